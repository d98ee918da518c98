"""What a submitted job is doing: its state (Slurm: squeue, and sacct over all its attempts; local jobs: their
processes and result files), why it waits or failed, its progress from the rank-0 metrics file, and its logs."""

import contextlib
import functools
import heapq
import math
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from vitctl.datasets.errors import count
from vitctl.trainer.checkpoint_files import NAME, list_checkpoints
from vitctl.trainer.metrics import read_metrics

from . import slurm_time
from .errors import LaunchError
from .process import children, is_running, pid_space
from .registry import JobRecord, UnknownJobError, load_records, reload, snapshot, update_record

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE", "INTERRUPTED"}  # INTERRUPTED: a local job that checkpointed on a signal and ended
FAILED = {"FAILED", "OUT_OF_MEMORY", "BOOT_FAIL"}
RATE_HISTORY = 24
QUIET_S = 600  # a running job that logs no step for this long, and for 10 of its intervals, is said to be quiet
SLURM_TIMEOUT_S = 30  # a Slurm command that takes longer counts as not answering (slurmctld down or overloaded)
# squeue's reasons for a pending job, in words; others are shown as Slurm names them.
PENDING_REASONS = {
    "BeginTime": "held until its begin time (Slurm delays a requeued job by about 2 minutes)",
    "Resources": "waiting for free nodes",
    "Priority": "waiting behind jobs of higher priority",
    "ReqNodeNotAvail": "waiting for nodes that are down, drained or reserved (`sinfo -R` says which, and why)",
    "NodeDown": "waiting for a node that is down",
    "Dependency": "waiting for the jobs it depends on",
    "JobHeldUser": "held: `scontrol release {job}` lets it start",
    "JobHeldAdmin": "held by an administrator, who alone can release it (`scontrol release {job}`)",
}
# Reasons squeue gives as sentences rather than names, by their start: the name whose words fit them.
PENDING_SENTENCES = {"Nodes required for job are DOWN, DRAINED": "ReqNodeNotAvail",
                     "job requeued in held state": "JobHeldUser"}
RANK_FAILED = re.compile(r"^[\w.]*RankFailed: ")
TIME_LIMIT_REACHED = re.compile(r"^[\w.]*TimeLimitReached: (.*)")
# What torch.distributed's gloo says on a rank whose peer died: the peer is the one to name.
PEER_LOST = re.compile(r"Connection (closed|reset) by peer")
TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}")  # logging's asctime


def is_live(state: str) -> bool:
    """A job in this state may still write to its run folder (nothing knows an UNKNOWN one: it will not change)."""
    return state not in TERMINAL and state != "UNKNOWN"


@dataclass(frozen=True)
class JobState:
    state: str
    elapsed_s: float | None  # over all attempts
    note: str = ""  # why it waits, what it went through, why it failed
    unreachable: bool = False  # UNKNOWN because squeue or sacct failed, not because neither lists it
    time_left_s: int | None = None  # a running Slurm job: until this attempt's time limit
    time_limit_s: int | None = None
    requeued: int = 0  # Slurm attempts that ended REQUEUED (by submitit on a time limit, or by scontrol)

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    @property
    def live(self) -> bool:
        return is_live(self.state)


