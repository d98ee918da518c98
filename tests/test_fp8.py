"""train.precision=fp8: refused where it cannot run, the float8 swap takes exactly the blocks' matmuls and leaves the
parameters as they were, and (GPU) training follows bf16-pure, under FSDP2 with float8 gathers too."""

import copy
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from vitctl.trainer import preflight as preflight_module
from vitctl.trainer.config import FP8_RECIPES, ConfigError, ModelConfig, load_config
from vitctl.trainer.fp8 import (
    Float8Mlp,
    Float8PackedQKV,
    FusedRowwiseLinear,
    FusedRowwiseMlp,
    FusedRowwisePackedQKV,
    convert_to_float8,
    float8_config,
    fp8_problems,
)
from vitctl.trainer.loop import train
from vitctl.trainer.models import block_widths, blocks_of, build_model
from vitctl.trainer.models.layers import timm_layout
from vitctl.trainer.models.vit import VisionTransformer
from vitctl.trainer.ops import resolve
from vitctl.trainer.precision import Precision
from vitctl.trainer.preflight import preflight

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
MICRO = {"vit_micro": ["model.name=vit_micro"], "swin_micro": ["model.name=swin_micro", "model.window_size=4"]}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def float8_linear_module():
    """torchao's Float8Linear module, or the test skipped where torchao (optional) is not installed."""
    return pytest.importorskip("torchao.float8.float8_linear", reason="torchao is optional (pip install 'vitctl[fp8]')")


def run_config(out, *overrides: str):
    return load_config(None, ["model.img_size=32", "model.num_classes=10", "model.drop_path=0.0",
                              "data.source=synthetic", "data.batch_size=32", "data.train_samples=3200",
                              "augment.mixup=0", "augment.cutmix=0", "optim.warmup_epochs=0", "optim.lr=1e-2",
                              "train.fp8_min_width=0", f"train.out_dir={out}", *overrides])


def micro_model(name: str, device: torch.device = CPU):
    window = {"window_size": 4} if name.startswith("swin") else {}
    config = ModelConfig(name=name, img_size=32, num_classes=10, drop_path=0.0, **window)
    return build_model(config, resolve("none" if device.type == "cpu" else "all", device)).to(device)


# ---------------------------------------------------------------- refused where it cannot run


def test_config_takes_fp8_and_names_the_recipes():
    assert load_config(None, ["train.precision=fp8"]).train.fp8_recipe == "fused_rowwise"
    assert load_config(None, ["train.precision=fp8", "train.fp8_recipe=tensorwise"]).train.fp8_recipe == "tensorwise"
    with pytest.raises(ConfigError, match="train.fp8_recipe must be one of tensorwise, rowwise, .*, got 'blockwise'"):
        load_config(None, ["train.fp8_recipe=blockwise"])
    with pytest.raises(ConfigError, match="train.fp8_min_width must be 0 or more, got -1"):
        load_config(None, ["train.fp8_min_width=-1"])


def test_fp8_that_would_put_no_layer_in_float8_is_refused_before_launch_with_a_width_that_works(tmp_path):
    narrow = run_config(tmp_path, "train.precision=fp8", *MICRO["swin_micro"], "train.fp8_min_width=512")
    with pytest.raises(ConfigError) as refused:
        preflight(narrow, 1, None)
    assert ("train.precision=fp8 would put no layer of swin_micro in float8: its widest blocks are 256 wide, under "
            "train.fp8_min_width=512; --set train.fp8_min_width=256 puts them in float8") in str(refused.value)
    preflight(run_config(tmp_path, "train.precision=fp8", *MICRO["swin_micro"], "train.fp8_min_width=256"), 1, None)
    model = micro_model("swin_micro")
    convert_to_float8(model, "fused_rowwise", fsdp=False, min_width=256)
    assert sum(type(m) is FusedRowwiseMlp for m in model.modules()) == 1  # the one 256-wide block


@pytest.mark.parametrize("name", MICRO)
def test_block_widths_are_those_of_the_built_model(name):
    model = micro_model(name)
    config = run_config("out", *MICRO[name]).model
    assert block_widths(config) == tuple(b.attn.qkv.weight.shape[-1] for b in blocks_of(model))


