"""Entry point of the `vitctl` command."""

import contextlib
import errno
import os
import signal
import sys
from pathlib import Path

from .commands import INTERRUPTED, quiet_interrupt

with quiet_interrupt():
    import importlib
    from importlib.metadata import version

    import click
    from rich.markup import escape

    from vitctl.datasets.errors import DataError
    from vitctl.datasets.oserrors import as_data_error
    from vitctl.datasets.parallel import hangup_as_interrupt, terminated, termination_as_interrupt
    from vitctl.trainer.config import ConfigError
    from vitctl.workflows.errors import Interrupted, LaunchError
    from vitctl.workflows.process import skip_final_collection
    from vitctl.workflows.registry import UnknownJobError

    from .commands import COMMANDS
    from .console import err_console


class VitctlGroup(click.Group):
    """Loads each command as it runs (`status`, `logs`, `cancel` and `jobs` import no torch, which takes seconds, and
    `--help` lists the commands from their table); turns bad input (data, config, a failed rank, a file this user may
    not read) anywhere below into a one-screen message and exit status 1, and Ctrl-C into one line and exit status
    130."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        command = COMMANDS[name]
        with quiet_interrupt():
            module = importlib.import_module(f"vitctl.cli.{command.module}")
        return getattr(module, command.function or name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, COMMANDS[name].summary) for name in self.list_commands(ctx)])

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except Interrupted as e:  # a local job stopped on Ctrl-C: where it stopped, and how to go on
            err_console.print(f"interrupted: {escape(str(e))}", highlight=False, soft_wrap=True)
            ctx.exit(INTERRUPTED)
        except (DataError, ConfigError, LaunchError, UnknownJobError) as e:
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            ctx.exit(1)
        except KeyboardInterrupt:
            with contextlib.suppress(OSError):  # a terminal that hung up takes no more output
                err_console.print("interrupted", highlight=False)
            ctx.exit(INTERRUPTED)
        except OSError as e:
            if _output_lost(e):
                _say_output_lost(e)
                ctx.exit(READER_LEFT if e.errno == errno.EPIPE else 1)
            if e.errno == errno.ENAMETOOLONG:  # a path (--out, --data, a config file) that no file system takes
                err_console.print(f"[bold red]error:[/] a name in {escape(str(e.filename))} is longer than the file "
                                  "system allows (255 bytes a name): shorten it", highlight=False, soft_wrap=True)
                ctx.exit(1)
            if e.errno in (errno.EACCES, errno.EPERM) and e.filename is not None:  # a file inside a folder given
                err_console.print(f"[bold red]error:[/] {escape(str(as_data_error(e, Path.cwd())))}", highlight=False,
                                  soft_wrap=True)
                ctx.exit(1)
            raise


READER_LEFT = 128 + signal.SIGPIPE  # what a shell reports for a writer whose reader (`| head`) left: not a failure


def _output_lost(e: OSError) -> bool:
    """A write to stdout or stderr failed: a closed terminal (EIO), a full disk, a reader gone (EPIPE). Errors of the
    files a command works on name their file, or reach here as DataError."""
    return e.filename is None and e.errno in (errno.EIO, errno.ENOSPC, errno.EDQUOT, errno.EPIPE)


def _say_output_lost(e: OSError) -> None:
    """One line on stderr where it can still be written (not for EPIPE: a reader such as `head` left on purpose)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # or the interpreter's exit flushes stdout into the same error again
    if e.errno == errno.EPIPE:
        return
    with contextlib.suppress(OSError):
        err_console.print(f"[bold red]error:[/] the output could not be written ({escape(e.strerror or str(e))}); "
                          "what the command did before is done", highlight=False, soft_wrap=True)


@click.group(cls=VitctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version("vitctl"), prog_name="vitctl")
def cli() -> None:
    """vitctl: prepare ImageNet, train Swin and ViT, launch on Slurm, watch the jobs."""


def main() -> None:
    skip_final_collection()
    hangup_as_interrupt()
    termination_as_interrupt()  # `kill`, `timeout`, a batch system: as Ctrl-C, also while a command loads (torch)
    try:
        cli()
    finally:  # the command has ended: a Ctrl-C now would only break the interpreter's shutdown with a traceback
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if signal.getsignal(signal.SIGTERM) is terminated:  # nothing is left to remove: end as by default
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