@dataclass
class JobStatus:
    job_id: str
    name: str
    executor: str
    state: str
    layout: str  # nodes x GPUs (or CPU tasks) and the parallel layout once the job has started, e.g. pp2·tp2·fsdp4
    elapsed: str
    step: int | None
    total_steps: int | None
    loss: float | None
    images_per_s: list[float]
    eta_s: float | None
    last_checkpoint: str | None
    restarts: int
    run_dir: str
    note: str

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    @property
    def live(self) -> bool:
        return is_live(self.state)

    def to_dict(self) -> dict[str, Any]:
        """As JSON holds it: a diverged run's NaN or infinite loss (or rate) is null, which every parser reads."""
        values = asdict(self)
        values["images_per_s"] = [_finite(rate) for rate in self.images_per_s]
        return values | {key: _finite(values[key]) for key in ("loss", "eta_s")}


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def _run(args: list[str], errors: list[str]) -> str:
    """The command's output; why it failed, in its own words, is added to `errors` (a job id squeue no longer knows
    is no failure)."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except OSError as e:
        errors.append(f"cannot run {args[0]} ({e.strerror})")
        return ""
    except subprocess.TimeoutExpired:
        errors.append(f"{args[0]} did not answer within {SLURM_TIMEOUT_S} s")
        return ""
    said = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    if done.returncode and not (said and said[-1].endswith("Invalid job id specified")):
        last = said[-1].removeprefix(f"{args[0]}: ") if said else f"exit status {done.returncode}"
        errors.append(f"{args[0]}: {last}")
    return done.stdout


def slurm_states(ids: list[str]) -> dict[str, JobState]:
    """job id -> its state: squeue for jobs in the queue (with why they wait), sacct for the rest and for the
    attempts before a requeue (their states, and the time they ran)."""
    if not ids:
        return {}
    attempts: dict[str, list[tuple[str, int]]] = {}
    errors: list[str] = []
    for line in _run(["sacct", "-n", "-P", "-X", "-D", "-j", ",".join(ids), "-o", "JobIDRaw,State,ElapsedRaw"],
                     errors).splitlines():
        job_id, state, elapsed = line.split("|")
        attempts.setdefault(job_id, []).append((state.split()[0], int(elapsed or 0)))  # "CANCELLED by 0"
    # a cancelled job is COMPLETING until its ranks have ended (Slurm kills them after its KillWait); sacct already
    # says CANCELLED
    unfinished = [i for i in ids if i not in attempts or attempts[i][-1][0] not in TERMINAL - {"CANCELLED"}]
    queued = {}  # job id -> (state, restarts, reason); squeue knows of a requeue before sacct does
    limits: dict[str, tuple[int | None, int | None]] = {}  # job id -> time left, time limit (seconds)
    if unfinished:
        for line in _run(["squeue", "-h", "-j", ",".join(unfinished), "-O",
                          "JobID:|,State:|,RestartCnt:|,TimeLeft:|,TimeLimit:|,Reason:"], errors).splitlines():
            job_id, state, restarts, left, limit, reason = (field.strip() for field in line.split("|", 5))
            queued[job_id] = (state, int(restarts or 0), reason)
            limits[job_id] = (slurm_time.seconds(left), slurm_time.seconds(limit))
    states = {}
    for job_id in ids:
        rows = attempts.get(job_id, [])
        if job_id not in queued and not rows:
            if errors:  # not "neither knows it": they could not say
                states[job_id] = JobState("UNKNOWN", None, _unreachable(errors), unreachable=True)
            continue
        state, restarts, reason = queued.get(job_id, (rows[-1][0] if rows else "", 0, ""))
        earlier = [ended for ended, _ in rows[:-1]]
        notes = [_requeues(earlier, max(restarts, len(earlier)), state in TERMINAL)] if earlier or restarts else []
        if job_id in unfinished and job_id not in queued and errors:  # squeue failed: sacct's word may be stale
            notes.append(f"as accounting last recorded it: {_unreachable(errors)}")
        if state == "PENDING" and reason not in ("", "None"):
            notes.append(_pending_note(job_id, reason))
        states[job_id] = JobState(state, sum(e for _, e in rows), "; ".join(notes), False,
                                  *limits.get(job_id, (None, None)), earlier.count("REQUEUED"))
    return states


def _pending_note(job_id: str, reason: str) -> str:
    """Why a job waits, in words, with squeue's reason after them; a reason vitctl has no words for, as it is."""
    name = next((named for start, named in PENDING_SENTENCES.items() if reason.startswith(start)), None)
    if name:  # its own words say less than ours
        return f"{PENDING_REASONS[name].format(job=job_id)} ({name})"
    name = reason.split(",")[0]
    return f"{PENDING_REASONS[name].format(job=job_id)} ({reason})" if name in PENDING_REASONS else reason


def _unreachable(errors: list[str]) -> str:
    """Which part of Slurm did not answer, and how to check it: sacct reads slurmdbd (accounting), which `scontrol
    ping` does not test; squeue and scancel ask slurmctld."""
    said = "; ".join(errors)
    if all(e.startswith("sacct") for e in errors):
        return (f"Slurm's accounting (slurmdbd), where sacct reads the states of ended jobs, does not answer: {said}; "
                "check that slurmdbd runs (`scontrol show config | grep AccountingStorageHost` names its host), then "
                "try again")
    return f"Slurm is unreachable: {said}; check `scontrol ping`, then try again"


def _requeues(earlier: list[str], times: int, ended: bool) -> str:
    """What the attempts before this one ended in: 'requeued after NODE_FAIL', 'requeued (2 times)'; of a job that has
    ended, 'after 2 requeues (the last after NODE_FAIL)'."""
    cause = earlier[-1] if earlier and earlier[-1] != "REQUEUED" else ""  # REQUEUED: scontrol, submitit
    if ended:
        return f"after {times} requeue{'s' if times > 1 else ''}" + (f" (the last after {cause})" if cause else "")
    return "requeued" + (f" after {cause}" if cause else "") + (f" ({times} times)" if times > 1 else "")


STOPPED_AS_RANKS_STARTED = "cancelled as its ranks started, before they trained: run the same command again"


def local_state(record: JobRecord) -> JobState:
    if not record.job_id:
        if record.submitter:
            return JobState("SUBMITTING", None, f"being submitted by vitctl (pid {record.submitter[0]})")
        return JobState("UNKNOWN", None, "the vitctl that submitted it stopped before the job started; no job of it "
                                         f"was found in {record.folder}")
    away = elsewhere(record)
    if not away and is_running(int(record.job_id), record.started):
        return JobState("RUNNING", time.time() - record.submitted, "cancel requested" if record.cancelled else "")
    result = _result(_result_path(record, 0))
    if result is not None:
        (outcome, _), ended = result
        elapsed = ended - record.submitted
        if stopped := _stop_note(result):
            return JobState("CANCELLED" if record.cancelled else "INTERRUPTED", elapsed, stopped)
        return JobState("COMPLETED" if outcome == "success" else "FAILED", elapsed)
    if away:  # its PID names nothing here, or another process
        return JobState("UNKNOWN", None, f"a local job that runs {away}, whose processes this machine cannot see; "
                                         f"`vitctl status {record.job_id}` there shows it")
    elapsed = _until_last_written(record)
    if record.cancelled:  # no result: killed by a second cancel, or stopped before a rank took the signal
        return JobState("CANCELLED", elapsed, killed_note(record) if record.killed else STOPPED_AS_RANKS_STARTED)
    if not Path(record.folder).is_dir():  # with its run folder, collect's note says so
        return JobState("UNKNOWN", None, "" if not Path(record.run_dir).is_dir() else
                        f"its folder {record.folder} is gone")
    if (path := _result_path(record, 0)).exists():
        return JobState("UNKNOWN", elapsed, f"it ended, and rank 0's result {path} cannot be read (damaged); "
                                            f"`vitctl logs {record.job_id}` shows how it ended")
    if elapsed is None and (later := _later_job(record)):  # none of its files: not killed, removed
        return JobState("UNKNOWN", None, f"its logs and result are gone: {record.folder} was removed and made again "
                                         f"(job {later.job_id} ran there since)")
    return JobState("FAILED", elapsed)


