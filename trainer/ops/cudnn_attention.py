"""cuDNN's fused attention through the cuDNN frontend (nvidia-cudnn-frontend), on ViT's packed qkv.

The kernels are those torch's SDPA runs on Hopper; what differs is the layout around them. Here q, k and v are read
as strided views of the qkv projection's output and dq, dk and dv are written straight into one packed gradient,
where SDPA's backward returns three tensors that Inductor then stacks (a copy of the whole qkv gradient each block).
"""

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from . import first_line, register, sdpa
from .cuda import aligned
from .reference import split_heads

DTYPES = (torch.bfloat16, torch.float16)
# uids of the graphs' tensors
Q, K, V, OUT, STATS, GRAD_OUT, GRAD_Q, GRAD_K, GRAD_V = range(9)


@functools.cache
def _cudnn():
    import cudnn  # nvidia-cudnn-frontend

    return cudnn


def unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "needs CUDA"
    try:
        _cudnn()
    except Exception as e:  # not installed, or no libcudnn for it to load
        return f"needs nvidia-cudnn-frontend ({first_line(e)}): pip install 'vitctl[cudnn]'"
    return _declined(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _declined(device: int) -> str | None:
    """Why cuDNN builds no attention graphs on this GPU (before Ampere, or too old a cuDNN), found by building a
    small one: otherwise the first step would fail."""
    try:
        _graphs(1, 8, 1, 64, torch.bfloat16, device, False)
    except Exception as e:
        return f"cuDNN builds no attention graph on cuda:{device} ({first_line(e)})"
    return None


def fits(qkv: Tensor, heads: int) -> bool:
    """cuDNN's attention takes bf16 and fp16 heads up to 128 wide, in multiples of 8."""
    width = qkv.shape[-1] // (3 * heads)
    return qkv.is_cuda and qkv.dtype in DTYPES and width % 8 == 0 and width <= 128


def _strides(tokens: int, heads: int, width: int, parts: int) -> tuple[int, int, int, int]:
    """(batch, head, token, dim) strides of one part of a (B, N, parts, heads, width) tensor."""
    return (tokens * parts * heads * width, width, parts * heads * width, 1)


@dataclass(frozen=True)
class _Graphs:
    forward: object
    backward: object
    handle: object

    def run(self, graph, pack: dict[int, Tensor]) -> None:
        # on the caller's stream: under CUDA graph capture, the capturing one
        _cudnn().set_stream(self.handle, torch.cuda.current_stream().cuda_stream)
        workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=pack[Q].device)
        graph.execute(pack, workspace, handle=self.handle)


@functools.cache
def _handle(device: int):
    with torch.cuda.device(device):
        return _cudnn().create_handle()


@functools.cache
def _graphs(batch: int, tokens: int, heads: int, width: int, dtype: torch.dtype, device: int,
            deterministic: bool) -> _Graphs:
    """The forward and backward graphs of one shape, built on its first call."""
    cudnn = _cudnn()
    data_type = cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF
    handle, dims = _handle(device), (batch, heads, tokens, width)
    packed, single = _strides(tokens, heads, width, 3), _strides(tokens, heads, width, 1)
    stats_dims, stats_strides = (batch, heads, tokens, 1), (heads * tokens, tokens, 1, 1)

    def graph():
        return cudnn.pygraph(io_data_type=data_type, intermediate_data_type=cudnn.data_type.FLOAT,
                             compute_data_type=cudnn.data_type.FLOAT, handle=handle)

    def inputs(g, uids, strides):
        return [g.tensor(uid=u, dim=dims, stride=strides, data_type=data_type) for u in uids]

    def output(t, uid, strides, dtype=data_type, shape=dims):
        t.set_uid(uid).set_output(True).set_dim(shape).set_stride(strides).set_data_type(dtype)

    fwd = graph()
    out, stats = fwd.sdpa(*inputs(fwd, (Q, K, V), packed), generate_stats=True, attn_scale=width ** -0.5)
    output(out, OUT, single)
    output(stats, STATS, stats_strides, cudnn.data_type.FLOAT, stats_dims)

    bwd = graph()
    q, k, v = inputs(bwd, (Q, K, V), packed)
    o, grad_out = inputs(bwd, (OUT, GRAD_OUT), single)
    lse = bwd.tensor(uid=STATS, dim=stats_dims, stride=stats_strides, data_type=cudnn.data_type.FLOAT)
    grads = bwd.sdpa_backward(q, k, v, o, grad_out, lse, attn_scale=width ** -0.5,
                              use_deterministic_algorithm=deterministic)
    for t, uid in zip(grads, (GRAD_Q, GRAD_K, GRAD_V), strict=True):
        output(t, uid, packed)
    for g in (fwd, bwd):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
    return _Graphs(fwd, bwd, handle)


