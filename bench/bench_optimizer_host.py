"""Host time of one AdamW step over a model's FSDP2-sharded weights: torch's step on the DTensors against
`step_on_local_shards` (the same kernels on the local shards), on every rank of this machine, as the trainer builds
the optimizer (the op seams' AdamW, its parameter groups).

    torchrun --standalone --nproc-per-node 2 bench/bench_optimizer_host.py --model vit_h14

Each step is timed from its call until it returns, after the device has finished the previous one: the host's
launching, which bounds a step where FSDP2 makes the host the bottleneck. Rank 0's medians.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from vitctl.trainer.config import ModelConfig
from vitctl.trainer.models import blocks_of, build_model
from vitctl.trainer.ops import resolve
from vitctl.trainer.optim import param_groups, step_on_local_shards
from vitctl.trainer.parallel import init_distributed


def host_seconds(step, device: torch.device, warmup: int, steps: int) -> float:
    times = []
    for _ in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_b16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    env = init_distributed(torch.cuda.is_available())
    ops = resolve("all", env.device, compiling=False)
    with torch.device(env.device):
        model = build_model(ModelConfig(name=args.model), ops)
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer = ops.optimizer(param_groups(model, 0.05, None), 1e-3, (0.9, 0.999), 1e-8)
    optimizer.step()  # makes the state, which the local path needs
    if not step_on_local_shards(optimizer):
        raise SystemExit(f"the local path does not apply to {type(optimizer).__name__}")
    on_dtensors = host_seconds(optimizer.step, env.device, args.warmup, args.steps)
    on_shards = host_seconds(lambda: step_on_local_shards(optimizer), env.device, args.warmup, args.steps)
    if env.rank == 0:
        weights = sum(1 for _ in model.parameters())
        print(f"{args.model}, {weights} weights, {type(optimizer).__name__}, {env.world_size} ranks on "
              f"{env.device.type}: torch's step on the DTensors {on_dtensors * 1e3:.2f} ms, on the local shards "
              f"{on_shards * 1e3:.2f} ms ({(on_dtensors - on_shards) / weights * 1e6:.0f} us a weight)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
