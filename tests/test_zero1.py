"""ZeRO-1 (`parallel.grad_reduce=zero1`) on CPU gloo ranks: the partition, the gradient exchange and the gathers; a
bf16-pure run trains bitwise as the fp32 all-reduce after the backward does at two ranks, and its checkpoints hold
every weight's optimizer state, resuming under another reduction and onto another number of ranks. On two GPUs
(`gpu`): the same under CUDA graphs over NCCL, and the exchange through the copy engines as through NCCL."""

import copy
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_parallel import GPU_RUN, run
from torch import nn

from conftest import TWO_GPUS, ok, spawn_ranks, vitctl
from vitctl.trainer import checkpoint as ckpt
from vitctl.trainer.config import ConfigError, ModelConfig, TrainConfig
from vitctl.trainer.models import build_model
from vitctl.trainer.ops import resolve
from vitctl.trainer.parallel import ParallelDims, build_mesh, parallelize
from vitctl.trainer.parallel.peer_copies import runs_of
from vitctl.trainer.parallel.strategy import BlockStrategy, Strategy
from vitctl.trainer.parallel.zero import ALIGN, Zero1, partition
from vitctl.trainer.precision import MasterWeights, Precision


def test_the_partition_balances_whole_tensors_and_aligns_them():
    width = 768  # ViT-B's weights: each rank's share within 1% of the others' at 2 and 3 ranks
    block = [width, width, 3 * width * width, 3 * width, width * width, width, width, width, 4 * width * width,
             4 * width, 4 * width * width, width]
    vit_b = [width, 197 * width, 3 * 16 * 16 * width, width] + 12 * block + [width, width, 1000 * width, 1000]
    for sizes, ranks in ((vit_b, 2), (vit_b, 3), ([3000, 10, 2000, 1000, 7, 2000, 5, 64], 3)):
        owners, offsets, length = partition(sizes, ranks)
        loads = [sum(-(-s // ALIGN) * ALIGN for s, o in zip(sizes, owners, strict=True) if o == r)
                 for r in range(ranks)]
        assert length == max(loads) and max(loads) - min(loads) <= max(sizes) + ALIGN
        if sizes is vit_b:
            assert max(loads) < 1.01 * min(loads)
        for rank in range(ranks):  # each rank's tensors lie one after another, aligned, in their own order
            mine = [(offsets[i], sizes[i]) for i in range(len(sizes)) if owners[i] == rank]
            assert mine and all(offset % ALIGN == 0 for offset, _ in mine)
            assert all(a + size <= b for (a, size), (b, _) in zip(mine, mine[1:], strict=False))
            assert mine[-1][0] + mine[-1][1] <= length


def test_a_share_is_cut_into_runs_of_whole_tensors_in_order():
    tensors = [(0, 96), (96, 32), (128, 4096), (4224, 64), (4288, 1024), (5312, 32)]
    for count in (1, 2, 3, 8):
        runs = runs_of(tensors, count)
        assert 1 <= len(runs) <= count and runs[0][0] == 0 and runs[-1][1] == 5344
        assert all(a < b == c for (a, b), (c, _) in zip(runs, runs[1:], strict=False))
        assert {a for a, _ in runs} <= {offset for offset, _ in tensors}  # a run starts where a tensor does
    assert runs_of(tensors, 3) == [(0, 4224), (4224, 5344)]  # no run of a third: the third tensor is half
    assert runs_of([], 3) == []


def test_fewer_weights_than_ranks_is_a_clear_error():
    with pytest.raises(ConfigError, match="the model's 2 weights cannot go round 3 ranks; use parallel.grad_reduce"):
        Zero1(MasterWeights(nn.Linear(4, 4)), None, 0, 3, torch.bfloat16)


RANKS = 3


def _exchange_rank(rank: int, init: str, results: dict, micro_batches: int) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=RANKS)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 6), nn.Linear(6, 6))  # the last one unused
    master = MasterWeights(model)  # the model is now bf16
    plain = copy.deepcopy(model)  # this rank's own bf16 gradients, summed in fp32 over its micro-batches
    zero = Zero1(master, None, rank, RANKS, torch.bfloat16 if micro_batches == 1 else torch.float32)
    torch.manual_seed(1 + rank)
    own = [torch.zeros_like(m) for _, m in master.pairs]
    for i in range(micro_batches):
        x = torch.randn(8, 24).bfloat16()
        model[:3](x).float().square().mean().backward()
        plain[:3](x).float().square().mean().backward()
        for total, p in zip(own, plain.parameters(), strict=True):
            total += p.grad.float() if p.grad is not None else 0
        plain.zero_grad()
        if i < micro_batches - 1:
            master.accumulate()
    zero.reduce()
    zero.average()
    for total in own:  # the fp32 mean over ranks
        dist.all_reduce(total)
        total /= RANKS
    grads = [None if m.grad is None else m.grad.clone() for _, m in master.pairs]
    buffer = zero.weights.untyped_storage().data_ptr()
    in_buffer = all(p.untyped_storage().data_ptr() == buffer for p in model.parameters())
    with torch.no_grad():  # a step of this rank's share: its masters and, through them, its bf16 weights
        for i in zero.owned:
            p, m = master.pairs[i]
            m.add_(rank + 1)
            p.copy_(m)
    zero.gather_weights()
    zero.gather([(m, m.detach()) for _, m in master.pairs])
    results[rank] = (zero.owned, grads, own, in_buffer, [p.detach().clone() for p in model.parameters()],
                     [m.detach().clone() for _, m in master.pairs], all(p.grad is None for p in model.parameters()))
    dist.destroy_process_group()


