"""`vitctl plan`: the search on a hand-made profile (DDP when memory is ample; sharding, checkpointing or a pipeline
when it is tight; never over the budget; nothing when nothing fits), its dynamic programme against brute force, the
plan file it writes, the profiler on CPU (blocks, and collectives among gloo ranks), and the command run offline
from a saved profile."""

import dataclasses
import errno
import functools
import itertools
import json
import os
import random
import re
import shutil
import subprocess
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import AS_A_USER, ok, spawn_ranks, vitctl
from vitctl.trainer.config import ConfigError, ParallelConfig
from vitctl.trainer.parallel.strategy import (
    CHECKPOINT,
    INTERLEAVED,
    BlockStrategy,
    Strategy,
    read_plan,
    strategy_problems,
)
from vitctl.trainer.planner import profile as profile_module
from vitctl.trainer.planner import search as search_module
from vitctl.trainer.planner.cost import (
    FSDP_BUFFER_BYTES,
    Cluster,
    Cost,
    Setting,
    block_costs,
    held_bytes,
    link,
    parts_before,
    predict,
    stage_fixed,
)
from vitctl.trainer.planner.profile import (
    COLLECTIVES,
    SHIPPED,
    BlockProfile,
    CollectiveProfile,
    FsdpHost,
    LinkFit,
    Measured,
    PartProfile,
    Profile,
    collective_groups,
    model_layout,
    profile_blocks,
    profile_collectives,
    profile_file,
    profile_parts,
    read_profile,
)
from vitctl.trainer.planner.search import CHOICES, Option, Pipeline, cheapest_under, plan_rank, search
from vitctl.workflows.plan import local_measurements

LAYOUT = model_layout("vit_mini", 32)  # 4 blocks of 4 heads
CLUSTER, BATCH = Cluster(nodes=1, gpus=4), 32
GIB, MB = 2**30, 2**20
BATCHES = (2, 8)


def _measured(forward, backward, retained, peak, host=1e-4) -> Measured:
    """Lines through BATCHES: `forward(b)` seconds and so on, the host issuing each phase in `host` seconds."""
    return Measured(BATCHES, *(tuple(f(b) for b in BATCHES) for f in (forward, backward)), (host,) * 2, (host,) * 2,
                    *(tuple(int(f(b)) for b in BATCHES) for f in (retained, peak)))


def hand_made_profile(fsdp_work_s: float = 2e-3, latency_s: float = 20e-6, host_s: float = 1e-4) -> Profile:
    """A fictional GPU for LAYOUT: 50M parameters a block (over tp), forward 1 ms + 1 ms a sample (tensor parallel
    at 75% efficiency), backward twice that plus the recomputation, each issued by the host in `host_s`; 100 MB of
    activations a sample (over tp), of which selective checkpointing keeps half and full 10 MB; NVLink-like links in
    a node, slower ones across."""
    blocks = []
    for tp in (1, 2, 4):
        efficiency = 1.0 if tp == 1 else 0.75
        forward = lambda b, tp=tp, e=efficiency: 1e-3 + b * 1e-3 / (tp * e)  # noqa: E731
        for mode, rerun, kept in (("none", 0.0, 100 / tp + 10), ("selective", 0.3, 50 / tp + 10), ("full", 1.0, 10)):
            for fsdp, work in ((False, 0.0), (True, fsdp_work_s)):
                blocks.append(BlockProfile(LAYOUT.blocks[0].key, tp, mode, fsdp, 50_000_000 // tp, _measured(
                    lambda b, f=forward, w=work: f(b) + w, lambda b, f=forward, r=rerun, w=work: (2 + r) * f(b) + w,
                    lambda b, k=kept: k * MB * b, lambda b, k=kept: (k + 20) * MB * b, host_s)))
    parts = tuple(PartProfile(p.name, 1_000_000, _measured(lambda b: 1e-4 * b, lambda b: 2e-4 * b,
                                                           lambda b: MB * b, lambda b: 2 * MB * b))
                  for p in LAYOUT.parts)

    def link(ranks: int, nodes: int, bandwidth: float) -> CollectiveProfile:
        fit = LinkFit(latency_s, bandwidth)
        return CollectiveProfile(ranks, nodes, (MB,), {op: (latency_s + MB / bandwidth,) for op in COLLECTIVES},
                                 {op: fit for op in COLLECTIVES}, 1.3)

    return Profile("Hand-made GPU", torch.__version__, "vit_mini", 32, tuple(blocks), parts, 2e-11,
                   (link(8, 1, 200e9), link(16, 2, 20e9)))


@pytest.fixture
def one_thread():
    """Timing on a CPU with one intra-op thread: steadier on a shared machine, and far quicker for small ops."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _is_ddp(s: Strategy) -> bool:
    return s.tp == 1 and s.pp == 1 and not s.fsdp and all(b.checkpoint == "none" for b in s.blocks)


def test_ample_memory_gives_ddp():
    result = search(LAYOUT, hand_made_profile(), CLUSTER, BATCH, 80 * GIB)
    assert _is_ddp(result.best.strategy)
    ddp = next(u for u in result.uniform if u.name == "DDP")
    assert ddp.fits and result.best.prediction.step_s == pytest.approx(ddp.prediction.step_s)
    assert all(u.prediction.step_s >= result.best.prediction.step_s for u in result.uniform if u.fits)


def test_tight_memory_shards_checkpoints_or_pipelines_within_the_budget():
    profile = hand_made_profile()
    ddp_peak = next(u for u in search(LAYOUT, profile, CLUSTER, BATCH, 80 * GIB).uniform if u.name == "DDP") \
        .prediction.peak_bytes
    budgets = [ddp_peak * f for f in (0.25, 0.4, 0.6, 0.8, 0.95)]
    times = []
    for budget in budgets:
        best = search(LAYOUT, profile, CLUSTER, BATCH, budget).best
        assert best is not None and best.prediction.peak_bytes <= budget
        s = best.strategy
        assert s.fsdp or s.pp > 1 or s.tp > 1 or any(b.checkpoint != "none" for b in s.blocks)
        times.append(best.prediction.step_s)
    assert times == sorted(times, reverse=True)  # more memory never plans slower


def test_a_plan_keeps_the_allocator_s_room_beside_its_tensors_the_larger_with_fsdp():
    """A strategy fits where its tensors and the allocator's room do (under a cap within that room the allocator
    frees its cache and retries several times a step): DDP's tensors alone fit here, not with its room."""
    profile, roomy = hand_made_profile(), replace(CLUSTER, allocator_room=(0.1 * GIB, 0.3 * GIB))
    ddp = next(u for u in search(LAYOUT, profile, CLUSTER, BATCH, 80 * GIB).uniform if u.name == "DDP").prediction
    budget = ddp.peak_bytes + 0.05 * GIB
    bare, kept = search(LAYOUT, profile, CLUSTER, BATCH, budget), search(LAYOUT, profile, roomy, BATCH, budget)
    assert _is_ddp(bare.best.strategy) and bare.best.prediction.room_bytes == 0
    rows = {u.name: u for u in kept.uniform}
    assert not rows["DDP"].fits and rows["DDP"].prediction.room_bytes == 0.1 * GIB
    assert rows["FSDP"].prediction.room_bytes == rows["FSDP + full checkpointing"].prediction.room_bytes == 0.3 * GIB
    best = kept.best.prediction
    assert best.room_bytes == roomy.room(kept.best.strategy.fsdp) and best.needs_bytes <= budget
    assert best.step_s > bare.best.prediction.step_s


