"""`vitctl train` and `vitctl finetune`: run a preset here or on Slurm (both through submitit)."""

from __future__ import annotations  # the annotations name the deferred workflow's types

from pathlib import Path

import click
from rich.table import Table

from vitctl.trainer.config import PRECISIONS, shadowed_file

from .commands import Deferred, summary
from .console import GivenPath, GivenText, SlurmTime, console, err_console

wf = Deferred("vitctl.workflows.train")
PRECISION_CHOICE = click.Choice(PRECISIONS)
PRESET = GivenText("give a preset name or a YAML file")


def run_options(command):
    options = [
        click.option("--config", "preset", type=PRESET, help="Preset name (e.g. swin_b_pretrain) or a YAML file "
                     "[default: the built-in defaults, as `vitctl config show` prints them]."),
        click.option("--data", type=GivenPath(path_type=Path), help="Shard folder from `vitctl data shard`."),
        click.option("--out", type=GivenPath(path_type=Path),
                     help="Run folder (checkpoints, metrics, logs) [default: the preset's train.out_dir]."),
        click.option("--model", type=GivenText("give a model name, e.g. vit_b16 or swin_t, or leave the option out"),
                     help="Model name, e.g. vit_b16, swin_b [default: the preset's]."),
        click.option("--batch", type=click.IntRange(min=1),
                     help="Samples per data-parallel rank and step (the ranks of a tensor- or pipeline-parallel group "
                     "share one batch) [default: the preset's; optim.lr scales with the global batch / 512]."),
        click.option("--epochs", type=float,
                     help="Epochs to train; the learning-rate schedule spans them [default: the preset's]."),
        click.option("--steps", type=click.IntRange(min=1),
                     help="Stop after this many optimizer steps, at most --epochs' (the schedule still spans "
                     "--epochs: a short test run)."),
        click.option("--precision", type=PRECISION_CHOICE, help="Mixed precision [default: the preset's]."),
        click.option("--fused", help="Fused ops: all, none, or comma-separated seams; seam=impl picks one "
                     "(e.g. all,optimizer=apex) [default: the preset's]."),
        click.option("--compile/--no-compile", default=None, help="torch.compile the model."),
        click.option("--plan", type=GivenPath(dir_okay=False, path_type=Path),
                     help="A parallel plan from `vitctl plan` (the same as --set parallel.plan=PATH)."),
        click.option("--resume", is_flag=True, help="Continue the run in --out from its last checkpoint."),
        click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="Override any config value, e.g. --set optim.lr=1e-3 (repeatable)."),
        # Where and how it runs.
        click.option("--executor", type=click.Choice(["slurm", "local"]),
                     help="slurm (sbatch) or local (this machine) [default: slurm when sbatch is found]."),
        click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Nodes (Slurm; the local executor runs on this one)."),
        click.option("--gpus", type=click.IntRange(min=0),
                     help="GPUs per node, one task each; 0 for CPU ranks [local default: all visible, or one CPU "
                     "rank where none is]."),
        click.option("--tasks-per-node", type=click.IntRange(min=1),
                     help="CPU ranks (gloo) per node when --gpus 0 [default: 1]."),
        click.option("--partition", type=GivenText(), help="Slurm partition [default: the cluster's]."),
        click.option("--account", type=GivenText(), help="Slurm account to charge [default: yours]."),
        click.option("--qos", type=GivenText(), help="Slurm quality of service [default: the account's]."),
        click.option("--time", type=SlurmTime(), default="24:00:00", show_default=True, help="Slurm time limit."),
        click.option("--cpus-per-gpu", type=click.IntRange(min=1),
                     help="CPUs per task (data loading) [default: data.workers + 1, at most a node's share]."),
        click.option("--mem", type=GivenText(), help="Memory per node, e.g. 400G."),
        click.option("--container-image", type=GivenText(),
                     help="pyxis/enroot image that holds this vitctl: `vitctl image build` writes one (a .sqsh)."),
        click.option("--container-mounts", type=GivenText(), help="pyxis mounts, e.g. /data:/data."),
        click.option("--max-requeues", type=click.IntRange(min=0), default=3, show_default=True,
                     help="Times a timed-out job is requeued from its checkpoint."),
        click.option("--dry-run", is_flag=True,
                     help="Print an sbatch script that runs this job (submit it as it is); submit nothing."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


# Each option that sets a config key: the key, and the flag as messages name it.
FLAG_KEYS = {"data": ("data.path", "--data"), "batch": ("data.batch_size", "--batch"),
             "model": ("model.name", "--model"), "out": ("train.out_dir", "--out"),
             "epochs": ("train.epochs", "--epochs"),
             "steps": ("train.max_steps", "--steps"), "precision": ("train.precision", "--precision"),
             "fused": ("train.fused", "--fused"), "compile": ("train.compile", "--compile/--no-compile"),
             "plan": ("parallel.plan", "--plan"), "from_ckpt": ("finetune.from_ckpt", "--from-ckpt"),
             "trust_checkpoint": ("finetune.trust_checkpoint", "--trust-checkpoint")}
FLAG_NAMES = dict(FLAG_KEYS.values())


def _flags(o: dict) -> dict:
    """The config keys the given options set, by section, paths as text. --trust-checkpoint unset is False, which
    sets nothing (--no-compile's False does)."""
    flags: dict[str, dict] = {}
    for option, (key, _) in FLAG_KEYS.items():
        value = o.get(option)
        if value is None or (option == "trust_checkpoint" and not value):
            continue
        section, name = key.split(".")
        flags.setdefault(section, {})[name] = str(value) if isinstance(value, Path) else value
    return flags


def _request(o: dict) -> wf.LaunchRequest:
    executor = o["executor"] or wf.default_executor()
    gpus = o["gpus"]
    if gpus is None:
        if executor == "slurm":
            raise wf.ConfigError("--executor slurm needs --gpus N (per node; 0 for CPU ranks with --tasks-per-node)")
        gpus = wf.visible_gpus()
    tasks = o["tasks_per_node"]
    if gpus and tasks not in (None, gpus):  # a GPU job runs one task per GPU: --tasks-per-node was ignored
        implied = " (this machine's GPUs, the local default)" if o["gpus"] is None else ""
        raise wf.ConfigError(f"--tasks-per-node {tasks} with --gpus {gpus}{implied}: vitctl runs one task per GPU, "
                             f"{gpus} per node; drop --tasks-per-node, or pass --gpus 0 --tasks-per-node {tasks} for "
                             "CPU ranks")
    return wf.LaunchRequest(executor, o["nodes"], gpus, tasks or 1, o["partition"], o["time"],
                            o["account"], o["qos"], o["cpus_per_gpu"], o["mem"], o["container_image"],
                            o["container_mounts"], o["max_requeues"])


def _run(o: dict, finetune: bool = False) -> None:
    if warning := shadowed_file(o["preset"]):
        err_console.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)
    config = wf.build_config(o["preset"], _flags(o), list(o["overrides"]), o["resume"], FLAG_NAMES)
    if finetune and not config.finetune.from_ckpt and o["resume"]:  # its checkpoints say what it started from
        config.finetune.from_ckpt = wf.resumed_finetune_source(config)
    if finetune and not config.finetune.from_ckpt:
        raise click.UsageError("vitctl finetune needs the weights to start from: pass --from-ckpt PATH (a run or "
                             "checkpoint folder, a `vitctl export` file, a timm or official Swin checkpoint)")
    request = _request(o)
    outcome = wf.launch(config, request, o["resume"], o["dry_run"],
                        lambda text: err_console.print(text, markup=False, highlight=False, soft_wrap=True))
    if o["dry_run"]:
        click.echo(outcome, nl=False)  # byte for byte: rich would wrap the srun line at the terminal's width
        return
    if outcome is None:  # nothing left to train (launch said so): the run as it stands
        print_summary(Path(config.train.out_dir), config.model.num_classes)
        return
    if request.executor == "slurm":
        console.print(f"submitted job {outcome.job_id} ({outcome.name}: {request.nodes} node(s) x "
                      f"{request.tasks} task(s)) -> {config.train.out_dir}\n"
                      f"watch it: vitctl status {outcome.job_id} --watch; vitctl logs {outcome.job_id} --follow",
                      highlight=False)
        return
    print_summary(Path(config.train.out_dir), config.model.num_classes)


