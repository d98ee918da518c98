"""The recipe's augmentations after the crop, on a uint8 (B, 3, H, W) batch, in torch, on its device.

augment_batch applies a batch's draws (draws.py) for the GPU paths: RandAugment, colour jitter, normalisation, erasing.

rand_augment applies the ops augment.draw_rand_augment draws as timm's PIL ops do (timm.data.auto_augment, the
reference), with PIL's arithmetic wherever it decides a grey level: its fixed-point greyscale, its lookup-table
formulas, truncation after a blend or a resampling, rounding after the smoothing filter. Rotate, shear and translate
resample with PIL's own kernels (Geometry.c: bilinear, or bicubic with a = -1, interpolated through differences),
not grid_sample's: its bicubic (a = -0.75) is 1 to 3 grey levels from PIL's on textured images, and its weighted
sums lose a level to truncation on flat ones. The torch functions here are the reference and run on the CPU: a layer
computes its ops but warp and equalize on the whole batch and keeps each sample's own (pixel_ops), then applies those
two to their samples, a group each. On a CUDA batch augment_kernels runs the same arithmetic as Triton kernels, a
pass a layer. color_jitter is torchvision's adjust_* on uint8 tensors. Erasing fills its boxes with noise hashed from
each box's seed. Nothing here waits for the GPU: the draws reach it through pinned memory, so a batch's work is
queued behind the training step before it, not run after it.
"""

import math

import numpy as np
import torch
from torch import Tensor

from .augment import KINDS, Recipe

# PIL's RGB -> L: (299 R + 587 G + 114 B) / 1000 in 16-bit fixed point, rounded (Convert.c's L24)
GREY_WEIGHTS = (19595, 38470, 7471)


def augment_batch(images: Tensor, drawn: dict[str, np.ndarray], recipe: Recipe) -> Tensor:
    """Cropped uint8 (B, 3, H, W) -> the recipe's float32 (B, 3, H, W): RandAugment, colour jitter, normalisation and
    erasing with the batch's draws (draws.stack_draws)."""
    if recipe.rand_augment:
        images = rand_augment(images, drawn["ra_kind"], drawn["ra_param"], drawn["ra_matrix"], recipe.fill,
                              recipe.interpolation)
    wanted = [name for name, used in (("jitter", recipe.color_jitter), ("erase_box", recipe.reprob),
                                      ("erase_seed", recipe.reprob)) if used]
    on = dict(zip(wanted, to_device_all([drawn[name] for name in wanted], images.device), strict=True))
    images = images.contiguous()
    if "jitter" in on:
        images = color_jitter(images, on["jitter"])
    if images.is_cuda:
        from . import augment_kernels

        return augment_kernels.normalize_erase(images, *_grey_levels(recipe.mean, recipe.std), on.get("erase_box"),
                                               on.get("erase_seed"), recipe.remode)
    images = _normalized(images, recipe.mean, recipe.std)
    return images if "erase_box" not in on else erase(images, on["erase_box"], on["erase_seed"], recipe.remode)


def model_input(views: Tensor, drawn: dict[str, np.ndarray] | None, recipe: Recipe) -> Tensor:
    """Cropped uint8 views -> the model's float32 input: evaluation's normalisation (drawn None), or augment_batch."""
    return normalize(views, recipe) if drawn is None else augment_batch(views, drawn, recipe)


def normalize(images: Tensor, recipe: Recipe) -> Tensor:
    """uint8 (B, 3, H, W) -> float32 normalised by the recipe's mean and std, on the images' device."""
    return _normalized(images, recipe.mean, recipe.std)


