"""Entry point of the `vitctl` command."""

from importlib.metadata import version

import click
from rich.markup import escape

from vitctl.datasets.errors import DataError
from vitctl.workflows.registry import UnknownJobError
from vitctl.workflows.train import ConfigError, LaunchError

from .bench import bench, doctor
from .console import err_console
from .data import data
from .export import export
from .jobs import cancel, jobs, logs, status_command
from .train import finetune, rank, train


class VitctlGroup(click.Group):
    """Turns bad input (data, config, a failed rank) anywhere below into a one-screen message and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (DataError, ConfigError, LaunchError, UnknownJobError) as e:
            err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
            ctx.exit(1)


@click.group(cls=VitctlGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version("vitctl"), prog_name="vitctl")
def cli() -> None:
    """vitctl: prepare ImageNet, train Swin and ViT, launch on Slurm, watch the jobs."""


cli.add_command(data)
cli.add_command(train)
cli.add_command(finetune)
cli.add_command(bench)
cli.add_command(doctor)
for command in (export, status_command, jobs, logs, cancel, rank):
    cli.add_command(command)


def main() -> None:
    cli()
