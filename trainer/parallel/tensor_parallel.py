"""Tensor parallelism (Megatron's) inside each transformer block: attention split by heads (qkv column-parallel, proj
row-parallel), the MLP by hidden units (fc1 column-parallel, fc2 row-parallel).

Activations between modules stay plain tensors, whole on every rank of the tensor-parallel group. The split modules
compute on their weights' local shards and meet in two collectives: "copy to the TP region" before a column-parallel
matmul (identity forward, gradient summed over the ranks in the backward) and "reduce from the TP region" after a
row-parallel one (outputs summed over the ranks, identity backward), its bias added once after the sum.

The split weights become DTensors on the tensor-parallel mesh, so DCP saves and reshards them and FSDP2 can shard them
further over a data-parallel mesh. What stays whole (norms, the row-parallel biases, everything outside the blocks)
stays a plain tensor: every rank computes the same, whole gradient for it.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_reduce, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Shard, distribute_tensor

from ..models import blocks_of
from ..models.layers import Mlp, PackedQKV
from ..models.swin import WindowAttention


def _sum_over(x: Tensor, group: str) -> Tensor:
    # Functional (out-of-place) collectives, which torch.compile traces into its graph.
    return wait_tensor(all_reduce(x, "sum", group))


class _CopyToTP(torch.autograd.Function):
    """Identity; in the backward the input's gradient is summed over the ranks, each of which computed a part."""

    @staticmethod
    def forward(ctx, x: Tensor, group: str) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _sum_over(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """The ranks' partial outputs summed; the gradient, whole on every rank, goes back to each as it is."""

    @staticmethod
    def forward(ctx, x: Tensor, group: str) -> Tensor:
        return _sum_over(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def copy_to_tp(x: Tensor, group: str) -> Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: str) -> Tensor:
    return _ReduceFromTP.apply(x, group)


class ColumnParallelQKV(PackedQKV):
    """q, k and v of this rank's heads."""

    tp_group: str

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(copy_to_tp(x, self.tp_group), self.weight.to_local().flatten(0, 1),
                        self.bias.to_local().flatten())


class RowParallelLinear(nn.Linear):
    """The output from this rank's input features, summed over the ranks, plus the bias."""

    tp_group: str

    def forward(self, x: Tensor) -> Tensor:
        return reduce_from_tp(F.linear(x, self.weight.to_local()), self.tp_group) + self.bias


class TensorParallelMlp(Mlp):
    """This rank's hidden units through the MLP op (fc2 with a zero bias), summed over the ranks, plus fc2's bias."""

    tp_group: str

    def forward(self, x: Tensor) -> Tensor:
        fc1, fc2 = self.fc1, self.fc2
        partial = self.ops.mlp(copy_to_tp(x, self.tp_group), fc1.weight.to_local(), fc1.bias.to_local(),
                               fc2.weight.to_local(), torch.zeros_like(fc2.bias))
        return reduce_from_tp(partial, self.tp_group) + fc2.bias


class TensorParallelWindowAttention(WindowAttention):
    """Window attention of this rank's heads, with their columns of the relative-position table."""

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        out = self.ops.window_attention(self.qkv(x), self.heads, self.scale,
                                        self.relative_position_bias_table.to_local(), self.relative_position_index,
                                        mask)
        return self.proj(out)


def tensor_parallel_error(model: nn.Module, tp: int) -> str | None:
    """Why `model`'s blocks cannot be split over `tp` ranks (heads or MLP width not divisible), or None."""
    for i, block in enumerate(blocks_of(model)):
        heads, hidden = block.attn.heads, block.mlp.fc1.out_features
        if heads % tp or hidden % tp:
            return (f"tensor parallelism over {tp} ranks splits each block's heads and MLP width; block {i} has "
                    f"{heads} heads and an MLP of {hidden}, not both multiples of {tp}")
    return None


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split every block of a VisionTransformer or SwinTransformer over the 1-D `tp_mesh`, in place; every rank holds
    the same whole weights before."""
    if error := tensor_parallel_error(model, tp_mesh.size()):
        raise ValueError(error)
    group = tp_mesh.get_group().group_name
    for block in blocks_of(model):
        _split_attention(block.attn, tp_mesh, group)
        _split_mlp(block.mlp, tp_mesh, group)


def _split_attention(attn: nn.Module, mesh: DeviceMesh, group: str) -> None:
    _swap(attn.qkv, ColumnParallelQKV, tp_group=group)
    _swap(attn.proj, RowParallelLinear, tp_group=group)
    _shard(attn.qkv, "weight", mesh, Shard(1))  # dim 1 of (3, dim, dim): q, k and v rows of whole heads
    _shard(attn.qkv, "bias", mesh, Shard(1))
    _shard(attn.proj, "weight", mesh, Shard(1))
    if isinstance(attn, WindowAttention):
        _swap(attn, TensorParallelWindowAttention)
        _shard(attn, "relative_position_bias_table", mesh, Shard(1))
    attn.heads //= mesh.size()


def _split_mlp(mlp: Mlp, mesh: DeviceMesh, group: str) -> None:
    _swap(mlp, TensorParallelMlp, tp_group=group)
    _shard(mlp.fc1, "weight", mesh, Shard(0))
    _shard(mlp.fc1, "bias", mesh, Shard(0))
    _shard(mlp.fc2, "weight", mesh, Shard(1))


def _shard(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement) -> None:
    """The parameter as a DTensor of which this rank keeps its shard."""
    param = getattr(module, name)
    # src_data_rank=None: each rank cuts its shard from its own copy, with no broadcast (all hold the same weights).
    shard = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=None)
    module.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))


def _swap(module: nn.Module, parallel: type[nn.Module], **attributes: str) -> None:
    """`module` made an instance of `parallel`, a subclass of its class, with `attributes` set."""
    # Only from the plain class: the forward of another subclass (float8's, or this one's twice) would be lost.
    if type(module) is not parallel.__base__:
        raise TypeError(f"tensor parallelism splits {parallel.__base__.__name__} modules, not "
                        f"{type(module).__name__}: apply it before other module swaps, once")
    # The class changes in place, as FSDP2's fully_shard does: parameters, their names and any hooks stay.
    module.__class__ = parallel
    for name, value in attributes.items():
        setattr(module, name, value)
