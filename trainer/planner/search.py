"""Galvatron's search: for each tensor-parallel degree, pipeline degree and schedule (1F1B, or interleaved 1F1B with
two stages per rank), micro-batch count and division of the blocks into stages, dynamic programming over each
pipeline rank's blocks picks per block {FSDP or replicated} x {checkpoint none, selective, full} for the least time
whose memory fits the budget; the fastest of these is the plan."""

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..parallel.strategy import CHECKPOINT, INTERLEAVED, BlockStrategy, Strategy, strategy_problems
from .cost import (
    FSDP_BUFFER_BYTES,
    Cluster,
    Cost,
    Prediction,
    Setting,
    block_costs,
    in_flight,
    part_cost,
    predict,
    stage_fixed,
)
from .profile import ModelLayout, Profile

MEMORY_STEPS = 4096  # the budget's resolution in the dynamic programme; each block's memory is rounded up to it
CHOICES = tuple(BlockStrategy(fsdp, mode) for fsdp in (False, True) for mode in CHECKPOINT)
SCHEDULE = "1f1b"  # holds fewer micro-batches than GPipe for the same bubble
# Pipelines searched: (schedule, stages per rank). Interleaving with two stages per rank halves the bubble for twice
# the transfers; more stages per rank add transfers for less and less bubble.
PIPELINES = ((SCHEDULE, 1), (INTERLEAVED, 2))
# The dynamic programme adds up every block's activations and FSDP gradients and reserves the largest transient up
# front, which a backward without a pipeline never holds together (cost.held_bytes): it runs again over these
# multiples of the budget, each plan kept only where its predicted peak and room fit the budget itself. 5% apart to 1.2:
# 15% apart, Swin-H at 24 GiB was planned with 21.2 GiB of tensors where 23.6 fitted (before the room was kept).
SLACK = (1.0, 1.05, 1.1, 1.15, 1.2, 1.3, 1.5)


@dataclass(frozen=True)
class Pipeline:
    schedule: str
    virtual_stages: int

    @property
    def bubble(self) -> float:
        """Factor of (pp - 1) micro-batches of the slowest rank that the schedule idles for."""
        return 1 / self.virtual_stages


@dataclass(frozen=True)
class Option:
    seconds: float
    units: int  # of memory


@dataclass(frozen=True)
class Planned:
    name: str
    strategy: Strategy
    prediction: Prediction | None  # None when the strategy cannot run this job (`problem` says why)
    fits: bool
    problem: str = ""


@dataclass(frozen=True)
class SearchResult:
    best: Planned | None  # None: no strategy fits the budget
    uniform: tuple[Planned, ...]  # DDP, FSDP, FSDP + full checkpointing, HSDP, TP + FSDP, PP
    least: Planned | None  # of the candidates at every budget, the one needing the least memory: it fits at its needs


def cheapest_under(options: Sequence[Sequence[Option]], units: int) -> tuple[float, tuple[int, ...]] | None:
    """One option per block with the least total seconds whose units sum to at most `units`, and the index chosen
    for each block; None when none fits. Dynamic programming over the blocks, the memory axis vectorised."""
    if units < 0:
        return None
    best, picks = np.zeros(units + 1), []  # best[u]: least seconds of the blocks so far within u units
    for block in options:
        candidates = np.full((len(block), units + 1), np.inf)
        for j, option in enumerate(block):
            if option.units <= units:
                candidates[j, option.units:] = best[:units + 1 - option.units] + option.seconds
        pick = candidates.argmin(axis=0)
        best = candidates[pick, np.arange(units + 1)]
        picks.append(pick)
    if not np.isfinite(best[units]):
        return None
    chosen, u = [], units
    for block, pick in zip(reversed(options), reversed(picks), strict=True):
        chosen.append(int(pick[u]))
        u -= block[chosen[-1]].units
    return float(best[units]), tuple(reversed(chosen))


