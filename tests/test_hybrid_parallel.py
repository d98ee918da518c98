"""Hybrid parallelism on 4 CPU gloo ranks: every layout (data parallel, FSDP, tensor parallel, pipeline, and a
layerwise plan mixing them) trains as one process does, in fp32, step for step; a checkpoint saved under one layout
resumes under another; bad strategies are refused before launch."""

import json

import pytest
import torch

from conftest import CLASSES, ok, vitctl
from vitctl.trainer import checkpoint as ckpt
from vitctl.trainer.parallel.strategy import BlockStrategy, Strategy

STEPS = 10
COMMON = ["--set", f"model.num_classes={CLASSES}", "--set", "model.drop_path=0", "--set", "augment.mixup=0",
          "--set", "augment.cutmix=0", "--set", "data.workers=0", "--set", "train.log_every=1",
          "--set", "train.checkpoint_every=5", "--set", "train.epochs=20", "--set", "train.eval_every_epochs=100",
          "--executor", "local", "--gpus", 0]
GLOBAL_BATCH = 24


def train(shards, out, model: str, ranks: int, dp: int, steps: int, *extra: object) -> None:
    """The same global batch on any layout, so that runs can be compared step for step."""
    config = "demo_vit" if model.startswith("vit") else "demo_swin"
    ok("train", "--config", config, "--set", f"model.name={model}", "--data", shards, "--out", out,
       "--tasks-per-node", ranks, "--batch", GLOBAL_BATCH // dp, "--steps", steps, *COMMON, *extra)


def losses(run) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def assert_same_run(a, b) -> None:
    torch.testing.assert_close(losses(a), losses(b), rtol=1e-5, atol=0)
    last_a, last_b = ckpt.list_checkpoints(a)[-1], ckpt.list_checkpoints(b)[-1]
    assert last_a.name == last_b.name
    weights_a, weights_b = ckpt.consolidated(last_a, "model"), ckpt.consolidated(last_b, "model")
    assert weights_a.keys() == weights_b.keys()
    for key in weights_a:
        torch.testing.assert_close(weights_a[key], weights_b[key], rtol=0, atol=1e-5,
                                   msg=lambda m, key=key: f"{key}: {m}")


def write_plan(path, strategy: Strategy, model: str) -> str:
    path.write_text(strategy.to_json(model, 4))
    return str(path)


LAYOUTS = {  # name: (data-parallel degree, --set overrides)
    "dp4": (4, ["parallel.grad_reduce=after_backward"]),
    "fsdp4": (4, ["parallel.fsdp=true"]),
    "tp2-dp2": (2, ["parallel.tp=2"]),
    "pp2-dp2": (2, ["parallel.pp=2", "parallel.microbatches=2"]),
    "pp2-tp2": (1, ["parallel.pp=2", "parallel.tp=2", "parallel.microbatches=4", "parallel.schedule=gpipe"]),
}


@pytest.fixture(scope="module")
def reference(prepared_shards, tmp_path_factory):
    runs = {}
    for model in ("vit_mini", "swin_mini"):
        out = tmp_path_factory.mktemp("reference") / model
        train(prepared_shards, out, model, 1, 1, STEPS)
        runs[model] = out
    return runs


# Swin in the layouts that split inside its blocks or between them (its data-parallel ones are ViT's).
CASES = [("vit_mini", layout) for layout in LAYOUTS] + [("swin_mini", "tp2-dp2"), ("swin_mini", "pp2-tp2")]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "layout"), CASES)
def test_every_layout_trains_as_one_process(prepared_shards, reference, tmp_path, model, layout):
    dp, overrides = LAYOUTS[layout]
    train(prepared_shards, tmp_path / layout, model, 4, dp, STEPS, *[a for o in overrides for a in ("--set", o)])
    assert_same_run(reference[model], tmp_path / layout)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["vit_mini", "swin_mini"])
