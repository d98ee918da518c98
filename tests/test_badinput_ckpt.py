"""Checkpoints, --resume, export and finetune with damaged, hostile or interrupted input: a full disk during a save, a
step folder that lost a file, a meta.json of the wrong shape, an --out that would destroy something, a position table
of another layout, another model on --resume. Each gets one message whose fix, followed, works."""

import json
import logging
import os
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import test_checkpoint_input as base
import torch
from safetensors.torch import load_file, save_file

from conftest import CLASSES, ok, vitctl
from vitctl.trainer import checkpoint as ckpt
from vitctl.trainer.config import ConfigError, ModelConfig, load_config
from vitctl.trainer.loop import train
from vitctl.trainer.models import build_model
from vitctl.trainer.ops import resolve
from vitctl.trainer.pretrained import load_pretrained, read_state_dict
from vitctl.workflows.train import check_resumable

SETS, config, follow = base.SETS, base.config, base.follow
pretrained, run_copy = base.pretrained, base.run_copy  # fixtures: a run with checkpoints of steps 2 and 3, a copy


def events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def no_traceback(result) -> None:
    assert "Traceback" not in result.output + result.stderr, result.output + result.stderr


# ---------------------------------------------------------------- a disk that fills up during a save


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of `size` bytes (root only), grown by calling the fixture's value again; unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()

    def mount(size: int, remount: bool = False) -> Path:
        options = f"{'remount,' if remount else ''}size={size}"
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(disk)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        return disk

    yield mount
    subprocess.run(["umount", str(disk)], capture_output=True)


def test_a_full_disk_stops_the_run_keeps_the_last_checkpoint_and_resume_goes_on(pretrained, small_disk):
    """torch's writer reports the full disk as `RuntimeError: unexpected pos`, and the rank's log and result lie on
    the same disk: before, the job ended in `no rank reported an error (killed, or out of memory?)`, its unfinished
    save filling the disk."""
    saved = sum(f.stat().st_size for f in ckpt.list_checkpoints(pretrained)[-1].iterdir())
    run = small_disk(2 * saved + 4 * 2**20) / "run"  # room for the checkpoints of steps 2 and 4, not for step 6's
    result = vitctl("train", "--out", run, "--executor", "local", "--gpus", 0, "--steps", 6, *SETS)
    assert result.exit_code == 1, result.output + result.stderr
    no_traceback(result)
    assert (f"rank 0 raised CheckpointWriteError: cannot write checkpoint step-00000006 in {run / 'checkpoints'}: no "
            "space left on the device. Nothing of it was kept, and the run stopped; its last checkpoint, "
            f"step-00000004, is intact: free space in {run / 'checkpoints'} (or move the run folder to a device with "
            "room), then rerun the same command with --resume") in result.stderr, result.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    ckpt.read_checked(run / "checkpoints/step-00000004")  # intact: it matches its checksums
    small_disk(4 * saved + 4 * 2**20, remount=True)  # space freed
    ok("train", "--out", run, "--executor", "local", "--gpus", 0, "--steps", 6, *SETS, "--resume")
    assert ckpt.list_checkpoints(run)[-1].name == "step-00000006"
    assert [e["checkpoint"] for e in events(run) if e.get("event") == "resume"] == ["step-00000004"]


# ---------------------------------------------------------------- a step folder that lost a file