@pytest.mark.parametrize("micro_batches", [1, 3])
def test_each_rank_gets_the_fp32_mean_of_its_share_and_every_rank_the_stepped_weights(tmp_path, micro_batches):
    """One micro-batch (the gradients exchanged in bf16) or three (their fp32 sums exchanged): the weights each rank
    steps get the fp32 mean over ranks of every rank's sum, the others none, and a weight no rank used a zero one;
    after the step every rank holds each weight, bf16 and fp32 master, as its owner stepped it."""
    results = mp.Manager().dict()
    spawn_ranks(_exchange_rank, RANKS, tmp_path, results, micro_batches)
    owners = {}
    for rank in range(RANKS):
        owned, grads, own, in_buffer, _, _, freed = results[rank]
        assert in_buffer and freed and owned
        owners.update({i: rank for i in owned})
        for i, (got, want) in enumerate(zip(grads, own, strict=True)):
            if i in owned:
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
            else:
                assert got is None
    assert sorted(owners) == list(range(len(results[0][1])))
    assert not any(results[owners[i]][1][i].any() for i in (4, 5))  # the unused layer's weight and bias
    for rank in range(1, RANKS):
        for name in (4, 5):  # the bf16 weights and the masters
            assert all(torch.equal(a, b) for a, b in zip(results[0][name], results[rank][name], strict=True))
    first = results[0]
    torch.manual_seed(0)
    initial = [p.detach() for p in nn.Sequential(nn.Linear(24, 40), nn.GELU(), nn.Linear(40, 6),
                                                 nn.Linear(6, 6)).parameters()]
    for i, (master, start) in enumerate(zip(first[5], initial, strict=True)):
        assert torch.equal(master, start + (owners[i] + 1))