def search(layout: ModelLayout, profile: Profile, cluster: Cluster, global_batch: int,
           budget_bytes: float) -> SearchResult:
    """The fastest strategy whose predicted peak memory per GPU, with the allocator's room, is within
    `budget_bytes`, the uniform strategies' predictions, and the least memory any searched layout needs (fully
    checkpointed; searched at any budget, so a budget of that memory finds a plan)."""
    stage_cache: dict[tuple, list[tuple[BlockStrategy, ...] | None]] = {}
    budgets = tuple(budget_bytes * slack for slack in SLACK)
    best = least = None
    for setting, pipeline, stages in configurations(layout, profile, cluster, global_batch):
        base = Strategy(tp=setting.tp, pp=setting.pp, dp_shard=setting.dp_shard, microbatches=setting.microbatches,
                        schedule=pipeline.schedule, virtual_stages=pipeline.virtual_stages,
                        stages=stages if setting.pipelined else ())
        for fsdp_rest in (False, True) if setting.dp > 1 else (False,):
            plans = _plan_ranks(layout, profile, setting, pipeline, stages, fsdp_rest, budgets, stage_cache)
            for blocks in dict.fromkeys(plans):  # budgets that lead to the same plan: predicted once
                if blocks is None or (fsdp_rest and not any(b.fsdp for b in blocks)):  # no FSDP for the rest alone
                    continue
                best = _faster(best, _evaluate("searched", replace(base, blocks=blocks, fsdp_rest=fsdp_rest), layout,
                                               profile, cluster, global_batch, budget_bytes))
        # every block fully checkpointed, sharded or not (FSDP's allocator room can outweigh what it saves): a
        # candidate at every budget, as the dynamic programme rounds each block's memory up to a step of the budget
        # and misses it where it fits by less than that (Swin-H on 2 GPUs: 10.535 GiB, found from 10.6 GiB only)
        for sharded in {False, setting.dp > 1}:
            smallest = replace(base, blocks=(BlockStrategy(sharded, "full"),) * len(layout.blocks), fsdp_rest=sharded)
            planned = _evaluate("searched", smallest, layout, profile, cluster, global_batch, budget_bytes)
            best, least = _faster(best, planned), _less(least, planned)
    return SearchResult(best, uniform(layout, profile, cluster, global_batch, budget_bytes), least)


def _faster(best: Planned | None, planned: Planned) -> Planned | None:
    """`planned` where it fits the budget and beats `best` (None: nothing fits yet), else `best`."""
    return planned if planned.fits and (best is None or planned.prediction.step_s < best.prediction.step_s) else best


def _less(least: Planned | None, planned: Planned) -> Planned:
    """Of two runnable strategies, the one that needs less memory a GPU (the allocator's room included)."""
    return planned if least is None or planned.prediction.needs_bytes < least.prediction.needs_bytes else least


