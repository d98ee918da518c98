"""Everything checkable is checked before launch (the CLI, before anything is submitted) and again in each rank."""

import json
import shlex
import shutil

import pytest
import torch

from conftest import CLASSES, ok, vitctl
from vitctl.trainer import preflight as preflight_module
from vitctl.trainer.config import ConfigError, load_config
from vitctl.trainer.loop import train
from vitctl.trainer.preflight import Schedule, preflight, steps_warning

TWO_CPU_RANKS = ["--executor", "local", "--gpus", 0, "--tasks-per-node", 2]


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.name=vit_x"], "model.name 'vit_x' is unknown"),
    (["model.img_size=36"], "model vit_micro: image size 36 is not a multiple of the patch size 8"),
    (["model.name=swin_t", "model.img_size=200"], "model swin_t: image size 200 is not a multiple of 32 (the patch "
                                                  "size 4 times 2 for each of its 3 patch mergings); the nearest size "
                                                  "that works with window 7 is 224"),
    (["model.name=swin_t", "model.img_size=256"], "model swin_t: image size 256 with window 7 gives feature maps "
                                                  "[64, 32, 16, 8]"),
    (["model.window_size=4"], "model vit_micro: model.window_size=4 is a Swin setting, and a ViT has no windows; "
                              "pass --set model.window_size=null"),  # before: accepted, and recorded in the run
    (["model.name=swin_micro", "model.window_size=4", "model.pre_logits=true"],
     "model swin_micro: model.pre_logits=true is a ViT setting (its head's hidden layer), and Swin has none; pass "
     "--set model.pre_logits=false"),
    (["train.fused=all,mlp=bogus"], "--fused: mlp has no implementation 'bogus'"),
    (["train.fused=al"], "--fused: unknown op 'al'"),
    (["train.fused=all,mlp=cuda"], "--fused mlp=cuda: cuda cannot run on cpu (needs CUDA); drop '=cuda' to take"),
    (["model.num_classes=1000"], f"pass --set model.num_classes={CLASSES}"),
    (["augment.mixup=0.8", "data.batch_size=7"], "mixup/cutmix pair the samples of a batch and need an even"),
    (["data.batch_size=40"], "data.batch_size 40 x 2 data-parallel ranks = 80 samples a step, more than the 60"),
    (["optim.accum_steps=4"], "data.batch_size 8 x 2 data-parallel ranks x optim.accum_steps 4 = 64 samples an "
                              "optimizer step, more than the 60 train samples of an epoch; use --set "
                              "optim.accum_steps=3 or lower"),
    (["parallel.fsdp=true", "parallel.dp_shard=3"], "parallel.dp_shard=3 does not divide the 2 data-parallel ranks"),
    (["parallel.fsdp=true", "train.compile=true", "train.compile_mode=reduce-overhead"],
     "does not run with FSDP"),
    (["train.compile=true", "train.compile_mode=reduce-overhead"], "replays CUDA graphs and needs a GPU"),
])
def test_bad_requests_are_refused_before_launch(prepared_shards, tmp_path, overrides, message):
    sets = [a for o in overrides for a in ("--set", o)]
    result = vitctl("train", "--config", "demo_vit", "--data", prepared_shards, "--out", tmp_path / "run",
                    *TWO_CPU_RANKS, "--set", "data.batch_size=8", "--set", f"model.num_classes={CLASSES}", *sets)
    assert result.exit_code == 1 and message in result.stderr, result.stderr
    assert "Traceback" not in result.output + result.stderr
    assert not (tmp_path / "run" / "submitit").exists()  # nothing was launched


