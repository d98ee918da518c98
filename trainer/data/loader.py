"""Train and eval batches from our shards, read at the offsets their index files give (random access).

Random access, rather than streaming each tar, lets every epoch be a full shuffle of all samples split over the
data-parallel ranks (plan.py), and lets a resumed run start at the exact batch it stopped at without re-reading
what came before. Batches are (images, labels, rows): images normalised float32, rows the samples' indices in the
split. Items are (epoch, row, draw): the draw keys the sample's random numbers (a repeat of a sample has its own).
"""

import contextlib
import io
import shlex
import tarfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset

from vitctl.datasets import manifest as mf
from vitctl.datasets.errors import DataError
from vitctl.datasets.images import PIL_ERRORS
from vitctl.datasets.index import index_path
from vitctl.datasets.manifest import repair_advice

from .augment import Recipe, TimmTransforms
from .draws import draw_for_size, stack_draws
from .gpu_augment import model_input
from .images import decode_jpegs, decode_pil, eval_view_pil, sample_rng, train_view_pil, views_gpu
from .plan import EpochPlan, eval_rows
from .shards import SampleTable
from .workers import leave_stop_signals_to_the_rank, stop_signals_blocked

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class LoaderSpec:
    recipe: Recipe
    seed: int
    workers: int
    device: torch.device
    branch: str  # config.LOADER_BRANCHES: where decode, crop and the recipe run (DataConfig.decode)


def _cut_short(shard: Path, offset: int, size: int) -> DataError:
    """A shard truncated since the run started (its sample lies past the end): not an index of another shard."""
    return DataError(f"cut short since the run started: the file is {shard.stat().st_size} bytes, and the sample at "
                     f"offset {offset} needs {offset + size}", str(shard),
                     f"{repair_advice(shard.parent)}; then --resume")


def _damaged(shard: Path) -> bool:
    """Whether the shard's bytes differ from the sha256 its folder's manifest records (False where none is recorded:
    read once, on the way to an error)."""
    try:
        recorded = {e["name"]: e["sha256"] for _, e in mf.all_shards(mf.load(shard.parent) or {"splits": {}})}
    except DataError:  # a manifest damaged too: its own check names it
        return False
    return shard.name in recorded and mf.file_sha256(shard) != recorded[shard.name]


class ShardReader:
    """Reads a sample's JPEG bytes; files are opened lazily, once per process that reads."""

    def __init__(self, table: SampleTable) -> None:
        self.table = table
        self.files: dict[int, object] = {}

    def read(self, row: int) -> bytes:
        shard, offset, size = int(self.table.shard[row]), int(self.table.offset[row]), int(self.table.size[row])
        path = Path(self.table.paths[shard])
        f = self.files.get(shard)
        if f is None:
            try:
                f = self.files[shard] = open(path, "rb")  # noqa: SIM115  (kept open for reuse)
            except FileNotFoundError:
                raise DataError("the shard is gone: it was there when the run started", str(path),
                                f"{repair_advice(path.parent)}; then --resume") from None
        f.seek(offset)
        data = f.read(size)
        if len(data) < size:
            raise _cut_short(path, offset, size)
        return data

    @contextlib.contextmanager
    def decoding(self, row: int) -> Iterator[None]:
        """A PIL error inside becomes a DataError that names the sample's shard and offset: a worker's error reaches
        the user as its last line, and PIL's names no file."""
        try:
            yield
        except PIL_ERRORS as error:
            shard = Path(self.table.paths[int(self.table.shard[row])])
            self._check_member_at(row, shard)
            reason = "not in any format Pillow reads" if isinstance(error, UnidentifiedImageError) else str(error)
            raise DataError(f"the JPEG at offset {int(self.table.offset[row])} does not decode ({reason})", str(shard),
                            f"`vitctl data verify {shlex.quote(str(shard.parent))}` names each damaged shard and the "
                            f"command that writes it again (add --decode 100000000 to decode every image too)"
                            ) from error

    def _check_member_at(self, row: int, shard: Path) -> None:
        """Raises a DataError naming the index when no tar member of the indexed size starts at the row's offset:
        an index swapped for another shard's of the same sample count reads other bytes, not a damaged JPEG."""
        offset, size = int(self.table.offset[row]), int(self.table.size[row])
        if shard.stat().st_size < offset + size:
            raise _cut_short(shard, offset, size)
        with open(shard, "rb") as f:
            f.seek(max(offset - tarfile.BLOCKSIZE, 0))
            header = f.read(tarfile.BLOCKSIZE)
        try:
            member = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.HeaderError:
            member = None
        if offset >= tarfile.BLOCKSIZE and member is not None and member.size == size:
            return
        if member is None and _damaged(shard):  # no header at all there: the shard's bytes, or another's index
            raise DataError(f"damaged since it was sharded: its sha256 differs from the one manifest.json records, "
                            f"and no tar header precedes the sample at offset {offset}", str(shard),
                            f"{repair_advice(shard.parent)}; then --resume")
        index = index_path(shard)
        raise DataError(f"{index.name} does not describe this shard: no member of {size} bytes starts at offset "
                        f"{offset} (an index of another shard, or the shard was written again since)", str(shard),
                        f"`vitctl data index {shlex.quote(str(shard.parent))}` writes every index again from its shard")

    def name_damaged(self, rows: Iterable[int]) -> None:
        """Decodes each row's JPEG in full with Pillow, raising decoding's DataError at the first that fails: the GPU
        decoders' errors name no image of their batch."""
        for row in rows:
            with self.decoding(row), Image.open(io.BytesIO(self.read(row))) as image:
                image.load()

    def __getstate__(self) -> dict:
        return {"table": self.table, "files": {}}  # open files stay in the process that opened them


