"""Layers shared by the model files; each calls its op seam so the implementation can be swapped."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

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
    """A block whose activations can be recomputed in backward instead of stored (`checkpointed = True`)."""

    checkpointed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed and self.training and torch.is_grad_enabled():
            return checkpoint(self.block_forward, x, use_reentrant=False)
        return self.block_forward(x)

    def block_forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def init_weights(module: nn.Module, generator: torch.Generator | None = None) -> None:
    """timm's initialisation: truncated normal (std 0.02) for linear layers, zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02, generator=generator)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
