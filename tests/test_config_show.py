"""`vitctl config show PRESET [--set k=v]`: the fully resolved config as YAML, which loads back as a preset file;
bad presets and keys get the messages `vitctl train` gives."""

import dataclasses

import pytest
import yaml

from conftest import ok, vitctl
from vitctl.trainer.config import PRESETS, RunConfig, load_config


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS.glob("*.yaml")))
def test_the_printed_config_loads_back_as_the_same_config(preset, tmp_path):
    sets = ["data.path=/data/shards", "optim.lr=3e-4", "train.ema_decay=0.9999"]
    printed = ok("config", "show", preset, *(a for s in sets for a in ("--set", s))).output
    (tmp_path / "shown.yaml").write_text(printed)
    assert load_config(str(tmp_path / "shown.yaml")) == load_config(preset, sets)


def test_every_section_and_key_is_printed_defaults_included():
    shown = yaml.safe_load(ok("config", "show", "demo_vit", "--set", "data.source=synthetic").output)
    assert {section: set(keys) for section, keys in shown.items()} == \
        {f.name: {k.name for k in dataclasses.fields(f.default_factory)} for f in dataclasses.fields(RunConfig)}
    assert shown["optim"]["betas"] == [0.9, 0.999] and shown["train"]["ema_decay"] is None  # defaults
    assert shown["model"]["name"] == "vit_micro" and shown["data"]["source"] == "synthetic"  # preset, --set


@pytest.mark.parametrize("args", [["no_such_preset"], ["demo_vit", "--set", "optim.lr_typo=1"],
                                  ["demo_vit", "--set", "train.precision=fp64"]])
def test_bad_presets_and_keys_fail_as_train_does(args, tmp_path):
    shown = vitctl("config", "show", *args)
    preset, *sets = args
    trained = vitctl("train", "--config", preset, *sets, "--out", tmp_path / "r", "--executor", "local", "--gpus", 0)
    assert shown.exit_code == trained.exit_code == 1
    assert shown.stderr.startswith("error: ") and shown.stderr == trained.stderr and "Traceback" not in shown.stderr


def test_a_preset_shows_without_data_which_train_then_asks_for(tmp_path):
    shown = yaml.safe_load(ok("config", "show", "swin_b_pretrain").output)
    assert shown["data"]["path"] is None and shown["model"]["name"] == "swin_b"
    trained = vitctl("train", "--config", "swin_b_pretrain", "--out", tmp_path / "r", "--executor", "local",
                     "--gpus", 0)
    assert trained.exit_code == 1 and "data.path is required (or data.source=synthetic)" in trained.stderr