def test_preflight_refuses_fp8_on_the_cpu(tmp_path):
    with pytest.raises(ConfigError) as refused:
        preflight(run_config(tmp_path, "train.precision=fp8", *MICRO["vit_micro"]), 1, CPU)
    assert ("train.precision=fp8 multiplies in float8 on a GPU of compute capability 8.9 or newer (Ada, Hopper), "
            "and this run is on the CPU; use --precision bf16-pure") in str(refused.value)
    # vit_micro is narrower than fp8_min_width too, but where fp8 cannot run a width that fits is no fix
    assert "fp8_min_width" not in str(refused.value)


def test_a_batch_that_is_not_a_multiple_of_16_is_refused(tmp_path):
    problems = fp8_problems(run_config(tmp_path, "train.precision=fp8", "data.batch_size=40"), CPU)
    assert ("train.precision=fp8 needs a batch per forward (data.batch_size / parallel.microbatches) that is a "
            "multiple of 16, not 40; e.g. --batch 48") in problems


def test_a_missing_torchao_is_named_with_its_install_where_a_torchao_recipe_needs_it(tmp_path, monkeypatch):
    for module in ("torchao", "torchao.float8"):
        monkeypatch.setitem(sys.modules, module, None)  # `import torchao.float8` raises ImportError
    problems = fp8_problems(run_config(tmp_path, "train.precision=fp8", "train.fp8_recipe=rowwise"), CPU)
    assert any("train.precision=fp8 needs torchao" in p and "pip install 'vitctl[fp8]'" in p for p in problems)
    problems = fp8_problems(run_config(tmp_path, "train.precision=fp8", "train.fp8_recipe=fused_rowwise"), CPU)
    assert problems and not any("torchao" in p for p in problems)  # only the CPU is refused: ours needs no torchao
    with pytest.raises(ConfigError, match=r"pip install 'vitctl\[fp8\]'"):
        convert_to_float8(micro_model("vit_micro"), "tensorwise", fsdp=False)


def test_fp8_is_bf16_pure_with_float8_matmuls():
    precision = Precision("fp8", CPU)
    assert precision.pure and precision.fp8 and precision.scaler() is None
    assert precision.fsdp_policy().param_dtype == torch.bfloat16
    assert not Precision("bf16-pure", CPU).fp8


# ---------------------------------------------------------------- the swap


@pytest.mark.parametrize("name", MICRO)
def test_the_swap_takes_exactly_the_blocks_matmuls(name):
    float8_linear = float8_linear_module().Float8Linear
    model = micro_model(name)
    block_names = {n for n, m in model.named_modules() if any(m is b for b in blocks_of(model))}
    convert_to_float8(model, "tensorwise", fsdp=False)
    modules = dict(model.named_modules())
    linears = {n for n, m in modules.items() if isinstance(m, float8_linear)}
    assert linears == {f"{b}.{leaf}" for b in block_names for leaf in ("attn.proj", "mlp.fc1", "mlp.fc2")}
    assert {n for n, m in modules.items() if isinstance(m, Float8PackedQKV)} == {f"{b}.attn.qkv" for b in block_names}
    assert {n for n, m in modules.items() if isinstance(m, Float8Mlp)} == {f"{b}.mlp" for b in block_names}
    # The head, the patch embedding and Swin's patch merging stay bf16.
    assert not any(isinstance(m, float8_linear) for n, m in modules.items()
                   if n.startswith(("head", "patch_embed")) or "downsample" in n)


@pytest.mark.parametrize("name", MICRO)
def test_the_fused_rowwise_swap_takes_exactly_the_blocks_matmuls(name):
    model = micro_model(name)
    block_names = {n for n, m in model.named_modules() if any(m is b for b in blocks_of(model))}
    convert_to_float8(model, "fused_rowwise", fsdp=False)
    swapped = {n: type(m) for n, m in model.named_modules() if type(m).__module__ == "vitctl.trainer.fp8"}
    assert swapped == {**{f"{b}.attn.proj": FusedRowwiseLinear for b in block_names},
                       **{f"{b}.attn.qkv": FusedRowwisePackedQKV for b in block_names},
                       **{f"{b}.mlp": FusedRowwiseMlp for b in block_names}}


@pytest.mark.parametrize("recipe", ["tensorwise", "fused_rowwise"])
def test_blocks_narrower_than_fp8_min_width_stay_bf16(recipe):
    if recipe != "fused_rowwise":
        float8_linear_module()
    model = micro_model("swin_micro")  # stages 32, 64, 128 and 256 wide
    blocks = {id(b): b.attn.qkv.weight.shape[-1] for b in blocks_of(model)}
    wide = tuple(f"{n}." for n, m in model.named_modules() if blocks.get(id(m), 0) >= 128)
    convert_to_float8(model, recipe, fsdp=False, min_width=128)
    float8 = [n for n, m in model.named_modules() if type(m).__module__.startswith(("vitctl.trainer.fp8", "torchao"))]
    per_block = {"tensorwise": 5, "fused_rowwise": 3}[recipe]  # qkv, proj, MLP (and torchao's fc1, fc2)
    assert all(n.startswith(wide) for n in float8) and len(float8) == per_block * len(wide) > 0


