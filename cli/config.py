"""`vitctl config list` and `show`: the presets, and the fully resolved config of one with overrides, as YAML."""

import click

from vitctl.trainer.config import preset_summaries, shadowed_file

from .commands import Deferred, summary
from .console import GivenText, err_console

wf = Deferred("vitctl.workflows.train")


@click.group(short_help=summary("config"))
def config() -> None:
    """Inspect run configs."""


@config.command()
@click.argument("preset", required=False, type=GivenText("give a preset name or a YAML file"))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override any config value, as `vitctl train --set` does (repeatable).")
def show(preset: str | None, overrides: tuple[str, ...]) -> None:
    """Print the config PRESET (a preset name or a YAML file, as --config takes; none: the built-in defaults that
    train runs without --config) resolves to; the output loads back as a preset file. Exits 1 after printing it if
    `vitctl train` would refuse it whatever the data, ranks and devices (train checks those at launch)."""
    if warning := shadowed_file(preset):
        err_console.print(f"warning: {warning}", highlight=False, markup=False, soft_wrap=True)
    text, problems, unread = wf.resolved_yaml(preset, list(overrides))
    click.echo(text, nl=False)
    for warning in unread:
        err_console.print(f"warning: {warning}", highlight=False, markup=False, soft_wrap=True)
    if problems:
        raise wf.ConfigError(f"vitctl train would refuse this config: {'; '.join(problems)}")


@config.command(name="list")
def list_presets() -> None:
    """The presets that --config and `config show` take by name."""
    for name, summary_line in preset_summaries().items():
        click.echo(f"{name:<22} {summary_line}")
