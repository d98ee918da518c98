"""The training loop on the CPU: exact resume, checkpoints, ranks, precisions, finetuning through the CLI."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import CLASSES, ok, vitctl
from vitctl.trainer import checkpoint as ckpt
from vitctl.trainer import runlock
from vitctl.trainer.config import ConfigError, load_config
from vitctl.trainer.loop import Diverged, Trainer, train
from vitctl.trainer.metrics import read_metrics
from vitctl.workflows import registry, status

TINY = ["model.name=vit_micro", "model.img_size=32", f"model.num_classes={CLASSES}", "model.drop_path=0.1",
        "data.batch_size=8", "data.workers=0", "data.source=webdataset", "train.precision=fp32",
        "train.fused=none", "train.epochs=3", "train.log_every=2", "train.checkpoint_every=3",
        "optim.warmup_epochs=1", "optim.lr=5e-3", "augment.mixup=0.5", "augment.cutmix=0.5"]


def tiny(shards: Path, out: Path, *extra: str):
    return load_config(None, [*TINY, f"data.path={shards}", f"train.out_dir={out}", *extra])


def final_weights(out: Path, part: str = "model") -> dict[str, torch.Tensor]:
    return ckpt.consolidated(ckpt.list_checkpoints(out)[-1], part)


def last_meta(out: Path) -> dict:
    return ckpt.read_meta(ckpt.list_checkpoints(out)[-1])


# The published recipe's data side (timm's transforms in this process, seeded per sample) and a warmup from above 0.
RECIPE = ["augment.rand_augment=rand-m9-mstd0.5-inc1", "augment.reprob=0.25", "augment.repeated_aug=2",
          "optim.warmup_lr=1e-3"]


@pytest.mark.parametrize("recipe", [[], RECIPE], ids=["light", "recipe"])
def test_resume_continues_exactly(prepared_shards, tmp_path, recipe):
    """N steps in one go == N/2 steps, stop, resume, N/2 more: bitwise, on CPU in fp32 (mixup, drop path on)."""
    train(tiny(prepared_shards, tmp_path / "whole", "train.max_steps=10", *recipe))
    train(tiny(prepared_shards, tmp_path / "split", "train.max_steps=5", *recipe))
    with pytest.raises(ConfigError, match="pass --resume"):
        train(tiny(prepared_shards, tmp_path / "split", "train.max_steps=10", *recipe))
    train(tiny(prepared_shards, tmp_path / "split", "train.max_steps=10", *recipe), resume=True)
    for part in ("model", "optimizer"):
        whole, split = final_weights(tmp_path / "whole", part), final_weights(tmp_path / "split", part)
        assert whole.keys() == split.keys()
        assert all(torch.equal(whole[k], split[k]) for k in whole)
    meta = last_meta(tmp_path / "split")
    assert meta["position"] == {"step": 10, "epoch": 1, "sample": 24}  # 60 samples: 7 batches of 8 per epoch
    assert meta["config"]["train"]["max_steps"] == 10
    assert "rng.rank0.torch" in ckpt.saved_keys(ckpt.list_checkpoints(tmp_path / "split")[-1])


@pytest.mark.parametrize("asynchronous", [False, True])
def test_checkpoints_are_atomic_and_only_the_last_k_kept(prepared_shards, tmp_path, asynchronous):
    train(tiny(prepared_shards, tmp_path / "r", "train.max_steps=12", "train.checkpoint_every=2",
               "train.keep_checkpoints=2", f"train.async_checkpoint={str(asynchronous).lower()}"))
    names = [p.name for p in ckpt.list_checkpoints(tmp_path / "r")]
    assert names == ["step-00000010", "step-00000012"]
    assert sorted(p.name for p in (tmp_path / "r/checkpoints").iterdir()) == names  # no temporary folders


def test_an_unfinished_checkpoint_is_never_resumed_from(prepared_shards, tmp_path):
    """A save killed before its rename leaves a hidden folder, and one killed mid-rename a folder without DCP's
    metadata and meta.json: resume takes the last complete checkpoint and clears the hidden one."""
    train(tiny(prepared_shards, tmp_path / "r", "train.max_steps=3"))
    folder = tmp_path / "r/checkpoints"
    partial = folder / ".step-00000006.partial"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    (folder / "step-00000009").mkdir()
    result = train(tiny(prepared_shards, tmp_path / "r", "train.max_steps=4"), resume=True)
    assert result["step"] == 4 and not partial.exists()
    records = [json.loads(line) for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert [r["checkpoint"] for r in records if r.get("event") == "resume"] == ["step-00000003"]


def test_metrics_are_json_lines_with_the_promised_fields(prepared_shards, tmp_path):
    train(tiny(prepared_shards, tmp_path / "r", "train.max_steps=7", "train.eval_every_epochs=1"))
    records = [json.loads(line) for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_top1" in r]
    assert {"step", "loss", "lr", "images_per_s", "step_time_s", "data_wait_s"} <= steps[0].keys()
    assert evals[-1]["step"] == 7 and evals[-1]["eval_samples"] == 20  # every val sample, once
    assert 0 <= evals[-1]["eval_top1"] <= evals[-1]["eval_top5"] <= 100


@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16-pure"])
def test_mixed_precisions_train(prepared_shards, tmp_path, precision):
    result = train(tiny(prepared_shards, tmp_path / "r", "train.max_steps=3", f"train.precision={precision}"))
    assert torch.isfinite(torch.tensor(result["loss"]))
    weights = final_weights(tmp_path / "r")
    assert all(w.dtype == torch.float32 for w in weights.values())  # fp32 master weights are what is saved
    records = [json.loads(line) for line in (tmp_path / "r/metrics.jsonl").read_text().splitlines()]
    assert records[0] == {**records[0], "event": "start", "layout": "1 rank"}
    assert "grad_norm" in next(r for r in records if "loss" in r)


def test_accumulation_ema_and_activation_checkpointing_run(prepared_shards, tmp_path):
    result = train(tiny(prepared_shards, tmp_path / "r", "train.max_steps=3", "optim.accum_steps=2",
                        "train.ema_decay=0.9", "parallel.checkpoint=full", "optim.layer_decay=0.75"))
    assert result["step"] == 3
    assert last_meta(tmp_path / "r")["position"]["sample"] == 6 * 8  # 3 steps of 2 batches of 8
    ema, weights = final_weights(tmp_path / "r", "ema"), final_weights(tmp_path / "r")
    assert ema.keys() == weights.keys() and not all(torch.equal(ema[k], weights[k]) for k in ema)


def test_activation_checkpointing_does_not_change_the_result(prepared_shards, tmp_path):
    train(tiny(prepared_shards, tmp_path / "a", "train.max_steps=2"))
    train(tiny(prepared_shards, tmp_path / "b", "train.max_steps=2", "parallel.checkpoint=full"))
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_two_gloo_ranks_through_the_cli_then_finetune(prepared_shards, tmp_path):
    args = ["--data", prepared_shards, "--executor", "local", "--gpus", 0, "--tasks-per-node", 2,
            *sum((["--set", s] for s in TINY), [])]
    result = ok("train", "--out", tmp_path / "pre", "--steps", 4, *args)
    assert "checkpoint:" in result.output
    records = [json.loads(line) for line in (tmp_path / "pre/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4]
    assert [r["eval_samples"] for r in records if "eval_top1" in r][-1] == 20  # both ranks' val shards counted
    source = ckpt.list_checkpoints(tmp_path / "pre")[-1]
    tuned = ok("finetune", "--from-ckpt", source, "--out", tmp_path / "ft", "--steps", 2, *args,
               "--set", "model.img_size=48")  # new resolution: position embeddings interpolated
    assert "checkpoint:" in tuned.output


def test_fsdp_on_two_gloo_ranks(prepared_shards, tmp_path):
    args = ["--data", prepared_shards, "--executor", "local", "--gpus", 0, "--tasks-per-node", 2,
            *sum((["--set", s] for s in TINY), [])]
    ok("train", "--out", tmp_path / "r", "--steps", 3, *args, "--set", "parallel.fsdp=true")
    assert len(list(ckpt.list_checkpoints(tmp_path / "r")[-1].glob("*.distcp"))) == 2  # each rank wrote its shards
    weights = final_weights(tmp_path / "r")
    assert weights["pos_embed"].shape == (1, 17, 96)  # gathered whole, not a shard


def test_cli_errors_are_clear(prepared_shards, tmp_path):
    result = vitctl("train", "--config", "demo_vit", "--data", tmp_path / "missing")
    assert result.exit_code == 1 and "does not exist" in result.stderr
    result = vitctl("finetune", "--from-ckpt", tmp_path / "none.pt", "--config", "demo_vit", "--data", prepared_shards)
    assert result.exit_code == 1 and "no such file" in result.stderr
    result = vitctl("train", "--config", "demo_vit", "--data", prepared_shards, "--executor", "local", "--gpus", 1)
    assert result.exit_code == 1 and "CUDA devices" in result.stderr
    result = vitctl("train", "--config", "demo_vit", "--data", prepared_shards, "--executor", "slurm")
    assert result.exit_code == 1 and "needs --gpus N" in result.stderr


def test_dali_source_trains_on_the_cpu(prepared_shards, tmp_path):
    result = train(tiny(prepared_shards, tmp_path / "r", "train.max_steps=3", "data.source=dali", "data.workers=1"))
    assert result["step"] == 3 and torch.isfinite(torch.tensor(result["loss"]))


# ---------------------------------------------------------------- stopped by a signal: nothing lost

VITCTL = Path(sys.executable).parent / "vitctl"
ENDLESS = ["--config", "demo_vit", "--set", "data.source=synthetic", "--set", "data.train_samples=100000",
           "--set", "train.log_every=1000", "--set", "train.checkpoint_every=1000"]  # no log or checkpoint step


def wait_for_text(path: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"{text!r} never appeared in {path}"
        time.sleep(0.2)


def metrics_events(run: Path, event: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("event") == event]


@pytest.mark.slow
def test_sigterm_checkpoints_the_step_it_stopped_at_and_resume_goes_on_from_there(tmp_path):
    """`scontrol requeue` and preemption send SIGTERM: the rank checkpoints after the step it is in (not at the
    next log or checkpoint step), and the rerun continues from that step."""
    run, log = tmp_path / "run", tmp_path / "rank.log"
    args = [VITCTL, "rank", "--out", run, *ENDLESS, "--set", "data.batch_size=4"]
    with open(log, "w") as stderr:
        rank = subprocess.Popen([*args, "--steps", "100000"], stderr=stderr)
        wait_for_text(log, "vitctl.train: run")
        time.sleep(3)
        rank.send_signal(signal.SIGTERM)
        assert rank.wait(timeout=60) == 0, log.read_text()[-2000:]
    step = metrics_events(run, "stopped")[0]["step"]
    assert 0 < step < 1000
    assert [p.name for p in ckpt.list_checkpoints(run)] == [f"step-{step:08d}"]
    subprocess.run([*args, "--steps", str(step + 2)], check=True, capture_output=True)
    assert [e["step"] for e in metrics_events(run, "resume")] == [step]
    assert last_meta(run)["step"] == step + 2


@pytest.mark.slow
def test_cancel_of_a_local_job_checkpoints_every_rank_at_one_step(tmp_path):
    run, log = tmp_path / "run", tmp_path / "train.log"
    args = [VITCTL, "train", *ENDLESS, "--batch", "4", "--executor", "local", "--gpus", "0", "--tasks-per-node", "2",
            "--out", run]
    with open(log, "w") as output:
        waiting = subprocess.Popen(args, stdout=output, stderr=output)
        wait_for_text(log, "vitctl.train: run")
        job = registry.find_record(str(run)).job_id
        refused = vitctl(*args[1:], "--resume")  # the same folder, while the job runs
        assert refused.exit_code == 1
        assert f"run folder {run} is in use by job {job} (vit_micro-run, RUNNING, submitted " in refused.stderr
        said = subprocess.run([VITCTL, "cancel", str(run)], capture_output=True, text=True, check=True).stdout
        assert said.startswith("cancel requested for job ")
        assert waiting.wait(timeout=120) == 1
    step = metrics_events(run, "stopped")[0]["step"]
    error = [line for line in log.read_text().splitlines() if line.startswith("error:")]
    assert error == [f"error: job {job} was stopped (cancelled): checkpointed at "
                     f"step {step} on a signal: --resume continues from there"]
    assert [p.name for p in ckpt.list_checkpoints(run)] == [f"step-{step:08d}"]
    assert len(list(ckpt.list_checkpoints(run)[0].glob("*.distcp"))) == 2  # both ranks saved that step
    logs = ok("logs", job).output  # was submitit's "Job completed successfully", for a job cancelled
    assert "Job completed successfully" not in logs and "after successful completion" not in logs
    assert f"Job stopped by SIGTERM once every rank had checkpointed at step {step} (a requeue" in logs
    subprocess.run([*args, "--resume", "--steps", str(step + 1)], check=True, capture_output=True)
    assert [e["step"] for e in metrics_events(run, "resume")] == [step] and last_meta(run)["step"] == step + 1
    resumed_by = registry.load_records()[-1].job_id  # the stopped job's advice is taken: was still "--resume ..."
    stopped = next(s for s in status.collect(registry.load_records()) if s.job_id == job)
    assert stopped.note == f"checkpointed at step {step} on a signal; job {resumed_by} was started in its run folder " \
        "since"


HOLD_RUN_DIR = """
import sys, time
from pathlib import Path
from vitctl.trainer import runlock
with runlock.holding(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_run_folder_held_by_a_running_job_is_refused(prepared_shards, tmp_path, monkeypatch):
    """Another job's rank 0 holds the folder (launched from elsewhere: not in this registry): the launch and the
    trainer's rank 0 both refuse it, naming that job; once it ends the folder is free."""
    monkeypatch.setattr(runlock, "WAIT_S", 0.5)
    run = tmp_path / "r"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_RUN_DIR, run], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "SLURM_JOB_ID": "777"})
    try:
        assert holder.stdout.readline() == "held\n"
        refusal = r"run folder .*/r is in use by job 777 \(pid \d+ on .*\); wait for it to end, "
        with pytest.raises(ConfigError, match=refusal + re.escape(
                "cancel it (`vitctl cancel 777` where it was launched; for a Slurm job vitctl did not launch, "
                "`scancel --signal=TERM 777` has its ranks checkpoint, then stop), or choose another --out")):
            train(tiny(prepared_shards, run, "train.max_steps=1"))  # a rank: which vitctl launched it is not known
        result = vitctl("train", "--out", run, "--data", prepared_shards, "--executor", "local", "--gpus", 0,
                        *sum((["--set", s] for s in TINY), []))
        assert result.exit_code == 1 and re.search(refusal + re.escape(  # not this registry's: `vitctl cancel` fails
            "stop it where it was launched: it is not among this machine's vitctl jobs (if Slurm runs it, `scancel "
            "--signal=TERM 777` has its ranks checkpoint, then stop), or choose another --out"), result.stderr), \
            result.stderr
        script = vitctl("train", "--out", run, "--data", prepared_shards, "--executor", "local", "--gpus", 0,
                        "--dry-run", *sum((["--set", s] for s in TINY), []))  # before: printed without a word
        assert script.exit_code == 0 and re.search(refusal, script.stderr) and script.stderr.rstrip().endswith(
            "submitted now, the script's job would be refused by its rank 0"), script.stderr
    finally:
        holder.kill()
        holder.wait()
    assert train(tiny(prepared_shards, run, "train.max_steps=1"))["step"] == 1


