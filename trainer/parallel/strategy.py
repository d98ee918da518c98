"""A parallel strategy: the mesh degrees, the pipeline's division, and for each block how its weights are held and
whether its activations are recomputed. Given as one global strategy (`parallel.*`) or a JSON plan (`--plan`,
written by `vitctl plan`); both become a `Strategy`, checked against the job and the model before launch."""

import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..config import CHECKPOINT, INTERLEAVED, SCHEDULES, ConfigError, ParallelConfig, as_set_value
from ..models import ModelShape

PLAN_VERSION = 1


@dataclass(frozen=True)
class BlockStrategy:
    fsdp: bool = False  # shard this block's weights over the data-parallel shard ranks, else replicate them
    checkpoint: str = "none"  # recompute activations in the backward: none | selective | full


@dataclass(frozen=True)
class Strategy:
    tp: int = 1  # tensor-parallel degree (heads and MLP hidden units split), inside a node
    pp: int = 1  # ranks of a pipeline, each running virtual_stages of its stages
    dp_shard: int = -1  # ranks an FSDP block's weights are sharded over (-1: every data-parallel rank)
    microbatches: int = 1  # per step and pipeline (without one: gradients accumulated), each a slice of the batch
    schedule: str = "1f1b"
    virtual_stages: int = 1  # stages per pipeline rank (interleaved_1f1b): rank r runs stages r, r + pp, r + 2pp...
    stages: tuple[int, ...] = ()  # blocks per stage, n_stages entries; () = as even as possible
    blocks: tuple[BlockStrategy, ...] = ()  # one per block, in the model's order
    fsdp_rest: bool = False  # shard the weights outside the blocks (embeddings, final norm, head) too
    # what a plan file was searched for (its predictions hold for those alone): ranks, image size, samples per
    # data-parallel rank; None: any
    world_size: int | None = field(default=None, compare=False)
    img_size: int | None = field(default=None, compare=False)
    batch_size: int | None = field(default=None, compare=False)

    @property
    def fsdp(self) -> bool:
        return self.fsdp_rest or any(b.fsdp for b in self.blocks)

    @property
    def n_stages(self) -> int:
        """Pipeline stages in all, over the pp ranks."""
        return self.pp * self.virtual_stages

    def layout(self, world_size: int) -> str:
        """Short form for tables and `vitctl status`, e.g. `pp2·tp2·fsdp4` (`pp2v2`: 2 stages per pipeline rank;
        `dp2·fsdp8`: HSDP, shards of 8 ranks replicated twice; `fsdp4 on 7/12 blocks`: a plan's mix)."""
        dp = world_size // (self.tp * self.pp)
        pipeline = f"pp{self.pp}" + (f"v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        shard = (dp if self.dp_shard == -1 else self.dp_shard) if self.fsdp else 1
        parts = [pipeline if self.pp > 1 else "", f"tp{self.tp}" if self.tp > 1 else "",
                 f"dp{dp // shard}" if dp // shard > 1 else "", f"fsdp{shard}" if self.fsdp and shard > 1 else ""]
        sharded = sum(b.fsdp for b in self.blocks)
        mixed = shard > 1 and sharded < len(self.blocks)
        return "·".join(p for p in parts if p) + (f" on {sharded}/{len(self.blocks)} blocks" if mixed else "") \
            or "1 rank"

    def stage_blocks(self, n_blocks: int) -> tuple[int, ...]:
        """Blocks per stage: the given division, or an even one (earlier stages one more)."""
        if self.stages:
            return self.stages
        n = self.n_stages
        return tuple(n_blocks // n + (i < n_blocks % n) for i in range(n))

    def to_json(self, model: str, world_size: int, predicted: dict[str, Any] | None = None,
                img_size: int | None = None, batch_size: int | None = None) -> str:
        """The plan file: degrees, pipeline, and runs of consecutive blocks with the same strategy; what it was
        searched for (the ranks; the image size and samples per data-parallel rank, where given)."""
        groups: list[dict[str, Any]] = []
        for block in self.blocks:
            if groups and groups[-1]["fsdp"] == block.fsdp and groups[-1]["checkpoint"] == block.checkpoint:
                groups[-1]["blocks"] += 1
            else:
                groups.append({"blocks": 1, **asdict(block)})
        searched = {"img_size": img_size, "batch_size": batch_size}
        plan = {"version": PLAN_VERSION, "model": model, "world_size": world_size,
                **{key: value for key, value in searched.items() if value is not None}, "tp": self.tp, "pp": self.pp,
                "dp_shard": self.dp_shard, "microbatches": self.microbatches, "schedule": self.schedule,
                "virtual_stages": self.virtual_stages, "stages": list(self.stages), "fsdp_rest": self.fsdp_rest,
                "groups": groups}
        if predicted:
            plan["predicted"] = predicted
        return json.dumps(plan, indent=2) + "\n"


def strategy_from_config(config: ParallelConfig, n_blocks: int, model: str | None = None) -> Strategy:
    """The global strategy of `parallel.*`, or the plan file it names (for `model`, when given)."""
    if config.plan:
        return read_plan(Path(config.plan), config, n_blocks, model)
    block = BlockStrategy(fsdp=config.fsdp, checkpoint=config.checkpoint)
    return Strategy(tp=config.tp, pp=config.pp, dp_shard=config.dp_shard, microbatches=config.microbatches,
                    schedule=config.schedule, virtual_stages=config.virtual_stages, stages=tuple(config.stages),
                    blocks=(block,) * n_blocks, fsdp_rest=config.fsdp)


def is_plan(path: Path) -> bool:
    """Whether `path` holds a plan (of any version): what `vitctl plan --out` may write over."""
    try:
        plan = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return False
    return isinstance(plan, dict) and {"version", "groups"} <= set(plan)


def read_plan(path: Path, config: ParallelConfig, n_blocks: int, model: str | None = None) -> Strategy:
    """The plan file's strategy; ConfigError if it is not a plan, or one for another model than `model`."""
    where = f"parallel.plan {path}"
    defaults = ParallelConfig()
    given = [key for key in ("tp", "pp", "fsdp", "dp_shard", "checkpoint", "microbatches", "schedule",
                             "virtual_stages", "stages")
             if getattr(config, key) != getattr(defaults, key)]
    if given:
        defaults_back = " ".join(f"--set parallel.{key}={as_set_value(getattr(defaults, key))}" for key in given)
        raise ConfigError(f"{where} sets the strategy, so parallel.{', parallel.'.join(given)} cannot be given "
                          f"beside it (from --set, or from the preset); drop them, or give them their defaults "
                          f"({defaults_back}), or drop the plan")
    try:
        plan = json.loads(path.read_text(encoding="utf-8-sig"), object_pairs_hook=_refuse_repeated_keys)
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist; write one with `vitctl plan ... --out {shlex.quote(str(path))}`"
                          ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where} cannot be read as JSON ({e}); write it again with `vitctl plan`") from None
    if not isinstance(plan, dict) or type(plan.get("version")) is not int or plan["version"] != PLAN_VERSION:
        raise ConfigError(f"{where} is not a version-{PLAN_VERSION} plan; write it again with `vitctl plan`")
    if problems := _unknown_plan_keys(plan) + _plan_problems(plan):
        raise ConfigError(f"{where}: {'; '.join(problems)}; fix these, or write the plan again with `vitctl plan`")
    blocks = tuple(BlockStrategy(fsdp=g["fsdp"], checkpoint=g["checkpoint"])
                   for g in plan["groups"] for _ in range(g["blocks"]))
    strategy = Strategy(tp=plan["tp"], pp=plan["pp"], dp_shard=plan.get("dp_shard", -1),
                        microbatches=plan["microbatches"], schedule=plan["schedule"],
                        virtual_stages=plan.get("virtual_stages", 1), stages=tuple(plan.get("stages", ())),
                        blocks=blocks, fsdp_rest=plan.get("fsdp_rest", False), world_size=plan.get("world_size"),
                        img_size=plan.get("img_size"), batch_size=plan.get("batch_size"))
    if len(blocks) != n_blocks:
        raise ConfigError(_block_count_error(where, len(blocks), n_blocks, plan.get("model"), model, path))
    if model and plan.get("model", model) != model:  # same depth, other widths: its memory and times are not ours
        own = _plan_of(path, model)
        raise ConfigError(f"{where} was planned for {plan['model']!r}, not for model {model}; plan this model "
                          f"(vitctl plan --model {model} ... --out {own}, then --plan {own}), or train {plan['model']} "
                          "with it")
    return strategy


def _block_count_error(where: str, planned: int, n_blocks: int, planned_for: str | None, model: str | None,
                       path: Path) -> str:
    replan = f"vitctl plan --model {model or 'MODEL'} ... --out {shlex.quote(str(path))}"
    if planned_for and planned_for != model:
        own = _plan_of(path, model or "MODEL")
        return (f"{where} gives strategies for {planned} blocks but model has {n_blocks}; it was planned for "
                f"{planned_for!r}: train {planned_for} with it (--model {planned_for}), or plan this model "
                f"(vitctl plan --model {model or 'MODEL'} ... --out {own}, then --plan {own})")
    return (f"{where} gives strategies for {planned} blocks (the \"blocks\" of its groups add up to {planned}) but "
            f"{f'model {model}' if model else 'the model'} has {n_blocks}; make them add up to {n_blocks}, or write "
            f"the plan again with `{replan}`")


def _plan_of(path: Path, model: str) -> str:
    """Where a plan for `model` may go beside another model's plan `path`, which it should not overwrite."""
    return shlex.quote(str(path.with_name(f"{path.stem}-{model}{path.suffix}")))


def _refuse_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads keeps the last of a repeated key unseen: a hand-edited plan's other value would be lost."""
    keys = [key for key, _ in pairs]
    if repeated := sorted({key for key in keys if keys.count(key) > 1}):
        raise ValueError(f"key {', '.join(map(json.dumps, repeated))} appears more than once in one object")
    return dict(pairs)


# A plan's values are taken only of their JSON type (bool("no") is True, int(2.5) is 2, a string "12" a list of digits)
_PLAN_KINDS = {
    "whole": lambda v: type(v) is int,  # bool is not int here
    "count": lambda v: type(v) is int and v >= 1,
    "bool": lambda v: type(v) is bool,
    "string": lambda v: type(v) is str,
    "wholes": lambda v: type(v) is list and all(type(x) is int for x in v),
    "list": lambda v: type(v) is list,
}
_KIND_NAMES = {"whole": "a whole number", "count": "a whole number of at least 1", "bool": "true or false",
               "string": "a string", "wholes": "a list of whole numbers", "list": "a list"}
_GROUP_EXAMPLE = '{"blocks": 4, "fsdp": true, "checkpoint": "selective"}'
# key: (kind, an example value, whether the key may be left out)
_PLAN_KEYS = {"model": ("string", '"vit_b16"', True), "world_size": ("whole", "8", True),
              "img_size": ("whole", "224", True), "batch_size": ("whole", "128", True), "tp": ("whole", "2", False),
              "pp": ("whole", "2", False), "dp_shard": ("whole", "-1", True), "microbatches": ("whole", "4", False),
              "schedule": ("string", '"1f1b"', False), "virtual_stages": ("whole", "1", True),
              "stages": ("wholes", "[6, 6]", True), "fsdp_rest": ("bool", "false", True),
              "groups": ("list", f"[{_GROUP_EXAMPLE}]", False)}
_GROUP_KEYS = {"blocks": ("count", "4", False), "fsdp": ("bool", "true", False),
               "checkpoint": ("string", '"selective"', False)}


_WRITTEN_KEYS = ("version", *_PLAN_KEYS, "predicted")  # as `vitctl plan` writes them; predicted: its estimates


def _unknown_plan_keys(plan: dict[str, Any]) -> list[str]:
    """Keys no plan holds (a misspelt "fsdp_rest" would leave the default in force, unseen), in the plan and its
    groups."""
    unknown = [f"unknown key {json.dumps(key)} (a plan holds {', '.join(_WRITTEN_KEYS)})"
               for key in plan if key not in _WRITTEN_KEYS]
    groups = plan.get("groups") if type(plan.get("groups")) is list else []
    return unknown + [f"groups[{i}] has the unknown key {json.dumps(key)} (a group holds {', '.join(_GROUP_KEYS)})"
                      for i, group in enumerate(groups) if isinstance(group, dict)
                      for key in group if key not in _GROUP_KEYS]


def _range_problems(plan: dict[str, Any]) -> list[str]:
    """Values of the right type that no strategy takes (named by the plan's key, not by parallel.*)."""
    problems = [f"{key} holds {plan[key]}, not a whole number of at least 1, e.g. \"{key}\": {_PLAN_KEYS[key][1]}"
                for key in ("world_size", "img_size", "batch_size", "tp", "pp", "microbatches", "virtual_stages")
                if type(plan.get(key)) is int and plan[key] < 1]
    if type(shard := plan.get("dp_shard")) is int and shard != -1 and shard < 1:
        problems.append(f"dp_shard holds {shard}, not -1 (every data-parallel rank) or a whole number of at least 1")
    if type(schedule := plan.get("schedule")) is str and schedule not in SCHEDULES:
        problems.append(f"schedule holds {json.dumps(schedule)}, not one of {', '.join(map(json.dumps, SCHEDULES))}")
    return problems


def _plan_problems(plan: dict[str, Any]) -> list[str]:
    """Each key of the plan (and of each group of blocks) missing or holding a value of the wrong type or range."""
    problems = _key_problems(plan, _PLAN_KEYS, "") + _range_problems(plan)
    groups = plan["groups"] if _PLAN_KINDS["list"](plan.get("groups")) else []
    first: int | None = 0  # the group's first block, while the groups before it count theirs rightly
    for i, group in enumerate(groups):
        if not isinstance(group, dict):
            problems.append(f"groups[{i}] holds {json.dumps(group)}, not an object (e.g. {_GROUP_EXAMPLE})")
            first = None
            continue
        n = group.get("blocks")
        first = first if _PLAN_KINDS["count"](n) else None
        span = "" if first is None else f" (block {first})" if n == 1 else f" (blocks {first}-{first + n - 1})"
        problems += _key_problems(group, _GROUP_KEYS, f"groups[{i}].", span)
        if type(mode := group.get("checkpoint")) is str and mode not in CHECKPOINT:
            problems.append(f"groups[{i}].checkpoint{span} holds {json.dumps(mode)}, not one of "
                            f"{', '.join(map(json.dumps, CHECKPOINT))}")
        first = None if first is None else first + n
    return problems


def _key_problems(values: dict[str, Any], keys: dict[str, tuple[str, str, bool]], prefix: str,
                  suffix: str = "") -> list[str]:
    """Each of `keys` missing from `values` (unless optional) or of the wrong type, named `prefix` key `suffix`."""
    problems = []
    for key, (kind, example, optional) in keys.items():
        expected = f'{_KIND_NAMES[kind]}, e.g. "{key}": {example}'
        if key not in values:
            problems += [] if optional else [f"{prefix}{key}{suffix} is missing ({expected})"]
        elif not _PLAN_KINDS[kind](values[key]):
            problems.append(f"{prefix}{key}{suffix} holds {json.dumps(values[key])}, not {expected}")
    return problems


def strategy_problems(s: Strategy, model: ModelShape, world_size: int, batch_size: int,
                      img_size: int | None = None) -> list[str]:
    """Every reason `s` cannot run `model` (at `img_size` px) on `world_size` ranks with `batch_size` samples per
    data-parallel rank."""
    problems = []
    if min(s.tp, s.pp, s.microbatches, s.virtual_stages) < 1:
        return ["parallel.tp, parallel.pp, parallel.microbatches and parallel.virtual_stages must each be at least 1"]
    if s.world_size is not None and s.world_size != world_size:
        problems.append(f"the plan was searched for {s.world_size} ranks (its world_size), and this job has "
                        f"{world_size}: its memory and time were predicted for {s.world_size}; plan again for this "
                        f"job's nodes and GPUs (vitctl plan --nodes N --gpus G ...), or run it on {s.world_size} ranks")
    if s.img_size is not None and img_size is not None and s.img_size != img_size:
        problems.append(f"the plan was searched for {s.img_size} px images (its img_size), and this job trains at "
                        f"{img_size} px: its memory and time were predicted for {s.img_size}; plan again at this size "
                        f"(vitctl plan --img-size {img_size} ...), or train at --set model.img_size={s.img_size}")
    if s.batch_size is not None and s.batch_size != batch_size:
        problems.append(f"the plan was searched for {s.batch_size} samples per data-parallel rank (its batch_size), "
                        f"and this job has {batch_size}: its memory and time were predicted for {s.batch_size}; plan "
                        f"again for this batch (vitctl plan --batch GLOBAL ..., the samples of all data-parallel "
                        f"ranks together), or pass --batch {s.batch_size}")
    if world_size % (s.tp * s.pp):
        problems.append(f"parallel.tp={s.tp} x parallel.pp={s.pp} = {s.tp * s.pp} does not divide the {world_size} "
                        f"ranks; the ranks are pp x data parallel x tp")
    dp = max(1, world_size // (s.tp * s.pp))
    if s.fsdp and s.dp_shard != -1 and (s.dp_shard < 1 or dp % s.dp_shard):
        problems.append(f"parallel.dp_shard={s.dp_shard} does not divide the {dp} data-parallel ranks; pick a "
                        f"divisor of {dp} or -1 (all)")
    if s.schedule not in SCHEDULES:
        problems.append(f"parallel.schedule must be one of {', '.join(SCHEDULES)}, got {s.schedule!r}")
    bad = sorted({h for h in model.heads if h % s.tp} | {h for h in model.hidden if h % s.tp})
    if bad:
        problems.append(f"parallel.tp={s.tp} must divide every block's attention heads and MLP width; {model.name} "
                        f"has {', '.join(map(str, bad))}; pick a tp that divides them")
    if bad := sorted({b.checkpoint for b in s.blocks} - set(CHECKPOINT)):
        problems.append(f"parallel.checkpoint must be one of {', '.join(CHECKPOINT)}, got {', '.join(bad)}")
    problems += _pipeline_problems(s, model.n_blocks, batch_size)
    return problems


def _fewer_stages(s: Strategy, n_blocks: int) -> str:
    """How to fit the stages to `n_blocks` blocks: an interleaved schedule needs 2 stages per pipeline rank or more."""
    if s.virtual_stages > 1 and n_blocks >= 2 * s.pp:
        return f"lower parallel.virtual_stages to {n_blocks // s.pp}"
    fixes = [f"parallel.pp={n_blocks} or less"] if n_blocks < s.pp else []
    if s.virtual_stages > 1:
        fixes += ["parallel.schedule=1f1b", "parallel.virtual_stages=1"]
        return f"use {', '.join(fixes)} (interleaving needs 2 stages per pipeline rank)"
    return f"use {fixes[0]}"


def _microbatches_problem(batch_size: int, microbatches: int, least: int = 1) -> str:
    """The batch does not divide into the micro-batches: the nearest counts below and above that it divides into, of
    at least `least` (what the pipeline schedule needs; at most the batch)."""
    start, reach = min(microbatches, batch_size), min(microbatches, 10_000)  # a bounded search: the batch divides
    below = next((d for d in range(start, max(least - 1, start - reach), -1) if batch_size % d == 0), None)
    above = next((d for d in range(microbatches + 1, min(microbatches + reach, batch_size) + 1) if batch_size % d == 0),
                 None)  # as far above as below: a batch of a large prime has none near
    near = [d for d in (below, above) if d is not None] or [batch_size]
    return (f"data.batch_size {batch_size} does not divide into parallel.microbatches={microbatches}; use "
            f"parallel.microbatches={' or '.join(map(str, near))}, which divide{'s' if len(near) == 1 else ''} it")


def _pipeline_problems(s: Strategy, n_blocks: int, batch_size: int) -> list[str]:
    least = s.pp if s.pp > 1 and s.schedule == "1f1b" else 1
    if batch_size < least:  # no count of micro-batches will do: the batch is the one to change
        return [f"the 1f1b schedule needs at least parallel.pp={s.pp} micro-batches, more than data.batch_size "
                f"{batch_size} can be split into: raise data.batch_size (--batch) to a multiple of {s.pp}, with "
                f"parallel.microbatches={s.pp}"]
    divides = [] if batch_size % s.microbatches == 0 else [_microbatches_problem(batch_size, s.microbatches, least)]
    if s.pp == 1:  # micro-batches without a pipeline: the batch split, the gradients accumulated
        return divides + ([] if not s.stages and s.virtual_stages == 1 else
                          ["parallel.stages and parallel.virtual_stages need parallel.pp > 1"])
    count = s.n_stages
    described = f"{count} stages (parallel.pp={s.pp} x parallel.virtual_stages={s.virtual_stages})" \
        if s.virtual_stages > 1 else f"{count} stages"
    problems = _schedule_problems(s, batch_size)
    if n_blocks < count:
        problems.append(f"{count} pipeline stages need at least as many blocks; the model has {n_blocks}; "
                        + _fewer_stages(s, n_blocks))
    if s.stages and (len(s.stages) != count or sum(s.stages) != n_blocks or min(s.stages) < 1):
        problems.append(f"parallel.stages {list(s.stages)} must give {described} of at least one block each, "
                        f"{n_blocks} blocks in all")
    return problems + divides


def _schedule_problems(s: Strategy, batch_size: int) -> list[str]:
    """The micro-batch counts and stages per rank the pipeline schedule runs with (torch's own checks, ahead)."""
    m, pp = s.microbatches, s.pp
    if s.schedule == INTERLEAVED and s.virtual_stages < 2:
        return [f"parallel.schedule={INTERLEAVED} needs parallel.virtual_stages of 2 or more (stages per pipeline "
                f"rank); with one stage per rank use parallel.schedule=1f1b"]
    if s.schedule != INTERLEAVED and s.virtual_stages > 1:
        return [f"parallel.virtual_stages={s.virtual_stages} needs parallel.schedule={INTERLEAVED}; {s.schedule} "
                f"runs one stage per pipeline rank"]
    if s.schedule == "1f1b" and m < pp:  # a batch smaller than pp is refused before (_pipeline_problems)
        least = next(c for c in range(pp, batch_size + 1) if batch_size % c == 0)
        return [f"the 1f1b schedule needs at least parallel.pp={pp} micro-batches, got parallel.microbatches={m}: "
                f"use parallel.microbatches={least}, the fewest from {pp} that data.batch_size {batch_size} divides "
                "into"]
    rounds = max(1, m // pp)  # torch's ScheduleInterleaved1F1B runs the micro-batches in this many equal rounds
    if s.schedule == INTERLEAVED and m % rounds:
        # multiples of pp that the batch divides into, the nearest first
        fits = sorted((c for c in range(pp, batch_size + 1, pp) if batch_size % c == 0), key=lambda c: abs(c - m))
        some = f" (e.g. {' or '.join(map(str, sorted(fits[:2])))})" if fits else ""
        return [f"the {INTERLEAVED} schedule runs parallel.microbatches={m} in max(1, microbatches // pp) = {rounds} "
                f"rounds of equal size, which {m} does not divide into; use a multiple of parallel.pp={pp} that "
                f"data.batch_size {batch_size} divides into{some}, or fewer than {2 * pp}"]
    return []
