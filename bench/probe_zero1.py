"""What ZeRO-1 saves within a node: an fp32 all-reduce of ViT-B's 86.6 M gradients against a reduce-scatter of them
(or the bf16 all-to-all `parallel.grad_reduce=zero1` sends) plus a bf16 all-gather of the weights, and torch's fused
AdamW over all the weights against over half. NCCL settings go in the environment (NCCL_MIN_P2P_NCHANNELS=32 ...).

    torchrun --nproc-per-node 2 bench/probe_zero1.py

Rank 0 prints each median of 20 (CUDA events, after 5 warm-up runs).
"""

import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

N = 86_600_000
# ViT-B/16's parameter shapes (12 blocks, then the embeddings and the head)
BLOCK = [(2304, 768), (2304,), (768, 768), (768,), (3072, 768), (3072,), (768, 3072), (768,)] + [(768,)] * 4
SHAPES = BLOCK * 12 + [(768, 3, 16, 16), (768,), (1, 197, 768), (1, 1, 768), (1000, 768), (1000,)]


def median_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def adamw_ms(fraction: int) -> float:
    """Fused AdamW over 1/fraction of each ViT-B tensor."""
    params = [torch.randn(torch.Size(s).numel() // fraction or 1, device="cuda", requires_grad=True) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    return median_ms(torch.optim.AdamW(params, lr=1e-4, fused=True).step)


def main() -> None:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    n = N // world * world
    grads, shard = torch.randn(n, device="cuda"), torch.empty(n // world, device="cuda")
    weights = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    own = weights[rank * (n // world):(rank + 1) * (n // world)]
    sent, received = torch.randn(n, device="cuda").bfloat16(), torch.empty(n, device="cuda", dtype=torch.bfloat16)
    results = {
        "fp32 all-reduce": median_ms(lambda: dist.all_reduce(grads)),
        "fp32 reduce-scatter": median_ms(lambda: dist.reduce_scatter_tensor(shard, grads)),
        "bf16 all-gather (in place)": median_ms(lambda: dist.all_gather_into_tensor(weights, own)),
        "bf16 all-to-all (ZeRO-1's)": median_ms(lambda: dist.all_to_all_single(received, sent)),
        "fused AdamW, all weights": adamw_ms(1),
        "fused AdamW, half of each": adamw_ms(2),
    }
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}, {n / 1e6:.1f} M elements")
        for name, ms in results.items():
            print(f"{name:30s} {ms:7.3f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
