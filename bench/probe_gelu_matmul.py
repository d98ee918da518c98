"""The MLP's GELU matmuls: cuBLASLt's epilogues (GELU_AUX_BIAS forward, DGELU backward; the fused MLP op) against
Triton matmuls with GELU in their epilogue, at Swin-B/L's stages and ViT-B/L's shapes. The Triton side lost
(docs/performance.md), so its kernel lives here, not in trainer/ops.

    python bench/probe_gelu_matmul.py

Prints, per shape, GPU ms (median of 20, each run queued while the GPU sleeps so host time is not counted): the plain
cuBLAS matmul (the floor), the best Triton tile setting, and the whole op both ways; then the sum per training step.
"""

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from gpu_time import median_gpu_ms

from vitctl.trainer.bench import cuda_or_exit
from vitctl.trainer.ops.cuda import extension


def gelu_tanh_grad_reference(pre: torch.Tensor) -> torch.Tensor:
    """The derivative of GELU's tanh form at `pre`, in fp32."""
    x = pre.float()
    inner = x * (0.7978845608028654 + 0.035677408136300125 * x * x)
    t = torch.tanh(inner)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * (0.7978845608028654 + 0.10703222440890037 * x * x)


def bias_gelu_matmul_reference(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ w1.T + b1, its GELU): the GELU input and output in x's dtype."""
    pre = x.float() @ w1.float().t() + b1.float()
    return pre.to(x.dtype), torch.nn.functional.gelu(pre, approximate="tanh").to(x.dtype)


def dgelu_matmul_reference(grad: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """(grad @ w2) * GELU'(pre): the gradient of the GELU input, in grad's dtype."""
    return ((grad.float() @ w2.float()) * gelu_tanh_grad_reference(pre)).to(grad.dtype)


@triton.jit
def _tanh(x):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)

