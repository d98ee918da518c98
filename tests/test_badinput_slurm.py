"""Bad, hostile or interrupted input to Slurm jobs, against the real dev cluster (slurm/dev-cluster/up): what sbatch
refuses, a time limit with no requeue left, a watch over a job Slurm does not know, a run folder moved away."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_slurm import logged_steps, wait_for

from conftest import ok, vitctl
from vitctl.workflows import registry, status

pytestmark = pytest.mark.slurm
RUN = ["--config", "demo_vit", "--set", "data.source=synthetic", "--set", "data.train_samples=64", "--batch", 4,
       "--set", "data.workers=0", "--executor", "slurm", "--gpus", 0]


@pytest.fixture(autouse=True)
def cluster(tmp_path, monkeypatch):
    if subprocess.run(["scontrol", "ping"], capture_output=True).returncode:
        pytest.fail("the dev cluster is not up: run slurm/dev-cluster/up (make test does)")
    monkeypatch.setenv("VITCTL_HOME", str(tmp_path / "home"))


def test_a_request_sbatch_refuses_is_one_line_and_leaves_no_job(tmp_path):
    out = tmp_path / "run"
    refused = vitctl("train", *RUN, "--steps", 2, "--time", 10, "--out", out, "--mem", "400G")
    assert refused.exit_code == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr == ("error: sbatch refused the job: Memory specification can not be satisfied; Batch job "
                              "submission failed: Requested node configuration is not available; nothing was "
                              "submitted: change what it names (--mem, --account, --qos, --partition, ...) and run "
                              "the command again\n")
    # sacct records the refused submission as a FAILED job: the registry must not take it for this one
    assert registry.load_records() == []
    assert "Requested node configuration" not in ok("status").output
    ok("train", *RUN, "--steps", 2, "--time", 10, "--out", out, "--mem", "1000M")  # the fix, followed
    job = registry.load_records()[-1].job_id
    assert wait_for(job, status.TERMINAL) == "COMPLETED"


def test_a_time_limit_with_no_requeue_left_is_a_timeout_that_resume_continues(tmp_path):
    out = tmp_path / "run"
    command = [*RUN, "--epochs", 1000, "--steps", 400, "--out", out, "--time", 10]
    ok("train", *command, "--max-requeues", 0)
    job = registry.load_records()[-1].job_id
    deadline = time.monotonic() + 120
    while logged_steps(out) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)  # what Slurm sends before the time limit
    wait_for(job, status.TERMINAL)
    listed = json.loads(ok("status", job, "--json").output)[0]
    step = int(listed["last_checkpoint"].removeprefix("step-"))
    assert listed["state"] == "TIMEOUT" and 0 < step < 400, listed
    assert listed["note"] == (f"it reached its time limit with no requeue left (--time 10, --max-requeues 0): every "
                              f"rank checkpointed at step {step}; to go on from there, run the same command again "
                              "with --resume and a longer --time or a higher --max-requeues")
    ok("train", *command, "--max-requeues", 1, "--resume")  # the fix, followed
    again = registry.load_records()[-1].job_id
    assert wait_for(again, status.TERMINAL) == "COMPLETED"
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "resume"] == [step]  # nothing lost, nothing repeated
    assert json.loads(ok("status", again, "--json").output)[0]["step"] == 400


def test_watch_ends_when_slurm_knows_no_job(tmp_path):
    registry.add_record(registry.JobRecord("999999", "slurm", "vit_micro-old", str(tmp_path / "old"),
                                           str(tmp_path / "old/submitit"), 1, 1, 0, time.time()))
    watched = subprocess.run([Path(sys.executable).parent / "vitctl", "status", "--watch"], capture_output=True,
                             text=True, env=os.environ, timeout=30)  # it watched forever
    assert watched.returncode == 0, watched.stderr
    assert "999999\tvit_micro-old\tUNKNOWN\t" in watched.stdout


def test_status_of_a_job_whose_run_folder_moved_says_so(tmp_path):
    out = tmp_path / "run"
    ok("train", *RUN, "--steps", 2, "--time", 10, "--out", out)
    job = registry.load_records()[-1].job_id
    assert wait_for(job, status.TERMINAL) == "COMPLETED"
    shutil.move(out, tmp_path / "moved")
    listed = json.loads(ok("status", job, "--json").output)[0]
    assert listed["state"] == "COMPLETED" and listed["step"] is None
    assert listed["note"] == (f"its run folder {out} no longer exists (moved or deleted): its progress, checkpoints "
                              "and logs went with it")  # before: an empty row, as of a job that never started
