"""Our CUDA kernels (csrc/) as torch.library custom ops: fake implementations for torch.compile, autograd.

The extension is built by `pip install` when a CUDA toolkit and a CUDA build of torch are present (module
`vitctl_cuda_ops`); otherwise it is built just in time on first use and cached by torch, except where
VITCTL_PREBUILT_OPS=1 (the container image) says that it was compiled with vitctl and must be there.
"""

import functools
import importlib
import os
from pathlib import Path

import torch
from torch import Tensor

from . import first_line, reference, register
from .reference import merge_heads, split_heads

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("ops.cpp", "window_process.cu", "window_softmax.cu", "window_attention.cu", "fused_mlp.cpp",
           "master_adamw.cu")
PREBUILT_ONLY_ENV = "VITCTL_PREBUILT_OPS"


def prebuilt_only() -> bool:
    """Set in the image: a missing op there is a broken image, and a just-in-time build would hide it (and need a
    compiler and minutes on every node)."""
    return os.environ.get(PREBUILT_ONLY_ENV) == "1"


@functools.cache
def prebuilt() -> tuple[object | None, str | None]:
    """The module compiled when vitctl was installed, or None and why it does not import."""
    try:
        return importlib.import_module("vitctl_cuda_ops"), None
    except ImportError as e:
        return None, first_line(e)


@functools.cache
def extension():
    """The compiled module; raises with the reason when it cannot be had."""
    module, why = prebuilt()
    if module is not None:
        return module
    if prebuilt_only():
        raise RuntimeError(f"vitctl_cuda_ops is not prebuilt here ({why}) and {PREBUILT_ONLY_ENV}=1 forbids building "
                           "it just in time: rebuild the image (vitctl image build), or unset the variable outside it")
    from torch.utils.cpp_extension import load

    missing = [s for s in SOURCES if not (CSRC / s).exists()]
    if missing:
        raise RuntimeError(f"not prebuilt, and the sources {missing} are not in {CSRC}")
    return load("vitctl_cuda_ops", [str(CSRC / s) for s in SOURCES], extra_cuda_cflags=["-O3", "-lineinfo"],
                verbose=False)


def unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "needs CUDA"
    try:
        extension()
    except Exception as e:  # a failed build, a missing toolkit: say why, the reference op runs instead
        return f"CUDA extension unavailable: {first_line(e)}"
    return None


# ------------------------------------------------------------------ shape checks
# Checked here, before the launch: an error thrown from inside the extension can take the process down when its
# C++ runtime differs from torch's, and these messages say how to fix the call.


def check_map(H: int, W: int, window: int, shift: int) -> None:
    if window <= 0 or H % window or W % window:
        raise ValueError(f"feature map {H}x{W} is not a multiple of window {window} (pad it, or pick a window "
                         "that divides it)")
    if not 0 <= shift < window:
        raise ValueError(f"shift must be in [0, window), got {shift} for window {window}")


def check_attention(logits: Tensor, table: Tensor, index: Tensor, mask: Tensor | None) -> None:
    if logits.dim() != 4 or logits.shape[2] != logits.shape[3] or not logits.is_cuda:
        raise ValueError(f"window softmax expects CUDA logits (B*nW, heads, N, N), got {tuple(logits.shape)}")
    heads, N = logits.shape[1], logits.shape[2]
    if N > 256:
        raise ValueError(f"window softmax supports up to 256 tokens per window, got {N}")
    if table.dim() != 2 or table.shape[1] != heads or tuple(index.shape) != (N, N):
        raise ValueError(f"bias table {tuple(table.shape)} / index {tuple(index.shape)} do not fit {heads} heads "
                         f"and {N} tokens")
    check_shift_mask(mask, N, logits.shape[0])


def check_shift_mask(mask: Tensor | None, N: int, windows: int) -> None:
    if mask is not None and (mask.dim() != 3 or tuple(mask.shape[1:]) != (N, N) or windows % mask.shape[0]):
        raise ValueError(f"shift mask must be (nW, {N}, {N}) with nW dividing {windows}, got {tuple(mask.shape)}")


# ------------------------------------------------------------------ window partition / merge


@torch.library.custom_op("vitctl::window_partition", mutates_args=())
def window_partition_op(x: Tensor, window: int, shift: int) -> Tensor:
    if x.dim() != 4:
        raise ValueError(f"window_partition expects (B, H, W, C), got {tuple(x.shape)}")
    check_map(x.shape[1], x.shape[2], window, shift)
    return extension().window_partition(x, window, shift)


