"""The training recipe after the crop: RandAugment, colour jitter, random erasing, normalisation.

The index loader runs timm's own transforms (the reference implementation) with Python's, numpy's and torch's global
generators seeded from the sample's generator around each sample, then restored, so a batch does not depend on the
worker or on what the process drew before. DALI draws the same distributions here, from the sample's generator
directly (draw_* below), and its pipeline applies the drawn ops (dali.py).
"""

import contextlib
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from ..config import RunConfig
from ..recipe import IMAGENET_MEAN, IMAGENET_STD, RandAugmentSpec, model_eval


@dataclass(frozen=True)
class Recipe:
    """What the loaders do to images, resolved from the config: the model family's defaults filled in."""

    size: int
    min_scale: float = 0.08
    hflip: bool = True
    interpolation: str = "bicubic"
    rand_augment: str | None = None
    color_jitter: float = 0.0
    reprob: float = 0.0
    remode: str = "pixel"
    recount: int = 1
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    eval_crop_pct: float = 0.875
    eval_crop_mode: str = "center"
    eval_interpolation: str = "bicubic"

    @property
    def crop_and_flip_only(self) -> bool:
        return self.rand_augment is None and self.color_jitter == 0 and self.reprob == 0

    @property
    def fill(self) -> tuple[int, int, int]:
        """RandAugment's fill for pixels a geometric op uncovers: the mean colour (timm's img_mean)."""
        return tuple(min(255, round(255 * m)) for m in self.mean)


def recipe_of(config: RunConfig) -> Recipe:
    """The config's augment, eval and normalisation keys, each unset one the model family's (recipe.MODEL_EVAL)."""
    a, e = config.augment, config.eval
    defaults = model_eval(config.model.name, config.model.img_size)
    return Recipe(config.model.img_size, a.min_crop_scale, a.hflip, a.interpolation, a.rand_augment, a.color_jitter,
                  a.reprob, a.remode, a.recount, config.data.mean or defaults.mean, config.data.std or defaults.std,
                  e.crop_pct or defaults.crop_pct, e.crop_mode or defaults.crop_mode,
                  e.interpolation or defaults.interpolation)


def normalize_pil(image: Image.Image, recipe: Recipe) -> torch.Tensor:
    """An RGB image -> (3, H, W) float32 normalised, as torchvision's ToTensor and Normalize."""
    pixels = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255
    return (pixels - torch.tensor(recipe.mean).view(3, 1, 1)) / torch.tensor(recipe.std).view(3, 1, 1)


@contextlib.contextmanager
def global_rngs_from(rng: np.random.Generator) -> Iterator[None]:
    """Seeds Python's, numpy's and torch's CPU generators from `rng` (timm's ops draw from them), and puts the
    caller's states back afterwards: the trainer's own streams (mixup, drop path) are untouched."""
    seed = int(rng.integers(2**63))
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.default_generator.manual_seed(seed)
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


class TimmTransforms:
    """timm's train transforms after the crop and flip (transforms_imagenet_train's second and third stages):
    RandAugment, colour jitter, ToTensor, Normalize, RandomErasing."""

    def __init__(self, recipe: Recipe) -> None:
        from timm.data.auto_augment import RandAugment
        from timm.data.transforms_factory import transforms_imagenet_train

        _, self.secondary, self.final = transforms_imagenet_train(
            recipe.size, hflip=0.0, color_jitter=recipe.color_jitter or None, force_color_jitter=True,
            auto_augment=recipe.rand_augment, interpolation=recipe.interpolation, mean=recipe.mean, std=recipe.std,
            re_prob=recipe.reprob, re_mode=recipe.remode, re_count=recipe.recount, separate=True)
        for transform in self.secondary.transforms:
            for op in transform.ops if isinstance(transform, RandAugment) else ():
                if op.name.startswith("Posterize"):
                    op.aug_fn = _posterize

    def __call__(self, image: Image.Image, rng: np.random.Generator) -> torch.Tensor:
        with global_rngs_from(rng):
            return self.final(self.secondary(image))


def _posterize(image: Image.Image, bits: int, **_) -> Image.Image:
    """timm's posterize as it ran on Pillow before 11: 0 bits kept (magnitude 10 of PosterizeIncreasing, 2% of
    rand-m9-mstd0.5's draws) blacks the image, where Pillow's ImageOps.posterize now raises a ValueError."""
    if bits >= 8:
        return image
    mask = (0xFF << (8 - max(bits, 0))) & 0xFF
    return image.point([i & mask for i in range(256)] * len(image.getbands()))


# ---------------------------------------------------------------- draws for DALI

# What the DALI pipeline does for each drawn RandAugment op (dali.RAND_KINDS implements them in this order).
KINDS = ("identity", "warp", "auto_contrast", "equalize", "invert", "posterize", "solarize", "solarize_add",
         "color", "contrast", "brightness", "sharpness")
_KIND = {"AutoContrast": "auto_contrast", "Equalize": "equalize", "Invert": "invert", "Rotate": "warp",
         "Posterize": "posterize", "Solarize": "solarize", "SolarizeAdd": "solarize_add", "Color": "color",
         "Contrast": "contrast", "Brightness": "brightness", "Sharpness": "sharpness", "ShearX": "warp",
         "ShearY": "warp", "TranslateXRel": "warp", "TranslateYRel": "warp"}
