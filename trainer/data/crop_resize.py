"""A batch's random-resized crops, or its eval views, from decoded images of different sizes, in one GPU launch.

The nvjpeg branch decodes a batch into one tensor per image. Cropping, resizing and flipping each in turn took five
launches a sample, and the host time of those launches bounded the branch (docs/performance.md). `crop_resize` (a
box resized to the view) and `resize_crop` (the image resized, then the view cut from it, as timm's eval transform)
do the batch in one Triton kernel over the images packed end to end, with F.interpolate's antialiased filters (the
per-sample PyTorch they are tested against, `*_reference`, serves the CPU).
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .gpu_augment import to_device

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch: the reference serves
    triton = None


def crop_resize_reference(images: list[Tensor], boxes: np.ndarray, mirror: np.ndarray, size: int,
                          interpolation: str) -> Tensor:
    """Each uint8 (3, H, W) image's box (left, top, width, height), resized to size x size with antialiasing and
    mirrored where asked: float32 (B, 3, size, size)."""
    views = torch.empty(len(images), 3, size, size, device=images[0].device)
    for i, (image, (left, top, width, height)) in enumerate(zip(images, boxes.tolist(), strict=True)):
        crop = image[None, :, top:top + height, left:left + width].float()
        view = F.interpolate(crop, size=(size, size), mode=interpolation, antialias=True)[0]
        views[i] = view.flip(-1) if mirror[i] else view
    return views


def resize_crop_reference(images: list[Tensor], resizes: np.ndarray, size: int, interpolation: str) -> Tensor:
    """Each uint8 (3, H, W) image resized to (new_w, new_h) with antialiasing, then its size x size view at (left,
    top) kept, per row of `resizes`: float32 (B, 3, size, size). (A box of whole pixels in the image would shift the
    view by a fraction.)"""
    views = torch.empty(len(images), 3, size, size, device=images[0].device)
    for i, (image, (new_w, new_h, left, top)) in enumerate(zip(images, resizes.tolist(), strict=True)):
        resized = F.interpolate(image[None].float(), size=(new_h, new_w), mode=interpolation, antialias=True)
        views[i] = resized[0, :, top:top + size, left:left + size]
    return views


def crop_resize(images: list[Tensor], boxes: np.ndarray, mirror: np.ndarray, size: int, interpolation: str
                ) -> Tensor:
    """crop_resize_reference's result; on a GPU in one kernel (and one copy that packs the images). The kernel has
    both of the recipe's filters (recipe.INTERPOLATIONS)."""
    if images[0].device.type != "cuda" or triton is None:
        return crop_resize_reference(images, boxes, mirror, size, interpolation)
    # the box is what the filter reads, resized to the view: scale = box / size, no shift
    geometry = np.column_stack([boxes, mirror, np.full((len(images), 2), size), np.zeros((len(images), 2))])
    return _resampled(images, geometry, size, interpolation)


def resize_crop(images: list[Tensor], resizes: np.ndarray, size: int, interpolation: str) -> Tensor:
    """resize_crop_reference's result; on a GPU in one kernel (and one copy that packs the images)."""
    if images[0].device.type != "cuda" or triton is None:
        return resize_crop_reference(images, resizes, size, interpolation)
    shapes = np.array([image.shape[1:] for image in images], dtype=np.int64)
    # the whole image is read, resized to (new_w, new_h): scale = image / new size, the view shifted by (left, top)
    geometry = np.column_stack([np.zeros((len(images), 2)), shapes[:, 1], shapes[:, 0], np.zeros(len(images)),
                                resizes])
    return _resampled(images, geometry, size, interpolation)


def _resampled(images: list[Tensor], geometry: np.ndarray, size: int, interpolation: str) -> Tensor:
    """The kernel's launch. geometry, per sample: the region the filter reads (left, top, width, height), mirror,
    the size that region is resized to (width, height), and the view's offset in it (left, top)."""
    device = images[0].device
    shapes = np.array([image.shape for image in images], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(shapes.prod(axis=1))[:-1]])
    # per sample: where it starts in the packed images, its height and width, then its geometry
    table = np.column_stack([starts, shapes[:, 1], shapes[:, 2], geometry]).astype(np.int64)
    packed = torch.cat([image.reshape(-1) for image in images])
    views = torch.empty(len(images), 3, size, size, device=device)
    block = 256
    _crop_resize_kernel[(len(images), 3, triton.cdiv(size * size, block))](
        packed, to_device(table, device), views, SIZE=size, BICUBIC=interpolation == "bicubic", BLOCK=block,
        num_warps=4)
    return views


