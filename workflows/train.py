"""Turn CLI choices into a validated run config and run it locally; the benchmark entry point."""

from pathlib import Path
from typing import Any

import torch

from vitctl.trainer import checkpoint
from vitctl.trainer.config import ConfigError, RunConfig, load_config
from vitctl.trainer.metrics import read_metrics

from .job import TrainJob
from .local import LaunchError, launch_local

__all__ = ["ConfigError", "LaunchError", "RunConfig", "build_config", "checkpoint", "read_metrics", "run_local",
           "visible_gpus"]


def build_config(preset: str | None, flags: dict[str, Any], overrides: list[str]) -> RunConfig:
    """Preset < flags (e.g. {"data": {"path": ...}}) < `--set` overrides, validated; paths checked up front."""
    config = load_config(preset, overrides, flags)
    if config.data.source != "synthetic" and not Path(config.data.path).is_dir():
        raise ConfigError(f"data.path {config.data.path} is not a folder; prepare one with `vitctl data shard`")
    if config.finetune.from_ckpt and not Path(config.finetune.from_ckpt).is_file():
        raise ConfigError(f"--from-ckpt {config.finetune.from_ckpt}: no such file")
    return config


def visible_gpus() -> int:
    return torch.cuda.device_count()


def ranks_for(gpus: int, tasks_per_node: int) -> int:
    if gpus:
        available = torch.cuda.device_count()
        if gpus > available:
            raise ConfigError(f"--gpus {gpus} but this machine has {available} CUDA devices; use --gpus 0 for CPU")
        return gpus
    return tasks_per_node


def run_local(config: RunConfig, gpus: int, tasks_per_node: int, resume: bool) -> dict[str, Any] | None:
    return launch_local(TrainJob(config.to_dict(), resume, use_cuda=gpus > 0), ranks_for(gpus, tasks_per_node))
