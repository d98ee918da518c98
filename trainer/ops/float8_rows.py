"""float8 matmuls with row scales (recipe fused_rowwise of `trainer/fp8.py`), and the casts they need.

A (rows, n) tensor becomes float8 e4m3 with one power-of-two scale per row, in one pass over memory. Each cast has a
PyTorch reference beside it (the CPU runs it; tests compare the two); on a GPU a Triton kernel does it, because
Inductor's fusion of the same casts ran at a fifth to a half of the kernels' memory throughput
(`python bench/fp8_casts.py`). The forward and input-gradient matmuls run in float8 through torch._scaled_mm; the
weight gradients in bf16 from saved bf16 tensors, so no big tensor needs a float8 transpose.
"""

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch: the references serve
    triton = None

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
SQRT_HALF, INV_SQRT_2PI = math.sqrt(0.5), 1 / math.sqrt(2 * math.pi)


# ---------------------------------------------------------------- references


def quantize_rows_reference(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float8 `rows` and the (rows, 1) fp32 factors back: a power of two scales exactly; an all-zero row gets 1."""
    amax = rows.abs().amax(dim=-1, keepdim=True).float()
    scale = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax))), 1.0)
    return (rows.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale.reciprocal()


def _gelu_grad(h: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(h * SQRT_HALF)) + h * torch.exp(-0.5 * h * h) * INV_SQRT_2PI


def gelu_quantize_rows_reference(h: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GELU(h + bias) in float8 rows: fc2's input from fc1's output without its bias. GELU in its tanh form, within
    4.7e-4 of the erf form: the float8 cast that follows rounds by up to 1/16 of each value."""
    return quantize_rows_reference(torch.nn.functional.gelu(h.float() + bias.float(), approximate="tanh"))


def gelu_backward_quantize_rows_reference(grad: torch.Tensor, h: torch.Tensor, bias: torch.Tensor
                                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 rows of fc1's output gradient, their factors, that gradient in h's dtype, GELU(h + bias) in h's
    dtype): what fc1's input gradient, fc1's weight gradient and fc2's weight gradient need."""
    pre = h.float() + bias.float()
    grad_h = grad.float() * _gelu_grad(pre)
    return *quantize_rows_reference(grad_h), grad_h.to(h.dtype), torch.nn.functional.gelu(pre).to(h.dtype)


# ---------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _tile(pid, m, n, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """This program's ROWS rows: their indices, element offsets and mask."""
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
        columns = tl.arange(0, BLOCK)[None, :]
        return rows, rows * n + columns, (rows < m) & (columns < n)

    @triton.jit
    def _store_scaled(values, q_ptr, back_ptr, rows, offsets, mask, m):
        amax = tl.max(tl.abs(values), axis=1, keep_dims=True)
        scale = tl.where(amax > 0, tl.math.exp2(tl.floor(tl.math.log2(448.0 / amax))), 1.0)
        q = tl.clamp(values * scale, -448.0, 448.0)
        tl.store(q_ptr + offsets, q.to(tl.float8e4nv), mask=mask)
        tl.store(back_ptr + rows, 1.0 / scale, mask=rows < m)

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, back_ptr, m, n, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows, offsets, mask = _tile(tl.program_id(0), m, n, ROWS, BLOCK)
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        _store_scaled(x, q_ptr, back_ptr, rows, offsets, mask, m)

    @triton.jit
    def _pre_activation(h_ptr, bias_ptr, offsets, mask, n, BLOCK: tl.constexpr):
        columns = tl.arange(0, BLOCK)[None, :]
        bias = tl.load(bias_ptr + columns, mask=columns < n, other=0.0)
        return tl.load(h_ptr + offsets, mask=mask, other=0.0).to(tl.float32) + bias.to(tl.float32)

    @triton.jit
    def _normal_cdf_and_pdf(x):
        """The standard normal's cdf (GELU's gate) and pdf at x. libdevice's erf made GELU's backward compute-bound
        at a third of memory speed; this is Abramowitz and Stegun's 7.1.26 (erf within 1.5e-7), branch-free, one exp
        shared by both and a fast reciprocal, in the erfc form so the negative tail keeps its relative precision."""
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        t = tl.math.fdiv(1.0, 1.0 + 0.3275911 * 0.7071067811865476 * tl.abs(x), ieee_rounding=False)
        poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
        tail = 0.5 * poly * pdf * 2.5066282746310002  # 0.5 * erfc(|x| / sqrt 2): poly * exp(-x^2 / 2)
        return tl.where(x < 0, tail, 1.0 - tail), pdf

    @triton.jit
    def _gelu_tanh(x):
        """GELU's tanh form through the hardware's tanh (one instruction, relative error 2^-11): with the erf form
        this cast was bound by arithmetic at 0.6x the speed (docs/performance.md)."""
        inner = x * (0.7978845608028654 + 0.035677408136300125 * x * x)  # sqrt(2 / pi) * (x + 0.044715 x^3)
        tanh = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [inner], dtype=tl.float32,
                                         is_pure=True, pack=1)
        return 0.5 * x * (1.0 + tanh)

    @triton.jit
    def _gelu_quantize_rows_kernel(h_ptr, bias_ptr, q_ptr, back_ptr, m, n, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows, offsets, mask = _tile(tl.program_id(0), m, n, ROWS, BLOCK)
        pre = _pre_activation(h_ptr, bias_ptr, offsets, mask, n, BLOCK)
        _store_scaled(_gelu_tanh(pre), q_ptr, back_ptr, rows, offsets, mask, m)

    @triton.jit
    def _gelu_backward_quantize_rows_kernel(grad_ptr, h_ptr, bias_ptr, q_ptr, back_ptr, grad_h_ptr, g_ptr, m, n,
                                            ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows, offsets, mask = _tile(tl.program_id(0), m, n, ROWS, BLOCK)
        pre = _pre_activation(h_ptr, bias_ptr, offsets, mask, n, BLOCK)
        cdf, pdf = _normal_cdf_and_pdf(pre)
        gelu_grad = cdf + pre * pdf
        grad_h = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * gelu_grad
        tl.store(grad_h_ptr + offsets, grad_h.to(grad_h_ptr.dtype.element_ty), mask=mask)
        tl.store(g_ptr + offsets, (pre * cdf).to(g_ptr.dtype.element_ty), mask=mask)
        _store_scaled(grad_h, q_ptr, back_ptr, rows, offsets, mask, m)


def _launch(kernel, m: int, n: int, *args: object, rows: int | None = None, warps: int | None = None) -> None:
    """`kernel` over m rows of n; rows per program and warps as bench/fp8_casts.py's sweep chose, unless given."""
    block = triton.next_power_of_2(n)
    rows = rows or max(1, 2048 // block)
    warps = warps or (2 if rows * block <= 2048 else 4)
    kernel[(triton.cdiv(m, rows),)](*args, m, n, ROWS=rows, BLOCK=block, num_warps=warps)


def _outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty float8 rows shaped as `x` and their (rows, 1) fp32 factors; real or fake, as `x` is."""
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty((x.shape[0], 1), dtype=torch.float32)


# ---------------------------------------------------------------- the casts, as ops torch.compile leaves whole


@torch.library.custom_op("vitctl::quantize_rows", mutates_args=())
def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous (rows, n) `x` as float8 rows and the (rows, 1) fp32 factors that undo their scales."""
    if x.device.type != "cuda" or triton is None:
        return quantize_rows_reference(x)
    q, back = _outputs(x)
    _launch(_quantize_rows_kernel, x.shape[0], x.shape[1], x, q, back)
    return q, back


@torch.library.custom_op("vitctl::gelu_quantize_rows", mutates_args=())
def gelu_quantize_rows(h: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GELU(h + bias) as float8 rows and their factors back."""
    if h.device.type != "cuda" or triton is None:
        return gelu_quantize_rows_reference(h, bias)
    q, back = _outputs(h)
    _launch(_gelu_quantize_rows_kernel, h.shape[0], h.shape[1], h, bias, q, back)
    return q, back


@torch.library.custom_op("vitctl::gelu_backward_quantize_rows", mutates_args=())
def gelu_backward_quantize_rows(grad: torch.Tensor, h: torch.Tensor, bias: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GELU's backward at h + bias, as float8 rows with factors and in h's dtype, and GELU(h + bias) in h's dtype."""
    if h.device.type != "cuda" or triton is None:
        return gelu_backward_quantize_rows_reference(grad, h, bias)
    q, back = _outputs(h)
    grad_h, g = torch.empty_like(h), torch.empty_like(h)
    _launch(_gelu_backward_quantize_rows_kernel, h.shape[0], h.shape[1], grad, h, bias, q, back, grad_h, g)
    return q, back, grad_h, g


@quantize_rows.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(x)


@gelu_quantize_rows.register_fake
def _(h: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(h)


@gelu_backward_quantize_rows.register_fake
def _(grad: torch.Tensor, h: torch.Tensor, bias: torch.Tensor
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return *_outputs(h), torch.empty_like(h), torch.empty_like(h)



# ---------------------------------------------------------------- the matmuls


def _mm(a: torch.Tensor, a_back: torch.Tensor, b: torch.Tensor, b_back: torch.Tensor, out_dtype: torch.dtype,
        fast_accum: bool) -> torch.Tensor:
    """a @ b.T for float8 rows `a` (m, k) and `b` (n, k) with their factors back, in out_dtype."""
    if a.device.type != "cuda":  # torch 2.11's CPU _scaled_mm takes one scale per tensor only
        return ((a.float() * a_back) @ (b.float() * b_back).t()).to(out_dtype)
    return torch._scaled_mm(a, b.t(), scale_a=a_back, scale_b=b_back.t(), out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def _input_grad(grad_q: torch.Tensor, grad_back: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad @ weight, the weight scaled per input channel (a row of its small transpose)."""
    wt_q, wt_back = quantize_rows(weight.t().contiguous())
    return _mm(grad_q, grad_back, wt_q, wt_back, weight.dtype, fast_accum=False)


class _Float8Linear(torch.autograd.Function):
    """x @ weight.T in float8: x and the output's gradient scaled per row, the weight per output channel forward and
    per input channel backward; the weight's gradient in x's dtype (no float8 transposes of big tensors), fast
    accumulation forward only (as torchao's recipes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _mm(*quantize_rows(x), *quantize_rows(weight), x.dtype, fast_accum=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        return _input_grad(*quantize_rows(grad), weight), grad.t() @ x


class _Float8Mlp(torch.autograd.Function):
    """fc2(GELU(fc1(x))) as _Float8Linear twice, with fc1's bias, GELU and fc2's input cast in one kernel, and GELU's
    backward with fc1's gradient cast in one more; fc2's bias is added by the caller. The forward's GELU is the tanh
    form (it is rounded to float8 at once), the backward the erf form's, as bf16's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        h = _mm(*quantize_rows(x), *quantize_rows(w1), x.dtype, fast_accum=True)
        ctx.save_for_backward(x, w1, b1, w2, h)
        return _mm(*gelu_quantize_rows(h, b1), *quantize_rows(w2), x.dtype, fast_accum=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w1, b1, w2, h = ctx.saved_tensors
        grad = grad.contiguous()
        grad_g = _input_grad(*quantize_rows(grad), w2)
        grad_h_q, grad_h_back, grad_h, g = gelu_backward_quantize_rows(grad_g, h, b1)
        return (_input_grad(grad_h_q, grad_h_back, w1), grad_h.t() @ x, grad_h.sum(0).to(b1.dtype),
                grad.t() @ g)


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) through float8 matmuls; the bias is added outside, where compile fuses it."""
    out = _Float8Linear.apply(x.reshape(-1, x.shape[-1]).contiguous(), weight).unflatten(0, x.shape[:-1])
    return out if bias is None else out + bias.to(out.dtype)


def float8_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
               ) -> torch.Tensor:
    """F.linear(GELU(F.linear(x, w1, b1)), w2, b2) through float8 matmuls."""
    out = _Float8Mlp.apply(x.reshape(-1, x.shape[-1]).contiguous(), w1, b1, w2).unflatten(0, x.shape[:-1])
    return out + b2.to(out.dtype)
