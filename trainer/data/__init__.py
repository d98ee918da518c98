"""Build a data-parallel rank's train and eval batches from the config: DALI, the index loader, or synthetic data.

The data layer knows only the rank's data-parallel coordinate and the group's size, never the global rank: the
ranks of a tensor- or pipeline-parallel group read the same batches.
"""

import importlib.util
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from vitctl.datasets import manifest as mf

from ..config import RunConfig
from .augment import recipe_of
from .loader import Batch, EvalBatches, LoaderSpec, TrainBatches
from .plan import EpochPlan
from .shards import SplitMissing, read_table, split_shards
from .synthetic import SyntheticBatches

log = logging.getLogger("vitctl.data")


@dataclass
class Data:
    source: str
    train: Callable[[int, int], Iterator[Batch]]  # (epoch, first sample) -> batches from there on, never ending
    plan: EpochPlan
    eval: Callable[[], Iterator[Batch | None]] | None
    num_classes: int | None  # from the manifest
    digest: str | None = None  # the train samples' identity (manifest.split_digest), which checkpoints record


def dali_installed() -> bool:
    return importlib.util.find_spec("nvidia.dali") is not None


def resolve_source(requested: str) -> str:
    """`auto` is DALI when it is installed (preflight refuses `dali` without it)."""
    if requested != "auto":
        return requested
    return "dali" if dali_installed() else "webdataset"


def build_data(config: RunConfig, dp_rank: int, dp_size: int, device: torch.device) -> Data:
    c, batch, seed = config.data, config.data.batch_size, config.train.seed
    if c.source == "synthetic":
        plan = EpochPlan(c.train_samples, batch, dp_rank, dp_size, seed)
        train = SyntheticBatches(batch, config.model.img_size, config.model.num_classes, device, seed + dp_rank)
        return Data("synthetic", train, plan, None, None)
    folder = Path(c.path)
    shards, classes = split_shards(folder, "train")
    table = read_table(folder, shards)
    plan = EpochPlan(len(table), batch, dp_rank, dp_size, seed, repeats=config.augment.repeated_aug)
    source = resolve_source(c.source)
    if source == "webdataset" and c.source == "auto":
        log.info("data: nvidia-dali not installed, reading shards with the index loader")
    branch = c.decode if device.type == "cuda" else "pil"
    spec = LoaderSpec(recipe_of(config), seed, c.workers, device, branch)
    if source == "dali":
        from .dali import DaliTrainBatches

        train = DaliTrainBatches(table, spec, plan, threads=max(1, c.workers))
    else:
        train = TrainBatches(table, spec, plan)
    return Data(source, train, plan, _eval_batches(folder, spec, batch, dp_rank, dp_size), len(classes),
                mf.split_digest(classes, shards))


def _eval_batches(folder: Path, spec: LoaderSpec, batch: int, dp_rank: int, dp_size: int) -> EvalBatches | None:
    try:
        shards, _ = split_shards(folder, "val")
    except SplitMissing:
        log.warning("data: no val split in %s; skipping evaluation", folder)
        return None
    return EvalBatches(read_table(folder, shards), spec, batch, dp_rank, dp_size)
