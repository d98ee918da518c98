"""`vitctl plan`: the layerwise parallel strategy for a job under a per-GPU memory budget, from a saved profile."""

from __future__ import annotations  # the annotations name the deferred workflow's types

import math
import shlex
from pathlib import Path

import click
from rich.columns import Columns
from rich.table import Table

from vitctl.trainer.registry import MODELS

from .commands import Deferred, summary
from .console import GivenPath, console, err_console

wf = Deferred("vitctl.workflows.plan")
PLANNING_ONLY = ("nodes", "memory_gib", "batch", "out", "profile")  # the options --profile-only has no use for


class GiB(click.FloatRange):
    """A positive, finite memory budget: nan passes FloatRange's comparisons, and the search divides it into steps."""

    def __init__(self) -> None:
        super().__init__(min=0, min_open=True)

    def convert(self, value, param, ctx) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number; give the memory of one GPU in GiB, e.g. 80", param, ctx)
        if number < 1 / 1024:  # the search's memory units would underflow (1e-308: an OverflowError)
            self.fail(f"{value!r} GiB is less than one MiB; give the memory of one GPU in GiB, e.g. 80", param, ctx)
        if number > wf.MOST_GIB:  # nvidia-smi shows MiB: 81559 for an 80 GB GPU
            self.fail(f"{number:g} GiB is more than any GPU holds (this takes {wf.MOST_GIB} at most); if that figure "
                      f"is MiB, as nvidia-smi shows it, pass --memory-gib {math.floor(number / 1024)}", param, ctx)
        return number


@click.command(short_help=summary("plan"))
@click.option("--model", "model_name", type=click.Choice(list(MODELS)), required=True)
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--gpus", type=click.IntRange(min=1),
              help="GPUs per node [default: all visible]. With --profile-only: the local ranks to measure "
                   "collectives among [default: every GPU, or 2 CPU ranks].")
@click.option("--memory-gib", type=GiB(), help="Memory budget per GPU, GiB.")
@click.option("--batch", type=click.IntRange(min=1), help="Global batch: all data-parallel ranks together.")
@click.option("--out", type=GivenPath(dir_okay=False, path_type=Path), help="The plan file to write (JSON).")
@click.option("--img-size", type=click.IntRange(min=32), default=224, show_default=True)
@click.option("--profile", type=GivenPath(dir_okay=False, path_type=Path),
              help="A profile from `vitctl plan --profile-only` [default: the cached or shipped one of this GPU "
                   "type; measured now on a GPU].")
@click.option("--profile-only", is_flag=True,
              help="Measure this machine's profile (blocks, collectives, optimizer), cache it and print where.")
def plan(model_name, nodes, gpus, memory_gib, batch, out, img_size, profile, profile_only) -> None:
    """Search the fastest layerwise strategy (tensor and pipeline parallel degrees, and per block FSDP or
    replicated weights and activation checkpointing) whose predicted memory fits --memory-gib per GPU, and write it
    for `vitctl train --plan OUT`."""
    try:
        wf.model_layout(model_name, img_size)  # a size the model cannot take is a usage error, as in bench
    except wf.ConfigError as e:
        raise click.UsageError(str(e)) from None
    if profile_only:
        if unused := _unused_by_profile_only():
            raise click.UsageError(f"--profile-only measures and caches this machine's profile, and plans nothing: it "
                                   f"does not use {', '.join(unused)}; drop them to measure (a later `vitctl plan` "
                                   f"reads the cached profile), or drop --profile-only to plan")
        if wf.local_device().type == "cpu":
            err_console.print("warning: this machine has no GPU: measuring its CPU, whose profile plans CPU ranks "
                              "only; to plan GPUs, run this on a GPU node", highlight=False, soft_wrap=True)
        path = wf.profile_only(model_name, img_size, gpus)
        if path is not None:
            console.print(f"profile: {path}", highlight=False, soft_wrap=True)
        return
    missing = [flag for flag, value in (("--memory-gib", memory_gib), ("--batch", batch), ("--out", out)) if not value]
    if missing:
        raise click.UsageError(f"planning needs {', '.join(missing)} (or --profile-only to measure a profile)")
    gpus = gpus or wf.visible_gpus()
    if not gpus:
        raise click.UsageError("this machine has no GPU: give --gpus, the GPUs per node of the job to plan")
    wf.check_out(out)
    request = wf.PlanRequest(model_name, img_size, nodes, gpus, memory_gib, batch, profile)
    outcome = wf.plan(request, lambda text: err_console.print(text, highlight=False, soft_wrap=True))
    console.print(f"profile: {outcome.profile_path} ({outcome.profile.device}, torch {outcome.profile.torch})",
                  highlight=False, soft_wrap=True)
    if warning := wf.cpu_profile_warning(outcome.profile, outcome.profile_path):
        err_console.print(f"warning: {warning}", highlight=False, soft_wrap=True)
    tables = [_uniform_table(outcome)]
    if outcome.result.best is not None:
        tables.insert(0, _plan_table(outcome))
    console.print(Columns(tables))
    if outcome.result.least is None:  # no layout runs: more memory would not help, as write_plan would advise
        raise wf.ConfigError(_indivisible_batch(outcome))
    wf.write_plan(outcome, out)
    console.print(f"plan: {out}  (train with {_train_flags(outcome, out)})", highlight=False, soft_wrap=True)


