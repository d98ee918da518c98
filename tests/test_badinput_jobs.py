"""Jobs given hostile input or interrupted: Ctrl-C and SIGTERM of a waiting `vitctl train`, a rank killed, logs of a
job whose folder is gone, a plan of another model, --resume across pretraining and finetuning. Each ends in one
message (no traceback), and the fix it names is followed."""

import json
import os
import pickle
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import ok, vitctl
from vitctl.trainer import checkpoint as ckpt
from vitctl.trainer.metrics import MetricsWriter, read_metrics
from vitctl.workflows import registry, status, submit
from vitctl.workflows.errors import Interrupted, LaunchError
from vitctl.workflows.process import children, start_time

VITCTL = str(Path(sys.executable).parent / "vitctl")
RANK_ARGS = ["--config", "demo_vit", "--set", "data.source=synthetic", "--set", "data.train_samples=64", "--set",
             "data.workers=0", "--steps", "1"]
QUICK = ["--config", "demo_vit", "--set", "data.source=synthetic", "--set", "data.train_samples=64", "--batch", "4",
         "--executor", "local", "--gpus", "0"]


# `--steps` ends these jobs, not demo_vit's 8 epochs: 64 steps (64 samples, 8 a step over the two ranks), which two
# ranks of one thread each train in about 3 s, while a test waits to see the job still running
LONG = ["--epochs", "1000", "--tasks-per-node", "2", "--set", "train.log_every=1"]