class ShardImages(Dataset):
    """Items are (epoch, row, draw); returns per branch a normalised float image, a uint8 crop or the JPEG's bytes,
    with the label, the item and, where the recipe runs in the main process, the sample's draws (None for eval)."""

    def __init__(self, table: SampleTable, spec: LoaderSpec, train: bool) -> None:
        self.reader, self.spec, self.train = ShardReader(table), spec, train
        recipe = spec.recipe
        timm = train and spec.branch == "pil" and not recipe.crop_and_flip_only
        self.transforms = TimmTransforms(recipe) if timm else None

    def __len__(self) -> int:
        return len(self.reader.table)

    def __getitem__(self, item: tuple[int, int, int]):
        epoch, row, draw = item
        data, label = self.reader.read(row), int(self.reader.table.label[row])
        with self.reader.decoding(row):
            return self._item(data, label, item)

    def _item(self, data: bytes, label: int, item: tuple[int, int, int]):
        epoch, _, draw = item
        recipe, branch = self.spec.recipe, self.spec.branch
        if branch == "pil":
            rng = sample_rng(self.spec.seed, epoch, draw)
            return decode_pil(data, recipe, self.train, rng, self.transforms), label, item, None
        if branch == "nvjpeg":  # the header is read here in eval too: the GPU decoder's errors name no file
            with Image.open(io.BytesIO(data)) as image:
                size = image.size
            draws = draw_for_size(size, recipe, sample_rng(self.spec.seed, epoch, draw)) if self.train else None
            return torch.frombuffer(bytearray(data), dtype=torch.uint8), label, item, draws
        if not self.train:
            return eval_view_pil(data, recipe), label, item, None
        with Image.open(io.BytesIO(data)) as image:  # opened once for its size, its draws and its view
            draws = draw_for_size(image.size, recipe, sample_rng(self.spec.seed, epoch, draw))
            view = train_view_pil(image, draws["anchor"], draws["shape"], draws["mirror"], recipe)
        return view, label, item, draws


def _collate(items: list) -> tuple:
    images, labels, keys, draws = zip(*items, strict=True)
    if images[0].ndim == 1:  # JPEG bytes: one buffer and the sizes, not a tensor each to share and pin
        images = (torch.cat(images), torch.tensor([len(data) for data in images]))
    else:
        images = torch.stack(images)
    return images, torch.tensor(labels), keys, None if draws[0] is None else stack_draws(list(draws))


class BatchPlan:
    """A DataLoader batch sampler over an EpochPlan's stream: never ends, one batch of (epoch, row) items at a time."""

    def __init__(self, plan: EpochPlan, epoch: int, sample: int) -> None:
        self.plan, self.epoch, self.sample = plan, epoch, sample

    def __iter__(self) -> Iterator[list[tuple[int, int, int]]]:
        for epoch, draws in self.plan.stream(self.epoch, self.sample):
            yield [(epoch, int(r), int(d)) for r, d in zip(self.plan.sample(draws), draws, strict=True)]