@pytest.mark.parametrize("lost", ["meta.json", ".metadata", "__0_0.distcp"])
def test_a_last_checkpoint_that_lost_a_file_is_named_not_skipped(run_copy, tmp_path, lost):
    """Before, export, --from-ckpt and --resume took step 2 without a word, and the resumed run wrote over step 3; a
    lost shard of the weights (.distcp) was found only by the ranks, a job started for it."""
    last, out = run_copy / "checkpoints/step-00000003", tmp_path / "w.safetensors"
    (last / lost).unlink()
    expected = (f"error: checkpoint {last} is damaged: {lost} is missing. To go on from the previous checkpoint, "
                f"step-00000002, move this one aside (mv {last} {last}.damaged)")
    for result in (vitctl("export", run_copy, "--out", out), vitctl("export", last, "--out", out),
                   vitctl("train", "--out", run_copy, "--resume", "--executor", "local", "--gpus", 0, *SETS)):
        assert result.exit_code == 1 and expected in result.stderr, result.stderr
        no_traceback(result)
    assert not out.exists() and not (run_copy / "submitit").exists()  # nothing was launched
    shutil.move(*follow(expected, "mv"))
    assert "step-00000002" in ok("export", run_copy, "--out", out).output
    assert train(config(run_copy, "train.max_steps=4"), resume=True)["step"] == 4
    assert [e["checkpoint"] for e in events(run_copy) if e.get("event") == "resume"] == ["step-00000002"]


def test_the_move_aside_of_a_damaged_checkpoint_is_quoted_when_its_path_holds_a_space(pretrained, tmp_path):
    """`mv /x/my run/checkpoints/step-00000003 ...`, pasted, moved nothing (mv: target is not a directory)."""
    run = Path(shutil.copytree(pretrained, tmp_path / "my run"))
    last, out = run / "checkpoints/step-00000003", tmp_path / "w.safetensors"
    (last / "meta.json").unlink()
    result = vitctl("export", run, "--out", out)
    assert result.exit_code == 1 and f"checkpoint {last} is damaged" in result.stderr, result.stderr
    move = result.stderr.split("move this one aside (", 1)[1].split(")", 1)[0]
    assert shlex.split(move) == ["mv", str(last), f"{last}.damaged"]
    subprocess.run(["bash", "-c", move], check=True)  # as pasted into a shell
    assert not last.exists() and (run / "checkpoints/step-00000003.damaged").is_dir()
    assert "step-00000002" in ok("export", run, "--out", out).output


def test_an_only_checkpoint_that_lost_a_file_is_named_damaged(run_copy, tmp_path):
    """Before, export and --from-ckpt of its run folder said it was neither a checkpoint nor a run with checkpoints."""
    shutil.rmtree(run_copy / "checkpoints/step-00000002")
    last = run_copy / "checkpoints/step-00000003"
    (last / "meta.json").unlink()
    expected = (f"error: checkpoint {last} is damaged: meta.json is missing. Its run folder holds no earlier "
                f"checkpoint: move it aside (mv {last} {last}.damaged)")
    for result in (vitctl("export", run_copy, "--out", tmp_path / "w.safetensors"),
                   vitctl("export", run_copy, "--step", 3, "--out", tmp_path / "w.safetensors"),
                   vitctl("finetune", *SETS, "--out", tmp_path / "ft", "--from-ckpt", run_copy, "--executor", "local",
                          "--gpus", 0, "--dry-run")):
        assert result.exit_code == 1 and expected in result.stderr, result.stderr
        no_traceback(result)


@pytest.mark.parametrize(("meta", "what"), [
    ([], "meta.json holds list, not an object"),
    ({"format": ckpt.FORMAT}, "meta.json: step is missing, position is missing, world_size is missing, mesh is "
                              "missing, config is missing"),
    ("files", "meta.json: files is not a mapping of file names to their sizes and sha256 digests"),
])
def test_a_meta_json_of_the_wrong_shape_is_damage_not_a_traceback(run_copy, tmp_path, meta, what):
    """Before: KeyError: 'config' (export), AttributeError: 'list' object has no attribute 'get'."""
    last, out = run_copy / "checkpoints/step-00000003", tmp_path / "w.safetensors"
    if meta == "files":
        meta = json.loads((last / "meta.json").read_text()) | {"files": {"__0_0.distcp": 3}}
    (last / "meta.json").write_text(json.dumps(meta))
    result = vitctl("export", run_copy, "--out", out)
    assert result.exit_code == 1 and f"error: checkpoint {last} is damaged: {what}. To go on" in result.stderr, \
        result.stderr
    no_traceback(result)
    shutil.move(*follow(result.stderr, "mv"))
    assert "step-00000002" in ok("export", run_copy, "--out", out).output