IDENTITY = np.array([[1, 0, 0], [0, 1, 0]], dtype=np.float32)


@dataclass(frozen=True)
class RandOp:
    name: str  # timm's op name
    kind: int  # index into KINDS
    param: float  # posterize: the bit mask; solarize: the threshold; solarize_add: the shift; enhance ops: factor
    matrix: np.ndarray  # warp: (2, 3) output -> input pixel coordinates, as PIL's Image.transform takes them


def _negated(rng: np.random.Generator, value: float) -> float:
    return -value if rng.random() > 0.5 else value


def _rotation(degrees: float, size: int) -> np.ndarray:
    """PIL's Image.rotate(degrees) about the centre, as the output -> input matrix it builds."""
    angle = -math.radians(degrees)
    cos, sin, centre = math.cos(angle), math.sin(angle), size / 2
    return np.array([[cos, sin, centre - cos * centre - sin * centre],
                     [-sin, cos, centre + sin * centre - cos * centre]], dtype=np.float32)


def _rand_op(name: str, level: float, rng: np.random.Generator, size: int) -> RandOp:
    """One op at magnitude `level` (0-10), its argument as timm's LEVEL_TO_ARG computes it."""
    base = name.removesuffix("Increasing")
    increasing, fraction, param, matrix = name.endswith("Increasing"), level / 10, 0.0, IDENTITY
    if base == "Rotate":
        matrix = _rotation(_negated(rng, fraction * 30), size)
    elif base in ("ShearX", "ShearY"):
        shear = _negated(rng, fraction * 0.3)
        matrix = np.array([[1, shear, 0], [0, 1, 0]] if base == "ShearX" else [[1, 0, 0], [shear, 1, 0]],
                          dtype=np.float32)
    elif base in ("TranslateXRel", "TranslateYRel"):
        pixels = _negated(rng, fraction * 0.45) * size
        matrix = np.array([[1, 0, pixels], [0, 1, 0]] if base == "TranslateXRel" else [[1, 0, 0], [0, 1, pixels]],
                          dtype=np.float32)
    elif base == "Posterize":
        bits = 4 - int(fraction * 4) if increasing else int(fraction * 4)
        param = (0xFF << (8 - min(max(bits, 0), 8))) & 0xFF  # a mask of the `bits` high bits kept
    elif base == "Solarize":
        threshold = min(256, int(fraction * 256))
        param = 256 - threshold if increasing else threshold
    elif base == "SolarizeAdd":
        param = min(128, int(fraction * 110))
    elif base in ("Color", "Contrast", "Brightness", "Sharpness"):
        param = max(0.1, 1.0 + _negated(rng, fraction * 0.9)) if increasing else fraction * 1.8 + 0.1
    return RandOp(name, KINDS.index(_KIND[base]), float(param), matrix)


def draw_rand_augment(rng: np.random.Generator, spec: RandAugmentSpec, size: int) -> list[RandOp | None]:
    """timm's RandAugment for one image: `layers` ops drawn uniformly with replacement, each applied with `prob`
    (None: skipped) at a magnitude drawn around `magnitude` and clipped to [0, magnitude_max]."""
    ops = []
    for index in rng.integers(0, len(spec.ops), size=spec.layers):
        if spec.prob < 1 and rng.random() > spec.prob:
            ops.append(None)
            continue
        level = spec.magnitude
        if spec.magnitude_std == math.inf:
            level = rng.uniform(0, level)
        elif spec.magnitude_std > 0:
            level = rng.normal(level, spec.magnitude_std)
        ops.append(_rand_op(spec.ops[index], min(max(level, 0.0), spec.magnitude_max), rng, size))
    return ops


def draw_color_jitter(rng: np.random.Generator, strength: float) -> np.ndarray:
    """Brightness, contrast and saturation factors, each uniform in [max(0, 1 - s), 1 + s] (torchvision's)."""
    return rng.uniform(max(0.0, 1 - strength), 1 + strength, size=3).astype(np.float32)


@dataclass(frozen=True)
class Erasure:
    boxes: list[tuple[int, int, int, int]]  # (top, left, h, w), in the order they were drawn
    seeds: list[int]  # each box's fill is noise hashed from this seed (gpu_augment.erase)


def draw_erasing(rng: np.random.Generator, prob: float, max_count: int, size: int) -> Erasure:
    """timm's RandomErasing on a (3, size, size) image: with `prob`, 1 to max_count boxes of 2% to 1/3 of the area
    (split between them), aspect in [0.3, 1/0.3], up to 10 tries each."""
    boxes, seeds = [], []
    if rng.random() > prob:
        return Erasure(boxes, seeds)
    count = 1 if max_count == 1 else int(rng.integers(1, max_count + 1))
    for _ in range(count):
        for _attempt in range(10):
            target = rng.uniform(0.02, 1 / 3) * size * size / count
            aspect = math.exp(rng.uniform(math.log(0.3), math.log(1 / 0.3)))
            h, w = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if w < size and h < size:
                boxes.append((int(rng.integers(0, size - h + 1)), int(rng.integers(0, size - w + 1)), h, w))
                seeds.append(int(rng.integers(2**63)))
                break
    return Erasure(boxes, seeds)
