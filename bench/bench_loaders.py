"""Training throughput on real-size JPEGs, each loader beside synthetic data in one process on one GPU.

One compiled training step (the preset's model, bf16-pure, fused ops, compile reduce-overhead) is fed by: a batch
resident on the GPU (synthetic), vitctl's DALI path, vitctl's index loader (data.decode's default, or each of its
branches), and timm's `create_loader` (PIL workers, the same recipe) over the same generated JPEGs (500x375, ~110 KB,
as ImageNet's). Every loader applies the preset's full augmentation recipe. Each row times `--steps` steps after
`--warmup`, wall clock from the first timed step to a synchronize after the last, so stalls count; it also prints the
longest step (an epoch-start stall shows there) and the time spent waiting for the next batch. The step has no mixup
(it is the same GPU work for every loader). Every row runs on the trainer's CUDA stream (parallel.own_stream);
--against-default-stream also times each on CUDA's legacy default stream."""

import argparse
import contextlib
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from bench_data import ensure_images

from vitctl.trainer.bench import cuda_or_exit, training_step
from vitctl.trainer.config import LOADER_BRANCHES, load_config
from vitctl.trainer.data import build_data
from vitctl.trainer.data.augment import Recipe, recipe_of
from vitctl.trainer.models import build_model
from vitctl.trainer.ops import resolve
from vitctl.trainer.parallel import own_stream, widen_cuda_queues
from vitctl.trainer.precision import Precision

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


def prepare(work: Path, images: int) -> tuple[Path, Path]:
    """JPEGs under work/jpeg/train/<wnid>/, and vitctl's shards and index files of them under work/shards."""
    root, shards = work / "jpeg", work / "shards"
    ensure_images(root, images)
    made_from = shards / "images.json"  # the JPEGs' marker when these shards were made: a regeneration remakes them
    if not made_from.is_file() or made_from.read_text() != (root / "complete.json").read_text():
        shutil.rmtree(shards, ignore_errors=True)
        cli = [sys.executable, "-m", "vitctl.cli", "data"]
        subprocess.run([*cli, "shard", str(root), "--out", str(shards), "--split", "train", "--maxsize", "100MB"],
                       check=True)
        subprocess.run([*cli, "index", str(shards)], check=True)
        made_from.write_text((root / "complete.json").read_text())
    return root, shards


def vitctl_batches(preset: str, overrides: list[str], shards: Path, source: str, batch: int, workers: int) -> Batches:
    config = load_config(preset, [*overrides, f"data.path={shards}", f"data.source={source}",
                                  f"data.batch_size={batch}", f"data.workers={workers}"])
    data = build_data(config, 0, 1, torch.device("cuda"))
    return ((images, labels) for images, labels, _ in data.train(0, 0))


def timm_batches(root: Path, recipe: Recipe, batch: int, workers: int) -> Batches:
    from timm.data import ImageDataset, create_loader

    loader = create_loader(
        ImageDataset(str(root / "train")), input_size=(3, recipe.size, recipe.size), batch_size=batch,
        is_training=True, scale=(recipe.min_scale, 1.0), hflip=0.5 if recipe.hflip else 0.0,
        color_jitter=recipe.color_jitter, auto_augment=recipe.rand_augment, interpolation=recipe.interpolation,
        re_prob=recipe.reprob, re_mode=recipe.remode, re_count=recipe.recount, mean=recipe.mean, std=recipe.std,
        num_workers=workers, pin_memory=True, persistent_workers=True)
    return itertools.chain.from_iterable(itertools.repeat(loader))


def synthetic_batches(batch: int, size: int) -> Batches:
    images = torch.randn(batch, 3, size, size, device="cuda")
    labels = torch.randint(0, 1000, (batch,), device="cuda")
    return itertools.repeat((images, labels))


def run(step: Callable | None, batches: Batches, warmup: int, steps: int) -> dict[str, float]:
    """Seconds to the first batch (the loader's start), then throughput over `steps` steps (wall clock,
    synchronized at the end), the longest step and the data wait; with no step, what the loader alone delivers."""
    step = step or (lambda images, labels: None)
    begin = time.perf_counter()
    first = next(batches)
    first_batch_s = time.perf_counter() - begin
    print(f"  first batch after {first_batch_s:.1f} s", flush=True)
    for images, labels in itertools.chain([first], itertools.islice(batches, warmup - 1)):
        step(images, labels)
    torch.cuda.synchronize()
    step_s, wait_s = [], 0.0
    start = last = time.perf_counter()
    for _ in range(steps):
        images, labels = next(batches)
        got = time.perf_counter()
        step(images, labels)
        now = time.perf_counter()
        wait_s += got - last
        step_s.append(now - last)
        last = now
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    return {"first_batch_s": first_batch_s, "images_per_s": steps * images.shape[0] / total,
            "longest_step_s": max(step_s),
            "median_step_s": statistics.median(step_s), "data_wait_s_per_step": wait_s / steps}


