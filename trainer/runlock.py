"""The run folder's lock (`job.lock`), held by rank 0 while a job trains, so that a second job into the folder of a
running one (two writers of one checkpoint and one metrics.jsonl) is refused, however either was launched."""

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from .config import ConfigError

log = logging.getLogger("vitctl.runlock")
LOCK = "job.lock"
WAIT_S = 5.0  # a launch that checks the lock holds it for an instant; a job holds it until it ends
UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # e.g. Lustre mounted without flock


def describe(holder: dict[str, Any]) -> str:
    if not holder.get("pid"):
        return "a job that is starting"  # its lock was taken, its details not yet written
    since = time.strftime("%Y-%m-%d %H:%M", time.localtime(holder["since"]))
    job = f"job {holder['job']}" if holder.get("job") else "a job"
    return f"{job} (pid {holder['pid']} on {holder['host']}, since {since})"


def in_use(run_dir: Path, who: str, job: str | None, registered: bool | None = None) -> ConfigError:
    """`registered`: whether this machine's `vitctl cancel` knows the job (not one of plain sbatch, or of another
    machine's vitctl); None where that is not known (a rank)."""
    scancel = f"`scancel --signal=TERM {job}` has its ranks checkpoint, then stop"
    if not job:
        cancel = "cancel it"
    elif registered:
        cancel = f"cancel it (`vitctl cancel {job}`)"
    elif registered is None:
        cancel = f"cancel it (`vitctl cancel {job}` where it was launched; for a Slurm job vitctl did not launch, " \
                 f"{scancel})"
    else:
        cancel = f"stop it where it was launched: it is not among this machine's vitctl jobs (if Slurm runs it, " \
                 f"{scancel})"
    return ConfigError(f"run folder {run_dir} is in use by {who}; wait for it to end, {cancel}, or choose another "
                       "--out")


def holder(run_dir: Path) -> dict[str, Any] | None:
    """Who holds the run folder's lock now (job, pid, host, since), or None."""
    try:
        with open(run_dir / LOCK) as f:
            if _try_lock(f, fcntl.LOCK_SH):
                return None
            return _read(f)
    except OSError:  # no lock file (no job ran there), or a folder this user cannot read: nothing holds it
        return None


def last_holder(run_dir: Path) -> dict[str, Any]:
    """What the job that last held the run folder's lock wrote there (job, executor, pid, host, since), held now or
    not; {} where none did."""
    try:
        with open(run_dir / LOCK) as f:
            held = _read(f)
    except (OSError, ValueError):  # no lock file, one this user cannot read, or not text
        return {}
    return held if isinstance(held, dict) else {}


@contextlib.contextmanager
def holding(run_dir: Path) -> Iterator[None]:
    """Hold the run folder's lock for the block; ConfigError naming the holder if another job has it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LOCK, "a+") as f:
        deadline = time.monotonic() + WAIT_S
        while not _try_lock(f, fcntl.LOCK_EX):
            if time.monotonic() > deadline:
                other = _read(f)
                raise in_use(run_dir, describe(other), other.get("job"))
            time.sleep(0.2)
        f.truncate(0)
        slurm = os.environ.get("SLURM_JOB_ID")
        f.write(json.dumps({"job": slurm or os.environ.get("SUBMITIT_LOCAL_JOB_ID"),
                            "executor": "slurm" if slurm else "local", "pid": os.getpid(),
                            "host": socket.gethostname(), "since": time.time()}))
        f.flush()
        yield


def _try_lock(f: IO[str], kind: int) -> bool:
    try:
        fcntl.flock(f, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in UNSUPPORTED:
            raise
        log.warning("%s: this filesystem has no flock (%s); a second job into this run folder is not refused",
                    f.name, e.strerror)
    return True


def _read(f: IO[str]) -> dict[str, Any]:
    f.seek(0)
    try:
        return json.loads(f.read())
    except json.JSONDecodeError:
        return {}  # written at the very moment it was read