# ---------------------------------------------------------------- divergence: nothing non-finite is checkpointed

DIVERGING = ["--config", "demo_vit", "--set", "data.source=synthetic", "--set", "data.train_samples=256",
             "--executor", "local", "--gpus", 0, "--set", "train.checkpoint_every=3"]


def the_error(result) -> str:
    """The one `error:` line a failed command printed (no traceback)."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1, result.output + result.stderr
    assert "Traceback" not in result.output + result.stderr
    return errors[0]


def logged_steps(run: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run) if "loss" in r]


def test_a_diverged_run_stops_unsaved_and_resuming_with_a_lower_lr_goes_on(tmp_path):
    run = tmp_path / "run"
    ok("train", "--out", run, *DIVERGING, "--steps", 3)
    args = ["train", "--out", run, *DIVERGING, "--resume", "--steps", 9, "--set", "train.log_every=1"]
    error = the_error(vitctl(*args, "--set", "optim.lr=1e8"))
    assert re.search(r"rank 0 raised Diverged: step \d: the training loss is (nan|inf) \(not finite\): the run "
                     r"diverged, and nothing from this step on is checkpointed\. To go on from the last checkpoint, "
                     rf"{re.escape(str(run))}/checkpoints/step-00000003, lower the learning rate \(--set optim.lr="
                     r"\.\.\., now 1e\+08\) and rerun with --resume \(traceback in \S+\)$", error), error
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-00000003"]
    ok(*args, "--set", "optim.lr=1e-3")
    assert logged_steps(run) == list(range(3, 10))
    assert all(torch.isfinite(t).all() for t in final_weights(run).values())


def test_a_checkpoint_whose_own_weights_diverge_is_named_and_moving_it_aside_goes_on(tmp_path):
    """Before: `To go on from the last checkpoint, step-N, lower the learning rate`, for a checkpoint saved finite
    but diverging (one update at lr 1e8): every lower rate diverged again from it, with the same advice."""
    run = tmp_path / "run"
    ok("train", "--out", run, *DIVERGING, "--steps", 3, "--set", "train.checkpoint_every=1")
    args = ["train", "--out", run, *DIVERGING, "--resume", "--steps", 8, "--set", "train.checkpoint_every=1"]
    error = the_error(vitctl(*args, "--set", "train.log_every=100", "--set", "optim.lr=1e8"))
    step = int(re.search(r"Diverged: step (\d+): ", error)[1])
    bad, before = run / f"checkpoints/step-{step - 1:08d}", run / f"checkpoints/step-{step - 2:08d}"
    said = (f"The weights of the last checkpoint, {bad}, give that loss themselves: move it aside (mv {bad} "
            f"{bad}.diverged) and rerun with --resume from the one before it, {before}; where this run's learning "
            "rate made them diverge, lower the learning rate (--set optim.lr=..., now 1e+08) too")
    assert said in error, error
    assert said.replace("1e+08", "0.002") in the_error(vitctl(*args))  # from it at the usual rate, as the walk did
    bad.rename(f"{bad}.diverged")  # the fix
    ok(*args)
    assert all(torch.isfinite(t).all() for t in final_weights(run).values())


def test_a_run_diverged_before_its_first_checkpoint_saves_none_and_a_lower_lr_starts_it_again(tmp_path):
    """The loss is checked at a checkpoint step that is no log step too."""
    run = tmp_path / "run"
    args = ["train", "--out", run, *DIVERGING, "--steps", 4, "--set", "train.log_every=4", "--set",
            "train.checkpoint_every=2"]
    error = the_error(vitctl(*args, "--set", "optim.lr=1e8"))
    assert ("raised Diverged: step 2: the training loss is not finite: the run diverged, and nothing from this step on "
            "is checkpointed. No checkpoint was saved before it: lower the learning rate (--set optim.lr=..., now "
            "1e+08) and start again") in error, error
    assert not (run / "checkpoints").exists()
    ok(*args)
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-00000002", "step-00000004"]
    assert logged_steps(run) == [4]


def test_non_finite_weights_after_a_finite_loss_are_never_checkpointed(prepared_shards, tmp_path, monkeypatch):
    """An update can overflow the weights after the loss it came from was finite: the checkpoint checks them."""
    step = Trainer._optimizer_step

    def overflowing(self: Trainer) -> torch.Tensor | None:
        norm = step(self)
        with torch.no_grad():
            next(self.par.weights.parameters()).view(-1)[0] = float("inf")
        return norm

    monkeypatch.setattr(Trainer, "_optimizer_step", overflowing)
    with pytest.raises(Diverged, match=r"^step 1: the weights hold non-finite values \(inf or nan\) after the update: "
                                       r"the run diverged, .* No checkpoint was saved before it"):
        train(tiny(prepared_shards, tmp_path / "r", "train.max_steps=2", "train.log_every=1",
                   "train.checkpoint_every=1"))
    assert logged_steps(tmp_path / "r") == [1] and not (tmp_path / "r/checkpoints").exists()


# ---------------------------------------------------------------- the metrics of an interrupted attempt


def test_a_resume_drops_the_records_logged_past_its_checkpoint(prepared_shards, tmp_path):
    """What `kill -9` after step 4's log, before its checkpoint, leaves (and a line it cut short): after the resume
    the log holds each step once."""
    run = tmp_path / "r"
    train(tiny(prepared_shards, run, "train.max_steps=3"))  # logs steps 2 and 3, checkpoints step 3
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "epoch": 0, "loss": 99.0}) + '\n{"step": 5, "epo')
    train(tiny(prepared_shards, run, "train.max_steps=6"), resume=True)
    records = read_metrics(run)
    assert logged_steps(run) == [2, 3, 4, 6] and 99.0 not in [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if r.get("event") == "resume"] == [3]
    assert len((run / "metrics.jsonl").read_text().splitlines()) == len(records)