SUMMARY_STEPS = 5  # logged steps the end-of-run table shows
SUMMARY_EVALS = 10  # evals it shows (a run of 300 epochs evaluates 300 times), and the best one


def print_summary(run_dir: Path, classes: int) -> None:
    """The end-of-run table: the last logged steps and evals, and the best eval (top-5 where the model has more than 5
    classes)."""
    records = wf.read_metrics(run_dir)
    steps = [r for r in records if "loss" in r]
    every_eval = {r["step"]: r for r in records if "eval_top1" in r}
    last_evals = sorted(every_eval)[-SUMMARY_EVALS:]
    # of evals tied at the best top-1, the latest: nearest the checkpoint the run ends with
    best = max(every_eval, key=lambda s: (every_eval[s]["eval_top1"], s), default=None)
    extra = [] if best is None or best in last_evals else [best]
    evals = {step: every_eval[step] for step in [*last_evals, *extra]}
    ema = any("eval_ema_top1" in r for r in evals.values())  # runs with train.ema_decay
    top5 = classes > 5  # of 5 classes or fewer, every image is in its top 5
    keys = ["eval_top1", *(["eval_top5"] if top5 else []), *(["eval_ema_top1"] if ema else [])]
    by_step = {r["step"]: r for r in steps}
    shown = sorted({r["step"] for r in steps[-SUMMARY_STEPS:]} | evals.keys())
    cut = len(by_step) > SUMMARY_STEPS or len(every_eval) > len(evals)
    evals_shown = "every eval" if len(evals) == len(every_eval) else \
        f"the last {SUMMARY_EVALS} of {len(every_eval)} evals" + (f" and the best one (step {best})" if extra else "")
    table = Table("step", "loss", "images/s", "eval top-1", *(["eval top-5"] if top5 else []),
                  *(["EMA top-1"] if ema else []),
                  title=f"{run_dir}", caption=f"the last {min(SUMMARY_STEPS, len(by_step))} of {len(by_step)} logged "
                                              f"steps, and {evals_shown}; all in metrics.jsonl" if cut else None)
    for step in shown:
        record, match = by_step.get(step, {}), evals.get(step, {})
        table.add_row(str(step), f"{record['loss']:.4f}" if record else "",
                      f"{record['images_per_s']:.1f}" if record else "",
                      *(f"{match[key]:.2f}" if key in match else "" for key in keys))  # a resumed run may lack EMA
    console.print(table)
    last = wf.checkpoint.list_checkpoints(run_dir)
    if last:
        console.print(f"checkpoint: {last[-1]}")


