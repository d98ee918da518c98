"""Our CUDA kernels against the reference ops (marked gpu; run them with the device tool)."""

import functools

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
    N, C = window * window, heads * 32
    qkv = torch.randn(B * n_windows, N, 3 * C, device="cuda", dtype=dtype, requires_grad=True)
    table = (torch.randn((2 * window - 1) ** 2, heads, device="cuda") * 0.5).requires_grad_()
    index = relative_position_index(window).cuda()
    side = int(n_windows**0.5) * window
    mask = shift_mask(side, side, window, window // 2).cuda() if masked else None
    return qkv, table, index, mask


ATTENTION_SHAPES = [  # window, windows per image, batch, heads
    (7, 64, 3, 4), (7, 4, 33, 16), (7, 1, 5, 3), (4, 16, 2, 2), (8, 4, 3, 2),  # one kernel: N = 49, 16, 64
    (12, 16, 2, 4),  # N = 144: the seed's design
]


@pytest.mark.parametrize(("window", "n_windows", "B", "heads"), ATTENTION_SHAPES)
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_attention_matches_reference_forward_and_every_gradient(window, n_windows, B, heads, masked, dtype):
    torch.manual_seed(0)
    qkv, table, index, mask = _attention_inputs(B, n_windows, heads, window, masked, dtype)
    ref_qkv, ref_table = (t.detach().double().requires_grad_() for t in (qkv, table))
    scale = 32**-0.5
    ours = cuda.window_attention(qkv, heads, scale, table, index, mask)
    ref = reference.window_attention(ref_qkv, heads, scale, ref_table, index,
                                     mask.double() if mask is not None else None)
    assert ours.dtype == dtype and ours.shape == ref.shape
    assert relative_error(ours, ref) < TOLERANCE[dtype]
    grad = torch.randn_like(ours)
    ours.backward(grad)
    ref.backward(grad.double())
    for part, name in enumerate("qkv"):
        C = heads * 32
        assert relative_error(qkv.grad[..., part * C:(part + 1) * C], ref_qkv.grad[..., part * C:(part + 1) * C]) \
            < 2 * TOLERANCE[dtype], name
    assert relative_error(table.grad, ref_table.grad) < 2 * TOLERANCE[dtype], "bias table"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_attention_on_a_large_batch_and_an_unaligned_view(dtype):
    """Stage 1 of Swin-B at batch 128 (32,768 window-heads per launch), and qkv starting off a 16-byte boundary."""
    torch.manual_seed(0)
    qkv, table, index, mask = _attention_inputs(128, 64, 4, 7, True, dtype)
    ours = cuda.window_attention(qkv, 4, 32**-0.5, table, index, mask)
    ref = reference.window_attention(qkv.double(), 4, 32**-0.5, table.double(), index, mask.double())
    assert relative_error(ours, ref) < TOLERANCE[dtype]
    storage = torch.randn(6 * 49 * 96 + 1, device="cuda", dtype=dtype)
    shifted = storage[1:].view(6, 49, 96)  # 2 bytes past an aligned start
    ours = cuda.window_attention(shifted, 1, 0.2, table[:, :1], index, None)
    ref = reference.window_attention(shifted.double(), 1, 0.2, table[:, :1].double(), index, None)
    assert relative_error(ours, ref) < TOLERANCE[dtype]


def test_fused_attention_rejects_what_it_cannot_take():
    qkv, table, index, mask = _attention_inputs(1, 4, 2, 7, True, torch.bfloat16)
    with pytest.raises(ValueError, match="half/bfloat16"):
        cuda.window_attention_op(qkv.float(), table, index, mask, 0.1)
    with pytest.raises(ValueError, match="3 \\* heads \\* 32"):
        cuda.window_attention_op(qkv, table[:, :1], index, mask, 0.1)
    with pytest.raises(ValueError, match="shift mask must be"):
        cuda.window_attention_op(qkv, table, index, mask[:3], 0.1)
    with pytest.raises(ValueError, match="bias index must be"):
        cuda.window_attention_op(qkv, table, index[:, :48], mask, 0.1)
    with pytest.raises(ValueError, match="bias index must be"):
        cuda.window_attention_op(qkv, table, index.int(), mask, 0.1)


def test_gradcheck_in_float64():
    qkv, table, index, mask = _attention_inputs(2, 4, heads=2, window=4, masked=True, dtype=torch.float64)
    q, k, _ = reference.split_heads(qkv.detach(), 2)
    table = table.detach().double().requires_grad_()
    logits = (q @ k.transpose(-2, -1)).detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda lg, t: cuda.window_softmax_op(lg, t, index, mask.double()),
                                    (logits, table), eps=1e-6, atol=1e-5)
    x = torch.randn(2, 8, 8, 3, device="cuda", dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: cuda.window_partition_op(t, 4, 2), (x,))