def test_a_strategy_with_problems_still_counts_its_data_parallel_ranks(prepared_shards):
    """Before: with tp=2 refused for vit_micro's 3 heads, the batch was counted over all 4 ranks as data parallel."""
    config = load_config("demo_vit", [f"data.path={prepared_shards}", "data.batch_size=40", "parallel.tp=2",
                                      f"model.num_classes={CLASSES}"])
    with pytest.raises(ConfigError) as refused:
        preflight(config, 4, None)
    assert "parallel.tp=2 must divide every block's attention heads" in str(refused.value)
    assert "data.batch_size 40 x 2 data-parallel ranks = 80 samples a step" in str(refused.value)
    config.parallel.tp = 3  # 3 does not divide 4 ranks: the data-parallel ranks are not known, nor said
    with pytest.raises(ConfigError) as refused:
        preflight(config, 4, None)
    assert "data-parallel ranks" not in str(refused.value)


def test_a_named_implementation_that_cannot_run_is_refused_and_the_fix_runs(prepared_shards, tmp_path):
    """Named, an implementation is not swapped for the reference behind the user's back; without the name it is."""
    args = ["train", "--config", "demo_vit", "--data", prepared_shards, "--out", tmp_path / "run", "--executor",
            "local", "--gpus", 0, "--batch", 8, "--epochs", 1, "--set", f"model.num_classes={CLASSES}"]
    refused = vitctl(*args, "--fused", "all,optimizer=cuda")
    assert refused.exit_code == 1 and "drop '=cuda'" in refused.stderr, refused.stderr
    empty = vitctl(*args, "--fused", "")  # an unset shell variable: it had meant none
    assert empty.exit_code == 1 and "--fused is empty; give all" in empty.stderr, empty.stderr
    ok(*args, "--fused", "all,optimizer")


@pytest.mark.parametrize(("preset", "setting", "fix"), [
    ("demo_vit", "model.window_size=4", "model.window_size=null"),
    ("demo_swin", "model.pre_logits=true", "model.pre_logits=false"),
])
def test_a_setting_of_the_other_model_family_is_refused_and_the_fix_runs(prepared_shards, tmp_path, preset, setting,
                                                                        fix):
    args = ["train", "--config", preset, "--data", prepared_shards, "--out", tmp_path / "run", "--executor", "local",
            "--gpus", 0, "--set", f"model.num_classes={CLASSES}", "--set", setting, "--dry-run"]
    refused = vitctl(*args)
    assert refused.exit_code == 1 and f"pass --set {fix}" in refused.stderr, refused.stderr
    ok(*args, "--set", fix)


def test_every_problem_is_reported_at_once(prepared_shards, tmp_path):
    result = vitctl("train", "--config", "demo_vit", "--data", prepared_shards, "--out", tmp_path / "run",
                    *TWO_CPU_RANKS, "--set", "train.fused=bogus", "--set", "model.img_size=36")
    assert result.exit_code == 1
    for message in ("unknown op 'bogus'", "image size 36", f"pass --set model.num_classes={CLASSES}"):
        assert message in result.stderr


