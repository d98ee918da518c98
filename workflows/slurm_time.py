"""Slurm's time formats, as sbatch --time takes them and squeue prints them."""

import re

# vitctl asks Slurm for USR2 this long before a time limit, for every rank to checkpoint and requeue. Slurm may send
# it up to a minute earlier (the resolution of its events): half a minute earlier on average.
SIGNAL_DELAY_S = 90
SIGNAL_LEAD_S = SIGNAL_DELAY_S + 30

FORMAT = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def seconds(text: str) -> int | None:
    """MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS -> seconds; None for anything else (UNLIMITED, INVALID)."""
    match = FORMAT.fullmatch(text.strip())
    if not match:
        return None
    days, first, second, third = (int(g) if g else 0 for g in match.groups())
    if match.group(1):  # D-HH[:MM[:SS]]
        return days * 86400 + first * 3600 + second * 60 + third
    if match.group(4):  # HH:MM:SS
        return first * 3600 + second * 60 + third
    return first * 60 + second  # MM[:SS]


def limit_problem(text: str) -> str | None:
    """Why `text` cannot be vitctl's time limit (--time), or None where it can."""
    if text.strip().lower() in ("unlimited", "infinite"):
        return (f"{text!r} is no limit: vitctl needs one, to checkpoint before it and requeue; give the partition's "
                "longest (`sinfo -o '%P %l'` lists them), e.g. --time 7-00:00:00")
    limit = seconds(text)
    if limit is None:
        return f"{text!r} is not a Slurm time (e.g. 30, 4:00:00, 1-12:00:00)"
    if limit <= 0:
        return f"{text!r} is no time to train; give a positive limit, e.g. --time 4:00:00"
    return None
