"""What ZeRO-1 saves within a node: an fp32 all-reduce of ViT-B's 86.6 M gradients against a reduce-scatter of them
(or the bf16 all-to-all `parallel.grad_reduce=zero1` sends) plus a bf16 all-gather of the weights, and torch's fused
AdamW over all the weights against over half. Then a rank's step of its share from the bf16 gradients it received,
with and without the clipping norm: their fp32 mean written, then the master AdamW kernel, against the kernel taking
the mean as it reads them (vitctl's CUDA ops needed). NCCL settings go in the environment (NCCL_MIN_NCHANNELS=32 ...).

    torchrun --nproc-per-node 2 bench/probe_zero1.py

Rank 0 prints each median of 20 (CUDA events, after 5 warm-up runs), of the GPU's time: each run is queued while
the GPU sleeps, so the host's time to queue it is not counted.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from gpu_time import median_gpu_ms

from vitctl.trainer.ops.cuda import MasterAdamW, parts_sum_of_squares
from vitctl.trainer.parallel.peer_copies import runs_of
from vitctl.trainer.precision import clip_coefficient, total_norm

N = 86_600_000
# ViT-B/16's parameter shapes (12 blocks, then the embeddings and the head)
BLOCK = [(2304, 768), (2304,), (768, 768), (768,), (3072, 768), (3072,), (768, 3072), (768,)] + [(768,)] * 4
SHAPES = BLOCK * 12 + [(768, 3, 16, 16), (768,), (1, 197, 768), (1, 1, 768), (1000, 768), (1000,)]


def median_ms(fn: Callable[[], object]) -> float:
    return median_gpu_ms(fn, ready=dist.barrier)  # both ranks time the same runs


def adamw_ms(fraction: int) -> float:
    """Fused AdamW over 1/fraction of each ViT-B tensor."""
    params = [torch.randn(torch.Size(s).numel() // fraction or 1, device="cuda", requires_grad=True) for s in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    return median_ms(torch.optim.AdamW(params, lr=1e-4, fused=True).step)


def master_step_ms(world: int) -> dict[str, float]:
    """A rank's step of half of each ViT-B tensor from the bf16 parts `world` ranks sent it, two ways."""
    sizes = [-(-(torch.Size(s).numel() // world or 1) // 32) * 32 for s in SHAPES]
    starts, length = [sum(sizes[:i]) for i in range(len(sizes))], sum(sizes)
    masters = [torch.nn.Parameter(torch.randn(size, device="cuda")) for size in sizes]
    weights = [m.detach().bfloat16() for m in masters]
    optimizer = MasterAdamW([{"params": masters, "weight_decay": 0.05}], lr=1e-4)
    for m in masters:  # torch's first step makes the state the kernel steps
        m.grad = torch.zeros_like(m)
    optimizer.step()
    received = torch.randn(world * length, device="cuda").bfloat16()
    mean = torch.empty(length, device="cuda")
    firsts = [received[a:a + size] for a, size in zip(starts, sizes, strict=True)]
    means = [mean[a:a + size] for a, size in zip(starts, sizes, strict=True)]

    def written(norm: Callable[[], torch.Tensor] | None) -> None:
        torch.mean(received.view(world, length), dim=0, dtype=torch.float32, out=mean)
        factor = clip_coefficient(norm(), 5.0) if norm else None
        optimizer.step_master_weights(list(zip(means, weights, masters, strict=True)), factor)

    def in_kernel(norm: Callable[[], torch.Tensor] | None) -> None:
        factor = clip_coefficient(norm(), 5.0) if norm else None
        optimizer.step_master_weights(list(zip(firsts, weights, masters, strict=True)), factor, received, world)

    norms = {"": None, ", clipped (torch._foreach_norm)": lambda: total_norm(means),
             ", clipped (vector_norm of the mean)": lambda: torch.linalg.vector_norm(mean),
             ", clipped (norm of the parts)": lambda: parts_sum_of_squares(received, world).sqrt()}
    return {f"share: mean {way}{label}": median_ms(lambda f=f, n=n: f(n)) for label, n in norms.items()
            for way, f in (("written, step", written), ("in the step", in_kernel))}


def copy_engine_ms(world: int) -> dict[str, float]:
    """ZeRO-1's exchange through symmetric memory, each rank's copy engines writing into its peers' buffers (no SMs),
    against NCCL's, around the step of the share: in one piece, and pipelined over chunks of the share (the gradients
    of chunk k land while chunk k - 1 steps; its weights leave while chunk k + 1 steps)."""
    import torch.distributed._symmetric_memory as symm_mem

    rank, group = dist.get_rank(), dist.group.WORLD.group_name
    sizes = [-(-(torch.Size(s).numel() // world or 1) // 32) * 32 for s in SHAPES]
    starts, length = [sum(sizes[:i]) for i in range(len(sizes))], sum(sizes)
    received = symm_mem.empty(world * length, dtype=torch.bfloat16, device="cuda")
    gathered = symm_mem.empty(world * length, dtype=torch.bfloat16, device="cuda")
    handles = symm_mem.rendezvous(received, group), symm_mem.rendezvous(gathered, group)
    sent = torch.randn(world * length, device="cuda").bfloat16()  # this rank's gradients, the part for rank p at p L
    masters = [torch.nn.Parameter(torch.randn(size, device="cuda")) for size in sizes]
    own = gathered[rank * length:(rank + 1) * length]
    triples = [(received[a:a + n], own[a:a + n], m) for a, n, m in zip(starts, sizes, masters, strict=True)]
    optimizer = MasterAdamW([{"params": masters, "weight_decay": 0.05}], lr=1e-4)
    for m in masters:
        m.grad = torch.zeros_like(m)
    optimizer.step()
    nccl_received = torch.empty_like(sent)
    nccl_triples = [(nccl_received[a:a + n], w, m) for (_, w, m), a, n in zip(triples, starts, sizes, strict=True)]
    peers = [p for p in range(world) if p != rank]
    grads_out, weights_out = torch.cuda.Stream(), torch.cuda.Stream()

    def chunks(n: int) -> list[tuple[int, int, list]]:
        """runs_of's runs of the share, each with its triples: (start, end, triples)."""
        return [(a, b, [t for t, start in zip(triples, starts, strict=True) if a <= start < b])
                for a, b in runs_of(list(zip(starts, sizes, strict=True)), n)]

    def nccl(clip: bool) -> None:
        dist.all_to_all_single(nccl_received, sent)
        factor = clip_coefficient(parts_sum_of_squares(nccl_received, world).sqrt(), 5.0) if clip else None
        optimizer.step_master_weights(nccl_triples, factor, nccl_received, world)
        dist.all_gather_into_tensor(gathered, own)

    def pipelined(n: int, clip: bool) -> None:
        main_stream = torch.cuda.current_stream()
        pieces = chunks(n)
        received[rank * length:(rank + 1) * length].copy_(sent[rank * length:(rank + 1) * length])
        grads_out.wait_stream(main_stream)
        with torch.cuda.stream(grads_out):
            for k, (a, b, _) in enumerate(pieces):
                for p in peers:  # into part `rank` of peer p's received buffer
                    handles[0].get_buffer(p, (b - a,), torch.bfloat16, rank * length + a).copy_(
                        sent[p * length + a:p * length + b])
                    handles[0].put_signal(p, 1 + k)
        factor = None
        if clip:
            for k in range(len(pieces)):
                for p in peers:
                    handles[0].wait_signal(p, 1 + k)
            factor = clip_coefficient(parts_sum_of_squares(received, world).sqrt(), 5.0)
        weights_out.wait_stream(main_stream)
        for k, (a, b, chunk) in enumerate(pieces):
            if not clip:
                for p in peers:
                    handles[0].wait_signal(p, 1 + k)
            optimizer.step_master_weights(chunk, factor, received, world)
            stepped = torch.cuda.Event()
            stepped.record()
            with torch.cuda.stream(weights_out):
                weights_out.wait_event(stepped)
                for p in peers:
                    handles[1].get_buffer(p, (b - a,), torch.bfloat16, rank * length + a).copy_(own[a:b])
        main_stream.wait_stream(grads_out)
        main_stream.wait_stream(weights_out)
        handles[1].barrier(0)  # the peers' weights have landed here

    results = {}
    for clip in (False, True):
        results[f"exchange: NCCL all-to-all, step, all-gather{', clipped' if clip else ''}"] = median_ms(
            lambda clip=clip: nccl(clip))
        for n in (1, 2, 3, 4, 6, 8):
            label = f"exchange: copy engines, {n} chunk{'s' * (n > 1)}{', clipped' if clip else ''}"
            results[label] = median_ms(lambda n=n, clip=clip: pipelined(n, clip))
    return results


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
        **master_step_ms(world),
        **copy_engine_ms(world),
    }
    if rank == 0:
        print(f"{world} x {torch.cuda.get_device_name()}, {n / 1e6:.1f} M elements")
        for name, ms in results.items():
            print(f"{name:60s} {ms:7.3f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
