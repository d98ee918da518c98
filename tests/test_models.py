"""Our model files against timm's: same state_dict names, same logits; official Swin and finetune loading."""

import re

import pytest
import timm
import torch

from vitctl.trainer.config import ConfigError, ModelConfig
from vitctl.trainer.models import build_model, weights_of
from vitctl.trainer.models.layers import patch_projection
from vitctl.trainer.ops import resolve
from vitctl.trainer.pretrained import load_pretrained

CPU = torch.device("cpu")


def ours(name: str, **kw) -> torch.nn.Module:
    return build_model(ModelConfig(name=name, drop_path=0.0, **kw), resolve("none", CPU)).eval()


@pytest.mark.parametrize(("name", "timm_name"), [("vit_s16", "vit_small_patch16_224"),
                                                 ("swin_t", "swin_tiny_patch4_window7_224")])
def test_timm_weights_load_and_give_the_same_logits(name, timm_name, tmp_path):
    torch.manual_seed(0)
    theirs = timm.create_model(timm_name, pretrained=False).eval()
    path = tmp_path / "timm.pth"
    torch.save(theirs.state_dict(), path)
    model = ours(name)
    assert load_pretrained(model, path, None, name) == []
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model(x), theirs(x), rtol=1e-4, atol=1e-4)
    ops_model = build_model(ModelConfig(name=name, drop_path=0.0), resolve("all", CPU)).eval()
    ops_model.load_state_dict(model.state_dict())
    with torch.no_grad():  # the sdpa seams compute the same function as the reference ones
        torch.testing.assert_close(ops_model(x), theirs(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("patch", [4, 16])
def test_patch_projection_is_the_strided_convolution(patch):
    conv = torch.nn.Conv2d(3, 24, patch, patch)
    x = torch.randn(2, 3, 3 * patch, 5 * patch)
    torch.testing.assert_close(patch_projection(x, conv), conv(x).permute(0, 2, 3, 1), rtol=1e-5, atol=1e-5)


def _official_layout(state: dict) -> dict:
    """timm's Swin names -> the official repository's (patch merging at the end of the previous stage)."""
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        if parts[0] == "layers" and parts[2] == "downsample":
            parts[1] = str(int(parts[1]) - 1)
        if parts[:2] == ["head", "fc"]:
            parts = ["head", *parts[2:]]
        out[".".join(parts)] = value
        if key.endswith("relative_position_bias_table"):
            out[".".join(parts).replace("bias_table", "index")] = torch.zeros(49, 49, dtype=torch.long)
    return out


def test_official_swin_checkpoint_under_model_key_loads(tmp_path):
    torch.manual_seed(1)
    theirs = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False).eval()
    path = tmp_path / "swin_tiny_patch4_window7_224.pth"
    torch.save({"model": _official_layout(theirs.state_dict()), "epoch": 300}, path)
    model = ours("swin_t")
    load_pretrained(model, path, None, "swin_t")
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(model(x), theirs(x), rtol=1e-4, atol=1e-4)


def test_head_is_swapped_when_classes_differ_and_pre_logits_dropped(tmp_path):
    source = ours("vit_micro", img_size=32, num_classes=21, pre_logits=True)
    path = tmp_path / "pretrain.pt"
    torch.save(source.state_dict(), path)
    target = ours("vit_micro", img_size=32, num_classes=10)
    fresh = load_pretrained(target, path, None, "vit_micro")
    assert fresh == ["head.bias", "head.weight"]
    assert torch.equal(target.blocks[2].mlp.fc1.weight, source.blocks[2].mlp.fc1.weight)
    assert target(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_vit_position_embeddings_are_interpolated_for_a_new_resolution(tmp_path):
    source = ours("vit_micro", img_size=32)
    path = tmp_path / "a.pt"
    torch.save(source.state_dict(), path)
    target = ours("vit_micro", img_size=64)
    load_pretrained(target, path, None, "vit_micro")
    assert target.pos_embed.shape == (1, 1 + 8 * 8, 96)
    assert torch.equal(target.pos_embed[0, 0], source.pos_embed[0, 0])  # class token kept
    grid = target.pos_embed[0, 1:].reshape(8, 8, 96)
    assert torch.allclose(grid.mean(), source.pos_embed[0, 1:].mean(), atol=0.02)


def test_swin_relative_tables_are_interpolated_for_a_new_window(tmp_path):
    source = ours("swin_micro", img_size=64, window_size=4)  # 224/7 -> 384/12 in miniature
    path = tmp_path / "a.pt"
    torch.save({"model": source.state_dict()}, path)
    target = ours("swin_micro", img_size=96, window_size=6)
    load_pretrained(target, path, None, "swin_micro")
    table = target.layers[0].blocks[0].attn.relative_position_bias_table
    assert table.shape == ((2 * 6 - 1) ** 2, 1)
    centre = source.layers[0].blocks[0].attn.relative_position_bias_table.view(7, 7)[3, 3]
    assert torch.allclose(table.view(11, 11)[5, 5], centre, atol=1e-5)  # the zero offset stays at the centre
    assert target(torch.randn(1, 3, 96, 96)).shape == (1, 1000)


def test_mismatched_architecture_names_the_keys_and_the_model_the_file_holds(tmp_path):
    path = tmp_path / "vit.pt"
    torch.save(ours("vit_micro", img_size=32).state_dict(), path)
    with pytest.raises(ConfigError, match=r"does not fit model swin_micro: missing \(\d+\): layers\.0\..*unexpected.*; "
                                          r"the file holds the weights of a vit_micro: finetune them with --model "
                                          r"vit_micro, or use weights of a swin_micro$"):
        load_pretrained(ours("swin_micro", img_size=32, window_size=4), path, None, "swin_micro")


def test_swin_weights_of_another_width_name_the_model_and_window_and_the_fix_loads_them(tmp_path):
    path = tmp_path / "swin.pt"
    torch.save(ours("swin_mini", img_size=32, window_size=4).state_dict(), path)
    with pytest.raises(ConfigError, match=r"the file holds the weights of a swin_mini at window 4: finetune them with "
                                          r"--model swin_mini,") as error:
        load_pretrained(ours("swin_micro", img_size=32, window_size=4), path, None, "swin_micro")
    named = re.search(r"--model (\w+)", str(error.value)).group(1)
    assert load_pretrained(ours(named, img_size=64, window_size=8), path, None, named) == []  # the table resized


def test_state_roots_are_the_models_own():
    for name, extra in (("vit_micro", {"pre_logits": True}), ("swin_micro", {"window_size": 4})):
        model = ours(name, img_size=32, **extra)
        assert {key.split(".")[0] for key in model.state_dict()} == type(model).STATE_ROOTS


@pytest.mark.parametrize(("timm_name", "held"), [("vit_base_patch16_224", ("vit_b16", None)),
                                                 ("swin_tiny_patch4_window7_224", ("swin_t", 7)),
                                                 ("swin_base_patch4_window12_384", ("swin_b", 12)),
                                                 ("deit_tiny_patch16_224", None),
                                                 ("deit_base_distilled_patch16_224", None)])
def test_timm_weights_are_named_by_the_model_they_fit(timm_name, held):
    with torch.device("meta"):
        state = timm.create_model(timm_name).state_dict()
    assert weights_of(state) == held


def test_bad_image_size_for_the_window_is_a_config_error():
    with pytest.raises(ConfigError, match="multiple of the window"):
        ours("swin_t", img_size=256)
    with pytest.raises(ConfigError, match="not a multiple of 32"):
        ours("swin_t", img_size=200)


@pytest.mark.parametrize(("name", "window"),
                         [("swin_micro", 4), ("swin_micro", 7), ("swin_t", 12), ("vit_micro", None)])
def test_a_refused_image_size_names_the_nearest_that_builds(name, window):
    suggested = set()
    for size in range(17, 500, 5):
        try:
            ours(name, img_size=size, window_size=window)
        except ConfigError as e:
            suggested.add(int(str(e).rsplit(" ", 1)[1]))
    assert suggested
    for size in suggested:
        ours(name, img_size=size, window_size=window)(torch.zeros(1, 3, size, size))


def test_mac_counts_match_published_figures():
    assert ours("swin_t").flops_per_image() / 2e9 == pytest.approx(4.51, rel=0.01)
    assert ours("vit_b16").flops_per_image() / 2e9 == pytest.approx(17.58, rel=0.01)
