"""The local registry of submitted jobs ($VITCTL_HOME/jobs.json, default ~/.vitctl), so that `vitctl status`, `logs`
and `cancel` can find them.

Writers hold an exclusive lock (flock on jobs.lock) while they read, change and write; every write goes to a unique
temporary name, is fsynced, renamed into place and its folder fsynced, and is repeated into jobs.json.bak. A damaged
jobs.json is moved aside and rebuilt from that backup and from sacct, and the recovery is reported.
"""

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import re
import subprocess
import tempfile
import time
import types
import typing
import uuid
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from vitctl.datasets.atomic import fsync_dir
from vitctl.datasets.oserrors import file_in_the_way, what_it_is
from vitctl.trainer import runlock

from .errors import LaunchError
from .process import is_running, start_time, started_at

log = logging.getLogger("vitctl.registry")
SACCT_DAYS = 30  # how far back a recovery looks for Slurm jobs


class UnknownJobError(LookupError):
    """No job in the registry matches."""


@dataclass
class JobRecord:
    job_id: str  # "" while the submission is under way
    executor: str  # slurm | local
    name: str
    run_dir: str
    folder: str  # submitit's folder: job pickles and per-task logs
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    submitted: float  # unix time
    cancelled: bool = False  # `vitctl cancel` asked its ranks to stop
    command: list[str] = field(default_factory=list)
    started: int | None = None  # local jobs: their controller's (PID = job_id) start time, see process.start_time
    submitter: list[int] | None = None  # while job_id is "": [PID, start time] of the vitctl submitting it
    host: str | None = None  # local jobs: the host and PID namespace their PIDs are in (process.pid_space)
    pid_namespace: str | None = None
    killed: bool = False  # a second cancel killed its processes (the first had not stopped them)
    max_requeues: int | None = None  # Slurm jobs: how often a time limit may requeue them (--max-requeues)
    submitted_run_dir: str | None = None  # once moved: the run folder that submitit's job pickle names
    key: str = field(default_factory=lambda: uuid.uuid4().hex)  # the registry's own id

    @property
    def ranks(self) -> int:
        return self.nodes * self.tasks_per_node


def home() -> Path:
    """$VITCTL_HOME; where it is unset or empty (an unset shell variable), ~/.vitctl rather than the current folder."""
    return Path(os.environ.get("VITCTL_HOME") or Path.home() / ".vitctl")


def registry_path() -> Path:
    return home() / "jobs.json"


def backup_path() -> Path:
    return home() / "jobs.json.bak"


def load_records() -> list[JobRecord]:
    """All records, oldest first. Reads need no lock (writes are atomic); a damaged file or a submission that was
    cut short is mended under the lock."""
    try:
        text = _read_registry()
        if text is None:
            return []
        records = _parse(text)
    except ValueError:  # UnicodeDecodeError too
        pass  # damaged: recovered under the lock, below
    else:
        if not any(_interrupted(r) for r in records):
            return records
    with editing() as records:
        return list(records)


def snapshot() -> tuple[JobRecord, ...]:
    """The records, read again only once the registry has changed: for reading (`vitctl status` of hundreds of jobs
    looks up each one's successor in its run folder)."""
    try:
        stat = registry_path().stat()
        version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)  # writes replace the file: a new inode
    except OSError:  # none yet, or unreadable: load_records says why
        version = None
    return _records_of(home(), version)


@functools.lru_cache(maxsize=1)
def _records_of(home: Path, version: tuple[int, int, int] | None) -> tuple[JobRecord, ...]:
    return tuple(load_records())


@contextlib.contextmanager
def editing() -> Iterator[list[JobRecord]]:
    """The records, under the registry's lock; written back if the block changed them (not if it raised)."""
    with _locked():
        records = _read_or_recover()
        _settle_interrupted(records)
        before = [asdict(r) for r in records]
        yield records
        if [asdict(r) for r in records] != before:
            _save(records)


def add_record(record: JobRecord) -> None:
    with editing() as records:
        records.append(record)


