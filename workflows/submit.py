"""Submit a training job with submitit: to Slurm (sbatch), or to this machine through its local executor.

The task each rank runs checkpoints when it is told to stop: on the USR2 that Slurm sends before the time limit
(or on pre-emption) every rank checkpoints after the next step, then submitit requeues the job, which resumes
from that checkpoint; on SIGTERM (`scontrol requeue`, pre-emption, `vitctl cancel`) it checkpoints and ends
within the grace time, and Slurm requeues or ends it. An error in a rank is reported as one line; its traceback
stays in the rank's log.
"""

import contextlib
import faulthandler
import functools
import io
import itertools
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import submitit
import yaml

from vitctl.datasets.atomic import write_json_atomic
from vitctl.trainer import checkpoint, runlock
from vitctl.trainer.config import ConfigError

from . import registry, slurm_time, status
from .errors import Interrupted, LaunchError, TimeLimitReached
from .job import TrainJob
from .process import (
    children,
    pid_space,
    signal_when_parent_ends,
    skip_final_collection,
    start_time,
    this_process,
    with_environment,
)
from .registry import JobRecord
from .slurm_time import SIGNAL_DELAY_S
from .status import LogTail, log_paths, rank_failures, slurm_states, state_of

# The shortest --time that trains before that signal: Slurm may send it up to a minute earlier than asked (the
# resolution of its events), so 3 minutes leave at least 30 s; a shorter limit signals every attempt as it starts.
MIN_TIME_MINUTES = 3
SUBMITIT_FOLDER = "submitit"  # in the run folder: the jobs' scripts, logs and results
TIME_LIMIT_REQUEUES = "time-limit-requeues.json"  # in the run folder, for plain-sbatch jobs (submitit keeps its own)
# torch.distributed's rendezvous port, from the job id: below Linux's ephemeral ports (32768-60999), which any
# outgoing connection on the node may already hold.
RENDEZVOUS_PORTS = range(20000, 32768)
# srun ends every task once one exits with an error: the others would wait for it in the rendezvous or a collective,
# the job RUNNING and holding its nodes, until torch.distributed's timeout (30 minutes). A local job: _follow.
KILL_ON_BAD_EXIT = "export SLURM_KILL_BAD_EXIT=1"
FAILED_RANK_GRACE_S = 10  # after one rank of a local job failed, the others' time to end before they are stopped


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


def resolve_container_image(request: LaunchRequest) -> LaunchRequest:
    """The request with a file image (`vitctl image build`'s .sqsh) as the absolute path pyxis needs; a registry
    image (nvcr.io#nvidia/pytorch:TAG) is left to pyxis to pull."""
    image = request.container_image
    if not image:
        if request.container_mounts:  # pyxis mounts into an image: without one, nothing would read them
            raise ConfigError(f"--container-mounts {request.container_mounts} mounts folders into the image of "
                              "--container-image, and none is given: pass --container-image IMAGE, or drop "
                              "--container-mounts (without an image the ranks see this machine's folders as they are)")
        return request
    if request.executor == "local":
        raise ConfigError("--container-image runs every rank in the image through pyxis (srun): use it with "
                          "--executor slurm, or drop it to run here")
    if not image.startswith(("/", "./", "../")) and not image.endswith((".sqsh", ".squashfs")):
        return request
    path = Path(image).absolute()
    if not path.is_file():
        raise ConfigError(f"--container-image {image}: no such file; `vitctl image build` writes one (OUT/NAME.sqsh), "
                          "or name a registry image such as nvcr.io#nvidia/pytorch:25.10-py3")
    return replace(request, container_image=str(path))


def default_executor() -> str:
    return "slurm" if shutil.which("sbatch") else "local"


def parse_time(text: str) -> int:
    """Slurm's time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) -> whole minutes, at least 1."""
    problem = slurm_time.limit_problem(text)
    if problem:
        raise ConfigError(f"--time {problem}")
    return max(1, round(slurm_time.seconds(text) / 60))


def check_time(request: LaunchRequest) -> int:
    """--time in whole minutes; ConfigError when it leaves no time to train before the time-limit signal."""
    minutes = parse_time(request.time)
    # Locally the signal comes on time: past it, the limit must only leave a step's time.
    minimum = MIN_TIME_MINUTES if request.executor == "slurm" else SIGNAL_DELAY_S // 60 + 1
    if minutes < minimum:
        delay = SIGNAL_DELAY_S
        why = (f"Slurm signals the job {delay} s before its time limit (and up to a minute earlier still) for every "
               "rank to checkpoint and requeue, so each attempt would stop as soon as it starts"
               if request.executor == "slurm" else f"the local executor signals the ranks {delay} s before the time "
               "limit to checkpoint, so a shorter limit kills them with no signal and no checkpoint")
        raise ConfigError(f"--time {request.time} ({minutes} min) leaves no time to train: {why}; pass --time "
                          f"{minimum} or more")
    return minutes


def rendezvous_port(job_id: str) -> int:
    key = int(job_id) if job_id.isdigit() else zlib.crc32(job_id.encode())  # consecutive jobs, different ports
    return RENDEZVOUS_PORTS[key % len(RENDEZVOUS_PORTS)]


