"""`vitctl status`, `jobs`, `logs`, `cancel`: watch the jobs `vitctl train` submitted."""

import json
import time

import click
from rich.live import Live
from rich.table import Table

from vitctl.workflows import registry, status

from .console import console

SPARKS = "▁▂▃▄▅▆▇█"
STATE_STYLE = {"RUNNING": "green", "COMPLETED": "bold green", "PENDING": "yellow", "REQUEUED": "yellow",
               "FAILED": "bold red", "CANCELLED": "red", "TIMEOUT": "red"}


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    low, high = min(values), max(values)
    return "".join(SPARKS[round((v - low) / (high - low) * 7) if high > low else 3] for v in values)


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m" if seconds >= 3600 else f"{int(seconds)}s"


def _rows(statuses: list[status.JobStatus]) -> list[list[str]]:
    rows = []
    for s in statuses:
        rate = f"{s.images_per_s[-1]:,.0f} {sparkline(s.images_per_s)}" if s.images_per_s else ""
        rows.append([s.job_id, s.name, s.state, s.layout, s.elapsed,
                     f"{s.step}/{s.total_steps}" if s.step is not None else "",
                     f"{s.loss:.4f}" if s.loss is not None else "", rate, _eta(None if s.finished else s.eta_s),
                     s.last_checkpoint or "", str(s.restarts)])
    return rows


HEADERS = ["job", "name", "state", "nodes x GPUs", "elapsed", "step", "loss", "images/s", "ETA", "checkpoint",
           "restarts"]


def status_table(statuses: list[status.JobStatus]) -> Table:
    table = Table(*HEADERS, title="vitctl jobs")
    for row in _rows(statuses):
        row[2] = f"[{STATE_STYLE.get(row[2], 'white')}]{row[2]}[/]"
        table.add_row(*row)
    return table


def _selected(job: str | None) -> list[registry.JobRecord]:
    return [registry.find_record(job)] if job else registry.load_records()


@click.command(name="status")
@click.argument("job", required=False)
@click.option("--watch", is_flag=True, help="Refresh until every job has ended.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status_command(job: str | None, watch: bool, as_json: bool) -> None:
    """State, progress, throughput and ETA of submitted jobs (JOB: id or run folder)."""
    records = _selected(job)
    statuses = status.collect(records)
    if as_json:
        click.echo(json.dumps([s.to_dict() for s in statuses], indent=1))
    elif not console.is_terminal:
        click.echo("\t".join(HEADERS))
        for row in _rows(statuses):
            click.echo("\t".join(row))
    elif watch:
        with Live(status_table(statuses), console=console, refresh_per_second=1) as live:
            while not all(s.finished for s in statuses):
                time.sleep(2)
                statuses = status.collect(records)
                live.update(status_table(statuses))
    else:
        console.print(status_table(statuses))


@click.command()
def jobs() -> None:
    """The jobs this machine submitted (newest last)."""
    table = Table("job", "executor", "name", "run folder", "submitted", title=str(registry.registry_path()))
    for r in registry.load_records():
        submitted = time.strftime("%Y-%m-%d %H:%M", time.localtime(r.submitted))
        table.add_row(r.job_id, r.executor, r.name, r.run_dir, submitted)
    console.print(table)


@click.command()
@click.argument("job")
@click.option("--rank", default=0, show_default=True, help="Task (rank) whose log to show.")
@click.option("--follow", is_flag=True, help="Keep printing until the job ends.")
def logs(job: str, rank: int, follow: bool) -> None:
    """A task's log (stderr, where the trainer logs; stdout after it)."""
    record = registry.find_record(job)
    out, err = status.log_paths(record, rank)
    if not err.exists() and not follow:
        raise click.ClickException(f"no log yet for rank {rank} of job {record.job_id} ({err})")
    offset = 0
    while True:
        if err.exists():
            with open(err) as f:
                f.seek(offset)
                click.echo(f.read(), nl=False)
                offset = f.tell()
        if not follow or status.collect([record])[0].finished:
            break
        time.sleep(1)
    if out.exists() and out.stat().st_size:
        click.echo(out.read_text(), nl=False)


@click.command()
@click.argument("job")
def cancel(job: str) -> None:
    """Cancel a job (scancel on Slurm; the local executor's processes otherwise)."""
    record = registry.find_record(job)
    status.cancel(record)
    console.print(f"cancel requested for job {record.job_id} ({record.name})")