def _start(out: Path, steps: int) -> subprocess.Popen:
    """`vitctl train` of two CPU ranks in a session of its own (a terminal's process group), logging every step."""
    return subprocess.Popen([VITCTL, "train", *QUICK, *LONG, "--steps", str(steps), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ,
                            start_new_session=True)


def _wait_for_step(out: Path, step: int, terminal: int | None = None) -> None:
    """Until rank 0 logs `step`; reading what vitctl writes to `terminal` meanwhile, as a terminal shows it."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(f" step={step} " in log.read_text() for log in out.glob("submitit/*_0_log.err")):
            return
        while terminal is not None and select.select([terminal], [], [], 0)[0]:
            os.read(terminal, 65536)
        time.sleep(0.2)
    raise AssertionError(f"rank 0 never logged step {step}")


def test_a_running_job_before_its_first_checkpoint_is_named_as_such(tmp_path):
    """Exporting (or finetuning from) a running job too early said 'neither a checkpoint folder nor a run folder'."""
    out = tmp_path / "run"
    job = subprocess.Popen([VITCTL, "train", *QUICK, "--steps", "1000", "--set", "train.log_every=1", "--set",
                            "train.checkpoint_every=1000", "--out", str(out)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=os.environ, start_new_session=True)
    try:
        _wait_for_step(out, 2)
        result = vitctl("export", out, "--out", tmp_path / "w.safetensors")
        assert result.exit_code == 1 and result.stderr.startswith(
            f"error: {out} is a run folder whose run has saved no checkpoint yet: a running job saves its first at "
            f"step train.checkpoint_every (`vitctl status {out}` shows where it is)"), result.stderr
        assert "RUNNING" in ok("status", out).output
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()


def _rank_pid(out: Path, rank: int) -> int:
    """The PID of one rank of the job into `out` (a child of submitit's controller, whose PID is the job id)."""
    controller = int(registry.find_record(str(out)).job_id)
    for pid in children(controller):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        if f"SUBMITIT_LOCAL_GLOBALID={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} of job {controller}")


@pytest.mark.slow
@pytest.mark.parametrize(("whom", "signum"), [("group", signal.SIGINT), ("vitctl", signal.SIGTERM),
                                              ("group", signal.SIGHUP)])
def test_ctrl_c_sigterm_or_a_hangup_stops_a_local_job_with_a_checkpoint_and_resume_goes_on(tmp_path, whom, signum):
    """Ctrl-C and a hangup (a closed terminal, a dropped SSH link) reach the whole process group; before, on Ctrl-C
    submitit's controller printed a KeyboardInterrupt traceback and killed the ranks before they checkpointed, a
    hangup killed every process at once (the steps since the last checkpoint lost, the job called out of memory?),
    and a SIGTERM to vitctl left silently (143), the job running on."""
    out = tmp_path / "run"
    job = _start(out, 40)
    _wait_for_step(out, 2)
    os.killpg(job.pid, signum) if whom == "group" else os.kill(job.pid, signum)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 130 and "Traceback" not in stderr, stderr
    record = registry.find_record(str(out))
    log = Path(record.folder) / f"{record.job_id}_0_log.err"
    said = re.fullmatch(rf"interrupted: job {record.job_id} was stopped: checkpointed at step (\d+) on a signal: "
                        rf"--resume continues from there \(its log: {re.escape(str(log))}\)", stderr.splitlines()[-1])
    assert said, stderr.splitlines()[-1]
    assert (out / f"checkpoints/step-{int(said[1]):08d}").is_dir()
    assert not Path(f"/proc/{record.job_id}").exists()  # the controller has ended: nothing left running
    if signum == signal.SIGINT:  # the fix it names
        ok("train", *QUICK, *LONG, "--steps", 40, "--out", out, "--resume")
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert steps[-1]["step"] == 40 and any(s.get("event") == "resume" for s in steps)


@pytest.mark.slow
def test_sigterm_while_a_local_job_is_submitted_stops_the_job_it_started(tmp_path):
    """Before: SIGTERM in the instant the job's controller started (its folder just made) ended vitctl, `interrupted`
    and 130, while the job trained on unseen."""
    out = tmp_path / "run"
    job = _start(out, 400)
    deadline = time.monotonic() + 120
    while not (out / "submitit").is_dir() and time.monotonic() < deadline:
        time.sleep(0.002)
    os.kill(job.pid, signal.SIGTERM)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 130 and "Traceback" not in stderr, stderr
    record = registry.find_record(str(out))
    assert record.job_id and stderr.splitlines()[-1].startswith(f"interrupted: job {record.job_id} was stopped"), \
        stderr
    assert not Path(f"/proc/{record.job_id}").exists() and not status.state_of(record).live  # nothing runs on


def _stop_twice(tmp_path, monkeypatch, first_signals, second_signal: int | None) -> list[str]:
    """`wait_local` of a fake job: the first `follow` receives `first_signals` at once (blocked, then let through
    together), and the cancel receives `second_signal`; the job ids asked to stop."""
    record = registry.JobRecord("1", "local", "vit_micro-run", str(tmp_path), str(tmp_path / "submitit"), 1, 2, 0,
                                time.time())
    follows, asked = iter([True, False]), []

    def follow(*args):
        if next(follows):
            signal.pthread_sigmask(signal.SIG_BLOCK, first_signals)
            try:
                for signum in first_signals:  # to this thread: os.kill's could reach another thread of pytest's at
                    signal.pthread_kill(threading.main_thread().ident, signum)  # once, and its handler raise here
            finally:  # blocked signals are inherited: every process started later would ignore Ctrl-C and SIGTERM
                signal.pthread_sigmask(signal.SIG_UNBLOCK, first_signals)
            time.sleep(0.05)  # Python runs a signal's handler between bytecodes: give it the chance

    def cancel(job):
        if second_signal is not None:
            os.kill(os.getpid(), second_signal)
            time.sleep(0.05)
        asked.append(job.job_id)

    monkeypatch.setattr(submit, "_follow", follow)
    monkeypatch.setattr(registry, "reload", lambda job: job)
    monkeypatch.setattr(status, "cancel", cancel)
    monkeypatch.setattr(submit, "state_of", lambda job: status.JobState("CANCELLED", 1.0, "checkpointed at step 3"))
    try:
        submit.wait_local(None, record, lambda line: None)
    except Interrupted as e:
        assert str(e).startswith("job 1 was stopped: checkpointed at step 3")
    except KeyboardInterrupt:
        pytest.fail("the second signal cut the cancel short: the job was never asked to stop")
    return asked


def test_a_second_ctrl_c_during_the_cancel_does_not_leave_the_job_running(tmp_path, monkeypatch):
    """`timeout -s INT` signals vitctl and its group: the second Ctrl-C, a few ms after the first, landed inside the
    cancel (in the registry's fsync), and vitctl left with the job running on. Here it lands there every time."""
    assert _stop_twice(tmp_path, monkeypatch, {signal.SIGINT}, signal.SIGINT) == ["1"]


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_second_signal_before_the_cancel_does_not_leave_the_job_running(tmp_path, monkeypatch):
    """A second signal that came before the cancel had begun (between the first one's KeyboardInterrupt and the
    cancel) also left the job running on, one time in eight under `timeout -s INT`. Here both come at once, and
    Python would run the second's handler at the first bytecodes after the first's; once it was ignored, Python
    wrote `OSError: Signal 15 ignored due to race condition`, a traceback, to stderr."""
    assert _stop_twice(tmp_path, monkeypatch, {signal.SIGINT, signal.SIGTERM}, None) == ["1"]


@pytest.mark.slow
def test_a_terminal_that_hangs_up_leaves_a_checkpoint_and_vitctl_ends_as_interrupted(tmp_path):
    """A closed window: vitctl's output is a terminal that is gone (writes fail with EIO) while it stops the job."""
    out, (terminal, attached) = tmp_path / "run", pty.openpty()
    job = subprocess.Popen([VITCTL, "train", *QUICK, "--tasks-per-node", "2", "--steps", "40", "--set",
                            "train.log_every=1", "--out", str(out)], stdin=subprocess.DEVNULL, stdout=attached,
                           stderr=attached, env=os.environ, start_new_session=True)
    os.close(attached)
    _wait_for_step(out, 2, terminal)
    os.killpg(job.pid, signal.SIGHUP)
    os.close(terminal)
    assert job.wait(timeout=120) == 130  # not 1, as a failed write to the terminal ended it
    state = status.state_of(registry.find_record(str(out)))
    step = re.fullmatch(r"checkpointed at step (\d+) on a signal.*", state.note)
    assert state.state == "CANCELLED" and step, state
    assert (out / f"checkpoints/step-{int(step[1]):08d}").is_dir()


def test_a_job_stopped_before_its_ranks_started_says_so_and_what_to_do(tmp_path, monkeypatch):
    """Before: `interrupted: job N was stopped:  (its log: ...)` on Ctrl-C, and `job N was stopped (cancelled): ` on a
    `vitctl cancel`, a blank reason (status too) and a log with nothing in it."""
    record = registry.JobRecord("1", "local", "vit_micro-run", str(tmp_path), str(tmp_path / "submitit"), 1, 2, 0,
                                time.time(), cancelled=True)  # ended, no rank's result: the cancel came first
    follows = iter([KeyboardInterrupt, None, None])

    def follow(*args):
        if (raised := next(follows)) is not None:
            raise raised

    monkeypatch.setattr(submit, "_follow", follow)
    monkeypatch.setattr(registry, "reload", lambda job: job)
    monkeypatch.setattr(status, "cancel", lambda job: None)
    said = "cancelled as its ranks started, before they trained: run the same command again"
    with pytest.raises(Interrupted, match=rf"^job 1 was stopped: {said} \(its log: "):
        submit.wait_local(None, record, lambda line: None)
    with pytest.raises(LaunchError, match=rf"^job 1 was stopped \(cancelled\): {said}$"):
        submit.wait_local(None, record, lambda line: None)  # a `vitctl cancel` from elsewhere
    assert status.state_of(record).note == said


@pytest.mark.slow
def test_a_busy_run_folder_named_through_dotdot_or_a_link_is_refused_too(tmp_path):
    """The check compared the path as written: `--out sub/../run` or a link to the folder let a second job in."""
    out = tmp_path / "run"
    job = _start(out, 4000)
    try:
        _wait_for_step(out, 2)
        (tmp_path / "sub").mkdir()
        (tmp_path / "link").symlink_to(out)
        for other in (tmp_path / "sub" / ".." / "run", tmp_path / "link"):
            result = vitctl("train", *QUICK, "--steps", 4, "--out", other)
            assert result.exit_code == 1 and f"run folder {out} is in use by job" in result.stderr, result.stderr
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate()


@pytest.mark.slow
def test_under_nohup_a_hangup_leaves_the_local_job_training(tmp_path):
    """nohup ignores the hangup for vitctl and the job it starts: it must not be taken for a Ctrl-C."""
    out = tmp_path / "run"
    job = subprocess.Popen([VITCTL, "train", *QUICK, *LONG, "--steps", "4000", "--out", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ, start_new_session=True,
                           preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # as nohup starts it
    try:
        _wait_for_step(out, 2)
        os.killpg(job.pid, signal.SIGHUP)
        time.sleep(3)
        record = registry.find_record(str(out))
        assert job.poll() is None and not record.cancelled and status.state_of(record).state == "RUNNING"
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()


@pytest.mark.slow
def test_a_hung_rank_s_job_is_killed_by_a_second_cancel_and_resume_goes_on(tmp_path):
    """A stopped rank (SIGSTOP: as a rank stuck in a driver call) held the other's stop in its all-reduce: the cancel
    never took, status said RUNNING, and gloo's timeout fired only after 30 minutes."""
    out = tmp_path / "run"
    job = _start(out, 4000)
    try:
        _wait_for_step(out, 2)
        os.kill(_rank_pid(out, 1), signal.SIGSTOP)
        record = registry.find_record(str(out))
        first = ok("cancel", record.job_id).output
        assert first.strip().endswith("; if it does not stop, cancel again to end it at once"), first
        time.sleep(3)
        assert job.poll() is None  # the hung rank holds the stop
        assert ok("cancel", record.job_id).output.startswith(f"ended job {record.job_id} (vit_micro-run) at once "
                                                             "(killed it): the first cancel had not stopped it")
        _, stderr = job.communicate(timeout=60)
        assert ("killed by a second `vitctl cancel`: its run had saved no checkpoint, so nothing of it was kept: run "
                "the same command again to start afresh") in stderr, stderr  # step 3 of checkpoints every 50
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
    state = status.state_of(registry.find_record(str(out)))
    assert state.state == "CANCELLED" and state.note.startswith("killed by a second `vitctl cancel`")
    ok("train", *QUICK, *LONG, "--steps", 3, "--out", out)  # the fix it names, with fewer steps


def test_a_running_job_whose_steps_stopped_coming_is_said_to_be_quiet(tmp_path):
    """A hung rank: the row stayed RUNNING with a frozen step and ETA, and no word, for 30 minutes."""
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    record = registry.JobRecord(str(os.getpid()), "local", "vit_micro-run", str(run), str(run / "submitit"), 1, 2, 0,
                                time.time() - 3600, started=submit.start_time(os.getpid()))  # this process: running
    registry.add_record(record)
    writer = MetricsWriter(run, True)
    for step, ago in ((20, 1250.0), (40, 1240.0)):  # one step every 10 s, the last 1,240 s ago
        writer.write({"step": step, "total_steps": 900, "loss": 2.0, "images_per_s": 8.0, "step_time_s": 0.5,
                      "time": time.time() - ago})
    listed = json.loads(ok("status", record.job_id, "--json").output)[0]
    assert listed["state"] == "RUNNING" and re.fullmatch(
        rf"no step logged for 21 min \(the last, step 40, at \d\d:\d\d; one every 10 s before\): a rank may hang; "
        rf"`vitctl logs {record.job_id} --rank R` shows each rank's last lines, and `vitctl cancel {record.job_id}` "
        rf"stops the job", listed["note"]), listed["note"]


def test_a_running_job_s_eta_is_its_wall_clock_rate_since_warm_up_counted_down_between_records(tmp_path):
    """Before: the ETA was the steps left times the last record's step time, which leaves out the evals and
    checkpoints between steps: it swung 10x between two calls a second apart, and warm-up's first record made a
    30-second job look like 48 minutes."""
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    now = time.time()
    record = registry.JobRecord(str(os.getpid()), "local", "vit_micro-run", str(run), str(run / "submitit"), 1, 2, 0,
                                now - 2000, started=submit.start_time(os.getpid()))  # this process: running
    registry.add_record(record)
    writer = MetricsWriter(run, True)
    step = {"total_steps": 130, "loss": 2.0, "images_per_s": 8.0}
    writer.write({**step, "step": 5, "step_time_s": 0.1, "time": now - 1000})  # an earlier attempt, faster
    writer.write({"event": "resume", "step": 0, "time": now - 200})  # (from no checkpoint: counts from 0)
    writer.write({**step, "step": 10, "step_time_s": 9.0, "time": now - 100})  # compiling
    writer.write({**step, "step": 20, "step_time_s": 0.5, "time": now - 60})
    writer.write({"step": 20, "epoch": 1, "val_top1": 0.5, "time": now - 40})  # an eval, 20 s
    writer.write({**step, "step": 30, "step_time_s": 0.5, "time": now - 20})
    listed = json.loads(ok("status", record.job_id, "--json").output)[0]
    # 10 steps in 40 s from step 20 on: 100 steps left take 400 s, 20 of which have passed since step 30's record
    assert listed["state"] == "RUNNING" and 370 < listed["eta_s"] <= 380, listed


def test_a_requeued_job_has_no_eta_until_its_new_attempt_logs_a_step(tmp_path):
    """Before: the previous attempt's last record, the step its signal cut into (7 s where the others took 0.1 s),
    gave the new attempt an ETA past its time limit, and the note said it would stop unfinished."""
    record = _ended_local_job(tmp_path / "run")
    writer, now = MetricsWriter(tmp_path / "run", True), time.time() + 1
    step = {"total_steps": 100, "loss": 2.0, "images_per_s": 8.0}
    writer.write({**step, "step": 40, "step_time_s": 7.0, "time": now})  # cut into by the signal
    writer.write({"event": "stopped", "step": 40, "time": now + 1})
    writer.write({"event": "resume", "step": 40, "time": now + 2})
    assert status.progress(record)["eta_s"] is None
    writer.write({**step, "step": 50, "step_time_s": 0.1, "time": now + 3})  # the new attempt's own
    assert status.progress(record)["eta_s"] == pytest.approx(5.0)


def _go_on(run: Path) -> str:
    """How a note on a job that ended without a word goes on: from the run's last checkpoint, or afresh (was left
    out where a rank was killed and another lost it, and said of a last checkpoint where there was none)."""
    found = ckpt.list_checkpoints(run)
    if found:
        return f"; --resume goes on from its last checkpoint ({found[-1].name})"
    return "; it had saved no checkpoint: run the same command again to start afresh"


def _rank_1_ended_by(out: Path, signum: int) -> tuple[str, list[str], str]:
    """A two-rank job whose rank 1 gets `signum` as it trains: its job id, vitctl's error lines, rank 1's log."""
    job = _start(out, 400)
    _wait_for_step(out, 2)
    os.kill(_rank_pid(out, 1), signum)
    _, stderr = job.communicate(timeout=120)
    record = registry.find_record(str(out))
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert job.returncode == 1 and len(errors) == 1 and "Traceback" not in stderr, stderr
    return record.job_id, errors, f"{record.folder}/{record.job_id}_1_log.err"


@pytest.mark.slow
def test_a_killed_rank_is_named_not_the_rank_that_lost_its_connection_to_it(tmp_path):
    job_id, errors, log = _rank_1_ended_by(tmp_path / "run", signal.SIGKILL)
    assert errors == [f"error: job {job_id} failed: rank 1 ended without reporting an error (killed, or out of "
                      f"memory?), and rank 0 then lost its connection to it; see {log}{_go_on(tmp_path / 'run')}"]


def test_a_rank_that_crashes_in_native_code_is_named_with_where_it_was(tmp_path):
    """Before: a segfault (in a decoder, a driver) read `rank 1 ended without reporting an error (killed, or out of
    memory?)`; now faulthandler writes the Python stack into the rank's log, and the error names its crash and place."""
    job_id, errors, log = _rank_1_ended_by(tmp_path / "run", signal.SIGSEGV)
    assert re.fullmatch(rf"error: job {job_id} failed: rank 1 crashed \(Segmentation fault\) in \w+ "
                        rf"\(\w+\.py:\d+\), and rank 0 then lost its connection to it; see {re.escape(log)}"
                        rf"{re.escape(_go_on(tmp_path / 'run'))}", errors[0]), errors[0]
    assert "Fatal Python error: Segmentation fault" in Path(log).read_text()


def test_a_crash_inside_a_comprehension_names_the_function_that_holds_it(tmp_path):
    """Before, on Python 3.11 (which gives a comprehension its own frame): `crashed (Segmentation fault) in <listcomp>
    (precision.py:144)`; the comprehension's line stays, the name is its function's."""
    record = _ended_local_job(tmp_path / "run")
    precision = Path(status.__file__).resolve().parents[1] / "trainer/precision.py"
    log = Path(record.folder) / "1_1_log.err"
    log.write_text(f'Fatal Python error: Segmentation fault\n\nCurrent thread 0x00007f (most recent call first):\n'
                   f'  File "{precision}", line 144 in <listcomp>\n  File "{precision}", line 144 in clip_gradients\n'
                   f'  File "/usr/lib/python3.11/runpy.py", line 88 in _run_code\n')
    assert status.failure(record) == (f"rank 1 crashed (Segmentation fault) in clip_gradients (precision.py:144); "
                                      f"see {log}")


def test_ranks_whose_controller_is_killed_checkpoint_and_stop(tmp_path):
    """Before: kill -9 of a local job's controller (its PID is the job id) left its ranks training, orphaned: status
    said FAILED, cancel 'already ended', and --resume was refused, the ranks holding the run folder."""
    out = tmp_path / "run"
    job = _start(out, 4000)
    _wait_for_step(out, 2)
    record = registry.find_record(str(out))
    ranks = [_rank_pid(out, rank) for rank in (0, 1)]
    os.kill(int(record.job_id), signal.SIGKILL)
    _, stderr = job.communicate(timeout=120)
    # vitctl waits for the ranks (before: at once `failed: no rank reported an error`, while they checkpointed)
    assert not any(start_time(pid) for pid in ranks), "the ranks train on"
    state = status.state_of(registry.find_record(str(out)))
    assert state.state == "INTERRUPTED" and state.note.startswith("checkpointed at step "), state
    step = int(state.note.split()[3])
    assert ckpt.list_checkpoints(out)[-1].name == f"step-{step:08d}"
    assert f"job {record.job_id}: its controller process ended while its ranks ran on" in stderr, stderr
    assert f"error: job {record.job_id} was stopped (interrupted): checkpointed at step {step}" in stderr, stderr
    ok("train", *QUICK, *LONG, "--steps", step + 1, "--out", out, "--resume")


def _ended_local_job(run: Path) -> registry.JobRecord:
    """A local job that has ended: its controller's PID belongs to no process (PID 1 started at another time)."""
    (run / "submitit").mkdir(parents=True)
    record = registry.JobRecord("1", "local", f"vit_micro-{run.name}", str(run), str(run / "submitit"), 1, 2, 0,
                                time.time(), started=-1)
    registry.add_record(record)
    return record


def test_jobs_whose_run_folder_was_removed_and_made_again_are_not_called_failed(tmp_path):
    """`make clean-demo`, then `make demo`: before, the earlier jobs, which had completed, showed FAILED "no rank
    reported an error (killed, or out of memory?)", naming logs that no longer existed; and while the folder was gone,
    their note said so twice."""
    run = tmp_path / "run"
    earlier = _ended_local_job(run)
    shutil.rmtree(run)
    gone = status.collect([earlier])[0]
    assert gone.state == "UNKNOWN" and gone.note.count("no longer exists") == 1 and "is gone" not in gone.note
    later = registry.JobRecord("2", "local", earlier.name, str(run), str(run / "submitit"), 1, 2, 0,
                               earlier.submitted + 60, started=-1)
    registry.add_record(later)
    (run / "submitit").mkdir(parents=True)
    (run / "submitit/2_0_log.err").write_text("2026-11-30 10:00:35,661 [rank 0] vitctl.train: run\n")
    state = status.local_state(earlier)
    assert state.state == "UNKNOWN" and state.note == (f"its logs and result are gone: {run / 'submitit'} was removed "
                                                        "and made again (job 2 ran there since)"), state
    assert status.local_state(later).state == "FAILED"  # its own log is there: killed before its result


def test_a_local_job_whose_run_folder_is_moved_while_it_runs_says_so(tmp_path):
    """Before: `error: job N failed: ` and no reason: the rank's error went with the folder, into its moved log."""
    run, moved = tmp_path / "run", tmp_path / "moved"

    def move_once_it_trains():
        for _ in range(600):
            if (run / "metrics.jsonl").is_file():
                shutil.move(run, moved)
                return
            time.sleep(0.2)

    mover = threading.Thread(target=move_once_it_trains)
    mover.start()
    result = vitctl("train", *QUICK, "--steps", 100_000, "--set", "data.train_samples=400000", "--out", run)
    mover.join()
    assert moved.is_dir() and result.exit_code == 1, result.stderr
    assert f"failed: its run folder {run} no longer exists (moved or deleted): its progress, checkpoints and logs " \
        "went with it; if you moved it, `vitctl status NEW_PLACE` records where" in " ".join(result.stderr.split()), \
        result.stderr


def test_a_job_killed_before_it_left_a_result_shows_how_long_it_ran_until_its_last_log_line(tmp_path):
    """Before: a local job killed by SIGKILL (or the OOM killer) had an empty elapsed time in `vitctl status`."""
    record = _ended_local_job(tmp_path / "run")
    log = Path(record.folder) / "1_0_log.err"
    log.write_text("2026-11-30 10:00:35,661 [rank 0] vitctl.metrics: step=300\n")
    os.utime(log, (record.submitted + 95, record.submitted + 95))
    state = status.local_state(record)
    assert (state.state, state.elapsed_s) == ("FAILED", pytest.approx(95))
    row = next(line for line in ok("status", tmp_path / "run").output.splitlines() if line.startswith("1\t"))
    assert row.split("\t")[2:5] == ["FAILED", "1x2 CPU", "00:01:35"]
    # where to go on: before, only `see LOG`; and a run folder moved while it ran was taken for a kill
    assert status.state_of(record).note.endswith(f"see {log}; it had saved no checkpoint: run the same command again "
                                                 "to start afresh")
    saved = tmp_path / "run/checkpoints/step-00000300"
    saved.mkdir(parents=True)
    for name in ("meta.json", ".metadata"):
        (saved / name).write_text("{}")
    assert status.state_of(record).note.endswith(f"see {log}; --resume goes on from its last checkpoint "
                                                 f"(step-00000300)")
    shutil.move(tmp_path / "run", tmp_path / "moved")  # a Slurm job's: before, taken for a kill
    failed = status.state_of(replace(record, executor="slurm"), {"1": status.JobState("FAILED", 95.0)})
    assert failed.note == (f"its run folder {tmp_path / 'run'} was moved or deleted while it ran: its ranks could not "
                           "write there; if you moved it, `vitctl status NEW_PLACE` records where, and `--out "
                           "NEW_PLACE --resume` goes on from its last checkpoint"), failed.note


def test_an_ended_slurm_job_is_told_by_its_result_while_slurm_cannot_say(tmp_path):
    """Before: every ended job UNKNOWN while slurmdbd was down (sacct alone tells of ended jobs), though rank 0's
    result said how it ended."""
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    record = registry.JobRecord("7", "slurm", "vit_micro-run", str(run), str(run / "submitit"), 1, 1, 0, time.time())
    down = status.JobState("UNKNOWN", None, "Slurm's accounting (slurmdbd) ... does not answer", unreachable=True)
    assert status.state_of(record, {"7": down}) == down  # no result yet: it may still run
    result = run / "submitit/7_0_result.pkl"
    result.write_bytes(pickle.dumps(("success", {"step": 8})))
    assert status.state_of(record, {"7": down}) == status.JobState("COMPLETED", None,
                                                                   f"as rank 0's result says; {down.note}")
    result.write_bytes(pickle.dumps(("error", "Traceback (most recent call last):\n  ...\nValueError: bad")))
    failed = status.state_of(record, {"7": down})
    assert failed.state == "FAILED" and failed.note == (f"as rank 0's result says; {down.note}; rank 0 raised "
                                                        f"ValueError: bad (traceback in {run}/submitit/7_0_log.err)")


def test_logs_of_a_job_whose_run_folder_is_gone_say_so_and_follow_does_not_wait(tmp_path):
    """Before: 'no log yet ... once the job starts; --follow waits for it', and --follow waited forever."""
    run = tmp_path / "gone"
    record = _ended_local_job(run)
    (run / "submitit" / "1_0_log.err").write_text("2026-11-25 04:50:14,211 [rank 0] vitctl.train: run\n")
    (run / "submitit" / "1_submitted.pkl").write_bytes(pickle.dumps({"out_dir": str(run)}))  # as submitit's holds it
    moved = Path(shutil.move(run, tmp_path / "moved"))
    for follow in ([], ["--follow"]):
        done = subprocess.run([VITCTL, "logs", record.job_id, *follow], capture_output=True, text=True, timeout=60,
                              env=os.environ)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip() == (
            f"error: the logs of job 1 (UNKNOWN) are gone: its folder {run}/submitit no longer exists (the run folder "
            "was moved or deleted); if you moved it, `vitctl logs NEW_PLACE` shows them and records where")
    assert ok("logs", moved).stdout.endswith("vitctl.train: run\n")  # the fix, followed
    assert registry.find_record("1").run_dir == str(moved)


def test_logs_of_an_ended_job_that_wrote_none_say_it_never_started(tmp_path):
    """Before, the note sent the user to rank 0's log, which did not exist."""
    record = _ended_local_job(tmp_path / "run")
    result = vitctl("logs", record.job_id, "--rank", 1)
    assert result.exit_code == 1
    assert result.stderr.strip() == (f"error: job 1 (FAILED) ended without a log for rank 1 in {record.folder}: that "
                                     "rank never started (it ended before its ranks wrote a log (killed, or out of "
                                     "memory?); it had saved no checkpoint: run the same command again to start "
                                     "afresh)")


def test_logs_of_a_rank_that_ran_but_whose_logs_were_deleted_say_so(tmp_path):
    """Before: 'that rank never started', of a rank whose result said it had run."""
    record = _ended_local_job(tmp_path / "run")
    folder = Path(record.folder)
    for rank in (0, 1):
        (folder / f"1_{rank}_result.pkl").write_bytes(pickle.dumps(("success", None)))
    (folder / "1_0_log.out").write_text("2026-11-30 10:00:00,000 [rank 0] vitctl.train: done\n")
    result = vitctl("logs", record.job_id, "--rank", 1)
    assert result.exit_code == 1
    assert result.stderr.strip() == (f"error: the log of rank 1 of job 1 (COMPLETED) is gone: the rank ran (its result "
                                     f"is in {folder}), but its log files were deleted")
    shown = ok("logs", record.job_id).output  # one of rank 0's two files deleted: the header no longer names both
    assert shown.startswith(f"==> rank 0 of job 1: {folder}/1_0_log.out (1_0_log.err is missing) <==\n")


def test_logs_of_a_job_whose_state_cannot_be_told_do_not_say_it_ended(tmp_path):
    """Before: 'job 1 (UNKNOWN) ended without a log ...: that rank never started', of a job running on another host."""
    record = _ended_local_job(tmp_path / "run")
    registry.update_record(record.key, host="gpu-node-7")
    result = vitctl("logs", record.job_id)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: no log for rank 0 of job 1 (UNKNOWN) in {record.folder}, and whether that "
                                    "rank started cannot be told here (")
    assert "gpu-node-7" in result.stderr and "ended" not in result.stderr


def test_a_rank_s_own_error_is_named_before_the_peer_that_lost_it_whichever_was_saved_first(tmp_path):
    """Rank 1's result (gloo: Connection closed by peer) was saved 8 ms before rank 0's ConfigError, and the status
    named rank 1's."""
    run = tmp_path / "run"
    record = _ended_local_job(run)
    results = {1: "RuntimeError: [pair.cc:561] Connection closed by peer [127.0.0.1]:2776",
               0: "vitctl.workflows.job.RankFailed: rank 0 raised ConfigError: run folder R is in use by job 793"}
    for at, (rank, error) in enumerate(results.items()):  # rank 1's first
        path = run / f"submitit/1_{rank}_result.pkl"
        path.write_bytes(pickle.dumps(("error", f"Traceback (most recent call last):\n  ...\n{error}")))
        os.utime(path, (time.time() + at, time.time() + at))
    assert status.failure(record) == (f"rank 0 raised ConfigError: run folder R is in use by job 793 (traceback in "
                                      f"{run}/submitit/1_0_log.err)")


def test_status_watch_ends_on_the_state_a_cancel_meanwhile_left(tmp_path):
    """Before: `status --watch` kept the records of its first snapshot, so a job cancelled meanwhile, and ended without
    a rank's result, was last shown FAILED (`no rank reported an error`), where `status` said CANCELLED."""
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    job = subprocess.Popen(["sleep", "600"])  # the job's controller
    record = registry.JobRecord(str(job.pid), "local", "vit_micro-run", str(run), str(run / "submitit"), 1, 1, 0,
                                time.time(), started=submit.start_time(job.pid))
    registry.add_record(record)
    watch = subprocess.Popen([VITCTL, "status", record.job_id, "--watch", "--json"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=os.environ)
    assert json.loads(watch.stdout.readline())[0]["state"] == "RUNNING"
    registry.update_record(record.key, cancelled=True)  # as `vitctl cancel` marks it, before its ranks took it
    job.kill()
    job.wait()
    stdout, _ = watch.communicate(timeout=60)
    last = json.loads(stdout.splitlines()[-1])[0]
    assert (last["state"], last["note"]) == ("CANCELLED", status.STOPPED_AS_RANKS_STARTED)


def test_a_second_cancel_after_the_ranks_checkpointed_on_the_first_kills_nothing(tmp_path):
    """Before: a second cancel a second after the first, while the ranks, checkpointed and stopped, were ending, killed
    the job and said that the first had not stopped it and the steps since its last checkpoint were lost."""
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    controller = subprocess.Popen(["sleep", "600"])
    record = registry.JobRecord(str(controller.pid), "local", "vit_micro-run", str(run), str(run / "submitit"), 1, 1,
                                0, time.time(), started=submit.start_time(controller.pid), cancelled=True)
    registry.add_record(record)
    metrics = MetricsWriter(run, enabled=True)
    metrics.write({"step": 72, "loss": 1.5, "images_per_s": 200.0})
    metrics.write({"step": 72, "event": "stopped"})  # written once the checkpoint is saved
    try:
        said = ok("cancel", record.job_id).output
        assert said.strip() == (f"job {record.job_id} (vit_micro-run) has stopped: the first cancel had its ranks "
                                "checkpoint at step 72, and they are ending; nothing is lost, and --resume goes on "
                                "from there")
        assert controller.poll() is None  # not killed
        metrics.write({"step": 73, "event": "resume"})  # an attempt that went on after that stop: a kill again
        assert ok("cancel", record.job_id).output.startswith(f"ended job {record.job_id} (vit_micro-run) at once")
    finally:
        controller.kill()
        controller.wait()


def test_logs_follow_ends_saying_how_the_job_ended(tmp_path):
    """Before: following a job whose rank was killed, the output stopped after the rank's last lines, exit 0, as for a
    job that completed."""
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    (run / "submitit/0_0_log.err").write_text("2026-11-30 10:00:35,661 [rank 0] vitctl.metrics: step=300\n")
    controller = subprocess.Popen(["sleep", "600"])
    record = registry.JobRecord(str(controller.pid), "local", "vit_micro-run", str(run), str(run / "submitit"), 1, 1,
                                0, time.time(), started=submit.start_time(controller.pid))
    (run / "submitit/0_0_log.err").rename(run / f"submitit/{record.job_id}_0_log.err")
    registry.add_record(record)
    follower = subprocess.Popen([VITCTL, "logs", record.job_id, "--follow"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=os.environ)
    assert "step=300" in follower.stdout.readline() + follower.stdout.readline()
    controller.kill()  # as the OOM killer would
    controller.wait()
    _, stderr = follower.communicate(timeout=60)
    assert follower.returncode == 1 and stderr.startswith(f"error: job {record.job_id} ended FAILED: no rank reported "
                                                          "an error (killed, or out of memory?)"), stderr
    again = vitctl("logs", record.job_id, "--follow")  # once it has ended: the same (was exit 0, a note)
    assert again.exit_code == 1 and again.stderr.startswith(f"error: job {record.job_id} ended FAILED: "), again.stderr
    assert ok("logs", record.job_id).stderr.startswith(f"note: job {record.job_id} ended FAILED: ")  # not followed


def test_logs_of_a_live_job_without_follow_says_it_runs_on_not_that_it_ended(tmp_path):
    """Before: `note: job N ended RUNNING` (and `ended PENDING` for a job waiting in the queue)."""
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    controller = subprocess.Popen(["sleep", "600"])
    try:
        record = registry.JobRecord(str(controller.pid), "local", "vit_micro-run", str(run), str(run / "submitit"), 1,
                                    1, 0, time.time(), started=submit.start_time(controller.pid))
        (run / f"submitit/{record.job_id}_0_log.err").write_text("2026-11-30 10:00:35,661 [rank 0] step=3\n")
        registry.add_record(record)
        result = ok("logs", record.job_id)
    finally:
        controller.kill()
    assert "step=3" in result.output and "ended" not in result.stderr, result.stderr
    assert result.stderr == (f"note: job {record.job_id} is RUNNING; `vitctl logs {record.job_id} --follow` prints on "
                             "until it ends\n")


def test_a_metrics_line_without_a_step_s_rate_is_left_out_of_the_progress(tmp_path):
    """Before: a hand-edited metrics.jsonl line with a loss but no images_per_s ended `vitctl status` (of every job) in
    a KeyError traceback."""
    record = _ended_local_job(tmp_path / "run")
    metrics = MetricsWriter(tmp_path / "run", enabled=True)
    metrics.write({"step": 3, "loss": 1.2, "images_per_s": 10.0, "total_steps": 10, "step_time_s": 0.5})
    metrics.write({"step": 4, "loss": 1.1})
    done = status.progress(record)
    assert (done["step"], done["images_per_s"], done["eta_s"]) == (3, [10.0], 3.5)
    assert "Traceback" not in ok("status").output


def test_logs_follow_of_a_job_that_ends_before_its_rank_starts_says_so(tmp_path):
    """Before: the header of two log files that never came, and exit 0 (a job cancelled while pending)."""
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    job = subprocess.Popen(["sleep", "600"])  # the job's controller, which ends without a rank having started
    record = registry.JobRecord(str(job.pid), "local", "vit_micro-run", str(run), str(run / "submitit"), 1, 1, 0,
                                time.time(), started=submit.start_time(job.pid))
    registry.add_record(record)
    follower = subprocess.Popen([VITCTL, "logs", record.job_id, "--follow"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=os.environ)
    waiting = follower.stderr.readline()
    job.kill()
    job.wait()
    stdout, stderr = follower.communicate(timeout=60)
    assert waiting == f"waiting for rank 0 of job {job.pid} to start (RUNNING)\n", waiting + stderr
    assert follower.returncode == 1 and stdout == "", stdout
    assert stderr.startswith(f"error: job {job.pid} (FAILED) ended without a log for rank 0"), stderr


def test_status_of_a_job_with_a_damaged_result_and_metrics_says_so_and_resume_drops_the_damage(tmp_path):
    """Before: `vitctl status` (of every job) and `cancel` ended in a UnicodeDecodeError traceback, and so did the
    resumed run's rank 0 (metrics.jsonl read strictly)."""
    run = tmp_path / "run"
    record = _ended_local_job(run)
    result = run / "submitit/1_0_result.pkl"
    result.write_bytes(b"\x80\x04\x8c\x02\xff\xfe\x94.")  # a pickled str whose bytes are not UTF-8
    good = json.dumps({"step": 3, "loss": 2.5, "images_per_s": 10.0, "step_time_s": 0.1, "total_steps": 6})
    (run / "metrics.jsonl").write_bytes(good.encode() + b"\n\xff\xfe x\n")
    state = status.state_of(record)
    assert state.state == "UNKNOWN" and state.note == (f"it ended, and rank 0's result {result} cannot be read "
                                                       "(damaged); `vitctl logs 1` shows how it ended")
    assert status.progress(record)["step"] == 3
    assert "Traceback" not in ok("status").output
    MetricsWriter(run, enabled=True).drop_after(3)  # what a resume from step 3 does
    assert (run / "metrics.jsonl").read_text() == good + "\n"


def test_resume_onto_a_folder_without_checkpoints_or_past_its_steps_warns(tmp_path):
    """Before: a mistyped --out with --resume began the run again from step 0 without a word."""
    missing = tmp_path / "typo"
    result = ok("train", *QUICK, "--steps", 1, "--out", missing, "--resume")
    assert (f"warning: --resume, but {missing} does not exist: the run starts at step 0; to continue a run, give its "
            "folder as --out") in result.stderr, result.stderr
    assert "warning: --resume" not in ok("train", *QUICK, "--steps", 2, "--out", missing, "--resume").stderr
    # a run resumed with fewer steps than it has made ended at once without a word
    jobs = len(registry.load_records())
    fewer = ok("train", *QUICK, "--steps", 1, "--out", missing, "--resume")
    assert (f"warning: {missing} is at step 2 already, past train.max_steps=1 (--steps): there is nothing to train, "
            "and no job was started; pass --steps above 2 to train on") in fewer.stderr, fewer.stderr
    rerun = ok("train", *QUICK, "--steps", 2, "--out", missing, "--resume")  # as `make demo` reruns
    assert "warning" not in rerun.stderr and (f"note: {missing} is at step 2 already: the run ends there "
                                              "(train.max_steps=2, --steps): nothing to train; pass --steps above 2 to "
                                              "train on; no job was started") in rerun.stderr, rerun.stderr
    assert len(registry.load_records()) == jobs  # before, each started a job that ended at once: an empty row
    assert str(missing) in rerun.output  # the run's table as it stands


def test_resuming_a_run_at_the_end_of_its_epochs_says_there_is_nothing_to_train(tmp_path):
    """Before: exit 0 and no word, its log announcing 16 steps while none was trained."""
    args = [*QUICK, "--set", "train.eval_every_epochs=100", "--out", tmp_path / "run", "--resume"]
    ok("train", *args, "--epochs", 1)
    rerun = ok("train", *args, "--epochs", 1)
    assert (f"note: {tmp_path / 'run'} is at step 16 already: it has trained 1 epoch, and train.epochs=1: nothing to "
            "train; pass --epochs 2 to train on; no job was started") in rerun.stderr, rerun.stderr
    ok("train", *args, "--epochs", 2)  # the fix
    assert _last_step(tmp_path / "run") == 32


def test_a_resume_without_the_run_s_epochs_names_them_and_their_schedule(tmp_path):
    """Before: a run of 3 epochs stopped in its second, resumed with the preset's 1, was told `pass --epochs 2`, which
    ended it early on a schedule cut to 2 epochs, without a word of the 3 it began with."""
    args = [*QUICK, "--set", "train.eval_every_epochs=100", "--out", tmp_path / "run", "--resume"]
    ok("train", *args, "--epochs", 3, "--steps", 20)  # 16 steps an epoch: stopped 1.25 epochs in
    short = ok("train", *args, "--epochs", 1)
    assert ("it has trained 1.25 epochs, and train.epochs=1: nothing to train; the run began with train.epochs=3: "
            "pass --epochs 3 to finish it on its learning-rate schedule; no job was started") in short.stderr, \
        short.stderr
    longer = ok("train", *args, "--epochs", 4, "--steps", 21, "--dry-run")
    assert (f"note: --resume with train.epochs=4, where {tmp_path / 'run'} began with 3: its learning-rate schedule "
            "(warmup, cosine) is the one of 4 epochs from here on; --epochs 3 keeps it") in longer.stderr, longer.stderr
    assert "train.epochs=" not in ok("train", *args, "--epochs", 3).stderr  # the fix
    assert _last_step(tmp_path / "run") == 48


def test_steps_past_the_end_of_the_epochs_warn_and_the_fix_trains_them(tmp_path):
    """--steps only stops early: before, --steps 40 on 64 samples, batch 4, 2 epochs ran 32 steps with no word why."""
    args = [*QUICK, "--set", "train.eval_every_epochs=100"]
    result = ok("train", *args, "--steps", 40, "--epochs", 2, "--out", tmp_path / "a")
    assert ("warning: train.max_steps=40 (--steps) is past the end of train.epochs=2: 64 train samples make 16 steps "
            "an epoch at a global batch of 4, so the run stops at step 32; add --epochs 3 to train 40 steps"
            ) in result.stderr, result.stderr
    assert _last_step(tmp_path / "a") == 32
    fixed = ok("train", *args, "--steps", 40, "--epochs", 3, "--out", tmp_path / "b")
    assert "warning" not in fixed.stderr and _last_step(tmp_path / "b") == 40


def _last_step(run: Path) -> int:
    return max(json.loads(line).get("step", 0) for line in (run / "metrics.jsonl").read_text().splitlines())


def test_resume_onto_other_data_parallel_ranks_names_the_global_batch_and_the_fix_keeps_it(tmp_path):
    """Before: 2 ranks resumed on 1 (or 4) trained at another global batch and learning rate without a word."""
    run = tmp_path / "run"
    ok("train", *QUICK, "--tasks-per-node", 2, "--steps", 1, "--out", run)  # 2 x 4 samples a step
    resumed = ok("train", *QUICK, "--steps", 2, "--out", run, "--resume", "--dry-run")
    saved = ckpt.list_checkpoints(run)[-1]
    assert (f"warning: --resume at a global batch of 4 samples a step, where {saved} trained at 8: the learning rate "
            "scales with it (peak 3.125e-05 -> 1.5625e-05), and so do the steps of an epoch; --batch 8 keeps the saved "
            "one") in resumed.stderr, resumed.stderr
    assert "data.batch_size" not in resumed.stderr  # the per-rank batch is named only through the global one
    kept = ok("train", *QUICK, "--batch", 8, "--steps", 2, "--out", run, "--resume")  # the last --batch counts
    # before: also `data.batch_size=4 (now 8) ... --set the saved values to keep them`, whose fix undid this one
    assert "global batch" not in kept.stderr and "data.batch_size" not in kept.stderr, kept.stderr


def test_a_resume_on_other_ranks_trains_the_epochs_left_and_no_more(tmp_path):
    """Epochs, not steps, tell what is left: before, 1 epoch of 16 steps resumed on 2 ranks (8 steps an epoch) with
    --epochs 2 was `at step 16 already: nothing to train`, and 2 epochs resumed on 1 rank with --epochs 2 started a job
    that trained nothing."""
    args = [*QUICK, "--set", "train.eval_every_epochs=100", "--out", tmp_path / "run", "--resume"]
    ok("train", *args, "--epochs", 1)
    assert _last_step(tmp_path / "run") == 16
    ok("train", *args, "--epochs", 2, "--tasks-per-node", 2)
    assert _last_step(tmp_path / "run") == 24  # the second epoch, at 8 steps
    jobs = len(registry.load_records())
    rerun = ok("train", *args, "--epochs", 2)
    assert (f"note: {tmp_path / 'run'} is at step 24 already: it has trained 2 epochs, and train.epochs=2: nothing to "
            "train; pass --epochs 3 to train on; no job was started") in rerun.stderr, rerun.stderr
    assert len(registry.load_records()) == jobs
    dry = ok("train", *args, "--epochs", 2, "--dry-run")  # its script is printed, but says it would do nothing
    assert "nothing to train; pass --epochs 3 to train on; a job of the script below would train nothing" \
        in dry.stderr and dry.stdout.startswith("#!"), dry.stderr


def test_resume_with_other_settings_than_the_checkpoint_s_names_them(tmp_path):
    """Before: `--resume` without the run's --set options went on in fp32, without clipping, in silence; and a saved
    null was named as Python's None, which --set refuses."""
    run = tmp_path / "run"
    ok("train", *QUICK, "--steps", 1, "--out", run, "--set", "optim.clip_grad=0", "--set", "optim.lr=1e-3")
    resumed = ok("train", *QUICK, "--steps", 2, "--out", run, "--resume", "--set", "optim.lr=1e-3")
    saved = ckpt.list_checkpoints(run)[0]
    assert (f"warning: --resume with other settings than {saved} was saved with: optim.clip_grad=0.0 (now 1.0); the "
            "run goes on with the new ones (--set the saved values to keep them)") in resumed.stderr, resumed.stderr
    # more steps with the settings the last checkpoint (step 2) was saved with
    again = ok("train", *QUICK, "--steps", 3, "--out", run, "--resume", "--set", "optim.lr=1e-3")
    assert "settings" not in again.stderr
    # another layout is no other setting: the checkpoint is resharded to it, and it trains the same numbers (was:
    # `parallel.microbatches=1 (now 2)`, and under a plan `--set` values that the plan refuses)
    relaid = ok("train", *QUICK, "--steps", 4, "--out", run, "--resume", "--set", "optim.lr=1e-3", "--set",
                "parallel.microbatches=2")
    assert "settings" not in relaid.stderr, relaid.stderr

    unclipped = tmp_path / "unclipped"
    ok("train", *QUICK, "--steps", 1, "--out", unclipped, "--set", "optim.clip_grad=null")
    warned = ok("train", *QUICK, "--steps", 2, "--out", unclipped, "--resume", "--dry-run")
    assert "optim.clip_grad=null (now 1.0)" in warned.stderr, warned.stderr
    followed = ok("train", *QUICK, "--steps", 2, "--out", unclipped, "--resume", "--set", "optim.clip_grad=null")
    assert "settings" not in followed.stderr


def test_a_plan_for_another_model_of_the_same_depth_is_refused(tmp_path):
    """vit_mini and vit_micro both have 4 blocks: the block count let the plan through, unseen."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"version": 1, "model": "vit_mini", "world_size": 2, "tp": 1, "pp": 1, "dp_shard": -1,
                                "microbatches": 1, "schedule": "1f1b", "virtual_stages": 1, "fsdp_rest": False,
                                "groups": [{"blocks": 4, "fsdp": False, "checkpoint": "none"}]}))
    run = [*QUICK, "--tasks-per-node", 2, "--out", tmp_path / "run", "--plan", plan, "--dry-run"]
    result = vitctl("train", *run)
    assert result.exit_code == 1 and result.stderr.strip() == (
        f"error: parallel.plan {plan} was planned for 'vit_mini', not for model vit_micro; plan this model (vitctl "
        f"plan --model vit_micro ... --out {tmp_path / 'plan-vit_micro.json'}, then --plan "
        f"{tmp_path / 'plan-vit_micro.json'}), or train vit_mini with it")  # before, --out over vit_mini's plan
    ok("train", *run, "--model", "vit_mini")  # the other way it names


ONE_RANK = [*QUICK, "--set", "data.workers=0"]


def _pretrained_and_finetuned(tmp_path: Path, source: str = "pretrain", *finetune_options: str
                              ) -> tuple[Path, Path, Path]:
    """A one-step pretraining run, copied to `source` where that is another folder, and a one-step finetune from
    `source` with `finetune_options`: (pretraining run, source, finetune run)."""
    pretrain, finetune = tmp_path / "pretrain", tmp_path / "finetune"
    ok("train", *ONE_RANK, "--steps", 1, "--out", pretrain)
    if source != pretrain.name:
        shutil.copytree(pretrain, tmp_path / source)
    ok("finetune", *ONE_RANK, "--steps", 1, "--out", finetune, "--from-ckpt", tmp_path / source, *finetune_options)
    return pretrain, tmp_path / source, finetune


@pytest.mark.slow
def test_resume_across_pretraining_and_finetuning_is_refused_before_launch(tmp_path):
    """Before, `finetune --resume` into a pretraining run's folder continued that run, --from-ckpt unread; and the
    finetune at another resolution, resumed by `train`, was refused first for its model settings, then (with them)
    for being a finetune."""
    pretrain, _, finetune = _pretrained_and_finetuned(tmp_path, "pretrain", "--set", "model.img_size=48")
    for resume in (["--resume"], []):  # without it, before: "pass --resume", which this refused
        result = vitctl("finetune", *ONE_RANK, "--steps", 2, "--out", pretrain, "--from-ckpt", finetune, *resume,
                        "--set", "model.img_size=48")
        assert result.exit_code == 1 and result.stderr.strip() == (
            f"error: {pretrain} holds the checkpoints of a pretraining run (`vitctl train`), which a finetune from "
            f"--from-ckpt {finetune} would write over: choose another --out to finetune, or continue that run with "
            f"`vitctl train --resume --set model.img_size=32`")  # before, it spoke of a --resume not given
    result = vitctl("train", *ONE_RANK, "--steps", 2, "--out", finetune, "--resume")
    assert result.exit_code == 1 and result.stderr.strip() == (
        f"error: {finetune} holds the checkpoints of a finetune from {pretrain}: continue it with `vitctl finetune "
        f"--from-ckpt {pretrain} --resume --set model.img_size=48`, or choose another --out to pretrain")
    ok("finetune", *ONE_RANK, "--steps", 2, "--out", finetune, "--from-ckpt", pretrain, "--resume", "--set",
       "model.img_size=48")  # the fixes
    ok("train", *ONE_RANK, "--steps", 2, "--out", pretrain, "--resume", "--set", "model.img_size=32")
    assert (finetune / "checkpoints/step-00000002").is_dir() and (pretrain / "checkpoints/step-00000002").is_dir()


@pytest.mark.slow
def test_resuming_a_finetune_needs_no_source_and_refuses_another(tmp_path):
    """Before: a finetune whose source had since been removed could not resume ('no such file or folder'), and
    --resume with another --from-ckpt went on from the run's own checkpoints, the other source unread."""
    pretrain, source, finetune = _pretrained_and_finetuned(tmp_path, "source")
    result = vitctl("finetune", *ONE_RANK, "--steps", 2, "--out", finetune, "--from-ckpt", pretrain, "--resume")
    assert result.exit_code == 1 and result.stderr.strip() == (
        f"error: {finetune} holds the checkpoints of a finetune from {source}, not from {pretrain} (a run goes on from "
        f"its own checkpoints, not from --from-ckpt); continue it with --from-ckpt {source} --resume, or choose "
        f"another --out to finetune from {pretrain}")
    shutil.rmtree(source)
    ok("finetune", *ONE_RANK, "--steps", 2, "--out", finetune, "--from-ckpt", source, "--resume")
    assert [c.name for c in ckpt.list_checkpoints(finetune)][-1] == "step-00000002"


def _two_jobs_in_one_run(run: Path, now: float) -> tuple[registry.JobRecord, registry.JobRecord]:
    """Two ended local jobs into `run`, submitted 100 s and 50 s before `now`."""
    (run / "submitit").mkdir(parents=True)
    jobs = tuple(registry.JobRecord(job, "local", "vit_micro-run", str(run), str(run / "submitit"), 1, 1, 0, now - age,
                                    started=-1) for job, age in (("1", 100), ("2", 50)))
    for record in jobs:
        registry.add_record(record)
    return jobs


def test_a_job_shows_only_its_own_progress_not_that_of_later_jobs_in_its_run_folder(tmp_path):
    """Before: a job that failed at start showed the steps and checkpoint of the next job into its run folder."""
    run, now = tmp_path / "run", time.time()
    first, second = _two_jobs_in_one_run(run, now)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"time": now - age, "step": step, "loss": 1.0,
                                                           "images_per_s": 5.0, "step_time_s": 0.1,
                                                           "total_steps": 6}) + "\n"
                                               for age, step in ((90, 2), (40, 6))))
    steps = {s.job_id: s.step for s in status.collect([first, second])}
    assert steps == {"1": 2, "2": 6}
    assert status.collect([first])[0].step == 2  # also when the later job is not listed


def test_a_killed_job_keeps_the_steps_it_trained_past_its_checkpoint_after_a_later_resume(tmp_path):
    """Before: the resume dropped the killed job's records past its checkpoint, and its row fell back to that step."""
    run, now = tmp_path / "run", time.time()
    killed, resumed = _two_jobs_in_one_run(run, now)

    def logged(age: float, step: int) -> str:
        return json.dumps({"time": now - age, "step": step, "loss": 1.0, "images_per_s": 5.0, "step_time_s": 0.1,
                           "total_steps": 8}) + "\n"

    before = "".join(logged(age, step) for age, step in ((95, 2), (90, 3), (85, 4), (80, 5)))
    (run / "metrics.jsonl").write_text(before)
    MetricsWriter(run, enabled=True).drop_after(3)  # the resume from step 3's checkpoint
    with open(run / "metrics.jsonl", "a") as f:
        f.write(logged(40, 4))
    assert [r["step"] for r in read_metrics(run)] == [2, 3, 4]
    assert {s.job_id: s.step for s in status.collect([killed, resumed])} == {"1": 5, "2": 4}
    # A crash between keeping the dropped records and rewriting the log leaves them in both; a rerun keeps them again.
    (run / "metrics.jsonl").write_text(before)
    MetricsWriter(run, enabled=True).drop_after(3)
    assert [r["step"] for r in read_metrics(run, superseded=True)] == [2, 3, 4, 5]


def test_status_json_of_a_diverged_run_is_json_every_parser_reads(tmp_path):
    """A NaN loss was written as the bare NaN, which JSON has not: JavaScript's, Go's and serde's parsers refused the
    whole listing."""
    run = tmp_path / "diverged"
    record = _ended_local_job(run)
    (run / "metrics.jsonl").write_text(
        '{"step": 2, "total_steps": 9, "loss": 2.5, "images_per_s": Infinity, "step_time_s": 0.0}\n'
        '{"step": 3, "total_steps": 9, "loss": NaN, "images_per_s": 10.0, "step_time_s": NaN}\n')

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    listed = json.loads(ok("status", record.job_id, "--json").output, parse_constant=refuse)[0]
    assert listed["step"] == 3 and listed["loss"] is listed["eta_s"] is None and listed["images_per_s"] == [None, 10.0]
    assert "nan" in ok("status", record.job_id).output.lower()  # the table still shows it


@pytest.mark.slow
def test_a_local_job_seen_from_another_host_is_not_called_dead_and_cancel_says_where_to_run(tmp_path):
    """A shared VITCTL_HOME (or a container's PID namespace): the PID check alone called a running job FAILED ('no
    rank reported an error'), `cancel` said it had ended (exit 0) while it trained on, and `logs --follow` ended."""
    out = tmp_path / "run"
    job = _start(out, 4000)
    try:
        _wait_for_step(out, 2)
        record = registry.find_record(str(out))
        assert (record.host, record.pid_namespace) == submit.pid_space()
        registry.update_record(record.key, host="gpu-node-7")  # as another host reads the shared registry
        listed = json.loads(ok("status", out, "--json").output)[0]
        assert (listed["state"], listed["note"]) == ("UNKNOWN", (
            f"a local job that runs on host gpu-node-7, whose processes this machine cannot see; `vitctl status "
            f"{record.job_id}` there shows it"))
        cancelled = vitctl("cancel", record.job_id)
        assert cancelled.exit_code == 1 and cancelled.stderr.strip() == (
            f"error: cannot cancel job {record.job_id}: it is a local job that runs on host gpu-node-7, whose "
            f"processes this machine cannot signal; run `vitctl cancel {record.job_id}` there")
        followed = subprocess.run([VITCTL, "logs", record.job_id, "--follow"], capture_output=True, text=True,
                                  timeout=60, env=os.environ)
        assert followed.returncode == 0 and "note: not following" in followed.stderr
        assert job.poll() is None  # it trains on
        registry.update_record(record.key, host=record.host)  # back on its host, the advice works
        assert "cancel requested" in ok("cancel", record.job_id).output
        _, stderr = job.communicate(timeout=120)
        assert job.returncode == 1 and "was stopped (cancelled): checkpointed at step" in stderr, stderr
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()


@pytest.mark.parametrize("cause", ["full", "read-only"])
def test_a_job_that_could_not_report_for_a_full_or_read_only_disk_is_said_so(tmp_path, monkeypatch, cause):
    """A rank's error and result are written to the run folder too: a full or read-only one left only `no rank
    reported an error (killed, or out of memory?)`."""
    run = tmp_path / "run"
    record = _ended_local_job(run)
    folder = run / "submitit"
    (folder / "1_0_log.err").write_text("")
    assert status.failure(record).startswith("no rank reported an error (killed, or out of memory?)")  # room here
    if cause == "full":
        monkeypatch.setattr(status.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30, 2**20))
        why = f"the file system of {folder} is full (1 MiB free)"
    else:
        monkeypatch.setattr(status.os, "access", lambda path, mode: False)
        why = f"{folder} takes no writes (a read-only file system, or no write access)"
    assert status.failure(record) == (f"no rank could report an error: {why}; make room or write access (the log, "
                                      f"maybe cut short: {folder}/1_0_log.err){_go_on(run)}")
    assert "start afresh" in _go_on(run)  # this run saved none