def test_a_damaged_checkpoint_before_the_last_names_the_last(run_copy, tmp_path):
    """Before: export --step 2 of a run whose step 3 is whole said the run folder held no earlier checkpoint and that
    --resume would start the run afresh."""
    damaged = run_copy / "checkpoints/step-00000002"
    (damaged / "__0_0.distcp").write_bytes((damaged / "__0_0.distcp").read_bytes()[:1000])
    result = vitctl("export", run_copy, "--step", 2, "--out", tmp_path / "w.safetensors")
    assert result.exit_code == 1 and f"error: checkpoint {damaged} is damaged: " in result.stderr, result.stderr
    assert ("A later one is what --resume and the run folder take: export or finetune from step-00000003 (drop "
            "--step, or --step 3)") in result.stderr and "afresh" not in result.stderr
    assert "step-00000003" in ok("export", run_copy, "--step", 3, "--out", tmp_path / "w.safetensors").output


def test_a_checkpoint_without_checksums_that_dcp_cannot_read_is_damage(run_copy, tmp_path):
    """Checkpoints of vitctl releases before checksums are checked by DCP alone, whose CheckpointException is a
    BaseException: before, a traceback (export) or `no rank reported an error` (a job)."""
    last = run_copy / "checkpoints/step-00000003"
    meta = json.loads((last / "meta.json").read_text())
    del meta["files"]
    (last / "meta.json").write_text(json.dumps(meta))
    (last / "__0_0.distcp").write_bytes((last / "__0_0.distcp").read_bytes()[:1000])
    result = vitctl("export", run_copy, "--out", tmp_path / "w.safetensors")
    assert result.exit_code == 1 and f"error: checkpoint {last} is damaged: DCP cannot read it (" in result.stderr, \
        result.stderr
    no_traceback(result)
    with pytest.raises(ConfigError, match="is damaged: DCP cannot read it"):
        read_state_dict(run_copy)
    shutil.move(*follow(result.stderr, "mv"))
    assert "step-00000002" in ok("export", run_copy, "--out", tmp_path / "w.safetensors").output


def test_the_checkpoints_folder_and_a_run_without_a_finished_checkpoint_are_named(pretrained, tmp_path):
    out = tmp_path / "w.safetensors"
    result = vitctl("export", pretrained / "checkpoints", "--out", out)
    assert result.exit_code == 1, result.stderr
    assert (f"error: {pretrained / 'checkpoints'} is the checkpoints folder of the run {pretrained}: pass the run "
            "folder (its last checkpoint) or one checkpoint folder") in result.stderr, result.stderr
    ok("export", pretrained, "--out", out)
    (tmp_path / "killed/checkpoints/.step-00000002.partial").mkdir(parents=True)
    result = vitctl("export", tmp_path / "killed", "--out", out)
    assert result.exit_code == 1 and "its run stopped before its first checkpoint was complete " \
        "(.step-00000002.partial is the save it left unfinished)" in result.stderr, result.stderr


# ---------------------------------------------------------------- keep-last-K and files that are not its own


def test_keep_last_k_removes_its_own_files_only(run_copy, caplog):
    """Before, shutil.rmtree took a user's file kept in an old checkpoint folder with it."""
    notes = run_copy / "checkpoints/step-00000002/eval.txt"
    notes.write_text("top-1 71.2")
    with caplog.at_level(logging.WARNING, logger="vitctl.checkpoint"):
        train(config(run_copy, "train.max_steps=4", "train.keep_checkpoints=1"), resume=True)
    assert notes.read_text() == "top-1 71.2" and sorted(p.name for p in notes.parent.iterdir()) == ["eval.txt"]
    assert [p.name for p in ckpt.list_checkpoints(run_copy)] == ["step-00000004"]
    assert f"could not remove the old checkpoint {notes.parent} (train.keep_checkpoints): it holds files vitctl did " \
           "not write (eval.txt)" in caplog.text
    assert read_state_dict(run_copy).keys()  # the folder left behind is no checkpoint, and no damaged one


