"""A training sample's random choices as arrays, drawn in a loader worker from the sample's own generator.

The GPU paths (DALI, the index loader's pil-crop and nvjpeg branches) augment whole batches on the GPU, so each
sample's randomness is drawn beforehand, on the CPU, in the order the PIL path draws it: the crop and mirror
(train_view, on the size in the JPEG's header), then augment.py's RandAugment ops, colour-jitter factors and erased
boxes with their fills' seeds. A batch then depends only on (seed, epoch, draw), whichever worker drew it.
"""

import io

import numpy as np
from PIL import Image

from ..recipe import parse_rand_augment
from .augment import Recipe, draw_color_jitter, draw_erasing, draw_rand_augment
from .images import train_view


def draw_fields(recipe: Recipe) -> list[tuple[str, type]]:
    """The arrays draw_sample returns for this recipe, in order: (name, numpy dtype)."""
    fields = [("anchor", np.int32), ("shape", np.int32), ("mirror", np.int32)]
    if recipe.rand_augment:
        fields += [("ra_kind", np.int32), ("ra_param", np.float32), ("ra_matrix", np.float32)]
    if recipe.color_jitter:
        fields += [("jitter", np.float32)]
    if recipe.reprob:
        fields += [("erase_box", np.int32), ("erase_seed", np.int64)]
    return fields


def draw_sample(data: bytes, recipe: Recipe, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """draw_for_size on the size in the header of JPEG bytes `data`."""
    with Image.open(io.BytesIO(data)) as image:  # reads the header only
        return draw_for_size(image.size, recipe, rng)


def draw_for_size(size: tuple[int, int], recipe: Recipe, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Everything random about one training sample of an image of `size` (width, height): anchor (left, top) and
    shape (w, h) of its crop, mirror, and per the recipe ra_kind, ra_param, ra_matrix (one per layer), jitter,
    erase_box, erase_seed."""
    (left, top, w, h), flip = train_view(rng, *size, recipe.min_scale, recipe.hflip)
    out = {"anchor": np.array([left, top], dtype=np.int32), "shape": np.array([w, h], dtype=np.int32),
           "mirror": np.array(flip, dtype=np.int32)}
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


def stack_draws(samples: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """A batch's draws: each field stacked over its samples."""
    return {name: np.stack([s[name] for s in samples]) for name in samples[0]}