def test_a_layerwise_plan_trains_as_one_process_and_resumes_under_another_layout(prepared_shards, reference,
                                                                                 tmp_path, model):
    """pp2 x tp2 for half the run, then a plan of 2 stages x 2 data-parallel ranks whose blocks alternate between
    FSDP with full or selective recomputation and replicated weights."""
    n_blocks = 4 if model == "vit_mini" else 5
    kinds = [BlockStrategy(fsdp=True, checkpoint="full"), BlockStrategy(fsdp=False, checkpoint="none"),
             BlockStrategy(fsdp=True, checkpoint="selective")]
    plan = Strategy(pp=2, microbatches=2, schedule="1f1b", stages=(n_blocks - 2, 2),
                    blocks=tuple(kinds[i % 3] for i in range(n_blocks)), fsdp_rest=True)
    plan_file = write_plan(tmp_path / "plan.json", plan, model)
    out = tmp_path / "split"
    train(prepared_shards, out, model, 4, 1, STEPS // 2, "--set", "parallel.pp=2", "--set", "parallel.tp=2",
          "--set", "parallel.microbatches=2")
    train(prepared_shards, out, model, 4, 2, STEPS, "--resume", "--plan", plan_file)
    assert_same_run(reference[model], out)
    assert json.loads((ckpt.list_checkpoints(out)[-1] / "meta.json").read_text())["layout"] == "pp2·fsdp2"


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel.tp=3"], "parallel.tp=3 x parallel.pp=1 = 3 does not divide the 4 ranks"),
    (["parallel.tp=4"], "parallel.tp=4 must divide every block's attention heads and MLP width; vit_micro has 3"),
    (["parallel.pp=2", "parallel.microbatches=5"], "data.batch_size 6 does not divide into parallel.microbatches=5"),
    (["parallel.pp=2", "parallel.microbatches=1"], "the 1f1b schedule needs at least parallel.pp=2 micro-batches"),
    (["parallel.pp=2", "parallel.stages=[1,1]", "parallel.microbatches=2"],
     "parallel.stages [1, 1] must give 2 stages of at least one block each, 4 blocks in all"),
    (["parallel.pp=8"], "parallel.tp=1 x parallel.pp=8 = 8 does not divide the 4 ranks"),
    (["parallel.pp=2", "parallel.microbatches=2", "parallel.grad_reduce=overlap"],
     "parallel.grad_reduce=overlap (DDP) does not run with tensor or pipeline parallel"),
    (["parallel.plan=missing.json"], "missing.json does not exist; write one with `vitctl plan"),
])
def test_strategies_that_cannot_run_are_refused_before_launch(prepared_shards, tmp_path, overrides, message):
    sets = [a for o in overrides for a in ("--set", o)]
    result = vitctl("train", "--config", "demo_vit", "--data", prepared_shards, "--out", tmp_path / "run",
                    "--tasks-per-node", 4, "--batch", 6, *COMMON, *sets)
    assert result.exit_code == 1 and message in result.stderr, result.stderr
    assert "Traceback" not in result.output + result.stderr


def test_a_plan_for_another_model_and_a_plan_beside_strategy_keys_are_refused(prepared_shards, tmp_path):
    plan = write_plan(tmp_path / "plan.json", Strategy(blocks=(BlockStrategy(),) * 12), "vit_b16")
    base = ["train", "--config", "demo_vit", "--data", prepared_shards, "--out", tmp_path / "run", "--tasks-per-node",
            4, "--batch", 6, *COMMON, "--set", f"parallel.plan={plan}"]
    result = vitctl(*base)
    assert result.exit_code == 1 and "gives strategies for 12 blocks but model has 4; it was planned for " \
        "'vit_b16'" in result.stderr
    result = vitctl(*base, "--set", "parallel.tp=2")
    assert result.exit_code == 1 and "sets the strategy, so parallel.tp cannot be given beside it" in result.stderr


def test_a_tensor_parallel_group_may_not_span_nodes(prepared_shards, tmp_path):
    result = vitctl("train", "--config", "demo_vit", "--set", "model.name=vit_mini", "--set",
                    f"model.num_classes={CLASSES}", "--data", prepared_shards, "--out", tmp_path / "run",
                    "--executor", "slurm", "--nodes", 2, "--tasks-per-node", 2, "--gpus", 0, "--batch", 6,
                    "--set", "parallel.tp=4", "--dry-run")
    assert result.exit_code == 1
    assert "parallel.tp=4 would split tensor-parallel groups across nodes of 2 ranks" in result.stderr
