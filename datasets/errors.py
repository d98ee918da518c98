"""The one error type the data commands raise for bad input, and how its messages list names."""


class DataError(Exception):
    """Bad input: says what is wrong, where, and how to fix it."""

    def __init__(self, what: str, where: str | None = None, fix: str | None = None) -> None:
        self.what, self.where, self.fix = what, where, fix
        parts = [f"{where}: {what}" if where else what]
        if fix:
            parts.append(f"fix: {fix}")
        super().__init__("\n".join(parts))


def listed(names: set[str] | list[str], shown: int = 5) -> str:
    """The first `shown` of `names`, sorted, and how many more there are."""
    names = sorted(names)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def count(n: int, noun: str, plural: str = "") -> str:
    """`n` and `noun`, plural unless `n` is 1: "1 image", "2 images"."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def are(n: int) -> str:
    """The verb that agrees with a count of `n`."""
    return "is" if n == 1 else "are"
