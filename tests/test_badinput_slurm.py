"""Bad, hostile or interrupted input to Slurm jobs, against the real dev cluster (slurm/dev-cluster/up): what sbatch
refuses, more memory than a node has, a cancel while pending or running, a time limit with no requeue left, a watch
over a job Slurm does not know, a run folder moved away."""

import json
import os
import shutil
import signal
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
    refused = vitctl("train", *RUN, "--steps", 2, "--time", 10, "--out", out, "--mem", "lots")
    assert refused.exit_code == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr == ("error: sbatch refused the job: Invalid --mem specification; nothing was submitted: "
                              "change what it names (--mem, --account, --qos, --partition, ...) and run the command "
                              "again\n")
    # sacct records the refused submission as a FAILED job: the registry must not take it for this one
    assert registry.load_records() == []
    assert "Invalid --mem" not in ok("status").output
    ok("train", *RUN, "--steps", 2, "--time", 10, "--out", out, "--mem", "1000M")  # the fix, followed
    job = registry.load_records()[-1].job_id
    assert wait_for(job, status.TERMINAL) == "COMPLETED"


def test_sigterm_while_sbatch_submits_names_the_job_it_submitted(tmp_path):
    """Before: `interrupted`, exit 130, and a job that ran on with no id in the list (its ranks waiting for a pickle
    never put in place): status said UNKNOWN, cancel `job  ... nothing to cancel`; only scancel ended it."""
    tools = tmp_path / "bin"
    tools.mkdir()
    sbatch = shutil.which("sbatch")  # a slow one: the signal comes while it submits
    (tools / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path}/sbatch-called\nsleep 3\nexec {sbatch} \"$@\"\n")
    (tools / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}"}
    out = tmp_path / "run"
    vitctl_train = subprocess.Popen([Path(sys.executable).parent / "vitctl", "train", *map(str, RUN), "--steps", "2",
                                     "--time", "10", "--out", str(out)], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "sbatch-called").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    vitctl_train.send_signal(signal.SIGTERM)  # to vitctl alone (`kill PID`): sbatch goes on
    _, stderr = vitctl_train.communicate(timeout=60)
    job = registry.find_record(str(out)).job_id
    assert vitctl_train.returncode == 130 and job, stderr
    assert stderr.splitlines()[-1] == (f"interrupted: job {job} was submitted before the interrupt came, and Slurm "
                                       f"runs it: `vitctl cancel {job}` stops it"), stderr
    assert wait_for(job, status.TERMINAL) == "COMPLETED"  # a job submitted whole: its ranks found their pickle


