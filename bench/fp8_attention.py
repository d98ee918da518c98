"""Attention in float8 on one GPU: cuDNN's float8 attention (through the cuDNN frontend's Python graphs) against the
bf16 attention our ViT step ran (torch's SDPA, whose default on Hopper is cuDNN's), forward and backward at ViT's
training shapes, with q, k and v strided views of the packed qkv output as the model has them. Its `cudnn bf16` row
is the design trainer/ops/cudnn_attention.py then took up (docs/performance.md has this script's figures).

Per shape, GPU ms from the profiler (bench_ops.time_ms, 20 runs after warm-up):
- `torch sdpa bf16`: compiled, forward, and backward with dq, dk and dv stacked into the packed qkv gradient;
- `cudnn bf16`: the same through the frontend, dq, dk and dv written into one packed buffer (no stack);
- `cudnn fp8`: e4m3 q, k, v, o, dO and softmax (Hopper's cuDNN takes no bf16 o), gradients written packed in bf16
  (e4m3 where cuDNN builds no bf16 ones); one scale per tensor: dP's and the e4m3 gradients' from the previous
  call's amax (delayed), o's from v's, the softmax's fixed, the others from their tensors' amax;
- `casts`: what fp8 adds around it: qkv and dO cast to e4m3 with their amax (compiled, one pass each plus the amax).
Errors: ||x - ref|| / ||ref|| against float32 attention on the same bf16 inputs.
Needs `pip install nvidia-cudnn-frontend` (cuDNN >= 9.14 for float8 attention) and a Hopper GPU.
"""

import argparse

import torch
import torch.nn.functional as F
from bench_ops import time_ms  # bench/ is the script's folder
from torch.nn.attention import SDPBackend, sdpa_kernel

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
# batch, tokens, heads, head width; the last is no model's: ViT-B's width in 128-wide heads, which Hopper's float8
# backward needs
SHAPES = {"vit_b16": (256, 197, 12, 64), "vit_l16": (128, 197, 16, 64), "vit_b16_heads128": (256, 197, 6, 128)}
# uids of the graphs' tensors
Q, K, V, OUT, STATS, DO, DQ, DK, DV = range(9)
DESCALE_Q, DESCALE_K, DESCALE_V, DESCALE_S, SCALE_S, SCALE_O, AMAX_S, AMAX_O = range(10, 18)
DESCALE_O, DESCALE_DO, DESCALE_DP, SCALE_DP, SCALE_DQ, SCALE_DK, SCALE_DV = range(20, 27)
AMAX_DQ, AMAX_DK, AMAX_DV, AMAX_DP = range(30, 34)


def packed_strides(n: int, heads: int, width: int, parts: int) -> tuple[int, ...]:
    """(batch, head, token, dim) strides of one part of a (B, N, parts, H, d) tensor."""
    return (n * parts * heads * width, width, parts * heads * width, 1)