if triton is not None:

    @triton.jit
    def _filter(x, BICUBIC: tl.constexpr):
        """F.interpolate's antialiasing filters (aten's aa_filter): bicubic with a = -0.5, or the triangle."""
        x = tl.abs(x)
        if BICUBIC:
            near = ((-0.5 + 2.0) * x - (-0.5 + 3.0)) * x * x + 1.0
            far = ((-0.5 * x - 5.0 * -0.5) * x + 8.0 * -0.5) * x - 4.0 * -0.5
            return tl.where(x < 1.0, near, tl.where(x < 2.0, far, 0.0))
        return tl.where(x < 1.0, 1.0 - x, 0.0)

    @triton.jit
    def _span(out, length, resized, BICUBIC: tl.constexpr):
        """For positions `out` of an input of `length` resized to `resized`: aten's first tap, tap count, the inverse
        scale its filter is stretched by, the centre, the sum of the weights, and an upper bound on taps for the
        loop."""
        scale = length.to(tl.float32) / resized.to(tl.float32)
        support = (2.0 if BICUBIC else 1.0) * tl.maximum(scale, 1.0)
        inverse = tl.where(scale >= 1.0, 1.0 / scale, 1.0)
        centre = scale * (out.to(tl.float32) + 0.5)
        first = tl.maximum((centre - support + 0.5).to(tl.int32), 0)
        count = tl.minimum((centre + support + 0.5).to(tl.int32), length) - first
        bound = (2.0 * support).to(tl.int32) + 2
        total = tl.zeros_like(centre)
        for tap in range(0, bound):
            weight = _filter(((tap + first).to(tl.float32) - centre + 0.5) * inverse, BICUBIC)
            total += tl.where(tap < count, weight, 0.0)
        return first, count, inverse, centre, tl.where(total != 0.0, total, 1.0), bound

    @triton.jit
    def _crop_resize_kernel(packed_ptr, table_ptr, views_ptr, SIZE: tl.constexpr, BICUBIC: tl.constexpr,
                            BLOCK: tl.constexpr):
        sample, channel, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row = table_ptr + sample * 12
        start, height, width = tl.load(row), tl.load(row + 1).to(tl.int32), tl.load(row + 2).to(tl.int32)
        left, top = tl.load(row + 3).to(tl.int32), tl.load(row + 4).to(tl.int32)
        box_width, box_height = tl.load(row + 5).to(tl.int32), tl.load(row + 6).to(tl.int32)
        mirrored = tl.load(row + 7) != 0
        resized_width, resized_height = tl.load(row + 8).to(tl.int32), tl.load(row + 9).to(tl.int32)
        shift_x, shift_y = tl.load(row + 10).to(tl.int32), tl.load(row + 11).to(tl.int32)
        pixels = tile * BLOCK + tl.arange(0, BLOCK)
        valid = pixels < SIZE * SIZE
        out_y, out_x = pixels // SIZE, pixels % SIZE
        x0, x_count, x_inverse, x_centre, x_total, x_bound = _span(out_x + shift_x, box_width, resized_width, BICUBIC)
        y0, y_count, y_inverse, y_centre, y_total, y_bound = _span(out_y + shift_y, box_height, resized_height,
                                                                   BICUBIC)
        plane = packed_ptr + start + channel.to(tl.int64) * height * width
        # as aten's kernel sums: each input row across x with normalised weights, then the rows across y
        value = tl.zeros((BLOCK,), tl.float32)
        for j in range(0, y_bound):
            y_weight = _filter(((j + y0).to(tl.float32) - y_centre + 0.5) * y_inverse, BICUBIC) / y_total
            line = plane + (top + y0 + j).to(tl.int64) * width + left + x0
            across = tl.zeros((BLOCK,), tl.float32)
            for i in range(0, x_bound):
                x_weight = _filter(((i + x0).to(tl.float32) - x_centre + 0.5) * x_inverse, BICUBIC) / x_total
                taken = valid & (i < x_count) & (j < y_count)
                across += tl.where(taken, x_weight * tl.load(line + i, mask=taken, other=0).to(tl.float32), 0.0)
            value += tl.where(j < y_count, y_weight * across, 0.0)
        column = tl.where(mirrored, SIZE - 1 - out_x, out_x)
        tl.store(views_ptr + ((sample * 3 + channel) * SIZE + out_y) * SIZE + column, value, mask=valid)
