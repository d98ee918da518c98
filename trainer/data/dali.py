"""DALI training batches: our reader feeds encoded JPEGs to DALI's decoder (GPU decode with CUDA, CPU otherwise).

An external source reads each batch's bytes at the index offsets in the order plan.py gives (a global shuffle,
split by data-parallel rank) and draws all of each sample's randomness from the same per-sample generator as the
index loader: the crop and mirror (train_view, identical to the index loader's), and, from augment.py's draws with
timm's distributions, the RandAugment ops with their arguments, the colour-jitter factors, and the erased boxes with
their fills' seeds. No DALI random operator runs, so a batch depends only on (seed, epoch, draw): a resumed run starts
at its exact batch (bit for bit, tested on the CPU) without replaying the epoch, and one pipeline serves the whole run
(no rebuild at an epoch's start).

DALI decodes the crop (image_slice), resizes it (bicubic per augment.interpolation) and flips it; the rest runs in
torch on the batch's device, batched by op kind: RandAugment and colour jitter (gpu_augment.py, PIL's arithmetic),
normalisation to the model's mean and std, random erasing (augment.erase). DALI's own RandAugment (one conditional
`select` per layer) and erasing (per-sample noise patches) delivered 1,743 img/s at Swin-B b128 on one H200 where its
decode, crop and flip alone deliver 3,205. Evaluation uses the index loader (loader.py): exact, in order, padded so
all ranks run the same count.
"""

import io
from collections.abc import Iterator

import numpy as np
import torch
from PIL import Image

from ..recipe import parse_rand_augment
from .augment import Recipe, draw_color_jitter, draw_erasing, draw_rand_augment, erase
from .gpu_augment import color_jitter, rand_augment
from .images import normalize, sample_rng, train_view
from .loader import Batch, LoaderSpec, ShardReader
from .plan import EpochPlan
from .shards import SampleTable


def _fields(recipe: Recipe) -> list[tuple[str, str, str]]:
    """The external source's outputs for this recipe: (name, DALI type name, layout)."""
    fields = [("jpeg", "UINT8", ""), ("anchor", "INT32", ""), ("shape", "INT32", ""), ("mirror", "INT32", ""),
              ("label", "INT64", ""), ("row", "INT64", "")]
    if recipe.rand_augment:
        fields += [("ra_kind", "INT32", ""), ("ra_param", "FLOAT", ""), ("ra_matrix", "FLOAT", "")]
    if recipe.color_jitter:
        fields += [("jitter", "FLOAT", "")]
    if recipe.reprob:
        fields += [("erase_box", "INT32", ""), ("erase_seed", "INT64", "")]
    return fields


CROP_INPUTS = ("jpeg", "anchor", "shape", "mirror")  # what the pipeline consumes; the rest passes through it


def _passed_through(recipe: Recipe) -> list[str]:
    return [name for name, _, _ in _fields(recipe) if name not in CROP_INPUTS]


