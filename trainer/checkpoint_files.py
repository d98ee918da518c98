"""Where a run folder keeps its checkpoints, and which are complete: names alone, so that `vitctl status` needs no
torch (whose import takes seconds)."""

import re
from pathlib import Path

META = "meta.json"
NAME = re.compile(r"step-(\d{8})")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def is_checkpoint(path: Path) -> bool:
    return (path / META).is_file() and (path / ".metadata").is_file()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (one being written has a hidden temporary name)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if NAME.fullmatch(p.name) and is_checkpoint(p))