def _later_job(record: JobRecord) -> JobRecord | None:
    """The first job submitted into the same run folder after `record`, or None."""
    run_dir = _folder(record.run_dir)
    later = [r for r in snapshot() if _folder(r.run_dir) == run_dir and r.submitted > record.submitted]
    return min(later, key=lambda r: r.submitted, default=None)


def _until_last_written(record: JobRecord) -> float | None:
    """A local job that left no result (killed, as by SIGKILL or the OOM killer) ran until it last wrote its logs."""
    try:
        last = max((p.stat().st_mtime for p in Path(record.folder).glob(f"{record.job_id}_*")), default=None)
    except OSError:  # a folder this user cannot read
        return None
    return None if last is None else max(0.0, last - record.submitted)


def elsewhere(record: JobRecord) -> str | None:
    """Where a local job runs when this machine cannot see its processes (another host; another PID namespace, as a
    container's), in words; None here, and for records that do not say (older ones)."""
    if record.executor != "local" or record.host is None:
        return None
    host, namespace = pid_space()
    if record.host != host:
        return f"on host {record.host}"
    return None if record.pid_namespace == namespace else f"in another PID namespace (a container) of host {host}"


RESUME_HINT = ": --resume continues from there"


def _stop_note(result: tuple[tuple[str, Any], float] | None) -> str:
    """Where a job stopped on a signal checkpointed, from rank 0's result (`_result`); '' if it did not stop so."""
    value = result[0][1] if result and result[0][0] == "success" else None
    if isinstance(value, dict) and value.get("stopped"):
        return f"checkpointed at step {value['step']} on a signal{RESUME_HINT}"
    return ""