class CudnnAttention:
    """cuDNN's attention forward and backward graphs at one shape, bf16 or float8 (e4m3; on Hopper o is e4m3 too),
    dq, dk and dv in bf16 or e4m3 written into one packed (B, N, 3, H, d) buffer."""

    def __init__(self, cudnn, b: int, n: int, h: int, d: int, fp8: bool, fp8_grads: bool = False) -> None:
        self.cudnn, self.fp8, self.fp8_grads, self.shape = cudnn, fp8, fp8_grads, (b, h, n, d)
        self.handle = cudnn.create_handle()
        cudnn.set_stream(self.handle, torch.cuda.current_stream().cuda_stream)
        self.fwd, self.bwd, self.no_bwd = self._forward_graph(), None, ""
        try:
            self.bwd = self._backward_graph()
        except cudnn.cudnnGraphNotSupportedError as e:  # Hopper's float8 backward takes only 128-wide heads
            self.no_bwd = str(e)
        sizes = [g.get_workspace_size() for g in (self.fwd, self.bwd) if g is not None]
        self.workspace = torch.empty(max(sizes), dtype=torch.uint8, device="cuda")

    def _graph(self):
        dt = self.cudnn.data_type
        return self.cudnn.pygraph(io_data_type=dt.FP8_E4M3 if self.fp8 else dt.BFLOAT16,
                                  intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT, handle=self.handle)

    def _qkv(self, g, uids: tuple[int, ...]):
        b, h, n, d = self.shape
        return [g.tensor(uid=u, dim=self.shape, stride=packed_strides(n, h, d, 3), data_type=self._io_type())
                for u in uids]

    def _scalars(self, g, uids: tuple[int, ...]):
        return [g.tensor(uid=u, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=self.cudnn.data_type.FLOAT)
                for u in uids]

    def _out(self, t, uid: int, stride: tuple[int, ...], dtype=None):
        t.set_uid(uid).set_output(True).set_dim(self.shape).set_stride(stride)
        t.set_data_type(dtype or self.cudnn.data_type.BFLOAT16)

    def _amax(self, t, uid: int) -> None:
        t.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1))
        t.set_data_type(self.cudnn.data_type.FLOAT)

    def _forward_graph(self):
        b, h, n, d = self.shape
        g = self._graph()
        q, k, v = self._qkv(g, (Q, K, V))
        if self.fp8:
            dq_, dk_, dv_, ds, ss, so = self._scalars(g, (DESCALE_Q, DESCALE_K, DESCALE_V, DESCALE_S, SCALE_S,
                                                          SCALE_O))
            o, stats, amax_s, amax_o = g.sdpa_fp8(q=q, k=k, v=v, descale_q=dq_, descale_k=dk_, descale_v=dv_,
                                                  descale_s=ds, scale_s=ss, scale_o=so, generate_stats=True,
                                                  attn_scale=d ** -0.5, use_causal_mask=False)
            self._amax(amax_s, AMAX_S)
            self._amax(amax_o, AMAX_O)
        else:
            o, stats = g.sdpa(q=q, k=k, v=v, generate_stats=True, attn_scale=d ** -0.5)
        self._out(o, OUT, packed_strides(n, h, d, 1), self._io_type())
        stats.set_uid(STATS).set_output(True).set_dim((b, h, n, 1)).set_stride((h * n, n, 1, 1))
        stats.set_data_type(self.cudnn.data_type.FLOAT)
        return self._build(g)

    def _backward_graph(self):
        b, h, n, d = self.shape
        g = self._graph()
        q, k, v = self._qkv(g, (Q, K, V))
        o = g.tensor(uid=OUT, dim=self.shape, stride=packed_strides(n, h, d, 1), data_type=self._io_type())
        do = g.tensor(uid=DO, dim=self.shape, stride=packed_strides(n, h, d, 1), data_type=self._io_type())
        stats = g.tensor(uid=STATS, dim=(b, h, n, 1), stride=(h * n, n, 1, 1), data_type=self.cudnn.data_type.FLOAT)
        if self.fp8:
            scalars = self._scalars(g, (DESCALE_Q, DESCALE_K, DESCALE_V, DESCALE_O, DESCALE_DO, DESCALE_S,
                                        DESCALE_DP, SCALE_S, SCALE_DQ, SCALE_DK, SCALE_DV, SCALE_DP))
            names = ("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                     "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
            dq, dk, dv, *amaxes = g.sdpa_fp8_backward(q=q, k=k, v=v, o=o, dO=do, stats=stats, attn_scale=d ** -0.5,
                                                      **dict(zip(names, scalars, strict=True)))
            for t, uid in zip(amaxes, (AMAX_DQ, AMAX_DK, AMAX_DV, AMAX_DP), strict=True):
                self._amax(t, uid)
        else:
            dq, dk, dv = g.sdpa_backward(q=q, k=k, v=v, o=o, dO=do, stats=stats, attn_scale=d ** -0.5)
        for t, uid in zip((dq, dk, dv), (DQ, DK, DV), strict=True):
            self._out(t, uid, packed_strides(n, h, d, 3), self._io_type() if self.fp8_grads else None)
        return self._build(g)

    def _io_type(self):
        return self.cudnn.data_type.FP8_E4M3 if self.fp8 else self.cudnn.data_type.BFLOAT16

    def _build(self, g):
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([self.cudnn.heur_mode.A, self.cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        return g

    def run(self, pack: dict[int, torch.Tensor], graph) -> None:
        graph.execute(pack, self.workspace, handle=self.handle)


def scalar(x: float) -> torch.Tensor:
    return torch.full((1, 1, 1, 1), x, dtype=torch.float32, device="cuda")


@torch.compile
def to_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x in e4m3 with one scale (its amax to e4m3's largest), and the descale."""
    amax = x.abs().amax().float().clamp(min=1e-12)
    return (x.float() * (E4M3_MAX / amax)).to(E4M3), (amax / E4M3_MAX).reshape(1, 1, 1, 1)


def views(qkv: torch.Tensor) -> list[torch.Tensor]:
    """q, k, v as (B, H, N, d) strided views of the packed (B, N, 3, H, d) tensor."""
    return [qkv[:, :, i].transpose(1, 2) for i in range(3)]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).norm() / ref.norm()).item()


def measure(cudnn, name: str, b: int, n: int, h: int, d: int) -> None:
    """Print the table's rows of one shape."""
    torch.manual_seed(0)
    qkv = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)  # dO, (B, N, H, d) as proj's gradient
    do = grad.transpose(1, 2)

    # the reference: float32 attention on the same bf16 inputs
    ref_in = [t.float().requires_grad_() for t in views(qkv)]
    ref_o = F.scaled_dot_product_attention(*ref_in)
    ref_o.backward(do.float())
    ref_grads = [t.grad for t in ref_in]

    leaf = qkv.detach().requires_grad_()

    @torch.compile  # as in the step: Inductor stacks dq, dk and dv into the packed gradient
    def torch_fwd():
        return F.scaled_dot_product_attention(*views(leaf))

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o_t = torch_fwd()
        o_t.backward(do)
        torch_errs = [rel_err(o_t, ref_o)] + [rel_err(g, r) for g, r in zip(views(leaf.grad), ref_grads, strict=True)]
        t_fwd = time_ms(torch_fwd, warmup=5, repeats=20)[0]

        def torch_fwd_bwd():
            leaf.grad = None
            torch_fwd().backward(do)
        t_both = time_ms(torch_fwd_bwd, warmup=5, repeats=20)[0]
    print(f"{name} | torch sdpa bf16 | {t_fwd:.3f} | {t_both - t_fwd:.3f} | {t_both:.3f} | - | "
          + " ".join(f"{e:.2e}" for e in torch_errs), flush=True)
    for fp8 in (False, True):
        print(cudnn_row(cudnn, name, qkv, grad, ref_o, ref_grads, fp8), flush=True)


def cudnn_row(cudnn, name: str, qkv: torch.Tensor, grad: torch.Tensor, ref_o: torch.Tensor,
              ref_grads: list[torch.Tensor], fp8: bool) -> str:
    """One table row of cuDNN's attention through the frontend: bf16, or float8 with bf16 gradients where cuDNN
    builds that graph and e4m3 ones where not."""
    b, n, _, h, d = qkv.shape
    att = CudnnAttention(cudnn, b, n, h, d, fp8)
    if att.no_bwd:
        print(f"{name}: float8 attention with bf16 gradients: {att.no_bwd}", flush=True)
        att = CudnnAttention(cudnn, b, n, h, d, fp8, fp8_grads=True)
        if att.no_bwd:
            print(f"{name}: float8 attention with e4m3 gradients: {att.no_bwd}", flush=True)
    dtype, grad_dtype = (E4M3 if fp8 else torch.bfloat16), (E4M3 if att.fp8_grads else torch.bfloat16)
    o = torch.empty(b, n, h, d, device="cuda", dtype=dtype).transpose(1, 2)
    stats = torch.empty(b, h, n, 1, device="cuda", dtype=torch.float32)
    dqkv = torch.empty_like(qkv, dtype=grad_dtype)
    dq, dk, dv = views(dqkv)
    o_descale, grad_descales = scalar(1.0), [scalar(1.0) for _ in range(3)]
    if fp8:
        qkv8, descale = to_e4m3(qkv)
        do8, do_descale = to_e4m3(grad)
        q, k, v = views(qkv8)
        o_descale = descale  # o is a convex combination of v's rows: |o| <= max |v|
        amax = {u: scalar(float("nan")) for u in (AMAX_S, AMAX_O, AMAX_DQ, AMAX_DK, AMAX_DV, AMAX_DP)}
        s_scale, dp_scale = scalar(E4M3_MAX), scalar(1.0)
        grad_scales = [1 / x for x in grad_descales]
        common = {Q: q, K: k, V: v, DESCALE_Q: descale, DESCALE_K: descale, DESCALE_V: descale,
                  SCALE_S: s_scale, DESCALE_S: 1 / s_scale, STATS: stats, OUT: o}
        fwd = {**common, SCALE_O: 1 / o_descale, AMAX_S: amax[AMAX_S], AMAX_O: amax[AMAX_O]}
        bwd = {**common, DO: do8.transpose(1, 2), DESCALE_O: o_descale, DESCALE_DO: do_descale,
               SCALE_DP: dp_scale, DESCALE_DP: 1 / dp_scale, DQ: dq, DK: dk, DV: dv,
               **dict(zip((SCALE_DQ, SCALE_DK, SCALE_DV), grad_scales, strict=True)),
               **{u: amax[u] for u in (AMAX_DQ, AMAX_DK, AMAX_DV, AMAX_DP)}}
        att.run(fwd, att.fwd)
        if att.no_bwd:
            t_fwd = time_ms(lambda: att.run(fwd, att.fwd), warmup=5, repeats=20)[0]
            return (f"{name} | cudnn fp8, forward only | {t_fwd:.3f} | no backward | - | - | "
                    f"{rel_err(o.float() * o_descale, ref_o):.2e}")
        att.run(bwd, att.bwd)  # the amaxes of dP (and of the e4m3 gradients) for their scales, delayed as in training
        dp_scale.fill_(E4M3_MAX / amax[AMAX_DP].item())
        bwd[DESCALE_DP] = 1 / dp_scale
        if att.fp8_grads:
            for u, scale, descale_ in zip((AMAX_DQ, AMAX_DK, AMAX_DV), grad_scales, grad_descales, strict=True):
                scale.fill_(E4M3_MAX / amax[u].item())
                descale_.fill_(amax[u].item() / E4M3_MAX)
    else:
        q, k, v = views(qkv)
        fwd = {Q: q, K: k, V: v, OUT: o, STATS: stats}
        bwd = {**fwd, DO: grad.transpose(1, 2), DQ: dq, DK: dk, DV: dv}
    att.run(fwd, att.fwd)
    att.run(bwd, att.bwd)
    torch.cuda.synchronize()
    errs = [rel_err(o.float() * o_descale, ref_o)] + [
        rel_err(g.float() * s, r) for g, s, r in zip((dq, dk, dv), grad_descales, ref_grads, strict=True)]
    t_fwd = time_ms(lambda: att.run(fwd, att.fwd), warmup=5, repeats=20)[0]
    t_bwd = time_ms(lambda: att.run(bwd, att.bwd), warmup=5, repeats=20)[0]
    casts = f"{time_ms(lambda: (to_e4m3(qkv), to_e4m3(grad)), warmup=5, repeats=20)[0]:.3f}" if fp8 else "-"
    kind = "bf16" if not fp8 else "fp8, e4m3 gradients" if att.fp8_grads else "fp8"
    return (f"{name} | cudnn {kind} | {t_fwd:.3f} | {t_bwd:.3f} | {t_fwd + t_bwd:.3f} | {casts} | "
            + " ".join(f"{e:.2e}" for e in errs))

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="vit_b16,vit_l16", help=f"of {', '.join(SHAPES)}")
    args = parser.parse_args()
    import cudnn

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {cudnn.backend_version()}; GPU ms per "
          "call of one block's attention; errors of o, dq, dk, dv against float32")
    print("model | attention | forward | backward | both | fp8 casts | errors o dq dk dv")
    for m in args.models.split(","):
        measure(cudnn, m, *SHAPES[m])


if __name__ == "__main__":
    main()
