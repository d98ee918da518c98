"""Against the real dev cluster (slurm/dev-cluster/up; `make test` starts it): multi-node gloo training,
requeue from checkpoint, cancel, status. Marked slurm."""

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from rich.console import Console

from conftest import ok, vitctl
from vitctl.cli.jobs import status_table
from vitctl.trainer import checkpoint as ckpt
from vitctl.workflows import registry, status

pytestmark = pytest.mark.slurm
RUN = ["--config", "demo_vit", "--batch", 4, "--epochs", 8, "--set", "model.num_classes=5", "--set",
       "train.log_every=2", "--set", "train.checkpoint_every=6", "--set", "data.workers=0", "--time", 10]
SLURM_2x2 = ["--executor", "slurm", "--nodes", 2, "--gpus", 0, "--tasks-per-node", 2]


@pytest.fixture(autouse=True)
def cluster(tmp_path, monkeypatch):
    if subprocess.run(["scontrol", "ping"], capture_output=True).returncode:
        pytest.fail("the dev cluster is not up: run slurm/dev-cluster/up (make test does)")
    monkeypatch.setenv("VITCTL_HOME", str(tmp_path / "home"))


def wait_for(job_id: str, states: set[str], timeout: float = 240) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = status.slurm_states([job_id]).get(job_id, ("UNKNOWN", ""))[0]
        if state in states:
            return state
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not reach {states} (last: {state})")


def submit(shards: Path, out: Path, *extra: object) -> str:
    result = ok("train", "--data", shards, "--out", out, *RUN, *SLURM_2x2, *extra)
    assert "submitted job" in result.output
    return registry.load_records()[-1].job_id


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if '"loss"' in line) if path.exists() else 0


def start_now(job_id: str) -> None:
    wait_for(job_id, {"PENDING"})
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.consolidated(ckpt.list_checkpoints(run_dir)[-1])


def same(a: dict, b: dict) -> bool:
    """Bitwise: the same reductions in the same order, whether or not the job was interrupted."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def local_reference(prepared_shards, tmp_path_factory):
    """The same job as 4 gloo ranks on this machine through submitit's local executor."""
    out = tmp_path_factory.mktemp("local") / "run"
    ok("train", "--data", prepared_shards, "--out", out, *RUN, "--executor", "local", "--gpus", 0,
       "--tasks-per-node", 4)
    return weights(out)


def test_two_nodes_train_like_a_local_four_process_run(prepared_shards, tmp_path, local_reference):
    job = submit(prepared_shards, tmp_path / "run")
    assert wait_for(job, status.TERMINAL) == "COMPLETED"
    assert same(weights(tmp_path / "run"), local_reference)
    nodes = subprocess.run(["sacct", "-n", "-X", "-j", job, "-o", "NodeList"], capture_output=True, text=True)
    assert nodes.stdout.strip() == "n[1-2]"
    listed = status.collect(registry.load_records())[0]
    assert (listed.state, listed.step, listed.total_steps, listed.layout) == ("COMPLETED", 24, 24, "2x2 CPU")
    log = vitctl("logs", job, "--rank", 3, "--follow")  # returns: the job has ended
    assert log.exit_code == 0 and "resumed" not in log.output


@pytest.mark.parametrize("interrupt", ["usr2", "scontrol-requeue"])
def test_requeued_job_resumes_and_ends_with_the_same_weights(prepared_shards, tmp_path, local_reference, interrupt):
    job = submit(prepared_shards, tmp_path / "run")
    deadline = time.monotonic() + 120
    while logged_steps(tmp_path / "run") < (4 if interrupt == "usr2" else 5) and time.monotonic() < deadline:
        time.sleep(0.2)
    if interrupt == "usr2":  # what Slurm sends before the time limit, or on pre-emption
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
    else:  # killed at once: resumes from the last periodic checkpoint
        subprocess.run(["scontrol", "requeue", job], check=True)
    start_now(job)
    assert wait_for(job, status.TERMINAL) == "COMPLETED"
    assert same(weights(tmp_path / "run"), local_reference)
    events = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e.get("event") == "resume"]
    assert len(resumed) == 1
    if interrupt == "usr2":
        stopped = [e for e in events if e.get("event") == "stopped"]
        assert stopped and stopped[0]["step"] == resumed[0]["step"]  # checkpointed on the signal, nothing lost
    assert status.collect(registry.load_records())[0].restarts == 1


