"""How the ranks divide into parallel groups: a device mesh with one named dimension per parallelism.

Data parallelism has two dimensions, replicate and shard (HSDP when both exceed 1); tensor and pipeline parallel
join as further dimensions of the same mesh. The data layer sees only the data-parallel coordinate and size.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config import ConfigError, ParallelConfig


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        return self.dp_shard > 1

    def describe(self) -> str:
        if self.world_size == 1:
            return "1 rank"
        if not self.fsdp:
            return f"DDP over {self.dp_replicate} ranks"
        if self.dp_replicate == 1:
            return f"FSDP over {self.dp_shard} ranks"
        return f"HSDP: {self.dp_replicate} replicas x FSDP over {self.dp_shard} ranks"


def parallel_dims(config: ParallelConfig, world_size: int) -> ParallelDims:
    """The mesh shape for `world_size` ranks; ConfigError when the request does not divide them."""
    if not config.fsdp:
        return ParallelDims(world_size, 1)
    shard = world_size if config.dp_shard == -1 else config.dp_shard
    if world_size % shard:
        raise ConfigError(f"parallel.dp_shard={shard} does not divide the {world_size} ranks; pick a divisor of "
                          f"{world_size} or -1 (all)")
    return ParallelDims(world_size // shard, shard)


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the mesh: the device mesh (None for one process) and its data-parallel coordinate."""

    dims: ParallelDims
    device_mesh: DeviceMesh | None
    dp_mesh: DeviceMesh | None  # all data-parallel ranks, flattened: data split, loss and eval reductions
    dp_rank: int

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return None if self.dp_mesh is None else self.dp_mesh.get_group()

    def data_parallel_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 takes: (replicate, shard) for HSDP, the shard dimension alone otherwise."""
        assert self.device_mesh is not None
        return self.device_mesh["dp_replicate", "dp_shard"] if self.dims.dp_replicate > 1 \
            else self.device_mesh["dp_shard"]


def build_mesh(dims: ParallelDims, device: torch.device) -> Mesh:
    if dims.world_size == 1:
        return Mesh(dims, None, None, 0)
    if dist.get_world_size() != dims.world_size:
        raise ConfigError(f"the mesh needs {dims.world_size} ranks but the job has {dist.get_world_size()}")
    mesh = init_device_mesh(device.type, (dims.dp_replicate, dims.dp_shard),
                            mesh_dim_names=("dp_replicate", "dp_shard"))
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return Mesh(dims, mesh, dp, dp.get_local_rank())
