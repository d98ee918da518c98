"""Image decoding and the crop every loader shares: PIL on the CPU, nvjpeg (torchvision.io.decode_jpeg) on the GPU.

Each sample's randomness comes from a generator seeded by (seed, epoch, draw), so a batch is the same whichever
worker builds it and whether or not the run was resumed. The crop box and mirror are drawn first, on the image's
full size, by every loader alike (train_view); the rest of the recipe follows: timm's transforms after PIL's decode
(augment.py), or gpu_augment.py with the sample's draws (draws.py) after nvjpeg's or a PIL worker's crop.
"""

import io
import math
import threading

import numpy as np
import torch
from PIL import Image

from .augment import Recipe, TimmTransforms, normalize_pil
from .crop_resize import crop_resize, resize_crop
from .gpu_augment import model_input

PIL_RESAMPLE = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, index])


def crop_box(rng: np.random.Generator, width: int, height: int, min_scale: float) -> tuple[int, int, int, int]:
    """Random-resized-crop box (left, top, w, h): area in [min_scale, 1], aspect in [3/4, 4/3] (torchvision's)."""
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(min_scale, 1.0)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    # torchvision's fallback: the centre of the image with its aspect clamped to [3/4, 4/3]
    w, h = min(width, round(height * 4 / 3)), min(height, round(width * 4 / 3))
    return (width - w) // 2, (height - h) // 2, w, h


def train_view(rng: np.random.Generator, width: int, height: int, min_scale: float,
               hflip: bool) -> tuple[tuple[int, int, int, int], bool]:
    """A training sample's crop box and whether to mirror it, drawn in this order by every loader."""
    box = crop_box(rng, width, height, min_scale)
    return box, hflip and rng.random() < 0.5


def eval_resize(width: int, height: int, size: int, crop_pct: float, mode: str) -> tuple[int, int, int, int]:
    """timm's eval transform: the (w, h) an image is resized to, floor(size / crop_pct) on the shorter side keeping
    the aspect (`center`) or on both (`squash`), and the (left, top) of the centre size x size it keeps."""
    scale = math.floor(size / crop_pct)
    if mode == "squash":
        new_w = new_h = scale
    elif width <= height:
        new_w, new_h = scale, int(scale * height / width)
    else:
        new_w, new_h = int(scale * width / height), scale
    return new_w, new_h, round((new_w - size) / 2), round((new_h - size) / 2)


def eval_box(width: int, height: int, size: int, crop_pct: float, mode: str) -> tuple[float, float, float, float]:
    """The region of the image (left, top, w, h) an eval view shows, in its pixels."""
    new_w, new_h, left, top = eval_resize(width, height, size, crop_pct, mode)
    fx, fy = width / new_w, height / new_h
    return left * fx, top * fy, size * fx, size * fy


def _view(data: bytes, recipe: Recipe, train: bool, rng: np.random.Generator) -> Image.Image:
    """JPEG bytes -> the (size, size) RGB crop, mirrored when drawn so."""
    with Image.open(io.BytesIO(data)) as image:
        if not train:
            return _eval_resized(image, recipe)
        box, flip = train_view(rng, *image.size, recipe.min_scale, recipe.hflip)
        return _resized(image, box, flip, recipe.size, PIL_RESAMPLE[recipe.interpolation])


def _eval_resized(image: Image.Image, recipe: Recipe) -> Image.Image:
    box = eval_box(*image.size, recipe.size, recipe.eval_crop_pct, recipe.eval_crop_mode)
    return _resized(image, box, False, recipe.size, PIL_RESAMPLE[recipe.eval_interpolation])


def _resized(image: Image.Image, box: tuple[float, float, float, float], flip: bool, size: int,
             resample: int) -> Image.Image:
    """An opened JPEG's box (left, top, w, h) resized to (size, size), mirrored if `flip`."""
    left, top, w, h = box
    width, height = image.size
    # libjpeg may decode at 1/2, 1/4, 1/8 scale while the box keeps at least `size` pixels each way
    image.draft("RGB", (math.ceil(width * size / w), math.ceil(height * size / h)))
    scale_x, scale_y = image.size[0] / width, image.size[1] / height
    box = (left * scale_x, top * scale_y, (left + w) * scale_x, (top + h) * scale_y)
    view = image.convert("RGB").resize((size, size), resample, box=box)
    return view.transpose(Image.FLIP_LEFT_RIGHT) if flip else view


def _as_tensor(view: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(view).copy()).permute(2, 0, 1)