def test_nothing_fits():
    result = search(LAYOUT, hand_made_profile(), CLUSTER, BATCH, 0.05 * GIB)
    assert result.best is None
    assert not any(u.fits for u in result.uniform)
    assert result.least.prediction.peak_bytes > 0.05 * GIB


def test_the_uniform_strategies_include_every_tensor_and_pipeline_degree_within_a_node():
    """4 GPUs: TP2 and TP4 (each with FSDP over the rest), and pipelines of 2 stages (data parallel over 2) and of 4,
    each at the micro-batch count predicted fastest of those its rank's batch divides into."""
    profile = hand_made_profile()
    rows = {u.name: u for u in search(LAYOUT, profile, CLUSTER, BATCH, 80 * GIB).uniform}
    assert list(rows) == ["DDP", "FSDP", "FSDP + full checkpointing", "TP2 + FSDP", "TP4 + FSDP", "PP2", "PP4"]
    assert [rows[name].strategy.layout(4) for name in rows] == ["dp4", "fsdp4", "fsdp4", "tp2·fsdp2", "tp4",
                                                                "pp2·dp2", "pp4"]
    for pp in (2, 4):
        counts = search_module.microbatch_counts(pp, BATCH // (4 // pp))
        fastest = min(counts, key=lambda m: predict(Strategy(pp=pp, microbatches=m, blocks=(BlockStrategy(),) * 4),
                                                    LAYOUT, profile, CLUSTER, BATCH).step_s)
        assert len(counts) > 1 and rows[f"PP{pp}"].strategy.microbatches == fastest


def test_dynamic_programme_equals_brute_force():
    rng = random.Random(0)
    for _ in range(50):
        options = [[Option(rng.uniform(0, 10), rng.randrange(0, 8)) for _ in range(3)] for _ in range(5)]
        budget = rng.randrange(0, 30)
        fitting = [(sum(o[j].seconds for o, j in zip(options, pick, strict=True)), pick)
                   for pick in itertools.product(range(3), repeat=5)
                   if sum(o[j].units for o, j in zip(options, pick, strict=True)) <= budget]
        found = cheapest_under(options, budget)
        if not fitting:
            assert found is None
        else:
            assert found[0] == pytest.approx(min(fitting)[0])
            assert sum(o[j].units for o, j in zip(options, found[1], strict=True)) <= budget


@pytest.mark.parametrize("budget_gib", [3.5, 5, 9])
def test_search_equals_brute_force_over_every_block_choice(budget_gib):
    """On one GPU (no pipeline, no sharding to gain) the searched plan is the fastest of all 3^4 checkpoint choices
    that fit; the profile's transients are the same for every choice, so the search reserves nothing extra."""
    profile, cluster, batch = hand_made_profile(latency_s=0.0), Cluster(1, 1), 8
    best = search(LAYOUT, profile, cluster, batch, budget_gib * GIB).best
    predictions = [predict(Strategy(blocks=tuple(BlockStrategy(False, mode) for mode in modes)), LAYOUT, profile,
                           cluster, batch) for modes in itertools.product(CHECKPOINT, repeat=len(LAYOUT.blocks))]
    fastest = min(p.step_s for p in predictions if p.peak_bytes <= budget_gib * GIB)
    assert best.prediction.step_s == pytest.approx(fastest)


def _summed_peak(profile, setting: Setting, choices: tuple[BlockStrategy, ...]) -> float:
    """A stage's memory as the dynamic programme counts it: every block's gradients and activations at once."""
    blocks = range(len(LAYOUT.blocks))
    costs = block_costs(profile, setting, LAYOUT, blocks, choices)
    parts, _, _ = stage_fixed(profile, LAYOUT, setting, blocks, True, False)
    return held_bytes(costs, parts, parts_before(LAYOUT, blocks, True), 1, accumulates=True)


@pytest.mark.parametrize("budget_gib", [2, 3, 6.5])
def test_stage_search_equals_brute_force_over_sharding_and_checkpointing(budget_gib):
    """On 4 GPUs, data parallel: the stage's plan is the fastest of all 6^4 choices of FSDP or not and checkpoint
    mode whose summed memory fits; its predicted peak, which counts the backward's order, fits too."""
    profile, budget = hand_made_profile(latency_s=0.0), budget_gib * GIB
    setting = Setting(CLUSTER, tp=1, pp=1, microbatches=1, microbatch=BATCH // CLUSTER.world)
    [blocks] = plan_rank(LAYOUT, profile, setting, Pipeline("1f1b", 1), ((0, range(len(LAYOUT.blocks))),), False,
                         [budget])
    planned = predict(Strategy(blocks=blocks), LAYOUT, profile, CLUSTER, BATCH)
    fitting = [predict(Strategy(blocks=choices), LAYOUT, profile, CLUSTER, BATCH).step_s
               for choices in itertools.product(CHOICES, repeat=len(LAYOUT.blocks))
               if _summed_peak(profile, setting, choices) <= budget]
    assert planned.peak_bytes <= _summed_peak(profile, setting, blocks) <= budget
    assert planned.step_s == pytest.approx(min(fitting))


def test_one_gpu_never_holds_all_gradients_and_activations_at_once_where_several_hold_the_gradients_all_step():
    """Alone, the backward frees activations as it allocates gradients: the predicted peak lies between the larger
    of the two and their sum, and the search plans against it (a larger plan than the sum allows). On several ranks
    the gradients are views of the all-reduce's buffer, held all step: the peak is the sum."""
    profile, ddp, alone = hand_made_profile(), (BlockStrategy(),) * len(LAYOUT.blocks), Cluster(nodes=1, gpus=1)
    setting = Setting(alone, tp=1, pp=1, microbatches=1, microbatch=BATCH)
    costs = block_costs(profile, setting, LAYOUT, range(len(LAYOUT.blocks)), ddp)
    gradients, activations = sum(c.grad_bytes for c in costs), sum(c.activation_bytes for c in costs)
    peak, summed = predict(Strategy(blocks=ddp), LAYOUT, profile, alone, BATCH).peak_bytes, \
        _summed_peak(profile, setting, ddp)
    assert gradients > 0 and summed - min(gradients, activations) <= peak < summed
    best = search(LAYOUT, profile, alone, BATCH, (peak + summed) / 2).best
    assert best.strategy == Strategy(blocks=ddp)
    several = Setting(CLUSTER, tp=1, pp=1, microbatches=1, microbatch=BATCH // CLUSTER.world)
    costs = block_costs(profile, several, LAYOUT, range(len(LAYOUT.blocks)), ddp)
    summed = _summed_peak(profile, several, ddp)  # with the largest transient, which the start need not meet
    assert not any(c.grad_bytes for c in costs)
    assert summed - max(c.transient_bytes for c in costs) <= \
        predict(Strategy(blocks=ddp), LAYOUT, profile, CLUSTER, BATCH).peak_bytes <= summed


def test_the_backward_frees_a_part_once_past_it_and_holds_the_fsdp_buffers_of_the_blocks_it_runs():
    """As in Swin: the first block's backward (a large recomputation) is the peak, the patch merging after it has
    freed its activations by then, and the last, widest FSDP block's buffers are not gathered there."""
    def cost(state, activations, transient, gathered, grads):
        return Cost(0.0, 0.0, 0.0, state, activations, transient, gathered, False, grads)
    blocks = [cost(10, 1, 100, 1, 2), cost(100, 1, 1, 5, 20)]
    embed, merge = cost(0, 5, 0, 0, 0), cost(0, 30, 0, 0, 0)  # before blocks 0 and 1
    fixed = 110 - 22  # the state, less the blocks' gradients, which the walk allocates
    first_block = 22 + (1 + 5) + 100 + FSDP_BUFFER_BYTES * 1  # every gradient, block 0's and the embedding's inputs
    second_block = 20 + (2 + 5 + 30) + 1 + FSDP_BUFFER_BYTES * 5
    head = (2 + 5 + 30) + FSDP_BUFFER_BYTES * 5
    assert held_bytes(blocks, [embed, merge], [0, 1], 1, False) == fixed + max(first_block, second_block, head)
    # the merge before block 0 instead: its activations live until after block 0's backward, the peak
    assert held_bytes(blocks, [embed, merge], [0, 0], 1, False) == fixed + first_block + 30
    assert held_bytes(blocks, [embed, merge], [0, 1], 1, True) == 110 + 37 + 100 + FSDP_BUFFER_BYTES * 5


@pytest.mark.parametrize("share", [0.2, 0.3, 0.5])
def test_short_memory_splits_the_batch_into_accumulated_micro_batches(share):
    """One GPU, a fraction of DDP's memory: the plan splits the batch and is the fastest of every checkpoint choice x
    micro-batch count (1, 2, 4, 8 slices of the batch, gradients accumulated) that fits with the dynamic programme's
    rounding to spare (each block's memory and the budget rounded to a MEMORY_STEPS-th of the budget)."""
    profile, cluster, batch = hand_made_profile(latency_s=0.0), Cluster(1, 1), 32
    budget = share * predict(Strategy(blocks=(BlockStrategy(),) * 4), LAYOUT, profile, cluster, batch).peak_bytes
    best = search(LAYOUT, profile, cluster, batch, budget).best
    predictions = [predict(Strategy(microbatches=m, blocks=tuple(BlockStrategy(False, c) for c in modes)), LAYOUT,
                           profile, cluster, batch) for m in (1, 2, 4, 8)
                   for modes in itertools.product(CHECKPOINT, repeat=len(LAYOUT.blocks))]
    rounding = (len(LAYOUT.blocks) + 1) * budget / search_module.MEMORY_STEPS
    assert best.strategy.microbatches > 1 and best.prediction.peak_bytes <= budget
    assert best.prediction.step_s <= min(p.step_s for p in predictions if p.peak_bytes <= budget - rounding) + 1e-12


def test_interleaving_shrinks_the_predicted_bubble():
    """pp2 with 2 stages of one block per rank: the bubble is (pp - 1) / v micro-batches of a rank's, half 1F1B's,
    which outweighs the twice as many transfers of a micro-batch between ranks."""
    profile, blocks = hand_made_profile(), (BlockStrategy(),) * len(LAYOUT.blocks)
    plain = predict(Strategy(pp=2, microbatches=2, blocks=blocks), LAYOUT, profile, CLUSTER, BATCH)
    interleaved = predict(Strategy(pp=2, microbatches=2, schedule="interleaved_1f1b", virtual_stages=2, blocks=blocks),
                          LAYOUT, profile, CLUSTER, BATCH)
    assert [s.blocks for s in interleaved.stages] == [range(i, i + 1) for i in range(4)]
    assert interleaved.step_s < plain.step_s
    assert interleaved.peak_bytes > 0


def test_a_pipeline_stage_host_fills_its_bubble():
    """A stage whose host launches its kernels slower than they run (eager, small micro-batches) issues the next ones
    while its device waits for the other stage (a receive makes the stream wait, not the host): the bubble costs
    device time only, so the step is m micro-batches at the host's pace, not m + pp - 1 of them."""
    strategy, m = Strategy(pp=2, microbatches=4, blocks=(BlockStrategy(),) * len(LAYOUT.blocks)), 4
    device_bound = predict(strategy, LAYOUT, hand_made_profile(), CLUSTER, BATCH)
    host_bound = predict(strategy, LAYOUT, hand_made_profile(host_s=0.05), CLUSTER, BATCH)
    once = max(s.step_s for s in device_bound.stages)
    micro = max(s.micro_s for s in device_bound.stages)
    assert [s.device_micro_s for s in device_bound.stages] == [s.micro_s for s in device_bound.stages]
    assert device_bound.step_s == pytest.approx((m + 1) * micro + once)
    assert [s.device_micro_s for s in host_bound.stages] == [s.device_micro_s for s in device_bound.stages]
    host_micro = max(s.micro_s for s in host_bound.stages)
    assert host_micro > (m + 1) / m * micro
    assert host_bound.step_s == pytest.approx(m * host_micro + once)


@pytest.mark.parametrize("budget_gib", [1.5, 3, 6])
def test_rank_search_equals_brute_force_over_an_interleaved_pipeline(budget_gib):
    """pp2 with two one-block stages per rank: each rank's plan over its two stages, put together, is the fastest of
    all 6^4 choices that fit under interleaved 1F1B (none, when none fits)."""
    profile, budget = hand_made_profile(), budget_gib * GIB
    setting, pipeline = Setting(CLUSTER, tp=1, pp=2, microbatches=2, microbatch=8), Pipeline(INTERLEAVED, 2)
    interleaved = lambda blocks: predict(Strategy(pp=2, microbatches=2, schedule=INTERLEAVED, virtual_stages=2,  # noqa: E731
                                                  blocks=blocks), LAYOUT, profile, CLUSTER, BATCH)
    fitting = [p.step_s for p in map(interleaved, itertools.product(CHOICES, repeat=len(LAYOUT.blocks)))
               if p.peak_bytes <= budget]
    ranks = [plan_rank(LAYOUT, profile, setting, pipeline, ((r, range(r, r + 1)), (r + 2, range(r + 2, r + 3))),
                       False, [budget])[0] for r in (0, 1)]
    if not fitting:
        assert None in ranks
        return
    planned = interleaved((ranks[0][0], ranks[1][0], ranks[0][1], ranks[1][1]))
    assert planned.peak_bytes <= budget and planned.step_s == pytest.approx(min(fitting))


def test_search_interleaves_where_the_bubble_costs_most(tmp_path, monkeypatch):
    """On 2 GPUs whose memory makes a pipeline pay, two stages per rank halve the bubble: the search picks
    interleaved 1F1B, faster than the best plan without it, and the plan loads and passes the checks."""
    profile, cluster = hand_made_profile(), Cluster(nodes=1, gpus=2)
    ddp = next(u for u in search(LAYOUT, profile, cluster, BATCH, 80 * GIB).uniform if u.name == "DDP")
    budget = 0.35 * ddp.prediction.peak_bytes
    best = search(LAYOUT, profile, cluster, BATCH, budget).best
    assert best.strategy.schedule == INTERLEAVED and best.strategy.virtual_stages == 2
    assert best.prediction.peak_bytes <= budget
    monkeypatch.setattr(search_module, "PIPELINES", (("1f1b", 1),))
    plain = search(LAYOUT, profile, cluster, BATCH, budget).best
    assert plain.strategy.schedule == "1f1b" and best.prediction.step_s < plain.prediction.step_s
    path = tmp_path / "plan.json"
    path.write_text(best.strategy.to_json("vit_mini", cluster.world))
    loaded = read_plan(path, ParallelConfig(), len(LAYOUT.blocks))
    assert loaded == best.strategy
    assert strategy_problems(loaded, LAYOUT.shape(), cluster.world, BATCH) == []


def test_plans_load_and_pass_the_checks(tmp_path):
    profile = hand_made_profile()
    for budget in (2, 4, 80):
        best = search(LAYOUT, profile, CLUSTER, BATCH, budget * GIB).best
        path = tmp_path / f"plan{budget}.json"
        path.write_text(best.strategy.to_json("vit_mini", CLUSTER.world, {"step_s": best.prediction.step_s}))
        loaded = read_plan(path, ParallelConfig(), len(LAYOUT.blocks))
        assert loaded == best.strategy
        dp = CLUSTER.world // (loaded.tp * loaded.pp)
        assert strategy_problems(loaded, LAYOUT.shape(), CLUSTER.world, BATCH // dp) == []


def test_profile_blocks_on_cpu(one_thread):
    profiles = profile_blocks("vit_mini", 32, 2, torch.device("cpu"), tp_degrees=(1, 2))
    assert {(b.tp, b.checkpoint, b.fsdp) for b in profiles} == \
        {(tp, mode, fsdp) for tp in (1, 2) for mode in CHECKPOINT for fsdp in (False, True)}
    for b in profiles:
        m = b.measured
        assert m.batch == (1, 2) and min(m.forward_s + m.backward_s) > 0 and min(m.retained_bytes) > 0
        assert all(peak >= kept for peak, kept in zip(m.peak_bytes, m.retained_bytes, strict=True))
    kept = {(b.tp, b.checkpoint, b.fsdp): b.measured.retained_bytes[-1] for b in profiles}
    for fsdp in (False, True):
        assert kept[1, "full", fsdp] < kept[1, "selective", fsdp] < kept[1, "none", fsdp]
    params = {b.tp: b.params for b in profiles}
    assert params[2] < params[1]


def _cpu_bf16_autocast(device, run, x):
    with torch.autocast("cpu", torch.bfloat16):
        return run(x)


@pytest.mark.parametrize("model, bf16_from", [("swin_micro", 1), ("vit_micro", None)])
def test_profile_feeds_blocks_and_parts_the_dtype_the_model_feeds_them(monkeypatch, one_thread, model, bf16_from):
    """Under bf16 autocast Swin's residual stream turns bf16 at its first patch merging (a fully checkpointed block
    keeps its input: half fp32's bytes), ViT's stays fp32: each block and part is measured on what it gets."""
    fed = {}

    def record(module, make_input, batch, device, run=None):
        x = make_input(1)
        fed.setdefault(tuple(x.shape[1:]), set()).add(x.dtype)

    monkeypatch.setattr(profile_module, "_autocast", _cpu_bf16_autocast)
    monkeypatch.setattr(profile_module, "_measure", record)
    img = 224 if model.startswith("swin") else 32
    cpu = torch.device("cpu")
    profile_blocks(model, img, 2, cpu, tp_degrees=(1,), checkpoints=("none",))
    blocks = model_layout(model, img).blocks
    expected = {b.input_shape: torch.float32 if bf16_from is None or i < bf16_from else torch.bfloat16
                for i, b in enumerate(blocks)}
    assert fed == {shape: {dtype} for shape, dtype in expected.items()}
    fed.clear()
    profile_parts(model, img, 2, cpu)
    assert fed.pop((3, img, img)) == {torch.float32}  # the images
    merged = [blocks[p.before - 1].input_shape for p in model_layout(model, img).parts if p.name.startswith("merge")]
    assert fed == {shape: {expected[shape]} for shape in [*merged, blocks[-1].input_shape]}


def _collectives_rank(rank: int, init: str, results: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    results[rank] = profile_collectives(None, (1 << 12, 1 << 16))
    dist.destroy_process_group()


def test_profile_collectives_on_two_gloo_ranks(tmp_path):
    results = mp.Manager().dict()
    spawn_ranks(_collectives_rank, 2, tmp_path, results)
    measured = results[0]
    assert (measured.ranks, measured.nodes, measured.sizes) == (2, 1, (1 << 12, 1 << 16))
    assert set(measured.fits) == set(COLLECTIVES)
    assert all(f.bus_bytes_per_s > 0 and f.latency_s >= 0 for f in measured.fits.values())
    assert measured.overlap_slowdown >= 1 and results[1].seconds == measured.seconds  # the slowest rank's, on both


def test_ranks_measure_collectives_and_fsdp_blocks_host_in_chains_on_two_gloo_ranks():
    """What `vitctl plan --profile-only` measures among ranks: the collectives, and for each checkpoint mode the host
    time an FSDP block adds to a step, its weights sharded over both ranks, which the profile keeps."""
    collectives, hosts = local_measurements("vit_micro", 32, 2, torch.device("cpu"))
    assert [c.ranks for c in collectives] == [2]
    key = model_layout("vit_micro", 32).blocks[0].key
    assert sorted((h.shape, h.checkpoint, h.ranks, h.batch) for h in hosts) == \
        sorted((key, mode, 2, 1) for mode in CHECKPOINT)
    assert all(min(h.forward_s, h.backward_s, h.step_s) > 0 for h in hosts)
    profile = replace(hand_made_profile(), fsdp_hosts=hosts)
    assert Profile.from_json(profile.to_json()) == profile
    assert profile.fsdp_host(key, "full", 8) == next(h for h in hosts if h.checkpoint == "full")


def test_an_fsdp_block_launches_at_the_pace_its_chains_were_measured_among_the_nearest_rank_count():
    """Where the profile holds chains of FSDP blocks, an FSDP block's host times are theirs, for the rank count
    nearest its shard degree, the optimizer's step spread over the micro-batches; the kernels' times stay."""
    key, full = LAYOUT.blocks[0].key, BlockStrategy(fsdp=True, checkpoint="full")
    chains = {2: FsdpHost(key, "full", 2, 1, 1.0, 2.0, 0.5), 4: FsdpHost(key, "full", 4, 1, 3.0, 4.0, 1.0)}
    profile = hand_made_profile()
    timed = replace(profile, fsdp_hosts=tuple(chains.values()))
    for shard, m in itertools.product((2, 4), (1, 2)):
        setting = Setting(CLUSTER, 1, 1, m, BATCH // 4 // m, shard)
        own, chained = (block_costs(p, setting, LAYOUT, range(1), [full] * 4)[0] for p in (profile, timed))
        host = chains[shard]
        assert chained.micro_s == pytest.approx(host.forward_s + host.backward_s + host.step_s / m, rel=1e-3)
        assert chained.device_micro_s == own.device_micro_s and chained.micro_s > own.micro_s
    setting = Setting(CLUSTER, 1, 1, 1, BATCH // 4)
    for choice in (BlockStrategy(fsdp=True), BlockStrategy(checkpoint="full")):  # no chain measured; replicated
        assert block_costs(timed, setting, LAYOUT, range(1), [choice] * 4) == \
            block_costs(profile, setting, LAYOUT, range(1), [choice] * 4)


def test_collective_groups():
    assert collective_groups(8, 8) == [[0, 1], [0, 1, 2, 3], list(range(8))]
    assert collective_groups(12, 6) == [[0, 1], [0, 1, 2, 3], list(range(6)), [0, 6], list(range(12))]


def _plan_args(profile_path, out, memory_gib):
    return ("plan", "--model", "vit_mini", "--img-size", 32, "--nodes", 1, "--gpus", 4, "--memory-gib", memory_gib,
            "--batch", BATCH, "--out", out, "--profile", profile_path)


@pytest.mark.parametrize("path", sorted(SHIPPED.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_profile_loads_under_its_own_name_and_plans_its_machine(path):
    """A shipped profile is read as `vitctl plan` reads it, is named as it would be cached, and plans for each
    group of GPUs of one node its collectives were measured among."""
    model = path.stem.rsplit("-", 2)[1]  # DEVICE-TORCH-MODEL-IMG_SIZE
    profile = read_profile(path, model, 224)
    assert path.name == profile_file(profile.device, profile.torch, model, 224)
    layout = model_layout(model, 224)
    for ranks in sorted({c.ranks for c in profile.collectives if c.nodes == 1}):
        result = search(layout, profile, Cluster(nodes=1, gpus=ranks), 64 * ranks, 40 * GIB)
        assert result.best is not None and result.best.fits


def test_cli_plans_offline_from_a_saved_profile(tmp_path):
    profile_path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile_path.write_text(hand_made_profile().to_json())
    result = ok(*_plan_args(profile_path, out, 80))
    for text in ("searched plan", "DDP", "FSDP + full checkpointing", "images/s", "peak GiB", str(out)):
        assert text in result.output
    loaded = read_plan(out, ParallelConfig(), len(LAYOUT.blocks))
    assert _is_ddp(loaded)
    assert strategy_problems(loaded, LAYOUT.shape(), CLUSTER.world, BATCH // CLUSTER.world) == []


def test_a_profile_measured_on_the_cpu_warns_that_it_plans_from_a_cpu(tmp_path):
    """Before: a plan for GPUs from `--profile-only` on a machine without one, said only by `(cpu, ...)`."""
    profile_path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile_path.write_text(dataclasses.replace(hand_made_profile(), device="cpu").to_json())
    result = ok(*_plan_args(profile_path, out, 80))
    assert (f"warning: profile {profile_path} was measured on the CPU: the plan's timings, and the strategy picked "
            "from them, are a CPU's, not a GPU's; measure one on a GPU node (`vitctl plan --profile-only --model "
            "vit_mini --img-size 32`) and pass it with --profile") in result.stderr, result.stderr
    profile_path.write_text(hand_made_profile().to_json())
    assert "warning" not in ok(*_plan_args(profile_path, out, 80)).stderr


def test_cli_fails_clearly_when_nothing_fits(tmp_path):
    profile_path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile_path.write_text(hand_made_profile().to_json())
    result = vitctl(*_plan_args(profile_path, out, 0.05))
    assert result.exit_code == 1
    assert "does not fit" in result.output
    assert "no strategy for vit_mini" in result.stderr and "--memory-gib" in result.stderr
    assert not out.exists()
    least = re.search(r"needs is (\d+(?:\.\d+)?) GiB \((\S+), ([^)]+)\): pass --memory-gib \1 or more", result.stderr)
    assert least and re.fullmatch(r"(every block|\d+ blocks) (dp|fsdp), checkpoint (none|selective|full).*",
                                  least[3]), result.stderr  # before: "every block FSDP ...", of a pp2 without FSDP
    # 0.05 GiB is less than the 1.5 GiB a plan leaves the allocator: more GPUs or a smaller batch would not fit either
    assert "add GPUs" not in result.stderr and result.stderr.rstrip().endswith("or more"), result.stderr
    below = vitctl(*_plan_args(profile_path, out, f"{float(least[1]) - 0.01:.2f}"))
    assert below.exit_code == 1 and not out.exists()  # the least of every strategy searched: before, one fit below it
    ok(*_plan_args(profile_path, out, least[1]))  # the figure it names fits: before, it was rounded down
    assert out.exists()


def test_cli_plans_at_the_least_memory_it_names_where_the_programme_rounds_it_out(tmp_path):
    """Before: Swin-H on 2 GPUs named 10.54 GiB (pp2, every block dp, checkpoint full: 10.535), and refused 10.54 and
    10.55: the dynamic programme rounds each block's memory up to a step of the budget, past its 5 MiB to spare."""
    out, profile_path = tmp_path / "plan.json", SHIPPED / "NVIDIA_H200-torch2.11.0_cu130-swin_h-224.json"
    args = lambda memory_gib: ("plan", "--model", "swin_h", "--gpus", 2, "--memory-gib", memory_gib,  # noqa: E731
                               "--batch", 256, "--out", out, "--profile", profile_path)
    result = vitctl(*args(0.5))
    assert result.exit_code == 1 and not out.exists(), result.stderr
    least = re.search(r"needs is (\d+(?:\.\d+)?) GiB \(.+\): pass --memory-gib \1 or more", result.stderr)
    assert least, result.stderr
    below = vitctl(*args(f"{float(least[1]) - 0.01:.2f}"))
    assert below.exit_code == 1 and not out.exists()
    assert "or more, or add GPUs (--nodes, --gpus) or lower --batch" in below.stderr, below.stderr  # both would help
    ok(*args(least[1]))
    assert read_plan(out, ParallelConfig(), 48).pp == 2


@pytest.mark.parametrize("extra", [["--out", "mine.json"], ["--profile", "p.json"], ["--memory-gib", 80],
                                   ["--batch", 64], ["--nodes", 2],
                                   ["--memory-gib", 80, "--batch", 64, "--out", "mine.json"]])
def test_cli_refuses_planning_options_beside_profile_only_before_measuring(tmp_path, monkeypatch, extra):
    """Before: exit 0 after minutes of measuring, each ignored (`--out mine.json` never written)."""
    monkeypatch.chdir(tmp_path)
    measuring = lambda *_: pytest.fail("measured before refusing the options")  # noqa: E731
    monkeypatch.setattr("vitctl.workflows.plan.profile_only", measuring)
    monkeypatch.setattr("vitctl.workflows.plan.local_device", measuring)
    result = vitctl("plan", "--profile-only", "--model", "vit_mini", "--img-size", 32, "--gpus", 2, *extra)
    named = [flag for flag in extra if str(flag).startswith("--")]
    assert result.exit_code == 2, result.output + result.stderr
    assert (f"--profile-only measures and caches this machine's profile, and plans nothing: it does not use "
            f"{', '.join(named)}; drop them to measure (a later `vitctl plan` reads the cached profile), or drop "
            f"--profile-only to plan") in " ".join(result.stderr.split()), result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("edit", "reason"), [
    # version 1 profiles measured FSDP without checkpointing only: read, they would mislead the search
    (('"version": 2', '"version": 1'), "profile version 1, this vitctl reads version 2"),
    (('"img_size": 32', '"img_size": 64'), "measured vit_mini at 64 px, not vit_mini at 32 px"),
], ids=["older format", "another size"])
def test_cli_refuses_a_profile_it_cannot_use_with_the_command_that_replaces_it(tmp_path, edit, reason):
    profile_path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile_path.write_text(hand_made_profile().to_json().replace(*edit))
    result = vitctl(*_plan_args(profile_path, out, 80))
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr
    assert reason in result.stderr
    assert "`vitctl plan --profile-only --model vit_mini --img-size 32`" in result.stderr
    assert not out.exists()


def test_cli_given_a_plan_as_its_profile_says_so_and_the_profile_works(tmp_path):
    """Before: 'profile version 1, this vitctl reads version 2', and measuring again, which the plan did not need."""
    profile_path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile_path.write_text(hand_made_profile().to_json())
    ok(*_plan_args(profile_path, out, 80))
    result = vitctl(*_plan_args(out, tmp_path / "again.json", 80))
    assert result.exit_code == 1 and f"--profile {out} is a plan (`vitctl plan --out` wrote it), not a profile" \
        in result.stderr, result.stderr
    ok(*_plan_args(profile_path, tmp_path / "again.json", 80))


def test_the_printed_train_flags_run_the_plan(tmp_path, prepared_shards):
    """Before: `train with --plan plan.json --batch 16`, which trained the default vit_b16 at 224 and was refused."""
    profile_path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile_path.write_text(hand_made_profile().to_json())
    said = re.search(r"\(train with (.+)\)", ok(*_plan_args(profile_path, out, 80)).stdout.replace("\n", ""))
    flags = said.group(1).split()
    assert flags[:2] == ["--model", "vit_mini"] and "--gpus" in flags and "model.img_size=32" in flags, flags
    gpus = flags.index("--gpus")  # this machine's ranks are CPU ones
    flags[gpus:gpus + 2] = ["--gpus", "0", "--tasks-per-node", flags[gpus + 1]]
    ok("train", *flags, "--config", "demo_vit", "--data", prepared_shards, "--set", "model.num_classes=5",
       "--set", "train.precision=fp32", "--executor", "local", "--dry-run", "--out", tmp_path / "run")


def test_the_train_flags_of_a_cpu_profile_s_plan_run_cpu_ranks_as_printed(tmp_path, prepared_shards):
    """Before: `--gpus 4` for a plan searched from a CPU profile; here --gpus 4 is refused, and its fix (--gpus 0)
    ran one rank, which the plan of 4 refused in turn."""
    profile_path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile_path.write_text(replace(hand_made_profile(), device="cpu").to_json())
    said = re.search(r"\(train with (.+)\)", ok(*_plan_args(profile_path, out, 80)).stdout.replace("\n", ""))
    flags = said.group(1).split()
    assert flags[flags.index("--gpus"):flags.index("--gpus") + 4] == ["--gpus", "0", "--tasks-per-node", "4"], flags
    ok("train", *flags, "--config", "demo_vit", "--data", prepared_shards, "--set", "model.num_classes=5",
       "--set", "train.precision=fp32", "--executor", "local", "--dry-run", "--out", tmp_path / "run")


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the missing profile is measured")
def test_cli_without_a_profile_on_a_cpu_says_how_to_get_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    result = vitctl("plan", "--model", "vit_mini", "--img-size", 32, "--gpus", 4, "--memory-gib", 8, "--batch", BATCH,
                    "--out", tmp_path / "plan.json")
    assert result.exit_code == 1
    assert "no profile" in result.stderr and "--profile-only" in result.stderr and "--profile" in result.stderr


def test_across_nodes_the_search_shards_within_a_node(tmp_path):
    """2 nodes x 4 GPUs, ten times slower between nodes: HSDP (FSDP within each node, replicated across) moves a
    quarter of the gradients between nodes that FSDP over all 8 ranks or DDP would, so it is predicted fastest though
    it holds twice FSDP's weights; the search shards within a node, and its plan loads and passes the checks."""
    profile, cluster, batch = hand_made_profile(), Cluster(nodes=2, gpus=4), 64
    rows = {u.name: u for u in search(LAYOUT, profile, cluster, batch, 80 * GIB).uniform}
    hsdp, fsdp = rows["HSDP"], rows["FSDP"]
    assert hsdp.strategy.layout(8) == "dp2·fsdp4" and fsdp.strategy.layout(8) == "fsdp8"
    mixed = replace(fsdp.strategy, blocks=(BlockStrategy(fsdp=True),) * 3 + (BlockStrategy(),))
    assert mixed.layout(8) == "fsdp8 on 3/4 blocks"  # was "fsdp8", as if every block were sharded
    assert hsdp.prediction.step_s < min(fsdp.prediction.step_s, rows["DDP"].prediction.step_s)
    assert hsdp.prediction.peak_bytes > fsdp.prediction.peak_bytes
    best = search(LAYOUT, profile, cluster, batch, 0.5 * rows["DDP"].prediction.peak_bytes).best
    assert best.strategy.dp_shard == 4 and best.strategy.fsdp
    path = tmp_path / "plan.json"
    path.write_text(best.strategy.to_json("vit_mini", cluster.world))
    loaded = read_plan(path, ParallelConfig(), len(LAYOUT.blocks))
    assert loaded == best.strategy and strategy_problems(loaded, LAYOUT.shape(), 8, batch // 8) == []


def test_a_profile_without_collectives_across_nodes_names_the_command_that_measures_them():
    """Before: the command lacked the profile's image size and the rendezvous torchrun needs across nodes."""
    profile = hand_made_profile()
    one_node = replace(profile, collectives=[c for c in profile.collectives if c.nodes == 1])
    with pytest.raises(ConfigError) as refused:
        link(one_node, "all_reduce", 8, crosses_nodes=True)
    assert (f"--rdzv-endpoint HOST:29500 -m vitctl.cli plan --profile-only --model vit_mini --img-size "
            f"{profile.img_size}`") in str(refused.value)


def test_cli_warns_where_the_plan_extrapolates_collectives_past_the_gpus_measured(tmp_path):
    """Before: a plan for 1,000 GPUs from collectives measured among 2 was printed without a word."""
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(hand_made_profile().to_json())  # collectives measured among 8 and 16 GPUs
    args = ["plan", "--model", "vit_mini", "--img-size", 32, "--memory-gib", 80, "--profile", profile_path]
    wide = ok(*args, "--nodes", 4, "--gpus", 8, "--batch", 320, "--out", tmp_path / "wide.json")
    assert "warning: the profile measured collectives among 16 GPUs at most; the times of 32 are extrapolated" \
        in wide.stderr, wide.stderr
    assert "warning" not in ok(*args, "--nodes", 2, "--gpus", 8, "--batch", 320, "--out", tmp_path / "n.json").stderr


def test_cli_where_no_gpu_could_hold_a_plan_names_no_memory_to_pass(tmp_path):
    """Before: `pass --memory-gib 12258509799.3 or more`, which --memory-gib refuses (1024 at most)."""
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(hand_made_profile().to_json())
    result = vitctl("plan", "--model", "vit_mini", "--img-size", 32, "--gpus", 2, "--memory-gib", 80, "--batch",
                    999_999_999_998, "--out", tmp_path / "plan.json", "--profile", profile_path)
    assert result.exit_code == 1 and "pass --memory-gib" not in result.stderr, result.stderr
    assert re.search(r"the least any searched strategy needs is [\d,.]+ GiB a GPU, more than any GPU holds: add GPUs "
                     r"\(--nodes, --gpus\) or lower --batch", result.stderr), result.stderr


@pytest.mark.parametrize(("budget", "said"), [("nan", "'nan' is not a finite number"),
                                              ("inf", "'inf' is not a finite number"),
                                              ("1e-308", "'1e-308' GiB is less than one MiB")])  # was: OverflowError
def test_cli_refuses_a_memory_budget_that_is_not_a_finite_number_or_too_small(tmp_path, budget, said):
    profile_path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile_path.write_text(hand_made_profile().to_json())
    result = vitctl(*_plan_args(profile_path, out, budget))
    assert result.exit_code == 2 and "Traceback" not in result.output + result.stderr
    assert f"Invalid value for '--memory-gib': {said}; give the memory of one GPU in GiB" \
           in result.output + result.stderr
    assert not out.exists()


def test_cli_refuses_a_budget_in_mib_and_names_it_in_gib(tmp_path):
    """Before: 81559 (an 80 GB GPU in nvidia-smi's MiB) was planned as 81559 GiB, and the plan ran out of memory."""
    profile_path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile_path.write_text(hand_made_profile().to_json())
    result = vitctl(*_plan_args(profile_path, out, 81559))
    assert result.exit_code == 2 and "Traceback" not in result.output + result.stderr
    assert "'--memory-gib': 81559 GiB is more than any GPU holds (this takes 1024 at most); if that figure is MiB, " \
           "as nvidia-smi shows it, pass --memory-gib 79" in result.output + result.stderr
    assert not out.exists()
    ok(*_plan_args(profile_path, out, 79))
    assert out.exists()


@pytest.mark.parametrize("out", ["notes.txt/plan.json", "notes.txt/plans/plan.json"])
def test_cli_refuses_an_out_under_a_regular_file_before_searching(tmp_path, out):
    profile_path, blocker = tmp_path / "profile.json", tmp_path / "notes.txt"
    profile_path.write_text(hand_made_profile().to_json())
    blocker.write_text("mine")
    result = vitctl(*_plan_args(profile_path, tmp_path / out, 80))
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr
    assert result.stderr == f"error: cannot write {tmp_path / out}: {blocker} is a file, not a folder; choose " \
                            f"another --out\n"
    assert "searched plan" not in result.output and blocker.read_text() == "mine"
    ok(*_plan_args(profile_path, tmp_path / "plan.json", 80))


def test_cli_refuses_an_out_that_writing_would_replace_or_that_lies_in_a_checkpoint(tmp_path):
    """Before: /dev/null was to be moved away; a link was replaced by the plan, its target left as it was; a plan
    written into a checkpoint folder stopped keep-last-K from removing that checkpoint."""
    profile_path = tmp_path / "profile.json"
    profile_path.write_text(hand_made_profile().to_json())
    (tmp_path / "target.json").write_text("")
    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
    step = tmp_path / "run/checkpoints/step-00000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    (step / ".metadata").write_text("")
    for out, said in (("/dev/null", "--out /dev/null is not a regular file: writing would replace it, not write "
                                    "through it; choose another --out"),
                      (tmp_path / "link.json", f"--out {tmp_path / 'link.json'} is a symbolic link: writing would "
                                               "replace it, not write through it"),
                      (step / "plan.json", f"--out {step / 'plan.json'} lies in the checkpoint folder {step}, which "
                                           "holds what training wrote there alone")):
        result = vitctl(*_plan_args(profile_path, out, 80))
        assert result.exit_code == 1 and said in " ".join(result.stderr.split()), result.stderr
    assert (tmp_path / "link.json").is_symlink() and sorted(p.name for p in step.iterdir()) == [".metadata",
                                                                                                 "meta.json"]


def test_cli_says_which_folder_it_may_not_write(tmp_path, monkeypatch):
    """Tests run as root, whom chmod does not stop: the OS's refusal is injected where the plan is written."""
    profile_path, out = tmp_path / "profile.json", tmp_path / "plans" / "plan.json"
    profile_path.write_text(hand_made_profile().to_json())
    real_open = open

    def refusing(file, *args, **kwargs):
        if str(file).startswith(str(out.parent)):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr("builtins.open", refusing)
        result = vitctl(*_plan_args(profile_path, out, 80))
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr
    assert result.stderr == f"error: cannot write {out} (Permission denied); choose another --out\n"
    ok(*_plan_args(profile_path, out, 80))


def test_cli_refuses_an_out_folder_it_may_not_write_before_searching(tmp_path, monkeypatch):
    profile_path, out = tmp_path / "profile.json", tmp_path / "plans" / "plan.json"
    profile_path.write_text(hand_made_profile().to_json())
    def denied(*args, dir, **kwargs):  # as a user without write access meets it (root's access is never denied)
        raise PermissionError(errno.EACCES, "Permission denied", str(dir))

    with monkeypatch.context() as patch:
        patch.setattr("tempfile.TemporaryFile", denied)
        result = vitctl(*_plan_args(profile_path, out, 80))
    assert result.exit_code == 1 and "searched plan" not in result.output
    assert result.stderr == f"error: cannot write the plan {out}: this user may not write in {tmp_path} (give this " \
                            f"user write access to {tmp_path}); choose another --out\n"
    frozen = tmp_path / "frozen"  # was told to give root write access, which it has
    frozen.mkdir()
    if subprocess.run(["chattr", "+i", frozen], capture_output=True).returncode == 0:
        try:
            result = vitctl(*_plan_args(profile_path, frozen / "plan.json", 80))
        finally:
            subprocess.run(["chattr", "-i", frozen], check=True)
        assert f"{frozen} takes no new files: operation not permitted (an immutable folder, with an i in `lsattr -d " \
            f"{frozen}`, needs `chattr -i {frozen}`); choose another --out" in " ".join(result.stderr.split())


# A local dry run of vit_micro (4 blocks) on one rank: read_plan runs in preflight, before anything is launched
TRAIN_WITH_PLAN = ["train", "--config", "demo_vit", "--set", "data.source=synthetic", "--set", "data.train_samples=64",
                   "--batch", 4, "--executor", "local", "--gpus", 0, "--dry-run"]
BLOCKS = "is missing (a whole number of at least 1, e.g. \"blocks\": 4)"


@pytest.mark.parametrize(("path", "value", "problem"), [
    (["fsdp_rest"], "no", 'fsdp_rest holds "no", not true or false, e.g. "fsdp_rest": false'),
    (["stages"], "12", 'stages holds "12", not a list of whole numbers, e.g. "stages": [6, 6]'),
    (["stages"], [2, "2"], 'stages holds [2, "2"], not a list of whole numbers, e.g. "stages": [6, 6]'),
    (["tp"], "1", 'tp holds "1", not a whole number, e.g. "tp": 2'),
    (["pp"], 1.0, 'pp holds 1.0, not a whole number, e.g. "pp": 2'),
    (["microbatches"], True, 'microbatches holds true, not a whole number, e.g. "microbatches": 4'),
    (["dp_shard"], "-1", 'dp_shard holds "-1", not a whole number, e.g. "dp_shard": -1'),
    (["virtual_stages"], 1.5, 'virtual_stages holds 1.5, not a whole number, e.g. "virtual_stages": 1'),
    (["schedule"], 1, 'schedule holds 1, not a string, e.g. "schedule": "1f1b"'),
    (["model"], ["vit_micro"], 'model holds ["vit_micro"], not a string, e.g. "model": "vit_b16"'),
    (["tp"], None, 'tp is missing (a whole number, e.g. "tp": 2)'),
    (["groups"], {"blocks": 4}, 'groups holds {"blocks": 4}, not a list, e.g. "groups": [{"blocks": 4, "fsdp": true, '
                                '"checkpoint": "selective"}]'),
    (["groups", 1], 4, 'groups[1] holds 4, not an object (e.g. {"blocks": 4, "fsdp": true, "checkpoint": '
                       '"selective"})'),
    (["groups", 1, "fsdp"], "no", 'groups[1].fsdp (blocks 2-3) holds "no", not true or false, e.g. "fsdp": true'),
    (["groups", 0, "checkpoint"], 1, 'groups[0].checkpoint (blocks 0-1) holds 1, not a string, e.g. "checkpoint": '
                                     '"selective"'),
    (["groups", 0, "blocks"], 2.0, 'groups[0].blocks holds 2.0, not a whole number of at least 1, e.g. "blocks": 4'),
    (["groups", 1, "blocks"], None, f"groups[1].blocks {BLOCKS}"),
])
def test_a_hand_written_plan_with_a_value_of_the_wrong_type_is_refused(tmp_path, path, value, problem):
    """Values were converted loosely: "fsdp_rest": "no" became true, "stages": "12" the stages [1, 2]."""
    written = Strategy(blocks=(BlockStrategy(),) * 2 + (BlockStrategy(checkpoint="selective"),) * 2)
    plan = json.loads(written.to_json("vit_micro", 1))
    *parents, key = path
    holder = functools.reduce(lambda held, k: held[k], parents, plan)
    if value is None:
        del holder[key]
    else:
        holder[key] = value
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    result = vitctl(*TRAIN_WITH_PLAN, "--out", tmp_path / "run", "--plan", plan_file)
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr
    assert result.stderr == f"error: parallel.plan {plan_file}: {problem}; fix these, or write the plan again with " \
                            f"`vitctl plan`\n"
    plan_file.write_text(written.to_json("vit_micro", 1))  # the plan as `vitctl plan` writes it, which trains
    ok(*TRAIN_WITH_PLAN, "--out", tmp_path / "run", "--plan", plan_file)


def test_every_value_of_the_wrong_type_is_named_at_once(tmp_path):
    plan = json.loads(Strategy(blocks=(BlockStrategy(),) * 4).to_json("vit_micro", 1))
    plan["fsdp_rest"], plan["groups"][0]["fsdp"] = "no", "no"
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    result = vitctl(*TRAIN_WITH_PLAN, "--out", tmp_path / "run", "--plan", plan_file)
    assert result.exit_code == 1 and result.stderr == (
        f'error: parallel.plan {plan_file}: fsdp_rest holds "no", not true or false, e.g. "fsdp_rest": false; '
        f'groups[0].fsdp (blocks 0-3) holds "no", not true or false, e.g. "fsdp": true; fix these, or write the plan '
        f"again with `vitctl plan`\n")


def test_a_plan_records_its_image_size_and_batch_and_train_refuses_others_until_the_fix_is_followed(tmp_path):
    """A plan searched at 32 px and its batch was trained at any size and batch without a word: on the GPUs, an out
    of memory after the queue wait."""
    profile_path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    profile_path.write_text(hand_made_profile().to_json())
    printed = ok(*_plan_args(profile_path, out, 80)).output
    batch = int(re.search(r"--batch (\d+)", printed)[1])
    plan = json.loads(out.read_text())
    assert (plan["img_size"], plan["batch_size"]) == (32, batch)
    train = ["train", "--config", "demo_vit", "--model", "vit_mini", "--set", "data.source=synthetic", "--executor",
             "local", "--gpus", 0, "--tasks-per-node", plan["world_size"], "--plan", out, "--dry-run", "--out",
             tmp_path / "run"]
    result = vitctl(*train, "--batch", batch, "--set", "model.img_size=64")
    assert result.exit_code == 1 and result.stderr == (
        f"error: parallel.plan {out}: the plan was searched for 32 px images (its img_size), and this job trains at "
        f"64 px: its memory and time were predicted for 32; plan again at this size (vitctl plan --img-size 64 ...), "
        f"or train at --set model.img_size=32\n")
    result = vitctl(*train, "--batch", 2 * batch)
    assert result.exit_code == 1 and result.stderr == (
        f"error: parallel.plan {out}: the plan was searched for {batch} samples per data-parallel rank (its "
        f"batch_size), and this job has {2 * batch}: its memory and time were predicted for {batch}; plan again for "
        f"this batch (vitctl plan --batch GLOBAL ..., the samples of all data-parallel ranks together), or pass "
        f"--batch {batch}\n")
    ok(*train, "--batch", batch)  # both fixes followed: the plan's size (demo_vit's) and batch


@pytest.mark.parametrize(("model", "size", "said"), [
    ("vit_micro", 36, "model vit_micro: image size 36 is not a multiple of the patch size 8; the nearest that is: 32"),
    ("swin_micro", 32, "model swin_micro: image size 32 with window 7 gives feature maps [8, 4, 2, 1]; each must be a "
                       "multiple of the window; the nearest size that works with window 7 is 224 (the default window "
                       "at 32 px, 12 at multiples of 384; `vitctl train` takes another as --set model.window_size=W, "
                       "`vitctl plan` and `bench` only the default)")])
def test_cli_an_image_size_the_model_cannot_take_is_a_usage_error(tmp_path, model, size, said):
    """Before: exit 1 (bench: 2); for a Swin, no word that the window is the default one, which plan cannot change."""
    result = vitctl("plan", "--model", model, "--img-size", size, "--gpus", 2, "--memory-gib", 8, "--batch", 8,
                    "--out", tmp_path / "p.json")
    assert result.exit_code == 2 and f"Error: {said}" in " ".join(result.stderr.split()), result.stderr


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv (util-linux)")
def test_a_cached_profile_this_user_may_not_read_is_told_so_not_to_measure_it_again(tmp_path):
    """Before: `is not a profile this vitctl reads ([Errno 13] Permission denied ...); measure it again ... on a GPU
    node`, of this machine's (a CPU's) cached profile. (A --profile click finds unreadable is a usage error.)"""
    cached = tmp_path / "cache/vitctl/profiles" / profile_file("cpu", torch.__version__, "vit_mini", 32)
    cached.parent.mkdir(parents=True)
    cached.write_text(hand_made_profile().to_json())
    cached.chmod(0)
    args = [*AS_A_USER, *map(str, _plan_args(None, tmp_path / "plan.json", 80)[:-2])]  # no --profile: the cached
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1 and done.stderr == (
        f"error: profile {cached}: this user may not read it (permission denied); give this user read access to it "
        f"(`ls -l {cached}` shows owner and mode)\n"), done.stderr
    cached.chmod(0o644)  # the fix followed
    assert subprocess.run(args, capture_output=True, timeout=300, env=env).returncode == 0


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv (util-linux)")
def test_profile_only_into_a_cache_this_user_may_not_write_is_refused_before_measuring(tmp_path):
    """Before: the whole profile was measured (minutes on a GPU), then `cannot write ... (Permission denied)`."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o555)
    args = [*AS_A_USER, "plan", "--profile-only", "--model", "vit_micro", "--img-size", "32", "--gpus", "2"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache)})
    assert done.returncode == 1 and done.stderr.endswith(
        f"error: cannot write {cache / 'vitctl/profiles'}/{profile_file('cpu', torch.__version__, 'vit_micro', 32)}: "
        f"this user may not write in {cache} (give this user write access to {cache}); point XDG_CACHE_HOME at a "
        "folder this user can write, where profiles are cached\n"), done.stderr
    assert "profile:" not in done.stdout