def test_cancel_shows_cancelled(prepared_shards, tmp_path):
    job = submit(prepared_shards, tmp_path / "run", "--set", "train.epochs=200")
    wait_for(job, {"RUNNING"})
    assert "cancel requested" in ok("cancel", job).output
    assert wait_for(job, status.TERMINAL) == "CANCELLED"
    text = ok("status", job).output  # not a terminal: plain text
    assert f"{job}\tvit_micro-run\tCANCELLED\t2x2 CPU" in text
    console = Console(record=True, width=200)
    console.print(status_table(status.collect(registry.load_records())))
    rendered = console.export_text()
    assert "CANCELLED" in rendered and "2x2 CPU" in rendered and job in rendered
    listed = json.loads(ok("status", "--json").output)
    assert listed[0]["state"] == "CANCELLED"


@pytest.mark.parametrize(("extra", "message"), [
    (["--partition", "gpu"], "--partition 'gpu' does not exist; partitions: debug"),
    (["--nodes", 3], "--nodes 3 but partition debug has 2 nodes"),
    (["--gpus", 8], "partition debug's nodes have no GPUs"),
    (["--tasks-per-node", 4], "4 tasks x 1 CPUs per node but partition debug's nodes have 2 CPUs"),
    (["--time", "1:xx"], "is not a Slurm time"),
])
def test_bad_requests_are_refused_before_submission(prepared_shards, tmp_path, extra, message):
    args = ["train", "--data", prepared_shards, "--out", tmp_path / "run", *RUN, *SLURM_2x2, *extra]
    result = vitctl(*[a for a in args])
    assert result.exit_code == 1 and message in result.stderr, result.stderr
    assert registry.load_records() == []
    assert not (tmp_path / "run/submitit").exists()


def test_a_bad_config_is_refused_before_the_queue(prepared_shards, tmp_path):
    result = vitctl("train", "--data", prepared_shards, "--out", tmp_path / "run", *RUN, *SLURM_2x2,
                    "--set", "train.fused=all,attention=bogus", "--set", "model.img_size=36")
    assert result.exit_code == 1 and "attention has no implementation 'bogus'" in result.stderr
    assert "image size 36 is not a multiple of the patch size 8" in result.stderr
    assert registry.load_records() == []


def test_missing_paths_and_unwritable_run_folder_are_refused(prepared_shards, tmp_path):
    result = vitctl("train", "--data", tmp_path / "nope", "--out", tmp_path / "run", *RUN, *SLURM_2x2)
    assert result.exit_code == 1 and "is not a folder" in result.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = vitctl("train", "--data", prepared_shards, "--out", blocker / "run", *RUN, *SLURM_2x2)
    assert result.exit_code == 1 and "is not writable" in result.stderr
    assert registry.load_records() == []


def test_dry_run_prints_the_sbatch_script(tmp_path):
    result = ok("train", "--set", "data.source=synthetic", "--out", tmp_path / "run", "--config", "swin_b_pretrain",
                "--executor", "slurm", "--nodes", 2, "--gpus", 8,
                "--cpus-per-gpu", 12, "--time", "1-00:00:00", "--partition", "gpu", "--account", "vision",
                "--container-image", "nvcr.io#nvidia/pytorch:25.10-py3", "--container-mounts", "/data:/data",
                "--dry-run")
    script = result.output
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=12", "#SBATCH --time=1440", "#SBATCH --partition=gpu",
                 "#SBATCH --account=vision", "#SBATCH --signal=USR2@90", "--container-image=nvcr.io#nvidia/pytorch"]:
        assert line in script, line
    assert registry.load_records() == [] and not list(tmp_path.glob("run/submitit/*"))


def test_plain_sbatch_template_trains_across_both_nodes(prepared_shards, tmp_path):
    import os
    import sys

    env = dict(os.environ, DATA=str(prepared_shards), OUT=str(tmp_path / "run"), PRESET="demo_vit",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    submitted = subprocess.run(
        ["sbatch", "--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10",
         f"--output={tmp_path}/%j.out", "slurm/pretrain.sbatch", "--set", "data.batch_size=4", "--set",
         "model.num_classes=5", "--set", "train.epochs=2", "--set", "data.workers=0"],
        env=env, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
    job = submitted.stdout.split()[-1]
    assert wait_for(job, status.TERMINAL) == "COMPLETED", (tmp_path / f"{job}.out").read_text()[-2000:]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "run")] == ["step-00000006"]
    assert "[rank 0]" in (tmp_path / f"{job}.out").read_text()
