"""How the ranks divide into parallel groups: a device mesh (pp, dp_replicate, dp_shard, tp), tp innermost so that a
tensor-parallel group sits inside a node, pp outermost so that only activations cross between nodes' stages.

FSDP blocks shard their weights over dp_shard and replicate them over dp_replicate (HSDP when both exceed 1);
replicated blocks use the whole data-parallel group. The data layer sees only the data-parallel coordinate.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config import ConfigError
from .strategy import Strategy

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard


def parallel_dims(strategy: Strategy, world_size: int) -> ParallelDims:
    """The mesh shape for `world_size` ranks; ConfigError when the strategy does not divide them."""
    if world_size % (strategy.tp * strategy.pp):
        raise ConfigError(f"parallel.tp={strategy.tp} x parallel.pp={strategy.pp} does not divide the {world_size} "
                          f"ranks")
    dp = world_size // (strategy.tp * strategy.pp)
    shard = (dp if strategy.dp_shard == -1 else strategy.dp_shard) if strategy.fsdp else 1
    if dp % shard:
        raise ConfigError(f"parallel.dp_shard={shard} does not divide the {dp} data-parallel ranks; pick a divisor "
                          f"of {dp} or -1 (all)")
    return ParallelDims(strategy.pp, dp // shard, shard, strategy.tp)


def describe_groups(dims: ParallelDims, ranks_per_node: int) -> list[str]:
    """The mesh's shape, and for each dimension over one rank its first group of ranks and whether its groups stay
    inside a node (ranks numbered node by node, as srun and torchrun number them)."""
    sizes = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp)
    lines = [f"mesh ({', '.join(DIMS)}) = ({', '.join(map(str, sizes))})"]
    stride = dims.world_size
    for name, size in zip(DIMS, sizes, strict=True):
        stride //= size
        if size > 1:
            span = size * stride  # ranks from a group's first to past its last
            where = "inside a node" if ranks_per_node % span == 0 else "across nodes"
            lines.append(f"{name} groups of {size} ranks, e.g. {list(range(0, span, stride))}: {where}")
    return lines


@dataclass(frozen=True)
class Mesh:
    """This rank's place in the mesh: the device mesh (None for one process) and its coordinates."""

    dims: ParallelDims
    device_mesh: DeviceMesh | None
    dp_mesh: DeviceMesh | None  # all data-parallel ranks, flattened: data split, replicated gradients
    metrics_mesh: DeviceMesh | None  # pp x dp flattened: sums of losses and eval counts (one tp rank's worth)
    dp_rank: int
    pp_rank: int

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return None if self.dp_mesh is None else self.dp_mesh.get_group()

    @property
    def metrics_group(self) -> dist.ProcessGroup | None:
        return None if self.metrics_mesh is None else self.metrics_mesh.get_group()

    def sub(self, *names: str) -> DeviceMesh:
        assert self.device_mesh is not None
        return self.device_mesh[names] if len(names) > 1 else self.device_mesh[names[0]]

    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 takes: (replicate, shard) for HSDP, the shard dimension alone otherwise."""
        return self.sub("dp_replicate", "dp_shard") if self.dims.dp_replicate > 1 else self.sub("dp_shard")


def build_mesh(dims: ParallelDims, device: torch.device) -> Mesh:
    if dims.world_size == 1:
        return Mesh(dims, None, None, None, 0, 0)
    if dist.get_world_size() != dims.world_size:
        raise ConfigError(f"the mesh needs {dims.world_size} ranks but the job has {dist.get_world_size()}")
    mesh = init_device_mesh(device.type, (dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp), mesh_dim_names=DIMS)
    dp = mesh["dp_replicate", "dp_shard"]._flatten("dp")
    metrics = mesh["pp", "dp_replicate", "dp_shard"]._flatten("pp_dp")
    return Mesh(dims, mesh, dp, metrics, dp.get_local_rank(), mesh["pp"].get_local_rank())