def _result(path: Path) -> tuple[tuple[str, Any], float] | None:
    """A task's (outcome, value) as submitit pickled it, and when; None before it ends."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f), path.stat().st_mtime
    except Exception:  # not there yet; or damaged, when unpickling raises whatever its bytes lead to
        return None


def state_of(record: JobRecord, slurm: dict[str, JobState] | None = None) -> JobState:
    if record.executor == "local" or not record.job_id:
        state = local_state(record)
    else:
        slurm = slurm_states([record.job_id]) if slurm is None else slurm
        state = slurm.get(record.job_id, JobState("UNKNOWN", None, "neither squeue nor sacct knows it"))
        state = _slurm_cancel_state(record, _ended_by_result(record, state) if state.unreachable else state)
        state = _signalled_state(record, state)
    if state.state in FAILED:
        out_of_time = _out_of_time(record)  # a job that ended on its time limit is no failure of a rank
        state = JobState("TIMEOUT" if out_of_time else state.state, state.elapsed_s,
                         "; ".join(filter(None, [state.note, out_of_time or failure(record)])))
    return state


def _ended_by_result(record: JobRecord, state: JobState) -> JobState:
    """A job Slurm cannot tell of now (`state`: a daemon does not answer) whose rank 0 saved its result has ended, as
    that result says (how long it ran is Slurm's to say)."""
    result = _result(_result_path(record, 0))
    if result is None:
        return state
    # a job whose ranks stopped on a signal saved a success too, as Slurm records it COMPLETED
    return JobState("COMPLETED" if result[0][0] == "success" else "FAILED", None,
                    f"as rank 0's result says; {state.note}")


def _slurm_cancel_state(record: JobRecord, state: JobState) -> JobState:
    """A Slurm job as its cancel left it: `vitctl cancel` signals the ranks, which checkpoint and end (COMPLETED to
    Slurm); a second cancel, or scancel, cancels it (its ranks checkpoint too when they can within KillWait)."""
    if not record.cancelled and state.state != "CANCELLED":  # CANCELLED: scancel from outside vitctl
        return state
    if state.state == "RUNNING":
        return replace(state, note="; ".join(filter(None, [state.note, "cancel requested"])))
    if state.state == "COMPLETING" and record.killed:
        return replace(state, note=ENDING)
    if state.state == "FAILED" and not rank_failures(record):
        # the signal came before a rank took it (Python starting): killed before it trained
        return JobState("CANCELLED", state.elapsed_s, STOPPED_AS_RANKS_STARTED)
    if state.state not in ("CANCELLED", "COMPLETED"):
        return state
    stopped = _stop_note(_result(_result_path(record, 0)))
    if state.state == "COMPLETED" and not stopped:
        return state  # it had finished training when the cancel came
    killed = killed_note(record) if record.killed and not stopped else ""
    return JobState("CANCELLED", state.elapsed_s, "; ".join(filter(None, [state.note, stopped, killed])))


def _signalled_state(record: JobRecord, state: JobState) -> JobState:
    """A Slurm job whose ranks checkpointed on a signal from outside vitctl (`scancel --signal=TERM`, a batch system's
    own stop) and ended: Slurm records it COMPLETED, unfinished; INTERRUPTED, as a local job stopped so."""
    if state.state != "COMPLETED" or record.cancelled or not (stopped := _stop_note(_result(_result_path(record, 0)))):
        return state
    return JobState("INTERRUPTED", state.elapsed_s, "; ".join(filter(None, [state.note, stopped])))


def _out_of_time(record: JobRecord) -> str | None:
    """Rank 0's TimeLimitReached message: the job checkpointed on its time limit with no requeue left."""
    result = _result(_result_path(record, 0))
    lines = str(result[0][1]).strip().splitlines() if result and result[0][0] == "error" else []
    match = TIME_LIMIT_REACHED.match(lines[-1]) if lines else None
    return match[1] if match else None


def rank_failures(record: JobRecord) -> list[tuple[int, str]]:
    """(rank, its error in one line) of each rank that raised, the first to fail first."""
    found = []
    for rank in range(record.ranks):
        result = _result(_result_path(record, rank))
        if result is not None and result[0][0] == "error":
            lines = [line for line in str(result[0][1]).splitlines() if line.strip()] or ["no message"]
            last = RANK_FAILED.sub("", lines[-1])  # "rank N raised ..."; other errors come from submitit
            found.append((result[1], rank, last if last != lines[-1] else f"rank {rank} raised {last}"))
    return [(rank, message) for _, rank, message in sorted(found)]


def failure(record: JobRecord) -> str:
    """Why a job failed: the first rank's error and the log that holds its traceback; a rank that ended without a
    word (killed) comes first when the errors of the others only say they lost it."""
    failures = rank_failures(record)
    silent = [rank for rank in range(record.ranks) if _result(_result_path(record, rank)) is None]
    if failures and not (silent and all(PEER_LOST.search(message) for _, message in failures)):
        # a rank's own error before the errors of ranks that only lost it, whichever result was saved first
        rank, message = next(((r, m) for r, m in failures if not PEER_LOST.search(m)), failures[0])
        return f"{message} (traceback in {log_paths(record, rank)[1]})"
    if silent and failures:
        crashed, fix = _crash(record, silent[0]) or ("ended without reporting an error (killed, or out of memory?)", "")
        return (f"rank {silent[0]} {crashed}, and rank {failures[0][0]} then lost its connection to it{fix}; see "
                f"{log_paths(record, silent[0])[1]}{_where_to_go_on(record)}")
    if unwritable := _unwritable(Path(record.folder)):  # the ranks write their results and logs there
        return (f"no rank could report an error: {unwritable}; make room or write access (the log, maybe cut short: "
                f"{log_paths(record, 0)[1]}){_where_to_go_on(record)}")
    log = log_paths(record, 0)[1]
    if not Path(record.run_dir).is_dir():  # its ranks' errors, results and logs went with it
        return (f"its run folder {record.run_dir} was moved or deleted while it ran: its ranks could not write "
                "there; if you moved it, `vitctl status NEW_PLACE` records where, and `--out NEW_PLACE --resume` "
                "goes on from its last checkpoint")
    if crash := next(((rank, c) for rank in silent if (c := _crash(record, rank))), None):
        rank, (crashed, fix) = crash
        return f"rank {rank} {crashed}{fix}; see {log_paths(record, rank)[1]}"
    if said := _slurm_said(log):
        return f"no rank reported an error, and Slurm logged: {said}; see {log}"
    if not any(p.exists() for p in log_paths(record, 0)):  # killed before its ranks started
        return f"it ended before its ranks wrote a log (killed, or out of memory?){_where_to_go_on(record)}"
    return f"no rank reported an error (killed, or out of memory?); see {log}{_where_to_go_on(record)}"


def _where_to_go_on(record: JobRecord) -> str:
    """After a job that ended without a word: where --resume goes on from, unless a later job went on already."""
    found, later = _checkpoints_of_its_time(record)
    if later:
        return ""
    if found:
        return f"; --resume goes on from its last checkpoint ({found[-1].name})"
    return "; it had saved no checkpoint: run the same command again to start afresh"


SLURM_ERROR = re.compile(r"^(?:srun|slurmstepd): (?:error: |unrecognized option).*", re.MULTILINE)


CRASH = re.compile(r"^Fatal Python error: (.+)$", re.MULTILINE)
# vitctl's own folders, to find its frames in a crash's stacks (a virtual environment may lie beside them)
PACKAGES = tuple(Path(__file__).resolve().parents[1] / name for name in ("cli", "workflows", "trainer", "datasets"))
FRAME = re.compile(r'^\s*File "(.+)", line (\d+) in (\S+)', re.MULTILINE)
# Python 3.11 runs a comprehension in a frame of its own, always called from the function that holds it (3.12 inlines)
COMPREHENSIONS = ("<listcomp>", "<dictcomp>", "<setcomp>")


def _crash(record: JobRecord, rank: int) -> tuple[str, str] | None:
    """A rank that crashed in native code, as faulthandler wrote it into its log: what, and where in vitctl it was;
    and the fix where DALI's decoder crashed (it does on some damaged JPEGs, which verify --decode finds)."""
    tail = _tail(log_paths(record, rank)[1])
    if not (found := CRASH.search(tail)):
        return None
    threads = re.split(r"\n(?=Thread 0x|Current thread 0x)", tail[found.end():])  # innermost frame first in each
    ours = [[f for f in FRAME.finditer(t) if any(Path(f[1]).is_relative_to(p) for p in PACKAGES)] for t in threads]
    # the crashing thread's, where it runs Python; else (a native thread of a library) what vitctl was doing
    frames = next((f for t, f in zip(threads, ours, strict=True) if t.startswith("Current thread") and f), None) \
        or next(filter(None, ours), [])
    if not frames:
        return f"crashed ({found[1]})", ""
    file, line = frames[0][1], frames[0][2]
    function = next((f[3] for f in frames if f[3] not in COMPREHENSIONS), frames[0][3])
    if not any(f[1].endswith("data/dali.py") for f in frames):  # not while reading DALI's batches
        return f"crashed ({found[1]}) in {function} ({Path(file).name}:{line})", ""
    data = next((m["data"] for m in reversed(read_metrics(Path(record.run_dir))) if m.get("event") == "start"
                 and isinstance(m.get("data"), str)), "SHARDS")
    return (f"crashed ({found[1]}) in {function} ({Path(file).name}:{line})", "; DALI's decoder crashes on some "
            f"damaged JPEGs: `vitctl data verify {shlex.quote(data)} --decode 100000000` decodes every image and "
            "names the shards to write again")


def _tail(log: Path) -> str:
    """The last 64 KiB of a log; empty if it cannot be read."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _slurm_said(log: Path) -> str | None:
    """The first error srun or slurmstepd wrote into the end of the job's log (an option it does not take, an
    out-of-memory kill; what follows it, such as `task 0: Exited`, is its consequence), or None."""
    found = SLURM_ERROR.findall(_tail(log))
    return found[0].strip() if found else None


FULL_BYTES = 64 * 2**20  # less room than this, and a rank's metrics, log or result may not fit


def _unwritable(folder: Path) -> str | None:
    """Why a job's folder takes no more writes (a full or read-only file system), or None."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:  # gone: said elsewhere
        return None
    if not os.access(folder, os.W_OK):
        return f"{folder} takes no writes (a read-only file system, or no write access)"
    return f"the file system of {folder} is full ({free / 2**20:.0f} MiB free)" if free < FULL_BYTES else None


