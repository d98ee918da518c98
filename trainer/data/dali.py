"""DALI training batches: our reader feeds encoded JPEGs to DALI's decoder (GPU decode with CUDA, CPU otherwise).

An external source reads each batch's bytes at the index offsets in the order plan.py gives (a global shuffle,
split by data-parallel rank) and draws all of each sample's randomness from the same per-sample generator as the
index loader: the crop and mirror (train_view, identical to the index loader's), and, from augment.py's draws with
timm's distributions, the RandAugment ops with their arguments, the colour-jitter factors, and the erased boxes with
their fills' seeds. The pipeline applies the crop, RandAugment and colour jitter with DALI's operators and no DALI
random operator; the boxes are erased on the output batch by augment.erase (in torch, on its device: in the pipeline,
the per-sample noise patches cost more than the rest of the recipe together). So a batch depends only on (seed, epoch,
draw): a resumed run starts at its exact batch (bit for bit, tested on the CPU) without
replaying the epoch, and one pipeline serves the whole run (no rebuild at an epoch's start).

Pipeline: decode the crop (image_slice) -> resize (bicubic per augment.interpolation) -> flip -> RandAugment (one
`select` per layer over the op kinds, DALI conditionals) -> colour jitter -> normalise to CHW float (the model's
mean and std); then augment.erase. It differs from timm's PIL ops in: rotate, shear and
translate interpolate bilinearly (warp_affine has no bicubic), equalize follows OpenCV's formula, sharpness filters
the 1-pixel border too, contrast uses the unrounded grey mean; colour jitter applies brightness, contrast and
saturation in that order rather than torchvision's random order (they commute but for the clipping between them).
Evaluation uses the index loader (loader.py): exact, in order, padded so all ranks run the same count.
"""

import io
from collections.abc import Iterator

import numpy as np
import torch
from PIL import Image

from ..recipe import parse_rand_augment
from .augment import KINDS, Recipe, draw_color_jitter, draw_erasing, draw_rand_augment, erase
from .images import sample_rng, train_view
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


def _on(images, node):
    """An external-source input where arithmetic with the images needs it: on their device."""
    return node.gpu() if images.device == "gpu" else node


def _rand_kinds(fill: tuple[int, int, int]) -> list:
    """The DALI implementation of each of augment.KINDS, as (images, param, matrix) -> images (uint8 HWC)."""
    from nvidia.dali import fn, types
    from nvidia.dali.auto_aug import augmentations as aa

    smooth = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], dtype=np.float32) / 13  # PIL's ImageFilter.SMOOTH
    centre = np.array([[0, 0, 0], [0, 1, 0], [0, 0, 0]], dtype=np.float32)

    def warp(images, param, matrix):  # around the fill colour: warp_affine fills one value, timm a colour
        colour = types.Constant(np.array(fill, dtype=np.float32))
        shifted = fn.warp_affine(images - colour, matrix=matrix, fill_value=0, interp_type=types.INTERP_LINEAR)
        return fn.cast(shifted + colour, dtype=types.UINT8)

    def sharpness(images, param, matrix):  # PIL: blend with the smoothed image by the factor
        kernel = (1 - param) * types.Constant(smooth) + param * types.Constant(centre)
        return fn.filter(images, _on(images, kernel))

    implementations = {
        "identity": lambda images, param, matrix: images,
        "warp": warp,
        "auto_contrast": lambda images, param, matrix: aa.auto_contrast.op(images, None),
        "equalize": lambda images, param, matrix: fn.equalize(images),
        "invert": lambda images, param, matrix: aa.invert.op(images, None),
        "posterize": lambda images, param, matrix: images & _on(images, fn.cast(param, dtype=types.UINT8)),
        "solarize": lambda images, param, matrix: aa.solarize.op(images, _on(images, param)),
        "solarize_add": lambda images, param, matrix: aa.solarize_add.op(
            images, _on(images, fn.cast(param, dtype=types.UINT8))),
        "color": lambda images, param, matrix: fn.saturation(images, saturation=param),
        "contrast": lambda images, param, matrix: aa.contrast.op(images, _on(images, param)),
        "brightness": lambda images, param, matrix: fn.brightness(images, brightness=param),
        "sharpness": sharpness,
    }
    return [implementations[kind] for kind in KINDS]


