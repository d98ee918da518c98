"""The recipe's pieces against timm, the reference: RandAugment strings, each model family's eval view and
normalisation, the crop fallback, the eval view itself, RandAugment's ops in DALI op by op; and that the CPU path's
randomness comes from the sample's generator alone."""

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image
from scipy.ndimage import gaussian_filter

from vitctl.trainer.config import ConfigError, load_config
from vitctl.trainer.data import build_data
from vitctl.trainer.data.augment import Recipe, TimmTransforms, recipe_of
from vitctl.trainer.data.draws import draw_sample, stack_draws
from vitctl.trainer.data.images import _view, crop_box, decode_jpegs, decode_pil, sample_rng, views_gpu
from vitctl.trainer.models import MODELS
from vitctl.trainer.recipe import model_eval, parse_rand_augment


def smooth_image(height: int, width: int, seed: int) -> np.ndarray:
    """A smooth, asymmetric colour field using all 256 levels: RandAugment's ops behave as on photographs."""
    rng = np.random.default_rng(seed)
    image = np.stack([gaussian_filter(rng.random((height, width)), 3) for _ in range(3)], -1)
    return ((image - image.min()) / (image.max() - image.min()) * 255).astype(np.uint8)


def jpeg(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    return out.getvalue()


@pytest.mark.parametrize("text", ["rand-m9-mstd0.5-inc1", "rand-m7-n3-p0.8", "rand-m9-mstd101", "rand-mmax15-m12-inc0",
                                  "rand"])
def test_rand_augment_strings_parse_as_timm_reads_them(text):
    from timm.data.auto_augment import rand_augment_transform

    spec, reference = parse_rand_augment(text), rand_augment_transform(text, {})
    assert reference.num_layers == spec.layers and [op.name for op in reference.ops] == list(spec.ops)
    for op in reference.ops:
        assert (op.prob, op.magnitude, op.magnitude_max or 10) == (spec.prob, spec.magnitude, spec.magnitude_max)
        assert op.magnitude_std == spec.magnitude_std


@pytest.mark.parametrize(("text", "message"), [
    ("rand-m9-foo1", "unknown section 'foo1'"),
    ("rand-m9.5", "section 'm9.5' needs an integer after 'm'"),
    ("randaug-m9", "does not start with 'rand'"),
    ("rand-m9-tweights", "picks a weighted op set"),
    ("rand-n0", "n must be at least 1"),
])
def test_a_bad_rand_augment_string_is_refused_when_the_config_loads(text, message):
    with pytest.raises(ConfigError, match=f"augment.rand_augment: .*{message}.*write it as rand-m<int>"):
        load_config("swin_b_pretrain", ["data.path=/d", f"augment.rand_augment={text}"])


@pytest.mark.parametrize(("name", "size", "timm_name"), [
    *[(name, 224, spec.timm_name) for name, spec in MODELS.items() if spec.timm_name],
    ("swin_l", 384, "swin_large_patch4_window12_384"), ("swin_b", 384, "swin_base_patch4_window12_384"),
    ("vit_b16", 384, "vit_base_patch16_384")])
def test_each_family_evaluates_as_timm_s_pretrained_config_says(name, size, timm_name):
    from timm.models import get_pretrained_cfg

    cfg, ours = get_pretrained_cfg(timm_name), model_eval(name, size)
    assert (ours.crop_pct, ours.crop_mode, ours.interpolation) == (cfg.crop_pct, cfg.crop_mode, cfg.interpolation)
    assert (ours.mean, ours.std) == (tuple(cfg.mean), tuple(cfg.std))


@pytest.mark.parametrize(("preset", "crop", "mean"), [
    ("swin_b_pretrain", (0.875, "center", "bicubic"), (0.485, 0.456, 0.406)),  # Swin's TEST.CROP: 256 -> 224
    ("swin_l_22k_to_1k_384", (1.0, "squash", "bicubic"), (0.485, 0.456, 0.406)),  # TEST.CROP False
    ("vit_b16_pretrain", (0.875, "center", "bicubic"), (0.485, 0.456, 0.406)),  # DeiT: eval_crop_ratio, ImageNet's
    ("demo_vit", (0.9, "center", "bicubic"), (0.5, 0.5, 0.5)),  # the ViT family's default
])
def test_presets_resolve_their_eval_view_and_normalisation(preset, crop, mean):
    recipe = recipe_of(load_config(preset, ["data.path=/d"]))
    assert (recipe.eval_crop_pct, recipe.eval_crop_mode, recipe.eval_interpolation) == crop and recipe.mean == mean


@pytest.mark.parametrize(("shape", "crop_pct", "mode"), [((48, 64), 0.875, "center"), ((64, 48), 0.9, "center"),
                                                          ((48, 64), 1.0, "squash"), ((48, 64), 1.0, "center")])
def test_the_eval_view_is_timm_s(shape, crop_pct, mode):
    from timm.data.transforms_factory import transforms_imagenet_eval

    data, recipe = jpeg(smooth_image(*shape, seed=2)), Recipe(32, eval_crop_pct=crop_pct, eval_crop_mode=mode)
    reference = transforms_imagenet_eval(32, crop_pct=crop_pct, crop_mode=mode, interpolation="bicubic",
                                         mean=recipe.mean, std=recipe.std)(Image.open(io.BytesIO(data)).convert("RGB"))
    # one resampling instead of timm's resize then crop: a rounding apart (0.02 is 1.2 grey levels)
    assert (decode_pil(data, recipe, False, None, None) - reference).abs().max() < 0.04


@pytest.mark.parametrize("train", [True, False])
def test_the_nvjpeg_branch_shows_the_same_views_as_pil(train):
    """The nvjpeg branch runs on CPU tensors too: the same crop, flip and eval view as PIL, up to resampling."""
    data, recipe = jpeg(smooth_image(48, 64, seed=5)), Recipe(32, eval_crop_pct=0.875)
    draws = stack_draws([draw_sample(data, recipe, np.random.default_rng(seed)) for seed in range(2)]) if train \
        else None
    datas = [torch.frombuffer(bytearray(data), dtype=torch.uint8)] * 2
    gpu = views_gpu(decode_jpegs(datas, torch.device("cpu")), recipe, torch.device("cpu"), draws)
    pil = [decode_pil(data, recipe, train, np.random.default_rng(seed), None) for seed in range(2)]
    assert all((g - p).abs().mean() < 0.03 for g, p in zip(gpu, pil, strict=True))  # 0.03: 1.7 grey levels


@pytest.mark.parametrize("train", [True, False])
def test_the_pil_crop_branch_shows_the_pil_path_s_views_with_its_draws(tmp_path, train):
    """A pil-crop item, its JPEG opened once: the PIL path's crop and flip of the same seed exactly, and the draws
    draw_sample gives (or none, for eval)."""
    from vitctl.trainer.data.loader import LoaderSpec, ShardImages
    from vitctl.trainer.data.shards import SampleTable

    data, recipe = jpeg(smooth_image(48, 64, seed=5)), Recipe(32, rand_augment="rand-m9-mstd0.5-inc1", reprob=0.5)
    (tmp_path / "s.tar").write_bytes(data)
    table = SampleTable([str(tmp_path / "s.tar")], np.zeros(1, np.int32), np.zeros(1, np.int64),
                        np.array([len(data)], np.int32), np.zeros(1, np.int64))
    images = ShardImages(table, LoaderSpec(recipe, 7, 0, torch.device("cpu"), "pil-crop"), train)
    for draw in range(8):
        view, _, _, draws = images[(3, 0, draw)]
        expected = np.array(_view(data, recipe, train, sample_rng(7, 3, draw)))
        assert torch.equal(view, torch.from_numpy(expected).permute(2, 0, 1))
        if train:
            reference = draw_sample(data, recipe, sample_rng(7, 3, draw))
            assert all(np.array_equal(draws[k], reference[k]) for k in reference) and draws.keys() == reference.keys()
        else:
            assert draws is None


def test_a_crop_that_never_fits_falls_back_as_torchvision_s():
    from torchvision.transforms import RandomResizedCrop

    image = Image.new("RGB", (400, 50))
    top, left, h, w = RandomResizedCrop.get_params(image, scale=(0.9, 1.0), ratio=(3 / 4, 4 / 3))
    assert crop_box(np.random.default_rng(0), 400, 50, 0.9) == (left, top, w, h) == (166, 0, 67, 50)


def _seed_trainer_streams(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _trainer_draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_timm_transforms_draw_from_the_sample_generator_and_leave_the_trainer_s_streams_alone():
    transforms = TimmTransforms(Recipe(32, rand_augment="rand-m9-mstd0.5-inc1", color_jitter=0.4, reprob=1.0))
    image = Image.fromarray(smooth_image(32, 32, seed=3))
    _seed_trainer_streams(1)
    expected = _trainer_draws()
    _seed_trainer_streams(1)
    views = [transforms(image, np.random.default_rng(seed)) for seed in (7, 7, 8)]
    a, b, c = _trainer_draws()
    assert (a, b) == expected[:2] and torch.equal(c, expected[2])
    assert torch.equal(views[0], views[1]) and not torch.equal(views[0], views[2])


def test_posterize_at_magnitude_10_blacks_the_image_where_stock_timm_now_raises():
    """PosterizeIncreasing at magnitude 10 keeps 0 bits: Pillow 11+ refuses that (timm passes it on); rand-m9-mstd0.5
    reaches magnitude 10 in 2% of its draws. With 15 ops of 15 drawn per image, most images draw it."""
    from timm.data.auto_augment import rand_augment_transform

    image, text = Image.fromarray(smooth_image(32, 32, seed=4)), "rand-m10-n15-p1.0-inc1"
    transforms = TimmTransforms(Recipe(32, rand_augment=text))
    assert all(transforms(image, np.random.default_rng(seed)).shape == (3, 32, 32) for seed in range(10))
    stock = rand_augment_transform(text, {})
    _seed_trainer_streams(0)
    with pytest.raises(ValueError, match="bits must be between"):
        for _ in range(10):
            stock(image)


@pytest.mark.parametrize(("device", "decode", "branch"), [("cuda", None, "nvjpeg"), ("cuda", "pil-crop", "pil-crop"),
                                                       ("cpu", "nvjpeg", "pil")])
def test_the_index_loader_runs_the_recipe_on_a_gpu_and_timm_s_transforms_on_the_cpu(prepared_shards, device, decode,
                                                                                      branch):
    """data.decode picks the GPU branch, train and eval alike; the CPU runs the reference. (Nothing touches the GPU
    until the batches are iterated.)"""
    config = load_config("demo_vit", [f"data.path={prepared_shards}", "data.source=webdataset",
                                      "augment.rand_augment=rand-m9-mstd0.5-inc1", "augment.reprob=0.25",
                                      "model.num_classes=5", *([f"data.decode={decode}"] if decode else [])])
    data = build_data(config, 0, 1, torch.device(device))
    assert data.train.spec.branch == data.eval.spec.branch == branch
    assert (data.train.dataset.transforms is not None) is (branch == "pil")


def test_an_unknown_decode_branch_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="data.decode must be one of pil, pil-crop, nvjpeg, got 'gpu'"):
        load_config("demo_vit", ["data.decode=gpu"])


class _Sign:
    """A stand-in generator for _rand_op's random negation: random() > 0.5 negates, as timm's random.random()."""

    def __init__(self, value: float) -> None:
        self.value = value

    def random(self) -> float:
        return self.value
