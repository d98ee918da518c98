"""The row-scaled float8 casts and matmuls (trainer/ops/float8_rows.py): the references on the CPU, the Triton
kernels against them on the GPU, and the float8 linear and MLP against bf16's within float8's rounding."""

import pytest
import torch
import torch.nn.functional as F

from vitctl.trainer.ops import float8_rows
from vitctl.trainer.ops.float8_rows import E4M3_MAX, float8_linear, float8_mlp

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
E4M3_STEP = 2 ** -3  # e4m3's relative spacing: 3 mantissa bits


def rows(device: torch.device, n: int = 768) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(48, n, device=device) * torch.logspace(-4, 4, 48, device=device)[:, None]
    x[5] = 0  # an all-zero row
    return x.bfloat16()


def test_each_row_is_scaled_by_a_power_of_two_that_puts_its_largest_value_near_the_float8_maximum():
    x = rows(CPU)
    q, back = float8_rows.quantize_rows_reference(x)
    assert q.dtype == torch.float8_e4m3fn and back.shape == (48, 1) and back.dtype == torch.float32
    exponents = torch.log2(back)
    assert torch.equal(exponents, exponents.round())
    amax = q.float().abs().amax(dim=1)
    assert back[5].item() == 1.0 and amax[5] == 0
    live = amax > 0
    assert ((amax[live] >= E4M3_MAX / 2) & (amax[live] <= E4M3_MAX)).all()
    restored = q.float() * back
    assert ((restored - x.float()).abs() <= E4M3_STEP * x.float().abs() + 1e-30).all()


def test_gelu_backward_reference_is_autograds():
    torch.manual_seed(0)
    h, bias, grad = torch.randn(8, 64), torch.randn(64), torch.randn(8, 64)
    pre = (h + bias).requires_grad_()
    F.gelu(pre).backward(grad)
    _, _, grad_h, g = float8_rows.gelu_backward_quantize_rows_reference(grad, h, bias)
    torch.testing.assert_close(grad_h, pre.grad)
    torch.testing.assert_close(g, F.gelu(h + bias))


def linear_inputs(device: torch.device, n_in: int = 96, n_out: int = 64) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(4, 32, n_in, device=device), torch.randn(n_out, n_in, device=device) * 0.1,
            torch.randn(n_out, device=device)]


def mlp_inputs(device: torch.device, dim: int = 96, hidden: int = 384) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(4, 32, dim, device=device), torch.randn(hidden, dim, device=device) * 0.1,
            torch.randn(hidden, device=device), torch.randn(dim, hidden, device=device) * 0.05,
            torch.randn(dim, device=device)]


def outputs_and_grads(fn, inputs: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.float().square().mean().backward()
    return [out.float(), *(leaf.grad.float() for leaf in leaves)]


def assert_within_float8_rounding(fp8: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    """Every output and gradient within 8% of the reference's norm: float8 rounds each factor by up to 6%, and
    agrees far better on average; a wrong transpose, scale or GELU is off by ~100%."""
    for a, b in zip(fp8, reference, strict=True):
        assert a.shape == b.shape
        assert (a - b).norm() <= 0.08 * b.norm()


@pytest.mark.parametrize(("fp8", "reference", "inputs"), [
    (float8_linear, F.linear, linear_inputs),
    (float8_mlp, lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2), mlp_inputs)],
    ids=["linear", "mlp"])
def test_float8_matmuls_give_bf16s_output_and_gradients_on_the_cpu(fp8, reference, inputs):
    assert_within_float8_rounding(outputs_and_grads(fp8, inputs(CPU), torch.bfloat16),
                                  outputs_and_grads(reference, inputs(CPU), torch.float32))


# ---------------------------------------------------------------- on the GPU: the Triton kernels


@pytest.mark.parametrize("n", [384, 768, 3072, 4096])
@pytest.mark.gpu
@needs_gpu
def test_triton_casts_match_their_references(n):
    """The same power-of-two scales and, but for one rounding step where the kernels' GELU and torch's differ, the
    same float8 values; GELU's bf16 outputs within one bf16 step or 1e-5 of their row's largest value (the scale at
    which the matmuls that take them resolve anything)."""
    x, grad = rows(CUDA, n), rows(CUDA, n).roll(1, dims=0)
    bias = torch.randn(n, device=CUDA).bfloat16()
    q, back = float8_rows.quantize_rows(x)
    ref_q, ref_back = float8_rows.quantize_rows_reference(x)
    assert torch.equal(q.float(), ref_q.float()) and torch.equal(back, ref_back)
    # The forward's tanh is the hardware's, within 2^-11 of torch's: GELU within 2^-12 |x + bias| before the cast.
    tanh_error = 2 ** -12 * (x.float() + bias.float()).abs()
    for kernel, reference, args, error in (
            (float8_rows.gelu_quantize_rows, float8_rows.gelu_quantize_rows_reference, (x, bias), tanh_error),
            (float8_rows.gelu_backward_quantize_rows, float8_rows.gelu_backward_quantize_rows_reference,
             (grad, x, bias), 0)):
        got, want = kernel(*args), reference(*args)
        assert torch.equal(got[1], want[1])
        step = E4M3_STEP * want[0].float().abs() + 2 ** -9 + error / want[1]
        assert ((got[0].float() - want[0].float()).abs() <= step).all()
        for a, b in zip(got[2:], want[2:], strict=True):
            a, b, row_max = a.float(), b.float(), b.float().abs().amax(dim=1, keepdim=True)
            assert ((a - b).abs() <= 2 ** -7 * b.abs() + 1e-5 * row_max).all()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.gpu
@needs_gpu
def test_float8_mlp_on_the_gpu_gives_bf16s_output_and_gradients(compiled):
    def reference(x, w1, b1, w2, b2):
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    fp8 = torch.compile(float8_mlp, fullgraph=True) if compiled else float8_mlp
    inputs = mlp_inputs(CUDA, dim=256, hidden=1024)
    assert_within_float8_rounding(outputs_and_grads(fp8, inputs, torch.bfloat16),
                                  outputs_and_grads(reference, inputs, torch.float32))