@triton.jit
def _gelu_matmul_kernel(a_ptr, b_ptr, bias_ptr, pre_ptr, out_ptr, M, N, K, stride_bk, stride_bn,
                        BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """a (M, K) @ b (K, N), K a multiple of BLOCK_K. Forward: pre = acc + bias, out = GELU(pre); backward:
        out = acc * GELU'(pre). Programs walk GROUP_M row tiles per column tile, so b's tiles stay in L2."""
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        first_m = (pid // (GROUP_M * tiles_n)) * GROUP_M
        group_m = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m
        pid_n = (pid % (GROUP_M * tiles_n)) // group_m
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        columns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * K + ks[None, :]
        b_ptrs = b_ptr + ks[:, None] * stride_bk + columns[None, :] * stride_bn
        row_mask, column_mask = rows[:, None] < M, columns[None, :] < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            acc = tl.dot(tl.load(a_ptrs, mask=row_mask, other=0.0), tl.load(b_ptrs, mask=column_mask, other=0.0),
                         acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
        offsets, mask = rows[:, None] * N + columns[None, :], row_mask & column_mask
        if BACKWARD:
            x = tl.load(pre_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            t = _tanh(x * (0.7978845608028654 + 0.035677408136300125 * x * x))
            slope = 0.7978845608028654 + 0.10703222440890037 * x * x
            out = acc * (0.5 * (1.0 + t) * (1.0 + x * (1.0 - t) * slope))
        else:
            x = acc + tl.load(bias_ptr + columns, mask=columns < N, other=0.0).to(tl.float32)[None, :]
            tl.store(pre_ptr + offsets, x.to(pre_ptr.dtype.element_ty), mask=mask)
            out = 0.5 * x * (1.0 + _tanh(x * (0.7978845608028654 + 0.035677408136300125 * x * x)))
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages)
Config = tuple[int, int, int, int, int, int]
DEFAULT_CONFIG: Config = (128, 128, 64, 8, 8, 3)


def _launch(a: torch.Tensor, b: torch.Tensor, stride_bk: int, stride_bn: int, bias: torch.Tensor | None,
            pre: torch.Tensor, out: torch.Tensor, backward: bool, config: Config) -> None:
    block_m, block_n, block_k, group_m, warps, stages = config
    (m, k), n = a.shape, out.shape[1]
    block_k = next(b for b in (block_k, 32, 16) if k % b == 0)  # the shapes here: k a multiple of 16
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gelu_matmul_kernel[grid](a, b, bias if bias is not None else pre, pre, out, m, n, k, stride_bk, stride_bn,
                              BACKWARD=backward, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
                              num_warps=warps, num_stages=stages)


def bias_gelu_matmul(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, config: Config = DEFAULT_CONFIG
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) @ w1 (H, K).T + b1 -> (GELU input, GELU output), both (M, H)."""
    pre, act = x.new_empty(x.shape[0], w1.shape[0]), x.new_empty(x.shape[0], w1.shape[0])
    _launch(x, w1, 1, w1.shape[1], b1, pre, act, False, config)
    return pre, act


def dgelu_matmul(grad: torch.Tensor, w2: torch.Tensor, pre: torch.Tensor, config: Config = DEFAULT_CONFIG
                 ) -> torch.Tensor:
    """(grad (M, N) @ w2 (N, H)) * GELU'(pre (M, H)) -> the GELU input's gradient (M, H)."""
    out = torch.empty_like(pre)
    _launch(grad, w2, w2.shape[1], 1, None, pre, out, True, config)
    return out

# name, rows, width, hidden, blocks per model
SHAPES = [("swin_b s1", 128 * 3136, 128, 512, 2), ("swin_b s2", 128 * 784, 256, 1024, 2),
          ("swin_b s3", 128 * 196, 512, 2048, 18), ("swin_b s4", 128 * 49, 1024, 4096, 2),
          ("swin_l s1", 128 * 3136, 192, 768, 2), ("swin_l s3", 128 * 196, 768, 3072, 18),
          ("vit_b16", 256 * 197, 768, 3072, 12), ("vit_l16", 128 * 197, 1024, 4096, 24)]
CONFIGS = [(128, 128, 64, 8, 4, 3), (128, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3), (256, 128, 64, 8, 8, 3),
           (128, 128, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4), (128, 256, 32, 8, 8, 4)]


def best(fn: Callable[[Config], object]) -> tuple[float, Config]:
    results = []
    for config in CONFIGS:
        try:
            results.append((median_gpu_ms(lambda c=config: fn(c)), config))
        except Exception as error:  # a tile setting that does not fit in shared memory
            print(f"    {config}: {type(error).__name__}")
    return min(results)


def measure(name: str, rows: int, width: int, hidden: int) -> tuple[float, float]:
    """Prints one shape's figures; returns the op's forward + backward ms on cuBLASLt and with the Triton kernels."""
    ext = extension()
    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(hidden, width, device="cuda", dtype=torch.bfloat16) * width ** -0.5
    b1 = torch.randn(hidden, device="cuda", dtype=torch.bfloat16) * 0.1
    w2 = torch.randn(width, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5
    b2 = torch.zeros(width, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    _, pre, act = ext.fused_mlp_forward(x, w1, b1, w2, b2)
    check = slice(0, 4096)
    pre_t, act_t = bias_gelu_matmul(x, w1, b1)
    ref_pre, ref_act = bias_gelu_matmul_reference(x[check], w1, b1)
    grad_pre = dgelu_matmul(grad, w2, pre)
    ref_grad_pre = dgelu_matmul_reference(grad[check], w2, pre[check])
    errors = [float((a[check].float() - b.float()).abs().max() / b.float().abs().max())
              for a, b in ((pre_t, ref_pre), (act_t, ref_act), (grad_pre, ref_grad_pre), (act, ref_act))]
    fwd_floor = median_gpu_ms(lambda: torch.addmm(b1, x, w1.t()))
    fwd_lt = median_gpu_ms(lambda: ext.fused_mlp_forward(x, w1, b1, w2, b2))
    fc2 = median_gpu_ms(lambda: torch.addmm(b2, act, w2.t()))
    fwd_t, fwd_config = best(lambda c: bias_gelu_matmul(x, w1, b1, c))
    bwd_floor = median_gpu_ms(lambda: grad @ w2)
    bwd_lt = median_gpu_ms(lambda: ext.fused_mlp_backward(grad, x, pre, act, w1, w2))
    bwd_t, bwd_config = best(lambda c: dgelu_matmul(grad, w2, pre, c))
    rest = median_gpu_ms(lambda: (grad_pre @ w1, grad_pre.t() @ x, grad.t() @ act))
    print(f"{name}: rows {rows} width {width} hidden {hidden}; max relative error of the GELU input, output and "
          "input gradient, and of cuBLASLt's output: " + " ".join(f"{e:.1e}" for e in errors))
    print(f"  fc1 forward: addmm {fwd_floor:.3f}, Triton bias+GELU {fwd_t:.3f} {fwd_config}; the op's forward: "
          f"cuBLASLt {fwd_lt:.3f}, Triton + addmm {fwd_t + fc2:.3f}")
    print(f"  backward's first matmul: mm {bwd_floor:.3f}, Triton DGELU {bwd_t:.3f} {bwd_config}; the op's "
          f"backward: cuBLASLt {bwd_lt:.3f}, Triton + 3 mm {bwd_t + rest:.3f}")
    return fwd_lt + bwd_lt, fwd_t + fc2 + bwd_t + rest


def main() -> None:
    cuda_or_exit("python bench/probe_gelu_matmul.py")
    torch.manual_seed(0)
    totals: dict[str, tuple[float, float]] = {}
    for name, rows, width, hidden, blocks in SHAPES:
        lt, triton_ms = measure(name, rows, width, hidden)
        model = name.split()[0]
        old, new = totals.get(model, (0.0, 0.0))
        totals[model] = (old + blocks * lt, new + blocks * triton_ms)
    for model, (old, new) in totals.items():
        print(f"{model} per step, the MLP ops forward and backward: cuBLASLt {old:.2f} ms, Triton {new:.2f} ms "
              f"({new - old:+.2f})")


if __name__ == "__main__":
    main()
