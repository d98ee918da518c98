"""The GPU paths apply the recipe as the reference does, judged by statistics over the same images: the index
loader's PIL workers (timm's transforms, the reference) against DALI and against the index loader's pil-crop and
nvjpeg branches, each on the CPU and (marked gpu) on the GPU. Each check runs N draws through each loader (the same
crops, their own RandAugment and erasing draws) and compares them; tolerances are Z standard errors of what is
compared, computed from the draws themselves, so a chance failure has odds of about 1e-4 per check."""

import importlib.util
import io
import itertools
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import stats
from test_recipe import smooth_image

from vitctl.trainer.data import dali, draws
from vitctl.trainer.data.augment import Recipe
from vitctl.trainer.data.images import sample_rng, train_view
from vitctl.trainer.data.loader import LoaderSpec, TrainBatches
from vitctl.trainer.data.plan import EpochPlan
from vitctl.trainer.data.shards import SampleTable

pytestmark = pytest.mark.dali

SIZE, BATCH, SEED = 32, 64, 11
IMAGES, DRAWS = 64, 1024  # 16 epochs of 64 images: each epoch draws every image anew
Z = 4.0  # standard errors allowed: two-sided p of 6e-5 for a normal statistic
P_MIN = 1e-4  # for the distribution tests (chi-square, Kolmogorov-Smirnov)


def write_table(folder: Path, images: list[np.ndarray]) -> SampleTable:
    """The images as JPEGs in one file, a table of their offsets: what the loaders read from shards."""
    blobs = []
    for pixels in images:
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="JPEG", quality=95)
        blobs.append(out.getvalue())
    path = folder / "images.bin"
    path.write_bytes(b"".join(blobs))
    sizes = np.array([len(b) for b in blobs])
    return SampleTable([str(path)], np.zeros(len(blobs), np.int32), np.concatenate([[0], np.cumsum(sizes)[:-1]]),
                       sizes.astype(np.int32), np.zeros(len(blobs), np.int64))


_ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# CI installs DALI, so its CPU rows always run; the GPU machine may lack it (its wheels travel apart)
_DALI_ON_GPU = [*_ON_GPU,
                pytest.mark.skipif(importlib.util.find_spec("nvidia.dali") is None, reason="needs nvidia-dali")]


@pytest.fixture(params=[*[(kind, "cpu") for kind in ("dali", "pil-crop", "nvjpeg")],
                        pytest.param(("dali", "cuda"), marks=_DALI_ON_GPU),
                        *[pytest.param((kind, "cuda"), marks=_ON_GPU) for kind in ("pil-crop", "nvjpeg")]],
                ids=lambda p: "-".join(p))
def gpu_path(request) -> tuple[str, str]:
    """A GPU path and where it runs: DALI's pipeline, or the index loader's pil-crop or nvjpeg branch, on the CPU, or
    on the GPU with the recipe's torch ops (and nvjpeg's decode) there."""
    return request.param


