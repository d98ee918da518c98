"""Our CUDA kernels against the reference ops (marked gpu; run them with the device tool)."""

import pytest
import torch

from vitctl.trainer.models.swin import relative_position_index, shift_mask
from vitctl.trainer.ops import cuda, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-12}
MAPS = [  # B, H, W, C, window, shift
    (2, 56, 56, 128, 7, 3), (3, 14, 28, 64, 7, 0), (1, 24, 24, 96, 12, 6), (5, 7, 7, 33, 7, 0), (3, 21, 14, 24, 7, 2),
    (1400, 56, 56, 8, 7, 3),  # 89,600 windows: past a 65,535 grid limit
]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", MAPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_partition_and_merge_are_exact(shape, dtype):
    B, H, W, C, window, shift = shape
    x = torch.randn(B, H, W, C, device="cuda", dtype=dtype, requires_grad=True)
    ours = cuda.window_partition_op(x, window, shift)
    ref_x = x.detach().clone().requires_grad_()
    ref = reference.window_partition(ref_x, window, shift)
    assert torch.equal(ours, ref)
    grad = torch.randn_like(ours)
    ours.backward(grad)
    ref.backward(grad)
    assert torch.equal(x.grad, ref_x.grad)
    assert torch.equal(cuda.window_merge_op(ours.detach(), window, shift, H, W), x.detach())


def test_non_contiguous_input_and_bad_shapes():
    x = torch.randn(2, 8, 14, 14, device="cuda").permute(0, 2, 3, 1)  # (2, 14, 14, 8), not contiguous
    assert torch.equal(cuda.window_partition_op(x, 7, 3), reference.window_partition(x, 7, 3))
    with pytest.raises(ValueError, match="is not a multiple of window 7"):
        cuda.window_partition_op(torch.randn(1, 15, 14, 8, device="cuda"), 7, 3)
    with pytest.raises(ValueError, match="shift must be in"):
        cuda.window_partition_op(torch.randn(1, 14, 14, 8, device="cuda"), 7, 7)
    with pytest.raises(ValueError, match="expects \\(B\\*4, 49, C\\)"):
        cuda.window_merge_op(torch.randn(6, 49, 8, device="cuda"), 7, 0, 14, 14)


def _attention_inputs(B: int, n_windows: int, heads: int, window: int, masked: bool, dtype: torch.dtype):
    N, d = window * window, 32
    q, k, v = (torch.randn(B * n_windows, heads, N, d, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    table = (torch.randn((2 * window - 1) ** 2, heads, device="cuda") * 0.5).requires_grad_()
    index = relative_position_index(window).cuda()
    side = int(n_windows**0.5) * window
    mask = shift_mask(side, side, window, window // 2).cuda() if masked else None
    return q, k, v, table, index, mask


@pytest.mark.parametrize(("window", "n_windows", "B"), [(7, 64, 3), (12, 16, 2), (7, 4, 33)])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_attention_matches_reference_forward_and_every_gradient(window, n_windows, B, masked, dtype):
    torch.manual_seed(0)
    inputs = _attention_inputs(B, n_windows, heads=4, window=window, masked=masked, dtype=dtype)
    ref_inputs = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    scale = 32**-0.5
    ours = cuda.window_attention(*inputs[:3], scale, *inputs[3:])
    ref = reference.window_attention(*[t.double() if t is not None and t.is_floating_point() else t
                                       for t in ref_inputs[:3]], scale, ref_inputs[3].double(), ref_inputs[4],
                                     ref_inputs[5].double() if ref_inputs[5] is not None else None)
    assert relative_error(ours, ref) < TOLERANCE[dtype]
    grad = torch.randn_like(ours)
    ours.backward(grad)
    ref.backward(grad.double())
    for name, a, b in zip("qkv", inputs[:3], ref_inputs[:3], strict=True):
        assert relative_error(a.grad, b.grad) < 2 * TOLERANCE[dtype], name
    assert relative_error(inputs[3].grad, ref_inputs[3].grad) < 2 * TOLERANCE[dtype], "bias table"


def test_gradcheck_in_float64():
    q, k, v, table, index, mask = _attention_inputs(2, 4, heads=2, window=4, masked=True, dtype=torch.float64)
    table = table.detach().double().requires_grad_()
    logits = (q @ k.transpose(-2, -1)).detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda lg, t: cuda.window_softmax_op(lg, t, index, mask.double()),
                                    (logits, table), eps=1e-6, atol=1e-5)
    x = torch.randn(2, 8, 8, 3, device="cuda", dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: cuda.window_partition_op(t, 4, 2), (x,))


def test_compiles_without_graph_breaks():
    q, k, v, table, index, mask = _attention_inputs(2, 64, heads=4, window=7, masked=True, dtype=torch.bfloat16)
    x = torch.randn(2, 56, 56, 32, device="cuda", requires_grad=True)

    def block(x, q, k, v, table):
        windows = cuda.window_partition(x, 7, 3)
        merged = cuda.window_merge(windows * 2, 7, 3, 56, 56)
        return merged.sum() + cuda.window_attention(q, k, v, 32**-0.5, table, index, mask).float().sum()

    compiled = torch.compile(block, fullgraph=True)  # raises on a graph break
    out = compiled(x, q, k, v, table)
    out.backward()
    torch.testing.assert_close(out, block(x, q, k, v, table), rtol=1e-2, atol=1e-2)


def test_fused_all_keeps_the_reference_partition_under_compile_only():
    from vitctl.trainer.ops import resolve

    eager = dict(resolve("all", torch.device("cuda")).chosen)
    compiled = dict(resolve("all", torch.device("cuda"), compiling=True).chosen)
    asked = dict(resolve("window_partition=cuda", torch.device("cuda"), compiling=True).chosen)
    assert eager["window_partition"] == "cuda" and compiled["window_partition"] == "reference"
    assert asked["window_partition"] == "cuda" and eager["window_attention"] == "sdpa"


@pytest.mark.slow
def test_swin_t_loss_parity_over_200_steps(tmp_path):
    """Training with every CUDA kernel in use follows the reference ops' loss within 1%."""
    import json

    from vitctl.trainer.config import load_config
    from vitctl.trainer.loop import train

    losses = {}
    for fused in ("none", "all,window_partition=cuda,window_merge=cuda,window_attention=cuda"):
        out = tmp_path / fused.split(",")[0]
        config = load_config(None, ["model.name=swin_t", "model.num_classes=100", "model.drop_path=0.0",
                                    "data.source=synthetic", "data.batch_size=32", "data.train_samples=6400",
                                    "train.epochs=1", "train.precision=bf16", f"train.fused={fused}",
                                    "train.log_every=10", f"train.out_dir={out}", "augment.mixup=0",
                                    "augment.cutmix=0", "optim.warmup_epochs=0.1"])
        train(config, use_cuda=True)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[fused] = [r["loss"] for r in records if "loss" in r]
    reference, fused = losses.values()
    assert len(reference) == len(fused) == 20
    worst = max(abs(a - b) / abs(a) for a, b in zip(reference, fused, strict=True))
    print(f"200 steps: first loss {reference[0]:.4f} / {fused[0]:.4f}, last {reference[-1]:.4f} / {fused[-1]:.4f}, "
          f"worst relative gap {worst:.4%}")
    assert reference[-1] < 0.5 * reference[0]  # it learned something, so the comparison means something
    assert worst < 0.01
