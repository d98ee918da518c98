"""The nvjpeg branch's batched crop-and-resize kernel, train and eval views, against its per-sample PyTorch reference
(marked gpu)."""

import numpy as np
import pytest
import torch

from vitctl.trainer.data.crop_resize import crop_resize, crop_resize_reference, resize_crop, resize_crop_reference
from vitctl.trainer.data.images import eval_resize

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA = torch.device("cuda")


def _images_and_boxes(count: int) -> tuple[list[torch.Tensor], np.ndarray]:
    """Images of many sizes with boxes that shrink (up to 12x), enlarge (a 1 x 1 box), or take the whole image."""
    rng = np.random.default_rng(0)
    images, boxes = [], []
    for i in range(count):
        height, width = (int(v) for v in rng.integers(20, 900, size=2))
        noise = rng.integers(0, 256, size=(3, height, width), dtype=np.uint8)
        images.append(torch.from_numpy(noise).to(CUDA))
        if i == 0:
            box = (0, 0, width, height)
        elif i == 1:
            box = (width // 2, height // 2, 1, 1)
        else:
            box_width, box_height = int(rng.integers(1, width + 1)), int(rng.integers(1, height + 1))
            box = (int(rng.integers(0, width - box_width + 1)), int(rng.integers(0, height - box_height + 1)),
                   box_width, box_height)
        boxes.append(box)
    return images, np.array(boxes, dtype=np.int32)


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear"])
def test_one_launch_gives_each_samples_antialiased_crop_as_f_interpolate_does(interpolation):
    images, boxes = _images_and_boxes(40)
    mirror = (np.arange(len(images)) % 2).astype(np.int32)
    _assert_close(crop_resize(images, boxes, mirror, 224, interpolation),
                  crop_resize_reference(images, boxes, mirror, 224, interpolation))


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear"])
def test_one_launch_gives_each_samples_eval_view_as_f_interpolate_then_a_centre_crop_does(interpolation):
    """timm's eval transform: the image resized (shrunk or enlarged, keeping its aspect or squashed), then cut."""
    images, _ = _images_and_boxes(40)
    resizes = np.array([eval_resize(image.shape[2], image.shape[1], 224, crop_pct, mode)
                        for image, crop_pct, mode in zip(images, [0.875, 0.9, 1.0, 0.95] * 10,
                                                         ["center", "center", "squash", "center"] * 10, strict=True)])
    _assert_close(resize_crop(images, resizes, 224, interpolation),
                  resize_crop_reference(images, resizes, 224, interpolation))


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape == (40, 3, 224, 224)
    # in grey levels, on noise: the weights are rounded differently (8e-3 at most on one H200)
    assert (got - want).abs().max().item() < 0.02
    as_uint8 = [views.round().clamp(0, 255).short() for views in (got, want)]
    assert (as_uint8[0] - as_uint8[1]).abs().max().item() <= 1
    assert (as_uint8[0] != as_uint8[1]).float().mean().item() < 1e-3
