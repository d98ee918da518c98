"""Predicted step time and peak memory per GPU of a `Strategy`, from a `Profile`: pure functions of the measurements
and of how the runtime executes the strategy (bf16 autocast, AdamW, fp32 gradient reduction).

Per block and micro-batch: its measured forward and backward (recomputation included) for the chosen checkpoint
mode on one tensor-parallel rank's share, plus 4 all-reduces of its bf16 output within the tensor-parallel group
(6 when fully checkpointed, the forward runs twice). An FSDP block all-gathers its bf16 weights before the forward
and again before the backward and reduce-scatters its fp32 gradients beside its compute, which runs slower by the
measured overlap slowdown meanwhile; its compute, FSDP's own work around it and its memory are measured under FSDP2
on one rank in the same checkpoint mode (checkpointing and FSDP's hooks do not simply add up), and where the profile
has them, its host's times in chains of FSDP blocks sharded over several ranks, its optimizer step's included
(inside a step an FSDP block costs the host up to 1.6x what it costs timed alone on one rank). Replicated weights
are all-reduced in fp32 once per step after the backward. A pipeline of pp stages and m micro-batches keeps its
slowest stage's device busy for (m + pp - 1) micro-batches; interleaved, with v stages per rank, (m + (pp - 1) / v)
of its slowest rank's (the sum of its v stages'), the bubble (pp - 1) / (v m) of the step. A stage's host issues its
m micro-batches without waiting for its neighbours (a receive makes the stream wait, not the host), so where
launching is slower than the kernels it fills the bubble rather than adding to it.
"""

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..config import ConfigError
from ..parallel.strategy import INTERLEAVED, BlockStrategy, Strategy
from .profile import BlockShape, FsdpHost, LinkFit, Measured, ModelLayout, Profile, bus_factor

STATE_BYTES = 16  # per parameter held: fp32 weight, fp32 gradient, AdamW's fp32 exp_avg and exp_avg_sq
GRAD_BYTES = 4  # fp32 gradients are what is reduced
GATHERED_BYTES = 2  # an FSDP block's weights all-gathered in bf16 for compute
FSDP_BUFFER_BYTES = 2 * GATHERED_BYTES + 2 + GRAD_BYTES  # per parameter of the largest FSDP block: it and the
# prefetched next one gathered, its unsharded bf16 gradient and that gradient's fp32 copy being reduce-scattered
PIPELINE_FSDP_BYTES = GATHERED_BYTES + GRAD_BYTES  # torch.distributed.pipelining keeps an FSDP block unsharded and
# its gradient unreduced (fp32) from the first micro-batch's backward until the last's
RESIDUAL_BYTES = 4  # autocast keeps the residual stream, which crosses the pipeline stages, in fp32
TP_BYTES = 2  # the tensor-parallel all-reduces sum bf16 matmul outputs
# What a GPU keeps for the CUDA caching allocator (expandable segments) above the tensors' peak, without FSDP and with
# it (bytes): capped below its reserve, the allocator frees its cache and retries, synchronising the device, several
# times a step. Uncapped, Swin-H's and ViT-H's plans reserved up to 0.8 GiB above their tensors without FSDP and up to
# 2.3 GiB with it, on two H200s (torch 2.11; bench/bench_plan.py's room column, docs/performance.md).
ALLOCATOR_ROOM = (1.5 * 2**30, 2.5 * 2**30)


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus: int  # per node
    allocator_room: tuple[float, float] = (0.0, 0.0)  # bytes a GPU keeps for the allocator: replicated, with FSDP

    @property
    def world(self) -> int:
        return self.nodes * self.gpus

    def room(self, fsdp: bool) -> float:
        return self.allocator_room[fsdp]


@dataclass(frozen=True)
class Setting:
    """What a block's cost depends on besides its own choice: the degrees and the micro-batch."""

    cluster: Cluster
    tp: int
    pp: int
    microbatches: int
    microbatch: int  # samples per micro-batch
    dp_shard: int = -1  # ranks an FSDP block shards over (-1: all data-parallel ranks), replicated over the rest

    @property
    def dp(self) -> int:
        return self.cluster.world // (self.tp * self.pp)

    @property
    def dp_crosses_nodes(self) -> bool:  # a data-parallel group is dp ranks tp apart: dp * tp consecutive ranks
        return self.dp * self.tp > self.cluster.gpus

    @property
    def shard(self) -> int:
        return self.dp if self.dp_shard == -1 else self.dp_shard

    @property
    def shard_crosses_nodes(self) -> bool:  # the shard ranks are the innermost data-parallel ones
        return self.shard * self.tp > self.cluster.gpus

    @property
    def pipelined(self) -> bool:
        return self.pp > 1

    @property
    def accumulates(self) -> bool:
        """Gradients live across micro-batches: a pipeline's, or micro-batches run in turn without one."""
        return self.microbatches > 1


