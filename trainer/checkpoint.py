"""Checkpoints: atomic (temporary name, fsync, rename), the last K kept, everything needed to resume exactly."""

import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vitctl.datasets.atomic import partial_open, publish

FORMAT = "vitctl-checkpoint/1"
NAME = re.compile(r"step-(\d{8})\.pt")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a partial one has a hidden temporary name)."""
    folder = checkpoint_dir(run_dir)
    return sorted(p for p in folder.iterdir() if NAME.fullmatch(p.name)) if folder.is_dir() else []


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
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": list(np.random.get_state())}
    state["numpy"][1] = torch.from_numpy(state["numpy"][1].copy())  # tensors keep the file weights_only-loadable
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    numpy_state = list(state["numpy"])
    numpy_state[1] = numpy_state[1].numpy()
    np.random.set_state(tuple(numpy_state))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the whole tensor (gathered first when it is an FSDP2 DTensor shard)."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full_tensor(v) for k, v in model.state_dict().items()}
