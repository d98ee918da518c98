"""`vitctl export`: a run's weights as one safetensors file."""

from pathlib import Path

import click

from .commands import Deferred, summary
from .console import GivenPath, console

wf = Deferred("vitctl.workflows.export")


@click.command(short_help=summary("export"))
@click.argument("run", type=GivenPath(exists=True, path_type=Path))
@click.option("--out", required=True, type=GivenPath(file_name=True, path_type=Path),
              help="The .safetensors file to write.")
@click.option("--step", type=click.IntRange(min=0), help="The checkpoint of this step [default: the last].")
@click.option("--ema", is_flag=True, help="Export the EMA weights (runs with train.ema_decay) instead.")
def export(run: Path, out: Path, step: int | None, ema: bool) -> None:
    """Write RUN's weights (a run folder or one checkpoint folder) with timm's names: `finetune --from-ckpt` reads
    them, and timm through the `timm.create_model` call printed (with the model's class count and image size)."""
    done = wf.export_weights(run, out, step, ema)
    console.print(f"{done.out}: {done.model}, {done.tensors} tensors, {done.parameters:,} parameters "
                  f"({'EMA' if ema else 'weights'} of {done.checkpoint})\ntimm: {done.timm}", highlight=False,
                  soft_wrap=True)
