"""Against the real dev cluster (slurm/dev-cluster/up; `make test` starts it): multi-node gloo training,
requeue from checkpoint, cancel, status. Marked slurm."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import submitit
import torch
from rich.console import Console

from conftest import ok, vitctl
from vitctl.cli.jobs import status_table
from vitctl.trainer import checkpoint as ckpt
from vitctl.workflows import registry, status
from vitctl.workflows.job import TrainJob
from vitctl.workflows.submit import TrainTask

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
        state = status.slurm_states([job_id]).get(job_id, status.JobState("UNKNOWN", None)).state
        if state in states:
            return state
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not reach {states} (last: {state})")


def submit(shards: Path, out: Path, *extra: object, workers: int = 0) -> str:
    """A 2x2-rank job; with `workers`, each rank reads through that many loader worker processes, which Slurm's
    signals reach too."""
    run = [f"data.workers={workers}" if arg == "data.workers=0" else arg for arg in RUN]
    result = ok("train", "--data", shards, "--out", out, *run, *SLURM_2x2, *extra)
    assert "submitted job" in result.output
    return registry.load_records()[-1].job_id


def accounted(job_id: str) -> bool:
    listed = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobIDRaw"], capture_output=True,
                            text=True).stdout
    return job_id in listed.split()


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
    assert (listed.state, listed.step, listed.total_steps, listed.layout) == ("COMPLETED", 24, 24, "2x2 CPU dp4")
    log = vitctl("logs", job, "--rank", 3, "--follow")  # returns: the job has ended
    assert log.exit_code == 0 and "resumed" not in log.output


def test_a_pipeline_of_tensor_parallel_pairs_spans_two_nodes_like_four_local_ranks(prepared_shards, tmp_path):
    """pp2 x tp2 on 2 nodes x 2 ranks: each node holds one stage's tensor-parallel pair, the stages talk across."""
    hybrid = ["--set", "model.name=vit_mini", "--set", "parallel.pp=2", "--set", "parallel.tp=2",
              "--set", "parallel.microbatches=2", "--steps", 6]
    ok("train", "--data", prepared_shards, "--out", tmp_path / "local", *RUN, *hybrid, "--executor", "local",
       "--gpus", 0, "--tasks-per-node", 4)
    job = submit(prepared_shards, tmp_path / "slurm", *hybrid)
    assert wait_for(job, status.TERMINAL) == "COMPLETED"
    assert same(weights(tmp_path / "slurm"), weights(tmp_path / "local"))
    assert status.collect(registry.load_records())[-1].layout == "2x2 CPU pp2·tp2"


@pytest.mark.parametrize("interrupt", ["usr2", "scontrol-requeue"])
def test_requeued_job_resumes_and_ends_with_the_same_weights(prepared_shards, tmp_path, local_reference, interrupt):
    """With a loader worker a rank: before, USR2 killed DALI's workers and the ranks hung instead of checkpointing."""
    job = submit(prepared_shards, tmp_path / "run", workers=1)
    deadline = time.monotonic() + 120
    while logged_steps(tmp_path / "run") < (4 if interrupt == "usr2" else 5) and time.monotonic() < deadline:
        time.sleep(0.2)
    if interrupt == "usr2":  # what Slurm sends before the time limit, or on pre-emption
        subprocess.run(["scancel", "--signal=USR2", job], check=True)
    else:  # SIGTERM at once, then SIGKILL after KillWait: the ranks checkpoint in between
        subprocess.run(["scontrol", "requeue", job], check=True)
    wait_for(job, {"PENDING"})
    waiting = status.collect(registry.load_records())[0]
    assert waiting.state == "PENDING" and waiting.eta_s is None and waiting.elapsed != "00:00:00"
    assert waiting.note.startswith("requeued") and "(BeginTime)" in waiting.note
    start_now(job)
    assert wait_for(job, status.TERMINAL) == "COMPLETED"
    assert same(weights(tmp_path / "run"), local_reference)
    events = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e.get("event") == "resume"]
    stopped = [e for e in events if e.get("event") == "stopped"]
    assert len(resumed) == 1 and stopped and stopped[0]["step"] == resumed[0]["step"]  # nothing lost
    ended = status.collect(registry.load_records())[0]
    assert ended.restarts == 1 and ended.note.startswith("after 1 requeue"), ended.note  # was "requeued", as if waiting


