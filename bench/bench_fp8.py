"""float8 training speed on one GPU, in one process: per model, timm's strongest setting, ours in bf16-pure and ours
in fp8 with each recipe, all compiled (ours with every fused op), and with --te-recipes our model on Transformer
Engine's float8 modules (fp8_te.py); images/s, peak memory and the ratios to timm and to our bf16-pure. Each row is
the training step of `vitctl bench train` (trainer/bench.py): synthetic batch resident on the GPU, warm-up steps,
then the median of steps timed back to back with CUDA events."""

import argparse
import gc
import importlib.metadata
import time
from dataclasses import dataclass

import torch
from fp8_te import TE_MODES, TE_RECIPES, TEAutocast, TEGraphed, convert_to_te

from vitctl.trainer.bench import TIMM_STRONGEST, BenchResult, cuda_or_exit, measure, timm_model
from vitctl.trainer.config import COMPILE_MODES, FP8_RECIPES, ModelConfig, TrainConfig
from vitctl.trainer.fp8 import convert_to_float8
from vitctl.trainer.models import MODELS, build_model
from vitctl.trainer.ops import resolve
from vitctl.trainer.precision import Precision

BATCHES = {"vit_b16": 256, "vit_l16": 128, "swin_b": 128}  # ViT-B and Swin-B as docs/performance.md has them
IMG_SIZE = 224


@dataclass
class Row:
    model: str
    batch: int
    label: str  # timm | bf16-pure | fp8 <recipe>
    result: BenchResult


def ours(name: str, batch: int, flops: float, recipe: str | None, min_width: int, args: argparse.Namespace
         ) -> BenchResult:
    """Our model compiled with every fused op, bf16-pure, its blocks' matmuls at least min_width wide in float8 when
    `recipe` is given."""
    device = torch.device("cuda")
    model = build_model(ModelConfig(name=name, img_size=IMG_SIZE, drop_path=0.0),
                        resolve("all", device, compiling=True)).to(device)
    if recipe is not None:
        convert_to_float8(model, recipe, fsdp=False, min_width=min_width)
    setting = f"fp8 {recipe}" if recipe else "bf16-pure"
    # fp8 is bf16-pure's step (bf16 model, fp32 masters, one optimizer kernel) on the float8 model.
    return measure(f"vitctl {name}", setting, model, Precision("bf16-pure", device), True, batch, IMG_SIZE,
                   flops, args.steps, args.warmup, args.compile_mode)


def ours_on_te(name: str, batch: int, flops: float, recipe: str, min_width: int, mode: str,
               args: argparse.Namespace) -> BenchResult:
    """Our model, bf16-pure, with Transformer Engine's float8 modules (`recipe`) in the blocks at least min_width
    wide; eager, as TE's CUDA graphs of the model eager ("graphs") or compiled ("compiled-graphs"), or compiled in
    `mode`."""
    device = torch.device("cuda")
    compiling = mode in COMPILE_MODES  # the whole step; "compiled-graphs" compiles the model inside TE's graphs
    model = build_model(ModelConfig(name=name, img_size=IMG_SIZE, drop_path=0.0),
                        resolve("all", device, compiling=mode not in ("eager", "graphs"))).to(device)
    convert_to_te(model, min_width)
    graphed = mode in ("graphs", "compiled-graphs")
    wrapped = TEGraphed(model, recipe, mode == "compiled-graphs") if graphed else TEAutocast(model, recipe)
    return measure(f"vitctl {name}", f"te {recipe} {mode}", wrapped, Precision("bf16-pure", device), compiling, batch,
                   IMG_SIZE, flops, args.steps, args.warmup, mode if compiling else "default")


def timm(name: str, batch: int, flops: float, args: argparse.Namespace) -> BenchResult:
    return measure(f"timm {MODELS[name].timm_name}", TIMM_STRONGEST, timm_model(name, IMG_SIZE, fused_attn=True),
                   Precision("bf16", torch.device("cuda")), True, batch, IMG_SIZE, flops, args.steps, args.warmup,
                   args.compile_mode)