def test_the_ranks_check_again(prepared_shards, tmp_path):
    """A rank started some other way (srun, torchrun, a changed data folder) refuses as the CLI would."""
    config = load_config("demo_vit", [f"data.path={prepared_shards}", f"train.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=f"pass --set model.num_classes={CLASSES}"):
        train(config)


def test_a_checkpoint_to_finetune_from_is_checked_before_launch_and_in_the_ranks(tmp_path):
    source = tmp_path / "weights.pt"
    source.write_text("not weights")
    sets = ["data.source=synthetic", f"finetune.from_ckpt={source}"]
    result = vitctl("train", "--config", "demo_vit", "--out", tmp_path / "run", *TWO_CPU_RANKS,
                    *[a for s in sets for a in ("--set", s)], "--set", "train.fused=bogus")
    assert result.exit_code == 1
    for message in (f"finetune.from_ckpt {source} is not a checkpoint", "unknown op 'bogus'"):  # reported together
        assert message in result.stderr, result.stderr
    assert not (tmp_path / "run" / "submitit").exists()
    with pytest.raises(ConfigError, match=f"finetune.from_ckpt {source} is not a checkpoint"):
        train(load_config("demo_vit", [*sets, f"train.out_dir={tmp_path / 'rank'}"]))


def test_a_torchvision_without_gpu_decode_is_refused_with_a_branch_that_works(prepared_shards, monkeypatch):
    """data.decode=nvjpeg (the default) on a GPU needs torchvision's CUDA decoder; the fix offered passes."""
    monkeypatch.setattr(preflight_module, "gpu_decode_available", lambda: False)
    sets = [f"data.path={prepared_shards}", "data.source=webdataset", f"model.num_classes={CLASSES}",
            "train.precision=fp32"]
    with pytest.raises(ConfigError, match="data.decode=nvjpeg decodes with torchvision's CUDA decode_jpeg, which "
                                          "this torchvision lacks; set data.decode=pil-crop"):
        preflight(load_config("demo_vit", sets), 1, torch.device("cuda"))
    preflight(load_config("demo_vit", [*sets, "data.decode=pil-crop"]), 1, torch.device("cuda"))
    preflight(load_config("demo_vit", sets), 1, torch.device("cpu"))  # the CPU decodes with PIL


@pytest.mark.parametrize(("out", "says"), [
    ("notes.txt", "cannot be made: {blocker} is a file, not a folder"),
    ("notes.txt/run", "cannot be made: {blocker} is a file, not a folder"),
])
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]], ids=["run", "dry-run"])
def test_an_out_that_is_a_file_is_refused_as_one(tmp_path, out, says, dry_run):
    blocker, out = tmp_path / "notes.txt", tmp_path / out
    blocker.write_text("mine")
    args = ["train", "--config", "demo_vit", "--set", "data.source=synthetic", *TWO_CPU_RANKS, "--steps", 1, *dry_run]
    result = vitctl(*args, "--out", out)
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr
    assert result.stderr == f"error: run folder {out} (--out, train.out_dir) {says.format(blocker=blocker)}; choose " \
                            f"another --out\n"
    assert blocker.read_text() == "mine"
    assert "srun" in ok(*args, "--dry-run", "--out", tmp_path / "run").output  # another --out passes


def test_an_out_inside_a_checkpoint_folder_is_refused(tmp_path):
    """Before: accepted, and the other run's keep-last-K would delete the new run with that checkpoint."""
    step = tmp_path / "other/checkpoints/step-00000002"
    step.mkdir(parents=True)
    for name in ("meta.json", ".metadata"):
        (step / name).write_text("{}")
    args = ["train", "--config", "demo_vit", "--set", "data.source=synthetic", "--executor", "local", "--gpus", 0,
            "--steps", 1]
    result = vitctl(*args, "--out", step / "run")
    assert result.exit_code == 1 and (f"run folder {step / 'run'} (--out) lies in the checkpoint folder {step}, "
                                      f"which holds what its run wrote there alone") in result.stderr, result.stderr
    assert f"--out {tmp_path / 'other'} --resume; else choose an --out outside it" in result.stderr
    assert not (step / "run").exists()
    ok(*args, "--out", tmp_path / "run")


def test_an_out_at_a_run_s_checkpoints_is_refused_naming_the_run_to_resume(tmp_path):
    """Before: `--out RUN/checkpoints --resume` trained from step 0 in there ('holds no checkpoint'), and a step
    folder as --out was told to choose an --out outside RUN, away from the run to go on with."""
    args = ["train", "--config", "demo_vit", "--set", "data.source=synthetic", "--set", "data.train_samples=32",
            "--batch", 4, "--executor", "local", "--gpus", 0]
    run = tmp_path / "run"
    ok(*args, "--steps", 1, "--out", run)
    for out in (run / "checkpoints", run / "checkpoints/step-00000001"):
        result = vitctl(*args, "--steps", 2, "--out", out, "--resume")
        assert result.exit_code == 1 and f"to go on with that run, pass its folder: --out {run} --resume" \
            in result.stderr, result.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000001"]
    resumed = ok(*args, "--steps", 2, "--out", run, "--resume")  # the fix
    assert "starts at step 0" not in resumed.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]


