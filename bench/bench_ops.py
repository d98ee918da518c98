"""Per-op forward + backward timing on one GPU: our CUDA kernels vs the reference ops, torch.compile of the
reference, and (attention) SDPA with an additive bias + mask. Shapes are Swin-B's at batch 128 (MLP: also ViT-B's)."""

import argparse
import statistics

import torch

from vitctl.trainer.bench import cuda_or_exit
from vitctl.trainer.models.swin import relative_position_index, shift_mask
from vitctl.trainer.ops import cuda, reference, sdpa

Row = tuple[str, tuple[float, float]]  # name, (GPU ms, wall ms)


def time_ms(fn, warmup: int = 10, repeats: int = 50) -> tuple[float, float]:
    """(GPU ms, wall ms) per call: the kernels' own time summed from the profiler, and the median wall time between
    CUDA events, which also counts the launches' CPU time when that is longer (small shapes)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages())
    return gpu_us / repeats / 1000, statistics.median(times)


def fwd_bwd(op, inputs):
    """Forward, then backward from a fixed output gradient: the op's own cost, nothing added around it."""
    grad = torch.randn_like(op(*inputs))

    def run():
        for t in inputs:
            t.grad = None
        op(*inputs).backward(grad)
    return run


def window_process(B: int, res: int, C: int, window: int, dtype: torch.dtype) -> list[Row]:
    x = torch.randn(B, res, res, C, device="cuda", dtype=dtype, requires_grad=True)
    shift = window // 2
    windows = torch.randn(B * (res // window) ** 2, window * window, C, device="cuda", dtype=dtype,
                          requires_grad=True)
    rows = []
    for direction, inputs, ref, ours in [
        ("partition", [x], lambda t: reference.window_partition(t, window, shift),
         lambda t: cuda.window_partition_op(t, window, shift)),
        ("merge", [windows], lambda t: reference.window_merge(t, window, shift, res, res),
         lambda t: cuda.window_merge_op(t, window, shift, res, res)),
    ]:
        rows += [(f"{direction}: {name}", time_ms(fwd_bwd(fn, inputs))) for name, fn in
                 (("reference", ref), ("torch.compile(reference)", torch.compile(ref)), ("vitctl cuda", ours))]
    return rows


def window_attention(B: int, res: int, heads: int, window: int, dtype: torch.dtype) -> list[Row]:
    n_windows, N = (res // window) ** 2, window * window
    qkv = torch.randn(B * n_windows, N, 3 * heads * 32, device="cuda", dtype=dtype, requires_grad=True)
    table = torch.randn((2 * window - 1) ** 2, heads, device="cuda", requires_grad=True)
    index = relative_position_index(window).cuda()
    mask = shift_mask(res, res, window, window // 2).cuda()
    scale = 32**-0.5

    def sdpa_efficient(qkv, table):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
            return sdpa.window_attention(qkv, heads, scale, table, index, mask)

    def op(fn):
        return lambda qkv, table: fn(qkv, heads, scale, table, index, mask)

    return [(name, time_ms(fwd_bwd(fn, [qkv, table]))) for name, fn in
            (("reference", op(reference.window_attention)),
             ("torch.compile(reference)", torch.compile(op(reference.window_attention))),
             ("SDPA memory-efficient, additive bias+mask", sdpa_efficient),
             ("SDPA default backend", op(sdpa.window_attention)),
             ("vitctl cuda, seed design (softmax kernel)", op(cuda.seed_window_attention)),
             ("vitctl cuda, one kernel", op(cuda.window_attention)))]


def mlp(B: int, tokens: int, dim: int, hidden: int, dtype: torch.dtype) -> list[Row]:
    inputs = [(torch.randn(shape, device="cuda", dtype=dtype) * 0.02).requires_grad_() for shape in
              ((B, tokens, dim), (hidden, dim), (hidden,), (dim, hidden), (dim,))]
    return [(name, time_ms(fwd_bwd(fn, inputs))) for name, fn in
            (("reference", reference.mlp), ("torch.compile(reference)", torch.compile(reference.mlp)),
             ("vitctl cuda (GELU and its derivative in cuBLASLt epilogues)", cuda.mlp),
             ("torch.compile(vitctl cuda)", torch.compile(cuda.mlp)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--ops", choices=("all", "process", "attention", "mlp"), default="all")
    args = parser.parse_args()
    cuda_or_exit("python bench/bench_ops.py")
    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, batch {args.batch}, median of 50")
    cases = {
        "window process (partition + merge), stage 1: 56x56x128": ("process", window_process, (56, 128, 7)),
        "window process, stage 3: 14x14x512": ("process", window_process, (14, 512, 7)),
        "window attention, stage 1: 64 windows x 4 heads, N=49": ("attention", window_attention, (56, 4, 7)),
        "window attention, stage 3: 4 windows x 16 heads, N=49": ("attention", window_attention, (14, 16, 7)),
        "MLP, Swin-B stage 1: 3136 tokens, 128 -> 512 -> 128": ("mlp", mlp, (3136, 128, 512)),
        "MLP, Swin-B stage 3: 196 tokens, 512 -> 2048 -> 512": ("mlp", mlp, (196, 512, 2048)),
        "MLP, ViT-B/16: 197 tokens, 768 -> 3072 -> 768": ("mlp", mlp, (197, 768, 3072)),
    }
    for title, (kind, bench, shape) in cases.items():
        if args.ops not in ("all", kind):
            continue
        rows = bench(args.batch, *shape, dtype)
        print(f"\n{title}\n| op | GPU ms (fwd+bwd kernels) | vs reference | wall ms |\n|---|---:|---:|---:|")
        for name, (gpu, wall) in rows:
            group = name.split(": ")[0] if ": " in name else ""
            suffix = ": reference" if group else "reference"
            base = next(m[0] for n, m in rows if n.startswith(group) and n.endswith(suffix))
            print(f"| {name} | {gpu:.3f} | {base / gpu:.2f}x | {wall:.3f} |")


if __name__ == "__main__":
    main()
