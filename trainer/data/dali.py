"""DALI training pipeline over our shards and index files: GPU decode when CUDA is present, CPU otherwise.

Evaluation always uses the index loader (loader.py): exact, in order, and padded so all ranks run the same count.
"""

from collections.abc import Iterator

import numpy as np
import torch

from .images import MEAN, STD
from .loader import LoaderSpec
from .shards import SampleTable

LABEL_BYTES = 8  # cls members are ASCII integers; padded to a fixed width so batches are dense


def _train_pipeline(paths: list[str], batch: int, spec: LoaderSpec, seed: int, threads: int):
    from nvidia.dali import fn, pipeline_def, types

    device_id = spec.device.index if spec.device.type == "cuda" else None
    decode_device = "mixed" if device_id is not None else "cpu"

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=device_id, seed=seed)
    def pipe():
        jpg, cls = fn.readers.webdataset(paths=paths, index_paths=[p.removesuffix(".tar") + ".idx" for p in paths],
                                         ext=["jpg", "cls"], missing_component_behavior="error",
                                         random_shuffle=True, initial_fill=4 * batch, name="reader")
        images = fn.decoders.image_random_crop(jpg, device=decode_device, output_type=types.RGB,
                                               random_area=[spec.min_scale, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
        images = fn.resize(images, resize_x=spec.img_size, resize_y=spec.img_size)
        mirror = fn.random.coin_flip() if spec.hflip else 0
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                          mean=MEAN.tolist(), std=STD.tolist(), mirror=mirror)
        return images, fn.pad(cls, fill_value=0, shape=[LABEL_BYTES])

    return pipe()


def _labels(padded: np.ndarray) -> torch.Tensor:
    digits = padded.astype(np.int64) - ord("0")
    valid = padded != 0
    places = np.cumsum(valid[:, ::-1], axis=1)[:, ::-1] - 1  # each digit's power of ten
    return torch.from_numpy(np.where(valid, digits * 10 ** np.maximum(places, 0), 0).sum(axis=1))


class DaliTrainBatches:
    """One pipeline per epoch, seeded by (seed, epoch), so a resumed epoch repeats its first batches exactly."""

    def __init__(self, table: SampleTable, batch: int, batches: int, spec: LoaderSpec, rank: int,
                 threads: int) -> None:
        self.paths, self.batch, self.batches_per_epoch = table.paths, batch, batches
        self.spec, self.rank, self.threads = spec, rank, threads

    def __call__(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        seed = int(np.random.default_rng([self.spec.seed, epoch, self.rank]).integers(2**31))
        pipe = _train_pipeline(self.paths, self.batch, self.spec, seed, self.threads)
        pipe.build()
        for step in range(self.batches_per_epoch):
            images, labels = pipe.run()
            if step >= start:  # a resumed epoch replays (reads, decodes, drops) the batches done before
                yield _to_torch(images, self.spec.device), _labels(np.array(labels.as_tensor())).to(self.spec.device)


def _to_torch(images, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        from nvidia.dali.plugin.pytorch import feed_ndarray

        dense = images.as_tensor()
        out = torch.empty(dense.shape(), dtype=torch.float32, device=device)
        feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(device))
        return out
    return torch.from_numpy(np.array(images.as_tensor()))
