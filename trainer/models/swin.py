"""Swin Transformer (Liu et al.), NHWC throughout, parameter names as timm's (official ones load by key map)."""

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


def relative_position_index(window: int) -> torch.Tensor:
    """(N, N) index into the ((2w-1)^2, heads) bias table, for N = window^2 tokens."""
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
    return relative[..., 0] * (2 * window - 1) + relative[..., 1]


def shift_mask(H: int, W: int, window: int, shift: int) -> torch.Tensor:
    """(nW, N, N) additive mask, -100 between tokens that the cyclic shift brought from different regions."""
    regions = torch.zeros(H, W)
    bounds = ((0, -window), (-window, -shift), (-shift, None))
    for i, (h0, h1) in enumerate(bounds):
        for j, (w0, w1) in enumerate(bounds):
            regions[h0:h1, w0:w1] = 3 * i + j
    windows = regions.view(H // window, window, W // window, window).permute(0, 2, 1, 3).reshape(-1, window**2)
    return (windows[:, None, :] != windows[:, :, None]).float() * -100.0


class WindowAttention(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, ops: Ops) -> None:
        super().__init__()
        self.heads, self.scale, self.window, self.ops = heads, (dim // heads) ** -0.5, window, ops
        self.qkv, self.proj = PackedQKV(dim), nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.empty((2 * window - 1) ** 2, heads))
        trunc_normal_02(self.relative_position_bias_table)  # valid on its own; a model draws it again by name
        self.register_buffer("relative_position_index", relative_position_index(window), persistent=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out = self.ops.window_attention(self.qkv(x), self.heads, self.scale, self.relative_position_bias_table,
                                        self.relative_position_index, mask)
        return self.proj(out)


class SwinBlock(CheckpointableBlock):
    def __init__(self, dim: int, heads: int, resolution: int, window: int, shift: int, drop_path: float,
                 ops: Ops) -> None:
        super().__init__()
        if resolution <= window:  # the window covers the whole map: nothing to shift
            window, shift = resolution, 0
        self.resolution, self.window, self.shift, self.ops = resolution, window, shift, ops
        self.norm1, self.attn = LayerNorm(dim, ops), WindowAttention(dim, heads, window, ops)
        self.norm2, self.mlp = LayerNorm(dim, ops), Mlp(dim, 4 * dim, ops)
        self.drop_path = DropPath(drop_path)
        mask = shift_mask(resolution, resolution, window, shift) if shift else None
        self.register_buffer("attn_mask", mask, persistent=False)

    def block_forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        windows = self.ops.window_partition(self.norm1(x), self.window, self.shift)
        x = x + self.drop_path(self.ops.window_merge(self.attn(windows, self.attn_mask), self.window, self.shift, H, W))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PatchMerging(nn.Module):
    """2x2 neighbours concatenated (in timm's and the official order), normalised, projected to 2C."""

    def __init__(self, dim: int, ops: Ops) -> None:
        super().__init__()
        self.norm, self.reduction = LayerNorm(4 * dim, ops), nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        x = x.reshape(B, H // 2, 2, W // 2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)
        return self.reduction(self.norm(x))


class Stage(nn.Module):
    def __init__(self, dim: int, depth: int, heads: int, resolution: int, window: int, rates: list[float],
                 downsample: bool, ops: Ops) -> None:
        super().__init__()
        self.downsample = PatchMerging(dim // 2, ops) if downsample else nn.Identity()
        self.blocks = nn.ModuleList(
            SwinBlock(dim, heads, resolution, window, 0 if i % 2 == 0 else window // 2, rates[i], ops)
            for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.downsample is not None:
            x = self.downsample(x)
        for block in self.blocks:
            if block is not None:
                x = block(x)
        return x


class PatchEmbed(nn.Module):
    def __init__(self, dim: int, ops: Ops) -> None:
        super().__init__()
        self.proj, self.norm = nn.Conv2d(3, dim, 4, 4), LayerNorm(dim, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(patch_projection(x, self.proj))


class Head(nn.Module):
    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.mean(dim=(1, 2)))


def geometry_error(img_size: int, window: int, depths: tuple[int, ...]) -> str | None:
    problem = _geometry_problem(img_size, window, depths)
    if problem is None:
        return None
    stride = _stride(depths)  # stride x window always works
    sizes = range(stride, max(2 * img_size, stride * window) + stride, stride)
    nearest = min((size for size in sizes if not _geometry_problem(size, window, depths)),
                  key=lambda size: (abs(size - img_size), size))
    return f"{problem}; the nearest size that works with window {window} is {nearest}"


def _geometry_problem(img_size: int, window: int, depths: tuple[int, ...]) -> str | None:
    stride = _stride(depths)
    if img_size % stride:
        return (f"image size {img_size} is not a multiple of {stride} (the patch size 4 times 2 for each of its "
                f"{len(depths) - 1} patch mergings)")
    resolutions = [img_size // 4 // 2**i for i in range(len(depths))]
    if any(r > window and r % window for r in resolutions):
        return (f"image size {img_size} with window {window} gives feature maps {resolutions}; each must be a "
                f"multiple of the window")
    return None


def _stride(depths: tuple[int, ...]) -> int:
    """Pixels per token of the last stage: the patch size 4, doubled by each patch merging."""
    return 4 * 2 ** (len(depths) - 1)


class SwinTransformer(nn.Module):
    STATE_ROOTS = frozenset({"patch_embed", "layers", "norm", "head"})  # the first part of each state_dict key

    def __init__(self, ops: Ops, img_size: int = 224, dim: int = 96, depths: tuple[int, ...] = (2, 2, 6, 2),
                 heads: tuple[int, ...] = (3, 6, 12, 24), window: int = 7, num_classes: int = 1000,
                 drop_path: float = 0.0, seed: int = 0) -> None:
        super().__init__()
        self.img_size, self.window, self.dim, self.depths = img_size, window, dim, depths
        if error := geometry_error(img_size, window, depths):
            raise ValueError(error)
        resolutions = [img_size // 4 // 2**i for i in range(len(depths))]
        rates = torch.linspace(0, drop_path, sum(depths), device="cpu").tolist()  # CPU: read under the meta device
        self.patch_embed = PatchEmbed(dim, ops)
        self.layers = nn.ModuleList()
        for i, (depth, n_heads) in enumerate(zip(depths, heads, strict=True)):
            start = sum(depths[:i])
            self.layers.append(Stage(dim * 2**i, depth, n_heads, resolutions[i], window,
                                     rates[start:start + depth], i > 0, ops))
        self.norm = LayerNorm(dim * 2 ** (len(depths) - 1), ops)
        self.head = Head(dim * 2 ** (len(depths) - 1), num_classes)
        self.init_weights(seed)

    def init_weights(self, seed: int) -> None:
        """timm's initialisation, each tensor from a stream seeded by `seed` and its name (layers.init_tensor): the
        same weights whichever blocks and shards this rank holds. The buffers are computed again: after `to_empty`
        they hold whatever the memory held."""
        for name, module in self.named_modules():
            init_module(module, name, seed)
            if isinstance(module, WindowAttention):
                init_tensor(module.relative_position_bias_table, f"{name}.relative_position_bias_table", seed,
                            trunc_normal_02)
                module.relative_position_index.copy_(relative_position_index(module.window))
            elif isinstance(module, SwinBlock) and module.attn_mask is not None:
                module.attn_mask.copy_(shift_mask(module.resolution, module.resolution, module.window, module.shift))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A pipeline stage holds some of the parts; the others are None (parallel/pipeline_parallel.py).
        if self.patch_embed is not None:
            x = self.patch_embed(x)
        for layer in self.layers:
            x = layer(x)
        return x if self.head is None else self.head(self.norm(x))

    def layer_id(self, name: str) -> int:
        """Depth of a parameter for layer-wise LR decay: blocks counted across stages, head last."""
        if name.startswith("patch_embed"):
            return 0
        if name.startswith("layers."):
            parts = name.split(".")
            stage = int(parts[1])
            block = int(parts[3]) if parts[2] == "blocks" else 0
            return sum(self.depths[:stage]) + block + 1
        return sum(self.depths) + 1

    def flops_per_image(self) -> float:
        """Forward FLOPs (2 x MACs) of the matmuls, for the MFU estimate."""
        macs, n = 3 * 16 * self.dim * (self.img_size // 4) ** 2, (self.img_size // 4) ** 2
        for i, depth in enumerate(self.depths):
            d, tokens = self.dim * 2**i, n // 4**i
            window = min(self.window, self.img_size // 4 // 2**i) ** 2
            if i > 0:
                macs += tokens * 4 * (d // 2) * d
            macs += depth * (tokens * 12 * d * d + 2 * tokens * window * d)
        return 2.0 * macs
