"""The recipe's augmentations after the crop, on a uint8 (B, 3, H, W) batch, in torch, on its device.

augment_batch applies a batch's draws (draws.py) for the GPU paths: RandAugment, colour jitter, normalisation, erasing.

rand_augment applies the ops augment.draw_rand_augment draws as timm's PIL ops do (timm.data.auto_augment, the
reference), with PIL's arithmetic wherever it decides a grey level: its fixed-point greyscale, its lookup-table
formulas, truncation after a blend or a resampling, rounding after the smoothing filter. Rotate, shear and translate
resample with PIL's own kernels (Geometry.c: bilinear, or bicubic with a = -1, interpolated through differences),
not grid_sample's: its bicubic (a = -0.75) is 1 to 3 grey levels from PIL's on textured images, and its weighted
sums lose a level to truncation on flat ones. A layer groups its samples by op kind (one argsort), so a batch costs a
few launches per kind and layer, whatever its size; on a GPU the costliest ops are compiled. color_jitter is
torchvision's adjust_* on uint8 tensors. Nothing here waits for the GPU: the draws reach it through pinned memory, so
a batch's work is queued behind the training step before it, not run after it.
"""

import functools
import logging
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from .augment import KINDS, Recipe, erase

log = logging.getLogger("vitctl.data")

# PIL's RGB -> L: (299 R + 587 G + 114 B) / 1000 in 16-bit fixed point, rounded (Convert.c's L24)
_GREY_WEIGHTS = (19595, 38470, 7471)


def augment_batch(images: Tensor, drawn: dict[str, np.ndarray], recipe: Recipe) -> Tensor:
    """Cropped uint8 (B, 3, H, W) -> the recipe's float32 (B, 3, H, W): RandAugment, colour jitter, normalisation and
    erasing with the batch's draws (draws.stack_draws)."""
    if recipe.rand_augment:
        images = rand_augment(images, drawn["ra_kind"], drawn["ra_param"], drawn["ra_matrix"], recipe.fill,
                              recipe.interpolation)
    if recipe.color_jitter:
        images = color_jitter(images, drawn["jitter"])
    images = normalize(images.contiguous(), recipe)
    if recipe.reprob:
        erase(images, drawn["erase_box"], drawn["erase_seed"], recipe.remode)
    return images


def normalize(images: Tensor, recipe: Recipe) -> Tensor:
    """uint8 (B, 3, H, W) -> float32 normalised by the recipe's mean and std, on the images' device."""
    mean = to_device(np.array(recipe.mean, dtype=np.float32) * 255, images.device).view(1, 3, 1, 1)
    std = to_device(np.array(recipe.std, dtype=np.float32) * 255, images.device).view(1, 3, 1, 1)
    return (images.float() - mean) / std


def to_device(values: np.ndarray, device: torch.device) -> Tensor:
    """Host values as a tensor on `device`, through pinned memory: a copy from pageable memory to a GPU waits for
    all the work queued on the stream (a training step), where this one is queued behind it."""
    tensor = torch.from_numpy(np.ascontiguousarray(values))
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def rand_augment(images: Tensor, kinds: np.ndarray, params: np.ndarray, matrices: np.ndarray,
                 fill: tuple[int, int, int], interpolation: str = "bicubic") -> Tensor:
    """Each sample's ops, layer by layer: kinds (B, L) index augment.KINDS, params (B, L) are RandOp.param, matrices
    (B, L, 2, 3) RandOp.matrix; a warp fills what it uncovers with `fill` and resamples with `interpolation`."""
    layers = kinds.shape[1]
    # each layer's group sizes, which split needs on the host
    slots = kinds.astype(np.int64) + np.arange(layers) * len(KINDS)
    counts = np.bincount(slots.ravel(), minlength=layers * len(KINDS)).reshape(layers, len(KINDS)).tolist()
    device = images.device
    kinds, params = to_device(kinds, device), to_device(params.astype(np.float32), device)
    matrices = to_device(matrices.astype(np.float32), device)
    fill_colour = to_device(np.array(fill, dtype=np.float32), device).view(1, 3, 1, 1)
    out = images.clone()
    for layer, layer_counts in enumerate(counts):
        groups = torch.argsort(kinds[:, layer], stable=True).split(layer_counts)
        for kind, samples, count in zip(KINDS, groups, layer_counts, strict=True):
            if kind == "identity" or count == 0:
                continue
            group = out.index_select(0, samples)
            op = _compiled(kind) if kind in _COMPILED and device.type == "cuda" and count > 1 else _OPS[kind]
            if kind == "warp":
                group = op(group, matrices[samples, layer], fill_colour, interpolation)
            else:
                group = op(group, params[samples, layer].view(-1, 1, 1, 1))
            out.index_copy_(0, samples, group)
    return out