@click.command(short_help=summary("train"))
@run_options
def train(**options) -> None:
    """Train a Swin or ViT from a preset, on this machine or on Slurm (`--nodes 2 --gpus 8`)."""
    _run(options)


@click.command(short_help=summary("finetune"))
@click.option("--from-ckpt", type=GivenPath(path_type=Path),
              help="Our checkpoint, a timm or official Swin checkpoint, or a plain state_dict (or --set "
                   "finetune.from_ckpt=PATH, or a preset that sets it).")
@click.option("--trust-checkpoint", is_flag=True,
              help="Unpickle --from-ckpt in full when it holds Python objects besides tensors (as checkpoints saved by "
                   "official Swin's or timm's training code do). That can run code: only for files you trust.")
@run_options
def finetune(**options) -> None:
    """Finetune from a checkpoint: new head when classes differ, position tables resized to the new resolution."""
    _run(options, finetune=True)


@click.command(short_help=summary("rank"))
@click.option("--config", "preset", type=PRESET, help="Preset name or a YAML file.")
@click.option("--data", type=GivenPath(path_type=Path), help="Shard folder.")
@click.option("--out", type=GivenPath(path_type=Path), help="Run folder (shared by all ranks).")
@click.option("--steps", type=click.IntRange(min=1), help="Stop after this many optimizer steps.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config value.")
@click.option("--max-requeues", type=click.IntRange(min=0), default=3, show_default=True,
              help="How often the time limit may requeue the Slurm job (Slurm's count of requeues, pre-emptions too).")
def rank(preset, data, out, steps, overrides, max_requeues) -> None:
    """Run one rank of a job started by srun (the sbatch templates in slurm/) or torchrun."""
    wf.run_one_rank(wf.build_config(preset, _flags({"data": data, "out": out, "steps": steps}), list(overrides)),
                    max_requeues)
