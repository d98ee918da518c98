"""Benchmark entry points for the CLI."""

from vitctl.trainer.bench import BenchResult, bench_train
from vitctl.trainer.models import MODELS

MODEL_NAMES = list(MODELS)

__all__ = ["MODEL_NAMES", "BenchResult", "bench_train"]
