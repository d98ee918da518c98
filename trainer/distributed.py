"""torch.distributed set-up from the launcher's environment, and one small function per parallelism."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(use_cuda: bool) -> DistEnv:
    """Read RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT (torchrun, submitit, `vitctl train --gpus N`)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # Modulo: a launcher may already have narrowed CUDA_VISIBLE_DEVICES to this rank's GPU.
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                device_id=device if use_cuda else None)
    return DistEnv(rank, world, local_rank, device)


def apply_ddp(model: nn.Module, env: DistEnv) -> nn.Module:
    if env.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)


def apply_fsdp(model: nn.Module, param_dtype: torch.dtype | None) -> nn.Module:
    """FSDP2: shard each block, then the root; `param_dtype` bf16 keeps fp32 sharded master weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .models.layers import CheckpointableBlock

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, CheckpointableBlock):
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def gather_objects(obj: object) -> list[object]:
    if not dist.is_initialized():
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