class StopSignals:
    """Records the first stop signal instead of acting on it at once: the trainer checks every step and
    checkpoints. `forward` hands the signal to the handler it replaced (submitit's requeue on USR2)."""

    def __init__(self, *signums: int) -> None:
        self.received: int | None = None
        self.previous = {signum: signal.signal(signum, self._handle) for signum in signums}

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum

    def is_set(self) -> bool:
        return self.received is not None

    def forward(self) -> None:
        previous = self.previous.get(self.received)
        if callable(previous):
            previous(self.received, None)


class RankFailed(LaunchError):
    """A rank's error in one line; its traceback is in the rank's log."""

    def __init__(self, rank: str, error: Exception) -> None:
        message = _original(type(error).__name__, str(error)).replace("\n", "; ")
        if "EADDRINUSE" in message:  # rank 0 could not listen on the rendezvous port
            message += (f"; port {os.environ.get('MASTER_PORT')}, where rank 0 waits for the other ranks, is taken by "
                        f"another process on {os.environ.get('MASTER_ADDR')}: run the same command again, and the new "
                        "job gets another port (it follows from the job id)")
        super().__init__(f"rank {rank} raised {message}")


_TRACEBACK = "Traceback (most recent call last):"


def _original(name: str, message: str) -> str:
    """`Name: message`. An error raised again from a loader's worker process (PyTorch's DataLoader, DALI) carries the
    worker's traceback in its message: what the user needs is the error at the end of it, without the frames."""
    if _TRACEBACK not in message:
        return f"{name}: {message}"
    lines = message.rsplit(_TRACEBACK, 1)[1].splitlines()
    error = "\n".join(itertools.dropwhile(lambda line: not line or line.startswith(" "), lines)).strip()
    qualified, _, text = error.partition(": ")
    return f"{qualified.rsplit('.', 1)[-1]}: {text}" if text else f"{name}: {error or message}"


def train_rank(job: TrainJob, stop: StopSignals) -> dict[str, Any]:
    """Run this rank; an error's traceback goes to the rank's log (stderr), and it is raised again as one line. A
    crash in native code (a segfault in a decoder or a driver) writes the Python stack it came from there too."""
    faulthandler.enable()
    try:
        return job(should_stop=stop.is_set)
    except Exception as error:
        traceback.print_exc()
        raise RankFailed(os.environ.get("RANK", "0"), error) from None


class _StoppedNotCompleted(logging.Filter):
    """Words submitit's "Job completed successfully", logged after the task returns, for a task stopped by SIGTERM:
    its job was requeued or cancelled, not completed."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() == "Job completed successfully":
            record.msg, record.args = (f"Job stopped by SIGTERM once every rank had checkpointed at step {self.step} "
                                       "(a requeue or a pre-emption starts it again; a cancel ends it)"), ()
        elif record.getMessage() == "Exiting after successful completion":
            record.msg, record.args = "Exiting", ()
        return True


class TrainTask(submitit.helpers.Checkpointable):
    """What every task of the job runs: torch.distributed variables from the job, then the trainer."""

    def __init__(self, job: TrainJob, request: LaunchRequest | None = None) -> None:
        self.job = job
        self.request = request  # its --time and --max-requeues, to name when they run out

    def __call__(self) -> dict[str, Any]:
        skip_final_collection()
        # submitit logs to the task's stdout itself; through the trainer's handler too, each line came twice in `logs`
        logging.getLogger("submitit").propagate = False
        environment = submitit.JobEnvironment()
        rendezvous = submitit.helpers.TorchDistributedEnvironment()
        rendezvous.master_port = rendezvous_port(environment.job_id)
        rendezvous.export(set_cuda_visible_devices=False, overwrite=True)
        # Ours replace submitit's handlers: its USR2 one would requeue before we could checkpoint.
        stop = StopSignals(signal.SIGUSR2, signal.SIGTERM)
        if status.cancel_marker(environment.paths.folder, environment.job_id).exists():
            stop.received = signal.SIGTERM  # cancelled while this rank started, before it could take the signal
        # A local job's controller (its PID is the job id) that ends, even by SIGKILL, stops its ranks as a cancel
        # does; else they trained on unseen, holding the run folder, and no cancel could reach them.
        if environment.name() == "local" and not signal_when_parent_ends(signal.SIGTERM, int(environment.job_id)):
            stop.received = signal.SIGTERM
        result = train_rank(self.job, stop)
        if result.get("stopped") and stop.received == signal.SIGTERM:
            logging.getLogger("submitit").addFilter(_StoppedNotCompleted(result["step"]))
        if result.get("stopped") and stop.received == signal.SIGUSR2:
            try:
                stop.forward()  # rank 0: submitit calls checkpoint() below and requeues; the others just return
            except submitit.core.utils.UncompletedJobError:  # no requeue left: submitit's message names no way on
                raise TimeLimitReached(self._out_of_time(result["step"])) from None
        return result

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        return submitit.helpers.DelayedSubmission(TrainTask(self.job, self.request))  # resumes from the run folder

    def _out_of_time(self, step: int) -> str:
        request = getattr(self, "request", None)  # None: pickled by a vitctl that did not keep it
        limits = f" (--time {request.time}, --max-requeues {request.max_requeues})" if request else ""
        return (f"it reached its time limit with no requeue left{limits}: every rank checkpointed at step {step}; "
                "to go on from there, run the same command again with --resume and a longer --time or a higher "
                "--max-requeues")


def _sinfo(fields: str, *args: str) -> list[str]:
    """sinfo's lines of `fields` (its -o format); LaunchError when it fails or does not answer."""
    out = status.slurm_command(["sinfo", "-h", *args, "-o", fields],
                               "try again, or run on this machine with --executor local")
    if out.returncode:
        raise LaunchError(f"sinfo failed: {out.stderr.strip()}; check `scontrol ping`, or use --executor local")
    return out.stdout.split()


