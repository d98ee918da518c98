"""vitctl's commands: the module that defines each and its one-line summary, which `vitctl --help` lists without
importing the modules; and the workflows those modules import only once a command runs (most import torch, which
takes seconds), so that each command's `--help` answers at once."""

import importlib
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any, NamedTuple

INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C


class Command(NamedTuple):
    module: str  # vitctl.cli.<module>
    summary: str
    function: str | None = None  # where not named as the command


COMMANDS = {
    "data": Command("data", "ImageNet-1k prep: synth, extract, valprep, shard, index, verify."),
    "config": Command("config", "Inspect run configs."),
    "train": Command("train", "Train a Swin or ViT, on this machine or on Slurm."),
    "finetune": Command("train", "Finetune from a checkpoint, an export or timm's weights."),
    "rank": Command("train", "Run one rank of a job started by srun or torchrun."),
    "export": Command("export", "Write a run's weights with timm's names (safetensors)."),
    "plan": Command("plan", "Search the fastest layerwise strategy that fits in memory."),
    "bench": Command("bench", "Benchmarks (GPU)."),
    "doctor": Command("bench", "Which op implementations can run here, and why not."),
    "image": Command("image", "The prebuilt container image (containers/)."),
    "status": Command("jobs", "State, progress, throughput and ETA of submitted jobs.", "status_command"),
    "jobs": Command("jobs", "The jobs this machine submitted (newest last)."),
    "logs": Command("jobs", "A task's log: its stdout and stderr, merged in time order."),
    "cancel": Command("jobs", "Cancel a job: its ranks checkpoint, then stop."),
    "forget": Command("jobs", "Drop ended jobs from the job list; their run folders stay."),
}


def summary(name: str) -> str:
    return COMMANDS[name].summary


def _exit_interrupted(signum: int, frame: object) -> None:
    sys.stderr.write("interrupted\n")
    sys.stderr.flush()
    os._exit(INTERRUPTED)


@contextmanager
def quiet_interrupt() -> Iterator[None]:
    """While modules load (torch takes seconds), Ctrl-C ends vitctl at once: a Ctrl-C inside a half-done import
    (torch's, numpy's) would leave it broken, and the interpreter's shutdown would print tracebacks."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:  # SIGINT is ignored, or whoever imports this module handles it
        yield
        return
    signal.signal(signal.SIGINT, _exit_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Deferred:
    """A module imported at the first use of one of its names (under `quiet_interrupt`), not when the command that
    uses it is defined."""

    def __init__(self, name: str) -> None:
        self._name, self._module = name, None

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._load(), attr)

    def _load(self) -> ModuleType:
        if self._module is None:
            with quiet_interrupt():
                self._module = importlib.import_module(self._name)
        return self._module