def update_record(key: str, **changes: object) -> JobRecord:
    with editing() as records:
        record = next(r for r in records if r.key == key)
        for name, value in changes.items():
            setattr(record, name, value)
        return record


def remove_records(keys: Collection[str]) -> None:
    with editing() as records:
        records[:] = [r for r in records if r.key not in keys]


def reload(record: JobRecord) -> JobRecord:
    """The record as the registry holds it now (another vitctl may have changed it)."""
    return next((r for r in load_records() if r.key == record.key), record)


def find_records(key: str) -> list[JobRecord]:
    """The jobs `key` names, the newest per run folder: a job id; a run folder given as a path (it holds a `/` or is
    a folder here), matched exactly; else a run folder's last component, or else a job's name (`vitctl jobs` shows
    them), which folders in several places may share."""
    if not key.strip():  # an unset shell variable
        raise UnknownJobError("the job is empty; give a job id or a run folder (`vitctl jobs` lists them)")
    records, where = load_records(), repr(key)
    if key and os.sep not in key and (by_id := [r for r in records if r.job_id == key]):
        # a local job's id is its PID: reused only once that job has ended, so the newest is the one meant; but a
        # Slurm job's id may equal one, and then neither is
        return list({r.run_dir: r for r in by_id}.values()) if len({r.executor for r in by_id}) > 1 else by_id[-1:]
    hint = "`vitctl jobs` lists the known ones"
    matches = []
    if os.sep in key or (key and Path(key).is_dir()):
        folder = Path(key).resolve()
        matches, where = [r for r in records if Path(r.run_dir).resolve() == folder], f"{key!r} ({folder})"
        matches = matches or _moved_to(folder, records)
        hint = _nearby_runs(folder, records) or hint
    if os.sep not in key and not matches:  # also a folder here that is no run folder: the name of one elsewhere
        matches = ([r for r in records if Path(r.run_dir).name == key] or
                   [r for r in records if r.name == key])
    if not matches:
        raise UnknownJobError(f"no job {where} in {registry_path()}; {hint}{_submitted_otherwise(key)}")
    return list({r.run_dir: r for r in matches}.values())  # a folder's later jobs replace its earlier ones


def _submitted_otherwise(key: str) -> str:
    """Where a job `key` names may be one the list does not hold (submitted by sbatch, or forgotten): how to reach
    it."""
    if key.isdigit():
        return f"; a job not in the list {_elsewhere([key], 'its run folder')}"
    folder = Path(key)
    if not any((folder / name).exists() for name in ("metrics.jsonl", "checkpoints", "job.lock")):
        return ""
    by_hand = sorted(p.name[4:-5] for p in folder.glob("job-*.yaml"))  # the configs a --dry-run script writes
    last = {} if by_hand else runlock.last_holder(folder)
    if last.get("executor") == "local":  # its id is a process id, which Slurm's commands would take for a job's
        return (f"; {key} holds a run none of whose jobs is in the list: local job {last.get('job')} (on "
                f"{last.get('host')}) trained there last, and was forgotten (`vitctl forget`) or started under another "
                f"VITCTL_HOME; its logs stay in {key}/submitit")
    ids = by_hand or ([str(last["job"])] if last.get("job") else ["JOB"])
    return f"; {key} holds a run none of whose jobs is in the list, which {_elsewhere(ids, key)}"


def _elsewhere(ids: list[str], run_dir: str) -> str:
    slurm = ", ".join(f"`{tool} {job_id}`" for job_id in ids for tool in ("squeue -j", "sacct -j", "scancel"))
    return (f"was submitted by sbatch (a `--dry-run` script, slurm/*.sbatch: {slurm} reach it, and its log is the file "
            f"sbatch's --output names) or forgotten (`vitctl forget`: its logs stay in {run_dir}/submitit)")


