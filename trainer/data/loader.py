"""Train and eval batches from our shards, read at the offsets their index files give (random access).

Random access, rather than streaming each tar, gives every rank a full shuffle of its shards each epoch and
lets a resumed run start at the exact batch it stopped at without re-reading what came before.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .images import decode_gpu, decode_pil, normalize, sample_rng
from .shards import SampleTable

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LoaderSpec:
    img_size: int
    min_scale: float
    hflip: bool
    seed: int
    workers: int
    device: torch.device
    gpu_decode: bool  # nvjpeg in the main process instead of PIL in the workers


class ShardImages(Dataset):
    """Items are (epoch, row); returns decoded uint8 images, or the raw bytes when decoding on the GPU."""

    def __init__(self, table: SampleTable, spec: LoaderSpec, train: bool) -> None:
        self.table, self.spec, self.train = table, spec, train
        self.files: dict[int, object] = {}  # opened lazily in each worker process

    def __len__(self) -> int:
        return len(self.table)

    def read(self, row: int) -> bytes:
        shard = int(self.table.shard[row])
        f = self.files.get(shard)
        if f is None:
            f = self.files[shard] = open(self.table.paths[shard], "rb")  # noqa: SIM115  (kept open for reuse)
        f.seek(int(self.table.offset[row]))
        return f.read(int(self.table.size[row]))

    def __getitem__(self, item: tuple[int, int]):
        epoch, row = item
        data, label = self.read(row), int(self.table.label[row])
        if self.spec.gpu_decode:
            return torch.frombuffer(bytearray(data), dtype=torch.uint8), label, (epoch, row)
        rng = sample_rng(self.spec.seed, epoch, row)
        image = decode_pil(data, self.spec.img_size, self.train, rng, self.spec.min_scale, self.spec.hflip)
        return image, label, (epoch, row)


def _collate(items: list) -> tuple:
    images, labels, keys = zip(*items, strict=True)
    images = list(images) if images[0].ndim == 1 else torch.stack(images)
    return images, torch.tensor(labels), keys


class TrainBatches:
    """A rank's training batches: a seeded permutation of its samples per epoch, resumable at any batch."""

    def __init__(self, table: SampleTable, spec: LoaderSpec, batch: int, batches: int, rank: int) -> None:
        self.dataset, self.spec, self.batch, self.rank = ShardImages(table, spec, True), spec, batch, rank
        self.batches_per_epoch = batches

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.spec.seed, epoch, self.rank]).permutation(len(self.dataset))

    def __call__(self, epoch: int, start: int) -> Iterator[Batch]:
        order = self.order(epoch)
        plan = [[(epoch, int(r)) for r in order[b * self.batch:(b + 1) * self.batch]]
                for b in range(start, self.batches_per_epoch)]
        yield from _run(self.dataset, plan, self.spec, train=True)


class EvalBatches:
    """A rank's eval batches, in order; ranks with fewer samples pad with empty batches so all run the same count."""

    def __init__(self, table: SampleTable, spec: LoaderSpec, batch: int, batches: int) -> None:
        self.dataset, self.spec, self.batch, self.batches = ShardImages(table, spec, False), spec, batch, batches

    def __call__(self) -> Iterator[Batch]:
        rows = range(len(self.dataset))
        plan = [[(0, r) for r in rows[b * self.batch:(b + 1) * self.batch]] for b in range(self.batches)]
        real = [p for p in plan if p]
        yield from _run(self.dataset, real, self.spec, train=False)
        for _ in range(len(plan) - len(real)):
            yield None  # this rank has no samples left, but collectives still need it


def _run(dataset: ShardImages, plan: list[list[tuple[int, int]]], spec: LoaderSpec, train: bool) -> Iterator[Batch]:
    if not plan:
        return
    # Its own generator: a DataLoader otherwise draws a seed from the global RNG whenever an epoch starts,
    # which would shift the model's random stream (drop path) differently in a resumed run.
    loader = DataLoader(dataset, batch_sampler=plan, num_workers=spec.workers, collate_fn=_collate,
                        pin_memory=spec.device.type == "cuda", generator=torch.Generator().manual_seed(spec.seed))
    for images, labels, keys in loader:
        if spec.gpu_decode:
            rngs = [sample_rng(spec.seed, epoch, row) for epoch, row in keys]
            images = decode_gpu(list(images), spec.img_size, train, rngs, spec.min_scale, spec.hflip, spec.device)
        images = images.to(spec.device, non_blocking=True)
        yield normalize(images), labels.to(spec.device, non_blocking=True)
