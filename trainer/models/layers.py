"""Layers shared by the model files; each calls its op seam so the implementation can be swapped. Also the
initialisation they share, drawn tensor by tensor from streams seeded by the tensors' names."""

import hashlib
import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from ..ops import Ops


class LayerNorm(nn.Module):
    def __init__(self, dim: int, ops: Ops, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.layer_norm(x, self.weight, self.bias, self.eps)


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, ops: Ops) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)


PACKED_QKV_DIMS = {"weight": 3, "bias": 2}  # PackedQKV's tensors and their number of dimensions


class PackedQKV(nn.Module):
    """q, k and v as one matmul over a (3, dim, dim) weight and (3, dim) bias: a split of dim 1 gives a rank whole
    heads of all three as a plain shard, which checkpoints save and reshard (a strided split of timm's (3 * dim, dim)
    they cannot)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.empty(3, dim, dim)), nn.Parameter(torch.zeros(3, dim))
        trunc_normal_02(self.weight)  # valid on its own, as nn.Linear is; a model draws it again by name (init_module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.flatten(0, 1), self.bias.flatten())

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args, **kwargs) -> None:
        """timm's and earlier vitctl's (3 * dim, dim) weight and (3 * dim,) bias load too."""
        for name in PACKED_QKV_DIMS:
            if prefix + name in state_dict:
                state_dict[prefix + name] = packed_qkv(name, state_dict[prefix + name])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def packed_qkv(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """timm's qkv `weight` (3 * dim, dim) or `bias` (3 * dim,) in PackedQKV's shape; other shapes as they are."""
    if tensor.dim() == PACKED_QKV_DIMS[name] - 1 and tensor.shape[0] % 3 == 0:
        return tensor.unflatten(0, (3, -1))
    return tensor


def timm_qkv(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """PackedQKV's `weight` or `bias` in timm's nn.Linear shape; other shapes as they are."""
    return tensor.flatten(0, 1) if tensor.dim() == PACKED_QKV_DIMS[name] else tensor


def _qkv_tensor(key: str) -> str | None:
    """`weight` or `bias` where a state-dict key names a tensor of a `qkv` module, else None."""
    module, _, name = key.rpartition(".")
    return name if module.rpartition(".")[2] == "qkv" and name in PACKED_QKV_DIMS else None


def packed_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with timm's qkv shapes in PackedQKV's (those already packed kept)."""
    return {k: packed_qkv(name, v) if (name := _qkv_tensor(k)) else v for k, v in state.items()}


def timm_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with PackedQKV's tensors in timm's nn.Linear shapes, as timm and exports hold them."""
    return {k: timm_qkv(name, v) if (name := _qkv_tensor(k)) else v for k, v in state.items()}


def patch_projection(x: torch.Tensor, proj: nn.Conv2d) -> torch.Tensor:
    """`proj(x)` for a Conv2d whose stride is its kernel, as one matmul over flattened patches: (B, H/p, W/p, dim).

    cuDNN runs this convolution (3 input channels, stride 16) several times slower than the matmul and adds an NCHW
    to NHWC transpose each way; the Conv2d stays as the holder of timm's parameter names and shapes."""
    p = proj.kernel_size[0]
    B, C, H, W = x.shape
    patches = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, H // p, W // p, C * p * p)
    return F.linear(patches, proj.weight.reshape(proj.out_channels, -1), proj.bias)


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class CheckpointableBlock(nn.Module):
    """A block whose activations can be recomputed in the backward instead of stored: `checkpoint` is "full" (keep
    only the input, rerun the forward) or "selective" (keep the matmul and attention outputs, rerun the rest)."""

    checkpoint = "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint == "none" or not (self.training and torch.is_grad_enabled()):
            return self.block_forward(x)
        context = _keep_matmuls if self.checkpoint == "selective" else noop_context_fn
        return checkpoint(self.block_forward, x, use_reentrant=False, context_fn=context)

    def block_forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


# The outputs worth keeping: recomputing them costs a matmul; everything else (norms, GELU, adds) is cheap to rerun.
_SAVED_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_efficient_attention",
              "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_cudnn_attention",
              "vitctl::window_attention", "vitctl::mlp", "aten::_scaled_mm",
              # Tensor parallel's all-reduces: rerunning them would repeat the communication, not just the arithmetic.
              "_c10d_functional::all_reduce", "_c10d_functional::wait_tensor"}


def _keep_matmuls():
    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op.name() in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


trunc_normal_02 = partial(nn.init.trunc_normal_, std=0.02)  # timm's weights; its bounds, +-2, never bite at std 0.02


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator of its own for the tensor called `name` (its whole-model name) in a run seeded by `seed`.
    sha256, not Python's hash(), which is salted per process: every rank must draw the same stream."""
    digest = hashlib.sha256(f"{seed} {name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@torch.no_grad()
def init_tensor(tensor: torch.Tensor, name: str, seed: int, draw: Callable[..., torch.Tensor]) -> None:
    """Fill `tensor` with `draw(whole, generator=...)` from the stream of `name`: the whole tensor's values are drawn
    on the CPU and a DTensor (tensor parallel, FSDP) keeps its shard of them, so every layout holds the same weights.
    A tensor on the meta device has nothing to fill."""
    if tensor.is_meta:
        return
    whole = torch.empty(tensor.shape, device="cpu")  # CPU whatever the default device: the generator's
    draw(whole, generator=tensor_generator(seed, name))
    copy_whole(tensor, whole)


@torch.no_grad()
def copy_whole(tensor: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy `whole`, the values of all of `tensor`, into it; a DTensor takes only its shard of them."""
    if isinstance(tensor, DTensor):  # src_data_rank=None: each rank cuts its shard from its own copy, no broadcast
        whole = distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None)
    tensor.copy_(whole)


@torch.no_grad()
def init_module(module: nn.Module, name: str, seed: int) -> None:
    """timm's initialisation of `module`'s own parameters, `name` being its whole-model name: truncated normal (std
    0.02) for linear and qkv weights, zero biases, LayerNorm's ones and zeros, torch's default for the patch
    convolution (uniform within 1/sqrt(fan_in), weight and bias)."""
    prefix = f"{name}." if name else ""
    if isinstance(module, (nn.Linear, PackedQKV)):
        init_tensor(module.weight, prefix + "weight", seed, trunc_normal_02)
        if module.bias is not None:
            module.bias.zero_()
    elif isinstance(module, LayerNorm):
        module.weight.fill_(1.0)
        module.bias.zero_()
    elif isinstance(module, nn.Conv2d):
        # kaiming_uniform_ with a = sqrt(5) is uniform within 1/sqrt(fan_in), as is the bias: Conv2d.reset_parameters
        init_tensor(module.weight, prefix + "weight", seed, partial(nn.init.kaiming_uniform_, a=math.sqrt(5)))
        if module.bias is not None:
            bound = 1 / math.sqrt(module.in_channels // module.groups * math.prod(module.kernel_size))
            init_tensor(module.bias, prefix + "bias", seed, partial(nn.init.uniform_, a=-bound, b=bound))
