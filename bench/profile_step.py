"""Where a training step spends its GPU time: the kernels of a few steps grouped by kind, for our `--fused` settings and
compile modes and (with --timm-mode) timm's strongest setting, side by side in one process."""

import argparse
import statistics
from collections import defaultdict

import torch

from vitctl.trainer.bench import TIMM_STRONGEST, cuda_or_exit, step_times, timm_model, training_step
from vitctl.trainer.config import FP8_RECIPES, ModelConfig, TrainConfig
from vitctl.trainer.fp8 import convert_to_float8
from vitctl.trainer.models import build_model
from vitctl.trainer.ops import resolve
from vitctl.trainer.precision import Precision

# First match wins: our window kernels before the generic attention names.
KINDS = (
    ("vitctl window kernels", ("window_attention", "window_softmax", "window_partition", "window_merge")),
    ("vitctl float8 casts (Triton)", ("quantize_rows",)),
    ("attention (flash / mem-eff / cuDNN)", ("flash", "fmha", "sdpa", "attention", "mha", "cudnn::fusion")),
    ("convolution", ("conv", "fprop", "implicit", "nchwtonhwc")),
    ("matmul (cuBLAS / CUTLASS)", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "cublas")),
    ("optimizer and multi-tensor copies", ("multi_tensor", "adam")),
    ("Inductor (Triton)", ("triton",)),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, keys in KINDS if any(k in name for k in keys)), "other (aten / copies)")


def profile(step, images, labels, steps: int) -> tuple[float, dict[str, float], dict[str, float], float]:
    """(median ms per step, run back to back as in training, GPU ms per step by kind, by kernel; launches per step).

    A wall time above the GPU total means the host does not keep the GPU fed."""
    times = step_times(step, images, labels, warmup=10, steps=steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(images, labels)
        torch.cuda.synchronize()
    by_kind, by_kernel, launches = defaultdict(float), defaultdict(float), 0
    for event in prof.key_averages():
        ms = event.self_device_time_total / 1000 / steps
        if ms > 0:
            by_kind[kind_of(event.key)] += ms
            by_kernel[event.key] += ms
            launches += event.count / steps
    return statistics.median(times), by_kind, by_kernel, launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="swin_b")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--fused", action="append", help="one row per --fused setting (default: all)")
    parser.add_argument("--fp8", action="append", choices=FP8_RECIPES, default=[],
                        help="also a row per float8 recipe (bf16-pure's step on the float8 model, fused all)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--mode", action="append", help="torch.compile modes for our rows (default: the default)")
    parser.add_argument("--timm-mode", action="append",
                        help=f"also timm's {TIMM_STRONGEST}, under each of these torch.compile modes ('default')")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    cuda_or_exit("python bench/profile_step.py")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    images = torch.randn(args.batch, 3, 224, 224, device=device)
    labels = torch.randint(0, 1000, (args.batch,), device=device)
    rows = []
    optimizer = resolve("optimizer", device).optimizer
    for fused in args.fused or ["all"]:
        for mode in args.mode or ["default"]:
            ops = resolve(fused, device, compiling=args.compile)
            model = build_model(ModelConfig(name=args.model, drop_path=0.0), ops).to(device).train()
            step = training_step(model, Precision(args.precision, device), args.compile, optimizer, mode)
            rows.append((f"vitctl {args.precision} fused {fused} {mode}", *profile(step, images, labels, args.steps)))
            del model, step
    for recipe in args.fp8:
        for mode in args.mode or ["default"]:
            model = build_model(ModelConfig(name=args.model, drop_path=0.0), resolve("all", device, compiling=True))
            model = model.to(device).train()
            convert_to_float8(model, recipe, fsdp=False, min_width=TrainConfig().fp8_min_width)
            step = training_step(model, Precision("bf16-pure", device), True, optimizer, mode)
            rows.append((f"vitctl fp8 {recipe} {mode}", *profile(step, images, labels, args.steps)))
            del model, step
    for mode in args.timm_mode or []:
        model = timm_model(args.model, 224, fused_attn=True).to(device).train()
        step = training_step(model, Precision("bf16", device), True, optimizer, mode)
        rows.append((f"timm strongest {mode}", *profile(step, images, labels, args.steps)))
        del model, step
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model} batch {args.batch}, "
          "GPU ms per step by kernel kind")
    kinds = sorted({k for row in rows for k in row[2]}, key=lambda k: -max(r[2].get(k, 0) for r in rows))
    print("| kind | " + " | ".join(r[0] for r in rows) + " |\n|---|" + "---:|" * len(rows))
    for kind in kinds:
        print(f"| {kind} | " + " | ".join(f"{r[2].get(kind, 0):.2f}" for r in rows) + " |")
    print("| GPU total | " + " | ".join(f"{sum(r[2].values()):.2f}" for r in rows) + " |")
    print("| kernel launches | " + " | ".join(f"{r[4]:.0f}" for r in rows) + " |")
    print("| wall (median step, back to back) | " + " | ".join(f"{r[1]:.2f}" for r in rows) + " |")
    for name, _, _, by_kernel, _ in rows:
        print(f"\n{name}: top kernels, GPU ms per step")
        for kernel, ms in sorted(by_kernel.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {ms:7.3f}  {kind_of(kernel)[:12]:12}  {kernel[:140]}")


if __name__ == "__main__":
    main()
