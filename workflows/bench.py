"""Benchmark entry points for the CLI."""

import torch

from vitctl.trainer.bench import BenchResult, bench_train
from vitctl.trainer.config import COMPILE_MODES, PRECISIONS
from vitctl.trainer.models import MODELS
from vitctl.trainer.ops import report

MODEL_NAMES = list(MODELS)


def op_report() -> tuple[str, list[tuple[str, str, str | None]]]:
    """The device checked (CUDA when present) and each op implementation's availability on it."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return str(device), report(device)


__all__ = ["COMPILE_MODES", "MODEL_NAMES", "PRECISIONS", "BenchResult", "bench_train", "op_report"]