def _auto_rank(rank: int, init: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    cpu, chosen = torch.device("cpu"), {}
    for precision in ("bf16-pure", "bf16", "fp32"):
        with torch.device("meta"):
            model = build_model(ModelConfig(name="vit_micro", img_size=32, num_classes=10), resolve("none", cpu))
        par = parallelize(model, build_mesh(ParallelDims(1, 2, 1, 1), cpu),
                          Strategy(blocks=(BlockStrategy(),) * len(model.blocks)), Precision(precision, cpu),
                          TrainConfig(compile=False), "auto", 1, cpu, lambda part: part.init_weights(0))
        chosen[precision] = "zero1" if par.zero else "after_backward" if par.reducer else "ddp"
    results[rank] = chosen
    dist.destroy_process_group()


def test_auto_steps_shares_under_bf16_pure_on_one_node(tmp_path):
    """Within a node `auto` picks ZeRO-1 under bf16-pure (it beat the all-reduce on two H200s), and the all-reduce
    after the backward for the other precisions."""
    results = mp.Manager().dict()
    spawn_ranks(_auto_rank, 2, tmp_path, results)
    assert results[0] == results[1] == {"bf16-pure": "zero1", "bf16": "after_backward", "fp32": "after_backward"}


PURE = ["--set", "train.precision=bf16-pure", "--set", "train.ema_decay=0.9", "--set", "train.checkpoint_every=5",
        "--set", "train.eval_every_epochs=1"]


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def parts(path) -> dict[str, dict]:
    return {part: ckpt.consolidated(path, part) for part in ("model", "optimizer", "ema")}


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_zero1_trains_bitwise_as_the_all_reduce_at_two_ranks_and_its_checkpoints_resume_anywhere(prepared_shards,
                                                                                                 tmp_path):
    """bf16-pure with an EMA, without clipping (whose norm ZeRO-1 sums in another order): at two ranks each
    exchanged gradient's mean is the all-reduce's, so the losses, evaluations, weights, optimizer state and EMA are
    bitwise the same. A ZeRO-1 run stopped at step 5, resumed under the all-reduce to 7 and under ZeRO-1 again to 10,
    ends bitwise where the uninterrupted one does; resumed onto 3 ranks it goes on as the all-reduce does there."""
    no_clip = [*PURE, "--set", "optim.clip_grad=0"]
    run(prepared_shards, tmp_path / "all-reduce", 2, 10, *no_clip, *sets("parallel.grad_reduce=after_backward"))
    run(prepared_shards, tmp_path / "zero1", 2, 10, *no_clip, *sets("parallel.grad_reduce=zero1"))
    run(prepared_shards, tmp_path / "split", 2, 5, *no_clip, *sets("parallel.grad_reduce=zero1"))
    for name in ("three-zero1", "three-all-reduce"):  # the run stopped at step 5, to go on on 3 ranks
        shutil.copytree(tmp_path / "split", tmp_path / name)
    run(prepared_shards, tmp_path / "split", 2, 7, "--resume", *no_clip, *sets("parallel.grad_reduce=after_backward"))
    run(prepared_shards, tmp_path / "split", 2, 10, "--resume", *no_clip, *sets("parallel.grad_reduce=zero1"))
    reference = [_logged(r) for r in metrics(tmp_path / "zero1")]
    assert any("eval_ema_loss" in r for r in reference)
    assert [_logged(r) for r in metrics(tmp_path / "all-reduce")] == reference
    assert [_logged(r) for r in metrics(tmp_path / "split")][-2:] == reference[-2:]  # a stop logs where it stops
    want = parts(ckpt.list_checkpoints(tmp_path / "zero1")[-1])
    for name in ("all-reduce", "split"):
        got = parts(ckpt.list_checkpoints(tmp_path / name)[-1])
        for part in want:
            assert got[part].keys() == want[part].keys()
            assert all(torch.equal(torch.as_tensor(got[part][k]), torch.as_tensor(want[part][k]))
                       for k in want[part]), (name, part)
    for name, reduce in (("three-zero1", "zero1"), ("three-all-reduce", "after_backward")):
        run(prepared_shards, tmp_path / name, 3, 10, "--resume", *no_clip, *sets(f"parallel.grad_reduce={reduce}"))
    a, b = (parts(ckpt.list_checkpoints(tmp_path / name)[-1]) for name in ("three-zero1", "three-all-reduce"))
    for part in a:  # at 3 ranks the means round otherwise, and bf16 weights that round otherwise carry it on
        for key in a[part]:
            torch.testing.assert_close(torch.as_tensor(a[part][key]), torch.as_tensor(b[part][key]), rtol=0,
                                       atol=1e-4, msg=lambda m, key=key: f"{key}: {m}")


def _logged(record: dict) -> dict:
    return {k: v for k, v in record.items() if k.startswith(("loss", "eval_"))}


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.precision=bf16"], "it does not run with train.precision=bf16 (only bf16-pure and fp8 keep fp32 master "
                               "weights); use parallel.grad_reduce=auto"),
    (["train.precision=bf16-pure", "parallel.fsdp=true"], "it does not run with parallel.fsdp; use "
                                                          "parallel.grad_reduce=auto"),
])
def test_zero1_is_refused_where_there_are_no_replicated_masters(prepared_shards, tmp_path, overrides, message):
    refused = vitctl("train", "--config", "demo_vit", "--data", prepared_shards, "--out", tmp_path / "run",
                     "--executor", "local", "--gpus", 0, "--tasks-per-node", 2, "--dry-run",
                     *sets("parallel.grad_reduce=zero1", *overrides))
    assert refused.exit_code == 1 and message in refused.stderr, refused.stderr
    shown = vitctl("config", "show", "demo_vit", *sets("parallel.grad_reduce=zero1", *overrides))
    assert shown.exit_code == 1 and message in shown.output + shown.stderr  # `config show` says so too


