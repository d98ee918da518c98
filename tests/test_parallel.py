"""Data parallelism on CPU gloo ranks: the fp32 gradient path of bf16-pure replication (DDP's hook and the reduction
after the backward), the mesh shape, and checkpoints that
reshard onto another number of ranks and another layout (DDP, FSDP, HSDP)."""

import contextlib
import copy
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from conftest import CLASSES, TWO_GPUS, ok, spawn_ranks
from vitctl.trainer import checkpoint as ckpt
from vitctl.trainer.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from vitctl.trainer.models import build_model
from vitctl.trainer.ops import resolve
from vitctl.trainer.parallel import ParallelDims, build_mesh, parallel_dims, parallelize
from vitctl.trainer.parallel.data_parallel import ReduceAfterBackward, apply_ddp
from vitctl.trainer.parallel.strategy import BlockStrategy, Strategy, strategy_from_config
from vitctl.trainer.precision import MasterWeights, Precision

WORLD = 2


def _bf16_replicated_rank(rank: int, init: str, results: dict, backend: str, reduce: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 8)).to(device)
    master = MasterWeights(model)  # the model is now bf16
    plain = copy.deepcopy(model)  # the same bf16 weights, outside DDP: this rank's own gradients
    mesh = build_mesh(ParallelDims(1, WORLD, 1, 1), device)
    if reduce == "overlap":
        ddp, sync = apply_ddp(model, mesh, master), lambda: None
    else:
        ddp, sync = model, ReduceAfterBackward(master.pairs, mesh.dp_group, WORLD).reduce
    torch.manual_seed(1 + rank)
    micro = [torch.randn(16, 64).bfloat16().to(device) for _ in range(3)]
    own = [torch.zeros_like(m) for _, m in master.pairs]
    for i, x in enumerate(micro):
        plain(x).float().square().mean().backward()
        for total, p in zip(own, plain.parameters(), strict=True):
            total += p.grad.float()
        plain.zero_grad()
        if i < len(micro) - 1:
            with ddp.no_sync() if reduce == "overlap" else contextlib.nullcontext():
                ddp(x).float().square().mean().backward()
            master.accumulate()
        else:
            ddp(x).float().square().mean().backward()
            sync()
    for total in own:  # the fp32 mean over ranks of each rank's fp32 sum over micro-batches
        dist.all_reduce(total)
        total /= WORLD
    results[rank] = ([m.grad.cpu() for _, m in master.pairs], [t.cpu() for t in own])
    dist.destroy_process_group()


@pytest.mark.parametrize("reduce", ["overlap", "after_backward"])
@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=[pytest.mark.gpu, TWO_GPUS])])
def test_bf16_gradients_are_accumulated_and_reduced_in_fp32(tmp_path, backend, reduce):
    results = mp.Manager().dict()
    spawn_ranks(_bf16_replicated_rank, WORLD, tmp_path, results, backend, reduce)
    for rank in range(WORLD):
        got, want = results[rank]
        for g, w in zip(got, want, strict=True):
            assert g.dtype == torch.float32
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
    for a, b in zip(results[0][0], results[1][0], strict=True):
        assert torch.equal(a, b)


def _fp32_replicated_rank(rank: int, init: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 8), nn.Linear(8, 8))  # the last one unused
    plain = copy.deepcopy(model)
    reducer = ReduceAfterBackward([(p, p) for p in model.parameters()], None, WORLD)
    storage = reducer.flat.untyped_storage().data_ptr()
    torch.manual_seed(1 + rank)
    for step in range(3):
        micro = [torch.randn(16, 32) for _ in range(3)]
        if step == 2:  # as torch's pipeline runs a step's micro-batches: one call, which on its first step infers
            reducer.accumulate_in_place()  # shapes with a real backward, then sets the gradients to None
            model[:3](torch.randn(16, 32)).sum().backward()
            model.zero_grad()
        for x in micro:
            if step < 2:
                reducer.accumulate_in_place()
            model[:3](x).square().mean().backward()
            plain[:3](x).square().mean().backward()
        reducer.reduce()
        in_buffer = [p.grad.untyped_storage().data_ptr() == storage for p in model.parameters()]
        own = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in plain.parameters()]
        for total in own:  # the mean over ranks of each rank's sum over micro-batches
            dist.all_reduce(total)
            total /= WORLD
        results[(rank, step)] = (in_buffer, [p.grad.clone() for p in model.parameters()], own)
        model.zero_grad()
        plain.zero_grad()
    dist.destroy_process_group()