def _graphs_for(qkv: Tensor, heads: int) -> _Graphs:
    batch, tokens, width3 = qkv.shape
    return _graphs(batch, tokens, heads, width3 // (3 * heads), qkv.dtype, qkv.device.index,
                   torch.are_deterministic_algorithms_enabled())


def _heads_view(x: Tensor, heads: int) -> Tensor:
    """(B, N, heads * width) -> (B, heads, N, width), a view."""
    batch, tokens, width = x.shape
    return x.view(batch, tokens, heads, width // heads).transpose(1, 2)


@torch.library.custom_op("vitctl::cudnn_attention", mutates_args=())
def cudnn_attention_op(qkv: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """(B, N, 3C) packed qkv -> the output (B, N, C) and the rows' softmax statistics (B, heads, N, 1) in float."""
    qkv = aligned(qkv)
    batch, tokens, width3 = qkv.shape
    out = qkv.new_empty(batch, tokens, width3 // 3)
    stats = qkv.new_empty(batch, heads, tokens, 1, dtype=torch.float32)
    q, k, v = split_heads(qkv, heads)
    graphs = _graphs_for(qkv, heads)
    graphs.run(graphs.forward, {Q: q, K: k, V: v, OUT: _heads_view(out, heads), STATS: stats})
    return out, stats


@cudnn_attention_op.register_fake
def _(qkv: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    batch, tokens, width3 = qkv.shape
    return qkv.new_empty(batch, tokens, width3 // 3), qkv.new_empty(batch, heads, tokens, 1, dtype=torch.float32)


@torch.library.custom_op("vitctl::cudnn_attention_backward", mutates_args=())
def cudnn_attention_backward_op(grad: Tensor, qkv: Tensor, out: Tensor, stats: Tensor, heads: int) -> Tensor:
    """The packed qkv gradient (B, N, 3C), dq, dk and dv written into it in place."""
    grad, qkv, out, stats = (aligned(t) for t in (grad, qkv, out, stats))
    grad_qkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
    graphs = _graphs_for(qkv, heads)
    pack = dict(zip((Q, K, V, GRAD_Q, GRAD_K, GRAD_V), (*split_heads(qkv, heads), *split_heads(grad_qkv, heads)),
                    strict=True))
    graphs.run(graphs.backward, pack | {OUT: _heads_view(out, heads), GRAD_OUT: _heads_view(grad, heads),
                                        STATS: stats})
    return grad_qkv


@cudnn_attention_backward_op.register_fake
def _(grad: Tensor, qkv: Tensor, out: Tensor, stats: Tensor, heads: int) -> Tensor:
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output) -> None:
    qkv, ctx.heads = inputs
    ctx.save_for_backward(qkv, *output)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad: Tensor, _grad_stats):
    qkv, out, stats = ctx.saved_tensors
    return cudnn_attention_backward_op(grad.to(qkv.dtype), qkv, out, stats, ctx.heads), None


cudnn_attention_op.register_autograd(_backward, setup_context=_setup)


@register("attention", "cudnn", 30, unavailable)
def attention(qkv: Tensor, heads: int) -> Tensor:
    """SDPA for what cuDNN's attention does not take (`fits`)."""
    if not fits(qkv, heads):
        return sdpa.attention(qkv, heads)
    return cudnn_attention_op(qkv, heads)[0]