def rows_of(name: str, args: argparse.Namespace) -> list[Row]:
    batch = BATCHES[name]
    cpu = torch.device("cpu")
    flops = 3 * build_model(ModelConfig(name=name, img_size=IMG_SIZE), resolve("none", cpu)).flops_per_image()
    runs = [("timm", lambda: timm(name, batch, flops, args)),
            ("bf16-pure", lambda: ours(name, batch, flops, None, 0, args))]
    runs += [(f"fp8 {recipe}" + (f", width >= {width}" if width else ""),
              lambda recipe=recipe, width=width: ours(name, batch, flops, recipe, width, args))
             for recipe in args.recipes.split(",") for width in args.min_widths]
    runs += [(f"te {recipe} {mode}" + (f", width >= {width}" if width else ""),
              lambda recipe=recipe, width=width, mode=mode: ours_on_te(name, batch, flops, recipe, width, mode, args))
             for recipe in args.te_recipes for mode in args.te_modes for width in args.min_widths]
    rows = []
    for label, run in runs:
        start = time.perf_counter()
        try:
            rows.append(Row(name, batch, label, run()))
        except Exception as e:  # noqa: BLE001 -- a TE row that fails is reported; the other rows still run
            if not label.startswith("te "):
                raise
            print(f"{name} b{batch} {label}: failed, {type(e).__name__}: {str(e)[:300]}", flush=True)
            _release()
            continue
        print(f"{name} b{batch} {label}: {rows[-1].result.images_per_s:,.0f} img/s, {rows[-1].result.peak_gib:.1f} "
              f"GiB ({time.perf_counter() - start:.0f} s with its compile)", flush=True)
        _release()
    return rows


def _release() -> None:
    """Drop the compiled graphs (and their CUDA graph pools) of the row before, so each row starts clean."""
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def table(rows: list[Row]) -> str:
    lines = ["| model | batch | setting | images/s | ms/step (median) | peak GiB | MFU (bf16 peak) | vs timm | "
             "vs our bf16-pure |", "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        same = {r.label: r.result for r in rows if r.model == row.model}
        r = row.result
        mfu = "-" if r.mfu is None else f"{r.mfu:.1%}"
        lines.append(f"| {row.model} | {row.batch} | {row.label} | {r.images_per_s:,.0f} | {r.ms_per_step:.1f} | "
                     f"{r.peak_gib:.1f} | {mfu} | {r.images_per_s / same['timm'].images_per_s:.2f}x | "
                     f"{r.images_per_s / same['bf16-pure'].images_per_s:.2f}x |")
    return "\n".join(lines)


def _names(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def version_of(package: str) -> str:
    """torchao serves the tensorwise and rowwise recipes, transformer_engine the TE rows."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default=",".join(BATCHES), help=f"comma-separated, of {', '.join(BATCHES)}")
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default="reduce-overhead",
                        help="for every row; reduce-overhead (CUDA graphs) keeps Swin's many kernels GPU-bound")
    parser.add_argument("--recipes", default=",".join(FP8_RECIPES), help="comma-separated fp8 recipes")
    parser.add_argument("--min-widths", type=lambda s: [int(w) for w in s.split(",")],
                        default=[TrainConfig().fp8_min_width],
                        help="comma-separated train.fp8_min_width values, each recipe's row once per value")
    parser.add_argument("--te-recipes", type=_names, default=[],
                        help=f"comma-separated Transformer Engine recipes, of {', '.join(TE_RECIPES)}")
    parser.add_argument("--te-modes", type=_names, default=["eager"],
                        help=f"comma-separated, of {', '.join(TE_MODES)}, {', '.join(COMPILE_MODES)}: how the TE rows "
                             "run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    cuda_or_exit("python bench/bench_fp8.py")
    models = args.models.split(",")
    if unknown := [m for m in models if m not in BATCHES]:
        parser.error(f"--models: {', '.join(unknown)} not among {', '.join(BATCHES)}")
    if unknown := set(args.recipes.split(",")) - set(FP8_RECIPES):
        parser.error(f"--recipes: {', '.join(sorted(unknown))} not among {', '.join(FP8_RECIPES)}")
    if unknown := set(args.te_recipes) - set(TE_RECIPES):
        parser.error(f"--te-recipes: {', '.join(sorted(unknown))} not among {', '.join(TE_RECIPES)}")
    if unknown := set(args.te_modes) - {*TE_MODES, *COMPILE_MODES}:
        parser.error(f"--te-modes: {', '.join(sorted(unknown))} not among {', '.join((*TE_MODES, *COMPILE_MODES))}")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, torchao {version_of('torchao')}, "
          f"transformer_engine {version_of('transformer_engine')}, "
          f"compile mode {args.compile_mode}, {args.warmup} warm-up + median of {args.steps} steps", flush=True)
    rows = [row for name in models for row in rows_of(name, args)]
    print(f"\ntimm: {TIMM_STRONGEST}; ours: --fused all, compiled, bf16 weights with fp32 masters\n")
    print(table(rows))


if __name__ == "__main__":
    main()