def test_fp32_gradients_accumulate_in_the_reduction_buffer_itself(tmp_path):
    """No second fp32 copy of the gradients: from a step's first micro-batch they are views of the all-reduce's
    buffer, which the backward adds to; reduced, they are the mean over ranks of the sums over micro-batches, and a
    weight the step did not use has a zero gradient, every step, also where something set the gradients to None after
    the step's first micro-batch began (they are copied in, as they were before they accumulated in place)."""
    results = mp.Manager().dict()
    spawn_ranks(_fp32_replicated_rank, WORLD, tmp_path, results)
    for (rank, step), (in_buffer, got, want) in results.items():
        assert all(in_buffer), (rank, step)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        assert not got[-1].any() and not got[-2].any()


@pytest.mark.parametrize(("parallel", "world", "dims"), [
    (dict(fsdp=False), 4, (1, 4, 1, 1)), (dict(fsdp=True), 4, (1, 1, 4, 1)),
    (dict(fsdp=True, dp_shard=2), 4, (1, 2, 2, 1)), (dict(fsdp=True, dp_shard=3), 6, (1, 2, 3, 1)),
    (dict(tp=2, pp=2), 8, (2, 2, 1, 2)), (dict(tp=2, pp=2, fsdp=True, dp_shard=2), 16, (2, 2, 2, 2))])
def test_mesh_shape(parallel, world, dims):
    shape = parallel_dims(strategy_from_config(ParallelConfig(**parallel), 4), world)
    assert (shape.pp, shape.dp_replicate, shape.dp_shard, shape.tp) == dims and shape.world_size == world


def test_a_shard_degree_that_does_not_divide_the_ranks_is_refused():
    with pytest.raises(ConfigError, match="parallel.dp_shard=3 does not divide the 4 data-parallel ranks"):
        parallel_dims(strategy_from_config(ParallelConfig(fsdp=True, dp_shard=3), 4), 4)


@pytest.mark.parametrize(("mode", "gathered", "block_input"), [
    ("bf16", torch.bfloat16, torch.float32), ("bf16-pure", torch.bfloat16, torch.bfloat16),
    ("fp32", torch.float32, torch.float32)])
def test_fsdp_gathers_what_the_matmuls_run_in_and_reduces_in_fp32(mode, gathered, block_input):
    """Under bf16 autocast FSDP2 gathers bf16 weights (half an fp32 gather) but leaves the residual stream in fp32
    as without FSDP; bf16-pure casts the inputs too; the sharded weights and their gradients stay fp32."""
    from torch.distributed.fsdp import fully_shard

    precision = Precision(mode, torch.device("cpu"))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        layer = fully_shard(nn.Linear(8, 8), mesh=init_device_mesh("cpu", (1,)), mp_policy=precision.fsdp_policy())
        seen = {}
        layer.register_forward_pre_hook(lambda module, args: seen.update(input=args[0].dtype,
                                                                          weight=module.weight.dtype))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
            layer(torch.randn(4, 8)).float().sum().backward()
    finally:
        dist.destroy_process_group()
    assert (seen["weight"], seen["input"]) == (gathered, block_input)
    assert layer.weight.dtype == layer.weight.grad.dtype == torch.float32


