import pytest

from vitctl.trainer.config import PRESETS, ConfigError, load_config, parse_override
from vitctl.trainer.preflight import preflight


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS.glob("*.yaml")))
def test_every_preset_loads_and_validates(preset):
    config = load_config(preset, ["data.path=/somewhere"])
    assert config.model.name and config.train.out_dir


def test_overrides_win_over_presets_and_read_yaml_values():
    config = load_config("swin_b_pretrain", ["data.path=/d", "optim.lr=5e-3", "train.compile=false",
                                             "optim.betas=[0.8, 0.95]", "train.max_steps=10"])
    assert config.optim.lr == 5e-3 and config.train.compile is False
    assert config.optim.betas == (0.8, 0.95) and config.train.max_steps == 10
    assert config.model.name == "swin_b" and config.model.drop_path == 0.5


@pytest.mark.parametrize(("override", "message"), [
    ("optim.lrr=1", "unknown keys \\['optim.lrr'\\]"),
    ("train.precision=fp8", "train.precision must be one of"),
    ("data.batch_size=big", "data.batch_size: expected int"),
    ("optim.betas=[0.9]", "expected a list of 2 values"),
    ("model.drop_path=1.5", "model.drop_path must be in"),
    ("nonsense", "not of the form section.key=value"),
    ("train.compile_mode=fastest", "train.compile_mode must be one of default, reduce-overhead"),
])
def test_bad_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("vit_b16_pretrain", ["data.path=/d", override])


def test_a_compile_mode_needs_compile():
    with pytest.raises(ConfigError, match="train.compile_mode=reduce-overhead needs train.compile=true"):
        load_config("vit_b16_pretrain", ["data.path=/d", "train.compile=false", "train.compile_mode=reduce-overhead"])
    assert load_config("vit_b16_pretrain", ["data.path=/d", "train.compile_mode=reduce-overhead"]).train.compile


def test_data_path_is_required_unless_synthetic():
    with pytest.raises(ConfigError, match="data.path is required"):
        preflight(load_config("vit_b16_pretrain"), 1, None)
    assert load_config("vit_b16_pretrain", ["data.source=synthetic"]).data.path is None


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match="swin_t_pretrain"):
        load_config("swin_xxl")


def test_parse_override_nests_keys():
    assert parse_override("a.b.c=3") == {"a": {"b": {"c": 3}}}