@pytest.mark.slow
def test_after_a_node_failure_status_says_why_the_job_waits(prepared_shards, tmp_path):
    job = submit(prepared_shards, tmp_path / "run", "--epochs", 200)
    deadline = time.monotonic() + 120
    while logged_steps(tmp_path / "run") < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    try:  # a node failure at once: DOWN kills its jobs as NODE_FAIL and requeues them (a dead slurmd takes minutes)
        subprocess.run(["scontrol", "update", "NodeName=n1", "State=DOWN", "Reason=vitctl-test"], check=True)
        wait_for(job, {"PENDING"})
    finally:
        subprocess.run(["scontrol", "update", "NodeName=n1", "State=RESUME"], capture_output=True)
    listed = json.loads(ok("status", job, "--json").output)[0]
    assert listed["state"] == "PENDING" and listed["eta_s"] is None
    assert listed["note"].startswith("requeued after NODE_FAIL; ") and listed["elapsed"] != "00:00:00"
    subprocess.run(["scancel", job], check=True)
    assert wait_for(job, status.TERMINAL) == "CANCELLED"


def wait_for_steps(run_dir: Path, steps: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while logged_steps(run_dir) < steps and time.monotonic() < deadline:
        time.sleep(0.2)
    assert logged_steps(run_dir) >= steps


def vitctl_state(job: str) -> status.JobState:
    return status.state_of(registry.find_record(job))


def test_cancel_signals_the_ranks_so_that_kill_wait_cannot_cut_their_checkpoint_short(prepared_shards, tmp_path):
    """scancel gives the ranks KillWait (5 s on the dev cluster) to checkpoint before SIGKILL; the ranks are signalled
    instead, and the job ends once they have checkpointed: to Slurm it completed, to vitctl it was cancelled. Before,
    the signal also killed the ranks' loader workers, and a rank failed ("DataLoader worker ... killed by signal")."""
    job = submit(prepared_shards, tmp_path / "run", "--epochs", 200, workers=1)
    wait_for_steps(tmp_path / "run", 2)
    assert "cancel requested" in ok("cancel", job).output
    assert wait_for(job, status.TERMINAL) == "COMPLETED"  # Slurm never cancelled it
    state = vitctl_state(job)
    step = int(re.fullmatch(r"checkpointed at step (\d+) on a signal: --resume continues from there", state.note)[1])
    assert state.state == "CANCELLED" and ckpt.list_checkpoints(tmp_path / "run")[-1].name == f"step-{step:08d}"
    assert "has already ended (CANCELLED" in ok("cancel", job).output
    text = ok("status", job).output  # not a terminal: plain text
    assert f"{job}\tvit_micro-run\tCANCELLED\t2x2 CPU" in text
    console = Console(record=True, width=200)
    console.print(status_table(status.collect(registry.load_records()), 200))
    rendered = console.export_text()
    assert "CANCELLED" in rendered and "2x2 CPU" in rendered and job in rendered
    listed = json.loads(ok("status", "--json").output)
    assert listed[0]["state"] == "CANCELLED"


def test_a_job_stopped_by_sigterm_from_outside_vitctl_is_interrupted_not_completed(prepared_shards, tmp_path):
    """`scancel --signal=TERM` (as a batch system's own stop): the ranks checkpoint and end, which Slurm records as
    COMPLETED. Before, status said COMPLETED, in green, of a run far from done, with no note."""
    job = submit(prepared_shards, tmp_path / "run", "--epochs", 200)
    wait_for_steps(tmp_path / "run", 2)
    subprocess.run(["scancel", "--signal=TERM", job], check=True)
    assert wait_for(job, status.TERMINAL) == "COMPLETED"
    state = vitctl_state(job)
    step = int(re.fullmatch(r"checkpointed at step (\d+) on a signal: --resume continues from there", state.note)[1])
    assert state.state == "INTERRUPTED" and ckpt.list_checkpoints(tmp_path / "run")[-1].name == f"step-{step:08d}"


def test_status_says_when_a_job_s_time_limit_and_requeues_leave_it_too_little_time(prepared_shards, tmp_path):
    """Before, the ETA column showed hours past the time limit and --max-requeues without a word."""
    job = submit(prepared_shards, tmp_path / "run", "--epochs", 100000, "--time", 3, "--max-requeues", 0)
    try:
        wait_for_steps(tmp_path / "run", 2)
        listed = json.loads(ok("status", job, "--json").output)[0]
        assert listed["state"] == "RUNNING" and listed["eta_s"] > 180, listed
        stop = re.search(r"at this rate it needs \d+:\d\d:\d\d more, and its time limit with no requeue left "
                         r"\(--max-requeues\) gives it about 00:0[01]:\d\d: it will stop unfinished near step (\d+) "
                         rf"of {listed['total_steps']}; then the same command with --resume goes on from its last "
                         "checkpoint", listed["note"])
        assert stop and listed["step"] < int(stop[1]) < listed["total_steps"], listed["note"]
        _set_timeouts_left(registry.find_record(job), 10**6)  # as if submitted with that many
        listed = json.loads(ok("status", job, "--json").output)[0]
        assert re.search(r"its time limit stops this attempt in about 00:0[01]:\d\d, before it is done: it checkpoints "
                         r"and is requeued then \(1000000 requeues left\)", listed["note"]), listed["note"]
    finally:
        subprocess.run(["scancel", job], check=True)


def _set_timeouts_left(record: registry.JobRecord, left: int) -> None:
    """The countdown of time-limit requeues in the job's pickle, where submitit keeps it."""
    path = Path(record.folder) / f"{record.job_id}_submitted.pkl"
    delayed = submitit.helpers.DelayedSubmission.load(path)
    delayed._timeout_countdown = left
    delayed.dump(path)


def test_the_requeues_a_job_has_left_are_submitit_s_count_which_pre_emptions_leave_alone(tmp_path):
    """Before: every requeue counted against --max-requeues, so after a `scontrol requeue` the note said `no requeue
    left` while submitit requeued the job once more at its time limit."""
    record = registry.JobRecord("77", "slurm", "n", str(tmp_path), str(tmp_path / "submitit"), 1, 1, 0, time.time(),
                                max_requeues=3)
    Path(record.folder).mkdir()
    submitit.helpers.DelayedSubmission(TrainTask(TrainJob({}))).dump(Path(record.folder) / "77_submitted.pkl")
    _set_timeouts_left(record, 2)  # one time limit, and two pre-emptions (3 attempts requeued)
    state = status.JobState("RUNNING", 10.0, time_left_s=200, time_limit_s=300, requeued=3)
    note = status._time_limit_note(record, state, {"eta_s": 400.0, "step": 1, "total_steps": 10})
    assert note.endswith("it checkpoints and is requeued then (2 requeues left)"), note


@pytest.mark.parametrize(("extra", "message"), [
    (["--partition", "gpu"], "--partition 'gpu' does not exist; partitions: debug"),
    (["--nodes", 3], "--nodes 3 but partition debug has 2 nodes"),
    (["--gpus", 8], "partition debug's nodes have no GPUs"),
    (["--tasks-per-node", 4], "4 tasks x 1 CPUs per node but partition debug's nodes have 2 CPUs: pass fewer tasks "
                              "a node (--tasks-per-node, or --gpus, with more --nodes)"),
    (["--cpus-per-gpu", 3], "2 tasks x 3 CPUs per node but partition debug's nodes have 2 CPUs: pass --cpus-per-gpu 1, "
                            "or fewer tasks a node"),
    (["--partition", "gpu", "--dry-run"], "--partition 'gpu' does not exist; partitions: debug"),
])
def test_bad_requests_are_refused_before_submission(prepared_shards, tmp_path, extra, message):
    # a GPU job runs a task per GPU: --tasks-per-node beside --gpus is refused first
    slurm = SLURM_2x2[:-2] if "--gpus" in extra else SLURM_2x2
    args = ["train", "--data", prepared_shards, "--out", tmp_path / "run", *RUN, *slurm, *extra]
    result = vitctl(*[a for a in args])
    assert result.exit_code == 1 and message in result.stderr, result.stderr
    assert registry.load_records() == []
    assert not (tmp_path / "run/submitit").exists()


def test_the_cpu_refusal_s_fix_fits_the_node(prepared_shards, tmp_path):
    args = ["train", "--data", prepared_shards, "--out", tmp_path / "run", *RUN, *SLURM_2x2, "--dry-run"]
    ok(*args, "--cpus-per-gpu", 1)  # what the refusal of --cpus-per-gpu 3 names
    ok(*args[:-1], "--nodes", 2, "--tasks-per-node", 1, "--dry-run")  # fewer tasks a node, more nodes


def test_a_bad_config_is_refused_before_the_queue(prepared_shards, tmp_path):
    result = vitctl("train", "--data", prepared_shards, "--out", tmp_path / "run", *RUN, *SLURM_2x2,
                    "--set", "train.fused=all,attention=bogus", "--set", "model.img_size=36")
    assert result.exit_code == 1 and "attention has no implementation 'bogus'" in result.stderr
    assert "image size 36 is not a multiple of the patch size 8" in result.stderr
    assert registry.load_records() == []


def test_missing_paths_and_unwritable_run_folder_are_refused(prepared_shards, tmp_path):
    result = vitctl("train", "--data", tmp_path / "nope", "--out", tmp_path / "run", *RUN, *SLURM_2x2)
    assert result.exit_code == 1 and "does not exist" in result.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = vitctl("train", "--data", prepared_shards, "--out", blocker / "run", *RUN, *SLURM_2x2)
    assert result.exit_code == 1 and f"cannot be made: {blocker} is a file, not a folder" in result.stderr
    assert registry.load_records() == []


@pytest.mark.slow
def test_dry_run_script_runs_as_printed(prepared_shards, tmp_path, local_reference):
    script = ok("train", "--data", prepared_shards, "--out", tmp_path / "run", *RUN, *SLURM_2x2, "--dry-run").output
    assert "#SBATCH --requeue" in script.splitlines() and "wckey" not in script
    assert registry.load_records() == [] and not (tmp_path / "run").exists()
    (tmp_path / "job.sh").write_text(script)
    job = subprocess.run(["sbatch", "--parsable", "job.sh"], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout.strip()
    log = tmp_path / f"vit_micro-run-{job}.out"
    assert wait_for(job, status.TERMINAL) == "COMPLETED", log.read_text()[-2000:]
    assert same(weights(tmp_path / "run"), local_reference)


def test_a_dry_run_script_requeues_no_more_often_than_max_requeues(prepared_shards, tmp_path):
    """Before: its ranks requeued the job on every time-limit signal, whatever --max-requeues said."""
    script = ok("train", "--data", prepared_shards, "--out", tmp_path / "run", *RUN, *SLURM_2x2, "--epochs", 200,
                "--max-requeues", 0, "--dry-run").output
    assert "rank --max-requeues 0 --config" in script
    (tmp_path / "job.sh").write_text(script)
    job = subprocess.run(["sbatch", "--parsable", "job.sh"], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout.strip()
    log = tmp_path / f"vit_micro-run-{job}.out"
    try:
        wait_for_steps(tmp_path / "run", 2)
        subprocess.run(["scancel", "--signal=USR2", job], check=True)  # what Slurm sends before the time limit
        assert wait_for(job, status.TERMINAL) == "FAILED", log.read_text()[-2000:]
    finally:
        subprocess.run(["scancel", job], check=False)
    step = ckpt.list_checkpoints(tmp_path / "run")[-1].name.removeprefix("step-").lstrip("0")
    assert (f"it reached its time limit with no requeue left (--max-requeues 0, requeued on 0 time limits before): "
            f"every rank checkpointed at step {step}; to go on from there, submit it again") in log.read_text()


def test_one_run_folder_takes_one_live_job(prepared_shards, tmp_path):
    job = submit(prepared_shards, tmp_path / "run", "--epochs", 200)
    for extra in ([], ["--resume"]):
        refused = vitctl("train", "--data", prepared_shards, "--out", tmp_path / "run", *RUN, *SLURM_2x2, *extra)
        assert refused.exit_code == 1
        assert f"run folder {tmp_path / 'run'} is in use by job {job} (" in refused.stderr
        assert f"cancel it (`vitctl cancel {job}`), or choose another --out" in refused.stderr
    assert [r.job_id for r in registry.load_records()] == [job]
    ok("cancel", job)
    wait_for(job, status.TERMINAL)
    assert vitctl_state(job).state == "CANCELLED"


def slurm_rank_pid(job: str, rank: int) -> int:
    """The PID of one rank of a job on the dev cluster (whose nodes are this machine)."""
    wanted = {f"SLURM_JOB_ID={job}".encode(), f"SLURM_PROCID={rank}".encode(), b"SLURM_STEP_ID=0"}
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and wanted <= set((proc / "environ").read_bytes().split(b"\0")) \
                    and b"submitit" in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:  # ended meanwhile
            continue
    assert found, f"no process of rank {rank} of job {job}"
    return min(found)  # the rank, not a process it started


def hold_stopped(pid: int, done: threading.Event) -> None:
    """Keep a process stopped, as a rank stuck in a driver call is: Slurm's signals to a job come with SIGCONT."""
    while not done.is_set():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        time.sleep(0.02)


def test_a_second_cancel_ends_a_job_whose_hung_rank_holds_the_others_stop(prepared_shards, tmp_path):
    job = submit(prepared_shards, tmp_path / "run", "--epochs", 200)
    done = threading.Event()
    try:
        wait_for_steps(tmp_path / "run", 2)
        threading.Thread(target=hold_stopped, args=(slurm_rank_pid(job, 1), done), daemon=True).start()
        assert ok("cancel", job).output.strip().endswith("if it does not stop, cancel again to end it at once")
        time.sleep(3)
        state = vitctl_state(job)
        assert state.state == "RUNNING" and state.note.endswith("cancel requested"), state
        second = subprocess.Popen([Path(sys.executable).with_name("vitctl"), "cancel", job], text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        # before: CANCELLED at once, with a final word on what was kept, while Slurm's KillWait still ran (and ranks
        # that were not hung checkpointed after that word)
        deadline, seen = time.monotonic() + 30, []
        while not (state := vitctl_state(job)).finished and time.monotonic() < deadline:
            seen.append(state)
            if state.state == "COMPLETING" and state.note == status.ENDING:
                break
            time.sleep(0.2)
        assert state.state == "COMPLETING" and state.note == status.ENDING, seen
        out, err = second.communicate(timeout=120)
        assert second.returncode == 0, err
        assert out.startswith(f"ending job {job} (vit_micro-run) (scancel): Slurm kills its ranks that have not "
                              "stopped within its KillWait; waiting for them to end\n"
                              f"ended job {job}: the first cancel had not stopped it"), out
        assert vitctl_state(job).state == "CANCELLED" and status.slurm_states([job])[job].state == "CANCELLED"
    finally:
        done.set()
        subprocess.run(["scancel", job], check=False)


@pytest.mark.slow
def test_a_damaged_registry_gets_its_slurm_jobs_back_from_sacct(prepared_shards, tmp_path):
    job = submit(prepared_shards, tmp_path / "run", "--steps", 2)
    held = submit_held_lookalike(tmp_path / "held" / "submitit")
    try:
        # slurmctld hands a new job to the accounting daemon a moment after sbatch returns; recovery is from accounting
        deadline = time.monotonic() + 60
        while not (accounted(job) and accounted(held)) and time.monotonic() < deadline:
            time.sleep(0.5)
        registry.registry_path().write_text("[\n {\n  \"job_id\": ")
        registry.backup_path().unlink()
        listed = subprocess.run([Path(sys.executable).parent / "vitctl", "status", job], capture_output=True,
                                text=True, env=os.environ)
        assert listed.returncode == 0, listed.stderr
        assert "recovered no jobs from" in listed.stderr and "Slurm jobs from sacct" in listed.stderr
        recovered = registry.find_record(job)
        assert (recovered.run_dir, recovered.nodes, recovered.tasks_per_node) == (str(tmp_path / "run"), 2, 2)
        # sacct leaves a held job (eligible: unknown) out of its time window; squeue still lists it
        assert registry.find_record(held).run_dir == str(tmp_path / "held")
        assert wait_for(job, status.TERMINAL) == "COMPLETED"
    finally:
        subprocess.run(["scancel", held], check=False)


def submit_held_lookalike(folder: Path) -> str:
    """A held job submitted as submitit submits vitctl's (`sbatch FOLDER/.submission_file_<hex>.sh`)."""
    folder.mkdir(parents=True)
    script = folder / ".submission_file_0123abcd.sh"
    script.write_text("#!/bin/bash\n#SBATCH --hold\n#SBATCH --job-name=held-lookalike\n#SBATCH --output=/dev/null\n"
                      "true\n")
    out = subprocess.run(["sbatch", script], capture_output=True, text=True, check=True, cwd=folder).stdout
    return out.split()[-1]  # "Submitted batch job <id>"


@pytest.mark.slow
def test_a_failing_scancel_is_a_clear_error(prepared_shards, tmp_path, monkeypatch):
    registry.add_record(registry.JobRecord("999999", "slurm", "vit_micro-run", str(tmp_path / "old"),
                                           str(tmp_path / "old/submitit"), 2, 2, 0, time.time()))
    result = vitctl("cancel", "999999")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "error: Slurm knows no job 999999 (neither squeue nor sacct lists it)" in result.stderr
    job = submit(prepared_shards, tmp_path / "run", "--epochs", 200)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/scancel").write_text("#!/bin/sh\necho 'scancel: error: Unable to contact slurm controller "
                                          "(connect failure)' >&2\nexit 1\n")  # as when slurmctld is down
    (tmp_path / "bin/scancel").chmod(0o755)
    with monkeypatch.context() as patch:
        patch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
        result = vitctl("cancel", job)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert re.search(rf"error: scancel (--signal=TERM )?{job} failed: scancel: error: Unable to contact slurm "
                     rf"controller \(connect failure\); slurmctld does not answer: check `scontrol ping`, then run "
                     rf"`vitctl cancel {job}` again", result.stderr), result.stderr  # was: squeue, which fails too
    assert not registry.find_record(job).cancelled  # the fix, cancel again, is a first cancel: the ranks checkpoint
    wait_for_steps(tmp_path / "run", 1)
    (tmp_path / "bin/scancel").rename(tmp_path / "bin/squeue")  # squeue fails, sacct still says RUNNING
    with monkeypatch.context() as patch:
        patch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
        result = vitctl("cancel", job)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert (f"error: cannot cancel job {job}: squeue failed (scancel: error: Unable to contact slurm controller "
            "(connect failure)), so whether its ranks run, and need the signal that lets them checkpoint, is unknown; "
            f"check `scontrol ping`, then run `vitctl cancel {job}` again") in result.stderr, result.stderr
    assert not registry.find_record(job).cancelled and wait_for(job, {"RUNNING"}) == "RUNNING"  # was: scancel'd
    assert "cancel requested" in ok("cancel", job).output
    wait_for(job, status.TERMINAL)
    assert vitctl_state(job).state == "CANCELLED"


@pytest.mark.slow
def test_a_failing_rank_is_reported_with_its_log(prepared_shards, tmp_path):
    # what the ranks alone can check: their device (a Slurm job's is not known at submission)
    job = submit(prepared_shards, tmp_path / "run", "--set", "train.compile=true", "--set",
                 "train.compile_mode=reduce-overhead")
    assert wait_for(job, status.TERMINAL) == "FAILED"
    note = json.loads(ok("status", job, "--json").output)[0]["note"]
    assert re.fullmatch(r"rank \d raised ConfigError: .*replays CUDA graphs and needs a GPU.* \(traceback in (\S+)\)",
                        note), note
    log = Path(re.search(r"traceback in (\S+)\)$", note)[1])
    assert "Traceback (most recent call last)" in log.read_text()


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


@pytest.mark.parametrize(("reason", "note"), [
    ("JobHeldUser", "held: `scontrol release 77` lets it start (JobHeldUser)"),
    ("job requeued in held state", "held: `scontrol release 77` lets it start (JobHeldUser)"),
    ("Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority partitions",
     "waiting for nodes that are down, drained or reserved (`sinfo -R` says which, and why) (ReqNodeNotAvail)"),
    ("ReqNodeNotAvail, UnavailableNodes:n2", "waiting for nodes that are down, drained or reserved (`sinfo -R` says "
     "which, and why) (ReqNodeNotAvail, UnavailableNodes:n2)"),
    ("QOSMaxJobsPerUserLimit", "QOSMaxJobsPerUserLimit"),
])
def test_why_a_job_waits_is_said_in_words_that_name_it(tmp_path, monkeypatch, reason, note):
    """Before: `scontrol release JOB` with JOB as written, and Slurm's sentences for drained nodes or a held requeue
    as they came, naming no way on."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\n")
    (bin_dir / "squeue").write_text(f"#!/bin/sh\necho '77|PENDING|0|5:00|5:00|{reason}'\n")
    for tool in ("sacct", "squeue"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert status.slurm_states(["77"])["77"].note == note


def test_a_plan_written_again_after_submission_leaves_the_job_its_checked_layout(prepared_shards, tmp_path):
    """Before: the job read the plan file when its ranks started, so `vitctl plan --out` the same file while the job
    waited changed its layout unchecked (pp2 submitted, fsdp4 trained)."""
    from vitctl.trainer.parallel.strategy import BlockStrategy, Strategy
    plan, blocks = tmp_path / "plan.json", 4  # vit_micro's
    pipeline = Strategy(pp=2, microbatches=2, stages=(2, 2), blocks=(BlockStrategy(),) * blocks)
    plan.write_text(pipeline.to_json("vit_micro", 4))
    job = submit(prepared_shards, tmp_path / "run", "--plan", plan, "--steps", 2)
    plan.write_text(Strategy(blocks=(BlockStrategy(fsdp=True),) * blocks, fsdp_rest=True).to_json("vit_micro", 4))
    assert wait_for(job, status.TERMINAL) == "COMPLETED"
    assert status.collect(registry.load_records())[-1].layout == "2x2 CPU pp2·dp2"
    copies = list((tmp_path / "run").glob("plan-*.json"))
    assert [p.read_text() for p in copies] == [pipeline.to_json("vit_micro", 4)]