def configurations(layout: ModelLayout, profile: Profile, cluster: Cluster,
                   global_batch: int) -> Iterator[tuple[Setting, Pipeline, tuple[int, ...]]]:
    """Every (tp, pp, micro-batches) and pipeline schedule the job allows, with each candidate division of the blocks
    into stages."""
    for tp in tp_degrees(layout, profile, cluster):
        for pp in (p for p in _divisors(cluster.world // tp) if p <= len(layout.blocks)):
            dp = cluster.world // (tp * pp)
            if global_batch % dp:
                continue
            counts = microbatch_counts(pp, global_batch // dp)
            for m, shard in itertools.product(counts, shard_degrees(cluster, tp, dp)):
                setting = Setting(cluster, tp, pp, m, global_batch // dp // m, shard)
                for pipeline in pipelines(pp, len(layout.blocks)):
                    for stages in divisions(layout, profile, setting, pipeline):
                        yield setting, pipeline, stages


def shard_degrees(cluster: Cluster, tp: int, dp: int) -> list[int]:
    """FSDP over every data-parallel rank (-1), and, where those span nodes, HSDP: shards within a node (its GPUs
    over tp), replicated across nodes."""
    node = cluster.gpus // tp
    return [-1] + ([node] if dp * tp > cluster.gpus and node > 1 and dp % node == 0 else [])


def pipelines(pp: int, n_blocks: int) -> list[Pipeline]:
    """The schedules a pipeline of pp ranks can run over n_blocks blocks (one pipeline, of one stage, without)."""
    if pp == 1:
        return [Pipeline(SCHEDULE, 1)]
    return [Pipeline(schedule, v) for schedule, v in PIPELINES if pp * v <= n_blocks]


def tp_degrees(layout: ModelLayout, profile: Profile, cluster: Cluster) -> list[int]:
    """Tensor-parallel degrees within a node that divide every block's heads and MLP and were profiled."""
    shape = layout.shape()
    return [t for t in _divisors(cluster.gpus) if not any(h % t for h in shape.heads + shape.hidden)
            and profile.has_tp(layout, t)]


def microbatch_counts(pp: int, per_rank_batch: int) -> list[int]:
    """pp, 2pp, 4pp and 8pp micro-batches (without a pipeline 1, 2, 4 and 8, run in turn with their gradients
    accumulated), those that divide the rank's batch."""
    return [m for m in (pp << i for i in range(4)) if per_rank_batch % m == 0]


def divisions(layout: ModelLayout, profile: Profile, setting: Setting, pipeline: Pipeline) -> list[tuple[int, ...]]:
    """Blocks per stage: as even as possible, balanced by time, and balanced by the least memory each can take
    (which weighs the first stages' extra micro-batches in flight)."""
    n, pp, v = len(layout.blocks), setting.pp, pipeline.virtual_stages
    if pp == 1:
        return [(n,)]
    quick = _with_parts(layout, profile, setting, BlockStrategy())
    small = _with_parts(layout, profile, setting, BlockStrategy(setting.dp > 1, "full"))
    time = _prefix([c.micro_s for c in quick])
    state, activation = _prefix([c.state_bytes for c in small]), _prefix([c.activation_bytes for c in small])
    held = [in_flight(pipeline.schedule, pp, setting.microbatches, s, v) for s in range(pp * v)]
    memory = lambda s, a, b: state[b] - state[a] + held[s] * (activation[b] - activation[a])  # noqa: E731
    candidates = [Strategy(pp=pp, virtual_stages=v).stage_blocks(n),
                  min_max_division(n, pp * v, lambda s, a, b: time[b] - time[a]), min_max_division(n, pp * v, memory)]
    return list(dict.fromkeys(candidates))


def min_max_division(n_blocks: int, stages: int, cost: Callable[[int, int, int], float]) -> tuple[int, ...]:
    """Blocks per stage, each stage at least one, minimising the largest `cost(stage, first block, end)`."""
    best: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {(0, 0): (0.0, ())}
    for s in range(stages):
        for end in range(s + 1, n_blocks - (stages - s - 1) + 1):
            best[(s + 1, end)] = min((max(best[(s, start)][0], cost(s, start, end)), best[(s, start)][1] +
                                      (end - start,)) for start in range(s, end) if (s, start) in best)
    return best[(stages, n_blocks)][1]


def _prefix(values: Sequence[float]) -> list[float]:
    return [0.0, *np.cumsum(values).tolist()]


def _with_parts(layout: ModelLayout, profile: Profile, setting: Setting, choice: BlockStrategy) -> list[Cost]:
    """Each block's cost under `choice`, with those of the parts that run just before it (after it, for the last
    block's head)."""
    n = len(layout.blocks)
    parts = {p.name: part_cost(profile, setting, p.name, choice.fsdp) for p in layout.parts}
    costs = []
    for i, own in enumerate(block_costs(profile, setting, layout, range(n), (choice,) * n)):
        near = [parts[p.name] for p in layout.parts if p.before == i or (p.before == n and i == n - 1)]
        costs.append(replace(own, micro_s=own.micro_s + sum(p.micro_s for p in near),
                             device_micro_s=own.device_micro_s + sum(p.device_micro_s for p in near),
                             state_bytes=own.state_bytes + sum(p.state_bytes for p in near),
                             activation_bytes=own.activation_bytes + sum(p.activation_bytes for p in near)))
    return costs


def _plan_ranks(layout: ModelLayout, profile: Profile, setting: Setting, pipeline: Pipeline, stages: tuple[int, ...],
                fsdp_rest: bool, budgets: tuple[float, ...], cache: dict) -> list[tuple[BlockStrategy, ...] | None]:
    """Per budget, each pipeline rank's plan (rank r runs stages r, r + pp, ...) put together, the blocks' choices
    in block order; None where some rank has none."""
    starts = [0, *itertools.accumulate(stages)]
    ranges = [range(starts[s], starts[s + 1]) for s in range(len(stages))]
    plans: list[dict[int, BlockStrategy] | None] = [{} for _ in budgets]
    for rank in range(setting.pp):
        own = tuple((s, ranges[s]) for s in range(rank, len(stages), setting.pp))
        key = (setting, pipeline, own, fsdp_rest, budgets)
        if key not in cache:
            cache[key] = plan_rank(layout, profile, setting, pipeline, own, fsdp_rest, budgets)
        for i, found in enumerate(cache[key]):
            if found is None or plans[i] is None:
                plans[i] = None
            else:
                plans[i].update(zip((b for _, blocks in own for b in blocks), found, strict=True))
    return [None if p is None else tuple(p[b] for b in range(len(layout.blocks))) for p in plans]


def plan_rank(layout: ModelLayout, profile: Profile, setting: Setting, pipeline: Pipeline,
              stages: Sequence[tuple[int, range]], fsdp_rest: bool,
              budgets: Sequence[float]) -> list[tuple[BlockStrategy, ...] | None]:
    """Per budget (bytes), the fastest choice per block of one pipeline rank's stages (stage index, its blocks)
    within it, or None. Their blocks' weighted time, (m + bubble) per micro-batch plus once per step, is minimised;
    the memory outside the per-block sums (each stage's largest transient and FSDP's gather buffers, summed over the
    rank's stages as predict sums them) is reserved up front at its largest, so the plan never exceeds the budget.
    The blocks' costs are computed once for all the budgets."""
    n_stages, v = setting.pp * pipeline.virtual_stages, pipeline.virtual_stages
    per_stage = []  # (held, parts, table: per block, per choice) of each stage
    fixed = 0.0
    for stage, blocks in stages:
        parts, _, transfer_bytes = stage_fixed(profile, layout, setting, blocks, stage == n_stages - 1, fsdp_rest)
        held = in_flight(pipeline.schedule, setting.pp, setting.microbatches, stage, v)
        every = [block_costs(profile, setting, layout, blocks, (choice,) * len(layout.blocks)) for choice in CHOICES]
        table = [list(row) for row in zip(*every, strict=True)]
        transient = max(c.transient_bytes for c in [*parts, *(c for row in table for c in row)])
        fixed += sum(c.state_bytes + held * c.activation_bytes for c in parts) + transient + transfer_bytes
        per_stage.append((held, parts, table))
    weight = setting.microbatches + (setting.pp - 1) * pipeline.bubble
    room = setting.cluster.room
    return [_cheapest_choices(per_stage, fixed, weight, budget, setting.dp > 1,
                              lambda allow_fsdp: room(allow_fsdp or fsdp_rest)) for budget in budgets]


def _cheapest_choices(per_stage: list, fixed: float, weight: float, budget: float, sharded: bool,
                      room: Callable[[bool], float]) -> tuple[BlockStrategy, ...] | None:
    """plan_rank's dynamic programme under one budget: with replicated weights only, and (`sharded`) with FSDP too,
    whose gather buffers are then reserved; each beside the allocator's room (`room(allow_fsdp)`)."""
    unit = budget / MEMORY_STEPS
    best: tuple[float, tuple[BlockStrategy, ...]] | None = None
    for allow_fsdp in (False, True) if sharded else (False,):
        allowed = [j for j, choice in enumerate(CHOICES) if allow_fsdp or not choice.fsdp]
        buffers = sum(FSDP_BUFFER_BYTES * max(c.gathered_params for c in [*parts, *(row[j] for row in table
                                                                                      for j in allowed)])
                      for _, parts, table in per_stage)
        options = [[Option(weight * row[j].micro_s + row[j].step_s,
                           math.ceil((row[j].state_bytes + held * row[j].activation_bytes) / unit)) for j in allowed]
                   for held, _, table in per_stage for row in table]
        found = cheapest_under(options, math.floor((budget - fixed - buffers - room(allow_fsdp)) / unit))
        if found is not None and (best is None or found[0] < best[0]):
            best = found[0], tuple(CHOICES[allowed[j]] for j in found[1])
    return None if best is None else best[1]


def uniform(layout: ModelLayout, profile: Profile, cluster: Cluster, global_batch: int,
            budget: float) -> tuple[Planned, ...]:
    """The one-setting-for-all strategies, predicted: DDP, FSDP, FSDP + full checkpointing, HSDP (on several nodes:
    shards within a node), TP + FSDP at each degree within a node, and a pipeline of each degree within a node (data
    parallel over the rest, at the micro-batch count that does best)."""
    every = lambda fsdp, checkpoint: (BlockStrategy(fsdp, checkpoint),) * len(layout.blocks)  # noqa: E731
    rows = [("DDP", Strategy(blocks=every(False, "none"))),
            ("FSDP", Strategy(blocks=every(True, "none"), fsdp_rest=True)),
            ("FSDP + full checkpointing", Strategy(blocks=every(True, "full"), fsdp_rest=True))]
    if (hsdp := shard_degrees(cluster, 1, cluster.world)[-1]) != -1:
        rows.append(("HSDP", Strategy(dp_shard=hsdp, blocks=every(True, "none"), fsdp_rest=True)))
    rows += [(f"TP{tp} + FSDP", Strategy(tp=tp, blocks=every(True, "none"), fsdp_rest=True))
             for tp in tp_degrees(layout, profile, cluster) if tp > 1]
    planned = [_evaluate(name, s, layout, profile, cluster, global_batch, budget) for name, s in rows]
    for pp in (p for p in _divisors(cluster.gpus) if 1 < p <= len(layout.blocks)):
        per_rank = global_batch // (cluster.world // pp)
        pipelines = [Strategy(pp=pp, microbatches=m, schedule=SCHEDULE, blocks=every(False, "none"))
                     for m in microbatch_counts(pp, per_rank) or [pp]]
        planned.append(min((_evaluate(f"PP{pp}", s, layout, profile, cluster, global_batch, budget)
                            for s in pipelines), key=_rank))
    return tuple(planned)


def _rank(p: Planned) -> tuple:
    """Runnable before not, fitting before not, then the faster."""
    return (p.prediction is None, not p.fits, p.prediction.step_s if p.prediction else 0.0)


def _evaluate(name: str, strategy: Strategy, layout: ModelLayout, profile: Profile, cluster: Cluster,
              global_batch: int, budget: float) -> Planned:
    dp = cluster.world // (strategy.tp * strategy.pp)
    if global_batch % dp:
        return Planned(name, strategy, None, False, f"the batch {global_batch} does not divide over {dp} data-parallel "
                                                    f"ranks")
    if problems := strategy_problems(strategy, layout.shape(), cluster.world, global_batch // dp):
        return Planned(name, strategy, None, False, problems[0])
    prediction = predict(strategy, layout, profile, cluster, global_batch)
    return Planned(name, strategy, prediction, prediction.needs_bytes <= budget)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