def _unused_by_profile_only() -> list[str]:
    """The planning options given beside --profile-only, which measures with the model, image size and --gpus only:
    ignored, --out would never be written."""
    ctx = click.get_current_context()
    return [param.opts[0] for param in ctx.command.params if param.name in PLANNING_ONLY
            and ctx.get_parameter_source(param.name) is not click.core.ParameterSource.DEFAULT]


def _train_flags(outcome: wf.PlanOutcome, out: Path) -> str:
    """The `vitctl train` flags that run the plan: its model, image size, ranks (CPU ranks, for a CPU profile's) and
    per-rank batch."""
    r = outcome.request
    flags = [f"--model {r.model}", f"--plan {shlex.quote(str(out))}", f"--batch {wf.per_rank_batch(outcome)}"]
    ranks = [f"--gpus {r.gpus}"] if outcome.profile.device != "cpu" else [f"--gpus 0 --tasks-per-node {r.gpus}"]
    flags += [f"--nodes {r.nodes}"] * (r.nodes > 1) + ranks  # a CPU profile's plan: CPU ranks, as it measured
    flags += [f"--set model.img_size={r.img_size}"] * (r.img_size != 224)
    return " ".join(flags)


def _indivisible_batch(outcome: wf.PlanOutcome) -> str:
    """No layout runs the batch (it does not divide over its data-parallel ranks, or gives a pipeline too few
    micro-batches); a multiple of the GPUs divides over every layout's, as one rank a GPU (DDP) has them all."""
    r, world = outcome.request, outcome.world
    fitting = [b for b in (r.batch // world * world, (r.batch // world + 1) * world) if b]
    return (f"no strategy can run a global batch of {r.batch} on {r.nodes} x {r.gpus} GPUs (the table says why each "
            f"cannot run); give a multiple of {world}, which divides over every layout's data-parallel ranks, e.g. "
            f"--batch {' or --batch '.join(map(str, fitting))}")


def _plan_table(outcome: wf.PlanOutcome) -> Table:
    best, layout = outcome.result.best, outcome.layout
    s, p = best.strategy, best.prediction
    table = Table("stage", "blocks", "block", "weights", "checkpoint", title=f"{outcome.request.model}: searched plan",
                  caption=f"{s.layout(outcome.world)}"
                          + (f", {s.microbatches} micro-batches ({s.schedule})" if s.pp > 1 else "")
                          + f"\n{p.step_s:.3g} s/step, {p.images_per_s:,.0f} images/s, {p.peak_gib:.3g} GiB peak/GPU "
                            f"+ {p.room_bytes / 2**30:.3g} for the allocator")
    for stage, prediction in enumerate(p.stages):
        for first, last in _groups(outcome, prediction.blocks):
            choice = s.blocks[first]
            table.add_row(str(stage), f"{first}-{last}" if last > first else str(first), layout.blocks[first].key,
                          "fsdp" if choice.fsdp else "dp", choice.checkpoint)
    return table


def _groups(outcome: wf.PlanOutcome, blocks: range) -> list[tuple[int, int]]:
    """Runs of consecutive blocks with the same shape and strategy: (first, last)."""
    key = lambda i: (outcome.layout.blocks[i].key, outcome.result.best.strategy.blocks[i])  # noqa: E731
    runs: list[tuple[int, int]] = []
    for i in blocks:
        if runs and key(runs[-1][1]) == key(i):
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _uniform_table(outcome: wf.PlanOutcome) -> Table:
    r = outcome.request
    replicated, fsdp = (room / 2**30 for room in wf.ALLOCATOR_ROOM)
    table = Table("strategy", "layout", "s/step", "images/s", "peak GiB", "fits",
                  title=f"{r.nodes} x {r.gpus} GPUs, batch {r.batch}, {r.memory_gib:g} GiB/GPU",
                  caption=f"a strategy fits with {replicated:g} GiB beside its peak for the allocator ({fsdp:g} "
                          f"with FSDP)")
    rows = ([outcome.result.best] if outcome.result.best else []) + list(outcome.result.uniform)
    for planned in rows:
        p = planned.prediction
        fits = "[green]yes[/]" if planned.fits else "[red]does not fit[/]" if p else f"[red]cannot run[/]: " \
            f"{planned.problem}"
        table.add_row(planned.name, planned.strategy.layout(outcome.world), *(
            [f"{p.step_s:.3g}", f"{p.images_per_s:,.0f}", f"{p.peak_gib:.3g}"] if p else ["-", "-", "-"]), fits)
    return table
