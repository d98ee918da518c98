"""The job registry under real concurrency (separate processes), damage and interrupted submissions."""

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import ok, vitctl
from vitctl.workflows import registry, status
from vitctl.workflows.process import start_time
from vitctl.workflows.registry import JobRecord

VITCTL = Path(sys.executable).parent / "vitctl"
ADD_MANY = """
import sys, time
from vitctl.workflows.registry import JobRecord, add_record
for i in range(int(sys.argv[2])):
    add_record(JobRecord(f"{sys.argv[1]}-{i}", "local", "n", "/r", "/r/submitit", 1, 1, 0, time.time()))
"""


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VITCTL_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def record(job_id: str, run_dir: str = "/runs/a", **fields) -> JobRecord:
    return JobRecord(job_id, "local", "vit_micro-a", run_dir, f"{run_dir}/submitit", 1, 2, 0, time.time(), **fields)


def test_concurrent_writers_lose_nothing(home):
    writers = [subprocess.Popen([sys.executable, "-c", ADD_MANY, f"w{w}", "20"]) for w in range(4)]
    assert [w.wait(timeout=120) for w in writers] == [0] * 4
    ids = [r.job_id for r in registry.load_records()]
    assert sorted(ids) == sorted(f"w{w}-{i}" for w in range(4) for i in range(20))
    assert json.loads(registry.backup_path().read_text()) == json.loads(registry.registry_path().read_text())
    assert sorted(p.name for p in home.iterdir()) == ["jobs.json", "jobs.json.bak", "jobs.lock"]  # no temporaries


