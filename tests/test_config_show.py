"""`vitctl config show PRESET [--set k=v]`: the fully resolved config as YAML, which loads back as a preset file;
bad presets and keys get the messages `vitctl train` gives."""

import dataclasses
import re

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


@pytest.mark.parametrize(("content", "message"), [
    (b"model: [unclosed\n", "is not valid YAML: line 2, column 1: expected ',' or ']'"),
    (b"model:\n  name: vit_micro\n   img_size: 32\n", "is not valid YAML: line 3, column 12: mapping values are not "
                                                       "allowed here"),
    (b"- 1\n", "holds a list at its top level, not a mapping of sections; write it as `section:` lines (model, data,"),
    (b"model:\n  name: vit_\xff\n", "is not UTF-8 text (line 2, column 13: byte 0xff); save it as UTF-8"),
    (b"model: vit_micro\n", "has sections that are not mappings of keys (model: 'vit_micro'); indent `key: value`"),
], ids=["unclosed", "indent", "list", "latin-1", "flat-section"])
def test_a_bad_config_file_is_named_with_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    shown = vitctl("config", "show", path)
    trained = vitctl("train", "--config", path, "--out", tmp_path / "r", "--executor", "local", "--gpus", 0)
    assert shown.exit_code == trained.exit_code == 1 and shown.stderr == trained.stderr
    assert shown.stderr.startswith(f"error: config file {path} {message}"), shown.stderr
    path.write_text("model:\n  name: vit_micro\n")  # the fix the message asks for
    assert yaml.safe_load(ok("config", "show", path).output)["model"]["name"] == "vit_micro"


def test_a_section_that_is_not_a_mapping_is_named_when_a_flag_sets_that_section_too(tmp_path):
    path = tmp_path / "flat.yaml"
    path.write_text("model: 5\n")
    result = vitctl("train", "--config", path, "--model", "vit_micro", "--out", tmp_path / "r", "--executor", "local",
                    "--gpus", 0, "--dry-run")
    assert result.exit_code == 1 and f"config file {path} has sections that are not mappings of keys (model: 5)" \
        in result.stderr


@pytest.mark.parametrize("name", ["nope.yaml", "configs/nope"])
def test_a_missing_config_file_is_not_taken_for_a_preset(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    shown = vitctl("config", "show", name)
    assert shown.exit_code == 1 and shown.stderr == f"error: config file {name} does not exist; check the path, or " \
                                                    f"pass a preset name\n"


def test_an_override_that_is_not_yaml_is_named(tmp_path):
    shown = vitctl("config", "show", "demo_vit", "--set", "optim.betas=[0.9, 0.95")
    assert shown.exit_code == 1 and "Traceback" not in shown.stderr
    assert shown.stderr.startswith("error: override 'optim.betas=[0.9, 0.95': its value is not valid YAML (line 1, "
                                   "column 11: expected ',' or ']'")
    ok("config", "show", "demo_vit", "--set", "optim.betas=[0.9, 0.95]")


def test_a_config_train_would_refuse_is_shown_then_refused_as_train_refuses_it(tmp_path):
    sets = ["--set", "model.name=swin_micro", "--set", "model.img_size=200", "--set", "train.fused=bogus"]
    shown = vitctl("config", "show", "demo_vit", *sets)
    assert shown.exit_code == 1 and "Traceback" not in shown.stderr
    assert yaml.safe_load(shown.stdout)["model"]["img_size"] == 200  # printed all the same, to edit
    assert shown.stderr.startswith("error: vitctl train would refuse this config: model swin_micro: image size 200 ")
    assert "; --fused: unknown op 'bogus'" in shown.stderr
    trained = vitctl("train", "--config", "demo_vit", *sets, "--set", "data.source=synthetic",
                     "--out", tmp_path / "r", "--executor", "local", "--gpus", 0)
    assert trained.exit_code == 1 and "image size 200" in trained.stderr and "unknown op 'bogus'" in trained.stderr
    nearest = re.search(r"the nearest size that works with window 7 is (\d+) ", shown.stderr).group(1)
    ok("config", "show", "demo_vit", "--set", "model.name=swin_micro", "--set", f"model.img_size={nearest}")


def test_without_a_preset_it_shows_the_defaults_that_train_runs_without_config(tmp_path):
    printed = ok("config", "show", "--set", "data.source=synthetic").output
    (tmp_path / "shown.yaml").write_text(printed)
    assert load_config(str(tmp_path / "shown.yaml")) == load_config(None, ["data.source=synthetic"]) != \
        load_config("demo_vit", ["data.source=synthetic"])
    assert yaml.safe_load(printed)["model"]["name"] == RunConfig().model.name


def test_config_list_names_every_preset_with_what_it_is_and_each_shows():
    """Before, the presets were listed only in the error for an unknown one, and in the README."""
    lines = ok("config", "list").output.splitlines()
    assert [line.split()[0] for line in lines] == sorted(p.stem for p in PRESETS.glob("*.yaml"))
    assert "vit_b16_pretrain       ViT-B/16 on ImageNet-1k from scratch, DeiT-B's recipe" in lines
    for line in lines:
        assert len(line.split()) > 3, line  # a description, not the name alone
        ok("config", "show", line.split()[0])