def test_compiles_without_graph_breaks():
    qkv, table, index, mask = _attention_inputs(2, 64, heads=4, window=7, masked=True, dtype=torch.bfloat16)
    qkv12, table12, index12, _ = _attention_inputs(2, 4, heads=2, window=12, masked=False, dtype=torch.bfloat16)
    x = torch.randn(2, 56, 56, 32, device="cuda", requires_grad=True)

    def block(x, qkv, table, qkv12, table12):
        windows = cuda.window_partition(x, 7, 3)
        merged = cuda.window_merge(windows * 2, 7, 3, 56, 56)
        fused = cuda.window_attention(qkv, 4, 32**-0.5, table, index, mask)  # one kernel
        seed = cuda.window_attention(qkv12, 2, 32**-0.5, table12, index12, None)  # matmuls + softmax kernel
        return merged.sum() + fused.float().sum() + seed.float().sum()

    compiled = torch.compile(block, fullgraph=True)  # raises on a graph break
    out = compiled(x, qkv, table, qkv12, table12)
    out.backward()
    torch.testing.assert_close(out, block(x, qkv, table, qkv12, table12), rtol=1e-2, atol=1e-1)


def test_fused_all_keeps_the_reference_partition_under_compile_and_takes_the_cuda_attention():
    from vitctl.trainer.ops import resolve

    eager = dict(resolve("all", torch.device("cuda")).chosen)
    compiled = dict(resolve("all", torch.device("cuda"), compiling=True).chosen)
    asked = dict(resolve("window_partition=cuda", torch.device("cuda"), compiling=True).chosen)
    assert eager["window_partition"] == "cuda" and compiled["window_partition"] == "reference"
    assert asked["window_partition"] == "cuda"
    assert eager["window_attention"] == compiled["window_attention"] == "cuda"  # ahead of SDPA, compiled or not


MLP_SHAPES = [(2, 49, 128, 512), (3, 50, 64, 256), (1, 7, 24, 40)]  # batch, tokens, dim, hidden


def _mlp_inputs(batch: int, tokens: int, dim: int, hidden: int, dtype: torch.dtype) -> list[torch.Tensor]:
    shapes = [(batch, tokens, dim), (hidden, dim), (hidden,), (dim, hidden), (dim,)]
    scales = [1.0, dim**-0.5, 0.5, hidden**-0.5, 0.5]
    return [(torch.randn(s, device="cuda") * k).to(dtype).requires_grad_() for s, k in zip(shapes, scales, strict=True)]


def _tanh_gelu_mlp(x, w1, b1, w2, b2):
    return torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1),
                                                               approximate="tanh"), w2, b2)


