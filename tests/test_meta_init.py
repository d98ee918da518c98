"""Meta-device initialisation: a model built on the meta device, divided (pipeline stage, tensor parallel, FSDP2),
then allocated and initialised rank by rank holds exactly the weights `build_model` gives one process, because each
tensor is drawn from a stream seeded by its name; the draws follow timm's initialisation."""

import math
from itertools import chain
from pathlib import Path

import pytest
import timm
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor

from conftest import spawn_ranks
from vitctl.trainer.config import ModelConfig, TrainConfig
from vitctl.trainer.fp8 import convert_to_float8
from vitctl.trainer.models import blocks_of, build_model
from vitctl.trainer.models.layers import timm_layout
from vitctl.trainer.ops import resolve
from vitctl.trainer.parallel import ParallelDims, build_mesh, parallelize
from vitctl.trainer.parallel.pipeline_parallel import keep_stage, stage_range
from vitctl.trainer.parallel.strategy import BlockStrategy, Strategy
from vitctl.trainer.precision import Precision
from vitctl.trainer.pretrained import HEAD_PREFIXES, Pretrained

CPU = torch.device("cpu")
OPS = resolve("none", CPU, compiling=False)
# ViT with the pre-logits head; Swin whose second stage shifts its windows, so that it holds attention masks too.
MODELS = {"vit_mini": {"img_size": 32, "pre_logits": True}, "swin_mini": {"img_size": 64, "window_size": 4}}


def config(name: str) -> ModelConfig:
    return ModelConfig(name=name, num_classes=10, drop_path=0.0, **MODELS[name])


