"""A small local registry of submitted jobs, so that `vitctl status`, `logs` and `cancel` can find them."""

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vitctl.datasets.atomic import write_json_atomic


class UnknownJobError(LookupError):
    """No job in the registry matches."""


@dataclass
class JobRecord:
    job_id: str
    executor: str  # slurm | local
    name: str
    run_dir: str
    folder: str  # submitit's folder: job pickles and per-task logs
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    submitted: float  # unix time
    cancelled: bool = False  # local jobs only; Slurm keeps its own record
    command: list[str] = field(default_factory=list)


def registry_path() -> Path:
    return Path(os.environ.get("VITCTL_HOME", Path.home() / ".vitctl")) / "jobs.json"


def load_records() -> list[JobRecord]:
    path = registry_path()
    return [JobRecord(**r) for r in json.loads(path.read_text())] if path.exists() else []


def save_records(records: list[JobRecord]) -> None:
    path = registry_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, [asdict(r) for r in records])


def add_record(record: JobRecord) -> None:
    save_records([*load_records(), record])


def find_record(key: str) -> JobRecord:
    """By job id, or by run folder (path or its last component); the newest match wins."""
    for record in reversed(load_records()):
        if key in (record.job_id, record.run_dir, Path(record.run_dir).name):
            return record
    raise UnknownJobError(f"no job {key!r} in {registry_path()}; `vitctl jobs` lists the known ones")
