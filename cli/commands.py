"""vitctl's commands: the module that defines each and its one-line summary, which `vitctl --help` lists without
importing the modules (most import torch, which takes seconds)."""

from typing import NamedTuple


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
}


def summary(name: str) -> str:
    return COMMANDS[name].summary
