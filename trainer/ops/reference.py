"""Reference implementations in plain PyTorch: the ground truth for every fused op, and what runs on CPU."""

import torch
import torch.nn.functional as F

from . import register


@register("window_partition", "reference", 0)
def window_partition(x: torch.Tensor, window: int, shift: int) -> torch.Tensor:
    """(B, H, W, C) -> cyclic shift by -shift -> (B * nW, window * window, C)."""
    if shift:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    B, H, W, C = x.shape
    x = x.view(B, H // window, window, W // window, window, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(B * (H // window) * (W // window), window * window, C)


@register("window_merge", "reference", 0)
def window_merge(windows: torch.Tensor, window: int, shift: int, H: int, W: int) -> torch.Tensor:
    """(B * nW, window * window, C) -> (B, H, W, C) -> cyclic shift by +shift."""
    C = windows.shape[-1]
    B = windows.shape[0] // ((H // window) * (W // window))
    x = windows.view(B, H // window, W // window, window, window, C).permute(0, 1, 3, 2, 4, 5)
    x = x.reshape(B, H, W, C)
    if shift:
        x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
    return x


def relative_position_bias(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gather the (heads, N, N) bias from the ((2w-1)^2, heads) table."""
    N = index.shape[0]
    return table[index.view(-1)].view(N, N, -1).permute(2, 0, 1)


def split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B_, N, 3C) packed projection -> q, k, v as (B_, heads, N, C / heads) views."""
    B_, N, C3 = qkv.shape
    return qkv.reshape(B_, N, 3, heads, C3 // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)


def merge_heads(out: torch.Tensor) -> torch.Tensor:
    """(B_, heads, N, d) -> (B_, N, heads * d)."""
    B_, heads, N, d = out.shape
    return out.transpose(1, 2).reshape(B_, N, heads * d)


@register("window_attention", "reference", 0)
def window_attention(qkv: torch.Tensor, heads: int, scale: float, bias_table: torch.Tensor, bias_index: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q k^T * scale + bias[head] + mask[window]) @ v: (B * nW, N, 3C) qkv -> (B * nW, N, C)."""
    q, k, v = split_heads(qkv, heads)
    attn = (q * scale) @ k.transpose(-2, -1)
    attn = attn + relative_position_bias(bias_table, bias_index).to(attn.dtype)
    if mask is not None:
        nW, N = mask.shape[0], mask.shape[1]
        attn = attn.view(-1, nW, attn.shape[1], N, N) + mask.to(attn.dtype)[None, :, None]
        attn = attn.view(-1, attn.shape[2], N, N)
    return merge_heads(attn.softmax(dim=-1) @ v)


@register("attention", "reference", 0)
def attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, 3C) packed qkv -> (B, N, C)."""
    q, k, v = split_heads(qkv, heads)
    attn = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
    return merge_heads(attn.softmax(dim=-1) @ v)


@register("layer_norm", "reference", 0)
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    if weight.dtype != x.dtype:  # an fp32 stream, bf16 weights gathered by FSDP2: in fp32, as CUDA's autocast does
        return F.layer_norm(x.float(), weight.shape, weight.float(), bias.float(), eps)
    return F.layer_norm(x, weight.shape, weight, bias, eps)


@register("mlp", "reference", 0)
def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


@register("optimizer", "reference", 0)
def adamw(groups: list[dict], lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)


@register("optimizer", "torch-fused", 35, lambda d: None if d.type == "cuda" else "needs CUDA")
def fused_adamw(groups: list[dict], lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)


def parts_sum_of_squares(flat: torch.Tensor, parts: int) -> torch.Tensor:
    """The sum of squares of the mean of `flat`'s `parts` equal slices, in float32."""
    return flat.view(parts, -1).mean(0, dtype=torch.float32).square().sum()
