"""The row-scaled float8 casts of trainer/ops/float8_rows.py on one GPU: memory throughput (bytes read and written
per second) of each Triton kernel at ViT-B/16 b256's sizes, for rows per program x warps, the default launch, and
the compiled PyTorch reference (what Inductor makes of the same cast) beside them. Each rate is the kernels' own GPU
time (the profiler's, 20 runs), as the training step replays them in CUDA graphs: between CUDA events a cast of
50 us would also count its Python launch."""

import argparse
from functools import partial

import torch
from bench_ops import time_ms  # bench/ is the script's folder

from vitctl.trainer.bench import cuda_or_exit
from vitctl.trainer.ops import float8_rows as f

BYTES = {"quantize_rows": (2, 1), "gelu_quantize_rows": (2, 1), "gelu_backward_quantize_rows": (4, 5)}  # per value


def gpu_ms(fn) -> float:
    return time_ms(fn, warmup=3, repeats=20)[0]


def cases(m: int, n: int) -> dict[str, tuple]:
    """Per cast: (its Triton kernel and arguments with fresh outputs, the reference and its inputs)."""
    x, grad = torch.randn(m, n, device="cuda").bfloat16(), torch.randn(m, n, device="cuda").bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    q, back = f._outputs(x)
    return {
        "quantize_rows": ((f._quantize_rows_kernel, x, q, back), (f.quantize_rows_reference, x)),
        "gelu_quantize_rows": ((f._gelu_quantize_rows_kernel, x, bias, q, back),
                               (f.gelu_quantize_rows_reference, x, bias)),
        "gelu_backward_quantize_rows": ((f._gelu_backward_quantize_rows_kernel, grad, x, bias, q, back,
                                         torch.empty_like(x), torch.empty_like(x)),
                                        (f.gelu_backward_quantize_rows_reference, grad, x, bias))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=50432, help="ViT-B/16 b256: 256 x 197 tokens")
    parser.add_argument("--widths", default="768,2304,3072")
    parser.add_argument("--sweep", action="store_true", help="also every rows-per-program x warps launch")
    args = parser.parse_args()
    cuda_or_exit("python bench/fp8_casts.py")
    m = args.rows
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {m} rows; GB/s (bytes read + written)")
    widths = [int(n) for n in args.widths.split(",")]
    for n in widths:
        for name, (kernel_args, (reference, *inputs)) in cases(m, n).items():
            if name != "quantize_rows" and n != max(widths):
                continue  # the GELU casts are the MLP's hidden layer's only
            gigabytes, compiled = m * n * sum(BYTES[name]) / 1e9, torch.compile(reference)
            kernel, *kernel_inputs = kernel_args
            rate = {"default": gigabytes / gpu_ms(partial(f._launch, kernel, m, n, *kernel_inputs)) * 1e3,
                    "compiled reference": gigabytes / gpu_ms(partial(compiled, *inputs)) * 1e3}
            if args.sweep:
                block = 1 << (n - 1).bit_length()
                for rows in (1, 2, 4, 8, 16):
                    for warps in (1, 2, 4, 8, 16):
                        if rows * block <= 32768 and rows * block >= 32 * warps:
                            ms = gpu_ms(partial(f._launch, kernel, m, n, *kernel_inputs, rows=rows,
                                                warps=warps))
                            rate[f"{rows} rows x {warps} warps"] = gigabytes / ms * 1e3
            print(f"{name} n={n}: default launch {rate.pop('default'):,.0f}, compiled reference "
                  f"{rate.pop('compiled reference'):,.0f}", flush=True)
            if rate:
                print(f"   best {max(rate, key=rate.get)}; " + ", ".join(f"{k}: {v:,.0f}" for k, v in rate.items()))


if __name__ == "__main__":
    main()