def _nearby_runs(folder: Path, records: list[JobRecord]) -> str | None:
    """The run folder `folder` lies in (a checkpoint, its logs), or the run folders it holds, as advice; or None."""
    runs = {Path(r.run_dir).resolve(): r for r in records if r.job_id}  # a folder's latest job last
    if outer := next((run for run in runs if run in folder.parents), None):
        return f"it lies in the run folder {outer} (job {runs[outer].job_id}): give that folder, or the job id"
    inner = sorted(run for run in runs if folder in run.parents)
    if inner:
        shown = ", ".join(f"{run} (job {runs[run].job_id})" for run in inner[:5])
        more = f" and {len(inner) - 5} more" if len(inner) > 5 else ""
        return f"it holds the run folders {shown}{more}: give one of them, or its job id"
    return None


def _moved_to(folder: Path, records: list[JobRecord]) -> list[JobRecord]:
    """The jobs whose run folder was moved to `folder`, with their new place recorded (and logged)."""
    moved = []
    for r in records:
        if r.job_id and not Path(r.run_dir).exists() and (logs := _moved_submitit_folder(folder, r)):
            log.warning("note: job %s's run folder %s was moved to %s; recorded its new place", r.job_id, r.run_dir,
                        folder)
            pickled = r.submitted_run_dir or r.run_dir
            update_record(r.key, run_dir=str(folder), folder=str(logs), submitted_run_dir=pickled)
            r.run_dir, r.folder, r.submitted_run_dir = str(folder), str(logs), pickled
            moved.append(r)
    return moved


def _moved_submitit_folder(folder: Path, record: JobRecord) -> Path | None:
    """`record`'s submitit folder at its place under `folder`, where it holds the job pickle submitit wrote: its name
    has the job id, its bytes the run folder's path at submission (a job id alone, a PID for local jobs, may be
    another's)."""
    try:
        logs = folder / Path(record.folder).relative_to(record.run_dir)
        pickled = (record.submitted_run_dir or record.run_dir).encode()
        return logs if pickled in (logs / f"{record.job_id}_submitted.pkl").read_bytes() else None
    except (ValueError, OSError):  # a submitit folder outside the run folder; no such pickle there
        return None


def find_record(key: str) -> JobRecord:
    """The one job `key` names (see find_records); UnknownJobError listing them when a bare folder name names run
    folders in several places."""
    found = find_records(key)
    if len(found) > 1 and all(r.job_id == key for r in found):
        listed = ", ".join(f"{r.executor} ({r.run_dir})" for r in found)
        raise UnknownJobError(f"job {key} names {len(found)} jobs (a local job's id is its process id, which a Slurm "
                              f"job's id may equal): {listed}; pass the full path of the run folder instead")
    if len(found) > 1:
        listed = ", ".join(f"{r.job_id or '(submitting)'} ({r.run_dir})" for r in found)
        raise UnknownJobError(f"{key!r} names the run folders of {len(found)} jobs in different places: {listed}; "
                              f"pass the job id or the full path of the run folder")
    return found[0]


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with contextlib.ExitStack() as held:
        with _home_errors():  # only the lock's own calls: the caller's block may touch other folders
            home().mkdir(parents=True, exist_ok=True)
            lock = held.enter_context(open(home() / "jobs.lock", "a"))
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when this process dies
        yield


@contextlib.contextmanager
def _home_errors() -> Iterator[None]:
    """The file system's refusals in the registry's folder as one error that names it and how to move it."""
    try:
        yield
    except OSError as e:
        folder = home()
        what = f"{e.strerror} ({e.filename})" if e.filename else e.strerror
        if blocker := file_in_the_way(folder):
            what = f"{what_it_is(blocker)}, not a folder"
        where = f"VITCTL_HOME={folder}" if os.environ.get("VITCTL_HOME") else f"{folder} (VITCTL_HOME is not set)"
        fix = "point VITCTL_HOME at a folder this user can write, e.g. `export VITCTL_HOME=$HOME/.vitctl`"
        if e.errno in (errno.ENOSPC, errno.EDQUOT):  # the folder is writable: its file system is full
            fix = (f"free space on the file system of {folder} (or raise your quota there), or point VITCTL_HOME "
                   "at a folder on another one")
        raise LaunchError(f"cannot keep the job registry in {where}: {what}; {fix}") from None


