"""Checkpoints: atomic (temporary name, fsync, rename), the last K kept, everything needed to resume exactly."""

import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vitctl.datasets.atomic import partial_open, publish

FORMAT = "vitctl-checkpoint/1"
NAME = re.compile(r"step-(\d{8})\.pt")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a partial one has a hidden temporary name)."""
    folder = checkpoint_dir(run_dir)
    return sorted(p for p in folder.iterdir() if NAME.fullmatch(p.name)) if folder.is_dir() else []


def checkpoints_to_resume(run_dir: Path, resume: bool) -> list[Path]:
    """The run folder's checkpoints; refuses to start afresh over them (that would mix two runs)."""
    from .config import ConfigError

    found = list_checkpoints(run_dir)
    if found and not resume:
        raise ConfigError(f"{run_dir} already holds checkpoints (last: {found[-1].name}); pass --resume to "
                          "continue that run, or choose another --out")
    return found


def save(run_dir: Path, step: int, payload: dict[str, Any], keep: int) -> Path:
    path = checkpoint_dir(run_dir) / f"step-{step:08d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    with partial_open(path) as f:
        torch.save(payload, f)
    publish(path)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink()
    return path


def load(path: Path) -> dict[str, Any]:
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a vitctl checkpoint")
    return payload


def rng_state() -> dict[str, Any]:
    """This process's random streams as plain bytes and numbers (safe to gather across ranks and to load)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state().numpy().tobytes(), "python": random.getstate(),
             "numpy": (kind, keys.tobytes(), pos, has_gauss, gauss)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return state


def _byte_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(_byte_tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_byte_tensor(state["cuda"]))
