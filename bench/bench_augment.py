"""The recipe's GPU part (gpu_augment.augment_batch: RandAugment, colour jitter, normalisation, erasing) on one GPU:
GPU and host ms a batch, for each preset's recipe and batch, with the batch's draws drawn as the loaders draw them
(500x375 JPEGs' crops), and the kernels that take its GPU time. On the training stream the recipe's GPU time runs
between two training steps, so it is what a GPU loader adds to a step."""

import argparse
import itertools
import statistics
import time

import numpy as np
import torch
from bench_ops import time_ms  # bench/ is the script's folder

from vitctl.trainer.bench import cuda_or_exit
from vitctl.trainer.config import load_config
from vitctl.trainer.data import gpu_augment
from vitctl.trainer.data.augment import recipe_of
from vitctl.trainer.data.draws import draw_for_size, stack_draws


def batch_inputs(preset: str, batch: int, seed: int) -> tuple:
    recipe = recipe_of(load_config(preset, []))
    rng = np.random.default_rng(seed)
    drawn = stack_draws([draw_for_size((500, 375), recipe, rng) for _ in range(batch)])
    images = torch.randint(0, 256, (batch, 3, recipe.size, recipe.size), dtype=torch.uint8, device="cuda")
    return images, drawn, recipe


def host_ms(fn, repeats: int = 30) -> float:
    """Median host ms a call, each call queued behind a long GPU sleep so that it never waits for the GPU."""
    times = []
    for _ in range(repeats):
        torch.cuda._sleep(50_000_000)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def top_kernels(fn, repeats: int = 20, top: int = 12) -> list[tuple[str, float, int]]:
    """(kernel name, GPU us a call, launches a call), the costliest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key[:90], e.self_device_time_total / repeats, e.count // repeats) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    return sorted(rows, key=lambda row: -row[1])[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", default="swin_b_pretrain:128,vit_b16_pretrain:256", help="preset:batch, ...")
    parser.add_argument("--draws", type=int, default=8, help="batches of draws cycled through")
    parser.add_argument("--kernels", action="store_true", help="also print the costliest kernels")
    args = parser.parse_args()
    cuda_or_exit("python bench/bench_augment.py")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("\n| recipe | batch | GPU ms a batch | host ms a batch |\n|---|---:|---:|---:|")
    for case in args.cases.split(","):
        preset, batch = case.split(":")
        inputs = [batch_inputs(preset, int(batch), seed) for seed in range(args.draws)]
        turn = itertools.count()

        def call(inputs=inputs, turn=turn) -> torch.Tensor:
            return gpu_augment.augment_batch(*inputs[next(turn) % len(inputs)])

        gpu, _ = time_ms(call, warmup=2 * args.draws, repeats=4 * args.draws)
        print(f"| {preset} | {batch} | {gpu:.3f} | {host_ms(call):.2f} |", flush=True)
        if args.kernels:
            for name, us, launches in top_kernels(call, repeats=2 * args.draws):
                print(f"    {us:8.1f} us  x{launches:<3d} {name}")


if __name__ == "__main__":
    main()
