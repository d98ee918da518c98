"""DALI training batches: our reader feeds encoded JPEGs to DALI's decoder (GPU decode with CUDA, CPU otherwise).

An external source reads each batch's bytes at the index offsets in the order plan.py gives (a global shuffle,
split by data-parallel rank) and draws each sample's crop and mirror from the same per-sample generator as the
index loader, so a batch depends only on (seed, epoch, sample): a resumed run starts at its exact batch without
replaying the epoch, and one pipeline serves the whole run (no rebuild at an epoch's start).
Evaluation uses the index loader (loader.py): exact, in order, padded so all ranks run the same count.
"""

import io
from collections.abc import Iterator

import numpy as np
import torch
from PIL import Image

from .images import MEAN, STD, sample_rng, train_view
from .loader import Batch, LoaderSpec, ShardReader
from .plan import EpochPlan
from .shards import SampleTable


class BatchSource:
    """DALI's external source: batch i of the stream that starts at (epoch, sample), computed from i alone, so that
    DALI's worker processes can build batches in parallel."""

    def __init__(self, table: SampleTable, plan: EpochPlan, spec: LoaderSpec, epoch: int, sample: int) -> None:
        self.reader, self.plan, self.spec, self.start = ShardReader(table), plan, spec, (epoch, sample)
        self.orders: dict[int, np.ndarray] = {}

    def __call__(self, info) -> tuple[list[np.ndarray], ...]:
        epoch, sample = self.plan.locate(*self.start, info.iteration)
        if epoch not in self.orders:
            self.orders = {epoch: self.plan.order(epoch)}  # the batches of a worker come in order of iteration
        rows = self.plan.rows(self.orders[epoch], sample)
        jpegs, anchors, shapes, mirrors = [], [], [], []
        for row in rows:
            data = self.reader.read(int(row))
            with Image.open(io.BytesIO(data)) as image:  # reads the header only
                width, height = image.size
            (left, top, w, h), flip = train_view(sample_rng(self.spec.seed, epoch, int(row)), width, height,
                                                 self.spec.min_scale, self.spec.hflip)
            jpegs.append(np.frombuffer(data, dtype=np.uint8))
            anchors.append(np.array([left, top], dtype=np.int32))
            shapes.append(np.array([w, h], dtype=np.int32))
            mirrors.append(np.array(flip, dtype=np.int32))
        labels = [np.array(self.reader.table.label[r], dtype=np.int64) for r in rows]
        return jpegs, anchors, shapes, mirrors, labels, [np.array(r, dtype=np.int64) for r in rows]


def _train_pipeline(source: BatchSource, batch: int, spec: LoaderSpec, threads: int):
    from nvidia.dali import fn, pipeline_def, types

    device_id = spec.device.index if spec.device.type == "cuda" else None
    workers = spec.workers

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=device_id, py_num_workers=max(1, workers),
                  py_start_method="spawn", prefetch_queue_depth=max(2, workers))
    def pipe():
        jpegs, anchors, shapes, mirrors, labels, rows = fn.external_source(
            source=source, num_outputs=6, batch=True, batch_info=True, parallel=workers > 0,
            dtype=[types.UINT8, types.INT32, types.INT32, types.INT32, types.INT64, types.INT64])
        images = fn.decoders.image_slice(jpegs, anchors, shapes, device="mixed" if device_id is not None else "cpu",
                                         output_type=types.RGB, normalized_anchor=False, normalized_shape=False)
        images = fn.resize(images, resize_x=spec.img_size, resize_y=spec.img_size)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=MEAN.tolist(),
                                          std=STD.tolist(), mirror=mirrors)
        return images, labels, rows

    return pipe()


class DaliTrainBatches:
    def __init__(self, table: SampleTable, spec: LoaderSpec, plan: EpochPlan, threads: int) -> None:
        self.table, self.spec, self.plan, self.threads = table, spec, plan, threads

    def __call__(self, epoch: int, sample: int) -> Iterator[Batch]:
        source = BatchSource(self.table, self.plan, self.spec, epoch, sample)
        pipe = _train_pipeline(source, self.plan.batch, self.spec, self.threads)
        pipe.build()
        while True:
            images, labels, rows = pipe.run()
            yield (_to_torch(images, self.spec.device), torch.from_numpy(np.array(labels.as_tensor())).to(
                self.spec.device), torch.from_numpy(np.array(rows.as_tensor())))


def _to_torch(images, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        from nvidia.dali.plugin.pytorch import feed_ndarray

        dense = images.as_tensor()
        out = torch.empty(dense.shape(), dtype=torch.float32, device=device)
        feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(device))
        return out
    return torch.from_numpy(np.array(images.as_tensor()))