@dataclass(frozen=True)
class Cost:
    """One block's or part's share of its stage."""

    micro_s: float  # forward + backward of one micro-batch, with the communication that is not overlapped
    device_micro_s: float  # the same had the host launched everything ahead: the kernels' and transfers' time
    step_s: float  # once per step: its share of the gradient reduction, and its optimizer update
    state_bytes: float  # weights, gradients and optimizer state, held all step
    activation_bytes: float  # per micro-batch in flight
    transient_bytes: float  # above its activations while its backward runs
    gathered_params: int  # FSDP: parameters all-gathered for its compute; 0 when replicated
    replicated: bool  # its gradients join the stage's all-reduce after the backward
    grad_bytes: float = 0.0  # of state_bytes: its fp32 gradients where the backward allocates them and the step
    # frees them (FSDP's shards, a replicated block's on one data-parallel rank)


@dataclass(frozen=True)
class StagePrediction:
    blocks: range
    micro_s: float  # per micro-batch: forward, backward and the transfers to the neighbouring stages
    device_micro_s: float  # the same on the device alone (see Cost)
    step_s: float  # once per step: gradient reductions that do not overlap, optimizer
    peak_bytes: float


@dataclass(frozen=True)
class Prediction:
    step_s: float
    images_per_s: float
    peak_bytes: float  # of the fullest GPU's tensors
    stages: tuple[StagePrediction, ...]
    room_bytes: float = 0.0  # kept beside them for the allocator (Cluster.allocator_room)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / 2**30

    @property
    def needs_bytes(self) -> float:
        """The memory a GPU must have: the tensors' peak and the allocator's room."""
        return self.peak_bytes + self.room_bytes


def at_batch(batches: Sequence[int], values: Sequence[float], batch: float) -> float:
    """The least-squares line through the measurements at `batch` (through the origin from one batch), >= 0."""
    if len(set(batches)) == 1:
        return statistics.fmean(values) * batch / batches[0]
    mean_x, mean_y = statistics.fmean(batches), statistics.fmean(values)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(batches, values, strict=True)) / \
        sum((x - mean_x) ** 2 for x in batches)
    return max(0.0, mean_y + slope * (batch - mean_x))


def link(profile: Profile, op: str, ranks: int, crosses_nodes: bool) -> tuple[LinkFit, float]:
    """The measured fit for `op` among `ranks` ranks on one node or across nodes (the nearest group size measured
    there), and the overlap slowdown measured with it."""
    measured = [c for c in profile.collectives if (c.nodes > 1) == crosses_nodes]
    if not measured:
        where = "across nodes" if crosses_nodes else "among the GPUs of one node"
        args = f"--profile-only --model {profile.model} --img-size {profile.img_size}"
        how = ("on two nodes, each running `torchrun --nnodes 2 --nproc-per-node G --rdzv-backend c10d "
               f"--rdzv-endpoint HOST:29500 -m vitctl.cli plan {args}` (G: a node's GPUs; HOST: the first node), or "
               "plan for --nodes 1") if crosses_nodes else f"on a node with several GPUs: `vitctl plan {args}`"
        raise ConfigError(f"the {profile.device} profile of {profile.model} has no collectives measured {where}; "
                          f"measure them {how}")
    nearest = min(measured, key=lambda c: (abs(c.ranks - ranks), -c.ranks))
    return nearest.fits[op], nearest.overlap_slowdown


def collective_s(profile: Profile, op: str, ranks: int, crosses_nodes: bool, nbytes: float,
                 latency: bool = True) -> float:
    """Seconds of one collective on `nbytes` (the whole buffer); `latency=False`: the bandwidth term alone."""
    if ranks == 1 or nbytes == 0:
        return 0.0
    fit, _ = link(profile, op, ranks, crosses_nodes)
    return (fit.latency_s if latency else 0.0) + bus_factor(op, ranks) * nbytes / fit.bus_bytes_per_s


def overlapped(compute_s: float, comm_s: float, slowdown: float) -> float:
    """Compute and communication side by side: the longer of the two, the compute slowed while both run."""
    return max(compute_s, comm_s) + (slowdown - 1) * min(compute_s, comm_s)