def ran(record: JobRecord, rank: int) -> bool:
    """Whether the rank ended with a result saved (an error or a success): it started."""
    return _result_path(record, rank).exists()


def _result_path(record: JobRecord, rank: int) -> Path:
    return Path(record.folder) / f"{record.job_id}_{rank}_result.pkl"


def progress(record: JobRecord, until: float | None = None) -> dict[str, Any]:
    """What the job wrote into its run folder: from its submission until `until`, when the next job into that folder
    was submitted (a job's row would otherwise show the progress of later jobs there)."""
    metrics = [m for m in read_metrics(Path(record.run_dir), superseded=True)
               if record.submitted <= m.get("time", record.submitted) < (until or math.inf)]
    steps = [m for m in metrics if {"step", "loss", "images_per_s"} <= m.keys()]  # not a hand-edited line's part
    last = steps[-1] if steps else {}
    checkpoints = [c for c in list_checkpoints(Path(record.run_dir)) if until is None or c.stat().st_mtime < until]
    return {"step": last.get("step"), "total_steps": last.get("total_steps"), "loss": last.get("loss"),
            "images_per_s": [m["images_per_s"] for m in steps[-RATE_HISTORY:]], "eta_s": _eta_s(metrics, last),
            "logged_at": last.get("time"),
            "last_checkpoint": checkpoints[-1].name if checkpoints else None,
            "restarts": len(restarts := _restarts(marks := _attempt_marks(metrics))),
            "unsaved": _unsaved(restarts, marks, checkpoints),
            "parallel": next((m["layout"] for m in reversed(metrics) if "layout" in m), None),
            "quiet": _quiet_note(record, steps)}


def _eta_s(metrics: list[dict[str, Any]], last: dict[str, Any]) -> float | None:
    """Seconds left as of the last step record: by this attempt's rate in wall-clock time from its second record on
    (the first one's interval holds compiling and warm-up; the later ones the evals and checkpoints between steps),
    or, before there are two such records, by the last record's step time; none before this attempt's first record
    (the last one before it may be the step its signal cut into)."""
    if not last.get("total_steps") or last["step"] >= last["total_steps"]:
        return None
    begun = max((i for i, m in enumerate(metrics) if m.get("event") in ("resume", "stopped")), default=-1)
    if not any(m is last for m in metrics[begun + 1:]):
        return None
    timed = [m for m in metrics[begun + 1:] if "loss" in m and isinstance(m.get("time"), (int, float))][1:]
    if len(timed) >= 2 and timed[-1]["time"] > timed[0]["time"] and timed[-1]["step"] > timed[0]["step"]:
        per_step = (timed[-1]["time"] - timed[0]["time"]) / (timed[-1]["step"] - timed[0]["step"])
    else:
        per_step = last.get("step_time_s")
    return (last["total_steps"] - last["step"]) * per_step if per_step else None


