"""Triton kernels for gpu_augment on a CUDA batch: a RandAugment layer in one pass, each sample's own op chosen inside
the kernel, and normalisation with random erasing in one pass.

gpu_augment's torch functions are the reference, with the same arithmetic (tests compare them; the CPU runs them).
Compiled on a GPU they computed every op on every sample and kept each sample's own: 2.29 ms of GPU time a ViT-B b256
batch on an H200, on the training stream between two steps. Here a program reads a tile of one sample and runs that
sample's op alone: 0.57 ms (bench/bench_augment.py).
"""

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from .augment import KINDS
from .gpu_augment import GREY_WEIGHTS

WARP: tl.constexpr = tl.constexpr(KINDS.index("warp"))
AUTO_CONTRAST: tl.constexpr = tl.constexpr(KINDS.index("auto_contrast"))
EQUALIZE: tl.constexpr = tl.constexpr(KINDS.index("equalize"))
INVERT: tl.constexpr = tl.constexpr(KINDS.index("invert"))
POSTERIZE: tl.constexpr = tl.constexpr(KINDS.index("posterize"))
SOLARIZE: tl.constexpr = tl.constexpr(KINDS.index("solarize"))
SOLARIZE_ADD: tl.constexpr = tl.constexpr(KINDS.index("solarize_add"))
COLOR: tl.constexpr = tl.constexpr(KINDS.index("color"))
CONTRAST: tl.constexpr = tl.constexpr(KINDS.index("contrast"))
BRIGHTNESS: tl.constexpr = tl.constexpr(KINDS.index("brightness"))
SHARPNESS: tl.constexpr = tl.constexpr(KINDS.index("sharpness"))
GREY_R: tl.constexpr = tl.constexpr(GREY_WEIGHTS[0])
GREY_G: tl.constexpr = tl.constexpr(GREY_WEIGHTS[1])
GREY_B: tl.constexpr = tl.constexpr(GREY_WEIGHTS[2])

# A sample's statistics for one layer, int32: 255 - each channel's minimum, each channel's maximum (auto_contrast),
# the sum of PIL's grey levels (contrast), one slot free, then each channel's 256-bin histogram (equalize).
_MAX: tl.constexpr = tl.constexpr(3)
_GREY_SUM: tl.constexpr = tl.constexpr(6)
_HISTOGRAMS: tl.constexpr = tl.constexpr(8)
STATS: tl.constexpr = tl.constexpr(8 + 3 * 256)
_NEEDS_STATS = [KINDS.index(k) for k in ("auto_contrast", "contrast", "equalize")]
MODES = ("const", "rand", "pixel")
BLOCK = 1024  # pixels of one sample a program


def rand_augment(images: Tensor, kinds: np.ndarray, kinds_on: Tensor, params_on: Tensor, matrices_on: Tensor,
                 fill: tuple[int, int, int], interpolation: str) -> Tensor:
    """gpu_augment.rand_augment's layers: kinds (B, L) on the host and on the device, params (B, L), matrices
    (B, L, 2, 3) on the device. Launches only: the host's copy of the kinds says which layers need statistics."""
    batch, _, height, width = images.shape
    layers = kinds.shape[1]
    grid = (batch, triton.cdiv(height * width, BLOCK))
    luts = torch.empty(batch, 3, 256, dtype=torch.uint8, device=images.device)
    stats = torch.zeros(layers, batch, STATS.value, dtype=torch.int32, device=images.device)
    for layer in range(layers):
        if np.isin(kinds[:, layer], _NEEDS_STATS).any():
            _stats_kernel[grid](images, kinds_on, stats[layer], layer, layers, height * width, BLOCK=BLOCK)
            _luts_kernel[(batch, 3)](stats[layer], kinds_on, luts, layer, layers, height * width)
        out = torch.empty_like(images)
        _layer_kernel[grid](images, out, kinds_on, params_on, matrices_on, luts, stats[layer], layer, layers,
                            height, width, *map(float, fill), BICUBIC=interpolation == "bicubic", BLOCK=BLOCK)
        images = out
    return images


