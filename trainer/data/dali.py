"""DALI training batches: our reader feeds encoded JPEGs to DALI's decoder (GPU decode with CUDA, CPU otherwise).

An external source reads each batch's bytes at the index offsets in the order plan.py gives (a global shuffle,
split by data-parallel rank) and draws all of each sample's randomness as the index loader's GPU branches do
(draws.py: the crop and mirror, RandAugment's ops, the jitter factors, the erased boxes and their fills' seeds). No
DALI random operator runs, so a batch depends only on (seed, epoch, draw): a resumed run starts at its exact batch
(bit for bit, tested on the CPU) without replaying the epoch, and one pipeline serves the whole run (no rebuild at an
epoch's start).

DALI decodes the crop (image_slice), resizes it (bicubic per augment.interpolation), and flips it as it writes the batch
channels first (crop_mirror_normalize, uint8, no normalisation: the layout torch computes on); the rest runs on the
batch's device (gpu_augment.augment_batch, Triton kernels on a GPU): RandAugment and colour jitter with PIL's
arithmetic, normalisation to the model's mean and std, random erasing. DALI's own RandAugment (one conditional
`select` per layer) and erasing (per-sample noise patches) delivered 1,743 img/s at Swin-B b128 on one H200 where its
decode, crop and flip alone deliver 3,205. Evaluation uses the index loader (loader.py): exact, in order, padded so all
ranks run the same count.
"""

import itertools
import multiprocessing
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from .augment import Recipe
from .draws import draw_fields, draw_sample
from .gpu_augment import augment_batch, to_device
from .images import sample_rng
from .loader import Batch, LoaderSpec, ShardReader
from .plan import EpochPlan
from .shards import SampleTable
from .workers import leave_stop_signals_to_the_rank, stop_signals_blocked

_PREFETCH = 2  # batches the pipeline decodes ahead of the one run() returns
_DALI_TYPES = {np.uint8: "UINT8", np.int32: "INT32", np.int64: "INT64", np.float32: "FLOAT"}


def _fields(recipe: Recipe) -> list[tuple[str, type]]:
    """The external source's outputs for this recipe: (name, numpy dtype)."""
    return [("jpeg", np.uint8), *draw_fields(recipe), ("label", np.int64), ("row", np.int64)]


CROP_INPUTS = ("jpeg", "anchor", "shape", "mirror")  # what the pipeline consumes; the rest passes through it


def _passed_through(recipe: Recipe) -> list[str]:
    return [name for name, _ in _fields(recipe) if name not in CROP_INPUTS]


class TableFile:
    """The sample table, saved once to a temporary file that DALI's spawned workers load instead of unpickling it.

    A spawned process reads what it is sent only after importing the parent's main module, and the parent's write
    waits while that payload exceeds the pipe's buffer (64 KiB): with the table pickled in (24 bytes a sample) each
    worker started only after the one before had imported torch (79 s for 14 workers at 4,000 samples, 16 cores)."""

    def __init__(self, table: SampleTable, path: str | None = None) -> None:
        self.table = table
        if path is None:
            fd, path = tempfile.mkstemp(prefix="vitctl-samples-", suffix=".npz")
            with os.fdopen(fd, "wb") as f:
                np.savez(f, paths=np.array(table.paths), shard=table.shard, offset=table.offset, size=table.size,
                         label=table.label)
            weakref.finalize(self, Path(path).unlink, missing_ok=True)  # where it was written, not in the workers
        self.path = path

    def __reduce__(self):
        return _load_table_file, (self.path,)


def _load_table_file(path: str) -> TableFile:
    with np.load(path) as f:
        table = SampleTable([str(p) for p in f["paths"]], f["shard"], f["offset"], f["size"], f["label"])
    return TableFile(table, path)


class BatchSource:
    """DALI's external source: batch i of the stream that starts at (epoch, sample), computed from i alone, so that
    DALI's worker processes can build batches in parallel."""

    def __init__(self, table: TableFile, plan: EpochPlan, spec: LoaderSpec, epoch: int, sample: int) -> None:
        self.table, self.plan, self.spec, self.start = table, plan, spec, (epoch, sample)
        self.reader = ShardReader(table.table)
        self.fields = [name for name, _ in _fields(spec.recipe)]
        self.orders: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict:
        return {**vars(self), "reader": None, "orders": {}}  # an epoch's order is as large as the table

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self.reader = ShardReader(self.table.table)
        if multiprocessing.parent_process() is not None:  # unpickled in one of DALI's worker processes
            _exit_with_parent()
            leave_stop_signals_to_the_rank()

    def draws(self, iteration: int) -> tuple[int, np.ndarray]:
        """Batch `iteration`'s epoch and draws (plan.py: a draw is a row or one of its repeats)."""
        epoch, sample = self.plan.locate(*self.start, iteration)
        if epoch not in self.orders:
            self.orders = {epoch: self.plan.order(epoch)}  # the batches of a worker come in order of iteration
        return epoch, self.plan.rows(self.orders[epoch], sample)

    def __call__(self, info) -> tuple[list[np.ndarray] | np.ndarray, ...]:
        epoch, draws = self.draws(info.iteration)
        samples = []
        for row, draw in zip(self.plan.sample(draws), draws, strict=True):
            data = self.reader.read(int(row))
            with self.reader.decoding(int(row)):
                inputs = draw_sample(data, self.spec.recipe, sample_rng(self.spec.seed, epoch, int(draw)))
            inputs["jpeg"] = np.frombuffer(data, dtype=np.uint8)
            inputs["label"] = np.array(self.reader.table.label[row], dtype=np.int64)
            inputs["row"] = np.array(row, dtype=np.int64)
            samples.append(inputs)
        # One array per field but the JPEGs' (the only ragged one): the training process unpacks 10 arrays a batch
        # from the workers' shared memory instead of 1,280 (the loader alone with Swin-B's recipe: 3,685 -> 8,093
        # img/s on one H200).
        return tuple([s[name] for s in samples] if name == "jpeg" else np.stack([s[name] for s in samples])
                     for name in self.fields)


