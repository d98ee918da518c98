"""Apply the parallelisms to a model, one small function each (torchtitan's `parallelize_*` shape): activation
checkpointing, compile, then data parallelism (replicated or FSDP2) on the mesh. The loop calls what this returns
and never branches on the strategy."""

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..config import TrainConfig
from ..models import set_activation_checkpointing
from ..models.layers import CheckpointableBlock
from ..precision import MasterWeights, Precision
from .data_parallel import ReduceAfterBackward, apply_ddp, apply_fsdp, one_node
from .mesh import Mesh


@dataclass
class Parallelized:
    weights: nn.Module  # the module the optimizer, the checkpoints and the EMA see: fp32 (sharded under FSDP)
    module: nn.Module  # the module that runs (DDP's wrapper, the bf16 model): train() and eval() go to it
    forward: Callable[[torch.Tensor], torch.Tensor]  # `module`, compiled when asked
    master: MasterWeights | None  # bf16-pure outside FSDP
    ddp: DistributedDataParallel | None
    reducer: ReduceAfterBackward | None
    fsdp: nn.Module | None
    accum_steps: int

    @property
    def input_dtype(self) -> torch.dtype | None:
        """What the images are cast to before the forward (a bf16 model takes bf16 inputs)."""
        return torch.bfloat16 if self.master is not None else None

    def micro_batch(self, sync: bool) -> AbstractContextManager:
        """Around one micro-batch's forward and backward; `sync` on the last of a step reduces the gradients."""
        if self.fsdp is not None:
            self.fsdp.set_requires_gradient_sync(sync)
        if self.ddp is not None and not sync:
            return self.ddp.no_sync()
        return nullcontext()

    def after_backward(self, sync: bool) -> None:
        """Reduce after the last micro-batch (when not DDP's job); bf16 gradients that no reduction consumes are
        summed into the masters in fp32."""
        if sync and self.reducer is not None:
            self.reducer.reduce()
        elif self.master is not None and (not sync or (self.ddp is None and self.accum_steps > 1)):
            self.master.accumulate()


def parallelize(model: nn.Module, mesh: Mesh, precision: Precision, train: TrainConfig, grad_reduce: str,
                accum_steps: int) -> Parallelized:
    """`model` is fp32 on its device, with the same weights on every rank."""
    set_activation_checkpointing(model, train.activation_checkpointing)
    if mesh.dims.fsdp:
        return _fully_shard(model, mesh, precision, train, accum_steps)
    master = MasterWeights(model) if precision.pure else None
    ddp = reducer = None
    if mesh.dims.world_size > 1 and _reduce_after_backward(grad_reduce, mesh):
        pairs = master.pairs if master else [(p, p) for p in model.parameters() if p.requires_grad]
        reducer = ReduceAfterBackward(pairs, mesh.dp_group, mesh.dp_size)
    elif mesh.dims.world_size > 1:
        ddp = apply_ddp(model, mesh, master)
    wrapped = ddp or model
    forward = torch.compile(wrapped, mode=train.compile_mode) if train.compile else wrapped
    return Parallelized(master.module if master else model, wrapped, forward, master, ddp, reducer, None,
                        accum_steps)


def _reduce_after_backward(grad_reduce: str, mesh: Mesh) -> bool:
    return grad_reduce == "after_backward" or (grad_reduce == "auto" and one_node(mesh.dp_group))


def _fully_shard(model: nn.Module, mesh: Mesh, precision: Precision, train: TrainConfig,
                 accum_steps: int) -> Parallelized:
    blocks = [m for m in model.modules() if isinstance(m, CheckpointableBlock)]
    if train.compile:  # per block, as FSDP2 expects: its hooks run between the compiled blocks
        for block in blocks:
            block.compile(mode=train.compile_mode)
    apply_fsdp(model, mesh, precision.fsdp_policy(), blocks)
    return Parallelized(model, model, model, None, None, None, model, accum_steps)
