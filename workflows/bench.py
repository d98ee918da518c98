"""Benchmark entry points for the CLI."""

import torch

from vitctl.trainer.bench import BenchResult, bench_train
from vitctl.trainer.config import ConfigError, ModelConfig
from vitctl.trainer.models import model_error
from vitctl.trainer.ops import parse_fused, report


def check_request(model_name: str, img_size: int, fused: str) -> None:
    """ConfigError before the GPU is looked for: on one, an unknown op ended in a traceback, and a size the model
    cannot take after the GPU was set up."""
    problems = [model_error(ModelConfig(name=model_name, img_size=img_size))]
    try:
        parse_fused(fused)
    except ValueError as e:
        problems.append(str(e))
    if problems := [p for p in problems if p]:
        raise ConfigError("; ".join(problems))


def op_report() -> tuple[str, list[tuple[str, str, str | None]]]:
    """The device checked (CUDA when present) and each op implementation's availability on it."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return str(device), report(device)


__all__ = ["BenchResult", "ConfigError", "bench_train", "check_request", "op_report"]
