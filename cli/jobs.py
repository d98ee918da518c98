"""`vitctl status`, `jobs`, `logs`, `cancel`, `forget`: watch the jobs `vitctl train` submitted."""

import json
import math
import time
from pathlib import Path

import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Column, Table
from rich.text import Text

from vitctl.workflows import forget as forgetting
from vitctl.workflows import registry, status
from vitctl.workflows.errors import LaunchError

from .commands import summary
from .console import console, err_console

SPARKS = "▁▂▃▄▅▆▇█"
STATE_STYLE = {"RUNNING": "green", "COMPLETED": "bold green", "PENDING": "yellow", "REQUEUED": "yellow",
               "SUBMITTING": "yellow", "INTERRUPTED": "yellow", "FAILED": "bold red", "OUT_OF_MEMORY": "bold red",
               "NODE_FAIL": "red", "CANCELLED": "red", "TIMEOUT": "red"}
WATCH_INTERVAL_S = 2
SLURM_END_WAIT_S = 300  # for the ranks of a job scancel ended: KillWait is 30 s by default, and rarely above 120


def sparkline(values: list[float]) -> str:
    """One bar per value, scaled between the finite ones; a NaN or infinite value is a dot."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return "·" * len(values)
    low, high = min(finite), max(finite)
    return "".join(SPARKS[round((v - low) / (high - low) * 7) if high > low else 3] if math.isfinite(v) else "·"
                   for v in values)


def _eta(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return ""
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _rows(statuses: list[status.JobStatus]) -> list[list[str]]:
    rows = []
    for s in statuses:
        rate = f"{s.images_per_s[-1]:,.0f} {sparkline(s.images_per_s)}" if s.images_per_s else ""
        rows.append([s.job_id or "-", s.name, s.state, s.layout, s.elapsed,
                     f"{s.step}/{s.total_steps}" if s.step is not None else "",
                     f"{s.loss:.4f}" if s.loss is not None else "", rate, _eta(s.eta_s),
                     s.last_checkpoint or "", str(s.restarts), s.note])
    return rows


HEADERS = ["job", "name", "state", "layout", "elapsed", "step", "loss", "images/s", "ETA", "checkpoint",
           "restarts", "note"]


WHOLE = {"job", "name", "state", "checkpoint"}  # kept whole; a narrow terminal wraps the other columns first
# to the lines below the table, in this order, until it fits
NARROW_TERMINAL_MOVES = ("restarts", "checkpoint", "layout", "elapsed", "images/s")


def status_table(statuses: list[status.JobStatus], width: int | None = None) -> Group:
    """The rows of `_rows` as a table `width` wide (the terminal's), without the columns that say nothing in any row
    (ETA of ended jobs, no restarts); below it each job's note, whole, and where the terminal is narrow the columns
    that would not fit beside the others."""
    rows, width = _rows(statuses), width or console.width
    shown = [i for i in range(len(HEADERS) - 1) if i < 3 or any(row[i] not in ("", "0") for row in rows)]
    moved = []
    for name in NARROW_TERMINAL_MOVES:
        if Console(width=10**4).measure(_table(rows, shown)).maximum <= width:  # its natural width
            break
        if (i := HEADERS.index(name)) in shown:
            shown.remove(i)
            moved.append(i)
    below = []
    for row in rows:
        details = [f"{HEADERS[i]} {row[i]}" for i in moved if row[i] not in ("", "0")] + [row[-1]] * bool(row[-1])
        below += [Text(f"{row[0]}: {'; '.join(details)}")] if details else []
    return Group(_table(rows, shown), *below)


def _table(rows: list[list[str]], shown: list[int]) -> Table:
    # folded rather than cut: a cell that cannot fit goes on in the next line, never as `1…`
    table = Table(*(Column(HEADERS[i], no_wrap=HEADERS[i] in WHOLE, overflow="fold") for i in shown),
                  title="vitctl jobs")
    for row in rows:
        cells = [row[i] for i in shown]
        cells[2] = f"[{STATE_STYLE.get(row[2], 'white')}]{row[2]}[/]"
        table.add_row(*cells)
    return table


def _selected(job: str | None) -> list[registry.JobRecord]:
    return registry.find_records(job) if job is not None else registry.load_records()


def _print_plain(statuses: list[status.JobStatus], as_json: bool, watch: bool) -> None:
    """One snapshot for a pipe or a file: tab-separated rows under their header, or JSON (a line each, watching)."""
    if as_json:
        click.echo(json.dumps([s.to_dict() for s in statuses], indent=None if watch else 1, allow_nan=False))
        return
    click.echo("\t".join(HEADERS))
    for row in _rows(statuses):
        click.echo("\t".join(row))


def _refreshed(records: list[registry.JobRecord]) -> list[status.JobStatus]:
    """The jobs' statuses now, from their records as they are now: a `vitctl cancel` meanwhile marks them (read from
    the first snapshot's records, a job killed by a second cancel was shown FAILED)."""
    now = {r.key: r for r in registry.load_records()}
    return status.collect([now.get(r.key, r) for r in records])


@click.command(name="status", short_help=summary("status"))
@click.argument("job", required=False)
@click.option("--watch", is_flag=True, help="Refresh while a job is queued or running (piped: a snapshot every "
              f"{WATCH_INTERVAL_S} s).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status_command(job: str | None, watch: bool, as_json: bool) -> None:
    """State, progress, throughput and ETA of submitted jobs (JOB: id, run folder or job name)."""
    records = _selected(job)
    statuses = status.collect(records)
    if as_json or not console.is_terminal:
        _print_plain(statuses, as_json, watch)
        while watch and any(s.live for s in statuses):
            time.sleep(WATCH_INTERVAL_S)
            statuses = _refreshed(records)
            _print_plain(statuses, as_json, watch)
    elif watch:
        with Live(status_table(statuses), console=console, refresh_per_second=1) as live:
            while any(s.live for s in statuses):
                time.sleep(WATCH_INTERVAL_S)
                statuses = _refreshed(records)
                live.update(status_table(statuses))
    else:
        console.print(status_table(statuses))


@click.command(short_help=summary("jobs"))
def jobs() -> None:
    """The jobs this machine submitted (newest last)."""
    headers = ("job", "executor", "name", "run folder", "submitted")
    rows = [(r.job_id or "(submitting)", r.executor, r.name, r.run_dir,
             time.strftime("%Y-%m-%d %H:%M", time.localtime(r.submitted))) for r in registry.load_records()]
    if not console.is_terminal:  # piped: whole paths, one tab-separated line a job, as `status` prints them
        click.echo("\n".join("\t".join(row) for row in (headers, *rows)))
        return
    table = Table(*(Column(h, overflow="fold") for h in headers), title=str(registry.registry_path()))
    for row in rows:
        table.add_row(*row)
    console.print(table)


@click.command(short_help=summary("logs"))
@click.argument("job")
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True, help="Task (rank) whose log to show.")
@click.option("--follow", is_flag=True, help="Keep printing until the job ends.")
def logs(job: str, rank: int, follow: bool) -> None:
    """A task's log: its stdout and stderr (the trainer's log, where errors end up), merged in time order."""
    record = registry.find_record(job)
    paths = status.log_paths(record, rank)
    if not any(p.exists() for p in paths):
        _no_log(record, rank, follow)  # following a live job: it waits for the log
        _wait_for_log(record, rank, paths)
    shown = f"{paths[0]} and {paths[1].name}, merged by time"
    if len(found := [p for p in paths if p.exists()]) == 1 and not status.state_of(record).live:  # one was deleted
        shown = f"{found[0]} ({next(p for p in paths if p not in found).name} is missing)"
    click.echo(f"==> rank {rank} of job {record.job_id}: {shown} <==")
    tail = status.LogTail(list(paths))
    live = False
    while True:
        state = status.state_of(registry.reload(record))  # reloaded: a cancel meanwhile marks the record
        live = live or state.live
        ended = not follow or not state.live  # UNKNOWN too: nothing will write to it
        click.echo(tail.read(final=ended), nl=False)
        if ended:
            break
        time.sleep(1)
    if follow and state.state == "UNKNOWN" and (away := status.elsewhere(record)):
        err_console.print(f"note: not following: job {record.job_id} is a local job that runs {away}, whose "
                          f"processes this machine cannot see; `vitctl logs {record.job_id} --follow` there follows "
                          "it", highlight=False, soft_wrap=True)
    elif state.live:  # not followed: it goes on
        err_console.print(f"note: job {record.job_id} is {state.state}" + (f" ({state.note})" if state.note else "")
                          + f"; `vitctl logs {record.job_id} --follow` prints on until it ends", highlight=False,
                          soft_wrap=True)
    elif live or state.finished:  # how it ended, which the log's last lines need not say (a rank killed)
        ending = f"job {record.job_id} ended {state.state}" + (f": {state.note}" if state.note else "")
        if follow and state.state == "FAILED":  # a script that waits on the job sees it, ended before or after
            raise LaunchError(ending)
        err_console.print(f"note: {ending}", highlight=False, soft_wrap=True)


def _wait_for_log(record: registry.JobRecord, rank: int, paths: tuple[Path, Path]) -> None:
    """Until the rank's log appears; the error of an ended job's missing log if the job ends first."""
    state = status.state_of(record)
    note = f": {state.note}" if state.note else ""
    err_console.print(f"waiting for rank {rank} of job {record.job_id} to start ({state.state}{note})",
                      highlight=False, soft_wrap=True)
    while not any(p.exists() for p in paths):
        if not status.state_of(record).live:
            _no_log(record, rank, follow=False)
        time.sleep(1)


def _no_log(record: registry.JobRecord, rank: int, follow: bool) -> None:
    """Why a task has no log: its folder is gone, the job ended without starting it, or (unless following, which
    waits for it) it has not started yet."""
    state = status.state_of(record)
    where = f"job {record.job_id} ({state.state})"
    if not Path(record.folder).is_dir():
        raise registry.UnknownJobError(
            f"the logs of {where} are gone: its folder {record.folder} no longer exists (the run folder was moved or "
            "deleted); if you moved it, `vitctl logs NEW_PLACE` shows them and records where")
    note = f" ({state.note})" if state.note else ""
    if state.state == "UNKNOWN":
        raise registry.UnknownJobError(f"no log for rank {rank} of {where} in {record.folder}, and whether that rank "
                                       f"started cannot be told here{note}")
    if (ran := status.ran(record, rank)) or state.state == "COMPLETED":
        why = f"its result is in {record.folder}" if ran else "the job completed"
        raise registry.UnknownJobError(f"the log of rank {rank} of {where} is gone: the rank ran ({why}), but its "
                                       "log files were deleted")
    if not state.live:
        raise registry.UnknownJobError(f"{where} ended without a log for rank {rank} in {record.folder}: that rank "
                                       f"never started{note}")
    if not follow:
        raise registry.UnknownJobError(
            f"no log yet for rank {rank} of {where}: it appears in {record.folder} once the job starts; "
            f"`vitctl logs {record.job_id} --rank {rank} --follow` waits for it")


def _end_slurm_job(record: registry.JobRecord) -> None:
    """After scancel of a job that a first cancel did not stop: what its end kept, once Slurm has ended its ranks."""
    click.echo(f"ending job {record.job_id} ({record.name}) (scancel): Slurm kills its ranks that have not stopped "
               "within its KillWait; waiting for them to end")
    ended = status.wait_until_ended(record, SLURM_END_WAIT_S)
    if not ended.finished:
        raise LaunchError(f"job {record.job_id} is still {ended.state} after {SLURM_END_WAIT_S} s; `vitctl status "
                          f"{record.job_id}` shows when it has ended, and what it kept")
    if (step := status.stopped_at(record)) is not None:
        click.echo(f"ended job {record.job_id}: its ranks had checkpointed at step {step} on the first cancel before "
                   "they ended; nothing is lost, and --resume goes on from there")
    else:
        click.echo(f"ended job {record.job_id}: the first cancel had not stopped it (its ranks stop after their step "
                   f"and checkpoint, unless a hung rank holds them); {status.what_a_kill_lost(record)}")


@click.command(short_help=summary("cancel"))
@click.argument("job")
def cancel(job: str) -> None:
    """Cancel a job: a running one's ranks checkpoint, then stop (SIGTERM to them); a pending one leaves the queue;
    one that a first cancel did not stop (a hung rank) is ended at once by a second."""
    record = registry.find_record(job)
    if record.cancelled and (step := status.stopped_at(record)) is not None and not status.state_of(record).finished:
        click.echo(f"job {record.job_id} ({record.name}) has stopped: the first cancel had its ranks checkpoint at "
                   f"step {step}, and they are ending; nothing is lost, and --resume goes on from there")
        return
    if record.cancelled and status.kill(record):
        if record.executor == "slurm":
            _end_slurm_job(record)
            return
        click.echo(f"ended job {record.job_id} ({record.name}) at once (killed it): the first cancel had not stopped "
                   f"it yet (its ranks stop after their step and checkpoint, unless a hung rank holds them); "
                   f"{status.what_a_kill_lost(record)}")
        return
    found, requested = status.cancel(record)
    if requested and found.state == "PENDING":
        click.echo(f"cancelled job {record.job_id} ({record.name}) while it was pending: it leaves the queue; no rank "
                   "is running, so there is nothing to checkpoint")
    elif requested:
        click.echo(f"cancel requested for job {record.job_id} ({record.name}): its ranks checkpoint, then stop; "
                   f"`vitctl status {record.job_id}` shows when it has ended; if it does not stop, cancel again to "
                   "end it at once")
    elif found.state == "SUBMITTING":
        raise LaunchError(f"the job into {record.run_dir} is still being submitted ({found.note}); run `vitctl "
                          "cancel` again once `vitctl jobs` shows its id")
    else:
        reason = f": {found.note}" if found.note else ""
        verb = "has already ended" if found.finished else "is not running"
        click.echo(f"job {record.job_id} ({record.name}) {verb} ({found.state}{reason}); nothing to cancel")


@click.command(short_help=summary("forget"))
@click.argument("jobs", nargs=-1, metavar="[JOB]...")
@click.option("--gone", is_flag=True, help="Also every job whose run folder no longer exists (a moved one is found "
              "again by `vitctl status NEW_PLACE`, until it is forgotten).")
def forget(jobs: tuple[str, ...], gone: bool) -> None:
    """Drop ended jobs from the job list that status, logs and cancel read (JOB: a job id, or a run folder or name:
    all of its jobs); their run folders, checkpoints and logs are left as they are."""
    if not jobs and not gone:
        raise click.UsageError("name the jobs to forget (a job id, run folder or name; `vitctl jobs` lists them), or "
                               "give --gone for those whose run folder no longer exists")
    forgotten, kept = forgetting.forget(forgetting.selected(jobs, gone))
    for r in forgotten:
        click.echo(f"forgot job {r.job_id or '(never submitted)'} ({r.name}, {r.run_dir})")
    if forgotten:
        click.echo("nothing on disk was changed: run folders, checkpoints and logs stay where they are")
    elif not kept:
        click.echo(f"no job's run folder is gone: nothing to forget ({registry.registry_path()})")
    if kept:
        raise LaunchError("; ".join(f"kept job {r.job_id or '(submitting)'} ({r.name}): {why}" for r, why in kept))