def test_a_job_killed_before_its_first_checkpoint_is_not_said_to_resume_from_one(tmp_path):
    """A second cancel of a job whose run had saved nothing said that --resume went on from its last checkpoint."""
    run = tmp_path / "run"
    record = registry.JobRecord("1", "local", "vit_micro-run", str(run), str(run / "submitit"), 1, 1, 0, time.time())
    assert status.killed_note(record) == ("killed by a second `vitctl cancel`: its run had saved no checkpoint, so "
                                          "nothing of it was kept: run the same command again to start afresh")
    saved = run / "checkpoints/step-00000004"
    saved.mkdir(parents=True)
    (saved / "meta.json").write_text("{}")
    (saved / ".metadata").write_text("")
    assert status.killed_note(record).endswith("--resume goes on from that checkpoint (step-00000004)")
    registry.add_record(record)  # a later job went on in the run folder and saved step 8: the kill lost what it lost
    registry.add_record(replace(record, job_id="2", submitted=record.submitted + 60, key=uuid.uuid4().hex))
    later = run / "checkpoints/step-00000008"
    shutil.copytree(saved, later)
    os.utime(later, (record.submitted + 120, record.submitted + 120))
    assert status.killed_note(record) == ("killed by a second `vitctl cancel`: the steps since its last checkpoint "
                                          "(step-00000004) were lost")