def test_the_run_folder_to_resume_is_quoted_when_its_path_holds_a_space(tmp_path):
    """`--out /x/my run --resume`, pasted, passed `/x/my` as --out and `run` as an argument click refused."""
    args = ["train", "--config", "demo_vit", "--set", "data.source=synthetic", "--set", "data.train_samples=32",
            "--batch", 4, "--executor", "local", "--gpus", 0]
    run = tmp_path / "my runs" / "run 1"
    ok(*args, "--steps", 1, "--out", run)
    result = vitctl(*args, "--steps", 2, "--out", run / "checkpoints", "--resume")
    assert result.exit_code == 1 and "pass its folder: --out " in result.stderr, result.stderr
    fix = shlex.split(result.stderr.split("pass its folder: ", 1)[1].split(";", 1)[0])
    assert fix == ["--out", str(run), "--resume"]
    ok(*args, "--steps", 2, *fix)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]
    step = tmp_path / "other run/checkpoints/step-00000002"  # a folder inside a checkpoint: the same advice
    step.mkdir(parents=True)
    for name in ("meta.json", ".metadata"):
        (step / name).write_text("{}")
    result = vitctl(*args, "--steps", 1, "--out", step / "run")
    assert result.exit_code == 1, result.stderr
    fix = shlex.split(result.stderr.split("pass its folder: ", 1)[1].split(";", 1)[0])
    assert fix == ["--out", str(tmp_path / "other run"), "--resume"]


def test_a_metrics_log_no_vitctl_run_wrote_is_refused_not_rewritten(tmp_path):
    """Before: a fresh run into a folder holding another tool's metrics.jsonl cut it to its step-0 records."""
    args = ["train", "--config", "demo_vit", "--set", "data.source=synthetic", "--set", "data.train_samples=32",
            "--batch", 4, "--executor", "local", "--gpus", 0, "--steps", 1]
    run = tmp_path / "run"
    run.mkdir()
    theirs = '{"epoch": 1, "step": 10, "acc": 0.5}\n'
    (run / "metrics.jsonl").write_text(theirs)
    result = vitctl(*args, "--out", run)
    assert result.exit_code == 1, result.stderr
    assert f"run folder {run} (--out) holds a metrics.jsonl that no vitctl run wrote there" in result.stderr
    assert f"move {run / 'metrics.jsonl'} away, or choose another --out" in result.stderr
    assert (run / "metrics.jsonl").read_text() == theirs and not (run / "checkpoints").exists()
    (run / "metrics.jsonl").rename(tmp_path / "theirs.jsonl")  # the fix
    ok(*args, "--out", run)
    shutil.rmtree(run / "checkpoints")  # an attempt that saved no checkpoint: its own log is redone, as before
    ok(*args, "--out", run)
    assert [r["event"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "event" in r] \
        == ["start", "start"]


@pytest.mark.parametrize(("steps", "accum", "epochs"), [(10**23, 1, 8333333333333333333334), (10, 3, 3), (97, 1, 9)])
def test_the_epochs_named_for_steps_past_the_end_reach_them(steps, accum, epochs):
    """Worked in integers: a float rounded 10**23 steps' epochs to 8333333333333332983808."""
    config = load_config("demo_vit", [f"train.max_steps={steps}", f"optim.accum_steps={accum}", "train.epochs=2"])
    batches = 12  # 400 samples at a global batch of 32
    warning = steps_warning(config, Schedule(400, 32, batches / accum, -(-2 * batches // accum)))
    assert warning.endswith(f"add --epochs {epochs} to train {steps} steps"), warning
    assert -(-epochs * batches // accum) >= steps > -(-(epochs - 1) * batches // accum)  # the fewest that reach them
