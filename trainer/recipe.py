"""The training recipe's vocabulary, checked when a config loads: timm's RandAugment strings, interpolations, and each
model family's eval view and normalisation (as timm's pretrained configs give them)."""

import functools
import math
import re
from dataclasses import dataclass

INTERPOLATIONS = ("bilinear", "bicubic")
ERASE_MODES = ("const", "rand", "pixel")  # timm's RandomErasing: zeros, a normal colour per box, normal per pixel
CROP_MODES = ("center", "squash")  # timm's eval crop modes: centre square, or the whole image resized to a square

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# timm.data.auto_augment's op lists (_RAND_TRANSFORMS, _RAND_INCREASING_TRANSFORMS), in its order: `inc1` picks the
# variants whose strength grows with the magnitude.
RAND_OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd", "Color",
            "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
RAND_INCREASING_OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing",
                       "SolarizeAdd", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing",
                       "SharpnessIncreasing", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
RAND_GRAMMAR = "rand-m<int>-n<int>-p<float>-mstd<float>-mmax<int>-inc<0|1>, sections optional (rand-m9-mstd0.5-inc1)"


@dataclass(frozen=True)
class RandAugmentSpec:
    """A parsed RandAugment string; defaults as timm's rand_augment_transform."""

    magnitude: int = 10
    layers: int = 2  # ops drawn (with replacement) per image
    prob: float = 0.5  # each drawn op is applied with this probability
    magnitude_std: float = 0.0  # > 0: magnitude ~ N(magnitude, std) per op; inf: uniform in [0, magnitude]
    magnitude_max: int = 10  # the drawn magnitude is clipped to [0, magnitude_max]
    increasing: bool = False

    @property
    def ops(self) -> tuple[str, ...]:
        return RAND_INCREASING_OPS if self.increasing else RAND_OPS


_NUMBER = {"m": int, "n": int, "p": float, "mstd": float, "mmax": int, "inc": int}
_FIELD = {"m": "magnitude", "n": "layers", "p": "prob", "mstd": "magnitude_std", "mmax": "magnitude_max",
          "inc": "increasing"}


@functools.cache  # DALI's external source reads it for every sample
def parse_rand_augment(text: str) -> RandAugmentSpec:
    """timm's config-string grammar, strictly: an unknown or malformed section is a ValueError naming it."""
    first, *sections = text.split("-")
    if first != "rand":
        raise ValueError(f"{text!r} does not start with 'rand'")
    values = {}
    for section in sections:
        key, number = re.split(r"(?=\d)", section, maxsplit=1) if re.search(r"\d", section) else (section, "")
        if key.startswith("t"):
            raise ValueError(f"{text!r}: section {section!r} picks a weighted op set, which vitctl does not run")
        if key not in _NUMBER:
            raise ValueError(f"{text!r}: unknown section {section!r}")
        try:
            value = _NUMBER[key](number)
        except ValueError:
            kind = "an integer" if _NUMBER[key] is int else "a number"
            raise ValueError(f"{text!r}: section {section!r} needs {kind} after {key!r}") from None
        values[_FIELD[key]] = value
    if values.get("magnitude_std", 0) > 100:  # timm: mstd above 100 means uniform magnitudes
        values["magnitude_std"] = math.inf
    if "increasing" in values:
        values["increasing"] = bool(values["increasing"])
    spec = RandAugmentSpec(**values)
    if spec.layers < 1 or not 0 < spec.prob <= 1 or spec.magnitude_std < 0 or spec.magnitude_max < 1:
        raise ValueError(f"{text!r}: n must be at least 1, p in (0, 1], mstd not negative, mmax at least 1")
    return spec


@dataclass(frozen=True)
class EvalDefaults:
    crop_pct: float
    crop_mode: str
    interpolation: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


# timm.models.get_pretrained_cfg for each family's 224-px models (swin_*_patch4_window7_224, vit_*_patch16_224);
# their 384-px finetunes evaluate the whole centre square (crop_pct 1.0). A preset that follows another recipe (the
# official Swin and DeiT repositories crop 0.875) says so in its `eval` and `data` sections.
MODEL_EVAL = {
    "swin": EvalDefaults(0.9, "center", "bicubic", IMAGENET_MEAN, IMAGENET_STD),
    "vit": EvalDefaults(0.9, "center", "bicubic", (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}
FULL_CROP_SIZE = 384  # from this image size on, timm's defaults evaluate crop_pct 1.0


def model_eval(model_name: str, img_size: int) -> EvalDefaults:
    """The eval view and normalisation a model family gets when the config leaves them unset."""
    defaults = MODEL_EVAL[model_name.split("_")[0]]
    if img_size >= FULL_CROP_SIZE:
        return EvalDefaults(1.0, defaults.crop_mode, defaults.interpolation, defaults.mean, defaults.std)
    return defaults