def test_status_names_requeued_attempts_that_ended_before_their_checkpoint(tmp_path):
    """Before: a requeue whose ranks Slurm killed at the end of its KillWait (5 s on the dev cluster), before they
    had checkpointed, showed only 'requeued'; and `restarts` counted the resume a `--resume` job starts with."""
    run = tmp_path / "run"
    record = _ended_local_job(run)
    for step in (10, 15):
        saved = ckpt.checkpoint_dir(run) / f"step-{step:08d}"
        saved.mkdir(parents=True)
        (saved / "meta.json").write_text("{}")
        (saved / ".metadata").write_bytes(b"")

    def steps(first: int, last: int) -> list[dict]:
        return [{"step": s, "loss": 1.0, "images_per_s": 1.0, "step_time_s": 1.0, "total_steps": 30}
                for s in range(first, last + 1)]

    marks = [{"step": 5, "event": "resume"}, *steps(6, 10),  # the job began with --resume from step 5
             # an attempt trained steps 11-13 and was killed before its checkpoint: the next one dropped their records
             {"step": 10, "event": "resume"}, *steps(11, 15), {"step": 15, "event": "stopped"},  # one checkpointed
             {"step": 15, "event": "resume"}, *steps(16, 18)]  # the last: requeued now, or running
    (run / "metrics.jsonl").write_text("".join(json.dumps({**m, "time": record.submitted + 1}) + "\n" for m in marks))
    done = status.progress(record)
    assert done["restarts"] == 2
    killed = ("1 requeued attempt ended before its checkpoint (Slurm killed the ranks at the end of its KillWait): "
              "the steps past the last checkpoint were trained again")
    assert status._unsaved_note(done["unsaved"], requeued_now=False) == killed
    assert status._unsaved_note(done["unsaved"], requeued_now=True) == (
        f"{killed}; the requeued attempt ended before its checkpoint (Slurm killed the ranks at the end of its "
        "KillWait): steps 16-18 are trained again")