def test_more_ranks_than_weights_is_refused_before_launch_and_the_fix_runs():
    """Before: refused inside the ranks (on Slurm after the queue wait), with a fix that was refused in turn."""
    from vitctl.trainer.config import load_config
    from vitctl.trainer.preflight import preflight

    base = ["data.source=synthetic", "data.batch_size=1", "data.train_samples=64", "train.precision=bf16-pure"]
    with pytest.raises(ConfigError, match=r"parallel.grad_reduce=zero1 gives each data-parallel rank whole weights to "
                       r"step: vit_micro's 56 weights cannot go round 64 ranks; use parallel.grad_reduce=auto \(and "
                       r"parallel.fsdp=true to shard them\)"):
        preflight(load_config("demo_vit", [*base, "parallel.grad_reduce=zero1"]), 64, None)
    preflight(load_config("demo_vit", [*base, "parallel.grad_reduce=auto", "parallel.fsdp=true"]), 64, None)


@pytest.mark.gpu
@TWO_GPUS
def test_zero1_on_two_gpus_under_cuda_graphs_follows_the_all_reduce(prepared_shards, tmp_path):
    """Over NCCL, compiled with CUDA graphs (whose captured weights are views of the all-gather's buffer), with an
    EMA and clipping: ZeRO-1 follows the all-reduce after the backward to bf16's precision (the attention backward
    sums with atomics, so not bitwise), and its checkpoint resumes under the all-reduce."""
    common = [*GPU_RUN, "--data", prepared_shards, "--set", "train.compile_mode=reduce-overhead",
              "--set", "train.ema_decay=0.9"]
    ok("train", "--out", tmp_path / "all-reduce", "--steps", 8, *common, *sets("parallel.grad_reduce=after_backward"))
    ok("train", "--out", tmp_path / "zero1", "--steps", 8, *common, *sets("parallel.grad_reduce=zero1"))
    losses = {name: [r["loss"] for r in metrics(tmp_path / name) if "loss" in r] for name in ("all-reduce", "zero1")}
    print(losses)
    torch.testing.assert_close(losses["zero1"], losses["all-reduce"], rtol=2e-2, atol=0)
    a, b = (parts(ckpt.list_checkpoints(tmp_path / name)[-1]) for name in ("all-reduce", "zero1"))
    assert a["optimizer"].keys() == b["optimizer"].keys()
    worst = max((a["model"][k].float() - b["model"][k].float()).abs().max().item() for k in a["model"])
    print(f"weights within {worst:.2e}")
    assert worst <= 4e-3
    ok("train", "--out", tmp_path / "zero1", "--steps", 12, "--resume", *common,
       *sets("parallel.grad_reduce=after_backward"))
    assert ckpt.read_meta(ckpt.list_checkpoints(tmp_path / "zero1")[-1])["step"] == 12


