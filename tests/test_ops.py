import dataclasses
import logging
import sys

import pytest
import torch

from vitctl.trainer.models.swin import relative_position_index, shift_mask
from vitctl.trainer.ops import REGISTRY, cuda, cudnn_attention, parse_fused, reference, resolve, sdpa


def test_partition_then_merge_is_the_identity_and_matches_a_loop():
    x = torch.randn(2, 12, 8, 5)  # H != W
    for shift in (0, 2):
        windows = reference.window_partition(x, 4, shift)
        assert windows.shape == (2 * 3 * 2, 16, 5)
        assert torch.equal(reference.window_merge(windows, 4, shift, 12, 8), x)
        rolled = torch.roll(x, (-shift, -shift), (1, 2))
        assert torch.equal(windows[1 * 6 + 2 * 2 + 1], rolled[1, 8:12, 4:8].reshape(16, 5))  # batch 1, window (2, 1)


@pytest.mark.parametrize("masked", [False, True])
def test_window_attention_reads_packed_qkv_per_head_and_matches_sdpa(masked):
    torch.manual_seed(0)
    heads, window, n_windows, d = 3, 4, 4, 8
    N, C = window**2, heads * d
    qkv = torch.randn(2 * n_windows, N, 3 * C)
    table = torch.randn((2 * window - 1) ** 2, heads)
    index = relative_position_index(window)
    mask = shift_mask(8, 8, window, 2) if masked else None
    expected = reference.window_attention(qkv, heads, d**-0.5, table, index, mask)
    assert expected.shape == (2 * n_windows, N, C)
    b, h = 5, 2  # one window and head by hand: q, k, v are (3, heads, d) blocks of each token's 3C features
    q, k, v = (qkv[b, :, part * C + h * d:part * C + (h + 1) * d] for part in range(3))
    logits = q @ k.T * d**-0.5 + table[index, h] + (mask[b % n_windows] if masked else 0)
    torch.testing.assert_close(expected[b, :, h * d:(h + 1) * d], logits.softmax(-1) @ v)
    torch.testing.assert_close(sdpa.window_attention(qkv, heads, d**-0.5, table, index, mask), expected)


def test_the_one_kernel_attention_takes_only_what_its_kernel_can():
    """Half/bfloat16, 1 to 64 tokens, head dim 32; anything else goes to the seed's design."""
    def fits(tokens: int, width: int = 3 * 3 * 32, dtype: torch.dtype = torch.bfloat16) -> bool:
        return cuda.fused_attention_fits(torch.empty(2, tokens, width, dtype=dtype), 3)

    assert fits(49) and fits(64) and fits(1) and fits(49, dtype=torch.float16)
    assert not fits(0)  # no tokens
    assert not fits(65) and not fits(144)  # windows past 8
    assert not fits(49, dtype=torch.float32)
    assert not fits(49, width=3 * 3 * 24)  # head dim 24


def test_the_fused_mlp_leaves_cpu_tensors_to_the_exact_gelu_reference():
    x, w1, b1, w2, b2 = (torch.randn(*s, dtype=torch.bfloat16) for s in ((2, 5, 16), (64, 16), (64,), (16, 64), (16,)))
    assert torch.equal(cuda.mlp(x, w1, b1, w2, b2), reference.mlp(x, w1, b1, w2, b2))


def test_cudnn_attention_leaves_to_sdpa_what_cudnn_takes_not():
    """Off a GPU the cuDNN attention is unavailable (resolve picks SDPA), and a CPU tensor reaching it goes to SDPA."""
    assert cudnn_attention.unavailable(torch.device("cpu")) == "needs CUDA"
    qkv = torch.randn(2, 17, 3 * 3 * 8, dtype=torch.bfloat16)
    assert not cudnn_attention.fits(qkv, 3)
    torch.testing.assert_close(cudnn_attention.attention(qkv, 3), sdpa.attention(qkv, 3))


