"""Image decoding and augmentation: PIL on the CPU, nvjpeg (torchvision.io.decode_jpeg) on the GPU.

Each sample's randomness comes from a generator seeded by (seed, epoch, sample), so a batch is the same
whichever worker builds it and whether or not the run was resumed.
"""

import io
import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

MEAN = torch.tensor([0.485, 0.456, 0.406]) * 255
STD = torch.tensor([0.229, 0.224, 0.225]) * 255
EVAL_CROP = 0.875


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, index])


def crop_box(rng: np.random.Generator, width: int, height: int, min_scale: float) -> tuple[int, int, int, int]:
    """Random-resized-crop box (left, top, w, h): area in [min_scale, 1], aspect in [3/4, 4/3]."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(min_scale, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    side = min(width, height)  # fall back to a centre crop
    return (width - side) // 2, (height - side) // 2, side, side


def train_view(rng: np.random.Generator, width: int, height: int, min_scale: float,
               hflip: bool) -> tuple[tuple[int, int, int, int], bool]:
    """A training sample's crop box and whether to mirror it, drawn in this order by every loader."""
    box = crop_box(rng, width, height, min_scale)
    return box, hflip and rng.random() < 0.5


def center_box(width: int, height: int) -> tuple[int, int, int, int]:
    side = round(min(width, height) * EVAL_CROP)
    return (width - side) // 2, (height - side) // 2, side, side


def decode_pil(data: bytes, size: int, train: bool, rng: np.random.Generator, min_scale: float,
               hflip: bool) -> torch.Tensor:
    """JPEG bytes -> (3, size, size) uint8."""
    with Image.open(io.BytesIO(data)) as image:
        image.draft("RGB", (size, size))  # let libjpeg decode at a reduced scale when the image is large
        image = image.convert("RGB")
        (left, top, w, h), flip = train_view(rng, *image.size, min_scale, hflip) if train \
            else (center_box(*image.size), False)
        image = image.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
        if flip:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)


def decode_gpu(datas: list[torch.Tensor], size: int, train: bool, rngs: list[np.random.Generator],
               min_scale: float, hflip: bool, device: torch.device) -> torch.Tensor:
    """A batch of JPEG byte tensors -> (B, 3, size, size) uint8 on `device`, decoded by nvjpeg."""
    from torchvision.io import ImageReadMode, decode_jpeg

    images = decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)
    out = torch.empty(len(images), 3, size, size, dtype=torch.uint8, device=device)
    for i, (image, rng) in enumerate(zip(images, rngs, strict=True)):
        height, width = image.shape[1:]
        (left, top, w, h), flip = train_view(rng, width, height, min_scale, hflip) if train \
            else (center_box(width, height), False)
        crop = image[None, :, top:top + h, left:left + w].float()
        crop = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        if flip:
            crop = crop.flip(-1)
        out[i] = crop[0].round_().clamp_(0, 255).to(torch.uint8)
    return out


def normalize(images: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> normalised float, on the images' device."""
    mean, std = MEAN.to(images.device).view(1, 3, 1, 1), STD.to(images.device).view(1, 3, 1, 1)
    return ((images.float() - mean) / std).to(dtype)