@window_partition_op.register_fake
def _(x: Tensor, window: int, shift: int) -> Tensor:
    B, H, W, C = x.shape
    return x.new_empty(B * (H // window) * (W // window), window * window, C)


@torch.library.custom_op("vitctl::window_merge", mutates_args=())
def window_merge_op(windows: Tensor, window: int, shift: int, H: int, W: int) -> Tensor:
    check_map(H, W, window, shift)
    per_image = (H // window) * (W // window)
    if windows.dim() != 3 or windows.shape[1] != window * window or windows.shape[0] % per_image:
        raise ValueError(f"window_merge expects (B*{per_image}, {window * window}, C), got {tuple(windows.shape)}")
    return extension().window_merge(windows, window, shift, H, W)


@window_merge_op.register_fake
def _(windows: Tensor, window: int, shift: int, H: int, W: int) -> Tensor:
    return windows.new_empty(windows.shape[0] // ((H // window) * (W // window)), H, W, windows.shape[2])


def _partition_setup(ctx, inputs, output) -> None:
    x, ctx.window, ctx.shift = inputs
    ctx.H, ctx.W = x.shape[1], x.shape[2]


def _partition_backward(ctx, grad: Tensor):
    return window_merge_op(grad, ctx.window, ctx.shift, ctx.H, ctx.W), None, None


def _merge_setup(ctx, inputs, output) -> None:
    _, ctx.window, ctx.shift, _, _ = inputs


def _merge_backward(ctx, grad: Tensor):
    return window_partition_op(grad, ctx.window, ctx.shift), None, None, None, None


window_partition_op.register_autograd(_partition_backward, setup_context=_partition_setup)
window_merge_op.register_autograd(_merge_backward, setup_context=_merge_setup)

# ------------------------------------------------------------------ window softmax (bias + mask + softmax)


@torch.library.custom_op("vitctl::window_softmax", mutates_args=())
def window_softmax_op(logits: Tensor, table: Tensor, index: Tensor, mask: Tensor | None) -> Tensor:
    check_attention(logits, table, index, mask)
    return extension().window_softmax_forward(logits, table, index, mask)


@window_softmax_op.register_fake
def _(logits: Tensor, table: Tensor, index: Tensor, mask: Tensor | None) -> Tensor:
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.custom_op("vitctl::window_softmax_backward", mutates_args=())
def window_softmax_backward_op(probs: Tensor, grad: Tensor, index: Tensor, entries: int) -> tuple[Tensor, Tensor]:
    grad_logits, grad_bias = extension().window_softmax_backward(probs, grad)
    heads = grad_bias.shape[0]
    # The kernel summed over windows per (head, i, j); the table gathers (i, j) pairs that share an offset.
    grad_table = grad_bias.new_zeros(entries, heads).index_add_(0, index.reshape(-1), grad_bias.reshape(heads, -1).T)
    return grad_logits, grad_table


@window_softmax_backward_op.register_fake
def _(probs: Tensor, grad: Tensor, index: Tensor, entries: int) -> tuple[Tensor, Tensor]:
    accumulate = torch.float64 if probs.dtype == torch.float64 else torch.float32  # the kernel's op-math type
    return torch.empty_like(probs, memory_format=torch.contiguous_format), probs.new_empty(
        entries, probs.shape[1], dtype=accumulate)


def _softmax_setup(ctx, inputs, output) -> None:
    _, table, index, _ = inputs
    ctx.save_for_backward(output, index)
    ctx.entries, ctx.table_dtype = table.shape[0], table.dtype


def _softmax_backward(ctx, grad: Tensor):
    probs, index = ctx.saved_tensors
    grad_logits, grad_table = window_softmax_backward_op(probs, grad, index, ctx.entries)
    return grad_logits, grad_table.to(ctx.table_dtype), None, None


window_softmax_op.register_autograd(_softmax_backward, setup_context=_softmax_setup)

# ------------------------------------------------------------------ whole window attention in one kernel

FUSED_DTYPES, FUSED_MAX_TOKENS, FUSED_HEAD_DIM = (torch.float16, torch.bfloat16), 64, 32


def fused_attention_fits(qkv: Tensor, heads: int) -> bool:
    """The one-kernel attention takes half and bfloat16, 1 to 64 tokens (windows up to 8) and head dim 32: Swin's."""
    return (qkv.dtype in FUSED_DTYPES and qkv.dim() == 3 and 1 <= qkv.shape[1] <= FUSED_MAX_TOKENS
            and qkv.shape[2] == 3 * heads * FUSED_HEAD_DIM)


def check_fused_attention(qkv: Tensor, table: Tensor, index: Tensor, mask: Tensor | None) -> None:
    heads = table.shape[1] if table.dim() == 2 else -1
    if not qkv.is_cuda or not fused_attention_fits(qkv, heads):
        raise ValueError(f"fused window attention takes CUDA half/bfloat16 qkv (B*nW, 1 <= N <= {FUSED_MAX_TOKENS}, "
                         f"3 * heads * {FUSED_HEAD_DIM}); got {qkv.dtype} {tuple(qkv.shape)} with {heads} heads")
    N = qkv.shape[1]
    if tuple(index.shape) != (N, N) or index.dtype != torch.int64:
        raise ValueError(f"bias index must be int64 ({N}, {N}), got {index.dtype} {tuple(index.shape)}")
    check_shift_mask(mask, N, qkv.shape[0])


def aligned(t: Tensor) -> Tensor:
    """Contiguous and 16-byte aligned, as the kernels' vector loads need."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def as_float(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.float().contiguous()


# The kernels read the ((2w-1)^2, heads) relative-position table through the (N, N) index themselves and return its
# gradient: with the gather outside them, its backward under torch.compile was an index_put kernel per block, whose
# contended bfloat16 atomics took 1.4 ms of a bf16-pure Swin-B step (docs/performance.md).
@torch.library.custom_op("vitctl::window_attention", mutates_args=())
def window_attention_op(qkv: Tensor, table: Tensor, index: Tensor, mask: Tensor | None,
                        scale: float) -> tuple[Tensor, Tensor]:
    """(B*nW, N, 3C) qkv, the bias table and its (N, N) index -> the output (B*nW, N, C), the row log-sum-exp
    (B*nW, heads, N) in float."""
    check_fused_attention(qkv, table, index, mask)
    out, lse = extension().window_attention_forward(aligned(qkv), as_float(table), index.contiguous(),
                                                    as_float(mask), scale)
    return out, lse


@window_attention_op.register_fake
def _(qkv: Tensor, table: Tensor, index: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    B_, N, C3 = qkv.shape
    return qkv.new_empty(B_, N, C3 // 3), qkv.new_empty(B_, table.shape[1], N, dtype=torch.float32)


@torch.library.custom_op("vitctl::window_attention_backward", mutates_args=())
def window_attention_backward_op(grad: Tensor, qkv: Tensor, lse: Tensor, table: Tensor, index: Tensor,
                                 mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """The qkv gradient and the bias table's gradient (float)."""
    grad_qkv, grad_table = extension().window_attention_backward(
        aligned(grad.to(qkv.dtype)), aligned(qkv), lse.contiguous(), as_float(table), index.contiguous(),
        as_float(mask), scale)
    return grad_qkv, grad_table


@window_attention_backward_op.register_fake
def _(grad: Tensor, qkv: Tensor, lse: Tensor, table: Tensor, index: Tensor, mask: Tensor | None,
      scale: float) -> tuple[Tensor, Tensor]:
    return (torch.empty_like(qkv, memory_format=torch.contiguous_format),
            table.new_empty(table.shape, dtype=torch.float32))


def _attention_setup(ctx, inputs, output) -> None:
    qkv, table, index, mask, ctx.scale = inputs
    ctx.save_for_backward(qkv, output[1], table, index, mask)
    ctx.mark_non_differentiable(output[1])


def _attention_backward(ctx, grad: Tensor, _grad_lse):
    qkv, lse, table, index, mask = ctx.saved_tensors
    grad_qkv, grad_table = window_attention_backward_op(grad, qkv, lse, table, index, mask, ctx.scale)
    return grad_qkv, grad_table.to(table.dtype), None, None, None


window_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)

# ---------------------------------------------------------------- MLP on cuBLASLt, GELU and its derivative in epilogues


def fused_mlp_fits(x: Tensor, w1: Tensor, w2: Tensor) -> bool:
    """cuBLASLt's GELU epilogue needs 16-byte aligned rows: every feature size a multiple of 8."""
    return x.is_cuda and all(n % 8 == 0 for n in (x.shape[-1], w1.shape[0], w2.shape[0]))


@torch.library.custom_op("vitctl::mlp", mutates_args=())
def mlp_op(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(M, K) x -> fc2(GELU(fc1(x))) (M, N), and the GELU input and output (M, H), kept for backward."""
    if x.dim() != 2 or w1.shape != (b1.shape[0], x.shape[1]) or w2.shape != (b2.shape[0], w1.shape[0]):
        raise ValueError(f"fused MLP: x {tuple(x.shape)}, fc1 {tuple(w1.shape)} + {tuple(b1.shape)}, fc2 "
                         f"{tuple(w2.shape)} + {tuple(b2.shape)} do not chain")
    y, pre, act = extension().fused_mlp_forward(aligned(x), *(aligned(t) for t in (w1, b1, w2, b2)))
    return y, pre, act


@mlp_op.register_fake
def _(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    rows, hidden = x.shape[0], w1.shape[0]
    return x.new_empty(rows, w2.shape[0]), x.new_empty(rows, hidden), x.new_empty(rows, hidden)


@torch.library.custom_op("vitctl::mlp_backward", mutates_args=())
def mlp_backward_op(grad: Tensor, x: Tensor, pre: Tensor, act: Tensor, w1: Tensor,
                    w2: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of the GELU input (GELU's derivative in the first matmul's epilogue), x, w1 and w2."""
    return tuple(extension().fused_mlp_backward(*(aligned(t) for t in (grad, x, pre, act, w1, w2))))


@mlp_backward_op.register_fake
def _(grad: Tensor, x: Tensor, pre: Tensor, act: Tensor, w1: Tensor,
      w2: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return torch.empty_like(pre), torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2)


def _mlp_setup(ctx, inputs, output) -> None:
    x, w1, _, w2, _ = inputs
    ctx.save_for_backward(x, output[1], output[2], w1, w2)
    ctx.mark_non_differentiable(output[1], output[2])


def _mlp_backward(ctx, grad: Tensor, _grad_pre, _grad_act):
    """The matmuls in the op; the bias gradients are plain sums, which Inductor fuses with their neighbours."""
    x, pre, act, w1, w2 = ctx.saved_tensors
    grad = grad.to(x.dtype)
    grad_pre, grad_x, grad_w1, grad_w2 = mlp_backward_op(grad, x, pre, act, w1, w2)
    return grad_x, grad_w1, grad_pre.sum(0), grad_w2, grad.sum(0)


mlp_op.register_autograd(_mlp_backward, setup_context=_mlp_setup)

# ------------------------------------------------------------------ AdamW on float32 masters from bfloat16 gradients


class MasterAdamW(torch.optim.AdamW):
    """torch's fused AdamW, which also steps float32 master weights from a bfloat16 model's gradients and writes the
    new weights back to the model in one kernel (bf16-pure). State and checkpoints are torch's fused AdamW's."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, fused=True, **kwargs)

    @torch.no_grad()
    def step_master_weights(self, triples: list[tuple[Tensor, Tensor, Tensor]], clip: Tensor | None = None,
                            received: Tensor | None = None, parts: int = 1) -> bool:
        """Step (gradient, bfloat16 parameter, float32 master) triples, the gradients all bfloat16 or all float32 and
        scaled by `clip` (a one-element tensor) when given. With `received` (ZeRO-1's), a bfloat16 buffer of `parts`
        equal parts, each gradient is a view into its first part and stands for its mean with the same place in the
        others. False, with nothing done, where the kernel does not apply."""
        if not self.applies(triples):
            return False
        stride = 0
        if received is not None:  # the kernel reads `parts - 1` strides past each gradient: they must stay inside
            stride, start = received.numel() // parts, received.data_ptr()
            end = start + stride * received.element_size()
            inside = (start <= g.data_ptr() <= end - g.numel() * g.element_size() for g, _, _ in triples)
            if received.dtype != torch.bfloat16 or not all(inside):
                raise ValueError("master AdamW: with `received`, each gradient must be a bfloat16 view into its first "
                                 "part")
        group_of = {m: g for g in self.param_groups for m in g["params"]}
        states = [self.state[m] for _, _, m in triples]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        (beta1, beta2), eps = self.param_groups[0]["betas"], self.param_groups[0]["eps"]
        extension().master_adamw([g for g, _, _ in triples], [p for _, p, _ in triples], [m for _, _, m in triples],
                                 [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], steps,
                                 [group_of[m]["lr"] for _, _, m in triples],
                                 [group_of[m]["weight_decay"] for _, _, m in triples], beta1, beta2, eps,
                                 None if clip is None else clip.float().reshape(1), parts, stride)
        return True

    def applies(self, triples: list[tuple[Tensor, Tensor, Tensor]]) -> bool:
        """Whether the kernel steps these: not before torch's first step has made the state, nor for amsgrad, maximize
        or per-group betas and eps."""
        first = self.param_groups[0]
        same = all(not g["amsgrad"] and not g["maximize"] and (g["betas"], g["eps"]) == (first["betas"], first["eps"])
                   for g in self.param_groups)
        grad_dtype = triples[0][0].dtype if triples else None
        return same and bool(triples) and grad_dtype in (torch.bfloat16, torch.float32) and all(
            m in self.state and p.dtype == torch.bfloat16 and g.dtype == grad_dtype and g.is_contiguous()
            for g, p, m in triples)


def parts_sum_of_squares(flat: Tensor, parts: int) -> Tensor:
    """The sum of squares of the mean of a bfloat16 `flat`'s `parts` equal slices, in float32 (one CUDA kernel that
    writes no mean); ZeRO-1's squared gradient norm from the parts the ranks sent."""
    if flat.is_cuda and unavailable(flat.device) is None:
        return extension().parts_sum_of_squares(flat, parts)
    return reference.parts_sum_of_squares(flat, parts)


# ------------------------------------------------------------------ the seams


# Under torch.compile the custom-op boundary stops Inductor fusing the partition with LayerNorm and the residual
# add, which costs more than the kernel saves; in eager runs the kernels are over 10x the reference op
# (docs/performance.md).
@register("window_partition", "cuda", 40, unavailable, under_compile=False)
def window_partition(x: Tensor, window: int, shift: int) -> Tensor:
    return window_partition_op(x, window, shift)


@register("window_merge", "cuda", 40, unavailable, under_compile=False)
def window_merge(windows: Tensor, window: int, shift: int, H: int, W: int) -> Tensor:
    return window_merge_op(windows, window, shift, H, W)


def seed_window_attention(qkv: Tensor, heads: int, scale: float, bias_table: Tensor, bias_index: Tensor,
                          mask: Tensor | None) -> Tensor:
    """The seed's design: q k^T and P v by cuBLAS around one kernel for bias + mask + softmax."""
    q, k, v = split_heads(qkv, heads)
    logits = (q * scale) @ k.transpose(-2, -1)
    return merge_heads(window_softmax_op(logits, bias_table, bias_index, mask) @ v)


@register("window_attention", "cuda", 30, unavailable)
def window_attention(qkv: Tensor, heads: int, scale: float, bias_table: Tensor, bias_index: Tensor,
                     mask: Tensor | None) -> Tensor:
    """One kernel for Swin's half/bfloat16 windows of 7; otherwise (fp32, window 12) the seed's design."""
    if fused_attention_fits(qkv, heads):
        return window_attention_op(qkv, bias_table, bias_index, mask, scale)[0]
    return seed_window_attention(qkv, heads, scale, bias_table, bias_index, mask)


# cuBLASLt's GELU is the tanh form, which differs from the exact (erf) GELU of the reference and timm by under 5e-4,
# below bfloat16's resolution: float32 runs, where that would show, take the reference. In eager runs it lost to the
# reference at Swin's stage 1 (docs/performance.md, item 10), so `--fused all` takes it only under torch.compile.
@register("mlp", "cuda", 35, unavailable, in_eager=False)
def mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """fc2(GELU(fc1(x))) on cuBLASLt with GELU and its derivative in matmul epilogues, for half and bfloat16."""
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    if dtype not in FUSED_DTYPES or not fused_mlp_fits(x, w1, w2):
        return reference.mlp(x, w1, b1, w2, b2)
    y, _, _ = mlp_op(*(t.to(dtype) for t in (x.reshape(-1, x.shape[-1]), w1, b1, w2, b2)))
    return y.view(*x.shape[:-1], w2.shape[0])


@register("optimizer", "cuda", 40, unavailable)
def master_adamw(groups: list[dict], lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    return MasterAdamW(groups, lr=lr, betas=betas, eps=eps)
