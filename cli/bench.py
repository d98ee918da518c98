"""`vitctl bench train`: our training step against timm's, side by side in one process."""

import click
from rich.markup import escape
from rich.table import Table

from vitctl.trainer.config import COMPILE_MODES, PRECISIONS
from vitctl.trainer.registry import MODELS

from .commands import Deferred, summary
from .console import console, err_console

wf = Deferred("vitctl.workflows.bench")
checks = Deferred("vitctl.workflows.doctor")


def _precision_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    if value is None:
        return None
    chosen = [p.strip() for p in value.split(",")]
    unknown = [p for p in chosen if p not in PRECISIONS]
    if unknown:
        raise click.BadParameter(f"{', '.join(map(repr, unknown))}: not a precision; choose from "
                                 f"{', '.join(PRECISIONS)}, e.g. --precisions bf16,bf16-pure")
    return chosen


@click.group(short_help=summary("bench"))
def bench() -> None:
    """Benchmarks (GPU)."""


@bench.command(name="train")
@click.option("--model", "model_name", type=click.Choice(list(MODELS)), default="vit_b16", show_default=True,
              help="Model to time (random weights, synthetic images).")
@click.option("--batch", type=click.IntRange(min=1), default=256, show_default=True, help="Images a step.")
@click.option("--precision", type=click.Choice(PRECISIONS), default="bf16", show_default=True,
              help="Mixed precision of our rows.")
@click.option("--precisions", callback=_precision_list, metavar="P1,P2,...",
              help=f"Several of {', '.join(PRECISIONS)}, comma-separated: the memory / speed table per precision.")
@click.option("--compile/--no-compile", "compile_", default=False, help="torch.compile our model.")
@click.option("--compile-mode", type=click.Choice(list(COMPILE_MODES)), default="default", show_default=True,
              help="torch.compile mode for our rows; reduce-overhead replays the step as CUDA graphs.")
@click.option("--fused", default="all", show_default=True, help="all, none, or comma-separated seams.")
@click.option("--compare", type=click.Choice(["timm"]), help="Also run timm's same model with the same loop.")
@click.option("--timm-setting", type=click.Choice(["strongest", "same"]), default="strongest", show_default=True,
              help="strongest: bf16 + compile + fused attention, under each compile mode (the faster is the baseline); "
                   "same: our precision and compile flags.")
@click.option("--img-size", type=click.IntRange(min=32), default=224, show_default=True, help="Image side, pixels.")
@click.option("--steps", type=click.IntRange(min=5), default=30, show_default=True,
              help="Timed steps; the figures are their medians.")
@click.option("--warmup", type=click.IntRange(min=1), default=10, show_default=True,
              help="Steps run before timing (compiling, autotuning).")
def train_bench(model_name, batch, precision, precisions, compile_, compile_mode, fused, compare, timm_setting,
                img_size, steps, warmup) -> None:
    """Images/s, ms/step, peak memory and MFU of a training step."""
    if compile_mode != "default" and not compile_:
        raise click.UsageError(f"--compile-mode {compile_mode} needs --compile")
    given = click.get_current_context().get_parameter_source
    if precisions and given("precision") is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError(f"--precision {precision} and --precisions: give one; --precisions "
                               f"{','.join([precision, *(p for p in precisions if p != precision)])} runs them all")
    if given("timm_setting") is click.core.ParameterSource.COMMANDLINE and not compare:
        raise click.UsageError(f"--timm-setting {timm_setting} needs --compare timm")
    try:
        wf.check_request(model_name, img_size, fused)
    except wf.ConfigError as e:  # what the options ask for cannot run: a usage error, as click's own
        raise click.UsageError(str(e)) from None
    results = wf.bench_train(model_name, batch, precisions or [precision], compile_, fused, compare, timm_setting,
                          img_size, steps, warmup, compile_mode)
    table = Table("model", "setting", "images/s (median step)", "ms/step (median)", "peak GiB", "MFU", "vs first",
                  title=f"{model_name}, batch {batch}, {img_size} px, {steps} timed steps after {warmup}")
    for r in results:
        table.add_row(r.name, r.setting, f"{r.images_per_s:,.0f}", f"{r.ms_per_step:.1f}", f"{r.peak_gib:.1f}",
                      f"{r.mfu:.1%}" if r.mfu is not None else "-", f"{r.images_per_s / results[0].images_per_s:.2f}x")
    console.print(table)
    for ops in sorted({r.ops for r in results if r.ops}):
        console.print(f"vitctl ops: {ops}", highlight=False)
    for optimizer in dict.fromkeys(r.optimizer for r in results):
        rows = ", ".join(str(i) for i, r in enumerate(results, 1) if r.optimizer == optimizer)
        console.print(f"optimizer in rows {rows}: {optimizer}", highlight=False)
    if compare:
        ours = max((r for r in results if r.name.startswith("vitctl")), key=lambda r: r.images_per_s)
        timm = max((r for r in results if r.name.startswith("timm")), key=lambda r: r.images_per_s)
        console.print(f"ours / timm: {ours.images_per_s / timm.images_per_s:.2f}x "
                      f"(our best: {ours.setting}; timm's best: {timm.setting})", highlight=False)


@click.command(short_help=summary("doctor"))
@click.option("--expect-image/--no-expect-image", default=None,
              help="Also check all the container image promises (prebuilt CUDA ops, apex, DALI, submitit, webdataset) "
                   "and exit 1 if any is missing [default: on where VITCTL_PREBUILT_OPS=1, as in the image].")
def doctor(expect_image: bool | None) -> None:
    """Which op implementations (reference, sdpa, apex, torch-fused, cuda) can run here and why not; how the CUDA ops
    were built; in the image, its self-test."""
    device, rows = wf.op_report()
    table = Table("op", "implementation", "available", title=f"vitctl ops on {device} ({checks.this_vitctl()})")
    for seam, name, reason in rows:
        table.add_row(seam, name, "[green]yes[/]" if reason is None else f"[red]no[/]: {reason}")
    console.print(table)
    builds = Table("function", "build", title="CUDA ops (vitctl_cuda_ops)")
    for name, state in checks.op_builds():
        builds.add_row(name, f"[green]{state}[/]" if state == "prebuilt" else state)
    console.print(builds)
    if not (checks.in_image() if expect_image is None else expect_image):
        return
    results = checks.image_checks()
    image = Table("promise", "kept", "detail", title="container image self-test")
    for check in results:
        image.add_row(check.name, "[green]yes[/]" if check.ok else "[red]no[/]", escape(check.detail))
    console.print(image)
    failed = [check.name for check in results if not check.ok]
    if failed:
        err_console.print(f"[bold red]error:[/] the image lacks {len(failed)} of what it promises: "
                          f"{', '.join(failed)}; rebuild it with `vitctl image build` (containers/README.md)",
                          highlight=False, soft_wrap=True)
        raise click.exceptions.Exit(1)
    console.print(f"image self-test passed: {len(results)} checks", highlight=False)