def _exchange_both_ways_rank(rank: int, init: str, results: dict, max_norm: float) -> None:
    from vitctl.trainer.optim import param_groups

    cuda = torch.device("cuda", rank)
    torch.cuda.set_device(cuda)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2, device_id=cuda)
    out = {}
    for exchange in ("copy_engines", "nccl"):
        os.environ["VITCTL_ZERO1_EXCHANGE"] = exchange
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64), *[nn.Linear(64, 64) for _ in range(6)]).to(cuda)
        master = MasterWeights(model)
        zero = Zero1(master, None, rank, 2, torch.bfloat16)
        optimizer = resolve("all", cuda).optimizer(param_groups(master.module, 0.05, None), 1e-3, (0.9, 0.999), 1e-8)
        torch.manual_seed(1 + rank)
        for _ in range(4):  # the first step is torch's (it makes the state), the others the kernel's, run by run
            model(torch.randn(32, 64, device=cuda).bfloat16()).float().square().mean().backward()
            zero.reduce()
            zero.step(master, optimizer, max_norm)
            zero.gather_weights()
        zero.gather([(m, m.detach()) for _, m in master.pairs])
        out[exchange] = (zero.copies is not None, len(zero.runs) if zero.copies else 0,
                         [p.detach().cpu() for p in model.parameters()], [m.detach().cpu() for _, m in master.pairs])
    results[rank] = out
    dist.destroy_process_group()


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("max_norm", [0.0, 1e-3])
def test_the_exchange_through_the_copy_engines_steps_bitwise_as_nccl_s(tmp_path, max_norm):
    """Two GPUs, the master AdamW kernel stepping each rank's share in runs as their gradients land, unclipped and
    clipped: every rank ends with the bf16 weights and fp32 masters that NCCL's all-to-all and all-gather give."""
    results = mp.Manager().dict()
    spawn_ranks(_exchange_both_ways_rank, 2, tmp_path, results, max_norm)
    for rank in range(2):
        copies, nccl = results[rank]["copy_engines"], results[rank]["nccl"]
        assert copies[0] and copies[1] >= 2 and not nccl[0]  # stepped in runs
        for a, b in zip(copies[2] + copies[3], nccl[2] + nccl[3], strict=True):
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(copies[2], results[0]["copy_engines"][2], strict=True))


def _train_one_rank(zero: bool, steps: int = 6) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A compiled bf16 MLP (CUDA graphs) with fp32 masters stepped by the fused master AdamW, on one NCCL rank,
    through ZeRO-1 or not; its masters and bf16 weights after `steps` steps."""
    from vitctl.trainer.ops import resolve
    from vitctl.trainer.optim import param_groups

    cuda = torch.device("cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)).to(cuda)
    master = MasterWeights(model)
    zero1 = Zero1(master, None, 0, 1, torch.bfloat16) if zero else None
    optimizer = resolve("all", cuda).optimizer(param_groups(master.module, 0.05, None), 1e-3, (0.9, 0.999), 1e-8)
    forward = torch.compile(model, mode="reduce-overhead")
    torch.manual_seed(1)
    for _ in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        forward(torch.randn(64, 256, device=cuda).bfloat16()).float().square().mean().backward()
        if zero1:
            zero1.reduce()
            zero1.step(master, optimizer, max_norm=1.0)
            zero1.gather_weights()
        else:
            master.step(optimizer, max_norm=1.0)
    return [m.detach().clone() for _, m in master.pairs], [p.detach().clone() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_weights_as_views_of_the_gather_buffer_train_under_cuda_graphs_as_the_model_s_own():
    """One NCCL rank: the compiled model's CUDA graphs capture weights that are views of ZeRO-1's buffer, and the
    fused master AdamW steps them from the exchanged fp32 gradients as it does from the bf16 ones."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plain, zero = _train_one_rank(False), _train_one_rank(True)
    finally:
        dist.destroy_process_group()
    for a, b in zip(plain[0], zero[0], strict=True):  # the masters (the norms sum bf16 or fp32 gradients)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for master, weight in zip(*zero, strict=True):  # the bf16 weights the graphs read are the masters rounded
        assert torch.equal(weight, master.bfloat16())