def test_a_step_folder_holding_a_user_s_files_is_moved_aside_when_that_step_is_saved(run_copy, caplog):
    """Before, publishing step N removed a step-N folder whole, a user's files in it too."""
    notes = run_copy / "checkpoints/step-00000004/eval.txt"
    notes.parent.mkdir()
    notes.write_text("top-1 71.2")
    with caplog.at_level(logging.WARNING, logger="vitctl.checkpoint"):
        train(config(run_copy, "train.max_steps=4"), resume=True)
    aside = run_copy / "checkpoints/step-00000004.moved-1"
    assert (aside / "eval.txt").read_text() == "top-1 71.2"
    assert [p.name for p in ckpt.list_checkpoints(run_copy)][-1] == "step-00000004"
    assert f"{notes.parent} held files vitctl did not write (eval.txt): moved them to {aside}" in caplog.text


# ---------------------------------------------------------------- export: an --out that would destroy something


def test_export_does_not_write_over_a_checkpoint_or_a_file_that_is_not_an_export(pretrained, tmp_path):
    """Before, `--out RUN/checkpoints/step-00000003/meta.json` replaced the checkpoint's meta.json (it was lost),
    and `--out model.safetensors` a user's safetensors file (timm's weights, say)."""
    last = ckpt.list_checkpoints(pretrained)[-1]
    before = (last / "meta.json").read_bytes()
    for out in (last / "meta.json", last / "w.safetensors"):
        result = vitctl("export", pretrained, "--out", out)
        assert result.exit_code == 1 and (f"error: --out {out} lies in the checkpoint folder {last}, which holds "
                                          "what training wrote there alone: writing there could destroy the "
                                          "checkpoint; choose an --out outside") in result.stderr, result.stderr
    assert (last / "meta.json").read_bytes() == before and not (last / "w.safetensors").exists()
    mine = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(2)}, mine)
    result = vitctl("export", pretrained, "--out", mine)
    assert result.exit_code == 1 and (f"error: --out {mine} exists and is not a vitctl export (no vitctl_sha256 in "
                                      "its safetensors header): writing over it would destroy it; choose another "
                                      "--out") in result.stderr, result.stderr
    assert torch.equal(load_file(mine)["w"], torch.ones(2))
    again = tmp_path / "w.safetensors"  # an earlier export is written over: that is how a damaged one is replaced
    ok("export", pretrained, "--out", again)
    with open(again, "r+b") as f:  # its tensors damaged, its header whole
        f.seek(-64, 2)
        f.write(bytes(64))
    ok("export", pretrained, "--out", again)
    assert read_state_dict(again).keys()


def test_export_does_not_write_over_a_safetensors_file_of_another_tool_or_what_is_not_a_file(pretrained, tmp_path):
    """Before, any *.safetensors was written over, and a FIFO, a device node or a symbolic link replaced by a file."""
    theirs = tmp_path / "other.safetensors"
    save_file({"foo.weight": torch.ones(3)}, theirs)
    result = vitctl("export", pretrained, "--out", theirs)
    assert result.exit_code == 1 and "is not a vitctl export" in result.stderr, result.stderr
    assert torch.equal(load_file(theirs)["foo.weight"], torch.ones(3))
    fifo, link = tmp_path / "fifo", tmp_path / "link.safetensors"
    os.mkfifo(fifo)
    link.symlink_to(theirs)
    for out, what in ((fifo, "not a regular file"), (link, "a symbolic link")):
        result = vitctl("export", pretrained, "--out", out)
        assert result.exit_code == 1 and f"error: --out {out} is {what}: writing would replace it" in result.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and link.is_symlink()
    ok("export", pretrained, "--out", tmp_path / "mine.safetensors")