def meta_model(name: str, seed: int) -> nn.Module:
    with torch.device("meta"):
        return build_model(config(name), OPS, seed)


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers (the attention tables and masks are not in the state dict), DTensors whole."""
    held = chain(model.named_parameters(), model.named_buffers())
    return {k: (t.full_tensor() if isinstance(t, DTensor) else t).detach() for k, t in held}


def mismatches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, t in got.items() if not torch.equal(t, want[k])]


@pytest.mark.parametrize("name", MODELS)
def test_meta_build_materialised_and_initialised_is_the_cpu_build(name):
    whole = build_model(config(name), OPS, seed=5)
    model = meta_model(name, seed=5)
    assert all(t.is_meta for t in tensors(model).values())
    model.to_empty(device=CPU)
    for t in tensors(model).values():
        t.fill_(-7)  # whatever the allocation held: every parameter and buffer must be written
    model.init_weights(5)
    assert tensors(model).keys() == tensors(whole).keys()
    assert mismatches(tensors(model), tensors(whole)) == []
    other = tensors(build_model(config(name), OPS, seed=6))
    drawn = [k for k, t in tensors(whole).items() if t.is_floating_point() and t.std() > 0]
    assert drawn and not any(torch.equal(tensors(whole)[k], other[k]) for k in drawn)  # another seed, other draws


@pytest.mark.parametrize(("name", "timm_name"), [("vit_s16", "vit_small_patch16_224"),
                                                 ("swin_t", "swin_tiny_patch4_window7_224")])
def test_the_draws_follow_timm_initialisation(name, timm_name):
    """Tensor by tensor against timm's own initialisation of the architecture: the same constants (zero biases,
    LayerNorm's ones) exactly; for drawn tensors the same mean and standard deviation, within 6 sigma of samples of
    their size (truncated normal std 0.02, the patch convolution's uniform, the class token's std 1e-6)."""
    ours = timm_layout(build_model(ModelConfig(name=name), OPS).state_dict())
    torch.manual_seed(0)
    theirs = timm.create_model(timm_name, pretrained=False).state_dict()
    for key, got in ours.items():
        want, n = theirs[key], got.numel()
        if want.unique().numel() == 1:
            assert torch.equal(got, want), key
            continue
        assert abs(got.std() / want.std() - 1) < 6 / math.sqrt(n), key
        assert abs(got.mean() - want.mean()) < 6 * want.std() / math.sqrt(n), key
    fc1 = ours["layers.2.blocks.0.mlp.fc1.weight" if name.startswith("swin") else "blocks.0.mlp.fc1.weight"]
    assert fc1.std().item() == pytest.approx(0.02, rel=0.01) and fc1.abs().max() < 2


@pytest.mark.parametrize("name", MODELS)
def test_a_pipeline_stage_allocates_only_its_own_parts(name):
    """Each stage of two, divided on the meta device, allocates its blocks and ends alone: the two stages' tensors
    split the whole model's between them, with the whole model's values."""
    whole = tensors(build_model(config(name), OPS, seed=3))
    n_blocks = len(blocks_of(meta_model(name, seed=3)))
    strategy = Strategy(pp=2, microbatches=2, blocks=(BlockStrategy(),) * n_blocks)
    stages = []
    for stage in range(2):
        model = meta_model(name, seed=3)
        keep_stage(model, stage_range(strategy, n_blocks, stage), stage == 0, stage == 1)
        model.to_empty(device=CPU)
        model.init_weights(3)
        held = tensors(model)
        assert mismatches(held, whole) == []
        assert len(blocks_of(model)) == len(stage_range(strategy, n_blocks, stage))
        stages.append(held)
    assert not stages[0].keys() & stages[1].keys() and stages[0].keys() | stages[1].keys() == whole.keys()
    stage_bytes = [sum(t.nbytes for t in held.values()) for held in stages]
    print(f"{name}: bytes allocated per stage {stage_bytes}, whole model {sum(t.nbytes for t in whole.values())}")
    assert all(0 < b < sum(t.nbytes for t in whole.values()) for b in stage_bytes)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("fsdp", [False, True])  # fsdp: the tensorwise weights are wrapped for float8 gathers
def test_float8_swaps_on_the_meta_device_initialise_as_on_the_cpu(name, fsdp):
    pytest.importorskip("torchao.float8", reason="torchao is optional (pip install 'vitctl[fp8]')")
    whole = build_model(config(name), OPS, seed=2)
    convert_to_float8(whole, "tensorwise", fsdp=fsdp)
    model = meta_model(name, seed=2)
    convert_to_float8(model, "tensorwise", fsdp=fsdp)
    model.to_empty(device=CPU)
    model.init_weights(2)
    assert mismatches(tensors(model), tensors(whole)) == []


# ---------------------------------------------------------------- on 4 gloo ranks, through parallelize()

WORLD = 4
LAYOUTS = {  # name: (mesh dims, strategy without its blocks, whether the blocks are FSDP)
    "tp2·fsdp2": (ParallelDims(1, 1, 2, 2), Strategy(tp=2, fsdp_rest=True), True),
    "pp2·fsdp2": (ParallelDims(2, 1, 2, 1), Strategy(pp=2, microbatches=2, fsdp_rest=True), True),
    "hsdp2x2": (ParallelDims(1, 2, 2, 1), Strategy(dp_shard=2, fsdp_rest=True), True),
    "pp2·tp2": (ParallelDims(2, 1, 1, 2), Strategy(pp=2, tp=2, microbatches=2), False),
}


def finetune_weights(name: str) -> Pretrained:
    """Another seed's weights without the head: finetuning's load, with a new head initialised."""
    state = build_model(config(name), OPS, seed=9).state_dict()
    return Pretrained(Path("pretrained"), {k: v for k, v in state.items() if not k.startswith(HEAD_PREFIXES)},
                      sorted(k for k in state if k.startswith(HEAD_PREFIXES)))


def _layout_rank(rank: int, init: str, results: dict) -> None:
    torch.set_num_threads(1)  # four ranks on a small CPU
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    found = {}
    for layout, (dims, strategy, fsdp) in LAYOUTS.items():
        mesh = build_mesh(dims, CPU)
        for name in MODELS:
            for pretrained in (None, finetune_weights(name)):
                def init(part: nn.Module, pretrained=pretrained) -> None:
                    part.init_weights(4)
                    if pretrained is not None:
                        pretrained.load_into(part, 4)

                model = meta_model(name, seed=4)
                blocks = (BlockStrategy(fsdp=fsdp),) * len(blocks_of(model))
                par = parallelize(model, mesh, Strategy(**{**strategy.__dict__, "blocks": blocks}),
                                  Precision("fp32", CPU), TrainConfig(compile=False), "after_backward", 1, CPU, init)
                whole = build_model(config(name), OPS, seed=4)
                if pretrained is not None:
                    pretrained.load_into(whole, 4)
                got = tensors(par.weights)
                key = f"{layout} {name}{' finetuned' if pretrained else ''}"
                held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in par.weights.parameters())
                found[key] = (mismatches(got, tensors(whole)), held / sum(p.numel() for p in whole.parameters()),
                              {str(p.placements) for p in par.weights.parameters() if isinstance(p, DTensor)})
    results[rank] = found
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_layout_starts_from_the_weights_of_one_process(tmp_path):
    """tp2·fsdp2 (2-D shards, strided where both split one dimension), pp2·fsdp2, HSDP and pp2·tp2, each initialised
    afresh and finetuned from weights with a new head: at step 0 each rank holds the single process's values."""
    results = mp.Manager().dict()
    spawn_ranks(_layout_rank, WORLD, tmp_path, results)
    for rank in range(WORLD):
        for key, (wrong, share, _) in results[rank].items():
            assert wrong == [], f"rank {rank}, {key}: {wrong}"
            assert share < 0.75, f"rank {rank}, {key}: holds {share:.0%} of the model"  # about half or a quarter
    placements = set().union(*(results[rank]["tp2·fsdp2 vit_mini"][2] for rank in range(WORLD)))
    assert "(_StridedShard(dim=0, sf=2), Shard(dim=0))" in placements  # fc1: FSDP and tensor parallel split dim 0