def _exit_with_parent() -> None:
    """End this DALI worker once the rank that started it is gone: a rank killed outright (SIGKILL, the OOM killer)
    would otherwise leave its workers running as orphans, each holding its memory (680 MB on the CPU)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="vitctl-parent-watch", daemon=True).start()


def _device_id(device: torch.device) -> int | None:
    """DALI's GPU for `device`, None for the CPU (`cuda` without an index is the current GPU)."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _train_pipeline(source: BatchSource, batch: int, spec: LoaderSpec, threads: int):
    from nvidia.dali import fn, pipeline_def, types

    recipe, device_id, workers = spec.recipe, _device_id(spec.device), spec.workers
    fields = _fields(recipe)
    interp = {"bilinear": types.INTERP_LINEAR, "bicubic": types.INTERP_CUBIC}[recipe.interpolation]

    # Each batch is one worker's task: only as many workers work at once as the source has batches scheduled ahead
    # (its prefetch_queue_depth, default 1), whatever the pipeline's queue.
    @pipeline_def(batch_size=batch, num_threads=threads, device_id=device_id, py_num_workers=max(1, workers),
                  py_start_method="spawn", prefetch_queue_depth=_PREFETCH)
    def pipe():
        outputs = fn.external_source(
            source=source, num_outputs=len(fields), batch=True, batch_info=True, parallel=workers > 0,
            prefetch_queue_depth=workers or None, dtype=[getattr(types, _DALI_TYPES[dtype]) for _, dtype in fields])
        inputs = dict(zip((name for name, _ in fields), outputs, strict=True))
        images = fn.decoders.image_slice(inputs["jpeg"], inputs["anchor"], inputs["shape"],
                                         device="mixed" if device_id is not None else "cpu", output_type=types.RGB,
                                         normalized_anchor=False, normalized_shape=False)
        images = fn.resize(images, resize_x=recipe.size, resize_y=recipe.size, interp_type=interp)
        images = fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW", mirror=inputs["mirror"])
        return images, *(inputs[name] for name in _passed_through(recipe))

    return pipe()


class DaliTrainBatches:
    def __init__(self, table: SampleTable, spec: LoaderSpec, plan: EpochPlan, threads: int) -> None:
        self.table, self.spec, self.plan, self.threads = TableFile(table), spec, plan, threads

    def __call__(self, epoch: int, sample: int) -> Iterator[Batch]:
        source = BatchSource(self.table, self.plan, self.spec, epoch, sample)
        pipe = _train_pipeline(source, self.plan.batch, self.spec, self.threads)
        with stop_signals_blocked():  # the Python workers start here
            pipe.build()
        names = _passed_through(self.spec.recipe)
        for iteration in itertools.count():
            try:
                images, *outputs = pipe.run()
            except RuntimeError:
                # DALI names a failed sample by its place in a batch it decoded ahead, not which batch
                ahead = range(iteration, iteration + _PREFETCH + 1)
                source.reader.name_damaged(row for i in ahead for row in self.plan.sample(source.draws(i)[1]))
                raise
            drawn = {name: np.array(out.as_tensor()) for name, out in zip(names, outputs, strict=True)}
            images = _to_torch(images, self.spec.device)
            images = augment_batch(images, drawn, self.spec.recipe)
            yield images, to_device(drawn["label"], self.spec.device), torch.from_numpy(drawn["row"])


def _to_torch(images, device: torch.device) -> torch.Tensor:
    """DALI's uint8 (B, 3, H, W) batch as a torch tensor on `device` (copied on the GPU)."""
    if device.type == "cuda":
        from nvidia.dali.plugin.pytorch import feed_ndarray

        dense = images.as_tensor()
        out = torch.empty(dense.shape(), dtype=torch.uint8, device=device)
        feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(device))
        return out
    return torch.from_numpy(np.array(images.as_tensor()))
