"""`vitctl train` and `vitctl finetune`: run a preset on this machine and print its metrics."""

from pathlib import Path

import click
from rich.table import Table

from vitctl.workflows import train as wf

from .console import console

PRECISIONS = click.Choice(["fp32", "bf16", "fp16", "bf16-pure"])


def run_options(command):
    options = [
        click.option("--config", "preset", help="Preset name (e.g. swin_b_pretrain) or a YAML file."),
        click.option("--data", type=click.Path(path_type=Path), help="Shard folder from `vitctl data shard`."),
        click.option("--out", type=click.Path(path_type=Path), help="Run folder (checkpoints, metrics)."),
        click.option("--gpus", type=click.IntRange(min=0), default=None,
                     help="GPUs on this machine, one process each [default: all visible]; 0 trains on the CPU."),
        click.option("--tasks-per-node", type=click.IntRange(min=1), default=1, show_default=True,
                     help="CPU ranks (gloo) when --gpus 0."),
        click.option("--model", help="Model name, e.g. vit_b16, swin_b."),
        click.option("--batch", type=click.IntRange(min=1), help="Batch size per rank."),
        click.option("--epochs", type=float),
        click.option("--steps", type=click.IntRange(min=1), help="Stop after this many optimizer steps."),
        click.option("--precision", type=PRECISIONS),
        click.option("--fused", help="Fused ops: all, none, or comma-separated seams; seam=impl picks one "
                     "(e.g. all,optimizer=apex)."),
        click.option("--compile/--no-compile", default=None, help="torch.compile the model."),
        click.option("--resume", is_flag=True, help="Continue the run in --out from its last checkpoint."),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="Override any config value, e.g. --set optim.lr=1e-3 (repeatable)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _flags(data, out, model, batch, epochs, steps, precision, fused, compile_, from_ckpt=None) -> dict:
    flags = {"data": {"path": str(data) if data else None, "batch_size": batch},
             "model": {"name": model},
             "train": {"out_dir": str(out) if out else None, "epochs": epochs, "max_steps": steps,
                       "precision": precision, "fused": fused, "compile": compile_},
             "finetune": {"from_ckpt": str(from_ckpt) if from_ckpt else None}}
    return {section: {k: v for k, v in values.items() if v is not None} for section, values in flags.items()}


def _run(preset, overrides, flags, gpus, tasks_per_node, resume) -> None:
    config = wf.build_config(preset, flags, list(overrides))
    gpus = wf.visible_gpus() if gpus is None else gpus
    console.print(f"[bold]{config.model.name}[/] on {config.data.path or 'synthetic data'} -> {config.train.out_dir} "
                  f"({gpus or tasks_per_node} {'GPU' if gpus else 'CPU'} rank(s), {config.train.precision}, "
                  f"fused {config.train.fused})", highlight=False)
    wf.run_local(config, gpus, tasks_per_node, resume)
    print_summary(Path(config.train.out_dir))


def print_summary(run_dir: Path) -> None:
    records = wf.read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_top1" in r]
    table = Table("step", "loss", "images/s", "eval top-1", "eval top-5", title=f"{run_dir}")
    for record in steps[-5:]:
        match = next((e for e in evals if e["step"] == record["step"]), {})
        table.add_row(str(record["step"]), f"{record['loss']:.4f}", f"{record['images_per_s']:.1f}",
                      f"{match['eval_top1']:.2f}" if match else "", f"{match['eval_top5']:.2f}" if match else "")
    console.print(table)
    last = wf.checkpoint.list_checkpoints(run_dir)
    if last:
        console.print(f"checkpoint: {last[-1]}")


@click.command()
@run_options
def train(preset, data, out, gpus, tasks_per_node, model, batch, epochs, steps, precision, fused, compile, resume,
          overrides) -> None:
    """Train a Swin or ViT from a preset on this machine (Slurm launch comes with `--nodes`)."""
    _run(preset, overrides, _flags(data, out, model, batch, epochs, steps, precision, fused, compile), gpus,
         tasks_per_node, resume)


@click.command()
@click.option("--from-ckpt", required=True, type=click.Path(path_type=Path),
              help="Our checkpoint, a timm or official Swin checkpoint, or a plain state_dict.")
@run_options
def finetune(from_ckpt, preset, data, out, gpus, tasks_per_node, model, batch, epochs, steps, precision, fused,
             compile, resume, overrides) -> None:
    """Finetune from a checkpoint: new head when classes differ, position tables resized to the new resolution."""
    _run(preset, overrides, _flags(data, out, model, batch, epochs, steps, precision, fused, compile, from_ckpt),
         gpus, tasks_per_node, resume)
