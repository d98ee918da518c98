"""`vitctl forget`: drop ended jobs from the registry; their run folders, checkpoints and logs stay as they are."""

from collections.abc import Sequence
from pathlib import Path

from . import registry, status
from .registry import JobRecord


def selected(keys: Sequence[str], gone: bool) -> list[JobRecord]:
    """The jobs `keys` name (a job id: that job; a run folder or a name: every job of that folder) and, with `gone`,
    every job whose run folder no longer exists; oldest first, each once."""
    named = [(key, registry.find_record(key)) for key in keys]  # one run each: a forgotten job is not listed again
    records = registry.load_records()  # read after: finding a moved run folder records its new place
    chosen: set[str] = set()
    for key, found in named:
        if key == found.job_id:
            chosen.add(found.key)
        else:
            folder = Path(found.run_dir).resolve()
            chosen |= {r.key for r in records if Path(r.run_dir).resolve() == folder}
    if gone:
        chosen |= {r.key for r in records if not Path(r.run_dir).is_dir()}
    return [r for r in records if r.key in chosen]


def forget(records: Sequence[JobRecord]) -> tuple[list[JobRecord], list[tuple[JobRecord, str]]]:
    """Remove those of `records` that have ended from the registry; (the forgotten, [(kept, why)])."""
    slurm = status.slurm_states([r.job_id for r in records if r.executor == "slurm" and r.job_id])
    kept = [(r, why) for r in records if (why := _why_kept(r, status.state_of(r, slurm)))]
    kept_keys = {r.key for r, _ in kept}
    forgotten = [r for r in records if r.key not in kept_keys]
    registry.remove_records({r.key for r in forgotten})
    return forgotten, kept


def _why_kept(record: JobRecord, state: status.JobState) -> str | None:
    """Why a job may not be forgotten yet (it may still run, or that cannot be told here); None once it has ended."""
    job = record.job_id or "(submitting)"
    if state.live:
        return (f"it is {state.state}; forget it once it has ended (`vitctl cancel {job}` stops it)"
                if record.job_id else f"it is {state.state} ({state.note}); forget it once `vitctl jobs` shows its id")
    if state.unreachable:
        return f"whether it has ended cannot be told: {state.note}; forget it once Slurm answers again"
    if state.state == "UNKNOWN" and (away := status.elsewhere(record)):
        return (f"it is a local job that runs {away}, whose processes this machine cannot see; `vitctl forget {job}` "
                "there forgets it")
    return None