def color_jitter(images: Tensor, factors: np.ndarray) -> Tensor:
    """factors (B, 3): brightness, contrast and saturation, applied in this order (as the DALI pipeline does)."""
    factors = to_device(factors.astype(np.float32), images.device)
    brightness, contrast, saturation = factors.view(-1, 3, 1, 1, 1).unbind(1)
    images = _tv_blend(images, torch.zeros((), device=images.device), brightness)
    mean = _tv_grey(images).float().mean(dim=(1, 2, 3), keepdim=True)
    images = _tv_blend(images, mean, contrast)
    return _tv_blend(images, _tv_grey(images), saturation)


# ---------------------------------------------------------------- torchvision's uint8 arithmetic


def _tv_grey(images: Tensor) -> Tensor:
    """torchvision's rgb_to_grayscale on uint8: the weighted sum truncated, (B, 1, H, W)."""
    r, g, b = images.unbind(1)
    return (0.2989 * r + 0.587 * g + 0.114 * b).to(images.dtype).unsqueeze(1)


def _tv_blend(images: Tensor, other: Tensor, ratio: Tensor) -> Tensor:
    return (ratio * images + (1.0 - ratio) * other).clamp(0, 255).to(images.dtype)


# ---------------------------------------------------------------- PIL's arithmetic


def _pil_grey(images: Tensor) -> Tensor:
    """PIL's convert("L"), (n, 1, H, W) int32."""
    r, g, b = images.int().unbind(1)
    red, green, blue = _GREY_WEIGHTS
    return ((red * r + green * g + blue * b + 0x8000) >> 16).unsqueeze(1)


def _pil_blend(degenerate: Tensor, images: Tensor, factor: Tensor) -> Tensor:
    """Image.blend(degenerate, images, factor) (ImageEnhance's enhance): in float32, clipped, truncated."""
    degenerate = degenerate.float()
    return (degenerate + factor * (images.float() - degenerate)).clamp(0, 255).to(torch.uint8)


def _apply_luts(images: Tensor, luts: Tensor) -> Tensor:
    """Each sample's and channel's 256-entry table (n, C, 256) looked up for its pixels (PIL's Image.point)."""
    n, channels, height, width = images.shape
    pixels = images.reshape(n, channels, height * width).long()
    return luts.to(torch.uint8).gather(2, pixels).view(n, channels, height, width)


def _histograms(images: Tensor) -> Tensor:
    """(n, C, 256) pixel counts per sample and channel. scatter_add_, not bincount: no host sync on a GPU."""
    n, channels = images.shape[:2]
    rows = torch.arange(n * channels, device=images.device).view(n, channels, 1) * 256
    bins = (images.reshape(n, channels, -1).long() + rows).flatten()
    counts = torch.zeros(n * channels * 256, dtype=torch.long, device=images.device)
    return counts.scatter_add_(0, bins, torch.ones_like(bins)).view(n, channels, 256)


# ---------------------------------------------------------------- the ops but warp: (images, param (n, 1, 1, 1))


def _auto_contrast(images: Tensor, _param: Tensor) -> Tensor:
    """ImageOps.autocontrast: each channel's [min, max] stretched to [0, 255] by PIL's table, in float64 as PIL
    computes it (truncation makes the last bit count); a one-level channel unchanged."""
    low = images.amin(dim=(2, 3)).double().unsqueeze(-1)
    high = images.amax(dim=(2, 3)).double().unsqueeze(-1)
    levels = torch.arange(256, dtype=torch.float64, device=images.device)
    scale = 255.0 / (high - low).clamp(min=1)
    offset = -low * scale
    stretched = (levels * scale + offset).trunc().clamp(0, 255)
    return _apply_luts(images, torch.where(high > low, stretched, levels))


