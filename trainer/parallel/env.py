"""torch.distributed set-up from the launcher's environment."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    if not dist.is_initialized():
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