def run(kind: str, device: str, table: SampleTable, recipe: Recipe) -> tuple[torch.Tensor, np.ndarray]:
    """DRAWS images from one loader (index: the reference, timm's transforms), as normalised floats on the CPU, and
    the (epoch, sample) each was drawn as."""
    branch = "pil" if kind in ("index", "dali") else kind
    spec = LoaderSpec(recipe, SEED, workers=0, device=torch.device(device), branch=branch)
    plan = EpochPlan(len(table), BATCH, 0, 1, SEED)
    batches = dali.DaliTrainBatches(table, spec, plan, threads=2) if kind == "dali" else TrainBatches(table, spec, plan)
    images, rows = zip(*((b[0].cpu(), b[2]) for b in itertools.islice(batches(0, 0), DRAWS // BATCH)), strict=True)
    epochs = np.repeat(np.arange(DRAWS // len(table)), len(table))
    return torch.cat(images), np.stack([epochs, torch.cat(rows).numpy()], 1)


def pixels(images: torch.Tensor, recipe: Recipe) -> torch.Tensor:
    """Normalised images back to grey levels."""
    return images * torch.tensor(recipe.std).view(1, 3, 1, 1) * 255 + torch.tensor(recipe.mean).view(1, 3, 1, 1) * 255


def assert_close(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """Paired means within Z standard errors of the mean difference (the draws share their crops)."""
    difference = a - b
    error = difference.std(ddof=1) / np.sqrt(len(difference))
    assert abs(difference.mean()) <= Z * error, f"{what}: {a.mean():.4f} vs {b.mean():.4f}, tolerance {Z * error:.4f}"


def assert_same_mean(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """Means within Z standard errors of two samples' difference."""
    error = np.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    assert abs(a.mean() - b.mean()) <= Z * error, f"{what}: {a.mean():.4f} vs {b.mean():.4f}, tolerance {Z * error:.4f}"


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> SampleTable:
    return write_table(tmp_path_factory.mktemp("photos"), [smooth_image(40, 48, seed) for seed in range(IMAGES)])


def test_the_swin_recipe_gives_the_same_pixel_statistics_and_op_histogram(photos, monkeypatch, gpu_path):
    recipe = Recipe(SIZE, rand_augment="rand-m9-mstd0.5-inc1", reprob=0.25)
    drawn = Counter()

    def counting(rng, spec, size):
        ops = draw(rng, spec, size)
        drawn.update(op.name for op in ops if op)
        return ops

    draw = draws.draw_rand_augment
    monkeypatch.setattr(draws, "draw_rand_augment", counting)  # workers=0: the draws run in this process
    gpu_images, _ = run(*gpu_path, photos, recipe)

    applied = Counter()
    spec = LoaderSpec(recipe, SEED, workers=0, device=torch.device("cpu"), branch="pil")
    loader = TrainBatches(photos, spec, EpochPlan(len(photos), BATCH, 0, 1, SEED))
    for op in loader.dataset.transforms.secondary.transforms[0].ops:  # timm's RandAugment: count what it applies
        op.aug_fn = lambda image, *args, _fn=op.aug_fn, _name=op.name, **kw: applied.update([_name]) or _fn(
            image, *args, **kw)
    cpu_images = torch.cat([b[0] for b in itertools.islice(loader(0, 0), DRAWS // BATCH)])

    for channel in range(3):
        for statistic in ("mean", "std"):
            a = getattr(cpu_images[:, channel].flatten(1), statistic)(1).numpy()
            b = getattr(gpu_images[:, channel].flatten(1), statistic)(1).numpy()
            assert_close(a, b, f"per-image {statistic} of channel {channel}")
    # Each of 2 layers per image applies its op with p = 0.5: a binomial count of 2 x DRAWS trials, on each side.
    total_cpu, total_gpu, trials = sum(applied.values()), sum(drawn.values()), 2 * DRAWS
    assert abs(total_cpu - total_gpu) <= Z * np.sqrt(2 * trials * 0.25), (total_cpu, total_gpu)
    assert abs(total_gpu - trials / 2) <= Z * np.sqrt(trials * 0.25)
    names = sorted(set(applied) | set(drawn))
    assert len(names) == 15
    _, p, _, _ = stats.chi2_contingency([[applied[n] for n in names], [drawn[n] for n in names]])
    assert p > P_MIN, (applied, drawn)


def test_colour_jitter_gives_the_same_pixel_statistics(photos, gpu_path):
    """torchvision's ColorJitter in a random order against brightness, contrast, saturation in a fixed one."""
    recipe = Recipe(SIZE, color_jitter=0.4)
    cpu_images, gpu_images = run("index", "cpu", photos, recipe)[0], run(*gpu_path, photos, recipe)[0]
    for channel in range(3):
        for statistic in ("mean", "std"):
            a = getattr(cpu_images[:, channel].flatten(1), statistic)(1).numpy()
            b = getattr(gpu_images[:, channel].flatten(1), statistic)(1).numpy()
            assert_close(a, b, f"per-image {statistic} of channel {channel}")


def test_the_crop_scale_distribution_is_the_same(tmp_path, gpu_path):
    """Ramps (red along x, green along y) show each output's crop: its width and height from the ramps' span."""
    height, width = 48, 64
    y, x = np.mgrid[0:height, 0:width]
    ramp = np.stack([x * 255 / (width - 1), y * 255 / (height - 1), np.full_like(x, 128.0)], -1).astype(np.uint8)
    table = write_table(tmp_path, [ramp] * IMAGES)
    recipe = Recipe(SIZE, hflip=False)
    scales = {}
    for kind, device in (("index", "cpu"), gpu_path):
        images, keys = run(kind, device, table, recipe)
        red, green = pixels(images, recipe)[:, 0].numpy(), pixels(images, recipe)[:, 1].numpy()
        span = SIZE / (SIZE - 1) / 255  # from the first to the last output pixel's centre
        crop_w = (red[:, :, -1].mean(1) - red[:, :, 0].mean(1)) * span * (width - 1)
        crop_h = (green[:, -1, :].mean(1) - green[:, 0, :].mean(1)) * span * (height - 1)
        scales[kind] = crop_w * crop_h / (width * height)
    truth = np.array([np.prod(train_view(sample_rng(SEED, e, r), width, height, 0.08, False)[0][2:]) / (width * height)
                      for e, r in keys])
    gpu = gpu_path[0]
    assert stats.ks_2samp(scales["index"], scales[gpu]).pvalue > P_MIN
    assert_same_mean(scales["index"], scales[gpu], "crop scale")
    for kind in ("index", gpu):  # each output shows the crop its sample drew, to a resampling's blur at the edges
        assert np.abs(scales[kind] - truth).mean() < 0.02, kind


def test_random_erasing_erases_as_often_as_much_and_with_the_same_noise(tmp_path, gpu_path):
    """Flat images: an erased pixel is one off its image's flat colour; pixel mode fills with N(0, 1) noise."""
    colours = np.random.default_rng(3).integers(30, 220, size=(IMAGES, 3))
    table = write_table(tmp_path, [np.broadcast_to(c, (40, 48, 3)).astype(np.uint8) for c in colours])
    recipe = Recipe(SIZE, reprob=0.25)
    erased, area, noise = {}, {}, {}
    for kind, device in (("index", "cpu"), gpu_path):
        images, _ = run(kind, device, table, recipe)
        flat = images.flatten(2).median(2).values[:, :, None, None]
        mask = ((images - flat).abs() > 0.05).any(1)  # 0.05 is 3 grey levels; noise falls that close in 1e-4 cases
        fraction = mask.flatten(1).float().mean(1).numpy()
        erased[kind], area[kind] = fraction > 0, fraction[fraction > 0]
        noise[kind] = images.permute(1, 0, 2, 3)[:, mask].flatten().numpy()
    n, p, gpu = DRAWS, 0.25, gpu_path[0]
    assert abs(erased["index"].mean() - erased[gpu].mean()) <= Z * np.sqrt(2 * p * (1 - p) / n)
    assert abs(erased[gpu].mean() - p) <= Z * np.sqrt(p * (1 - p) / n)
    assert_same_mean(area["index"], area[gpu], "erased area")
    for kind, values in noise.items():  # per-pixel N(0, 1); pixels of one box are independent
        n = len(values)
        assert abs(values.mean()) <= Z / np.sqrt(n) and abs(values.std() - 1) <= Z / np.sqrt(2 * n), kind