def _equalize(images: Tensor, _param: Tensor) -> Tensor:
    """ImageOps.equalize: per channel, step = (pixels - the last non-empty bin's count) // 255 and level i maps to
    (step // 2 + pixels below i) // step; step 0 leaves the channel unchanged."""
    histograms = _histograms(images)
    levels = torch.arange(256, device=images.device)
    last = (levels * (histograms > 0)).argmax(dim=2, keepdim=True)
    pixels = images.shape[2] * images.shape[3]
    step = (pixels - histograms.gather(2, last)) // 255
    below = histograms.cumsum(dim=2) - histograms
    # the last level can reach 256 (PIL's point clips it to 255)
    equalized = ((step // 2 + below) // step.clamp(min=1)).clamp(max=255)
    return _apply_luts(images, torch.where(step > 0, equalized, levels))


def _invert(images: Tensor, _param: Tensor) -> Tensor:
    return 255 - images


def _posterize(images: Tensor, mask: Tensor) -> Tensor:
    return images & mask.to(torch.uint8)


def _solarize(images: Tensor, threshold: Tensor) -> Tensor:
    return torch.where(images >= threshold, 255 - images, images)


def _solarize_add(images: Tensor, shift: Tensor) -> Tensor:
    return torch.where(images < 128, (images + shift).clamp(max=255).to(torch.uint8), images)


def _color(images: Tensor, factor: Tensor) -> Tensor:
    return _pil_blend(_pil_grey(images), images, factor)


def _contrast(images: Tensor, factor: Tensor) -> Tensor:
    """ImageEnhance.Contrast: blends with the grey mean as PIL rounds it, int(mean + 0.5), here in integers."""
    total = _pil_grey(images).sum(dim=(1, 2, 3), keepdim=True, dtype=torch.long)
    pixels = images.shape[2] * images.shape[3]
    return _pil_blend((2 * total + pixels) // (2 * pixels), images, factor)


def _brightness(images: Tensor, factor: Tensor) -> Tensor:
    return _pil_blend(torch.zeros((), device=images.device), images, factor)


def _sharpness(images: Tensor, factor: Tensor) -> Tensor:
    """ImageEnhance.Sharpness: blends with ImageFilter.SMOOTH ([[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13, rounded),
    which leaves the 1-pixel border as it is. Summed in integers: exact on any device."""
    pixels = images.int()
    height, width = pixels.shape[2:]
    weighted = 4 * pixels[:, :, 1:-1, 1:-1]
    for dy in range(3):
        for dx in range(3):
            weighted = weighted + pixels[:, :, dy:height - 2 + dy, dx:width - 2 + dx]
    smooth = pixels.clone()
    smooth[:, :, 1:-1, 1:-1] = (2 * weighted + 13) // 26  # round(weighted / 13): never a tie, 13 being odd
    return _pil_blend(smooth, images, factor)


# ---------------------------------------------------------------- warp


def _warp(images: Tensor, matrices: Tensor, fill: Tensor, interpolation: str) -> Tensor:
    """PIL's Image.transform(AFFINE): each output pixel centre (x + 0.5, y + 0.5) mapped by the (n, 2, 3) matrix to
    input coordinates; a point outside [0, W) x [0, H) takes `fill`, one inside is interpolated, edges repeated."""
    n, channels, height, width = images.shape
    ys, xs = torch.meshgrid(torch.arange(height, device=images.device) + 0.5,
                            torch.arange(width, device=images.device) + 0.5, indexing="ij")
    affine = matrices.reshape(n, 6, 1, 1)  # PIL's (a, b, c, d, e, f), elementwise: no matmul whose blocking varies
    x = affine[:, 0] * xs + affine[:, 1] * ys + affine[:, 2]
    y = affine[:, 3] * xs + affine[:, 4] * ys + affine[:, 5]
    inside = ((x >= 0) & (x < width) & (y >= 0) & (y < height)).unsqueeze(1)
    x, y = x - 0.5, y - 0.5  # from pixel edges to pixel centres
    left, top = x.floor(), y.floor()
    dx, dy = (x - left).unsqueeze(1), (y - top).unsqueeze(1)
    offsets = range(-1, 3) if interpolation == "bicubic" else range(2)
    flat = images.reshape(n, channels, height * width)

    def tap(row: Tensor, column: Tensor) -> Tensor:
        index = (row.clamp(0, height - 1) * width + column.clamp(0, width - 1)).view(n, 1, height * width)
        return flat.gather(2, index.expand(n, channels, -1)).view(n, channels, height, width).float()

    columns = [left.long() + i for i in offsets]
    rows = [_pil_interpolate([tap(top.long() + j, column) for column in columns], dx) for j in offsets]
    warped = _pil_interpolate(rows, dy)
    return torch.where(inside, warped, fill).clamp(0, 255).to(torch.uint8)


def _pil_interpolate(values: list[Tensor], d: Tensor) -> Tensor:
    """Geometry.c's BILINEAR (2 taps) or BICUBIC (4 taps, a = -1) at fraction d, through differences as PIL writes
    them: equal taps give exactly their value (weights summed in float32 would truncate a flat 200 to 199)."""
    if len(values) == 2:
        a, b = values
        return a + (b - a) * d
    v1, v2, v3, v4 = values
    return v2 + d * ((v3 - v1) + d * ((2 * (v1 - v2) + v3 - v4) + d * (v2 - v1 - v3 + v4)))


_OPS = {"auto_contrast": _auto_contrast, "equalize": _equalize, "invert": _invert, "posterize": _posterize,
        "solarize": _solarize, "solarize_add": _solarize_add, "color": _color, "contrast": _contrast,
        "brightness": _brightness, "sharpness": _sharpness, "warp": _warp}


# Compiled on a GPU: eager, warp's 16 gathers and ~70 elementwise kernels took 3.3 ms of GPU time for 43 images on
# an H200 (0.42 ms compiled), sharpness's 0.48 ms (0.14). The other ops gain less than the compiled call's host cost.
_COMPILED = ("warp", "sharpness")


@functools.cache
def _compiled(kind: str) -> Callable[..., Tensor]:
    """The op compiled once for any group size of two or more (a group of one would be compiled again, for itself)."""
    log.info("data: compiling RandAugment's %s for the GPU (once per process: 1-14 s, less from inductor's cache)",
             kind)
    return torch.compile(_OPS[kind], dynamic=True, fullgraph=True)
