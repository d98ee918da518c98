"""Where float8 pays: one linear layer's forward + backward at ViT-B's and Swin-B's shapes, compiled, bf16 against
each float8 recipe (torchao's, and fused_rowwise's linear). Prints the median ms per step and the ratio to bf16, so
the whole-model figures of bench_fp8.py can be read against what the matmuls alone gain."""

import argparse
import copy

import torch
from bench_ops import time_ms  # bench/ is the script's folder
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from vitctl.trainer.bench import cuda_or_exit
from vitctl.trainer.config import FP8_RECIPES
from vitctl.trainer.fp8 import FUSED_ROWWISE, FusedRowwiseLinear

# (name, rows = batch x tokens, in, out): ViT-B/16 b256 (197 tokens) and Swin-B b128 stage 3 (196 tokens)
SHAPES = [("vit_b16 qkv", 256 * 197, 768, 2304), ("vit_b16 fc1", 256 * 197, 768, 3072),
          ("vit_b16 fc2", 256 * 197, 3072, 768), ("swin_b s3 fc1", 128 * 196, 512, 2048),
          ("swin_b s1 fc1", 128 * 3136, 128, 512)]


def step_ms(layer: nn.Module, x: torch.Tensor, steps: int) -> float:
    """Median wall ms of forward + backward of a compiled `layer`, timed with CUDA events."""
    torch._dynamo.reset()  # each layer its own graph: the shared lambda would hit the recompile limit and run eager
    return time_ms(torch.compile(lambda: layer(x).sum().backward()), warmup=5, repeats=steps)[1]


def float8_layer(layer: nn.Linear, recipe: str) -> nn.Module:
    if recipe == FUSED_ROWWISE:
        fused = copy.deepcopy(layer)
        fused.__class__ = FusedRowwiseLinear
        return fused
    return convert_to_float8_training(nn.Sequential(copy.deepcopy(layer)),
                                      config=Float8LinearConfig.from_recipe_name(recipe))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    cuda_or_exit("python bench/fp8_linear.py")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; median of {args.steps} fwd+bwd, compiled")
    print("| layer | rows x in -> out | bf16 ms | " + " | ".join(f"fp8 {r} ms (x bf16)" for r in FP8_RECIPES) + " |")
    print("|---|---|---:|" + "---:|" * len(FP8_RECIPES))
    for name, rows, fan_in, fan_out in SHAPES:
        layer = nn.Linear(fan_in, fan_out, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(rows, fan_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        bf16 = step_ms(layer, x, args.steps)
        cells = []
        for recipe in FP8_RECIPES:
            ms = step_ms(float8_layer(layer, recipe), x, args.steps)
            cells.append(f"{ms:.3f} ({bf16 / ms:.2f}x)")
        print(f"| {name} | {rows} x {fan_in} -> {fan_out} | {bf16:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