def test_a_damaged_registry_is_recovered_from_its_backup_and_reported(home):
    for job_id in ("101", "102"):
        registry.add_record(record(job_id, f"/runs/{job_id}"))
    text = registry.registry_path().read_text()
    registry.registry_path().write_text(text[: len(text) // 2])  # half written, as a crash or a full disk leaves it
    listed = subprocess.run([VITCTL, "status"], capture_output=True, text=True, env=os.environ)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    assert "101" in listed.stdout and "102" in listed.stdout
    assert f"warning: {registry.registry_path()} was damaged" in listed.stderr
    assert f"recovered 2 jobs from {registry.backup_path()}" in listed.stderr
    damaged = list(home.glob("jobs.json.damaged-*"))
    assert len(damaged) == 1 and damaged[0].read_text() == text[: len(text) // 2]  # kept for the user
    assert {"101", "102"} <= {r.job_id for r in registry.load_records()}  # mended for good


@pytest.mark.parametrize("field, value", [("folder", None), ("nodes", "1"), ("command", "vitctl train")])
def test_a_record_edited_to_a_field_of_another_type_is_recovered_as_damage(home, field, value):
    """Before: a traceback in status (a folder of null) or logs (nodes of "1")."""
    for job_id in ("101", "102"):
        registry.add_record(record(job_id, f"/runs/{job_id}"))
    rows = json.loads(registry.registry_path().read_text())
    rows[1][field] = value
    registry.registry_path().write_text(json.dumps(rows))
    for command in (["status"], ["logs", "102"]):
        result = subprocess.run([VITCTL, *command], capture_output=True, text=True, env=os.environ)
        assert "Traceback" not in result.stderr, result.stderr
    listed = subprocess.run([VITCTL, "status"], capture_output=True, text=True, env=os.environ)
    assert "101" in listed.stdout and "102" in listed.stdout
    damaged = next(home.glob("jobs.json.damaged-*"))  # the first command recovered it, and kept the edit aside
    assert json.loads(damaged.read_text())[1][field] == value


def test_without_a_good_backup_the_registry_starts_empty_and_says_so(home):
    registry.add_record(record("101"))
    registry.registry_path().write_text("[{")
    registry.backup_path().write_text("")
    listed = subprocess.run([VITCTL, "jobs"], capture_output=True, text=True, env=os.environ)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr
    assert "recovered no jobs from" in listed.stderr and "(missing or damaged too)" in listed.stderr
    assert all(r.executor == "slurm" for r in registry.load_records())  # only what sacct still knows


def test_a_recovery_that_could_not_ask_sacct_says_so_rather_than_that_slurm_had_no_jobs(home, tmp_path, monkeypatch):
    """Before: 'recovered ... and 0 Slurm jobs from sacct', where sacct had failed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Problem talking to the database' >&2\nexit 1\n")
    (bin_dir / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    registry.add_record(record("101"))
    registry.registry_path().write_text("[{")
    registry.backup_path().write_text("")
    listed = subprocess.run([VITCTL, "jobs"], capture_output=True, text=True, env=os.environ)
    assert listed.returncode == 0 and "Traceback" not in listed.stderr
    assert ("and no Slurm jobs: sacct could not be asked (sacct: error: Problem talking to the database), so "
            f"jobs submitted to Slurm from here in the last {registry.SACCT_DAYS} days are not listed") in listed.stderr


def test_an_interrupted_submission_is_settled_from_the_job_folder(home, tmp_path):
    """vitctl killed after the job was submitted and before it recorded the id: the record it made beforehand
    gets the id of the job submitit left in the folder."""
    gone = subprocess.Popen(["sleep", "0"])
    submitter = [gone.pid, start_time(gone.pid) or 1]
    gone.wait()
    folder = tmp_path / "run/submitit"
    folder.mkdir(parents=True)
    pending = record("", str(tmp_path / "run"), submitter=submitter)
    registry.add_record(pending)
    (folder / "4242_submitted.pkl").write_bytes(b"")  # what submitit writes once it has the id
    settled = registry.load_records()
    assert [(r.job_id, r.submitter) for r in settled] == [("4242", None)]
    assert registry.find_record("run").job_id == "4242"


def test_a_submission_in_progress_is_left_to_its_submitter(home):
    pending = record("", submitter=[os.getpid(), start_time(os.getpid())])
    registry.add_record(pending)
    assert registry.load_records()[0].submitter == pending.submitter
    from vitctl.workflows import status

    assert status.state_of(pending).state == "SUBMITTING"


def _train_args(out: Path) -> list[object]:
    return ["train", "--config", "demo_vit", "--set", "data.source=synthetic", "--steps", 1, "--out", out,
            "--executor", "local", "--gpus", 0]


@pytest.mark.parametrize("command", [["train"], ["status"], ["jobs"], ["cancel", "123"], ["logs", "123"]])
def test_a_registry_folder_under_a_regular_file_is_named_with_the_fix(tmp_path, monkeypatch, command):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    monkeypatch.setenv("VITCTL_HOME", str(blocker / "home"))
    result = vitctl(*(_train_args(tmp_path / "run") if command == ["train"] else command))
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert result.stderr == f"error: cannot keep the job registry in VITCTL_HOME={blocker / 'home'}: {blocker} is a " \
                            f"file, not a folder; point VITCTL_HOME at a folder this user can write, e.g. `export " \
                            f"VITCTL_HOME=$HOME/.vitctl`\n"
    assert not (tmp_path / "run").exists() and blocker.read_text() == "mine"  # nothing launched
    monkeypatch.setenv("VITCTL_HOME", str(tmp_path / "home"))
    ok("jobs")


def test_a_registry_folder_this_user_may_not_write_is_named(home, tmp_path, monkeypatch):
    """Tests run as root, whom chmod does not stop: the OS's refusal is injected where the lock file opens."""
    real_open = open

    def refusing(file, *args, **kwargs):
        if Path(str(file)).name == "jobs.lock":
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr("builtins.open", refusing)
        result = vitctl(*_train_args(tmp_path / "run"))
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert f"error: cannot keep the job registry in VITCTL_HOME={home}: Permission denied ({home / 'jobs.lock'}); " \
           f"point VITCTL_HOME at a folder this user can write" in result.stderr
    assert not (tmp_path / "run" / "submitit").exists()  # refused before submitting


def test_a_run_folder_is_found_however_its_path_is_written(home, tmp_path, monkeypatch):
    """Jobs are registered with their absolute run folder; a relative path, ./ or a trailing slash names it too."""
    ours, theirs = tmp_path / "sweep/runs/pre", tmp_path / "other/runs/pre"
    for job_id, run_dir in (("7001", ours), ("7002", theirs)):
        run_dir.mkdir(parents=True)
        registry.add_record(record(job_id, str(run_dir)))
    monkeypatch.chdir(tmp_path / "sweep")
    for written in ("runs/pre", "./runs/pre", "runs/pre/", f"{ours}/", str(ours)):
        assert [s["job_id"] for s in json.loads(ok("status", written, "--json").output)] == ["7001"], written
        assert "job 7001 (vit_micro-a) is not running" in ok("cancel", written).output
        assert "the logs of job 7001 (" in vitctl("logs", written).stderr  # its submitit folder was never made
    registry.add_record(record("7003", str(ours)))  # the same run folder again (--resume): the newest job is meant
    assert "job 7003 (vit_micro-a) is not running" in ok("cancel", "runs/pre").output
    monkeypatch.chdir(tmp_path / "sweep/runs")  # here the bare name is a folder, so a path
    assert "job 7003 (vit_micro-a) is not running" in ok("cancel", "pre").output


def test_a_folder_here_that_is_no_run_folder_does_not_hide_the_run_of_that_name(home, tmp_path, monkeypatch):
    """Before: `no job 'c' (HERE/c)`, where c was a known run's name and only by chance a folder here too."""
    registry.add_record(record("7001", str(tmp_path / "runs/c")))
    (tmp_path / "x/c").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "x")
    assert [s["job_id"] for s in json.loads(ok("status", "c", "--json").output)] == ["7001"]
    assert vitctl("status", "d", "--json").stderr.startswith("error: no job 'd' in ")


def test_a_bare_folder_name_that_names_jobs_in_several_places_is_refused_with_them_listed(home, tmp_path):
    ours, theirs = tmp_path / "sweep/runs/pretrain", tmp_path / "other/pretrain"
    registry.add_record(record("7001", str(ours)))
    registry.add_record(record("7002", str(theirs)))
    for command in ("cancel", "logs"):
        result = vitctl(command, "pretrain")
        assert result.exit_code == 1 and "Traceback" not in result.stderr
        assert result.stderr == f"error: 'pretrain' names the run folders of 2 jobs in different places: 7001 " \
                                f"({ours}), 7002 ({theirs}); pass the job id or the full path of the run folder\n"
    listed = json.loads(ok("status", "pretrain", "--json").output)  # reading both is harmless
    assert [(s["job_id"], s["run_dir"]) for s in listed] == [("7001", str(ours)), ("7002", str(theirs))]
    assert "job 7001 (vit_micro-a) is not running" in ok("cancel", "7001").output
    assert "job 7002 (vit_micro-a) is not running" in ok("cancel", theirs).output


def test_jobs_piped_prints_whole_paths_one_line_a_job(home, tmp_path):
    """Before: the run folder column was cut to 80 columns (`/tmp/walkF/repo/…`), so two runs read the same."""
    deep = tmp_path / ("a-rather-long-folder-name-" * 3) / "runs"
    for job_id, name in (("7001", "pretrain"), ("7002", "finetune")):
        registry.add_record(record(job_id, str(deep / name)))
    lines = ok("jobs").output.splitlines()
    assert lines[0] == "job\texecutor\tname\trun folder\tsubmitted"
    assert [line.split("\t")[:4] for line in lines[1:]] == [["7001", "local", "vit_micro-a", str(deep / "pretrain")],
                                                            ["7002", "local", "vit_micro-a", str(deep / "finetune")]]


def test_a_job_is_found_by_the_name_vitctl_jobs_shows(home, tmp_path):
    """Before: `no job 'vit_micro-a'` for the name in `vitctl jobs`' name column."""
    registry.add_record(record("7001", str(tmp_path / "sweep/a")))
    assert "vit_micro-a" in ok("jobs").output
    assert "job 7001 (vit_micro-a) is not running" in ok("cancel", "vit_micro-a").output
    registry.add_record(record("7002", str(tmp_path / "other/a")))  # another run of that model into a folder named a
    result = vitctl("cancel", "vit_micro-a")
    assert result.exit_code == 1 and result.stderr.startswith(
        "error: 'vit_micro-a' names the run folders of 2 jobs in different places: 7001"), result.stderr


@pytest.mark.parametrize("command", ["status", "logs", "cancel"])
def test_an_empty_job_is_refused_not_read_as_every_job(command):
    """Before: `vitctl status ""` (an unset shell variable) listed every job."""
    result = vitctl(command, "")
    assert result.exit_code == 1 and result.stderr == ("error: the job is empty; give a job id or a run folder "
                                                       "(`vitctl jobs` lists them)\n"), result.stderr


@pytest.mark.parametrize("command", ["status", "logs", "cancel"])
def test_a_folder_in_a_run_or_holding_runs_names_the_run_folders(home, tmp_path, command):
    """Before: a bare `no job` for the checkpoint path `train` prints, a run's submitit folder, or the folder of
    runs."""
    runs = tmp_path / "runs"
    for job_id, name in (("7001", "a"), ("7002", "b")):
        (runs / name / "checkpoints/step-00000004").mkdir(parents=True)
        registry.add_record(record(job_id, str(runs / name)))
    inside = vitctl(command, runs / "a/checkpoints/step-00000004")
    assert inside.exit_code == 1 and inside.stderr.strip().endswith(
        f"it lies in the run folder {runs / 'a'} (job 7001): give that folder, or the job id"), inside.stderr
    holding = vitctl(command, runs)
    assert holding.exit_code == 1 and holding.stderr.strip().endswith(
        f"it holds the run folders {runs / 'a'} (job 7001), {runs / 'b'} (job 7002): give one of them, or its job "
        "id"), holding.stderr
    followed = vitctl(command, runs / "a")  # the fix: the run folder
    assert "no job" not in followed.stderr and "7001" in followed.output + followed.stderr  # found (logs: none yet)


def test_a_full_file_system_under_the_registry_is_named_with_the_fix_that_fits(home):
    """Before: 'No space left on device; point VITCTL_HOME at a folder this user can write', which it can."""
    import errno

    with pytest.raises(registry.LaunchError) as error, registry._home_errors():
        raise OSError(errno.ENOSPC, "No space left on device", str(home / "jobs.json"))
    assert str(error.value) == (
        f"cannot keep the job registry in VITCTL_HOME={home}: No space left on device ({home / 'jobs.json'}); free "
        f"space on the file system of {home} (or raise your quota there), or point VITCTL_HOME at a folder on another "
        "one")


def test_an_empty_vitctl_home_is_the_default_not_the_current_folder(tmp_path, monkeypatch):
    """An unset shell variable (`VITCTL_HOME=`) kept the registry in the folder each command ran from."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("VITCTL_HOME", "")
    registry.add_record(JobRecord("999999999", "local", "vit_micro-run", str(tmp_path / "run"),
                                  str(tmp_path / "run/submitit"), 1, 1, 0, time.time()))
    assert (tmp_path / "user/.vitctl/jobs.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["user"]
    assert "vit_micro-run" in ok("jobs").output


def test_status_of_many_failed_jobs_reads_the_registry_a_fixed_number_of_times(home, tmp_path, monkeypatch):
    """Before: each failed job's row read and parsed the whole registry twice, so that `vitctl status` of 1,000 jobs
    took 76 s on a 2-core VM (7 s after a first mend, 0.6 s now)."""
    for i in range(40):  # 20 run folders, two jobs each: the first's note depends on the second
        run = tmp_path / f"run{i % 20}"
        (run / "submitit").mkdir(parents=True, exist_ok=True)
        registry.add_record(JobRecord(str(100000 + i), "local", f"vit-{i}", str(run), str(run / "submitit"), 1, 1, 0,
                                      time.time() - 1000 + i, started=-1))
    loads = []
    real = registry.load_records
    monkeypatch.setattr(registry, "load_records", lambda: loads.append(1) or real())
    monkeypatch.setattr(status, "load_records", registry.load_records)
    rows = status.collect(registry.load_records())
    assert [r.state for r in rows] == ["UNKNOWN"] * 20 + ["FAILED"] * 20  # the earlier 20 have a successor
    assert all(f"job {100020 + i} ran there since" in rows[i].note for i in range(20)), rows[0].note
    assert len(loads) <= 3, len(loads)


def test_forget_drops_the_jobs_it_names_and_touches_no_file(home, tmp_path):
    """A job id names that job; a run folder or name every job of that folder; --gone those whose folder is gone."""
    kept_run, other_run, gone_run = tmp_path / "runs/a", tmp_path / "runs/b", tmp_path / "runs/gone"
    for run_dir in (kept_run, other_run):
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "checkpoints/step-1").write_text("weights")
    for job_id, run_dir in (("7001", kept_run), ("7002", kept_run), ("7003", other_run), ("7004", gone_run)):
        registry.add_record(record(job_id, str(run_dir)))
    assert ok("forget", "7001").output.startswith(f"forgot job 7001 (vit_micro-a, {kept_run})\n")
    assert [r.job_id for r in registry.load_records()] == ["7002", "7003", "7004"]
    forgotten = ok("forget", other_run, "--gone").output
    assert forgotten == (f"forgot job 7003 (vit_micro-a, {other_run})\nforgot job 7004 (vit_micro-a, {gone_run})\n"
                         "nothing on disk was changed: run folders, checkpoints and logs stay where they are\n")
    assert [r.job_id for r in registry.load_records()] == ["7002"]
    assert json.loads(registry.backup_path().read_text()) == json.loads(registry.registry_path().read_text())
    assert (other_run / "checkpoints/step-1").read_text() == "weights"
    assert [s["job_id"] for s in json.loads(ok("status", "--json").output)] == ["7002"]
    assert ok("forget", "--gone").output.startswith("no job's run folder is gone: nothing to forget")
    assert "forgot job 7002" in ok("forget", "a").output  # the run folder's name
    assert vitctl("forget").exit_code == 2  # nothing named: not every job


def test_forget_keeps_a_running_job_and_says_how_to_end_it(home, tmp_path):
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        pid = str(running.pid)
        registry.add_record(record(pid, str(tmp_path / "runs/live"), started=start_time(running.pid)))
        registry.add_record(record("7001", str(tmp_path / "runs/ended")))
        result = vitctl("forget", pid, "7001")
        assert result.exit_code == 1 and "Traceback" not in result.stderr
        assert result.output.startswith(f"forgot job 7001 (vit_micro-a, {tmp_path / 'runs/ended'})\n")
        assert result.stderr == (f"error: kept job {pid} (vit_micro-a): it is RUNNING; forget it once it has ended "
                                 f"(`vitctl cancel {pid}` stops it)\n")
        assert [r.job_id for r in registry.load_records()] == [pid]
    finally:
        running.kill()
        running.wait()


def test_forget_keeps_a_slurm_job_whose_end_slurm_cannot_confirm(home, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sacct", "squeue"):
        (bin_dir / tool).write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller' >&2\n"
                                    "exit 1\n")
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    registry.add_record(replace(record("101", str(tmp_path / "runs/s")), executor="slurm"))
    result = vitctl("forget", "101")
    assert result.exit_code == 1 and result.stderr.startswith(
        "error: kept job 101 (vit_micro-a): whether it has ended cannot be told: Slurm is unreachable: "), result.stderr
    assert "forget it once Slurm answers again" in result.stderr
    assert [r.job_id for r in registry.load_records()] == ["101"]


def test_a_job_vitctl_did_not_submit_is_told_where_to_watch_it(home, tmp_path):
    """Before: `no job '403' ...; \\`vitctl jobs\\` lists the known ones` for a job submitted by sbatch of a --dry-run
    script, a dead end."""
    for command in ("status", "logs", "cancel"):
        result = vitctl(command, "403")
        assert result.exit_code == 1 and ("a job not in the list was submitted by sbatch (a `--dry-run` script, "
                                          "slurm/*.sbatch: `squeue -j 403`, `sacct -j 403`, `scancel 403` reach it"
                                          in result.stderr), result.stderr
    run = tmp_path / "runs/by-hand"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    (run / "job-410.yaml").write_text("")
    result = vitctl("status", run)
    assert result.exit_code == 1 and f"{run} holds a run none of whose jobs is in the list, which was submitted by " \
        "sbatch (a `--dry-run` script, slurm/*.sbatch: `squeue -j 410`" in result.stderr, result.stderr
    assert f"or forgotten (`vitctl forget`: its logs stay in {run}/submitit)" in result.stderr
    assert "holds a run" not in vitctl("status", tmp_path / "runs/none").stderr
    (run / "job-410.yaml").unlink()  # slurm/*.sbatch writes none: the id is the one its rank 0 left in the lock
    (run / "job.lock").write_text('{"job": "412", "executor": "slurm", "pid": 7, "host": "n1", "since": 0}')
    assert "`squeue -j 412`, `sacct -j 412`, `scancel 412`" in " ".join(vitctl("logs", run).stderr.split())
    # a local job's id is a process id, which scancel would take for another job's (was: Slurm's commands named)
    (run / "job.lock").write_text('{"job": "23904", "executor": "local", "pid": 23910, "host": "vm", "since": 0}')
    said = " ".join(vitctl("logs", run).stderr.split())
    assert f"{run} holds a run none of whose jobs is in the list: local job 23904 (on vm) trained there last, and " \
        f"was forgotten (`vitctl forget`) or started under another VITCTL_HOME; its logs stay in {run}/submitit" in \
        said and "scancel" not in said, said


def test_forget_finds_a_moved_run_folder_and_refuses_a_name_of_several(home, tmp_path):
    """Before: `forget NEW_PLACE` recorded the new place but forgot nothing (`nothing to forget`), and a bare name
    forgot the jobs of every run folder of that name."""
    old = tmp_path / "runs/q1"
    (old / "submitit").mkdir(parents=True)
    (old / "submitit/7001_submitted.pkl").write_bytes(str(old).encode())  # the run folder submitit's pickle names
    registry.add_record(record("7001", str(old)))
    moved = old.rename(tmp_path / "runs/q1_moved")
    assert ok("forget", moved).output.startswith(f"forgot job 7001 (vit_micro-a, {moved})\n")
    assert registry.load_records() == []
    registry.add_record(record("7002", str(tmp_path / "a/pretrain")))
    registry.add_record(record("7003", str(tmp_path / "b/pretrain")))
    result = vitctl("forget", "pretrain")
    assert result.exit_code == 1 and "'pretrain' names the run folders of 2 jobs in different places" in result.stderr
    assert [r.job_id for r in registry.load_records()] == ["7002", "7003"]


def test_a_job_id_two_jobs_share_is_refused_where_one_job_is_meant_and_both_are_listed(home, tmp_path):
    """Before: a local job's PID that equalled a Slurm job's id named the newer job alone, so `cancel 4242` could
    stop the other job than the one meant."""
    local, slurm = tmp_path / "runs/local", tmp_path / "runs/slurm"
    registry.add_record(replace(record("4242", str(slurm)), executor="slurm"))
    registry.add_record(record("4242", str(local)))
    result = vitctl("forget", "4242")
    assert result.exit_code == 1, result.output
    said = " ".join(result.stderr.split())
    assert (f"job 4242 names 2 jobs (a local job's id is its process id, which a Slurm job's id may equal): slurm "
            f"({slurm}), local ({local}); pass the full path of the run folder instead") in said, said
    assert [r.executor for r in registry.find_records("4242")] == ["slurm", "local"]  # status lists both
    assert ok("forget", local).output.startswith(f"forgot job 4242 (vit_micro-a, {local})\n")
    assert [r.run_dir for r in registry.load_records()] == [str(slurm)]
    reused = tmp_path / "runs/later"  # a PID is reused once its job has ended: the newer local job is the one meant
    registry.add_record(record("4242", str(reused)))
    registry.add_record(record("4242", str(tmp_path / "runs/latest")))
    registry.remove_records([r.key for r in registry.load_records() if r.executor == "slurm"])
    assert [r.run_dir for r in registry.find_records("4242")] == [str(tmp_path / "runs/latest")]