def test_export_ema_of_a_run_without_ema_says_to_drop_it(pretrained, tmp_path):
    result = vitctl("export", pretrained, "--ema", "--out", tmp_path / "w.safetensors")
    assert result.exit_code == 1 and ("holds no EMA weights: its run was trained without train.ema_decay; drop "
                                      "--ema to export its weights") in result.stderr, result.stderr
    ok("export", pretrained, "--out", tmp_path / "w.safetensors")


# ---------------------------------------------------------------- finetune: position tables of another layout


def _distilled(weights: dict) -> dict:
    """DeiT's layout: a distillation token beside the class token, both with a position."""
    return weights | {"dist_token": weights["cls_token"], "pos_embed": torch.cat([weights["pos_embed"][:, :1],
                                                                                  weights["pos_embed"]], dim=1)}


@pytest.mark.parametrize("layout", [_distilled, lambda w: w | {"pos_embed": w["pos_embed"][:, 1:]}],
                         ids=["distillation-token", "no-class-token"])
def test_a_position_table_of_another_layout_is_a_shape_mismatch_not_a_traceback(pretrained, tmp_path, layout):
    """Before: RuntimeError: Sizes of tensors must match (the interpolation took it for a class token and a grid)."""
    source = tmp_path / "other.pth"
    torch.save(layout(ckpt.consolidated(ckpt.list_checkpoints(pretrained)[-1])), source)
    with pytest.raises(ConfigError, match=r"does not fit model vit_micro: .*shape mismatch, file -> model \(1\): "
                                          r"pos_embed \(1, 1[68], 96\) -> \(1, 37, 96\); use weights of a vit_micro"):
        load_pretrained(build_model(ModelConfig(name="vit_micro", num_classes=5, img_size=48),
                                    resolve("none", torch.device("cpu"))), source, None, "vit_micro")


def test_finetune_of_a_distilled_checkpoint_at_another_size_is_one_line(pretrained, tmp_path):
    source = tmp_path / "deit.pth"
    torch.save(_distilled(ckpt.consolidated(ckpt.list_checkpoints(pretrained)[-1])), source)
    result = vitctl("finetune", "--from-ckpt", source, "--out", tmp_path / "ft", "--executor", "local", "--gpus", 0,
                    "--steps", 1, *SETS, "--set", "model.img_size=48")
    assert result.exit_code == 1 and "pos_embed (1, 18, 96) -> (1, 37, 96)" in result.stderr, result.stderr
    assert "RuntimeError" not in result.stderr


# ---------------------------------------------------------------- --resume with another model


def test_resume_with_another_model_names_the_keys_and_both_ways_on_work(run_copy, tmp_path):
    """Before: `was trained with model {...}, not {...}; use another --out`, two dicts to compare by eye."""
    with pytest.raises(ConfigError) as error:
        train(config(run_copy, "train.max_steps=4", "model.num_classes=7"), resume=True)
    message = str(error.value)
    last = run_copy / "checkpoints/step-00000003"
    assert (f"{last} was trained with model settings other than this run's: model.num_classes=5 (now 7); --resume "
            "cannot change them: rerun with --set model.num_classes=5 to go on with the model it saved, or start a "
            f"new run from its weights: `vitctl finetune --from-ckpt {last} --out NEW --set model.num_classes=7`") \
        in message
    resume_sets = re.search(r"rerun with ((?:--set \S+ )+)", message).group(1).split()[1::2]
    assert train(config(run_copy, "train.max_steps=4", "model.num_classes=7", *resume_sets), resume=True)["step"] == 4
    finetune = shlex.split(message.split("`")[1])  # vitctl finetune --from-ckpt C --out NEW --set ...
    finetune[finetune.index("NEW")] = str(tmp_path / "ft")
    ok("finetune", *SETS, *finetune[2:], "--executor", "local", "--gpus", 0, "--steps", 1)  # its --set comes last
    assert json.loads((ckpt.list_checkpoints(tmp_path / "ft")[-1] / "meta.json").read_text())["config"]["model"][
        "num_classes"] == 7


