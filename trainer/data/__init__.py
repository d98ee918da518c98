"""Build a rank's train and eval batches from the config: DALI, the index loader, or synthetic data."""

import importlib.util
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError, RunConfig
from ..distributed import DistEnv
from .loader import EvalBatches, LoaderSpec, TrainBatches
from .shards import batches_per_epoch, rank_shards, read_table, split_shards
from .synthetic import SyntheticBatches

log = logging.getLogger("vitctl.data")


@dataclass
class Data:
    source: str
    train: Callable[[int, int], Iterator]  # (epoch, first batch) -> batches
    batches_per_epoch: int
    eval: Callable[[], Iterator] | None
    num_classes: int | None  # from the manifest


def _source(requested: str) -> str:
    if requested != "auto":
        if requested == "dali" and importlib.util.find_spec("nvidia.dali") is None:
            raise ConfigError("data.source=dali but nvidia-dali is not installed (pip install 'vitctl[dali]')")
        return requested
    if importlib.util.find_spec("nvidia.dali") is not None:
        return "dali"
    log.info("data: nvidia-dali not installed, reading shards with the index loader")
    return "webdataset"


def build_data(config: RunConfig, env: DistEnv) -> Data:
    c, batch = config.data, config.data.batch_size
    if c.source == "synthetic":
        batches = c.train_samples // (batch * env.world_size)
        train = SyntheticBatches(batch, batches, config.model.img_size, config.model.num_classes, env.device,
                                 config.train.seed + env.rank)
        return Data("synthetic", train, batches, None, None)
    folder = Path(c.path)
    shards, classes = split_shards(folder, "train")
    batches = check_split(config, env.world_size)
    mine = read_table(folder, rank_shards(shards, env.rank, env.world_size))
    source = _source(c.source)
    spec = LoaderSpec(config.model.img_size, config.augment.min_crop_scale, config.augment.hflip, config.train.seed,
                      c.workers, env.device, gpu_decode=env.device.type == "cuda")
    if source == "dali":
        from .dali import DaliTrainBatches

        train = DaliTrainBatches(mine, batch, batches, spec, env.rank, max(1, c.workers))
    else:
        train = TrainBatches(mine, spec, batch, batches, env.rank)
    return Data(source, train, batches, _eval_batches(folder, spec, batch, env), len(classes))


def check_split(config: RunConfig, world_size: int) -> int:
    """Batches per epoch for `world_size` ranks; raises when some rank would get no shard or no whole batch."""
    folder, batch = Path(config.data.path), config.data.batch_size
    shards, _ = split_shards(folder, "train")
    if len(shards) < world_size:
        raise ConfigError(f"data.path {folder}: {len(shards)} train shards for {world_size} ranks; "
                          "reshard with a smaller --maxcount so each rank gets at least one")
    batches = batches_per_epoch(shards, world_size, batch)
    if batches == 0:
        smallest = min(sum(n for _, n in rank_shards(shards, r, world_size)) for r in range(world_size))
        raise ConfigError(f"data.batch_size {batch} is more than the {smallest} samples the smallest of "
                          f"{world_size} ranks reads; lower it or reshard")
    return batches


def _eval_batches(folder: Path, spec: LoaderSpec, batch: int, env: DistEnv) -> EvalBatches | None:
    try:
        shards, _ = split_shards(folder, "val")
    except ConfigError:
        log.warning("data: no complete val split in %s; skipping evaluation", folder)
        return None
    per_rank = [sum(n for _, n in rank_shards(shards, r, env.world_size)) for r in range(env.world_size)]
    batches = -(-max(per_rank) // batch)
    return EvalBatches(read_table(folder, rank_shards(shards, env.rank, env.world_size)), spec, batch, batches)

