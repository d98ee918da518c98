"""Slurm's time formats, as sbatch --time takes them and squeue prints them."""

import re

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