def _sinfo_partitions() -> dict[str, dict[str, Any]]:
    partitions = {}
    for line in _sinfo("%P|%D|%c|%G|%l"):
        name, nodes, cpus, gres, limit = line.split("|")
        gpus = re.search(r"gpu(?::[^:,()]+)?:(\d+)", gres)
        partitions[name.rstrip("*")] = {"default": name.endswith("*"), "nodes": int(nodes),
                                        "cpus": int(cpus.rstrip("+")), "gpus": int(gpus.group(1)) if gpus else 0,
                                        "limit": None if limit in ("infinite", "n/a") else parse_time(limit)}
    return partitions


def _mem_mb(text: str) -> int | None:
    """sbatch's --mem (N[K|M|G|T][B], megabytes without a unit) in megabytes; None if sbatch would not read it."""
    match = re.fullmatch(r"(\d+)(?:([KMGT])B?)?", text.strip(), re.IGNORECASE)
    if not match:
        return None
    number, unit = int(match[1]), (match[2] or "M").upper()
    if unit == "K":
        return -(-number // 1024)  # sbatch rounds kilobytes up to a megabyte
    return number * 1024 ** "MGT".index(unit)


def _mem_problem(mem: str | None, partition: str) -> str | None:
    """Why --mem cannot be had on any node of the partition. A --mem sbatch cannot read is left to its refusal;
    nodes differ in memory (sinfo -N lists each), and the largest is the one that could take the job."""
    wanted = _mem_mb(mem) if mem else None
    if wanted is None:
        return None
    # A partition without nodes is refused by --nodes already.
    largest = max((int(m.rstrip("+")) for m in _sinfo("%m", "-N", "-p", partition)), default=wanted)
    if wanted <= largest:
        return None
    return (f"--mem {mem} ({wanted} MB per node) but the nodes of partition {partition} have at most {largest} MB; "
            f"ask for --mem {largest}M or less")


def validate_slurm(request: LaunchRequest, images_checked: bool = True) -> tuple[str, int]:
    """Check the request against the cluster before anything is submitted (with `images_checked`, that its srun runs
    --container-image); returns the partition used and its CPUs per node (its smallest node's)."""
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
        fixes = [f"--cpus-per-gpu {part['cpus'] // request.tasks}"] if part["cpus"] >= request.tasks else []
        fixes.append("fewer tasks a node (--tasks-per-node, or --gpus, with more --nodes)")
        problems.append(f"{request.tasks} tasks x {request.cpus_per_gpu or 1} CPUs per node but partition "
                        f"{name}'s nodes have {part['cpus']} CPUs: pass {', or '.join(fixes)}")
    if part["limit"] is not None and minutes > part["limit"]:
        problems.append(f"--time {request.time} exceeds partition {name}'s limit of {part['limit']} minutes")
    if mem := _mem_problem(request.mem, name):
        problems.append(mem)
    if images_checked and (problem := container_image_problem(request)):
        problems.append(problem)
    if problems:
        raise ConfigError("; ".join(problems))
    return name, part["cpus"]


def container_image_problem(request: LaunchRequest) -> str | None:
    """Why this cluster cannot run the request's --container-image, or None."""
    if not request.container_image or _srun_takes_images():
        return None
    return (f"--container-image {request.container_image} runs each rank in the image through pyxis, an srun plugin "
            "this cluster lacks (`srun --help` lists no --container-image): drop --container-image to run in this "
            "environment, or use a cluster with pyxis and enroot")


def _srun_takes_images() -> bool:
    """Whether srun has pyxis's --container-image (without it, every rank fails at start with srun's usage error)."""
    done = status.slurm_command(["srun", "--help"], "or drop --container-image")
    return "--container-image" in done.stdout + done.stderr


def with_cpus_per_task(request: LaunchRequest, node_cpus: int | None, loader_workers: int) -> LaunchRequest:
    """A Slurm request (or sbatch script) without --cpus-per-gpu: a CPU for each of a task's loader workers and one
    for the rank, at most an equal share of a node's CPUs where the nodes are known (not in a dry run away from the
    cluster). Slurm's default, one CPU a task, would make a rank's loader workers and DALI's threads share one."""
    if request.cpus_per_gpu is not None:
        return request
    need = loader_workers + 1
    return replace(request, cpus_per_gpu=max(1, min(need, node_cpus // request.tasks) if node_cpus else need))


def cpus_warning(request: LaunchRequest, loader_workers: int, node_cpus: int | None, given: bool) -> str | None:
    """Why a Slurm job's CPUs a task (`given` as --cpus-per-gpu, else a node's share) would starve its loader: fewer
    than its workers and the rank. The fix it names fits the node."""
    cpus = request.cpus_per_gpu
    if cpus is None or cpus > loader_workers:
        return None
    share = node_cpus // request.tasks if node_cpus else None
    what = f"--cpus-per-gpu {cpus}" if given else f"{cpus} CPU{'s' if cpus != 1 else ''} a task (a node's " \
        f"{node_cpus} over its {request.tasks} tasks)"
    problem = (f"{what}: each rank's {loader_workers} loader workers and the rank itself would share {cpus} "
               f"CPU{'s' if cpus != 1 else ''}, and loading may hold the step back")
    if share is None or share > loader_workers:  # the node has the CPUs
        return (f"{problem}; give --cpus-per-gpu {loader_workers + 1} or more (or leave it out: vitctl then asks for "
                f"that many, at most a node's share), or --set data.workers={cpus - 1}")
    fixes = [f"--set data.workers={cpus - 1}"]
    if share > cpus:
        fixes.insert(0, f"--cpus-per-gpu {share} --set data.workers={share - 1}")
    if request.tasks == 1:  # it has all of the node's CPUs already
        return f"{problem}; a node's {node_cpus} CPUs are all its one task has: {' or '.join(fixes)}"
    return (f"{problem}; a node's {node_cpus} CPUs give each of its {request.tasks} tasks at most {share}: "
            f"{' or '.join(fixes)}, or fewer --tasks-per-node")


def local_cpus_warning(tasks: int, cpus: int) -> str | None:
    """Why a local job's ranks would crowd this machine: more of them than its CPUs. (Loader workers, mostly waiting
    on the rank, share fine; a Slurm job's CPUs are cpus_warning's.)"""
    if tasks <= cpus:
        return None
    return (f"--tasks-per-node {tasks} runs {tasks} ranks on this machine's {cpus} CPU{'s' if cpus != 1 else ''}: "
            f"they would take turns, and each step may take many times as long; --tasks-per-node {cpus} or fewer")


# sinfo's node states (%T, less the suffixes such as * for "not responding") in which a node starts no new job.
UNAVAILABLE_STATES = {"down", "drained", "draining", "fail", "failing", "maint", "reserved", "inval", "future"}


def availability_warning(request: LaunchRequest, partition: str) -> str | None:
    """Why a job submitted to `partition` would wait in the queue until an administrator acts: the partition is not
    up, or fewer of its nodes than the job needs can start a job. Not a refusal: such nodes come back (maintenance
    ends), and a job queued meanwhile starts then."""
    groups = [line.split("|") for line in _sinfo("%T|%D|%N|%a", "-p", partition)]  # a line per node state
    avail = {a for *_, a in groups}
    if avail - {"up"}:
        return (f"partition {partition} is {'/'.join(sorted(avail))}, not up: the job waits in the queue until an "
                f"administrator sets it up (`scontrol update {shlex.quote(f'PartitionName={partition}')} State=UP`); "
                f"`sinfo -p {shlex.quote(partition)}` shows it; or cancel the job and submit to another --partition")
    out = [(state.rstrip("*~#!%$@^-+"), int(count), nodes) for state, count, nodes, _ in groups]
    unavailable = [(state, nodes) for state, _, nodes in out if state in UNAVAILABLE_STATES]
    usable = sum(count for state, count, _ in out if state not in UNAVAILABLE_STATES)
    if usable >= request.nodes or not unavailable:
        return None
    which = "; ".join(f"{state}: {nodes}" for state, nodes in unavailable)
    return (f"partition {partition} has {usable} node{'s' if usable != 1 else ''} that can start a job now and the job "
            f"needs {request.nodes} ({which}): it waits in the queue until they return; `sinfo -R -p "
            f"{shlex.quote(partition)}` shows why they are out, an administrator returns them with `scontrol update "
            f"{shlex.quote('NodeName=' + ','.join(nodes for _, nodes in unavailable))} State=RESUME`; or cancel the "
            f"job and submit to another --partition")


def check_run_dir(run_dir: Path) -> list[Path]:
    """Make the run folder and check it is writable; the checkpoints a --resume would go on from."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".vitctl-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"run folder {run_dir} is not writable ({e.strerror}); choose another --out") from None
    return checkpoint.checkpoints_to_resume(run_dir, resume=True)


def refuse_entries_of_another_kind(run_dir: Path) -> None:
    """ConfigError where the run folder holds a file under the name of the folder submitit writes the job's logs in
    (preflight checks the trainer's own entries)."""
    if (folder := run_dir / SUBMITIT_FOLDER).exists() and not folder.is_dir():
        raise ConfigError(f"run folder {run_dir}: {folder} is a file, where vitctl writes a folder: move it away, or "
                          "choose another --out")


def container_mounts(config: dict[str, Any], request: LaunchRequest) -> str:
    """pyxis's --container-mounts: the user's, then each folder the ranks read or write, at the same path inside the
    image (the run folder, the shards, the checkpoint to finetune from, the plan) unless the user mounted it."""
    given = [m for m in (request.container_mounts or "").split(",") if m]
    targets = {m.split(":")[1] if ":" in m else m for m in given}  # SRC[:DST[:FLAGS]]
    files = [config["finetune"].get("from_ckpt"), config["parallel"].get("plan")]
    folders = [config["train"]["out_dir"], config["data"].get("path"),
               *(str(Path(f) if Path(f).is_dir() else Path(f).parent) for f in files if f)]
    added = [f"{folder}:{folder}" for folder in dict.fromkeys(f for f in folders if f) if folder not in targets]
    return ",".join(given + added)


def _srun_args(request: LaunchRequest, config: dict[str, Any]) -> list[str]:
    """pyxis's flags, for each task's srun."""
    if not request.container_image:
        return []
    return [f"--container-image={request.container_image}", f"--container-mounts={container_mounts(config, request)}"]


def _python(request: LaunchRequest) -> str:
    return "python3" if request.container_image else sys.executable  # a container's interpreter, not this one


def make_executor(request: LaunchRequest, folder: Path, name: str, config: dict[str, Any]) -> submitit.Executor:
    minutes = parse_time(request.time)
    if request.executor == "local":
        executor = submitit.LocalExecutor(folder, max_num_timeout=request.max_requeues)
        executor.update_parameters(tasks_per_node=request.tasks, gpus_per_node=request.gpus_per_node,
                                   timeout_min=minutes, signal_delay_s=SIGNAL_DELAY_S)
        return executor
    executor = submitit.SlurmExecutor(folder, max_num_timeout=request.max_requeues, python=_python(request))
    params: dict[str, Any] = {
        "job_name": name, "nodes": request.nodes, "ntasks_per_node": request.tasks, "time": minutes,
        "cpus_per_task": request.cpus_per_gpu or 1, "gpus_per_node": request.gpus_per_node or None,
        "partition": request.partition, "account": request.account, "qos": request.qos, "mem": request.mem,
        "signal_delay_s": SIGNAL_DELAY_S, "srun_args": _srun_args(request, config) or None,
        # Requeue on preemption or node failure even where the cluster's default (JobRequeue) is off.
        "additional_parameters": {"requeue": True}, "setup": [KILL_ON_BAD_EXIT]}
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    executor.update_parameters(wckey=None)  # submitit adds --wckey=submitit, which clusters with wckeys refuse
    return executor


def sbatch_script(config: dict[str, Any], request: LaunchRequest, name: str, layout: list[str],
                  plan: tuple[Path, str] | None = None) -> str:
    """A self-contained sbatch script for the job: every task runs one rank (`vitctl rank`) on the config (and `plan`:
    the path its config names, and its text), written into the run folder when the job starts. Submittable as it is;
    `layout`: comment lines on how the ranks divide."""
    run_dir = Path(config["train"]["out_dir"])
    options = {"job-name": name, "nodes": request.nodes, "ntasks-per-node": request.tasks,
               "gpus-per-node": request.gpus_per_node or None, "cpus-per-task": request.cpus_per_gpu or 1,
               "time": parse_time(request.time), "partition": request.partition, "account": request.account,
               "qos": request.qos, "mem": request.mem, "signal": f"USR2@{SIGNAL_DELAY_S}", "requeue": True,
               "open-mode": "append", "output": "%x-%j.out"}  # where sbatch runs: the run folder may not exist yet
    lines = [
        "#!/bin/bash",
        f"# {name}: {request.nodes} node(s) x {request.tasks} rank(s), written by `vitctl train --dry-run`.",
        "# Submit it as it is (sbatch FILE); its log is NAME-JOBID.out where sbatch ran. Each rank resumes from the",
        "# run folder's last checkpoint, and checkpoints on USR2 (time limit) or SIGTERM (requeue, preemption,",
        "# scancel) before it stops. `vitctl status` lists the jobs `vitctl train` submits, not this one: squeue and",
        "# sacct show it.",
        *(f"# {line}" for line in layout),
        *(f"#SBATCH --{key}" if value is True else f"#SBATCH --{key}={shlex.quote(str(value))}"
          for key, value in options.items() if value is not None),
        "set -euo pipefail",
        KILL_ON_BAD_EXIT,
        f"config={shlex.quote(str(run_dir))}/job-$SLURM_JOB_ID.yaml",
        f"mkdir -p {shlex.quote(str(run_dir))}",
        "cat > \"$config\" <<'VITCTL_CONFIG'",
        yaml.safe_dump(json.loads(json.dumps(config)), sort_keys=False).rstrip("\n"),  # tuples as lists
        "VITCTL_CONFIG",
        *([f"cat > {shlex.quote(str(plan[0]))} <<'VITCTL_PLAN'", plan[1].rstrip("\n"), "VITCTL_PLAN"] if plan else []),
        shlex.join(["srun", *_srun_args(request, config), _python(request), "-m", "vitctl.cli", "rank",
                    "--max-requeues", str(request.max_requeues), "--config"]) + ' "$config"',
    ]
    return "\n".join(lines) + "\n"


def refuse_busy_run_dir(run_dir: Path, records: list[JobRecord]) -> None:
    """ConfigError naming the job if a live one writes to `run_dir`: one that `records` hold (pending ones too),
    or one that holds the folder's lock."""
    same = [r for r in records if Path(r.run_dir).resolve() == run_dir.resolve()]  # `..` and links name it too
    slurm = slurm_states([r.job_id for r in same if r.executor == "slurm" and r.job_id])
    for other in same:
        state = state_of(other, slurm)
        if state.live:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(other.submitted))
            raise runlock.in_use(run_dir, f"job {other.job_id or '(being submitted)'} ({other.name}, {state.state}, "
                                 f"submitted {when})", other.job_id, registered=True)
    holder = runlock.holder(run_dir)  # a job this registry does not know (another machine, plain sbatch)
    if holder:
        job = holder.get("job")
        raise runlock.in_use(run_dir, runlock.describe(holder), job, any(r.job_id == job for r in records))


def claim_run_dir(record: JobRecord) -> None:
    """Refuse a run folder that a live job writes to; else record the job as being submitted. Both under the
    registry's lock, so that of two launches into one folder only one passes."""
    with registry.editing() as records:
        refuse_busy_run_dir(Path(record.run_dir), records)
        records.append(record)


def submit(job: TrainJob, request: LaunchRequest, name: str,
           command: list[str]) -> tuple[JobRecord, Any, int | None]:
    """Submit the job, recorded in the registry before it is submitted (so that no crash leaves it untracked); with
    the stop signal that came meanwhile, held until its id is recorded (a local job's waiter takes it then). A Slurm
    job so submitted is named in an Interrupted error."""
    folder = job.run_dir / SUBMITIT_FOLDER
    host, pid_namespace = pid_space() if request.executor == "local" else (None, None)
    record = JobRecord("", request.executor, name, str(job.run_dir), str(folder), request.nodes, request.tasks,
                       request.gpus_per_node, time.time(), command=command, submitter=list(this_process()),
                       host=host, pid_namespace=pid_namespace,
                       max_requeues=request.max_requeues if request.executor == "slurm" else None)
    claim_run_dir(record)
    with _stops_held(request.executor == "local") as held:
        try:
            record, submitted = _submitted(job, request, name, record, folder)
        except LaunchError:
            if held.received is None:
                raise
            raise KeyboardInterrupt from None  # a Ctrl-C reaches sbatch too: it ended, and nothing was submitted
    if held.received is not None and request.executor == "slurm":
        raise Interrupted(f"job {record.job_id} was submitted before the interrupt came, and Slurm runs it: `vitctl "
                          f"cancel {record.job_id}` stops it")
    return record, submitted, held.received


def _submitted(job: TrainJob, request: LaunchRequest, name: str, record: JobRecord,
               folder: Path) -> tuple[JobRecord, Any]:
    """The job submitted, and its record with its id; LaunchError (the record removed) where it could not be."""
    try:
        # submitit prints sbatch's stderr before it raises, and the error below repeats it in one line.
        with contextlib.redirect_stderr(io.StringIO()):
            submitted = make_executor(request, folder, name, job.config).submit(TrainTask(job, request))
    except submitit.core.utils.FailedJobError as e:  # sbatch's refusal, its stderr as the message
        registry.remove_records({record.key})  # else the next command settles it as the FAILED job sacct records
        raise LaunchError(f"sbatch refused the job: {_sbatch_errors(str(e))}; nothing was submitted: change what it "
                          "names (--mem, --account, --qos, --partition, ...) and run the command again") from None
    except PermissionError as e:  # submitit writes the job's pickle and logs into the run folder's submitit/
        registry.remove_records({record.key})
        raise LaunchError(f"submission failed: this user cannot write {e.filename} ({e.strerror}); give this user "
                          f"write access to {folder}, or choose another --out") from None
    except (submitit.core.utils.FailedSubmissionError, subprocess.CalledProcessError, OSError) as e:
        registry.remove_records({record.key})
        raise LaunchError(f"submission failed: {e}") from None
    job_id = str(submitted.job_id)
    started = start_time(int(job_id)) if request.executor == "local" else None
    return registry.update_record(record.key, job_id=job_id, submitter=None, started=started), submitted


def _sbatch_errors(stderr: str) -> str:
    """sbatch's error lines in one: 'Memory specification can not be satisfied; Batch job submission failed: ...'."""
    lines = [re.sub(r"^sbatch: error: ", "", line.strip()) for line in stderr.splitlines() if line.strip()]
    return "; ".join(lines) or "no message"


# What a terminal sends its whole process group: Ctrl-C, and the hangup of a closed window or a dropped SSH link.
TERMINAL_SIGNALS = (signal.SIGINT, signal.SIGHUP)


class _Held:
    received: int | None = None

    def note(self, signum: int, frame: Any) -> None:
        self.received = self.received or signum


@contextlib.contextmanager
def _stops_held(local: bool) -> Iterator[_Held]:
    """Stop signals in the block are noted, not acted on: an interrupt between the submission and the record of its
    job id left a job running that no vitctl could see or stop. A local job's controller, started in the block,
    ignores the terminal's signals (an ignored signal stays ignored across exec): a Ctrl-C or a hangup, sent to the
    terminal's whole process group, so reaches only this vitctl, which stops the job as `vitctl cancel` does
    (wait_local); without it, submitit's controller printed its traceback and killed the ranks before they could
    checkpoint. Those two are then lost within the block, as the controller's start is short."""
    held = _Held()
    handlers = {signum: signal.SIG_IGN if local else held.note for signum in TERMINAL_SIGNALS}
    previous = {signum: signal.signal(signum, handler) for signum, handler in {**handlers,
                                                                               signal.SIGTERM: held.note}.items()}
    try:
        yield held
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _hung_up(terminals: list[int], signum: int, frame: Any) -> None:
    """The terminal is gone: what is written to it from now on (buffered text included) would fail (EIO), so the
    file descriptors that were `terminals` (isatty is false once it hung up) go to /dev/null instead; then as Ctrl-C."""
    with open(os.devnull, "wb") as devnull:
        for fd in terminals:
            os.dup2(devnull.fileno(), fd)
    raise KeyboardInterrupt


class TracebackFilter:
    """Hides the Python tracebacks of a log followed live, and submitit's words on them and on signals: a failed rank
    is reported once, in one line, and its traceback stays in the log file. A traceback ends where the trainer's
    logging writes again."""

    PREFIX = r"(\[rank\d+\]: )?"
    # faulthandler's dump of a crash in native code starts "Fatal Python error: Segmentation fault"
    START = re.compile(rf"{PREFIX}(Traceback \(most recent call last\):|Fatal Python error: )")
    # what multiprocessing's resource tracker says of a rank that was killed: the job's end says what was lost
    LEAK_WARNING = re.compile(r".*resource_tracker(\.py:\d+: UserWarning: resource_tracker)?: There appear to be |"
                              r"\s+warnings\.warn\('resource_tracker: ")
    # what submitit logs of a task that raised (a time limit with no requeue left among them), and of a signal it
    # ignores (SIGCONT, as a stop begins): the job's end, and vitctl's note on the stop, say what happened
    SUBMITIT_NOISE = re.compile(r".*\bsubmitit\b.*(Submitted job triggered an exception|Bypassing signal [A-Z0-9]+)$")
    SEPARATOR = re.compile(rf"{PREFIX}(The above exception was the direct cause of the following exception:|During "
                           r"handling of the above exception, another exception occurred:)")
    LOG_RECORD = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \[rank \d+\] ")
    # A chain's first cause has no "Traceback" line when it was never raised in this process (DALI raises again
    # from a worker's error): from a line that may be its `module.Name: message`, lines are held back until a
    # separator shows that they were (and hides them) or a log record or traceback shows that they were not.
    EXCEPTION_LINE = re.compile(rf"{PREFIX}[A-Za-z_][\w.]*(: |$)")

    def __init__(self) -> None:
        self.hiding = False
        self.held: list[str] = []

    def shown(self, lines: list[str], final: bool = False) -> list[str]:
        """Those of the log's next `lines` to show; `final`: the log has ended, and nothing is held back any longer."""
        shown = []
        for line in lines:
            if self.LEAK_WARNING.match(line) or self.SUBMITIT_NOISE.match(line):
                continue
            if self.SEPARATOR.match(line):
                self.hiding, self.held = True, []
            elif self.START.match(line):
                shown += self._release()
                self.hiding = True
            elif self.LOG_RECORD.match(line):
                self.hiding = False
                shown += [*self._release(), line]
            elif not self.hiding and (self.held or self.EXCEPTION_LINE.match(line)):
                self.held.append(line)
            elif not self.hiding:
                shown.append(line)
        return shown + (self._release() if final else [])

    def _release(self) -> list[str]:
        held, self.held = self.held, []
        return held


def wait_local(submitted: Any, record: JobRecord, echo: Callable[[str], None],
               stopped_already: bool = False) -> dict[str, Any]:
    """Follow rank 0's log until a local job ends; rank 0's result, or LaunchError saying why it did not end well.
    Ctrl-C, SIGTERM or a hangup (or one held while the job was submitted: `stopped_already`) stops the job as `vitctl
    cancel` does (its ranks checkpoint) and raises Interrupted once it has ended; a second one leaves it stopping on
    its own."""
    log, interrupted = LogTail([log_paths(record, 0)[1]]), False
    stops = _stop_handlers()
    previous = {signum: signal.signal(signum, functools.partial(_first_stop, handler))
                for signum, handler in stops.items()}
    try:
        try:
            if stopped_already:
                raise KeyboardInterrupt
            _follow(submitted, record, log, echo)
        except KeyboardInterrupt:  # the stop signals are ignored from here until the job has been asked to stop
            interrupted = True
            status.cancel(registry.reload(record))
            echo(f"stopping job {record.job_id}: its ranks checkpoint after the step they are in (interrupt again "
                 "to leave it stopping on its own)")
            for signum, handler in stops.items():
                signal.signal(signum, handler)
            try:
                _follow(submitted, record, log, echo)
            except KeyboardInterrupt:
                raise Interrupted(f"job {record.job_id} is still stopping on its own: `vitctl status "
                                  f"{record.job_id}` shows when it has ended (its log: {log_paths(record, 0)[1]})"
                                  ) from None
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    state = state_of(registry.reload(record))  # `vitctl cancel` or an interrupt may have marked it meanwhile
    if state.state == "COMPLETED":
        return submitted.results()[0]
    if interrupted and state.state == "CANCELLED":
        raise Interrupted(f"job {record.job_id} was stopped: {state.note} (its log: {log_paths(record, 0)[1]})")
    if state.state in ("INTERRUPTED", "CANCELLED", "TIMEOUT"):
        raise LaunchError(f"job {record.job_id} was stopped ({state.state.lower()}): {state.note}")
    why = state.note or status.run_dir_gone(record) or f"no rank reported why; see {log_paths(record, 0)[1]}"
    raise LaunchError(f"job {record.job_id} failed: {why}")


def _terminals() -> list[int]:
    return [stream.fileno() for stream in (sys.stdout, sys.stderr) if stream.isatty()]


def _stop_handlers() -> dict[int, Callable[[int, Any], None]]:
    """What stops a followed local job: Ctrl-C (unless ignored); SIGTERM, as Ctrl-C rather than a silent exit; a
    hangup (unless under nohup, where the job runs on after it, as asked), so that the ranks checkpoint rather than
    die unsaved."""
    handlers: dict[int, Callable[[int, Any], None]] = {signal.SIGTERM: _interrupt}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        handlers[signal.SIGINT] = _interrupt
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        handlers[signal.SIGHUP] = functools.partial(_hung_up, _terminals())
    return handlers


def _first_stop(handler: Callable[[int, Any], None], signum: int, frame: Any) -> None:
    """The first stop signal ignores the next ones, then acts: `timeout -s INT` signals vitctl and then its group a
    few ms apart, and a second signal that came before the cancel had begun left the job running on."""
    # A handler that does nothing, not SIG_IGN: a signal that came with this one may be pending in Python already,
    # which reports one whose handler became SIG_IGN as `OSError: Signal 15 ignored due to race condition` on stderr.
    # (SIG_IGN would also pass on to processes started from here; the local cancel starts none.)
    for other in (*TERMINAL_SIGNALS, signal.SIGTERM):
        signal.signal(other, _ignore)
    handler(signum, frame)


def _ignore(signum: int, frame: Any) -> None:
    pass


def _follow(submitted: Any, record: JobRecord, log: LogTail, echo: Callable[[str], None]) -> None:
    """Echo the log's new lines without tracebacks until the job ends. Once a rank has failed, the others get
    FAILED_RANK_GRACE_S to end before they are killed (they may be waiting for it in a collective)."""
    hide, stop_at, orphaned = TracebackFilter(), None, False
    while True:
        done = submitted.done()
        # the controller was killed: its ranks got SIGTERM (signal_when_parent_ends). Rank 0 lets go of the lock
        # before it and the other ranks have exited (maybe before this loop looks), so their processes count too.
        if done and (_ranks_run_on(record) or _rank_processes(record)):
            if not orphaned:
                echo(f"job {record.job_id}: its controller process ended while its ranks ran on; they checkpoint "
                     "after the step they are in, then stop")
            orphaned, done = True, False
        shown = hide.shown(log.read(final=done).splitlines(), final=done)
        if shown:
            echo("\n".join(shown))
        if done:
            return
        if stop_at is None and rank_failures(record):
            stop_at = time.monotonic() + FAILED_RANK_GRACE_S
        if stop_at is not None and time.monotonic() > stop_at:
            for rank in children(int(record.job_id)):  # the controller ignores SIGINT: its ranks are ended here
                os.kill(rank, signal.SIGKILL)
            stop_at = float("inf")
        time.sleep(0.5)


def _ranks_run_on(record: JobRecord) -> bool:
    """Whether rank 0 of the job still holds its run folder's lock."""
    holder = runlock.holder(Path(record.run_dir))
    return holder is not None and holder.get("job") in (record.job_id, None)


def _rank_processes(record: JobRecord) -> list[int]:
    """The live processes of a local job's ranks (and of the workers they forked); a controller that ended on its
    own has waited for them all."""
    return [pid for pid in with_environment("SUBMITIT_LOCAL_JOB_ID", record.job_id) if _runs_submitit(pid)]


def _runs_submitit(pid: int) -> bool:
    try:
        return b"submitit" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # ended meanwhile
        return False


def command_line() -> list[str]:
    return [Path(sys.argv[0]).name, *sys.argv[1:]]


def run_rank(job: TrainJob, max_requeues: int) -> dict[str, Any]:
    """One rank of a job that srun (a plain sbatch script) or torchrun started.

    On USR2 every rank checkpoints; rank 0 then requeues the Slurm job, which resumes from that checkpoint, unless
    its time limit has requeued it `max_requeues` times already (as submitit counts: pre-emptions do not count). On
    SIGTERM every rank checkpoints and ends: Slurm requeues or ends the job.
    """
    skip_final_collection()
    if "SLURM_JOB_ID" in os.environ and "RANK" not in os.environ:
        os.environ.update(srun_torch_env(os.environ))
    stop = StopSignals(signal.SIGUSR2, signal.SIGTERM)
    result = train_rank(job, stop)
    if (result.get("stopped") and stop.received == signal.SIGUSR2 and os.environ.get("RANK", "0") == "0"
            and "SLURM_JOB_ID" in os.environ):
        job_id, path = os.environ["SLURM_JOB_ID"], job.run_dir / TIME_LIMIT_REQUEUES
        counts = _time_limit_requeues(path)
        requeued = counts.get(job_id, 0)
        if requeued >= max_requeues:
            raise TimeLimitReached(f"it reached its time limit with no requeue left (--max-requeues {max_requeues}, "
                                   f"requeued on {requeued} time limit{'' if requeued == 1 else 's'} before): every "
                                   f"rank checkpointed at step {result['step']}; to go on from there, submit it again "
                                   "with a longer --time or a higher --max-requeues")
        write_json_atomic(path, counts | {job_id: requeued + 1})
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    return result


def _time_limit_requeues(path: Path) -> dict[str, int]:
    """Slurm job id -> the time limits that requeued it, as rank 0 of a plain-sbatch job records them."""
    try:
        counts = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet; or damaged, when the count starts again rather than the job failing
        return {}
    return counts if isinstance(counts, dict) else {}


def srun_torch_env(env: dict[str, str] | os._Environ) -> dict[str, str]:
    """torch.distributed's variables from an srun task's: rendezvous on the job's first node."""
    hosts = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]], capture_output=True,
                           text=True, check=True, timeout=30).stdout.split()
    local = tasks_on_node(env.get("SLURM_TASKS_PER_NODE", "1"), int(env.get("SLURM_NODEID", "0")))
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env["SLURM_LOCALID"],
            "LOCAL_WORLD_SIZE": str(local), "MASTER_ADDR": hosts[0],
            "MASTER_PORT": str(rendezvous_port(env["SLURM_JOB_ID"]))}


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """The tasks on the job's `node`-th node, from SLURM_TASKS_PER_NODE's list of counts, where `2(x3)` stands for
    three nodes of 2: set for every job (SLURM_NTASKS_PER_NODE only with --ntasks-per-node)."""
    counts = []
    for item in tasks_per_node.split(","):
        count, _, repeat = item.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts[node]