def _attempt_marks(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that tell the attempts of a job apart: its steps, and its stops and resumes."""
    return [m for m in metrics if "loss" in m or m.get("event") in ("stopped", "resume")]


def _restarts(marks: list[dict[str, Any]]) -> list[bool]:
    """For each restart of the job after an attempt of its own (a requeue; not the resume it may start with), whether
    that attempt checkpointed on its signal: its ranks log `stopped` then, unless they are killed first."""
    return [i > 0 and marks[i - 1].get("event") == "stopped" for i, m in enumerate(marks)
            if m.get("event") == "resume" and any("loss" in earlier for earlier in marks[:i])]


def _unsaved(restarts: list[bool], marks: list[dict[str, Any]], checkpoints: list[Path]) -> dict[str, Any]:
    """The requeued attempts that ended before their checkpoint (Slurm kills the ranks when its KillWait, and for a
    pre-emption the partition's GraceTime, runs out); and the steps the last attempt trained past its last checkpoint
    without a signal's checkpoint after them: trained again if that attempt was requeued."""
    saved = int(NAME.fullmatch(checkpoints[-1].name)[1]) if checkpoints else 0
    past = marks[-1]["step"] if marks and "loss" in marks[-1] and marks[-1]["step"] > saved else None
    return {"killed": restarts.count(False), "since": saved, "until": past}


def _unsaved_note(unsaved: dict[str, Any], requeued_now: bool) -> str:
    killed, since, until = unsaved["killed"], unsaved["since"], unsaved["until"]
    notes = [f"{killed} requeued attempt{'s' if killed > 1 else ''} ended before {'their' if killed > 1 else 'its'} "
             "checkpoint (Slurm killed the ranks at the end of its KillWait): the steps past the last checkpoint "
             "were trained again"] if killed else []
    if requeued_now and until is not None:
        notes.append(f"the requeued attempt ended before its checkpoint (Slurm killed the ranks at the end of its "
                     f"KillWait): steps {since + 1}-{until} are trained again")
    return "; ".join(notes)


def _quiet_note(record: JobRecord, steps: list[dict[str, Any]]) -> str:
    """For a running job whose steps stopped coming (a hung rank holds every other one in its collectives until
    their timeout, 30 min under gloo): how long since the last, against how often they came before."""
    if len(steps) < 2 or not all("time" in m for m in steps[-2:]):
        return ""
    gap, quiet = steps[-1]["time"] - steps[-2]["time"], time.time() - steps[-1]["time"]
    if quiet < max(QUIET_S, 10 * gap):
        return ""
    at = time.strftime("%H:%M", time.localtime(steps[-1]["time"]))
    return (f"no step logged for {quiet / 60:.0f} min (the last, step {steps[-1]['step']}, at {at}; one every "
            f"{gap:.0f} s before): a rank may hang; `vitctl logs {record.job_id} --rank R` shows each rank's last "
            f"lines, and `vitctl cancel {record.job_id}` stops the job")


def _format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return ""
    seconds = int(seconds)
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def collect(records: list[JobRecord]) -> list[JobStatus]:
    slurm = slurm_states([r.job_id for r in records if r.executor == "slurm" and r.job_id])
    later = _next_submission(load_records())
    statuses = []
    for r in records:
        state = state_of(r, slurm)
        unit = f"{r.gpus_per_node} GPU" if r.gpus_per_node else f"{r.tasks_per_node} CPU"
        done = progress(r, later.get((_folder(r.run_dir), r.submitted)))
        logged_at = done.pop("logged_at")
        if state.state != "RUNNING":  # a waiting job's last rate says nothing about when it will end
            done["eta_s"] = None
        elif done["eta_s"] is not None and isinstance(logged_at, (int, float)):  # counts down between records
            done["eta_s"] = max(done["eta_s"] - max(time.time() - logged_at, 0.0), 0.0)
        parallel, quiet, unsaved = done.pop("parallel"), done.pop("quiet"), done.pop("unsaved")
        layout = f"{r.nodes}x{unit}" + (f" {parallel}" if parallel and parallel != "1 rank" else "")
        requeued_now = state.state == "PENDING" and state.note.startswith("requeued")  # not yet resumed
        if RESUME_HINT in state.note and (next_job := _later_job(r)):  # advice taken already
            state = replace(state, note=state.note.replace(RESUME_HINT, f"; job {next_job.job_id} was started in its "
                                                                        "run folder since"))
        note = "; ".join(filter(None, [state.note, _unsaved_note(unsaved, requeued_now),
                                       quiet if state.state == "RUNNING" else "", _time_limit_note(r, state, done),
                                       run_dir_gone(r)]))
        statuses.append(JobStatus(r.job_id, r.name, r.executor, state.state, layout,
                                  _format_seconds(state.elapsed_s), **done, run_dir=r.run_dir, note=note))
    return statuses


def _time_limit_note(record: JobRecord, state: JobState, done: dict[str, Any]) -> str:
    """For a running Slurm job that will not end before this attempt's time limit: that it will be requeued, or, where
    the requeues it has left (--max-requeues) do not give it the time its rate needs, about where it will stop."""
    eta, left, limit = done["eta_s"], state.time_left_s, state.time_limit_s
    if eta is None or left is None or limit is None or record.max_requeues is None:
        return ""
    left = max(left - slurm_time.SIGNAL_LEAD_S, 0)  # the ranks stop on the signal before the limit
    if eta <= left:
        return ""
    requeues = _timeouts_left(record)
    if requeues is None:  # its job pickle unread: every requeue counted, pre-emptions too
        requeues = max(record.max_requeues - state.requeued, 0)
    room = left + requeues * max(limit - slurm_time.SIGNAL_LEAD_S, 0)
    left_over = f"{requeues or 'no'} requeue{'s' if requeues > 1 else ''} left"
    if eta <= room:
        return (f"its time limit stops this attempt in about {_format_seconds(left)}, before it is done: it "
                f"checkpoints and is requeued then ({left_over})")
    step, total = done["step"], done["total_steps"]
    last = step + int(room / (eta / (total - step)))
    return (f"at this rate it needs {_format_seconds(eta)} more, and its time limit with {left_over} (--max-requeues) "
            f"gives it about {_format_seconds(room)}: it will stop unfinished near step {last} of {total}; then the "
            "same command with --resume goes on from its last checkpoint (give it a longer --time or a higher "
            "--max-requeues)")


class _FieldsOnly(pickle.Unpickler):
    """Reads a pickle's objects as bare attribute holders: no module of theirs is imported (the job's would bring
    torch into `vitctl status`), and no code of theirs runs."""

    class Fields:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __setstate__(self, state: Any) -> None:
            if isinstance(state, tuple):  # (dict, slots)
                state = state[0]
            if isinstance(state, dict):
                self.__dict__.update(state)

    def find_class(self, module: str, name: str) -> type:
        return self.Fields


def _timeouts_left(record: JobRecord) -> int | None:
    """The time-limit requeues submitit has left for the job (the countdown its job pickle holds, lowered at each
    time limit but not by a pre-emption or `scontrol requeue`, as --max-requeues counts); None where unread."""
    try:
        with open(Path(record.folder) / f"{record.job_id}_submitted.pkl", "rb") as f:
            left = getattr(_FieldsOnly(f).load(), "_timeout_countdown", None)
    except Exception:  # none, damaged, or another pickle than submitit's: whatever unpickling its bytes raises
        return None
    return left if isinstance(left, int) and not isinstance(left, bool) else None


def _next_submission(records: Sequence[JobRecord]) -> dict[tuple[str, float], float]:
    """For each job, by (run folder, submission time), when the next job into the same run folder was submitted."""
    by_folder: dict[str, list[float]] = {}
    for r in records:
        by_folder.setdefault(_folder(r.run_dir), []).append(r.submitted)
    return {(folder, at): after for folder, times in by_folder.items()
            for at, after in zip(sorted(times), sorted(times)[1:], strict=False)}


@functools.lru_cache(maxsize=4096)  # a status of hundreds of jobs compares each one's folder with every other's
def _folder(run_dir: str) -> str:
    """One name per folder (not `..` or a link), to tell the jobs of one run folder."""
    return str(Path(run_dir).resolve())


def run_dir_gone(record: JobRecord) -> str:
    """Why a job shows no progress when its run folder is gone (else its row looks like a job that never started)."""
    if Path(record.run_dir).is_dir():
        return ""
    return (f"its run folder {record.run_dir} no longer exists (moved or deleted): its progress, checkpoints and logs "
            "went with it; if you moved it, `vitctl status NEW_PLACE` records where")


def log_paths(record: JobRecord, rank: int) -> tuple[Path, Path]:
    """(stdout, stderr) of one task, as submitit names them."""
    if not 0 <= rank < record.ranks:
        ranks = "its one rank is 0" if record.ranks == 1 else f"its ranks are 0-{record.ranks - 1}"
        raise UnknownJobError(f"job {record.job_id} has no rank {rank}: {ranks} ({count(record.nodes, 'node')} x "
                              f"{count(record.tasks_per_node, 'task')})")
    stem = Path(record.folder) / f"{record.job_id}_{rank}_log"
    return stem.with_suffix(".out"), stem.with_suffix(".err")


class LogTail:
    """Some logs followed together (a task's stdout and stderr): the lines added since the last read, merged in
    time order by the timestamp logging starts them with (the trainer's and submitit's records). A line without
    one (a traceback, a print) keeps its place after the line before it."""

    def __init__(self, paths: list[Path]) -> None:
        self.offsets = dict.fromkeys(paths, 0)
        self.times = dict.fromkeys(paths, "")

    def read(self, final: bool = False) -> str:
        """The new whole lines; with `final`, also a last line still without its newline."""
        streams = []
        for path, offset in self.offsets.items():
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            if not final:
                data = data[:data.rfind(b"\n") + 1]  # a line being written waits for the next read
            self.offsets[path] = offset + len(data)
            streams.append([(self._time(path, line), line) for line in data.decode(errors="replace").splitlines()])
        return "".join(f"{line}\n" for _, line in heapq.merge(*streams, key=lambda timed: timed[0]))

    def _time(self, path: Path, line: str) -> str:
        stamp = TIMESTAMP.search(line[:40])
        if stamp:
            self.times[path] = stamp[0]
        return self.times[path]


def cancel(record: JobRecord) -> tuple[JobState, bool]:
    """Ask a job to stop (its ranks checkpoint first): scancel, or SIGTERM to the local controller, which passes it
    to the ranks. The state it was in, and whether it was asked (a job that has already ended is left alone)."""
    current = state_of(record)
    if record.executor == "slurm" and record.job_id:
        if current.finished:
            return current, False
        if current.unreachable:
            raise LaunchError(f"cannot cancel job {record.job_id}: {current.note}")
        if current.state == "UNKNOWN":  # scancel would say nothing and succeed
            raise LaunchError(f"Slurm knows no job {record.job_id} (neither squeue nor sacct lists it), so there is "
                              "nothing to cancel; `squeue -u $USER` lists your jobs in the queue")
        update_record(record.key, cancelled=True)  # first: whoever sees it end then knows why
        try:
            _cancel_slurm_job(record, current)
        except LaunchError:  # not asked after all: the next cancel is a first one again
            update_record(record.key, cancelled=False)
            with contextlib.suppress(OSError):
                cancel_marker(record.folder, record.job_id).unlink(missing_ok=True)
            raise
        return current, True
    if (away := elsewhere(record)) and current.state == "UNKNOWN":
        raise LaunchError(f"cannot cancel job {record.job_id}: it is a local job that runs {away}, whose processes "
                          f"this machine cannot signal; run `vitctl cancel {record.job_id}` there")
    if away or not record.job_id or not is_running(int(record.job_id), record.started):
        return current, False  # ended; its PID may belong to another process by now
    update_record(record.key, cancelled=True)  # first: whoever sees it end then knows why
    os.kill(int(record.job_id), signal.SIGTERM)
    return current, True


def _cancel_slurm_job(record: JobRecord, current: JobState) -> None:
    # A cancelled job's ranks get SIGKILL KillWait seconds after its SIGTERM, maybe before their checkpoint is
    # written: the ranks are signalled instead, and the job ends once they have checkpointed.
    if current.state == "RUNNING" and _ranks_started(record.job_id):
        with contextlib.suppress(OSError):  # a folder this machine cannot write: the signal still goes out
            cancel_marker(record.folder, record.job_id).touch()
        _scancel(record.job_id, "--signal=TERM")  # to its steps, not the job: Slurm does not cancel it
    else:
        _scancel(record.job_id)


ENDING = ("its ranks are ending: Slurm kills those that have not stopped within its KillWait; a rank that checkpoints "
          "first keeps its checkpoint")


def wait_until_ended(record: JobRecord, timeout_s: float) -> JobState:
    """The job's state once it has ended, or after `timeout_s` (whatever it is then)."""
    deadline = time.monotonic() + timeout_s
    while not (state := state_of(reload(record))).finished and time.monotonic() < deadline:
        time.sleep(1)
    return state


def cancel_marker(folder: str | Path, job_id: str) -> Path:
    """What `vitctl cancel` leaves in a Slurm job's folder: a rank that starts while (or after) its ranks are
    signalled, when it could not yet take the signal, stops as if it had."""
    return Path(folder) / f"{job_id}.cancel"


def killed_note(record: JobRecord) -> str:
    return f"killed by a second `vitctl cancel`: {what_a_kill_lost(record)}"


def what_a_kill_lost(record: JobRecord) -> str:
    """What ending a job at once cost, from the checkpoints its run held then, and where --resume goes on from (where
    no later job has gone on in its run folder)."""
    found, later = _checkpoints_of_its_time(record)
    if found and later:
        return f"the steps since its last checkpoint ({found[-1].name}) were lost"
    if found:
        return (f"the steps since its last checkpoint are lost, and --resume goes on from that checkpoint "
                f"({found[-1].name})")
    if later:
        return "its run had saved no checkpoint, so nothing of it was kept"
    return "its run had saved no checkpoint, so nothing of it was kept: run the same command again to start afresh"


def _checkpoints_of_its_time(record: JobRecord) -> tuple[list[Path], bool]:
    """The checkpoints the job's run folder held before the next job into it was submitted, and whether one was."""
    later = _next_submission(snapshot()).get((_folder(record.run_dir), record.submitted))
    return [c for c in list_checkpoints(Path(record.run_dir)) if later is None or c.stat().st_mtime < later], \
        later is not None


def stopped_at(record: JobRecord) -> int | None:
    """The step at which the job's ranks checkpointed and stopped on a signal (a cancel), where that is the last
    thing its run logged (not an earlier attempt's stop that a requeue went on from); None if they have not."""
    logged = [m for m in read_metrics(Path(record.run_dir)) if m.get("time", 0) >= record.submitted]
    return logged[-1].get("step") if logged and logged[-1].get("event") == "stopped" else None


def kill(record: JobRecord) -> bool:
    """End a job that a cancel did not stop (a hung rank holds the others' stop in a collective): SIGKILL a local
    job's ranks and controller, scancel a Slurm job. Whether it was running."""
    if record.executor == "slurm" and record.job_id:
        if state_of(record).finished:
            return False
        update_record(record.key, killed=True)
        _scancel(record.job_id)
        return True
    if elsewhere(record) or not record.job_id or not is_running(int(record.job_id), record.started):
        return False
    update_record(record.key, killed=True)  # first: whoever sees it end then knows why
    for pid in [*children(int(record.job_id)), int(record.job_id)]:
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(pid, signal.SIGKILL)
    return True


def slurm_command(args: list[str], fix: str) -> subprocess.CompletedProcess[str]:
    """Run a Slurm client command; LaunchError, ending with `fix`, when it is missing or slurmctld does not answer."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{args[0]} did not answer within {SLURM_TIMEOUT_S} s: slurmctld is down or overloaded; "
                          f"check `scontrol ping`, then {fix}") from None
    except OSError as e:
        raise LaunchError(f"cannot run {args[0]} ({e.strerror}): install the Slurm client commands, or {fix}") from None


def _ranks_started(job_id: str) -> bool:
    """Whether the job's srun step (its ranks) has started: before, the batch script alone runs."""
    listed = slurm_command(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"],
                           f"run `vitctl cancel {job_id}` again (from a machine with Slurm)")
    if listed.returncode:  # not "no step": a plain scancel would kill running ranks before their checkpoint
        said = listed.stderr.strip() or f"exit status {listed.returncode}"
        raise LaunchError(f"cannot cancel job {job_id}: squeue failed ({said}), so whether its ranks run, and need "
                          f"the signal that lets them checkpoint, is unknown; check `scontrol ping`, then run "
                          f"`vitctl cancel {job_id}` again")
    return any(re.fullmatch(rf"{re.escape(job_id)}\.\d+", step) for step in listed.stdout.split())


def _scancel(job_id: str, *options: str) -> None:
    command = ["scancel", *options, job_id]
    done = slurm_command(command, f"run `vitctl cancel {job_id}` again (from a machine with Slurm)")
    if done.returncode:
        said = done.stderr.strip() or f"exit status {done.returncode}"
        check = (f"slurmctld does not answer: check `scontrol ping`, then run `vitctl cancel {job_id}` again"
                 if "Unable to contact slurm controller" in said else
                 f"`squeue -j {job_id}` shows whether it still waits or runs")
        raise LaunchError(f"{' '.join(command)} failed: {said}; {check}")