def eval_view_pil(data: bytes, recipe: Recipe) -> torch.Tensor:
    """JPEG bytes -> the (3, size, size) uint8 eval view, normalised afterwards on the GPU."""
    with Image.open(io.BytesIO(data)) as image:
        return _as_tensor(_eval_resized(image, recipe))


def train_view_pil(image: Image.Image, anchor: np.ndarray, shape: np.ndarray, mirror: np.ndarray,
                   recipe: Recipe) -> torch.Tensor:
    """An opened JPEG's training view as its draws (draws.py) give it, (3, size, size) uint8, for the recipe's rest
    on the GPU (gpu_augment.augment_batch)."""
    (left, top), (w, h) = anchor.tolist(), shape.tolist()
    view = _resized(image, (left, top, w, h), bool(mirror), recipe.size, PIL_RESAMPLE[recipe.interpolation])
    return _as_tensor(view)


def decode_pil(data: bytes, recipe: Recipe, train: bool, rng: np.random.Generator,
               transforms: TimmTransforms | None) -> torch.Tensor:
    """JPEG bytes -> (3, size, size) float32, normalised; in training, the rest of the recipe by timm's transforms."""
    view = _view(data, recipe, train, rng)
    return transforms(view, rng) if train and transforms else normalize_pil(view, recipe)


def gpu_decode_available() -> bool:
    """Whether this torchvision has decode_jpeg's GPU operator (0.29 deprecated its decoders). A build without nvjpeg
    has it too, and says so at the first decode."""
    try:
        from torchvision.io import decode_jpeg  # noqa: F401  (registers torch.ops.image)
    except ImportError:
        return False
    return hasattr(torch.ops.image, "decode_jpegs_cuda")


def decode_jpegs(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """JPEG byte tensors -> uint8 (3, H, W) images on `device` (nvjpeg on a GPU); safe to call from a thread."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if device.type != "cuda":
        return decode_jpeg(datas, mode=ImageReadMode.RGB)
    # torchvision's CUDA decode_jpeg writes on a private stream that it does not order after the caller's
    # (pytorch/vision#9606): handed a freed block whose last readers were still queued, it corrupted them (eval
    # counts on one H200). On a stream of its own, the blocks it can be handed are those of its own earlier
    # outputs, and views_gpu records every reader of those, so none is handed over while still read. Waiting for
    # that stream here (in the loader's thread) leaves the readers nothing to wait for on the GPU.
    stream = _stream("decode", device)
    with torch.cuda.stream(stream):
        images = decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)
    stream.synchronize()
    return images


def views_gpu(images: list[torch.Tensor], recipe: Recipe, device: torch.device,
              draws: dict[str, np.ndarray] | None) -> torch.Tensor:
    """decode_jpegs' images -> (B, 3, size, size) float32 for the current stream: training views with the batch's
    draws (draws.py) and the rest of the recipe, or eval views (draws None); on a GPU computed on a stream of their
    own, which overlaps the training step queued before them."""
    if device.type != "cuda":
        return _views(images, recipe, draws)
    stream = _stream("views", device)
    for image in images:
        image.record_stream(stream)
    with torch.cuda.stream(stream):
        views = _views(images, recipe, draws)
    consumer = torch.cuda.current_stream(device)
    consumer.wait_stream(stream)
    views.record_stream(consumer)
    return views


_STREAMS: dict[tuple[str, torch.device], torch.cuda.Stream] = {}
_STREAMS_LOCK = threading.Lock()  # the loader's decode thread and the training thread ask for them


def _stream(role: str, device: torch.device) -> torch.cuda.Stream:
    """The process's stream for `role` on `device`. The views share the SMs with the training step as equals: both
    run at high priority (parallel.own_stream says why the step does)."""
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    with _STREAMS_LOCK:
        if (role, device) not in _STREAMS:
            _STREAMS[role, device] = torch.cuda.Stream(device, priority=-1 if role == "views" else 0)
        return _STREAMS[role, device]


def _views(images: list[torch.Tensor], recipe: Recipe, draws: dict[str, np.ndarray] | None) -> torch.Tensor:
    if draws is None:
        resizes = np.array([eval_resize(image.shape[2], image.shape[1], recipe.size, recipe.eval_crop_pct,
                                        recipe.eval_crop_mode) for image in images])
        views = resize_crop(images, resizes, recipe.size, recipe.eval_interpolation)
    else:
        boxes = np.concatenate([draws["anchor"], draws["shape"]], axis=1)
        views = crop_resize(images, boxes, draws["mirror"], recipe.size, recipe.interpolation)
    views = views.round_().clamp_(0, 255).to(torch.uint8)
    return model_input(views, draws, recipe)