def test_more_memory_than_a_node_has_is_refused_before_submission_and_in_a_dry_run(tmp_path):
    out, largest = tmp_path / "run", max(int(m) for m in subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%m"], capture_output=True, text=True, check=True).stdout.split())
    for dry_run in ("--dry-run",), ():  # the dry run printed a script that sbatch refuses
        refused = vitctl("train", *RUN, "--steps", 2, "--time", 10, "--out", out, "--mem", "400G", *dry_run)
        assert refused.exit_code == 1 and refused.stdout == "", refused.stdout
        assert refused.stderr == (f"error: --mem 400G (409600 MB per node) but the nodes of partition debug have at "
                                  f"most {largest} MB; ask for --mem {largest}M or less\n")
    assert registry.load_records() == []
    fixed = ["--mem", f"{largest}M"]  # the fix, followed
    assert f"#SBATCH --mem={largest}M\n" in ok("train", *RUN, "--steps", 2, "--time", 10, "--out", out, *fixed,
                                               "--dry-run").output
    ok("train", *RUN, "--steps", 2, "--time", 10, "--out", out, *fixed)
    assert wait_for(registry.load_records()[-1].job_id, status.TERMINAL) == "COMPLETED"


def test_cancel_of_a_pending_job_says_it_leaves_the_queue(tmp_path, monkeypatch):
    (tmp_path / "bin").mkdir()  # an sbatch that holds the job: it stays pending until it is cancelled
    (tmp_path / "bin/sbatch").write_text(f'#!/bin/sh\nexec {shutil.which("sbatch")} --hold "$@"\n')
    (tmp_path / "bin/sbatch").chmod(0o755)
    with monkeypatch.context() as patch:
        patch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
        ok("train", *RUN, "--steps", 2, "--time", 10, "--out", tmp_path / "run")
    record = registry.load_records()[-1]
    wait_for(record.job_id, {"PENDING"})
    assert ok("cancel", record.job_id).output == (  # was: "its ranks checkpoint, then stop", though none had started
        f"cancelled job {record.job_id} ({record.name}) while it was pending: it leaves the queue; no rank is running, "
        "so there is nothing to checkpoint\n")
    assert wait_for(record.job_id, status.TERMINAL) == "CANCELLED"
    listed = json.loads(ok("status", record.job_id, "--json").output)[0]
    assert (listed["state"], listed["note"], listed["last_checkpoint"]) == ("CANCELLED", "", None)


def test_a_cancelled_slurm_job_says_where_it_checkpointed_and_resume_continues(tmp_path):
    out = tmp_path / "run"
    command = [*RUN, "--epochs", 1000, "--steps", 400, "--out", out, "--time", 10]
    ok("train", *command)
    job = registry.load_records()[-1].job_id
    deadline = time.monotonic() + 120
    while logged_steps(out) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "its ranks checkpoint, then stop" in ok("cancel", job).output
    wait_for(job, status.TERMINAL)
    deadline = time.monotonic() + 60  # sacct says CANCELLED at once; the ranks checkpoint while the job completes
    while squeued(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    listed = json.loads(ok("status", job, "--json").output)[0]
    step = int(listed["last_checkpoint"].removeprefix("step-"))
    assert listed["state"] == "CANCELLED" and 0 < step < 400, listed
    assert listed["note"] == f"checkpointed at step {step} on a signal: --resume continues from there"  # was: ""
    ok("train", *command, "--resume")  # the fix, followed
    again = registry.load_records()[-1].job_id
    assert wait_for(again, status.TERMINAL) == "COMPLETED"
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e.get("event") == "resume"] == [step]  # nothing lost, nothing repeated


def squeued(job: str) -> bool:
    return bool(subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip())


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


def test_status_of_a_job_whose_run_folder_moved_says_so(tmp_path, caplog):
    out = tmp_path / "run"
    ok("train", *RUN, "--steps", 2, "--time", 10, "--out", out)
    job = registry.load_records()[-1].job_id
    assert wait_for(job, status.TERMINAL) == "COMPLETED"
    shutil.move(out, tmp_path / "moved")
    listed = json.loads(ok("status", job, "--json").output)[0]
    assert listed["state"] == "COMPLETED" and listed["step"] is None
    assert listed["note"] == (f"its run folder {out} no longer exists (moved or deleted): its progress, checkpoints "
                              "and logs went with it; if you moved it, `vitctl status NEW_PLACE` records where")
    # before: an empty row, as of a job that never started; and the new place was "no job"
    followed = vitctl("status", tmp_path / "moved", "--json")
    assert followed.exit_code == 0, followed.stderr
    assert (f"note: job {job}'s run folder {out} was moved to {tmp_path / 'moved'}; recorded its new place"
            in caplog.text)
    for shown in (followed.output, ok("status", job, "--json").output):
        assert {k: json.loads(shown)[0][k] for k in ("job_id", "state", "step", "run_dir", "note")} == \
            {"job_id": job, "state": "COMPLETED", "step": 2, "run_dir": str(tmp_path / "moved"), "note": ""}
    shutil.move(tmp_path / "moved", tmp_path / "again")  # before: the pickle's path no longer matched the record's
    again = json.loads(ok("status", tmp_path / "again", "--json").output)[0]
    assert (again["job_id"], again["step"], again["run_dir"]) == (job, 2, str(tmp_path / "again"))
