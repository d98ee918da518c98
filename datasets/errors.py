"""The one error type the data commands raise for bad input."""


class DataError(Exception):
    """Bad input: says what is wrong, where, and how to fix it."""

    def __init__(self, what: str, where: str | None = None, fix: str | None = None) -> None:
        self.what, self.where, self.fix = what, where, fix
        parts = [f"{where}: {what}" if where else what]
        if fix:
            parts.append(f"fix: {fix}")
        super().__init__("\n".join(parts))
