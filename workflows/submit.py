"""Submit a training job with submitit: to Slurm (sbatch), or to this machine through its local executor.

The task each rank runs is checkpointable: on the USR2 that Slurm sends before the time limit (or on
pre-emption) every rank checkpoints at the next log step, then submitit requeues the job, and the requeued
job resumes from that checkpoint.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from vitctl.trainer import checkpoint
from vitctl.trainer.config import ConfigError

from .job import TrainJob
from .registry import JobRecord, add_record

SIGNAL_DELAY_S = 90


class LaunchError(RuntimeError):
    """A job could not be submitted, or a local job failed."""


@dataclass(frozen=True)
class LaunchRequest:
    executor: str  # slurm | local
    nodes: int = 1
    gpus_per_node: int = 0
    tasks_per_node: int = 1  # CPU ranks per node when gpus_per_node is 0
    partition: str | None = None
    time: str = "24:00:00"
    account: str | None = None
    qos: str | None = None
    cpus_per_gpu: int | None = None
    mem: str | None = None
    container_image: str | None = None
    container_mounts: str | None = None
    max_requeues: int = 3

    @property
    def tasks(self) -> int:
        return self.gpus_per_node or self.tasks_per_node


def default_executor() -> str:
    return "slurm" if shutil.which("sbatch") else "local"


def parse_time(text: str) -> int:
    """Slurm's time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) -> whole minutes, at least 1."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not match:
        raise ConfigError(f"--time {text!r} is not a Slurm time (e.g. 30, 4:00:00, 1-12:00:00)")
    days, first, second, third = (int(g) if g else 0 for g in match.groups())
    if match.group(1):  # D-HH[:MM[:SS]]
        seconds = days * 86400 + first * 3600 + second * 60 + third
    elif match.group(4):  # HH:MM:SS
        seconds = first * 3600 + second * 60 + third
    else:  # MM[:SS]
        seconds = first * 60 + second
    if seconds <= 0:
        raise ConfigError(f"--time {text!r} must be positive")
    return max(1, round(seconds / 60))


class SignalFlag:
    """Records a signal instead of acting on it at once; `forward` hands it to the handler it replaced."""

    def __init__(self, signum: int) -> None:
        self.signum, self.received = signum, False
        self.previous = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True

    def is_set(self) -> bool:
        return self.received

    def forward(self) -> None:
        if callable(self.previous):
            self.previous(self.signum, None)


class TrainTask(submitit.helpers.Checkpointable):
    """What every task of the job runs: torch.distributed variables from the job, then the trainer."""

    def __init__(self, job: TrainJob) -> None:
        self.job = job

    def __call__(self) -> dict[str, Any]:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        stop = SignalFlag(signal.SIGUSR2)  # submitit's handler would requeue before we could checkpoint
        result = self.job(should_stop=stop.is_set)
        if result.get("stopped"):
            stop.forward()  # rank 0: submitit calls checkpoint() below and requeues; the others just return
        return result

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        return submitit.helpers.DelayedSubmission(TrainTask(self.job))  # resumes from the run folder


def _sinfo_partitions() -> dict[str, dict[str, Any]]:
    out = subprocess.run(["sinfo", "-h", "-o", "%P|%D|%c|%G|%l"], capture_output=True, text=True, timeout=30)
    if out.returncode:
        raise LaunchError(f"sinfo failed: {out.stderr.strip()}")
    partitions = {}
    for line in out.stdout.split():
        name, nodes, cpus, gres, limit = line.split("|")
        gpus = re.search(r"gpu(?::[^:,()]+)?:(\d+)", gres)
        partitions[name.rstrip("*")] = {"default": name.endswith("*"), "nodes": int(nodes),
                                        "cpus": int(cpus.rstrip("+")), "gpus": int(gpus.group(1)) if gpus else 0,
                                        "limit": None if limit in ("infinite", "n/a") else parse_time(limit)}
    return partitions


def validate_slurm(request: LaunchRequest) -> str:
    """Check the request against the cluster before anything is submitted; returns the partition used."""
    if not shutil.which("sbatch"):
        raise ConfigError("--executor slurm: no sbatch on PATH (use --executor local to run on this machine)")
    partitions = _sinfo_partitions()
    name = request.partition or next((n for n, p in partitions.items() if p["default"]), None)
    if name not in partitions:
        raise ConfigError(f"--partition {name!r} does not exist; partitions: {', '.join(sorted(partitions))}")
    part, minutes = partitions[name], parse_time(request.time)
    problems = []
    if request.nodes > part["nodes"]:
        problems.append(f"--nodes {request.nodes} but partition {name} has {part['nodes']} nodes")
    if request.gpus_per_node > part["gpus"]:
        problems.append(f"--gpus {request.gpus_per_node} per node but partition {name}'s nodes have "
                        f"{part['gpus'] or 'no'} GPUs (use --gpus 0 --tasks-per-node K for CPU ranks)")
    cpus = request.tasks * (request.cpus_per_gpu or 1)
    if cpus > part["cpus"]:
        problems.append(f"{request.tasks} tasks x {request.cpus_per_gpu or 1} CPUs per node but partition "
                        f"{name}'s nodes have {part['cpus']} CPUs")
    if part["limit"] is not None and minutes > part["limit"]:
        problems.append(f"--time {request.time} exceeds partition {name}'s limit of {part['limit']} minutes")
    if problems:
        raise ConfigError("; ".join(problems))
    return name