@pytest.mark.parametrize("said", ["srun: unrecognized option '--container-image=nvcr.io#nvidia/pytorch:25.10-py3'",
                                  "slurmstepd: error: Detected 1 oom_kill event in StepId=7.0. Some of the step "
                                  "tasks have been OOM Killed."])
def test_a_job_that_slurm_ended_before_any_rank_reported_quotes_slurm(tmp_path, said):
    """Before: 'no rank reported an error (killed, or out of memory?)', where srun's or slurmstepd's line said why."""
    record = _ended_local_job(tmp_path / "run")
    log = tmp_path / "run/submitit/1_0_log.err"
    log.write_text(f"2026-11-30 06:10:00,000 [rank 0] submitit: Starting\n{said}\nsrun: error: n1: task 0: Exited\n")
    assert status.failure(record) == f"no rank reported an error, and Slurm logged: {said}; see {log}"


def test_a_rank_without_the_rendezvous_address_says_how_to_launch_it(tmp_path):
    """Before: torch's ValueError ("environment variable MASTER_ADDR expected, but not set"), without a way on."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([VITCTL, "rank", *RANK_ARGS, "--out", str(tmp_path / "r")], capture_output=True, text=True,
                          env={**env, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, timeout=120)
    assert done.returncode == 1 and done.stderr.rstrip().endswith(
        "WORLD_SIZE=2, but MASTER_ADDR and MASTER_PORT are not set: the ranks meet at rank 0's address and port; "
        "launch them with torchrun, srun or `vitctl train`, which set both, or set MASTER_ADDR and MASTER_PORT"), \
        done.stderr


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_rank_waiting_for_a_missing_rank_stops_on_a_signal(tmp_path, stop):
    """Before: rank 0 of 2, started alone, ignored SIGTERM and Ctrl-C for as long as torch waited (30 minutes)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    rank = subprocess.Popen([VITCTL, "rank", *RANK_ARGS, "--out", str(tmp_path / "r")], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while socket.socket().connect_ex(("127.0.0.1", port)) and time.monotonic() < deadline:
            time.sleep(0.2)  # until rank 0 listens for the others
        time.sleep(1)
        rank.send_signal(stop)
        assert rank.wait(timeout=20) == -stop
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