@pytest.mark.parametrize("shape", MLP_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_mlp_matches_the_tanh_gelu_mlp_forward_and_every_gradient(shape, dtype):
    inputs = _mlp_inputs(*shape, dtype)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    ours, ref = cuda.mlp(*inputs), _tanh_gelu_mlp(*exact)
    assert ours.dtype == dtype and ours.shape == ref.shape
    assert relative_error(ours, ref) < TOLERANCE[dtype]
    grad = torch.randn_like(ref)
    ours.backward(grad.to(dtype))
    ref.backward(grad)
    for name, a, b in zip(("x", "w1", "b1", "w2", "b2"), inputs, exact, strict=True):
        assert relative_error(a.grad, b.grad) < TOLERANCE[dtype], name


def test_fused_mlp_under_autocast_gives_float32_parameters_their_gradients():
    inputs = _mlp_inputs(2, 49, 128, 512, torch.float32)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ours = cuda.mlp(*inputs)
    assert ours.dtype == torch.bfloat16
    ours.float().square().sum().backward()
    exact = [t.detach().double().requires_grad_() for t in inputs]
    _tanh_gelu_mlp(*exact).square().sum().backward()
    for a, b in zip(inputs, exact, strict=True):
        assert a.grad.dtype == torch.float32 and relative_error(a.grad, b.grad) < 2 * TOLERANCE[torch.bfloat16]


def test_fused_mlp_leaves_float32_and_odd_sizes_to_the_reference():
    for dtype, dim in ((torch.float32, 64), (torch.bfloat16, 36)):
        inputs = [t.detach() for t in _mlp_inputs(2, 5, dim, 128, dtype)]
        assert torch.equal(cuda.mlp(*inputs), reference.mlp(*inputs))


def test_fused_mlp_compiles_without_graph_breaks():
    inputs = _mlp_inputs(2, 49, 128, 512, torch.bfloat16)
    compiled = torch.compile(lambda *t: cuda.mlp(*t).float().sum(), fullgraph=True)
    out = compiled(*inputs)
    out.backward()
    torch.testing.assert_close(out, _tanh_gelu_mlp(*inputs).float().sum(), rtol=2e-2, atol=1.0)
    assert all(t.grad is not None for t in inputs)


def test_fused_mlp_shapes_first_met_while_a_cuda_graph_is_captured_replay_right():
    """Each matmul times its candidate algorithms on first use, which cannot run inside a capture: there it takes the
    heuristic's pick."""
    x, w1, b1, w2, b2 = (t.detach() for t in _mlp_inputs(1, 24, 72, 136, torch.bfloat16))  # shapes no other test uses
    x, grad = x[0], torch.randn(24, 72, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, pre, act = cuda.mlp_op(x, w1, b1, w2, b2)
        grad_pre, *grads = cuda.mlp_backward_op(grad, x, pre, act, w1, w2)
    x.copy_(torch.randn_like(x))
    grad.copy_(torch.randn_like(grad))
    graph.replay()
    exact = [t.double().requires_grad_() for t in (x, w1, b1, w2, b2)]
    ref = _tanh_gelu_mlp(*exact)
    ref.backward(grad.double())
    assert relative_error(y, ref) < TOLERANCE[torch.bfloat16]
    for got, want in zip((*grads, grad_pre.sum(0)), (exact[0].grad, exact[1].grad, exact[3].grad, exact[2].grad),
                         strict=True):
        assert relative_error(got, want) < TOLERANCE[torch.bfloat16]


def _bf16_model_and_optimizer(make_optimizer):
    from vitctl.trainer.precision import MasterWeights

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).cuda()
    master = MasterWeights(model)  # casts the model to bf16
    masters = master.module
    groups = [{"params": [masters[0].weight, masters[2].weight], "weight_decay": 0.05},
              {"params": [masters[0].bias, masters[2].bias], "weight_decay": 0.0, "lr": 3e-3}]
    return model, master, make_optimizer(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


@pytest.mark.parametrize("max_norm", [0.0, 0.05])
@pytest.mark.parametrize("accum", [1, 2])  # 2: the gradients reach the kernel summed in fp32
def test_master_adamw_kernel_steps_as_torch_fused_adamw_with_copies(max_norm, accum):
    ran = []

    class Counting(cuda.MasterAdamW):
        def step_master_weights(self, triples, clip=None):
            ran.append(super().step_master_weights(triples, clip))
            return ran[-1]

    ours = _bf16_model_and_optimizer(Counting)
    ref = _bf16_model_and_optimizer(functools.partial(torch.optim.AdamW, fused=True))
    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(4):
        for model, master, optimizer in (ours, ref):
            for micro in range(accum):
                model(x[micro::accum]).float().square().mean().backward()
                if accum > 1:
                    master.accumulate()
            master.step(optimizer, max_norm)
    assert ran == [False, True, True, True]  # torch's first step makes the state; the kernel takes the rest
    (_, master, optimizer), (_, ref_master, ref_optimizer) = ours, ref
    for (p, m), (_, ref_m) in zip(master.pairs, ref_master.pairs, strict=True):
        assert p.grad is None and m.grad is None
        torch.testing.assert_close(m, ref_m, rtol=1e-6, atol=1e-7)
        assert torch.equal(p, m.to(torch.bfloat16))  # the new weights are in the model
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(optimizer.state[m][key], ref_optimizer.state[ref_m][key], rtol=1e-6, atol=1e-9)
    assert optimizer.state[master.pairs[0][1]]["step"].item() == 4


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("gap", [6, 7])  # 7: the parts are not 4-element aligned, so the kernel reads them one by one
def test_master_adamw_takes_the_mean_of_a_gradient_s_parts_as_it_reads_them(parts, gap):
    """ZeRO-1's received buffer: each rank's bf16 gradient of a weight `length` elements after the previous rank's.
    The kernel steps from their mean as it steps from the fp32 mean written beforehand, and the parts' sum of
    squares is the fp32 mean's."""
    _, master, fused = _bf16_model_and_optimizer(cuda.MasterAdamW)
    _, ref_master, ref = _bf16_model_and_optimizer(cuda.MasterAdamW)
    for opt, m in ((fused, master), (ref, ref_master)):  # torch's first step makes the state
        for _, w in m.pairs:
            w.grad = torch.zeros_like(w)
        opt.step()
    sizes = [w.numel() for _, w in master.pairs]
    length = sum(sizes) + gap  # gaps between the parts, as alignment leaves them, hold zeros
    received = torch.zeros(parts * length, dtype=torch.bfloat16, device="cuda")
    received.view(parts, length)[:, :sum(sizes)] = torch.randn(parts, sum(sizes), device="cuda").bfloat16()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    firsts = [received[a:a + w.numel()].view_as(w) for a, (_, w) in zip(starts, master.pairs, strict=True)]
    mean = received.view(parts, length).mean(0, dtype=torch.float32)
    clip = torch.tensor(0.5, device="cuda")
    assert fused.step_master_weights([(g, p, w) for g, (p, w) in zip(firsts, master.pairs, strict=True)], clip,
                                     received, parts)
    assert ref.step_master_weights([(mean[a:a + w.numel()].view_as(w), p, w)
                                    for a, (p, w) in zip(starts, ref_master.pairs, strict=True)], clip)
    for (p, w), (_, ref_w) in zip(master.pairs, ref_master.pairs, strict=True):
        torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-9)
        assert torch.equal(p, w.bfloat16())
    squares = cuda.parts_sum_of_squares(received, parts)
    torch.testing.assert_close(squares, mean.double().square().sum().float(), rtol=1e-5, atol=0)
    torch.testing.assert_close(squares, reference.parts_sum_of_squares(received, parts), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="each gradient must be a bfloat16 view into its first part"):
        fused.step_master_weights([(firsts[-1], *master.pairs[-1])], clip, received, parts + 1)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "bf16-pure"])  # bf16-pure: the master AdamW kernel too
