"""Tensor parallelism on 2 CPU gloo ranks: the split ViT and Swin give the single-process model's logits, loss,
gradients and optimizer steps, eager and traced by torch.compile; their DCP checkpoints load into an unsharded model
and back. PackedQKV loads timm's qkv shapes."""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.experimental import implicit_replication

from conftest import spawn_ranks
from vitctl.trainer.config import ModelConfig
from vitctl.trainer.models import blocks_of, build_model
from vitctl.trainer.models.layers import PackedQKV, timm_layout
from vitctl.trainer.ops import resolve
from vitctl.trainer.parallel.tensor_parallel import apply_tensor_parallel, tensor_parallel_error

WORLD, BATCH, TOLERANCE = 2, 4, 1e-5
MODELS = {"vit_mini": {"img_size": 32}, "swin_mini": {"img_size": 64, "window_size": 4}}  # stage 1 shifts windows
PLAN = {"attn.qkv.weight": Shard(1), "attn.qkv.bias": Shard(1), "attn.relative_position_bias_table": Shard(1),
        "attn.proj.weight": Shard(1), "mlp.fc1.weight": Shard(0), "mlp.fc1.bias": Shard(0), "mlp.fc2.weight": Shard(1)}
OPTIMIZERS = {"sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True),
              "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05, eps=1e-4, foreach=True)}


def build(name: str, seed: int = 0) -> nn.Module:
    return build_model(ModelConfig(name=name, num_classes=10, drop_path=0.0, **MODELS[name]),
                       resolve("none", torch.device("cpu"), compiling=False), seed)


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_near(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Relative to the tensor's norm: row-parallel sums round in another order than the whole matmul's."""
    error = ((whole(got) - want).norm() / want.norm()).item()
    assert error <= TOLERANCE, f"{what}: relative error {error:.2e}"


def batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)  # the same on every rank: tensor parallelism splits no batch
    size = MODELS[name]["img_size"]
    return torch.randn(BATCH, 3, size, size, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator)


def assert_sharded_as_planned(model: nn.Module) -> None:
    for key, param in model.named_parameters():
        placement = next((p for suffix, p in PLAN.items() if key.endswith(suffix)), None)
        assert (param.placements if isinstance(param, DTensor) else None) == (placement and (placement,)), key


def _train_alike(name: str, optimizer: str, mesh) -> nn.Module:
    """Three steps of the split model beside the whole one, compared at each: returns the split model."""
    reference = build(name)
    split = copy.deepcopy(reference)
    apply_tensor_parallel(split, mesh)
    assert_sharded_as_planned(split)
    with pytest.raises(TypeError, match="splits PackedQKV modules, not ColumnParallelQKV"):
        apply_tensor_parallel(split, mesh)  # twice
    optimizers = [OPTIMIZERS[optimizer](m.parameters()) for m in (reference, split)]
    for step in range(3):
        images, targets = batch(name, step)
        logits = [m(images) for m in (reference, split)]
        losses = [F.cross_entropy(out, targets) for out in logits]
        assert_near(logits[1], logits[0], f"{name} step {step} logits")
        assert_near(losses[1], losses[0], f"{name} step {step} loss")
        for loss in losses:
            loss.backward()
        for (key, want), got in zip(reference.named_parameters(), split.parameters(), strict=True):
            assert isinstance(got.grad, DTensor) == isinstance(got, DTensor), key
            assert_near(got.grad, want.grad, f"{name} step {step} gradient of {key}")
        with implicit_replication():  # one foreach step over DTensor and plain parameters
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
    for (key, want), got in zip(reference.named_parameters(), split.parameters(), strict=True):
        assert_near(got, want, f"{name} after 3 {optimizer} steps: {key}")
    return split


def _compiled_block_alike(name: str, mesh) -> None:
    """A split block traced by torch.compile (aot_eager: the graph the compiler gets) computes what it does eagerly.
    Swin's suffices: its blocks hold every split module that ViT's do, and the window attention besides."""
    model = build(name)
    block = blocks_of(model)[0]
    x = model.patch_embed(batch(name, 0)[0]).detach()  # tokens as the first block takes them
    apply_tensor_parallel(block, mesh)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=False)
    grads = []
    for forward in (block, compiled):
        x_ = x.clone().requires_grad_()
        forward(x_).square().sum().backward()
        grads.append([x_.grad] + [whole(p.grad) for p in block.parameters()])
        block.zero_grad()
    for got, want in zip(grads[1], grads[0], strict=True):
        assert_near(got, want, f"{name} compiled block")


def _checkpoints(name: str, split: nn.Module, folder: Path) -> None:
    """Save the split model; load the unsharded checkpoint of the seed-1 model into it."""
    dcp.save(get_model_state_dict(split), checkpoint_id=str(folder / "tp2"))
    state = get_model_state_dict(split)
    dcp.load(state, checkpoint_id=str(folder / "whole"))
    set_model_state_dict(split, state)
    for (key, want), got in zip(build(name, seed=1).state_dict().items(), split.state_dict().values(), strict=True):
        assert torch.equal(whole(got), want), key


def _rank(rank: int, init: str, folder: Path, results: dict) -> None:
    torch.set_num_threads(1)  # two ranks on a small CPU: more threads spin against each other
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    for name, optimizer in zip(MODELS, OPTIMIZERS, strict=True):
        split = _train_alike(name, optimizer, mesh)
        # Cloned: the manager would share the plain tensors' memory, which the load below overwrites.
        results[name] = {k: whole(v).clone() for k, v in split.state_dict().items()}
        _checkpoints(name, split, folder / name)
    _compiled_block_alike("swin_mini", mesh)
    dist.destroy_process_group()


def test_split_models_compute_and_checkpoint_what_whole_ones_do(tmp_path):
    for name in MODELS:  # an unsharded checkpoint for the ranks to load
        dcp.save(build(name, seed=1).state_dict(), checkpoint_id=str(tmp_path / name / "whole"), no_dist=True)
    results = mp.Manager().dict()
    spawn_ranks(_rank, WORLD, tmp_path, tmp_path, results)
    for name in MODELS:
        model = build(name, seed=2)
        state = model.state_dict()
        dcp.load(state, checkpoint_id=str(tmp_path / name / "tp2"), no_dist=True)
        model.load_state_dict(state)
        trained = results[name]
        assert all(torch.equal(model.state_dict()[k], trained[k]) for k in trained), name


def test_heads_that_do_not_divide_are_refused():
    swin = build_model(ModelConfig(name="swin_micro", img_size=64, window_size=4), resolve("none", torch.device("cpu")))
    assert "block 0 has 1 heads" in tensor_parallel_error(swin, 2)
    assert tensor_parallel_error(swin, 1) is None


def test_packed_qkv_loads_timm_shapes():
    torch.manual_seed(0)
    linear, packed = nn.Linear(16, 48), PackedQKV(16)
    packed.load_state_dict(linear.state_dict())
    assert packed.weight.shape == (3, 16, 16) and packed.bias.shape == (3, 16)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(packed(x), linear(x), rtol=0, atol=0)
    assert {k: v.shape for k, v in timm_layout({"attn.qkv.weight": packed.weight}).items()} == {
        "attn.qkv.weight": (48, 16)}