def test_resume_with_another_model_name_is_told_the_option_that_sets_it_and_following_it_works(run_copy):
    """Before: `rerun with --set model.name="vit_micro"`, which beside the run's --model was refused as set twice."""
    sets = [a for s in base.BASE if not s.startswith("model.name=") for a in ("--set", s)]
    args = ["train", "--out", run_copy, "--executor", "local", "--gpus", 0, "--resume", "--dry-run", "--steps", 4,
            *sets]
    result = vitctl(*args, "--model", "vit_mini")
    assert result.exit_code == 1 and "rerun with --model vit_micro to go on with the model it saved" in result.stderr
    ok(*args, "--model", "vit_micro")


def test_a_resume_onto_shards_of_other_classes_names_the_data_not_num_classes(tmp_path, monkeypatch):
    """Before, the two checks sent the user round in a circle: --resume said `rerun with --set model.num_classes=3`,
    and then the shards' check said `pass --set model.num_classes=5`."""
    def run_config(shards: str, classes: int):
        return load_config("demo_vit", [f"data.path={tmp_path / shards}", f"model.num_classes={classes}"])

    monkeypatch.setattr(ckpt, "read_meta", lambda path: {"config": run_config("sh3", 3).to_dict()})
    last = tmp_path / "run/checkpoints/step-00000003"
    with pytest.raises(ConfigError) as error:
        check_resumable([last], run_config("sh5", 5))
    assert str(error.value) == (
        f"{tmp_path / 'run'} was trained on {tmp_path / 'sh3'} (3 classes), and --data {tmp_path / 'sh5'} is another "
        f"shard folder, for model.num_classes=5: --resume goes on with the data a run began with; pass --data "
        f"{tmp_path / 'sh3'}, or start a new run from its weights: `vitctl finetune --from-ckpt {tmp_path / 'run'} "
        f"--out NEW --data {tmp_path / 'sh5'}` (with the other options of this command)")
    check_resumable([last], run_config("sh3", 3))  # the fix: its own data
    check_resumable([last], run_config("moved", 3))  # shards moved elsewhere, the same classes: not refused


def test_a_resume_onto_other_samples_of_the_same_classes_warns_and_each_fix_is_quiet(prepared_root, tmp_path):
    """A shard folder written again (another seed: other shards) or another dataset of the same classes: --resume
    went on from its place in an epoch of the old order without a word."""
    for shards, seed in (("a", 0), ("b", 1)):
        ok("data", "shard", prepared_root, "--out", tmp_path / shards, "--maxcount", 16, "--seed", seed)
        ok("data", "index", tmp_path / shards)
    run = tmp_path / "run"
    common = ["--config", "demo_vit", "--batch", 8, "--executor", "local", "--gpus", 0, "--out", run,
              "--set", "train.checkpoint_every=2", "--set", f"model.num_classes={CLASSES}"]
    ok("train", *common, "--data", tmp_path / "a", "--steps", 2)
    warned = ok("train", *common, "--data", tmp_path / "b", "--steps", 3, "--resume", "--dry-run")
    assert (f"warning: --resume onto other train samples than {run} was trained on: the shards of --data "
            f"{tmp_path / 'b'} differ from those its checkpoint recorded (their names and sha256)") in warned.stderr
    fix = re.search(r"`(vitctl finetune .*)`$", warned.stderr.splitlines()[0])[1].replace("NEW", str(tmp_path / "ft"))
    copy = Path(shutil.copytree(tmp_path / "a", tmp_path / "a-copy"))  # the data it began with, elsewhere
    quiet = ok("train", *common, "--data", copy, "--steps", 4, "--resume")  # trains on
    assert "warning" not in quiet.stderr, quiet.stderr
    followed = ok(*shlex.split(fix)[1:], "--config", "demo_vit", "--batch", 8, "--executor", "local", "--gpus", 0,
                  "--steps", 1, "--set", f"model.num_classes={CLASSES}")
    assert "warning" not in followed.stderr, followed.stderr