def test_swin_t_loss_parity_over_200_steps(tmp_path, precision):
    """Training with every CUDA kernel in use follows the reference ops' loss within 1%."""
    import json

    from vitctl.trainer.config import load_config
    from vitctl.trainer.loop import train

    losses = {}
    for fused in ("none", "all,window_partition=cuda,window_merge=cuda,window_attention=cuda,mlp=cuda"):
        out = tmp_path / fused.split(",")[0]
        config = load_config(None, ["model.name=swin_t", "model.num_classes=100", "model.drop_path=0.0",
                                    "data.source=synthetic", "data.batch_size=32", "data.train_samples=6400",
                                    "train.epochs=1", f"train.precision={precision}", f"train.fused={fused}",
                                    "train.log_every=10", f"train.out_dir={out}", "augment.mixup=0",
                                    "augment.cutmix=0", "optim.warmup_epochs=0.1"])
        train(config, use_cuda=True)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[fused] = [r["loss"] for r in records if "loss" in r]
    reference, fused = losses.values()
    assert len(reference) == len(fused) == 20
    worst = max(abs(a - b) / abs(a) for a, b in zip(reference, fused, strict=True))
    print(f"{precision}, 200 steps: first loss {reference[0]:.4f} / {fused[0]:.4f}, "
          f"last {reference[-1]:.4f} / {fused[-1]:.4f}, worst relative gap {worst:.4%}")
    assert reference[-1] < 0.5 * reference[0]  # it learned something, so the comparison means something
    assert worst < 0.01