def _read_registry() -> str | None:
    """jobs.json's text; None before the first job."""
    with _home_errors():
        try:
            return registry_path().read_text()
        except FileNotFoundError:
            return None


def _parse(text: str) -> list[JobRecord]:
    """Records from the file's text; ValueError if it is not a list of complete records."""
    rows = json.loads(text)
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError("not a list of job records")
    hints = typing.get_type_hints(JobRecord)
    kinds = {f.name: _types(hints[f.name]) for f in fields(JobRecord)}
    for row in rows:  # a hand-edited field of another type surfaced later as a traceback in status or logs
        if wrong := next((k for k, v in row.items() if k in kinds and not isinstance(v, kinds[k])), None):
            hint = hints[wrong]
            raise ValueError(f"a record's {wrong} is {row[wrong]!r}, not {getattr(hint, '__name__', hint)}")
    try:
        return [JobRecord(**{k: v for k, v in r.items() if k in kinds}) for r in rows]
    except TypeError as e:
        raise ValueError(f"a record lacks a field ({e})") from None


def _types(hint: object) -> tuple[type, ...]:
    """What isinstance takes for a field's type: int | None -> (int, NoneType), list[str] -> list, float -> a number."""
    if isinstance(hint, types.UnionType):
        return sum((_types(arg) for arg in typing.get_args(hint)), ())
    base = typing.get_origin(hint) or hint
    return (int, float) if base is float else (base,)


def _write_atomic(path: Path, text: str) -> None:
    """Unique temporary name (writers never share one), fsync, rename, fsync of the folder."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _save(records: list[JobRecord]) -> None:
    text = json.dumps([asdict(r) for r in records], indent=1) + "\n"
    with _home_errors():
        _write_atomic(registry_path(), text)
        _write_atomic(backup_path(), text)


def _read_or_recover() -> list[JobRecord]:
    try:
        text = _read_registry()
        return [] if text is None else _parse(text)
    except (ValueError, UnicodeDecodeError) as e:
        damage = str(e)
    aside = registry_path().with_name(f"jobs.json.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(registry_path(), aside)
    fsync_dir(aside.parent)
    try:
        records = _parse(backup_path().read_text())
        source = f"{len(records)} jobs from {backup_path()}"
    except (OSError, ValueError, UnicodeDecodeError):
        records, source = [], f"no jobs from {backup_path()} (missing or damaged too)"
    known = {r.job_id for r in records}
    found, unanswered = _slurm_records()
    from_slurm = [r for r in found if r.job_id not in known]
    records = sorted(records + from_slurm, key=lambda r: r.submitted)
    _save(records)
    slurm = (f"no Slurm jobs: sacct could not be asked ({unanswered}), so jobs submitted to Slurm from here in the "
             f"last {SACCT_DAYS} days are not listed" if unanswered else
             f"{len(from_slurm)} Slurm jobs from sacct (last {SACCT_DAYS} days)")
    log.warning("warning: %s was damaged (%s); moved it aside to %s and recovered %s and %s", registry_path(), damage,
                aside.name, source, slurm)
    return records


# submitit submits `sbatch FOLDER/.submission_file_<hex>.sh`, FOLDER being <run folder>/submitit.
SUBMIT_LINE = re.compile(r"sbatch (?P<folder>/\S+/submitit)/\.submission_file_[0-9a-f]+\.sh")


def _slurm_records(folder: str | None = None, since: float | None = None) -> tuple[list[JobRecord], str | None]:
    """The Slurm jobs vitctl submitted (all of this user's in the last SACCT_DAYS, or those from `folder`), as
    sacct knows them; and why sacct did not answer, if it did not."""
    records, seen = [], set()
    lines, unanswered = _sacct_lines(since or time.time() - SACCT_DAYS * 86400)
    for line in lines:
        job_id, name, nodes, submit, submit_line = line.split("|", 4)
        match = SUBMIT_LINE.fullmatch(submit_line.strip())
        if job_id in seen or not match or (folder and match["folder"] != folder) or not Path(match["folder"]).is_dir():
            continue  # listed twice, not vitctl's, not the one asked for, or its run folder is gone
        seen.add(job_id)
        tasks, gpus = _sbatch_layout(Path(match["folder"]) / f"{job_id}_submission.sh")
        records.append(JobRecord(job_id, "slurm", name, str(Path(match["folder"]).parent), match["folder"],
                                 int(nodes), tasks, gpus, time.mktime(time.strptime(submit, "%Y-%m-%dT%H:%M:%S"))))
    return records, unanswered


def _sacct_lines(since: float) -> tuple[list[str], str | None]:
    """sacct's lines for this user's jobs since `since` and for those still queued, which sacct leaves out of a time
    window until they are eligible to start (held, waiting on a dependency, or just submitted); and why sacct did
    not answer, if it did not."""
    user, fields = str(os.getuid()), ["-o", "JobIDRaw,JobName,NNodes,Submit,SubmitLine"]
    start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since))
    out, unanswered = _quiet(["sacct", "-X", "-n", "-P", "-u", user, "-S", start, *fields])
    lines = out.splitlines()
    if queued := _quiet(["squeue", "-h", "-u", user, "-o", "%i"])[0].split():
        lines += _quiet(["sacct", "-X", "-n", "-P", "-j", ",".join(queued), *fields])[0].splitlines()
    return lines, unanswered


def _quiet(command: list[str]) -> tuple[str, str | None]:
    """The command's output, and why it failed if it did ("" where it is missing or hangs: no Slurm here, or its
    daemons down)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return "", f"{command[0]} is not installed here"
    except (OSError, subprocess.TimeoutExpired) as e:
        return "", f"{command[0]}: {e}"
    said = next(iter(done.stderr.strip().splitlines()[-1:]), f"exit status {done.returncode}")
    said = said if said.startswith(f"{command[0]}:") else f"{command[0]}: {said}"
    return done.stdout, said if done.returncode else None


