"""Building a large model the old way (whole, on the CPU, initialised) against meta-device initialisation of one
pipeline stage of two (built on the meta device, the other stage's parts dropped, this stage's allocated and
initialised on the CPU): seconds and peak host memory of each, each in a fresh process so that peaks do not mix.

    python bench/meta_init.py --model swin_h
"""

import argparse
import resource
import subprocess
import sys
import time

import torch

from vitctl.trainer.config import ModelConfig
from vitctl.trainer.models import blocks_of, build_model
from vitctl.trainer.ops import resolve
from vitctl.trainer.parallel.pipeline_parallel import keep_stage, stage_range
from vitctl.trainer.parallel.strategy import BlockStrategy, Strategy

CPU = torch.device("cpu")
WAYS = ("whole on the CPU", "meta, stage 0 of 2", "meta, stage 1 of 2")


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def build(name: str, way: int) -> torch.nn.Module:
    config, ops = ModelConfig(name=name, drop_path=0.0), resolve("none", CPU)
    if way == 0:
        return build_model(config, ops)
    with torch.device("meta"):
        model = build_model(config, ops)
    n_blocks = len(blocks_of(model))
    stage = way - 1
    keep_stage(model, stage_range(Strategy(pp=2, blocks=(BlockStrategy(),) * n_blocks), n_blocks, stage),
               stage == 0, stage == 1)
    model.to_empty(device=CPU)
    model.init_weights(0)
    return model


def measure(name: str, way: int) -> None:
    """One way, in this process: prints seconds, parameters held, peak memory and its rise over the imports'."""
    before = peak_gib()
    start = time.perf_counter()
    model = build(name, way)
    seconds = time.perf_counter() - start
    held = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"| {name} | {WAYS[way]} | {seconds:.1f} | {held:.0f}M | {peak_gib():.2f} | {peak_gib() - before:.2f} |",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", help="registry names (default: swin_h and vit_h14)")
    parser.add_argument("--way", type=int, choices=range(len(WAYS)), help=argparse.SUPPRESS)  # one child's way
    args = parser.parse_args()
    if args.way is not None:
        measure(args.model[0], args.way)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| model | build | seconds | parameters | peak RSS GiB | over imports GiB |\n|---|---|---:|---:|---:|---:|",
          flush=True)
    for name in args.model or ["swin_h", "vit_h14"]:
        for way in range(len(WAYS)):
            subprocess.run([sys.executable, __file__, "--model", name, "--way", str(way)], check=True)


if __name__ == "__main__":
    main()