def sample_inputs(data: bytes, recipe: Recipe, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One sample's external-source inputs but its label and row: everything random, drawn from its generator."""
    with Image.open(io.BytesIO(data)) as image:  # reads the header only
        width, height = image.size
    (left, top, w, h), flip = train_view(rng, width, height, recipe.min_scale, recipe.hflip)
    out = {"jpeg": np.frombuffer(data, dtype=np.uint8), "anchor": np.array([left, top], dtype=np.int32),
           "shape": np.array([w, h], dtype=np.int32), "mirror": np.array(flip, dtype=np.int32)}
    if recipe.rand_augment:
        ops = draw_rand_augment(rng, parse_rand_augment(recipe.rand_augment), recipe.size)
        out["ra_kind"] = np.array([op.kind if op else 0 for op in ops], dtype=np.int32)
        out["ra_param"] = np.array([op.param if op else 0 for op in ops], dtype=np.float32)
        out["ra_matrix"] = np.stack([op.matrix if op else np.eye(2, 3) for op in ops]).astype(np.float32)
    if recipe.color_jitter:
        out["jitter"] = draw_color_jitter(rng, recipe.color_jitter)
    if recipe.reprob:  # a fixed shape, recount boxes, those not drawn of height 0: a batch is one array
        erasure = draw_erasing(rng, recipe.reprob, recipe.recount, recipe.size)
        out["erase_box"] = np.zeros((recipe.recount, 4), dtype=np.int32)
        out["erase_seed"] = np.zeros(recipe.recount, dtype=np.int64)
        if erasure.boxes:
            out["erase_box"][:len(erasure.boxes)] = erasure.boxes
            out["erase_seed"][:len(erasure.seeds)] = erasure.seeds
    return out


class BatchSource:
    """DALI's external source: batch i of the stream that starts at (epoch, sample), computed from i alone, so that
    DALI's worker processes can build batches in parallel."""

    def __init__(self, table: SampleTable, plan: EpochPlan, spec: LoaderSpec, epoch: int, sample: int) -> None:
        self.reader, self.plan, self.spec, self.start = ShardReader(table), plan, spec, (epoch, sample)
        self.fields = [name for name, _, _ in _fields(spec.recipe)]
        self.orders: dict[int, np.ndarray] = {}

    def __call__(self, info) -> tuple[list[np.ndarray], ...]:
        epoch, sample = self.plan.locate(*self.start, info.iteration)
        if epoch not in self.orders:
            self.orders = {epoch: self.plan.order(epoch)}  # the batches of a worker come in order of iteration
        draws = self.plan.rows(self.orders[epoch], sample)
        samples = []
        for row, draw in zip(self.plan.sample(draws), draws, strict=True):
            inputs = sample_inputs(self.reader.read(int(row)), self.spec.recipe,
                                   sample_rng(self.spec.seed, epoch, int(draw)))
            inputs["label"] = np.array(self.reader.table.label[row], dtype=np.int64)
            inputs["row"] = np.array(row, dtype=np.int64)
            samples.append(inputs)
        return tuple([s[name] for s in samples] for name in self.fields)


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

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=device_id, py_num_workers=max(1, workers),
                  py_start_method="spawn", prefetch_queue_depth=max(2, workers))
    def pipe():
        outputs = fn.external_source(
            source=source, num_outputs=len(fields), batch=True, batch_info=True, parallel=workers > 0,
            dtype=[getattr(types, kind) for _, kind, _ in fields], layout=[layout for _, _, layout in fields])
        inputs = {name: outputs[i] for i, (name, _, _) in enumerate(fields)}
        images = fn.decoders.image_slice(inputs["jpeg"], inputs["anchor"], inputs["shape"],
                                         device="mixed" if device_id is not None else "cpu", output_type=types.RGB,
                                         normalized_anchor=False, normalized_shape=False)
        images = fn.resize(images, resize_x=recipe.size, resize_y=recipe.size, interp_type=interp)
        images = fn.flip(images, horizontal=inputs["mirror"])
        return images, *(inputs[name] for name in _passed_through(recipe))

    return pipe()


class DaliTrainBatches:
    def __init__(self, table: SampleTable, spec: LoaderSpec, plan: EpochPlan, threads: int) -> None:
        self.table, self.spec, self.plan, self.threads = table, spec, plan, threads

    def __call__(self, epoch: int, sample: int) -> Iterator[Batch]:
        source = BatchSource(self.table, self.plan, self.spec, epoch, sample)
        pipe = _train_pipeline(source, self.plan.batch, self.spec, self.threads)
        pipe.build()
        names = _passed_through(self.spec.recipe)
        while True:
            images, *outputs = pipe.run()
            drawn = {name: np.array(out.as_tensor()) for name, out in zip(names, outputs, strict=True)}
            images = augment_batch(_to_torch(images, self.spec.device), drawn, self.spec.recipe)
            yield images, torch.from_numpy(drawn["label"]).to(self.spec.device), torch.from_numpy(drawn["row"])


def augment_batch(images: torch.Tensor, drawn: dict[str, np.ndarray], recipe: Recipe) -> torch.Tensor:
    """Cropped uint8 (B, H, W, 3) -> the recipe's float32 (B, 3, H, W): RandAugment, colour jitter, normalisation and
    erasing with the drawn arguments, in torch on the images' device."""
    images = images.permute(0, 3, 1, 2)
    if recipe.rand_augment:
        images = rand_augment(images, torch.from_numpy(drawn["ra_kind"]), torch.from_numpy(drawn["ra_param"]),
                              torch.from_numpy(drawn["ra_matrix"]), recipe.fill, recipe.interpolation)
    if recipe.color_jitter:
        images = color_jitter(images, torch.from_numpy(drawn["jitter"]))
    images = normalize(images.contiguous(), recipe)
    if recipe.reprob:
        erase(images, drawn["erase_box"], drawn["erase_seed"], recipe.remode)
    return images


def _to_torch(images, device: torch.device) -> torch.Tensor:
    """DALI's uint8 (B, H, W, 3) batch as a torch tensor on `device` (copied on the GPU)."""
    if device.type == "cuda":
        from nvidia.dali.plugin.pytorch import feed_ndarray

        dense = images.as_tensor()
        out = torch.empty(dense.shape(), dtype=torch.uint8, device=device)
        feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(device))
        return out
    return torch.from_numpy(np.array(images.as_tensor()))
