"""Vision Transformer (Dosovitskiy et al.), parameter names as timm's so timm checkpoints load as they are."""

from functools import partial

import torch
from torch import nn

from ..ops import Ops
from .layers import (
    CheckpointableBlock,
    DropPath,
    LayerNorm,
    Mlp,
    PackedQKV,
    init_module,
    init_tensor,
    patch_projection,
    trunc_normal_02,
)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, ops: Ops) -> None:
        super().__init__()
        self.heads, self.ops = heads, ops
        self.qkv, self.proj = PackedQKV(dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the heads this module holds: a share of them under tensor parallelism
        return self.proj(self.ops.attention(self.qkv(x), self.heads))


class Block(CheckpointableBlock):
    def __init__(self, dim: int, heads: int, mlp_ratio: float, drop_path: float, ops: Ops) -> None:
        super().__init__()
        self.norm1, self.attn = LayerNorm(dim, ops, 1e-6), Attention(dim, heads, ops)
        self.norm2, self.mlp = LayerNorm(dim, ops, 1e-6), Mlp(dim, int(dim * mlp_ratio), ops)
        self.drop_path = DropPath(drop_path)

    def block_forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return patch_projection(x, self.proj).flatten(1, 2)


class PreLogits(nn.Module):
    """The MLP head of supervised ViT pretraining: Linear + Tanh before the classifier."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def geometry_error(img_size: int, patch: int) -> str | None:
    if img_size % patch:
        nearest = max(patch, round(img_size / patch) * patch)
        return f"image size {img_size} is not a multiple of the patch size {patch}; the nearest that is: {nearest}"
    return None


class VisionTransformer(nn.Module):
    # The first part of each state_dict key (a timm file with more, e.g. DeiT's dist_token, is another architecture)
    STATE_ROOTS = frozenset({"cls_token", "pos_embed", "patch_embed", "blocks", "norm", "pre_logits", "head"})

    def __init__(self, ops: Ops, img_size: int = 224, patch: int = 16, dim: int = 768, depth: int = 12,
                 heads: int = 12, mlp_ratio: float = 4.0, num_classes: int = 1000, drop_path: float = 0.0,
                 pre_logits: bool = False, seed: int = 0) -> None:
        super().__init__()
        if error := geometry_error(img_size, patch):
            raise ValueError(error)
        self.img_size, self.patch, self.dim = img_size, patch, dim
        self.patch_embed = PatchEmbed(patch, dim)
        self.cls_token = nn.Parameter(torch.empty(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.empty(1, 1 + (img_size // patch) ** 2, dim))
        rates = torch.linspace(0, drop_path, depth, device="cpu").tolist()  # CPU: read under the meta device
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio, rate, ops) for rate in rates)
        self.norm = LayerNorm(dim, ops, 1e-6)
        self.pre_logits = PreLogits(dim) if pre_logits else nn.Identity()
        self.head = nn.Linear(dim, num_classes)
        self.init_weights(seed)

    def init_weights(self, seed: int) -> None:
        """timm's initialisation, each tensor from a stream seeded by `seed` and its name (layers.init_tensor): the
        same weights whichever blocks and shards this rank holds."""
        for name, module in self.named_modules():
            init_module(module, name, seed)
        if self.pos_embed is not None:  # the first pipeline stage's
            init_tensor(self.pos_embed, "pos_embed", seed, trunc_normal_02)
            init_tensor(self.cls_token, "cls_token", seed, partial(nn.init.normal_, std=1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A pipeline stage holds some of the parts; the others are None (parallel/pipeline_parallel.py).
        if self.patch_embed is not None:
            x = self.patch_embed(x)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            if block is not None:
                x = block(x)
        return x if self.head is None else self.head(self.pre_logits(self.norm(x)[:, 0]))

    def layer_id(self, name: str) -> int:
        """Depth of a parameter for layer-wise LR decay: 0 for the embeddings, depth + 1 for the head."""
        if name.startswith(("cls_token", "pos_embed", "patch_embed")):
            return 0
        if name.startswith("blocks."):
            return int(name.split(".")[1]) + 1
        return len(self.blocks) + 1

    def flops_per_image(self) -> float:
        """Forward FLOPs (2 x MACs) of the matmuls, for the MFU estimate."""
        n, d, depth = 1 + (self.img_size // self.patch) ** 2, self.dim, len(self.blocks)
        hidden = self.blocks[0].mlp.fc1.out_features
        per_block = n * d * 3 * d + 2 * n * n * d + n * d * d + 2 * n * d * hidden
        return 2.0 * (depth * per_block + (n - 1) * 3 * self.patch**2 * d)