def _device_id(device: torch.device) -> int | None:
    """DALI's GPU for `device`, None for the CPU (`cuda` without an index is the current GPU)."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def _train_pipeline(source: BatchSource, batch: int, spec: LoaderSpec, threads: int):
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.auto_aug import augmentations as aa
    from nvidia.dali.auto_aug.core import select

    recipe, device_id, workers = spec.recipe, _device_id(spec.device), spec.workers
    fields = _fields(recipe)
    interp = {"bilinear": types.INTERP_LINEAR, "bicubic": types.INTERP_CUBIC}[recipe.interpolation]
    layers = parse_rand_augment(recipe.rand_augment).layers if recipe.rand_augment else 0
    kinds = _rand_kinds(recipe.fill) if layers else []

    @pipeline_def(batch_size=batch, num_threads=threads, device_id=device_id, py_num_workers=max(1, workers),
                  py_start_method="spawn", prefetch_queue_depth=max(2, workers), enable_conditionals=layers > 0)
    def pipe():
        outputs = fn.external_source(
            source=source, num_outputs=len(fields), batch=True, batch_info=True, parallel=workers > 0,
            dtype=[getattr(types, kind) for _, kind, _ in fields], layout=[layout for _, _, layout in fields])
        inputs = {name: outputs[i] for i, (name, _, _) in enumerate(fields)}  # (autograph's zip takes no strict=)
        images = fn.decoders.image_slice(inputs["jpeg"], inputs["anchor"], inputs["shape"],
                                         device="mixed" if device_id is not None else "cpu", output_type=types.RGB,
                                         normalized_anchor=False, normalized_shape=False)
        images = fn.resize(images, resize_x=recipe.size, resize_y=recipe.size, interp_type=interp)
        images = fn.flip(images, horizontal=inputs["mirror"])
        for layer in range(layers):
            images = select(kinds, inputs["ra_kind"][layer], images, inputs["ra_param"][layer],
                            inputs["ra_matrix"][layer])
        if recipe.color_jitter:
            jitter = inputs["jitter"]
            images = fn.brightness(images, brightness=jitter[0])
            images = aa.contrast.op(images, _on(images, jitter[1]))
            images = fn.saturation(images, saturation=jitter[2])
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                          mean=[255 * m for m in recipe.mean], std=[255 * s for s in recipe.std])
        erasing = [inputs["erase_box"], inputs["erase_seed"]] if recipe.reprob else []
        return images, inputs["label"], inputs["row"], *erasing

    return pipe()


class DaliTrainBatches:
    def __init__(self, table: SampleTable, spec: LoaderSpec, plan: EpochPlan, threads: int) -> None:
        self.table, self.spec, self.plan, self.threads = table, spec, plan, threads

    def __call__(self, epoch: int, sample: int) -> Iterator[Batch]:
        source = BatchSource(self.table, self.plan, self.spec, epoch, sample)
        pipe = _train_pipeline(source, self.plan.batch, self.spec, self.threads)
        pipe.build()
        recipe, device = self.spec.recipe, self.spec.device
        while True:
            images, labels, rows, *erasing = pipe.run()
            images = _to_torch(images, device)
            if erasing:
                erase(images, *(np.array(out.as_tensor()) for out in erasing), recipe.remode)
            yield images, torch.from_numpy(np.array(labels.as_tensor())).to(device), torch.from_numpy(
                np.array(rows.as_tensor()))


def _to_torch(images, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        from nvidia.dali.plugin.pytorch import feed_ndarray

        dense = images.as_tensor()
        out = torch.empty(dense.shape(), dtype=torch.float32, device=device)
        feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream(device))
        return out
    return torch.from_numpy(np.array(images.as_tensor()))