def _sbatch_layout(script: Path) -> tuple[int, int]:
    """(tasks per node, GPUs per node) from the #SBATCH lines of the script submitit kept; (1, 0) without it."""
    text = script.read_text() if script.is_file() else ""
    tasks = re.search(r"^#SBATCH --ntasks-per-node=(\d+)", text, re.M)
    gpus = re.search(r"^#SBATCH --gpus-per-node=(\d+)", text, re.M)
    return int(tasks[1]) if tasks else 1, int(gpus[1]) if gpus else 0


def _interrupted(record: JobRecord) -> bool:
    """A submission whose vitctl ended before it recorded the job id."""
    return not record.job_id and record.submitter is not None and not is_running(*record.submitter)


def _settle_interrupted(records: list[JobRecord]) -> None:
    """Find the job ids of interrupted submissions: the job pickle submitit wrote into the folder, else sacct."""
    known = {r.job_id for r in records}
    for record in filter(_interrupted, records):
        folder = Path(record.folder)
        pickles = sorted(folder.glob("*_submitted.pkl"), key=lambda p: p.stat().st_mtime) if folder.is_dir() else []
        found = [p.name.removesuffix("_submitted.pkl") for p in pickles if p.stat().st_mtime >= record.submitted - 1]
        if record.executor == "slurm":
            found += [r.job_id for r in _slurm_records(record.folder, since=record.submitted - 60)[0]]
        found = [job_id for job_id in found if job_id not in known]
        record.submitter = None  # settled: found, or never submitted
        if found:
            record.job_id = found[0]
            known.add(found[0])
        if found and record.executor == "local":  # the controller, if the running process is the one started then
            ticks = start_time(int(record.job_id))
            record.started = ticks if ticks and started_at(ticks) >= record.submitted - 1 else None