def test_a_gpu_whose_cudnn_builds_no_attention_graph_runs_sdpa_and_says_why(monkeypatch):
    """A V100's cuDNN, say: found before training by building a small graph, not by the first step failing."""
    def declines(*shape):
        raise RuntimeError("no engine proposed a plan for this graph\nmore detail")

    monkeypatch.setattr(cudnn_attention, "_cudnn", lambda: None)
    monkeypatch.setattr(cudnn_attention, "_graphs", declines)
    cudnn_attention._declined.cache_clear()
    try:
        assert cudnn_attention.unavailable(torch.device("cuda", 3)) == (
            "cuDNN builds no attention graph on cuda:3 (no engine proposed a plan for this graph)")
    finally:
        cudnn_attention._declined.cache_clear()


def test_sdpa_attention_matches_reference():
    qkv = torch.randn(2, 17, 3 * 3 * 8)
    torch.testing.assert_close(sdpa.attention(qkv, 3), reference.attention(qkv, 3))


def test_fused_spec_parsing():
    assert parse_fused("none") == {}
    assert parse_fused("layer_norm, mlp") == {"layer_norm": None, "mlp": None}
    assert parse_fused("all,optimizer=apex")["optimizer"] == "apex"
    with pytest.raises(ValueError, match="unknown op 'flash'"):
        parse_fused("flash")
    with pytest.raises(ValueError, match="optimizer has no implementation 'lion'"):
        parse_fused("optimizer=lion")


def test_an_implementation_asked_for_is_used_or_its_absence_logged(caplog):
    with caplog.at_level(logging.INFO, logger="vitctl.ops"):
        ops = resolve("window_attention=reference,optimizer=apex", torch.device("cpu"))
    assert dict(ops.chosen)["window_attention"] == "reference"
    assert any("op optimizer: apex unavailable (needs CUDA" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("installed", [True, False])
def test_apex_on_a_cpu_says_also_whether_it_is_installed(monkeypatch, installed):
    """Before: 'needs CUDA' alone, also where apex was not installed, which a GPU node would still lack."""
    from vitctl.trainer.ops import apex_ops

    monkeypatch.setattr(apex_ops.importlib.util, "find_spec", lambda name: object() if installed else None)
    why = apex_ops._missing("apex.fused_dense", "FusedDenseGeluDenseFunc")(torch.device("cpu"))
    assert why == ("needs CUDA" if installed else "needs CUDA; apex is not installed either")


def test_unavailable_ops_fall_back_with_one_log_line_each(caplog):
    with caplog.at_level(logging.INFO, logger="vitctl.ops"):
        ops = resolve("all", torch.device("cpu"))
    chosen = dict(ops.chosen)
    assert chosen["layer_norm"] == "reference" and chosen["attention"] == "sdpa"
    fallbacks = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert any(m.startswith("op layer_norm: apex unavailable (needs CUDA") for m in fallbacks)
    assert len([m for m in fallbacks if m.startswith("op optimizer")]) == 1
    none = resolve("none", torch.device("cpu"))
    assert set(dict(none.chosen).values()) == {"reference"}


def test_an_implementation_that_pays_only_under_compile_is_left_out_of_eager_runs(monkeypatch):
    impl = REGISTRY["mlp"]["cuda"]
    monkeypatch.setitem(REGISTRY["mlp"], "cuda", dataclasses.replace(impl, unavailable=lambda device: None))
    cpu = torch.device("cpu")
    assert dict(resolve("all", cpu, compiling=True).chosen)["mlp"] == "cuda"
    assert dict(resolve("all", cpu).chosen)["mlp"] == "reference"
    assert dict(resolve("mlp=cuda", cpu).chosen)["mlp"] == "cuda"  # asked for: used


def test_an_apex_without_the_function_we_call_is_unavailable_not_a_crash(monkeypatch):
    """apex's snapshot of 2025 dropped fused_dense_gelu_dense_function; the seam checks for what it calls."""
    import types

    from vitctl.trainer.ops import apex_ops

    fused_dense = types.ModuleType("apex.fused_dense")
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    monkeypatch.setitem(sys.modules, "apex.fused_dense", fused_dense)
    check = apex_ops._missing("apex.fused_dense", "FusedDenseGeluDenseFunc")
    assert check(torch.device("cuda")) == "this apex's apex.fused_dense has no FusedDenseGeluDenseFunc"
    fused_dense.FusedDenseGeluDenseFunc = object
    assert check(torch.device("cuda")) is None
    assert check(torch.device("cpu")) == "needs CUDA"
