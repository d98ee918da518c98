"""Run a job on this machine: in-process for one rank, else one process per rank with torch.distributed env vars."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .job import TrainJob


class LaunchError(RuntimeError):
    """A rank of a local launch failed."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(job: TrainJob, nproc: int) -> dict[str, Any] | None:
    """Run `job` on `nproc` local ranks (GPUs when CUDA is present, gloo CPU ranks otherwise)."""
    if nproc == 1:
        return job()
    spec = job.run_dir / "launch" / "job.json"
    job.write(spec)
    logs = job.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc))
    procs = []
    for rank in range(nproc):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        out = None if rank == 0 else open(logs / f"rank{rank}.log", "w")  # noqa: SIM115  (closed below)
        procs.append((subprocess.Popen([sys.executable, "-m", "vitctl.workflows.job", str(spec)], env=env,
                                       stdout=out, stderr=subprocess.STDOUT if out else None), out))
    try:
        return _wait(procs, logs)
    finally:
        for proc, out in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
            if out:
                out.close()


def _wait(procs: list, logs: Path) -> None:
    while True:
        codes = [proc.poll() for proc, _ in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            where = "above" if rank == 0 else str(logs / f"rank{rank}.log")
            raise LaunchError(f"rank {rank} exited with status {code} (its log: {where}); stopped the other ranks")
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.2)
