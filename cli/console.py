"""Rich consoles, progress bars and value types shared by the commands."""

import errno
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from vitctl.workflows import slurm_time


class _StdoutConsole(Console):
    def on_broken_pipe(self) -> None:
        """Rich exits 1 here; raised on, a reader gone (`| head`) ends the command as such (cli/main.py)."""
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


console = _StdoutConsole()
err_console = Console(stderr=True)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class GivenPath(click.Path):
    """click.Path that refuses an empty value: "" (an unset shell variable) would otherwise mean the current folder;
    and, where it names a file (`dir_okay=False`, or `file_name` for one that is written), a trailing slash, which
    Path drops."""

    def __init__(self, *args, file_name: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.file_name = file_name

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("is empty (an unset shell variable?); give a path", param, ctx)
        if isinstance(value, str) and value.endswith("/") and (self.file_name or not self.dir_okay):
            self.fail(f"{value!r} ends with a slash, which names a folder; give a file's name", param, ctx)
        return super().convert(value, param, ctx)


class GivenText(click.ParamType):
    """A string that must not be empty: "" (an unset shell variable) would reach sbatch or srun as a value they refuse
    in words of their own (`invalid partition specified: (null)`), or be taken as no option at all."""

    name = "text"

    def __init__(self, advice: str = "give a value, or leave the option out") -> None:
        self.advice = advice

    def convert(self, value, param, ctx) -> str:
        if isinstance(value, str) and not value.strip():
            self.fail(f"is empty (an unset shell variable?); {self.advice}", param, ctx)
        return value


class SlurmTime(GivenText):
    """A positive time limit in one of Slurm's formats (30, 4:00:00, 1-12:00:00); whether it leaves time to train is
    checked at launch."""

    name = "time"

    def convert(self, value, param, ctx) -> str:
        value = super().convert(value, param, ctx)
        problem = slurm_time.limit_problem(value)
        if problem:
            self.fail(problem, param, ctx)
        return value


class ByteSize(click.ParamType):
    """Sizes such as 1GB, 500MB, 64KiB or a plain number of bytes; `at_least` (a size itself) the smallest taken."""

    name = "size"

    def __init__(self, at_least: str = "0") -> None:
        self.at_least = at_least

    def convert(self, value, param, ctx) -> int:
        size = value if isinstance(value, int) else self._bytes(value, param, ctx)
        if size < self._bytes(self.at_least, param, ctx):
            unit = "byte" if size == 1 else "bytes"
            self.fail(f"{value!r} is {size:,} {unit}; give at least {self.at_least}", param, ctx)
        return size

    def _bytes(self, value, param, ctx) -> int:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).upper() if match else None
        if unit not in _UNITS:
            self.fail(f"{value!r} is not a size; write e.g. 1GB, 500MB, 64KiB or a number of bytes", param, ctx)
        return int(float(match.group(1)) * _UNITS[unit])


class _Count(ProgressColumn):
    """`done/total unit`, or nothing while the total is not known yet (a listing phase)."""

    def __init__(self, unit: str) -> None:
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        if task.total is None:
            return Text("")
        return Text(f"{int(task.completed)}/{int(task.total)} {self.unit}".rstrip(), style="progress.download")


@dataclass(frozen=True)
class Bar:
    advance: Callable[[int], None]
    set_total: Callable[[int], None]
    phase: Callable[[str, int], None]  # a new description and total, counting again from 0


@contextmanager
def progress_bar(description: str, total: int | None = None, unit: str = "") -> Iterator[Bar]:
    """A rich progress bar on stderr (plain and quiet when stderr is not a terminal)."""
    count = [DownloadColumn(), TransferSpeedColumn()] if unit == "bytes" else [_Count(unit)]
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), *count, TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=err_console) as progress:
        task = progress.add_task(description, total=total)
        yield Bar(lambda n: progress.advance(task, n), lambda n: progress.update(task, total=n),
                  lambda text, n: progress.reset(task, total=n, description=text))