def phase_seconds(measured: Measured, batch: int, host_bound: bool = True) -> tuple[float, float]:
    """Forward and backward seconds at `batch`: the device's or, when launching is slower (eager) and `host_bound`,
    the host's. The host launches the same kernels at any batch: its line is never taken below its least
    measurement (a noisy pair of measurements would otherwise extrapolate to almost no host time at a larger
    batch)."""
    fit = lambda values: at_batch(measured.batch, values, batch)  # noqa: E731
    host = lambda values: max(fit(values), min(values)) if host_bound else 0.0  # noqa: E731
    return (max(fit(measured.forward_s), host(measured.forward_host_s)),
            max(fit(measured.backward_s), host(measured.backward_host_s)))


def weights_cost(profile: Profile, setting: Setting, params: int, fsdp: bool, measured: Measured,
                 tp_s: float = 0.0) -> Cost:
    """The cost of a module of `params` (local) parameters, measured as `measured` (a block: as it is held,
    replicated or under FSDP), held replicated or by FSDP."""
    phases = phase_seconds(measured, setting.microbatch), phase_seconds(measured, setting.microbatch, False)
    retained = at_batch(measured.batch, measured.retained_bytes, setting.microbatch)
    transient = max(0.0, at_batch(measured.batch, measured.peak_bytes, setting.microbatch) - retained)
    dp, crosses = setting.dp, setting.dp_crosses_nodes
    if not fsdp:
        reduce = collective_s(profile, "all_reduce", dp, crosses, GRAD_BYTES * params, latency=False)
        micro, device = (forward + backward + tp_s for forward, backward in phases)
        # over several ranks the gradients are views of the all-reduce's buffer, held all step; alone, the backward
        # allocates them as it goes
        return Cost(micro, device, reduce + profile.optimizer_s_per_param * params, STATE_BYTES * params, retained,
                    transient, 0, True, 0.0 if dp > 1 else GRAD_BYTES * params)
    shard, inner = setting.shard, setting.shard_crosses_nodes
    gather = collective_s(profile, "all_gather", shard, inner, GATHERED_BYTES * params)
    # HSDP: each rank's reduced shard is then all-reduced over the replicas (across nodes when the shards are not)
    scatter = collective_s(profile, "reduce_scatter", shard, inner, GRAD_BYTES * params) + \
        collective_s(profile, "all_reduce", dp // shard, crosses, GRAD_BYTES * params / shard)
    slowdown = link(profile, "all_gather", shard, inner)[1] if shard > 1 else 1.0
    optimizer = profile.optimizer_s_per_param * params / shard
    if setting.accumulates:  # the reduce-scatter waits for the last micro-batch; until then the unreduced gradient
        # is held (fp32), and a pipeline keeps the gathered weights too (PIPELINE_FSDP_BYTES)
        held = PIPELINE_FSDP_BYTES if setting.pipelined else GRAD_BYTES
        micro, device = (overlapped(forward, gather, slowdown) + overlapped(backward, gather, slowdown) + tp_s
                         for forward, backward in phases)
        return Cost(micro, device, scatter + optimizer, (STATE_BYTES / shard + held) * params, retained, transient,
                    params, False)
    micro, device = (overlapped(forward, gather, slowdown) + overlapped(backward, gather + scatter, slowdown) + tp_s
                     for forward, backward in phases)
    return Cost(micro, device, optimizer, STATE_BYTES / shard * params, retained, transient, params, False,
                GRAD_BYTES / shard * params)


def block_cost(profile: Profile, setting: Setting, shape: BlockShape, choice: BlockStrategy) -> Cost:
    block = profile.block(shape.key, setting.tp, choice.checkpoint, choice.fsdp)
    measured = block.measured
    if choice.fsdp:
        measured = _without_gathered(measured, block.params)
        if host := profile.fsdp_host(shape.key, choice.checkpoint, setting.shard):
            measured = _with_host(measured, host, setting.microbatches)
    all_reduces = 6 if choice.checkpoint == "full" else 4  # 2 in the forward, 2 in the backward, 2 if rerun
    tp_s = all_reduces * collective_s(profile, "all_reduce", setting.tp, False,
                                      TP_BYTES * setting.microbatch * shape.tokens * shape.dim)
    return weights_cost(profile, setting, block.params, choice.fsdp, measured, tp_s)


def _with_host(measured: Measured, host: FsdpHost, microbatches: int) -> Measured:
    """An FSDP block's host times as measured in chains on several ranks, its optimizer step's spread over the
    micro-batches (launched after the last backward, it delays the step only where the host is the bound). The
    chains ran one rank's whole block: a tensor-parallel share launches as many kernels."""
    backward = host.backward_s + host.step_s / microbatches
    return replace(measured, forward_host_s=(host.forward_s,) * len(measured.batch),
                   backward_host_s=(backward,) * len(measured.batch))


def _without_gathered(measured: Measured, params: int) -> Measured:
    """An FSDP block's memory as on several ranks: measured on one, FSDP2 keeps the gathered bf16 weights after the
    forward; on more it frees them until the backward gathers them again (FSDP_BUFFER_BYTES counts the gathers)."""
    gathered = GATHERED_BYTES * params
    return replace(measured, retained_bytes=tuple(max(0, b - gathered) for b in measured.retained_bytes),
                   peak_bytes=tuple(max(0, b - gathered) for b in measured.peak_bytes))


def block_costs(profile: Profile, setting: Setting, layout: ModelLayout, blocks: range,
                choices: Sequence[BlockStrategy]) -> list[Cost]:
    """`block_cost` of each block in `blocks` (`choices` indexed as the model's blocks), once per distinct shape and
    choice."""
    memo: dict[tuple[str, BlockStrategy], Cost] = {}
    for i in blocks:
        if (key := (layout.blocks[i].key, choices[i])) not in memo:
            memo[key] = block_cost(profile, setting, layout.blocks[i], choices[i])
    return [memo[(layout.blocks[i].key, choices[i])] for i in blocks]


def part_cost(profile: Profile, setting: Setting, name: str, fsdp: bool) -> Cost:
    """Embedding, patch merging and head: replicated over the tensor-parallel ranks, measured whole."""
    part = profile.part(name)
    return weights_cost(profile, setting, part.params, fsdp, part.measured)


def in_flight(schedule: str, pp: int, microbatches: int, stage: int, virtual_stages: int = 1) -> float:
    """Micro-batches whose activations a stage holds at once: all under GPipe, pp - stage under 1F1B. Interleaved, a
    rank runs torch's warm-up forwards ((v - 1) rounds of micro-batches, and 2 for each later rank) and one more
    before its first backward, spread evenly over its v stages."""
    if schedule == "gpipe":
        return microbatches
    if schedule != INTERLEAVED:
        return min(pp - stage, microbatches)
    per_round = microbatches // max(1, microbatches // pp)
    forwards = (virtual_stages - 1) * per_round + 2 * (pp - 1 - stage % pp) + 1
    return min(forwards, microbatches * virtual_stages) / virtual_stages


def boundary_bytes(layout: ModelLayout, blocks: range, microbatch: int) -> float:
    """The larger activation a stage receives (the previous stage's last block's output) or sends (its own last
    block's) per micro-batch."""
    edges = ([layout.blocks[blocks.start - 1]] if blocks.start else []) + \
        ([layout.blocks[blocks.stop - 1]] if blocks.stop < len(layout.blocks) else [])
    return RESIDUAL_BYTES * microbatch * max(s.tokens * s.dim for s in edges)


def stage_parts(layout: ModelLayout, blocks: range, last: bool) -> list[str]:
    """The parts a stage runs: those before its blocks' (embed, Swin's patch merging), the head on the last."""
    return [p.name for p in layout.parts if p.before in blocks or (last and p.before == len(layout.blocks))]


def parts_before(layout: ModelLayout, blocks: range, last: bool) -> list[int]:
    """For each of `stage_parts`, the index among the stage's blocks of the block it precedes (the head: one past
    the last)."""
    before = {p.name: p.before - blocks.start for p in layout.parts}
    return [before[name] for name in stage_parts(layout, blocks, last)]


def stage_fixed(profile: Profile, layout: ModelLayout, setting: Setting, blocks: range, last: bool,
                fsdp_rest: bool) -> tuple[list[Cost], float, float]:
    """What a stage holds and spends besides its blocks: its parts' costs, the send/recv seconds per micro-batch,
    and the bytes of its transfer buffers."""
    parts = [part_cost(profile, setting, name, fsdp_rest) for name in stage_parts(layout, blocks, last)]
    if not setting.pipelined:
        return parts, 0.0, 0.0
    boundary = boundary_bytes(layout, blocks, setting.microbatch)
    send = collective_s(profile, "send_recv", 2, setting.cluster.nodes > 1, boundary)
    return parts, 2 * send, 2 * boundary  # forward: activation out; backward: its gradient back


def stage_prediction(profile: Profile, setting: Setting, blocks_cost: Sequence[Cost], parts: Sequence[Cost],
                     transfer_s: float, transfer_bytes: float, held: int, blocks: range,
                     before: Sequence[int]) -> StagePrediction:
    """A stage from its blocks' (in forward order) and parts' costs (each preceding the block `before` names),
    holding `held` micro-batches' activations at once."""
    costs = [*blocks_cost, *parts]
    latency = link(profile, "all_reduce", setting.dp, setting.dp_crosses_nodes)[0].latency_s \
        if setting.dp > 1 and any(c.replicated for c in costs) else 0.0  # one all-reduce for all replicated weights
    peak = held_bytes(blocks_cost, parts, before, held, setting.accumulates) + transfer_bytes
    transfers = lambda seconds: sum(seconds) + transfer_s  # noqa: E731
    return StagePrediction(blocks, transfers(c.micro_s for c in costs), transfers(c.device_micro_s for c in costs),
                           sum(c.step_s for c in costs) + latency, peak)


def held_bytes(blocks: Sequence[Cost], parts: Sequence[Cost], before: Sequence[int], held: int,
               accumulates: bool) -> float:
    """The most a stage holds at once besides the transfers. With one micro-batch per step the backward walks from
    the last block to the first, allocating each block's gradients as it frees its activations, so that the two never
    peak together; a part's activations (each preceding the block `before` names) are freed
    once the walk has passed it, and FSDP's buffers are those of the block whose backward runs and the one gathered
    ahead of it (Swin's peak is at its first block, after its patch mergings' backwards, far from its widest blocks).
    With more micro-batches, a micro-batch's activations live beside the gradients accumulated from the ones before,
    so it counts both whole, and the largest block's buffers."""
    every = [*blocks, *parts]
    state = sum(c.state_bytes for c in every)
    if accumulates or not blocks:
        return state + held * sum(c.activation_bytes for c in every) + max((c.transient_bytes for c in every),
                                                                           default=0.0) + _buffers(every)
    fixed = state - sum(c.grad_bytes for c in blocks)
    produced = list(itertools.accumulate(c.grad_bytes for c in reversed(blocks)))[::-1]  # of blocks i.. (backward)
    kept = list(itertools.accumulate(c.activation_bytes for c in blocks))  # of blocks ..i, not yet freed
    parts_kept = lambda i: sum(p.activation_bytes for p, b in zip(parts, before, strict=True) if b <= i)  # noqa: E731
    walk = max(produced[i] + held * (kept[i] + parts_kept(i)) + c.transient_bytes +
               _buffers([c, *blocks[max(0, i - 1):i], *parts]) for i, c in enumerate(blocks))
    first = held * (kept[-1] + parts_kept(len(blocks))) + max((c.transient_bytes for c in parts), default=0.0) + \
        _buffers([blocks[-1], *parts])  # the head's backward
    return fixed + max(walk, first)


def _buffers(running: Sequence[Cost]) -> float:
    """FSDP's gather and gradient buffers while `running` run: as for the largest of them (the parts, small, are
    counted at every point: the root holds them)."""
    return FSDP_BUFFER_BYTES * max((c.gathered_params for c in running), default=0)


def predict(strategy: Strategy, layout: ModelLayout, profile: Profile, cluster: Cluster,
            global_batch: int) -> Prediction:
    """Step time, images/s and the fullest GPU's memory of `strategy`. A pipeline rank runs its stages' micro-batches
    one after another and holds all their memory (their transients summed: an upper bound)."""
    dp = cluster.world // (strategy.tp * strategy.pp)
    setting = Setting(cluster, strategy.tp, strategy.pp, strategy.microbatches,
                      global_batch // dp // strategy.microbatches, strategy.dp_shard)
    stages, start = [], 0
    for stage, count in enumerate(strategy.stage_blocks(len(layout.blocks))):
        blocks = range(start, start + count)
        last = stage == strategy.n_stages - 1
        parts, transfer_s, transfer_bytes = stage_fixed(profile, layout, setting, blocks, last, strategy.fsdp_rest)
        costs = block_costs(profile, setting, layout, blocks, strategy.blocks)
        held = in_flight(strategy.schedule, strategy.pp, strategy.microbatches, stage, strategy.virtual_stages)
        stages.append(stage_prediction(profile, setting, costs, parts, transfer_s, transfer_bytes, held, blocks,
                                       parts_before(layout, blocks, last)))
        start += count
    ranks = [stages[rank::strategy.pp] for rank in range(strategy.pp)]
    micro_s = max(sum(s.micro_s for s in own) for own in ranks)
    device_micro_s = max(sum(s.device_micro_s for s in own) for own in ranks)
    bubble = (strategy.pp - 1) / strategy.virtual_stages  # in micro-batches of the slowest rank
    busy = max(strategy.microbatches * micro_s, (strategy.microbatches + bubble) * device_micro_s)
    step = busy + max(sum(s.step_s for s in own) for own in ranks)
    return Prediction(step, global_batch / step, max(sum(s.peak_bytes for s in own) for own in ranks), tuple(stages),
                      cluster.room(strategy.fsdp))
