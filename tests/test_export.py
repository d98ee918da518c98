"""`vitctl export` and what `finetune --from-ckpt` reads: exports, run folders, checkpoint folders, single-file
checkpoints of earlier versions."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import CLASSES, ok, vitctl
from vitctl.trainer import checkpoint as ckpt
from vitctl.trainer.config import ConfigError, load_config
from vitctl.trainer.loop import train
from vitctl.trainer.models.layers import timm_layout
from vitctl.trainer.pretrained import read_state_dict

BASE = [f"model.num_classes={CLASSES}", "model.img_size=32", "data.batch_size=8", "data.workers=0",
        "data.source=webdataset", "train.precision=fp32", "augment.mixup=0", "augment.cutmix=0",
        "train.checkpoint_every=2", "train.ema_decay=0.9"]


def run(shards: Path, out: Path, *extra: str) -> dict:
    return train(load_config(None, [*BASE, f"data.path={shards}", f"train.out_dir={out}", *extra]))


@pytest.fixture(scope="module")
def micro_run(prepared_shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("micro") / "run"
    run(prepared_shards, out, "model.name=vit_micro", "train.max_steps=3")
    return out


def test_export_has_timm_names_and_timm_loads_it(prepared_shards, tmp_path):
    import timm

    run(prepared_shards, tmp_path / "run", "model.name=vit_s16", "train.max_steps=1")
    ok("export", tmp_path / "run", "--out", tmp_path / "vit.safetensors")
    weights = load_file(tmp_path / "vit.safetensors")
    model = timm.create_model("vit_small_patch16_224", img_size=32, num_classes=CLASSES)
    model.load_state_dict(weights, strict=True)
    saved = timm_layout(ckpt.consolidated(ckpt.list_checkpoints(tmp_path / "run")[-1]))
    assert all(torch.equal(weights[k], saved[k]) for k in saved)


def test_export_of_a_step_and_of_the_ema(micro_run, tmp_path):
    result = ok("export", micro_run, "--step", 2, "--ema", "--out", tmp_path / "ema.safetensors")
    assert "EMA of" in result.output and "step-00000002" in result.output
    ema = load_file(tmp_path / "ema.safetensors")
    saved = timm_layout(ckpt.consolidated(micro_run / "checkpoints/step-00000002", "ema"))
    assert all(torch.equal(ema[k], v) for k, v in saved.items())
    assert not list(tmp_path.glob(".*partial"))


@pytest.mark.parametrize(("args", "message"), [
    (["--step", 7], "has no checkpoint of step 7; it has steps 2, 3"),
    (["--out", "."], "is a folder"),
])
def test_export_errors_say_what_to_do(micro_run, tmp_path, args, message):
    out = [] if "--out" in args else ["--out", tmp_path / "w.safetensors"]
    result = vitctl("export", micro_run, *out, *args)
    assert result.exit_code == 1 and message in result.stderr, result.stderr


def test_export_of_a_folder_without_checkpoints(tmp_path):
    result = vitctl("export", tmp_path, "--out", tmp_path / "w.safetensors")
    assert result.exit_code == 1 and "neither a checkpoint folder nor a run folder" in result.stderr


def test_finetune_reads_exports_run_folders_checkpoints_and_old_single_files(micro_run, tmp_path):
    weights = ckpt.consolidated(ckpt.list_checkpoints(micro_run)[-1])
    ok("export", micro_run, "--out", tmp_path / "w.safetensors")
    old = tmp_path / "step-00000003.pt"  # what vitctl wrote before checkpoints became DCP folders
    torch.save({"format": "vitctl-checkpoint/1", "model": weights, "optimizer": {}}, old)
    for source in (tmp_path / "w.safetensors", micro_run, ckpt.list_checkpoints(micro_run)[-1], old):
        got = read_state_dict(source)
        assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights), source


def test_finetune_from_a_run_folder_at_a_new_resolution(prepared_shards, micro_run, tmp_path):
    result = run(prepared_shards, tmp_path / "ft", "model.name=vit_micro", "model.img_size=48", "train.max_steps=1",
                 f"finetune.from_ckpt={micro_run}")
    assert result["step"] == 1


def test_a_run_folder_of_single_file_checkpoints_is_not_resumed_but_explained(prepared_shards, tmp_path):
    (tmp_path / "run/checkpoints").mkdir(parents=True)
    torch.save({"format": "vitctl-checkpoint/1", "model": {}}, tmp_path / "run/checkpoints/step-00000005.pt")
    with pytest.raises(ConfigError, match="already holds checkpoints .last: step-00000005.pt.; pass --resume"):
        run(prepared_shards, tmp_path / "run", "model.name=vit_micro", "train.max_steps=1")
    with pytest.raises(ConfigError, match="single-file checkpoints of an earlier vitctl .* which --resume cannot "
                                          "continue; start a new run from its weights"):
        train(load_config(None, [*BASE, "model.name=vit_micro", f"data.path={prepared_shards}",
                                 f"train.out_dir={tmp_path / 'run'}"]), resume=True)