def normalize_erase(images: Tensor, mean: tuple[float, ...], std: tuple[float, ...], boxes: Tensor | None,
                    seeds: Tensor | None, mode: str) -> Tensor:
    """uint8 (B, 3, H, W) -> float32 (images - mean) / std per channel (mean and std in grey levels), then
    gpu_augment.erase's boxes (B, K, 4) filled by `mode` from seeds (B, K); boxes None: none."""
    batch, _, height, width = images.shape
    out = torch.empty(images.shape, dtype=torch.float32, device=images.device)
    count = 0 if boxes is None else boxes.shape[1]
    boxes = boxes.int().contiguous() if boxes is not None else out
    seeds = seeds.contiguous() if seeds is not None else out
    _normalize_erase_kernel[(batch, triton.cdiv(height * width, BLOCK))](
        images, out, boxes, seeds, height * width, width, *mean, *std, BOXES=count, MODE=MODES.index(mode),
        BLOCK=BLOCK)
    return out


@triton.jit
def _stats_kernel(images, kinds, stats, layer, layers, hw, BLOCK: tl.constexpr):
    """A tile's share of the STATS its sample's op needs, added to the sample's row by atomics."""
    b = tl.program_id(0)
    kind = tl.load(kinds + b * layers + layer)
    if (kind == AUTO_CONTRAST) | (kind == CONTRAST) | (kind == EQUALIZE):
        p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = p < hw
        pixels = images + b * 3 * hw + p
        row = stats + b * STATS
        if kind == AUTO_CONTRAST:
            for c in tl.static_range(3):
                v = tl.load(pixels + c * hw, mask=inside, other=0).to(tl.int32)
                tl.atomic_max(row + c, tl.max(tl.where(inside, 255 - v, 0), axis=0))
                tl.atomic_max(row + _MAX + c, tl.max(v, axis=0))
        elif kind == CONTRAST:
            grey = _pil_grey(tl.load(pixels, mask=inside, other=0).to(tl.int32),
                             tl.load(pixels + hw, mask=inside, other=0).to(tl.int32),
                             tl.load(pixels + 2 * hw, mask=inside, other=0).to(tl.int32))
            tl.atomic_add(row + _GREY_SUM, tl.sum(tl.where(inside, grey, 0), axis=0))
        else:
            levels = tl.arange(0, 256)
            masked = BLOCK - tl.sum(inside.to(tl.int32), axis=0)  # the masked lanes, counted as level 0
            for c in tl.static_range(3):
                counts = tl.histogram(tl.load(pixels + c * hw, mask=inside, other=0).to(tl.int32), 256)
                counts -= tl.where(levels == 0, masked, 0)
                tl.atomic_add(row + _HISTOGRAMS + c * 256 + levels, counts)