def _stream_rank(rank: int, init: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    cpu = torch.device("cpu")
    found = {}
    for fsdp in (False, True):
        with torch.device("meta"):
            model = build_model(ModelConfig(name="vit_mini", img_size=32, num_classes=10), resolve("none", cpu))
        n = len(model.blocks)
        strategy = Strategy(blocks=(BlockStrategy(fsdp=fsdp),) * n, fsdp_rest=fsdp)
        dims = ParallelDims(1, 1, WORLD, 1) if fsdp else ParallelDims(1, WORLD, 1, 1)
        par = parallelize(model, build_mesh(dims, cpu), strategy, Precision("bf16", cpu),
                          TrainConfig(compile=False), "after_backward", 1, cpu, lambda part: part.init_weights(0))
        seen = []
        for block in par.weights.blocks:
            block.register_forward_pre_hook(lambda module, args, seen=seen: seen.append(args[0].dtype))
        torch.manual_seed(rank)
        par.forward_backward(torch.randn(2, 3, 32, 32), torch.tensor([rank, 3]), F.cross_entropy,
                             lambda loss: loss.backward(), sync=True)
        pos = par.weights.pos_embed
        found[fsdp] = (set(seen), isinstance(pos, DTensor), pos.dtype, pos.grad.clone(),
                       isinstance(par.weights.blocks[0].mlp.fc1.weight, DTensor))
    results[rank] = found
    dist.destroy_process_group()


def test_fsdp_under_bf16_autocast_keeps_vit_s_residual_stream_in_fp32_as_replicated(tmp_path):
    """FSDP2 gathers bf16 weights; ViT's position embedding and class token, added to the stream outside the blocks,
    stay whole and fp32 (reduced after the backward), so every block takes an fp32 stream as without FSDP."""
    results = mp.Manager().dict()
    spawn_ranks(_stream_rank, WORLD, tmp_path, results)
    for rank in range(WORLD):
        for fsdp, (dtypes, sharded, dtype, _, blocks_sharded) in results[rank].items():
            assert dtypes == {torch.float32}, (fsdp, dtypes)
            assert (sharded, dtype, blocks_sharded) == (False, torch.float32, fsdp)
    for fsdp in (False, True):  # the embedding's gradient is the same on every rank: reduced
        assert torch.equal(results[0][fsdp][3], results[1][fsdp][3])


def _local_shards_rank(rank: int, init: str, results: dict) -> None:
    """Two copies of a model, FSDP2 over the ranks (an uneven shard, and a weight left whole), stepped by torch's
    AdamW and by `step_on_local_shards`; whether each step took the local path, and whether they stayed bitwise
    equal."""
    from torch.distributed.fsdp import fully_shard

    from vitctl.trainer.optim import param_groups, step_on_local_shards

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    mesh, copies = init_device_mesh("cpu", (WORLD,)), []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 5))
        model.register_parameter("whole", nn.Parameter(torch.randn(5)))
        fully_shard(model, mesh=mesh, ignored_params={model.whole})
        copies.append((model, torch.optim.AdamW(param_groups(model, 0.05, None), lr=1e-2, foreach=True)))
    local_steps = []
    for step in range(4):
        torch.manual_seed(100 * step + rank)
        x = torch.randn(6, 8)
        for model, _ in copies:
            (model(x) + model.whole).square().mean().backward()
            dist.all_reduce(model.whole.grad)
        (_, by_torch), (_, by_shards) = copies
        by_torch.step()
        local_steps.append(step_on_local_shards(by_shards))
        if not local_steps[-1]:
            by_shards.step()
        for _, optimizer in copies:
            optimizer.zero_grad()
    (a, optimizer_a), (b, optimizer_b) = copies
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    same = [torch.equal(local(p), local(q)) for p, q in zip(a.parameters(), b.parameters(), strict=True)]
    same += [torch.equal(local(optimizer_a.state[p][k]), local(optimizer_b.state[q][k]))
             for p, q in zip(a.parameters(), b.parameters(), strict=True) for k in ("exp_avg", "exp_avg_sq", "step")]
    results[rank] = (local_steps, same, [isinstance(p, DTensor) for p in a.parameters()])
    dist.destroy_process_group()


def test_adamw_on_the_local_shards_steps_as_torch_does_on_dtensors(tmp_path):
    """The first step makes AdamW's state through torch; every later one runs on the shards and gives bitwise what
    torch's step over the DTensors gives, the weights and their state, an uneven shard and a whole weight included."""
    results = mp.Manager().dict()
    spawn_ranks(_local_shards_rank, WORLD, tmp_path, results)
    for rank in range(WORLD):
        local_steps, same, sharded = results[rank]
        assert local_steps == [False, True, True, True]
        assert all(same) and len(same) == 4 * len(sharded)
        assert sharded.count(False) == 1 and sharded.count(True) == 6