def _normalized(images: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    mean, std = _grey_levels(mean, std)
    return (images.float() - _per_channel(mean, images)) / _per_channel(std, images)


def _grey_levels(*values: tuple[float, ...]) -> list[tuple[float, ...]]:
    """Each triple of [0, 1] values in grey levels, as float32 computes them."""
    return [tuple(float(np.float32(v) * np.float32(255)) for v in triple) for triple in values]


def _per_channel(values: list[float] | tuple[float, ...], like: Tensor) -> Tensor:
    """Three constants as a float32 (1, 3, 1, 1) on `like`'s device, built there: no copy from the host, which from
    pageable memory would wait for the work queued on the stream."""
    channel = torch.arange(3, device=like.device).view(1, 3, 1, 1)
    return torch.where(channel == 0, values[0], torch.where(channel == 1, values[1], values[2])).float()


def to_device(values: np.ndarray, device: torch.device) -> Tensor:
    """Host values as a tensor on `device`, through pinned memory: a copy from pageable memory to a GPU waits for
    all the work queued on the stream (a training step), where this one is queued behind it."""
    return to_device_all([values], device)[0]


def to_device_all(arrays: list[np.ndarray], device: torch.device) -> list[Tensor]:
    """Host arrays as tensors on `device`, on a GPU through one pinned buffer and one copy (each pinned copy costs the
    host some 60 us)."""
    arrays = [np.ascontiguousarray(array) for array in arrays]
    if device.type != "cuda" or not arrays:
        return [torch.from_numpy(array).to(device) for array in arrays]
    starts = np.cumsum([0] + [-(-array.nbytes // 8) * 8 for array in arrays])  # 8-byte aligned for any dtype's view
    host = torch.empty(int(starts[-1]), dtype=torch.uint8, pin_memory=True)
    staging = host.numpy()
    for array, start in zip(arrays, starts, strict=False):
        staging[start:start + array.nbytes] = array.reshape(-1).view(np.uint8)
    on_device = host.to(device, non_blocking=True)
    return [on_device[start:start + array.nbytes].view(torch.from_numpy(array[:0]).dtype).view(array.shape)
            for array, start in zip(arrays, starts, strict=False)]


def rand_augment(images: Tensor, kinds: np.ndarray, params: np.ndarray, matrices: np.ndarray,
                 fill: tuple[int, int, int], interpolation: str = "bicubic") -> Tensor:
    """Each sample's ops, layer by layer: kinds (B, L) index augment.KINDS, params (B, L) are RandOp.param, matrices
    (B, L, 2, 3) RandOp.matrix; a warp fills what it uncovers with `fill` and resamples with `interpolation`."""
    kinds_on, params_on, matrices_on = to_device_all(
        [kinds, params.astype(np.float32), matrices.astype(np.float32)], images.device)
    if images.is_cuda:
        from . import augment_kernels

        return augment_kernels.rand_augment(images.contiguous(), kinds, kinds_on, params_on, matrices_on, fill,
                                            interpolation)
    fill_colour = _per_channel(fill, images)
    for layer in range(kinds.shape[1]):
        images = pixel_ops(images, kinds_on[:, layer], params_on[:, layer])
        for kind in GROUPED:
            index = torch.from_numpy(np.flatnonzero(kinds[:, layer] == KINDS.index(kind)))
            if len(index) == 0:
                continue
            extra = (matrices_on[index, layer], fill_colour, interpolation) if kind == "warp" else (None,)
            images.index_copy_(0, index, _OPS[kind](images.index_select(0, index), *extra))
    return images


# Applied to their samples only: warp's 16 taps a pixel and equalize's histograms cost the most on the whole batch.
GROUPED = ("warp", "equalize")


def pixel_ops(images: Tensor, kinds: Tensor, params: Tensor) -> Tensor:
    """One layer of RandAugment but its GROUPED ops: each sample's op (kinds (B,) into KINDS, params (B,)) selected
    from every op computed on the whole batch. A new tensor; samples drawn a GROUPED op are left as they are."""
    out, params = images, params.view(-1, 1, 1, 1)
    for index, kind in enumerate(KINDS):
        if kind != "identity" and kind not in GROUPED:
            out = torch.where((kinds == index).view(-1, 1, 1, 1), _OPS[kind](images, params), out)
    return out


def color_jitter(images: Tensor, factors: Tensor) -> Tensor:
    """factors (B, 3): brightness, contrast and saturation, applied in this order (as the DALI pipeline does)."""
    brightness, contrast, saturation = factors.view(-1, 3, 1, 1, 1).unbind(1)
    images = _tv_blend(images, 0.0, brightness)
    mean = _tv_grey(images).float().mean(dim=(1, 2, 3), keepdim=True)
    images = _tv_blend(images, mean, contrast)
    return _tv_blend(images, _tv_grey(images), saturation)


def erase(images: Tensor, boxes: Tensor, seeds: Tensor, mode: str) -> Tensor:
    """Random erasing of a normalised (B, 3, H, W) batch: sample i's boxes[i] (K, 4) of (top, left, h, w), h = 0 for
    none, filled in order (later boxes over earlier ones) with zeros (const), one N(0, 1) colour (rand) or N(0, 1)
    pixels (pixel) that depend on the box's seed (seeds[i]) and shape alone, so a resumed run erases as the first did
    and every device alike."""
    channels, height, width = images.shape[1:]
    ys = torch.arange(height, device=images.device).view(1, 1, height, 1)
    xs = torch.arange(width, device=images.device).view(1, 1, 1, width)
    cs = torch.arange(channels, device=images.device).view(1, channels, 1, 1)
    for k in range(boxes.shape[1]):
        top, left, h, w = (boxes[:, k, j].long().view(-1, 1, 1, 1) for j in range(4))
        y, x = ys - top, xs - left
        inside = (y >= 0) & (y < h) & (x >= 0) & (x < w)
        if mode == "const":
            fill = torch.zeros((), dtype=images.dtype, device=images.device)
        else:
            fill = _normal(seeds[:, k].view(-1, 1, 1, 1), cs if mode == "rand" else (cs * h + y) * w + x)
        images = torch.where(inside, fill.to(images.dtype), images)
    return images


def _normal(seeds: Tensor, counters: Tensor) -> Tensor:
    """Standard normal float32 values from int64 (seed, counter) pairs alone: Box-Muller over a 32-bit integer hash."""
    key = _hash32(_hash32(seeds >> 32) ^ seeds)
    u1, u2 = (_unit(_hash32(key ^ _hash32(2 * counters + i))) for i in (0, 1))
    return torch.sqrt(-2 * torch.log(u1)) * torch.cos(2 * math.pi * u2)


def _hash32(x: Tensor) -> Tensor:
    """Wellons' lowbias32 on the low 32 bits of int64 `x`, in int64 arithmetic that never overflows."""
    x = x & 0xFFFFFFFF
    x = _mul32(x ^ (x >> 16), 0x21F0AAAD)
    x = _mul32(x ^ (x >> 15), 0xD35A2D97)
    return x ^ (x >> 15)


def _mul32(x: Tensor, factor: int) -> Tensor:
    """x * factor modulo 2**32 for x below 2**32, as two products below 2**48."""
    return (x * (factor & 0xFFFF) + (((x * (factor >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _unit(x: Tensor) -> Tensor:
    """A 32-bit integer -> float32 in (0, 1]."""
    return (x.float() + 0.5) * 2.0**-32


# ---------------------------------------------------------------- torchvision's uint8 arithmetic


def _tv_grey(images: Tensor) -> Tensor:
    """torchvision's rgb_to_grayscale on uint8: the weighted sum truncated, (B, 1, H, W)."""
    r, g, b = images.unbind(1)
    return (0.2989 * r + 0.587 * g + 0.114 * b).to(images.dtype).unsqueeze(1)


def _tv_blend(images: Tensor, other: Tensor | float, ratio: Tensor) -> Tensor:
    return (ratio * images + (1.0 - ratio) * other).clamp(0, 255).to(images.dtype)


# ---------------------------------------------------------------- PIL's arithmetic


def _pil_grey(images: Tensor) -> Tensor:
    """PIL's convert("L"), (n, 1, H, W) int32."""
    r, g, b = images.int().unbind(1)
    red, green, blue = GREY_WEIGHTS
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
    # tensor over tensor: torch on the CPU rounds a Python number over a tensor otherwise than PIL's division (255 over
    # 200 came to 1.2750000000000001, not 1.275), and a channel spanning 55-255 then mapped 95 to 51 where PIL gives 50
    scale = torch.full_like(high, 255.0) / (high - low).clamp(min=1)
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