@pytest.mark.parametrize("recipe", ["tensorwise", "fused_rowwise"])
def test_layers_whose_sizes_are_not_multiples_of_16_stay_as_they_are(recipe):
    if recipe != "fused_rowwise":
        float8_linear_module()
    model = VisionTransformer(resolve("none", CPU), img_size=32, patch=8, dim=40, depth=1, heads=2, num_classes=10)
    types = [type(m) for m in model.modules()]
    convert_to_float8(model, recipe, fsdp=False)
    assert [type(m) for m in model.modules()] == types


@pytest.mark.parametrize("recipe", ["rowwise", "fused_rowwise"])
@pytest.mark.parametrize("name", MICRO)
def test_the_state_dict_keeps_its_keys_shapes_and_dtypes(name, recipe):
    if recipe != "fused_rowwise":
        float8_linear_module()
    torch.manual_seed(0)
    model = micro_model(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    convert_to_float8(model, recipe, fsdp=False)
    assert torch.equal(rng, torch.random.get_rng_state())  # the swap draws nothing: every rank's stream stays
    after = model.state_dict()
    assert {k: (v.shape, v.dtype) for k, v in after.items()} == {k: (v.shape, v.dtype) for k, v in before.items()}
    assert all(torch.equal(after[k], v) for k, v in before.items())
    model.load_state_dict(timm_layout(before))  # timm's (3 * dim, dim) qkv loads into the float8 qkv as before


def test_fsdp_gathers_float8_weights_for_the_tensorwise_recipe_only():
    float8_linear_module()
    assert float8_config("tensorwise", fsdp=True).enable_fsdp_float8_all_gather
    assert not float8_config("rowwise", fsdp=True).enable_fsdp_float8_all_gather
    assert not float8_config("tensorwise", fsdp=False).enable_fsdp_float8_all_gather


@pytest.mark.parametrize("recipe", FP8_RECIPES)
@pytest.mark.parametrize("name", MICRO)
def test_the_float8_model_computes_what_the_bf16_model_does(name, recipe):
    """torch runs float8 matmuls on the CPU too (slowly): the swapped model's output and gradients are the bf16
    model's within float8's rounding."""
    if recipe != "fused_rowwise":
        float8_linear_module()
    torch.manual_seed(0)
    reference = micro_model(name).bfloat16()
    model = copy.deepcopy(reference)
    convert_to_float8(model, recipe, fsdp=False)
    images = torch.randn(16, 3, 32, 32, dtype=torch.bfloat16)
    results = []
    for m in (reference, model):
        out = m(images).float()
        out.square().mean().backward()
        results.append((out, [p.grad.float() for p in m.parameters()]))
    (a, grads_a), (b, grads_b) = results
    assert (a - b).norm() < 0.15 * a.norm()
    for ga, gb in zip(grads_a, grads_b, strict=True):
        assert (ga - gb).norm() <= 0.3 * ga.norm() + 1e-6


def test_fp8_trains_checkpoints_and_resumes_into_either_precision(tmp_path, monkeypatch):
    """The loop with the swapped model (on the CPU, past the device check): its checkpoint resumes in fp8 and in
    bf16-pure, whose parameters are the same."""
    float8_linear_module()
    monkeypatch.setattr(preflight_module, "fp8_problems", lambda config, device: [])
    base = [*MICRO["vit_micro"], "data.batch_size=16", "train.log_every=1"]
    first = train(run_config(tmp_path, *base, "train.precision=fp8", "train.max_steps=2"), use_cuda=False)
    again = train(run_config(tmp_path, *base, "train.precision=fp8", "train.max_steps=3"), resume=True, use_cuda=False)
    other = train(run_config(tmp_path, *base, "train.precision=bf16-pure", "train.max_steps=4"), resume=True,
                  use_cuda=False)
    assert (first["step"], again["step"], other["step"]) == (2, 3, 4)
    assert all(math.isfinite(r["loss"]) for r in (first, again, other))


def test_fsdp2_runs_the_fused_rowwise_model_as_it_runs_alone(tmp_path):
    """One gloo rank: FSDP2 per block (bf16-pure's policy) hands our float8 layers its gathered weights, and the
    output and the sharded gradients are those of the model without FSDP."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    alone = micro_model("vit_micro").bfloat16()
    convert_to_float8(alone, "fused_rowwise", fsdp=False)
    sharded = copy.deepcopy(alone).float()
    images = torch.randn(16, 3, 32, 32)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        mesh, policy = init_device_mesh("cpu", (1,)), Precision("fp8", CPU).fsdp_policy()
        for block in blocks_of(sharded):
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(sharded, mesh=mesh, mp_policy=policy)
        out = sharded(images)
        out.float().square().mean().backward()
        grads = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
    finally:
        dist.destroy_process_group()
    expected = alone(images.bfloat16())
    expected.float().square().mean().backward()
    torch.testing.assert_close(out.float(), expected.float())
    for name, p in alone.named_parameters():
        torch.testing.assert_close(grads[name], p.grad.float(), rtol=2e-2, atol=1e-5)


# ---------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("name", "recipe"), [("vit_micro", "tensorwise"), ("swin_micro", "rowwise"),
                                              ("vit_micro", "fused_rowwise"), ("swin_micro", "fused_rowwise")])
def test_fp8_follows_bf16_pure_over_20_compiled_steps(tmp_path, name, recipe):
    if recipe != "fused_rowwise":  # ours needs no torchao
        float8_linear_module()
    losses = {}
    for precision in ("bf16-pure", "fp8"):
        out = tmp_path / precision
        train(run_config(out, *MICRO[name], f"train.precision={precision}", f"train.fp8_recipe={recipe}",
                         "train.compile=true", "train.max_steps=20", "train.log_every=5"), use_cuda=True)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[precision] = [r["loss"] for r in records if "loss" in r]
    reference, fp8 = losses["bf16-pure"], losses["fp8"]
    print(f"{name} {recipe}: bf16-pure {reference}, fp8 {fp8}")
    assert len(fp8) == 4 and all(math.isfinite(x) for x in fp8)
    assert reference[-1] < 0.9 * reference[0]  # it learned, so the comparison means something
    assert all(abs(a - b) <= 0.05 * a for a, b in zip(reference, fp8, strict=True))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "fused_rowwise"])
def test_fsdp2_trains_float8_and_checkpoints_keep_their_keys(tmp_path, recipe):
    """One NCCL rank: FSDP2 (with torchao's float8 gathers for tensorwise; our layers take its bf16 gathers),
    compiled per block as the trainer does, trains; its DCP checkpoint holds the unconverted model's keys and shapes
    and loads into a plain model."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from vitctl.trainer.optim import param_groups

    if recipe == "tensorwise":  # torchao's; ours needs none
        float8_linear_module()

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = micro_model("vit_micro", CUDA)
        expected = {k: v.shape for k, v in model.state_dict().items()}
        convert_to_float8(model, recipe, fsdp=True)
        mesh, policy = init_device_mesh("cuda", (1,)), Precision("fp8", CUDA).fsdp_policy()
        for block in blocks_of(model):
            block.compile()
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        shard = model.blocks[0].mlp.fc1.weight.to_local()
        if recipe == "tensorwise":
            from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

            assert isinstance(shard, WeightWithDynamicFloat8CastTensor)
        else:  # gathered as FSDP2 gathers any bf16 weight
            assert type(shard) is torch.Tensor
        assert (type(model.blocks[0].mlp) is FusedRowwiseMlp) == (recipe == "fused_rowwise")
        optimizer = resolve("all", CUDA).optimizer(param_groups(model, 0.05, None), 1e-3, (0.9, 0.999), 1e-8)
        images, labels = torch.randn(32, 3, 32, 32, device=CUDA), torch.randint(0, 10, (32,), device=CUDA)
        losses = []
        for _ in range(8):
            loss = F.cross_entropy(model(images).float(), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        state = get_model_state_dict(model)
        assert {k: v.shape for k, v in state.items()} == expected
        dcp.save({"model": state}, checkpoint_id=tmp_path / "checkpoint")
        plain = micro_model("vit_micro", CUDA)
        loaded = {"model": plain.state_dict()}
        dcp.load(loaded, checkpoint_id=tmp_path / "checkpoint")
        for key, value in state.items():  # one rank: its shard is the whole tensor
            torch.testing.assert_close(loaded["model"][key], value.to_local())
    finally:
        dist.destroy_process_group()