def test_adamw_on_local_shards_leaves_weights_without_dtensors_and_other_optimizers_to_torch():
    from vitctl.trainer.optim import step_on_local_shards

    weight = nn.Parameter(torch.ones(3))
    for optimizer in (torch.optim.AdamW([weight], foreach=True), torch.optim.SGD([weight], lr=0.1)):
        weight.grad = torch.ones(3)
        optimizer.step()
        before = weight.detach().clone()
        assert not step_on_local_shards(optimizer) and torch.equal(weight, before)


RESHARD = ["--set", f"model.num_classes={CLASSES}", "--set", "model.drop_path=0", "--set", "augment.mixup=0",
           "--set", "augment.cutmix=0", "--set", "data.workers=0", "--set", "train.log_every=2",
           "--set", "train.checkpoint_every=100", "--set", "train.epochs=6", "--executor", "local", "--gpus", 0]


def run(shards, out, ranks: int, steps: int, *extra: object) -> None:
    """The same global batch of 24 on any number of ranks, so that runs can be compared step for step."""
    ok("train", "--config", "demo_vit", "--data", shards, "--out", out, "--tasks-per-node", ranks,
       "--batch", 24 // ranks, "--steps", steps, *RESHARD, *extra)


@pytest.mark.slow
def test_resume_onto_other_rank_counts_and_layouts_reshards(prepared_shards, tmp_path):
    """4 FSDP ranks -> 2 DDP ranks -> 3 FSDP ranks ends where 4 replicated ranks (one reduction after the backward)
    end in one go: the weights, optimizer state and data position reshard (the gradient sums differ only in their
    order, so not bitwise)."""
    run(prepared_shards, tmp_path / "whole", 4, 10, "--set", "parallel.grad_reduce=after_backward")
    run(prepared_shards, tmp_path / "split", 4, 4, "--set", "parallel.fsdp=true")
    run(prepared_shards, tmp_path / "split", 2, 7, "--resume", "--set", "parallel.grad_reduce=overlap")
    run(prepared_shards, tmp_path / "split", 3, 10, "--resume", "--set", "parallel.fsdp=true")
    whole, split = (ckpt.list_checkpoints(tmp_path / name)[-1] for name in ("whole", "split"))
    assert whole.name == split.name == "step-00000010"
    assert ckpt.read_meta(whole)["position"] == ckpt.read_meta(split)["position"]
    assert len(list(split.glob("*.distcp"))) == 3
    for part in ("model", "optimizer"):
        a, b = ckpt.consolidated(whole, part), ckpt.consolidated(split, part)
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-5)


GPU_RUN = ["--config", "demo_swin", "--set", f"model.num_classes={CLASSES}", "--set", "data.source=webdataset",
           "--set", "data.workers=2", "--set", "train.precision=bf16-pure", "--set", "train.compile=true",
           "--set", "train.log_every=2", "--set", "train.checkpoint_every=100", "--set", "train.epochs=20",
           "--executor", "local", "--gpus", 2, "--batch", 8]


