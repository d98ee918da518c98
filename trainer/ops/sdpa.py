"""torch scaled_dot_product_attention where it applies (flash / memory-efficient / cuDNN kernels)."""

import torch
import torch.nn.functional as F

from . import register
from .reference import merge_heads, relative_position_bias, split_heads


@register("attention", "sdpa", 20)
def attention(qkv: torch.Tensor, heads: int) -> torch.Tensor:
    return merge_heads(F.scaled_dot_product_attention(*split_heads(qkv, heads)))


@register("window_attention", "sdpa", 20)
def window_attention(qkv: torch.Tensor, heads: int, scale: float, bias_table: torch.Tensor, bias_index: torch.Tensor,
                     mask: torch.Tensor | None) -> torch.Tensor:
    """Bias and shift mask as one additive mask (flash attention takes none, so a masked backend runs)."""
    q, k, v = split_heads(qkv, heads)
    bias = relative_position_bias(bias_table, bias_index).to(q.dtype)
    if mask is not None:
        nW, N = mask.shape[0], mask.shape[1]
        bias = (bias[None, None] + mask.to(q.dtype)[None, :, None]).expand(q.shape[0] // nW, -1, -1, -1, -1)
        bias = bias.reshape(q.shape[0], -1, N, N)
    return merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale))