def main() -> None:
    widen_cuda_queues()  # as a training rank does
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="swin_b_pretrain")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--images", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per loader (62 steps are an epoch of "
                                                                "8,000 images at batch 128: epoch starts are timed)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--loaders", default="synthetic,dali,index,timm",
                        help="any of synthetic, dali, index (data.decode's default: nvjpeg), index-pil, "
                             "index-pil-crop, index-nvjpeg (the index loader's branches), timm")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_loaders"))
    parser.add_argument("--no-model", action="store_true", help="time the loaders alone (no training step)")
    parser.add_argument("--against-default-stream", action="store_true",
                        help="time each loader twice on the trainer's stream and twice on CUDA's legacy default "
                             "stream, alternately")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with more than 1: each loader's rounds alternate with synthetic rounds, each against "
                             "the mean of the synthetic rounds either side of it, and the median ratio is printed")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every loader, e.g. augment.rand_augment=null (crop and flip only)")
    args = parser.parse_args()
    cuda_or_exit("python bench/bench_loaders.py")
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must each be at least 1")
    root, shards = prepare(args.work, args.images)
    config = load_config(args.preset, [*args.overrides, f"data.batch_size={args.batch}"])
    recipe = recipe_of(config)
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    ops = resolve(config.train.fused, device, compiling=True)
    model = None if args.no_model else build_model(config.model, ops).to(device).train()
    step = None if args.no_model else training_step(model, Precision("bf16-pure", device), True, ops.optimizer,
                                                     "reduce-overhead")
    step_line = "no training step" if args.no_model else \
        f"bf16-pure + compile (reduce-overhead), fused {config.train.fused}"
    print(f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}; {args.preset}: "
          f"{config.model.name} b{args.batch}, {step_line}; "
          f"recipe {recipe}; {args.images} JPEGs; {args.workers} loader workers", flush=True)
    def ours(source: str, *overrides: str) -> Batches:
        return vitctl_batches(args.preset, [*args.overrides, *overrides], shards, source, args.batch, args.workers)

    sources = {"synthetic": lambda: synthetic_batches(args.batch, recipe.size), "dali": lambda: ours("dali"),
               "index": lambda: ours("webdataset"),
               **{f"index-{branch}": lambda branch=branch: ours("webdataset", f"data.decode={branch}")
                  for branch in LOADER_BRANCHES},
               "timm": lambda: timm_batches(root, recipe, args.batch, args.workers)}
    if args.rounds > 1:
        with own_stream(device):
            alternate(step, sources, args.loaders.split(","), args.rounds, args.warmup, args.steps)
        return
    # own_stream: the stream the trainer runs on
    streams = [("", own_stream)]
    if args.against_default_stream:
        streams = [(f", {label} stream, round {i}", stream) for i in (1, 2)
                   for label, stream in (("trainer's", own_stream), ("default", lambda _: contextlib.nullcontext()))]
    results = {}
    for name in args.loaders.split(","):
        try:
            batches = sources[name]()
            for suffix, stream in streams:
                with stream(device):
                    results[name + suffix] = run(step, batches, args.warmup, args.steps)
                print(f"{name + suffix}: {results[name + suffix]}", flush=True)
        except Exception as error:  # a loader that fails still leaves the others' rows
            print(f"{name}: failed: {type(error).__name__}: {error}", flush=True)
    reference = {suffix: results.get("synthetic" + suffix, {}).get("images_per_s") for suffix, _ in streams}
    print("\n| loader | first batch (s) | img/s | vs synthetic | longest step (s) | median step (s) | "
          "data wait per step (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        same = next(ref for suffix, ref in reference.items() if name.endswith(suffix))
        ratio = f"{r['images_per_s'] / same:.2f}x" if same else ""
        print(f"| {name} | {r['first_batch_s']:.1f} | {r['images_per_s']:,.0f} | {ratio} | {r['longest_step_s']:.3f} | "
              f"{r['median_step_s']:.4f} | {r['data_wait_s_per_step']:.4f} |")


def alternate(step: Callable | None, sources: dict[str, Callable[[], Batches]], names: list[str], rounds: int,
              warmup: int, steps: int) -> None:
    """Each loader's rounds between synthetic ones, so that the GPU's drift over a call (clocks, heat) cancels."""
    synthetic = sources["synthetic"]()
    print("\n| loader | round | synthetic before | loader img/s | synthetic after | vs synthetic | longest step (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in (n for n in names if n != "synthetic"):
        batches, ratios = sources[name](), []
        before = run(step, synthetic, warmup, steps)["images_per_s"]
        for i in range(1, rounds + 1):
            r = run(step, batches, warmup if i == 1 else 5, steps)
            after = run(step, synthetic, 5, steps)["images_per_s"]
            ratios.append(r["images_per_s"] * 2 / (before + after))
            print(f"| {name} | {i} | {before:,.0f} | {r['images_per_s']:,.0f} | {after:,.0f} | {ratios[-1]:.3f}x | "
                  f"{r['longest_step_s']:.3f} |", flush=True)
            before = after
        print(f"| {name} | median | | | | **{statistics.median(ratios):.3f}x** | |", flush=True)


if __name__ == "__main__":
    main()