class TrainBatches:
    """A rank's training batches from a position on, epoch after epoch, through one set of loader workers."""

    def __init__(self, table: SampleTable, spec: LoaderSpec, plan: EpochPlan) -> None:
        self.dataset, self.spec, self.plan = ShardImages(table, spec, True), spec, plan

    def __call__(self, epoch: int, sample: int) -> Iterator[Batch]:
        yield from _run(self.dataset, BatchPlan(self.plan, epoch, sample), self.spec)


class EvalBatches:
    """A rank's share of the eval samples, in order, each exactly once over all ranks; a rank with fewer batches
    than the most loaded one pads with None so all run the same count."""

    def __init__(self, table: SampleTable, spec: LoaderSpec, batch: int, dp_rank: int, dp_size: int) -> None:
        self.dataset, self.spec, self.batch = ShardImages(table, spec, False), spec, batch
        self.rows = eval_rows(len(table), dp_rank, dp_size)
        self.batches = -(-len(eval_rows(len(table), 0, dp_size)) // batch)  # rank 0 has the largest share

    def __call__(self) -> Iterator[Batch | None]:
        rows = self.rows
        plan = [[(0, r, r) for r in rows[b * self.batch:(b + 1) * self.batch]] for b in range(self.batches)]
        real = [p for p in plan if p]
        yield from _run(self.dataset, real, self.spec)
        for _ in range(len(plan) - len(real)):
            yield None  # this rank has no samples left, but collectives still need it


def _run(dataset: ShardImages, batches, spec: LoaderSpec) -> Iterator[Batch]:
    if batches == []:
        return
    # Its own generator: a DataLoader otherwise draws a seed from the global RNG whenever it starts, which would
    # shift the model's random stream (drop path) differently in a resumed run.
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=spec.workers, collate_fn=_collate,
                        pin_memory=spec.device.type == "cuda", generator=torch.Generator().manual_seed(spec.seed),
                        worker_init_fn=leave_stop_signals_to_the_rank)
    with stop_signals_blocked():  # the workers start here
        loaded = iter(loader)
    if spec.branch == "nvjpeg":
        loaded = _decoded_ahead(loaded, spec.device, dataset.reader)
    for images, labels, keys, draws in loaded:
        rows = torch.tensor(np.array([row for _, row, _ in keys]))
        yield _on_device(images, draws, spec), labels.to(spec.device, non_blocking=True), rows


def _decoded_ahead(loader: Iterable, device: torch.device, reader: ShardReader) -> Iterator[tuple]:
    """The loader's batches with their JPEGs decoded, the next batch's decode running in a thread while this one is
    used: decode_jpeg holds its caller until its batch is decoded."""

    def decoded(decoding, keys) -> list[torch.Tensor]:
        try:
            return decoding.result()
        except RuntimeError:
            reader.name_damaged(row for _, row, _ in keys)
            raise

    if device.type == "cuda" and device.index is None:  # a new thread starts on the first GPU, not this rank's
        device = torch.device("cuda", torch.cuda.current_device())
    with ThreadPoolExecutor(1, thread_name_prefix="vitctl-decode") as pool:
        ahead = None
        for (packed, sizes), *rest in loader:
            decoding = pool.submit(decode_jpegs, list(packed.split(sizes.tolist())), device)
            if ahead is not None:
                yield decoded(ahead[0], ahead[2]), *ahead[1:]
            ahead = (decoding, *rest)
        if ahead is not None:
            yield decoded(ahead[0], ahead[2]), *ahead[1:]


def _on_device(images, draws: dict[str, np.ndarray] | None, spec: LoaderSpec) -> torch.Tensor:
    """A collated batch as normalised images on the device: decoded and augmented there per the branch."""
    if spec.branch == "nvjpeg":
        return views_gpu(images, spec.recipe, spec.device, draws)
    images = images.to(spec.device, non_blocking=True)
    if spec.branch == "pil-crop":
        return model_input(images, draws, spec.recipe)
    return images