@triton.jit
def _luts_kernel(stats, kinds, luts, layer, layers, hw):
    """auto_contrast's and equalize's tables from the statistics, a program per sample and channel."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    kind = tl.load(kinds + b * layers + layer)
    levels = tl.arange(0, 256)
    row = stats + b * STATS
    out = luts + (b * 3 + c) * 256 + levels
    if kind == AUTO_CONTRAST:
        low = (255 - tl.load(row + c)).to(tl.float64)
        high = tl.load(row + _MAX + c).to(tl.float64)
        scale = 255.0 / tl.maximum(high - low, 1.0)
        offset = -low * scale
        stretched = tl.minimum(tl.maximum((levels.to(tl.float64) * scale + offset).to(tl.int32), 0), 255)
        tl.store(out, tl.where(high > low, stretched, levels).to(tl.uint8))
    elif kind == EQUALIZE:
        counts = tl.load(row + _HISTOGRAMS + c * 256 + levels)
        last = tl.max(tl.where(counts > 0, levels, 0), axis=0)
        step = (hw - tl.sum(tl.where(levels == last, counts, 0), axis=0)) // 255
        below = tl.cumsum(counts, axis=0) - counts
        equalized = tl.minimum((step // 2 + below) // tl.maximum(step, 1), 255)
        tl.store(out, tl.where(step > 0, equalized, levels).to(tl.uint8))


# no argument may be named `params`: the argument binder Triton generates for a kernel has a local of that name
@triton.jit
def _layer_kernel(src, dst, kinds, arguments, matrices, luts, stats, layer, layers, height, width, fill0, fill1, fill2,
                  BICUBIC: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    hw = height * width
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = p < hw
    at = b * layers + layer
    kind = tl.load(kinds + at)
    param = tl.load(arguments + at)
    image = src + b * 3 * hw
    out = dst + b * 3 * hw
    if kind == WARP:
        _warp(image, out, matrices + at * 6, p, inside, height, width, fill0, fill1, fill2, BICUBIC)
    elif kind == SHARPNESS:
        _sharpness(image, out, param, p, inside, height, width)
    else:
        r = tl.load(image + p, mask=inside, other=0).to(tl.int32)
        g = tl.load(image + hw + p, mask=inside, other=0).to(tl.int32)
        bl = tl.load(image + 2 * hw + p, mask=inside, other=0).to(tl.int32)
        grey = _pil_grey(r, g, bl)
        # ImageEnhance.Contrast's mean, int(mean + 0.5) in integers
        mean = (2 * tl.load(stats + b * STATS + _GREY_SUM) + hw) // (2 * hw)
        lut = luts + b * 3 * 256
        tl.store(out + p, _pointwise(r, kind, param, grey, mean, lut), mask=inside)
        tl.store(out + hw + p, _pointwise(g, kind, param, grey, mean, lut + 256), mask=inside)
        tl.store(out + 2 * hw + p, _pointwise(bl, kind, param, grey, mean, lut + 512), mask=inside)


@triton.jit
def _pointwise(v, kind, param, grey, mean, lut):
    """One channel's int32 levels -> uint8 under the ops that read a pixel alone (gpu_augment's _invert ...)."""
    out = v
    if (kind == AUTO_CONTRAST) | (kind == EQUALIZE):
        out = tl.load(lut + v).to(tl.int32)
    elif kind == INVERT:
        out = 255 - v
    elif kind == POSTERIZE:
        out = v & param.to(tl.int32)
    elif kind == SOLARIZE:
        out = tl.where(v.to(tl.float32) >= param, 255 - v, v)
    elif kind == SOLARIZE_ADD:
        out = tl.where(v < 128, tl.minimum(v.to(tl.float32) + param, 255.0).to(tl.int32), v)
    elif kind == COLOR:
        out = _pil_blend(grey, v, param)
    elif kind == CONTRAST:
        out = _pil_blend(mean, v, param)
    elif kind == BRIGHTNESS:
        out = _pil_blend(tl.zeros_like(v), v, param)
    return out.to(tl.uint8)


@triton.jit
def _pil_grey(r, g, b):
    """gpu_augment._pil_grey: PIL's convert("L") in 16-bit fixed point."""
    return (GREY_R * r + GREY_G * g + GREY_B * b + 0x8000) >> 16


@triton.jit
def _pil_blend(degenerate, v, factor):
    """Image.blend in float32, clipped and truncated: int32 levels."""
    d = degenerate.to(tl.float32)
    return tl.minimum(tl.maximum(d + factor * (v.to(tl.float32) - d), 0.0), 255.0).to(tl.int32)