@pytest.mark.gpu
@TWO_GPUS
def test_two_gpus_resume_under_cuda_graphs_and_reshard_into_fsdp(prepared_shards, tmp_path):
    """bf16-pure replicated over NCCL (auto: ZeRO-1 on one node), compiled with CUDA graphs, stopped and resumed,
    follows the uninterrupted run (not bitwise on the GPU: the attention backward sums its bias gradient with
    atomics); FSDP2 (bf16 gathers, fp32 reduction) then continues from the replicated run's checkpoint."""
    ddp = [*GPU_RUN, "--data", prepared_shards, "--set", "train.compile_mode=reduce-overhead"]
    ok("train", "--out", tmp_path / "whole", "--steps", 8, *ddp)
    ok("train", "--out", tmp_path / "split", "--steps", 4, *ddp)
    ok("train", "--out", tmp_path / "split", "--steps", 8, "--resume", *ddp)
    whole, split = (ckpt.list_checkpoints(tmp_path / name)[-1] for name in ("whole", "split"))
    assert ckpt.read_meta(whole)["position"] == ckpt.read_meta(split)["position"]
    losses = {name: [json.loads(line).get("loss") for line in (tmp_path / name / "metrics.jsonl").read_text()
                     .splitlines()] for name in ("whole", "split")}
    last_whole, last_split = ([v for v in losses[name] if v is not None][-1] for name in ("whole", "split"))
    assert abs(last_split - last_whole) < 0.02 * last_whole
    ok("train", "--out", tmp_path / "split", "--steps", 12, "--resume", *GPU_RUN, "--data", prepared_shards,
       "--set", "parallel.fsdp=true")
    final = ckpt.list_checkpoints(tmp_path / "split")[-1]
    assert ckpt.read_meta(final)["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 1}
    assert len(list(final.glob("*.distcp"))) == 2
    records = [json.loads(line) for line in (tmp_path / "split/metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)


def test_widened_cuda_queues_leave_a_user_s_setting_alone(monkeypatch):
    from vitctl.trainer.parallel import widen_cuda_queues

    _without_cuda_settings(monkeypatch)
    widen_cuda_queues()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # e.g. Megatron-style ordering of communication
    widen_cuda_queues()
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"


@pytest.mark.parametrize(("env", "machine", "allowed", "threads"), [
    ({}, 8, 8, 8),  # one rank: all of them
    ({"LOCAL_WORLD_SIZE": "2"}, 8, 8, 4),
    ({"LOCAL_WORLD_SIZE": "16"}, 8, 8, 1),
    ({"LOCAL_WORLD_SIZE": "4"}, 64, 3, 3),  # bound by Slurm to 3 CPUs of its own: all 3
    ({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "3"}, 8, 8, 3),  # the user's setting, as torch read it
], ids=["one-rank", "two-ranks", "more-ranks-than-cpus", "bound-rank", "omp-num-threads"])
def test_cpu_ranks_of_one_machine_share_its_cpus_unless_omp_num_threads_says(monkeypatch, env, machine, allowed,
                                                                            threads):
    from vitctl.trainer.parallel import init_distributed

    before = torch.get_num_threads()
    for name in ("LOCAL_WORLD_SIZE", "OMP_NUM_THREADS", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(os, "cpu_count", lambda: machine)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(allowed)))
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", allowed)))  # as a fresh process starts
    try:
        init_distributed(use_cuda=False)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


ALLOCATOR_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def test_expandable_cuda_memory_leaves_a_user_s_allocator_setting_alone(monkeypatch):
    from vitctl.trainer.parallel import expandable_cuda_memory

    _without_cuda_settings(monkeypatch)
    expandable_cuda_memory()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for name in ALLOCATOR_SETTINGS:
        _without_cuda_settings(monkeypatch)
        monkeypatch.setenv(name, "max_split_size_mb:512")
        expandable_cuda_memory()
        assert {k: os.environ.get(k) for k in ALLOCATOR_SETTINGS} == \
            {k: "max_split_size_mb:512" if k == name else None for k in ALLOCATOR_SETTINGS}


def test_a_rank_sets_cuda_s_queues_and_allocator_before_it_first_asks_cuda(monkeypatch):
    """CUDA reads these settings when it starts: train() must set them before its first CUDA call."""
    from vitctl.trainer import loop
    from vitctl.trainer.config import load_config

    seen = []

    def first_cuda_call() -> bool:
        seen.append((os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))
        raise RuntimeError("stop here")

    _without_cuda_settings(monkeypatch)
    monkeypatch.setattr(loop.torch.cuda, "is_available", first_cuda_call)
    with pytest.raises(RuntimeError, match="stop here"):
        loop.train(load_config("demo_vit", []))
    assert seen == [("32", "expandable_segments:True")]


def _without_cuda_settings(monkeypatch) -> None:
    """The CUDA queue and allocator variables unset for this test, and unset again after it whatever the test set
    (delenv of an unset variable would restore nothing, leaving the test's value to the tests after it)."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("CUDA_DEVICE_MAX_CONNECTIONS", *ALLOCATOR_SETTINGS)})