def check_run_dir(run_dir: Path, resume: bool) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".vitctl-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run folder {run_dir} is not writable ({e.strerror}); choose another --out") from None
    checkpoint.checkpoints_to_resume(run_dir, resume)


def make_executor(request: LaunchRequest, folder: Path, name: str) -> submitit.AutoExecutor:
    constructor: dict[str, Any] = {"slurm_max_num_timeout": request.max_requeues}
    if request.executor == "slurm" and request.container_image:
        constructor["slurm_python"] = "python3"  # the container's interpreter, not this one
    executor = submitit.AutoExecutor(folder=folder, cluster=request.executor, **constructor)
    params: dict[str, Any] = {"name": name, "nodes": request.nodes, "tasks_per_node": request.tasks,
                              "timeout_min": parse_time(request.time), "cpus_per_task": request.cpus_per_gpu or 1}
    if request.gpus_per_node:
        params["gpus_per_node"] = request.gpus_per_node
    if request.executor == "slurm":
        params |= {"slurm_partition": request.partition, "slurm_account": request.account,
                   "slurm_qos": request.qos, "slurm_mem": request.mem, "slurm_signal_delay_s": SIGNAL_DELAY_S}
        if request.container_image:
            srun = [f"--container-image={request.container_image}"]
            if request.container_mounts:
                srun.append(f"--container-mounts={request.container_mounts}")
            params["slurm_srun_args"] = srun
        params = {k: v for k, v in params.items() if v is not None}
    executor.update_parameters(**params)
    return executor


def sbatch_script(request: LaunchRequest, folder: Path, name: str) -> str:
    """The script sbatch would run, without submitting anything."""
    inner = make_executor(request, folder, name)._executor
    return inner._make_submission_file_text(inner._submitit_command_str, "dry-run")


def submit(job: TrainJob, request: LaunchRequest, name: str, command: list[str]) -> tuple[JobRecord, Any]:
    folder = job.run_dir / "submitit"
    try:
        submitted = make_executor(request, folder, name).submit(TrainTask(job))
    except (submitit.core.utils.FailedSubmissionError, subprocess.CalledProcessError) as e:
        raise LaunchError(f"submission failed: {e}") from None
    record = JobRecord(str(submitted.job_id), request.executor, name, str(job.run_dir), str(folder),
                       request.nodes, request.tasks, request.gpus_per_node, time.time(), command=command)
    add_record(record)
    return record, submitted


def wait_local(submitted: Any, echo: Callable[[str], None]) -> dict[str, Any]:
    """Follow rank 0's log until a local job ends; its result, or LaunchError naming the failing log."""
    log = Path(submitted.paths.stderr)
    offset = 0
    while True:
        done = submitted.done()
        if log.exists():
            with open(log) as f:
                f.seek(offset)
                text = f.read()
                offset = f.tell()
            if text:
                echo(text.rstrip("\n"))
        if done:
            break
        time.sleep(0.5)
    try:
        return submitted.results()[0]
    except submitit.core.utils.FailedJobError as e:
        raise LaunchError(f"job {submitted.job_id} failed; logs in {log.parent}\n{str(e)[-2000:]}") from None


def command_line() -> list[str]:
    return [Path(sys.argv[0]).name, *sys.argv[1:]]



def run_rank(job: TrainJob) -> dict[str, Any]:
    """One rank of a job that srun (a plain sbatch script) or torchrun started.

    On USR2 every rank checkpoints; rank 0 then requeues the Slurm job, which resumes from that checkpoint.
    """
    if "SLURM_JOB_ID" in os.environ and "RANK" not in os.environ:
        os.environ.update(srun_torch_env(os.environ))
    stop = SignalFlag(signal.SIGUSR2)
    result = job(should_stop=stop.is_set)
    if result.get("stopped") and os.environ.get("RANK", "0") == "0" and "SLURM_JOB_ID" in os.environ:
        subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True, timeout=60)
    return result


def srun_torch_env(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """torch.distributed's variables from an srun task's: rendezvous on the job's first node."""
    hosts = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], capture_output=True,
                           text=True, check=True, timeout=30).stdout.split()
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env["SLURM_LOCALID"],
            "MASTER_ADDR": hosts[0], "MASTER_PORT": str(20000 + int(env["SLURM_JOB_ID"]) % 20000)}