@triton.jit
def _sharpness(image, out, factor, p, inside, height, width):
    """ImageEnhance.Sharpness: the 1-pixel border kept, inside it SMOOTH's rounded 3x3 mean, blended."""
    hw = height * width
    y = p // width
    x = p % width
    interior = inside & (y > 0) & (y < height - 1) & (x > 0) & (x < width - 1)
    for c in tl.static_range(3):
        plane = image + c * hw
        centre = tl.load(plane + p, mask=inside, other=0).to(tl.int32)
        weighted = 4 * centre
        for dy in tl.static_range(3):
            for dx in tl.static_range(3):
                weighted += tl.load(plane + p + (dy - 1) * width + (dx - 1), mask=interior, other=0).to(tl.int32)
        smooth = tl.where(interior, (2 * weighted + 13) // 26, centre)
        tl.store(out + c * hw + p, _pil_blend(smooth, centre, factor).to(tl.uint8), mask=inside)


@triton.jit
def _warp(image, out, matrix, p, inside, height, width, fill0, fill1, fill2, BICUBIC: tl.constexpr):
    """gpu_augment._warp: PIL's affine transform of each output pixel's centre, interpolated, `fill` outside."""
    hw = height * width
    ys = (p // width).to(tl.float32) + 0.5
    xs = (p % width).to(tl.float32) + 0.5
    x = tl.load(matrix) * xs + tl.load(matrix + 1) * ys + tl.load(matrix + 2)
    y = tl.load(matrix + 3) * xs + tl.load(matrix + 4) * ys + tl.load(matrix + 5)
    covered = (x >= 0) & (x < width) & (y >= 0) & (y < height)
    x -= 0.5
    y -= 0.5
    left = tl.floor(x)
    top = tl.floor(y)
    dx = x - left
    dy = y - top
    column = left.to(tl.int32)
    row = top.to(tl.int32)
    for c in tl.static_range(3):
        plane = image + c * hw
        if BICUBIC:
            warped = _cubic(_cubic_row(plane, row - 1, column, height, width, dx, inside),
                            _cubic_row(plane, row, column, height, width, dx, inside),
                            _cubic_row(plane, row + 1, column, height, width, dx, inside),
                            _cubic_row(plane, row + 2, column, height, width, dx, inside), dy)
        else:
            above = _linear(_tap(plane, row, column, height, width, inside),
                            _tap(plane, row, column + 1, height, width, inside), dx)
            below = _linear(_tap(plane, row + 1, column, height, width, inside),
                            _tap(plane, row + 1, column + 1, height, width, inside), dx)
            warped = _linear(above, below, dy)
        fill = fill0 if c == 0 else (fill1 if c == 1 else fill2)
        value = tl.minimum(tl.maximum(tl.where(covered, warped, fill), 0.0), 255.0)
        tl.store(out + c * hw + p, value.to(tl.uint8), mask=inside)


@triton.jit
def _tap(plane, row, column, height, width, inside):
    """The level at (row, column), edges repeated, as float32."""
    row = tl.minimum(tl.maximum(row, 0), height - 1)
    column = tl.minimum(tl.maximum(column, 0), width - 1)
    return tl.load(plane + row * width + column, mask=inside, other=0).to(tl.float32)


@triton.jit
def _cubic_row(plane, row, column, height, width, dx, inside):
    return _cubic(_tap(plane, row, column - 1, height, width, inside), _tap(plane, row, column, height, width, inside),
                  _tap(plane, row, column + 1, height, width, inside),
                  _tap(plane, row, column + 2, height, width, inside), dx)


@triton.jit
def _cubic(v1, v2, v3, v4, d):
    """gpu_augment._pil_interpolate's 4 taps (PIL's bicubic, a = -1, through differences)."""
    return v2 + d * ((v3 - v1) + d * ((2 * (v1 - v2) + v3 - v4) + d * (v2 - v1 - v3 + v4)))


@triton.jit
def _linear(a, b, d):
    return a + (b - a) * d


@triton.jit
def _normalize_erase_kernel(src, dst, boxes, seeds, hw, width, mean0, mean1, mean2, std0, std1, std2,
                            BOXES: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = p < hw
    y = p // width
    x = p % width
    for c in tl.static_range(3):
        mean = mean0 if c == 0 else (mean1 if c == 1 else mean2)
        std = std0 if c == 0 else (std1 if c == 1 else std2)
        levels = tl.load(src + (b * 3 + c) * hw + p, mask=inside, other=0).to(tl.float32)
        value = tl.div_rn(levels - mean, std)  # rounded as torch divides: Triton's `/` on float32 is approximate
        for k in tl.static_range(BOXES):
            box = boxes + (b * BOXES + k) * 4
            top = tl.load(box)
            left = tl.load(box + 1)
            h = tl.load(box + 2)
            w = tl.load(box + 3)
            if h > 0:
                by = y - top
                bx = x - left
                hit = (by >= 0) & (by < h) & (bx >= 0) & (bx < w)
                seed = tl.load(seeds + b * BOXES + k)
                if MODE == 0:
                    fill = tl.zeros_like(value)
                elif MODE == 1:
                    fill = _normal(seed, tl.full(p.shape, c, tl.int64))
                else:
                    fill = _normal(seed, ((c * h + by) * w + bx).to(tl.int64))
                value = tl.where(hit, fill, value)
        tl.store(dst + (b * 3 + c) * hw + p, value, mask=inside)


@triton.jit
def _normal(seed, counters):
    """gpu_augment._normal: N(0, 1) float32 from an int64 seed and int64 counters, Box-Muller over lowbias32."""
    seed = seed.to(tl.uint64, bitcast=True)
    key = _hash32(_hash32(seed >> 32) ^ seed)
    counters = counters.to(tl.uint64, bitcast=True)
    u1 = (_hash32(key ^ _hash32(2 * counters)).to(tl.float32) + 0.5) * 2.3283064365386963e-10
    u2 = (_hash32(key ^ _hash32(2 * counters + 1)).to(tl.float32) + 0.5) * 2.3283064365386963e-10
    return tl.sqrt_rn(-2.0 * tl.log(u1)) * tl.cos(6.283185307179586 * u2)


@triton.jit
def _hash32(x):
    """Wellons' lowbias32 on the low 32 bits of uint64 `x`."""
    x = x & 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x21F0AAAD) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0xD35A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)
