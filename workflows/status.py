"""What a submitted job is doing: its state (sacct, else squeue; local jobs: their processes and result files)
and its progress from the rank-0 metrics file."""

import contextlib
import os
import pickle
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vitctl.trainer.checkpoint import list_checkpoints
from vitctl.trainer.metrics import read_metrics

from .registry import JobRecord, load_records, save_records

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}
RATE_HISTORY = 24


@dataclass
class JobStatus:
    job_id: str
    name: str
    executor: str
    state: str
    layout: str  # nodes x GPUs (or CPU tasks)
    elapsed: str
    step: int | None
    total_steps: int | None
    loss: float | None
    images_per_s: list[float]
    eta_s: float | None
    last_checkpoint: str | None
    restarts: int
    run_dir: str

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _run(args: list[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def slurm_states(ids: list[str]) -> dict[str, tuple[str, str]]:
    """job id -> (state, elapsed): sacct (accounting), then squeue for what sacct does not know."""
    if not ids:
        return {}
    states = {}
    for line in _run(["sacct", "-n", "-P", "-X", "-j", ",".join(ids), "-o", "JobIDRaw,State,Elapsed"]).splitlines():
        job_id, state, elapsed = line.split("|")
        states[job_id] = (state.split()[0], elapsed)  # "CANCELLED by 0" -> CANCELLED
    missing = [i for i in ids if i not in states]
    if missing:
        for line in _run(["squeue", "-h", "-j", ",".join(missing), "-o", "%i|%T|%M"]).splitlines():
            job_id, state, elapsed = line.split("|")
            states[job_id] = (state, elapsed)
    return states


def _format_seconds(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def local_state(record: JobRecord) -> tuple[str, str]:
    result = Path(record.folder) / f"{record.job_id}_0_result.pkl"
    if result.exists():
        with open(result, "rb") as f:
            outcome = pickle.load(f)[0]
        return ("COMPLETED" if outcome == "success" else "FAILED"), _format_seconds(result.stat().st_mtime -
                                                                                     record.submitted)
    if record.cancelled:
        return "CANCELLED", ""
    if not Path(record.folder).is_dir():
        return "UNKNOWN", ""  # its run folder was deleted
    try:
        os.kill(int(record.job_id), 0)
    except (ProcessLookupError, ValueError):
        return "FAILED", ""  # gone without writing a result
    return "RUNNING", _format_seconds(time.time() - record.submitted)


def progress(record: JobRecord) -> dict[str, Any]:
    metrics = read_metrics(Path(record.run_dir))
    steps = [m for m in metrics if "loss" in m]
    last = steps[-1] if steps else {}
    eta = None
    if last and last.get("total_steps") and last["step"] < last["total_steps"]:
        eta = (last["total_steps"] - last["step"]) * last["step_time_s"]
    checkpoints = list_checkpoints(Path(record.run_dir))
    return {"step": last.get("step"), "total_steps": last.get("total_steps"), "loss": last.get("loss"),
            "images_per_s": [m["images_per_s"] for m in steps[-RATE_HISTORY:]], "eta_s": eta,
            "last_checkpoint": checkpoints[-1].name if checkpoints else None,
            "restarts": sum(1 for m in metrics if m.get("event") == "resume")}


def collect(records: list[JobRecord]) -> list[JobStatus]:
    slurm = slurm_states([r.job_id for r in records if r.executor == "slurm"])
    statuses = []
    for r in records:
        state, elapsed = slurm.get(r.job_id, ("UNKNOWN", "")) if r.executor == "slurm" else local_state(r)
        unit = f"{r.gpus_per_node} GPU" if r.gpus_per_node else f"{r.tasks_per_node} CPU"
        statuses.append(JobStatus(r.job_id, r.name, r.executor, state, f"{r.nodes}x{unit}", elapsed, **progress(r),
                                  run_dir=r.run_dir))
    return statuses


def log_paths(record: JobRecord, rank: int) -> tuple[Path, Path]:
    """(stdout, stderr) of one task, as submitit names them."""
    stem = Path(record.folder) / f"{record.job_id}_{rank}_log"
    return stem.with_suffix(".out"), stem.with_suffix(".err")


def cancel(record: JobRecord) -> None:
    if record.executor == "slurm":
        subprocess.run(["scancel", record.job_id], check=True, timeout=30)
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(record.job_id), signal.SIGTERM)  # submitit's local controller forwards it to the tasks
    records = load_records()
    for r in records:
        if r.job_id == record.job_id and r.executor == "local":
            r.cancelled = True
    save_records(records)
