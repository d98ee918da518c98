"""What the planner's cost model stands on, measured on this machine: each distinct block of a model for every
tensor-parallel degree and checkpoint mode, the parts outside the blocks, the optimizer step, and the collectives
among ranks. Saved as JSON per GPU type, torch version, model and image size."""

import copy
import functools
import json
import math
import re
import shlex
import socket
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..config import ConfigError, ModelConfig
from ..models import MODELS, blocks_of, build_model, default_window, model_error
from ..models.swin import SwinTransformer
from ..ops import Ops, resolve
from ..optim import step_on_local_shards
from ..parallel.strategy import CHECKPOINT, ModelShape, is_plan
from ..precision import Precision

PROFILE_VERSION = 2  # 2: FSDP measured in every checkpoint mode, under the trainer's policy
SHIPPED = Path(__file__).parent / "profiles"
WARMUP, ITERS = 2, 7
CHAIN_LENGTHS = (2, 6)  # FSDP blocks in the two chains whose host times differ by what the extra blocks add
HOST_AHEAD_S = 0.02  # spin the GPU this long before a timed call: longer than any block takes to launch
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


@dataclass(frozen=True)
class BlockShape:
    """A transformer block as the cost model sees it: its widths and the per-sample input it takes."""

    dim: int
    heads: int
    hidden: int  # MLP hidden units
    window: int  # Swin's attention window side; 0: global attention (ViT)
    input_shape: tuple[int, ...]  # per sample: (tokens, dim) for ViT, (H, W, dim) for Swin

    @property
    def tokens(self) -> int:
        return math.prod(self.input_shape[:-1])

    @property
    def key(self) -> str:
        grid = "x".join(map(str, self.input_shape[:-1]))
        return f"d{self.dim}-h{self.heads}-{grid}" + (f"-w{self.window}" if self.window else "")


@dataclass(frozen=True)
class Part:
    """A module outside the blocks, run just before block `before` (the number of blocks: after the last)."""

    name: str  # embed, merge1 (Swin's patch merging before its stage 1), ..., head
    before: int


@dataclass(frozen=True)
class ModelLayout:
    name: str
    img_size: int
    blocks: tuple[BlockShape, ...]  # in forward order
    parts: tuple[Part, ...]

    def shape(self) -> ModelShape:
        return ModelShape(self.name, tuple(b.heads for b in self.blocks), tuple(b.hidden for b in self.blocks))


def model_layout(model_name: str, img_size: int) -> ModelLayout:
    """The blocks and other parts of a registered model, from its hyperparameters (nothing is built)."""
    if error := model_error(ModelConfig(name=model_name, img_size=img_size)):
        raise ConfigError(error)
    spec = MODELS[model_name]
    kw = spec.kwargs
    blocks: list[BlockShape] = []
    parts = [Part("embed", 0)]
    if spec.family == "swin":
        for i, (depth, heads) in enumerate(zip(kw["depths"], kw["heads"], strict=True)):
            dim, side = kw["dim"] * 2**i, img_size // 4 // 2**i
            if i:
                parts.append(Part(f"merge{i}", len(blocks)))
            blocks += [BlockShape(dim, heads, 4 * dim, min(default_window(img_size), side), (side, side, dim))] * depth
    else:
        dim, tokens = kw["dim"], 1 + (img_size // kw["patch"]) ** 2
        blocks = [BlockShape(dim, kw["heads"], int(dim * kw["mlp_ratio"]), 0, (tokens, dim))] * kw["depth"]
    return ModelLayout(model_name, img_size, tuple(blocks), (*parts, Part("head", len(blocks))))


@dataclass(frozen=True)
class Measured:
    """Forward and backward of one module at a few batch sizes; the cost model fits a line through them. Times are
    the device's (kernels back to back) and the host's (launching them): a module takes the longer of the two."""

    batch: tuple[int, ...]
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]  # the recomputation of a checkpointed block included
    forward_host_s: tuple[float, ...]  # the host's time to issue the forward (eager launches; on a CPU the same)
    backward_host_s: tuple[float, ...]
    retained_bytes: tuple[int, ...]  # held from the forward until the backward, the module's input included
    peak_bytes: tuple[int, ...]  # the most held at once in the forward and backward, the input included


@dataclass(frozen=True)
class BlockProfile:
    shape: str  # BlockShape.key
    tp: int  # measured on one tensor-parallel rank's share: heads / tp and MLP hidden units / tp
    checkpoint: str
    fsdp: bool  # measured under FSDP2 on one rank, as the trainer shards it: FSDP's own work and memory included
    params: int  # that share's parameters
    measured: Measured


@dataclass(frozen=True)
class FsdpHost:
    """The host's seconds one FSDP block of `shape` adds to a step when its weights are sharded over `ranks` GPUs:
    the slope over chains of such blocks run as the trainer runs a step, each chain's median of several steps."""

    shape: str  # BlockShape.key
    checkpoint: str
    ranks: int
    batch: int  # samples a rank, few: the host's time, not the kernels'
    forward_s: float
    backward_s: float
    step_s: float  # AdamW's step over the block's shard, and clearing its gradients


@dataclass(frozen=True)
class PartProfile:
    name: str
    params: int
    measured: Measured


@dataclass(frozen=True)
class LinkFit:
    """Seconds of a collective on `size` bytes: latency_s + bus_factor(op, ranks) * size / bus_bytes_per_s."""

    latency_s: float
    bus_bytes_per_s: float


@dataclass(frozen=True)
class CollectiveProfile:
    ranks: int
    nodes: int
    sizes: tuple[int, ...]  # bytes of the whole buffer (all-gather's output, reduce-scatter's input)
    seconds: dict[str, tuple[float, ...]]  # per collective, per size: the slowest rank's median
    fits: dict[str, LinkFit]
    overlap_slowdown: float  # compute runs this many times slower while a collective runs beside it


@dataclass(frozen=True)
class Profile:
    device: str  # torch.cuda.get_device_name(), or "cpu"
    torch: str
    model: str
    img_size: int
    blocks: tuple[BlockProfile, ...]
    parts: tuple[PartProfile, ...]
    optimizer_s_per_param: float
    collectives: tuple[CollectiveProfile, ...]
    fsdp_hosts: tuple[FsdpHost, ...] = ()  # none in profiles measured before them, or on one GPU

    def block(self, shape: str, tp: int, checkpoint: str, fsdp: bool = False) -> BlockProfile:
        return next(b for b in self.blocks if (b.shape, b.tp, b.checkpoint, b.fsdp) == (shape, tp, checkpoint, fsdp))

    def fsdp_host(self, shape: str, checkpoint: str, ranks: int) -> FsdpHost | None:
        """The chain measured among the rank count nearest `ranks` (the larger of two as near), if any."""
        measured = [h for h in self.fsdp_hosts if (h.shape, h.checkpoint) == (shape, checkpoint)]
        return min(measured, key=lambda h: (abs(h.ranks - ranks), -h.ranks), default=None)

    def part(self, name: str) -> PartProfile:
        return next(p for p in self.parts if p.name == name)

    def has_tp(self, layout: ModelLayout, tp: int) -> bool:
        """Whether every block shape of `layout` was measured at degree `tp`, in each checkpoint mode and FSDP."""
        measured = {(b.shape, b.tp, b.checkpoint, b.fsdp) for b in self.blocks}
        return all({(s.key, tp, mode, fsdp) for mode in CHECKPOINT for fsdp in (False, True)} <= measured
                   for s in layout.blocks)

    def to_json(self) -> str:
        return json.dumps({"version": PROFILE_VERSION, **asdict(self)}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise NotAProfile(f"it holds a JSON {type(raw).__name__}, not an object")
        if "version" not in raw:
            raise NotAProfile("it holds no profile version")
        if (version := raw.pop("version")) != PROFILE_VERSION:
            raise ValueError(f"profile version {version}, this vitctl reads version {PROFILE_VERSION}")
        return cls(**{**raw, "blocks": tuple(BlockProfile(**{**b, "measured": _measured(b["measured"])})
                                             for b in raw["blocks"]),
                      "parts": tuple(PartProfile(**{**p, "measured": _measured(p["measured"])}) for p in raw["parts"]),
                      "collectives": tuple(_collective_from_dict(c) for c in raw["collectives"]),
                      "fsdp_hosts": tuple(FsdpHost(**h) for h in raw.get("fsdp_hosts", ()))})


class NotAProfile(ValueError):
    """A JSON file that is no profile of any version (no `version` key)."""


def _measured(m: dict[str, list]) -> Measured:
    return Measured(**{k: tuple(v) for k, v in m.items()})


def _collective_from_dict(c: dict[str, Any]) -> CollectiveProfile:
    return CollectiveProfile(**{**c, "sizes": tuple(c["sizes"]),
                                "seconds": {op: tuple(s) for op, s in c["seconds"].items()},
                                "fits": {op: LinkFit(**f) for op, f in c["fits"].items()}})


def read_profile(path: Path, model: str, img_size: int) -> Profile:
    """The profile of `model` at `img_size` at `path`; a ConfigError saying how to measure one where it is not."""
    measure = f"`vitctl plan --profile-only --model {model} --img-size {img_size}` on a GPU node"
    try:
        profile = Profile.from_json(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"profile {path} does not exist; measure one with {measure}") from None
    except PermissionError:  # a cached or shipped one too: measuring again would not help
        raise ConfigError(f"profile {path}: this user may not read it (permission denied); give this user read access "
                          f"to it (`ls -l {shlex.quote(str(path))}` shows owner and mode)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        if is_plan(path):  # both are JSON files that `vitctl plan` writes
            raise ConfigError(f"--profile {path} is a plan (`vitctl plan --out` wrote it), not a profile; pass the "
                              f"profile `vitctl plan --profile-only` wrote, or leave --profile out") from None
        if isinstance(e, NotAProfile | json.JSONDecodeError | UnicodeDecodeError):  # another file: no cache to replace
            raise ConfigError(f"--profile {path} is not a profile ({e}); pass the file `vitctl plan --profile-only` "
                              f"wrote, or measure one with {measure}") from None
        reason = f"key {e} is missing" if isinstance(e, KeyError) else e
        raise ConfigError(f"profile {path} is not a profile this vitctl reads ({reason}); measure it again with "
                          f"{measure} (it replaces the cached one) and pass that file with --profile") from None
    if (profile.model, profile.img_size) != (model, img_size):
        raise ConfigError(f"profile {path} measured {profile.model} at {profile.img_size} px, not {model} at "
                          f"{img_size} px; measure that with {measure}")
    if problems := _profile_problems(profile, model_layout(model, img_size)):
        raise ConfigError(f"profile {path} is damaged: {'; '.join(problems)}; measure it again with {measure} (it "
                          f"replaces the cached one) and pass that file with --profile")
    return profile


def _profile_problems(profile: Profile, layout: ModelLayout) -> list[str]:
    """What the cost model would fail on or be misled by: measurements missing, or values that are not measurements
    (a hand-edited or damaged file)."""
    problems = [] if profile.has_tp(layout, 1) else [
        "the blocks are not all measured (each block shape without tensor parallel, in every checkpoint mode, with "
        "and without FSDP)"]
    if missing := [p.name for p in layout.parts if p.name not in {q.name for q in profile.parts}]:
        problems.append(f"no measurement of {', '.join(missing)}, outside the blocks")
    measured = [(f"blocks[{i}]", b.params, b.measured) for i, b in enumerate(profile.blocks)] + \
        [(f"parts[{i}]", p.params, p.measured) for i, p in enumerate(profile.parts)]
    bad = [f"{where}.params" for where, params, _ in measured if type(params) is not int or params < 0]
    bad += [f"{where}.measured.{name}" for where, _, m in measured for name in _bad_columns(m)]
    bad += ["optimizer_s_per_param"] * (not _amount(profile.optimizer_s_per_param))
    bad += [f"collectives[{i}]" for i, c in enumerate(profile.collectives) if not _collective_ok(c)]
    if bad:
        more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
        problems.append(f"{', '.join(bad[:4])}{more} {'holds' if len(bad) == 1 else 'hold'} what is not a "
                        f"measurement (finite numbers, none negative, one per batch size)")
    return problems


def _amount(value: object) -> bool:
    """A finite number, not negative (JSON's true and false are not numbers here)."""
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


def _bad_columns(m: Measured) -> list[str]:
    """Columns of `m` that are not one amount per batch size (whole batch sizes of at least 1)."""
    if not m.batch or not all(type(b) is int and b >= 1 for b in m.batch):
        return ["batch"]
    return [name for name, values in vars(m).items()
            if name != "batch" and (len(values) != len(m.batch) or not all(map(_amount, values)))]


def _collective_ok(c: CollectiveProfile) -> bool:
    return (all(type(n) is int and n >= 1 for n in (c.ranks, c.nodes)) and _amount(c.overlap_slowdown)
            and c.overlap_slowdown >= 1 and set(COLLECTIVES) <= set(c.fits)
            and all(isinstance(f, LinkFit) and _amount(f.latency_s) and _amount(f.bus_bytes_per_s)
                    and f.bus_bytes_per_s > 0 for f in c.fits.values()))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def profile_file(device: str, torch_version: str, model: str, img_size: int) -> str:
    """The file name a profile is cached and shipped under, e.g. NVIDIA_H200-torch2.11.0_cu130-swin_h-224.json."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{device}-torch{torch_version}-{model}-{img_size}") + ".json"


# Measurement ------------------------------------------------------------------------------------------------------


def profile_blocks(model_name: str, img_size: int, batch: int, device: torch.device,
                   tp_degrees: Sequence[int] = (1, 2, 4, 8),
                   checkpoints: Sequence[str] = CHECKPOINT) -> tuple[BlockProfile, ...]:
    """Time and memory of one tensor-parallel rank's share of each distinct block, per degree and checkpoint mode,
    at `batch` and a quarter of it (bf16 autocast on a GPU, fp32 on a CPU), fed the dtype the model feeds it, held
    replicated and under FSDP2 on a one-rank mesh with the trainer's mixed-precision policy (FSDP's hooks, buffer
    copies and casts included). Runs FSDP2 in a process group of its own: call it with none initialised."""
    policy = Precision("bf16" if device.type == "cuda" else "fp32", device).fsdp_policy()
    profiles = []
    with _one_rank_mesh(device) as mesh:
        for shape, block, dtype in _distinct_blocks(model_name, img_size, device):
            make = functools.partial(_block_input, shape, dtype, device)
            for tp in (t for t in tp_degrees if shape.heads % t == 0 and shape.hidden % t == 0):
                local = _tp_share(copy.deepcopy(block), tp).train()
                params = _count(local)
                for fsdp in (False, True):
                    if fsdp:
                        local = fully_shard(local, mesh=mesh, mp_policy=policy)
                    for mode in checkpoints:
                        local.checkpoint = mode
                        profiles.append(BlockProfile(shape.key, tp, mode, fsdp, params,
                                                     _measure(local, make, batch, device)))
    return tuple(profiles)


def _distinct_blocks(model_name: str, img_size: int,
                     device: torch.device) -> list[tuple[BlockShape, nn.Module, torch.dtype]]:
    """The first block of each distinct shape, with the dtype the model feeds it."""
    model, layout = _build(model_name, img_size, device), model_layout(model_name, img_size)
    first: dict[str, tuple[BlockShape, nn.Module, torch.dtype]] = {}
    for shape, block, dtype in zip(layout.blocks, blocks_of(model), _stream_dtypes(model, img_size, device),
                                   strict=True):
        first.setdefault(shape.key, (shape, block, dtype))
    return list(first.values())


def _block_input(shape: BlockShape, dtype: torch.dtype, device: torch.device, batch: int) -> Tensor:
    return torch.randn(batch, *shape.input_shape, device=device, dtype=dtype, requires_grad=True)


def _stream_dtypes(model: nn.Module, img_size: int, device: torch.device) -> list[torch.dtype]:
    """Each block's input dtype in the model as the profile runs it: under bf16 autocast Swin's stream turns bf16 at
    its first patch merging (a linear layer's output), ViT's stays fp32 (its position embedding is)."""
    seen: list[torch.dtype] = []
    hooks = [b.register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype)) for b in blocks_of(model)]
    try:
        with torch.no_grad():
            _autocast(device, model, torch.randn(1, 3, img_size, img_size, device=device))
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@contextmanager
def _one_rank_mesh(device: torch.device) -> Iterator[DeviceMesh]:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        yield init_device_mesh(device.type, (1,))
    finally:
        dist.destroy_process_group()


def profile_parts(model_name: str, img_size: int, batch: int, device: torch.device) -> tuple[PartProfile, ...]:
    """Time and memory of the parts outside the blocks: patch embedding, Swin's patch merging, norm + head + loss."""
    model, layout = _build(model_name, img_size, device), model_layout(model_name, img_size)
    dtypes = _stream_dtypes(model, img_size, device)  # a block's output has its input's dtype (the residual's)
    head = [model.norm, model.head, *([model.pre_logits] if hasattr(model, "pre_logits") else [])]
    pooled = isinstance(model, SwinTransformer)  # Swin's head pools; ViT's takes the class token
    last = layout.blocks[-1].input_shape
    images = lambda b: torch.randn(b, 3, img_size, img_size, device=device)  # noqa: E731
    parts = {"head": (nn.ModuleList(head), last, dtypes[-1], lambda x: F.cross_entropy(
        model.head(model.norm(x)) if pooled else model.head(model.pre_logits(model.norm(x)[:, 0])),
        torch.zeros(x.shape[0], dtype=torch.long, device=device)))}
    for part in layout.parts:
        if part.name.startswith("merge"):
            merge = model.layers[int(part.name[5:])].downsample
            side, _, dim = layout.blocks[part.before - 1].input_shape
            parts[part.name] = (merge, (side, side, dim), dtypes[part.before - 1], merge)
    outside = {id(p) for module, *_ in parts.values() for p in module.parameters()}
    inside = {id(p) for block in blocks_of(model) for p in block.parameters()}
    embed = sum(p.numel() for p in model.parameters() if id(p) not in outside | inside)
    profiles = [PartProfile("embed", embed, _measure(model.patch_embed, images, batch, device))]
    for name, (module, shape, dtype, run) in parts.items():
        make = lambda b, s=shape, d=dtype: torch.randn(b, *s, device=device, dtype=d, requires_grad=True)  # noqa: E731
        profiles.append(PartProfile(name, _count(module), _measure(module, make, batch, device, run)))
    return tuple(sorted(profiles, key=lambda p: [p.name for p in layout.parts].index(p.name)))


def profile_optimizer(device: torch.device) -> float:
    """Seconds per parameter of one AdamW step, by the implementation the op seams pick on `device`."""
    sizes = [1 << 22] * 16 if device.type == "cuda" else [1 << 16] * 8
    params = [nn.Parameter(torch.randn(n, device=device)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = _ops(device).optimizer([{"params": params, "weight_decay": 0.05}], 1e-3, (0.9, 0.999), 1e-8)
    seconds = [_seconds(optimizer.step, device) for _ in range(WARMUP + ITERS)][WARMUP:]
    return statistics.median(seconds) / sum(sizes)


def profile_fsdp_hosts(blocks: Sequence[tuple[BlockShape, nn.Module, torch.dtype]], batch: int,
                       group: dist.ProcessGroup, device: torch.device,
                       checkpoints: Sequence[str] = CHECKPOINT) -> tuple[FsdpHost, ...]:
    """Each of `_distinct_blocks`' FSDP host time in each checkpoint mode, its weights sharded over `group`'s ranks,
    which all call it: in a step the host also waits on the collectives and the other ranks, and pays FSDP's hooks
    around every block and the optimizer's step over its shard, none of which one block timed alone shows."""
    mesh = DeviceMesh.from_group(group, device.type)
    policy = Precision("bf16" if device.type == "cuda" else "fp32", device).fsdp_policy()
    measured = []
    for shape, block, dtype in blocks:
        x = _block_input(shape, dtype, device, batch)
        for mode in checkpoints:
            short, long = (_chain_host_s(block, mode, n, x, mesh, policy, group) for n in CHAIN_LENGTHS)
            measured.append((shape.key, mode, [max(0.0, (b - a) / (CHAIN_LENGTHS[1] - CHAIN_LENGTHS[0]))
                                               for a, b in zip(short, long, strict=True)]))
    slowest = torch.tensor([seconds for *_, seconds in measured], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)  # a step waits for its slowest rank
    ranks = dist.get_world_size(group)
    return tuple(FsdpHost(key, mode, ranks, batch, *seconds)
                 for (key, mode, _), seconds in zip(measured, slowest.tolist(), strict=True))


def _chain_host_s(block: nn.Module, checkpoint: str, length: int, x: Tensor, mesh: DeviceMesh, policy: Any,
                  group: dist.ProcessGroup) -> tuple[float, float, float]:
    """Median host seconds of the forward, the backward and the AdamW step of `length` copies of `block` under
    FSDP2, a unit each and a root over them, as the trainer shards and steps a model."""
    chain = nn.Sequential(*(copy.deepcopy(block) for _ in range(length))).train()
    for member in chain:
        member.checkpoint = checkpoint
        fully_shard(member, mesh=mesh, mp_policy=policy)
    fully_shard(chain, mesh=mesh, mp_policy=policy)
    optimizer = _ops(x.device).optimizer([{"params": list(chain.parameters()), "weight_decay": 0.05}], 1e-3,
                                         (0.9, 0.999), 1e-8)
    steps = [_step_host_s(chain, optimizer, x, group) for _ in range(WARMUP + ITERS)][WARMUP:]
    return tuple(statistics.median(phase) for phase in zip(*steps, strict=True))


def _step_host_s(chain: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor,
                 group: dist.ProcessGroup) -> tuple[float, float, float]:
    x.grad = None
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    dist.barrier(group=group)
    begin = time.perf_counter()
    out = _autocast(x.device, chain, x)
    forward = time.perf_counter()
    out.backward(torch.ones_like(out))
    backward = time.perf_counter()
    if not step_on_local_shards(optimizer):
        optimizer.step()
    optimizer.zero_grad()
    return forward - begin, backward - forward, time.perf_counter() - backward


@functools.cache
def _ops(device: torch.device) -> Ops:
    """The op implementations a run on `device` picks (eager), resolved once: resolving logs every fallback."""
    return resolve("all", device, compiling=False)


def _build(model_name: str, img_size: int, device: torch.device) -> nn.Module:
    config = ModelConfig(name=model_name, img_size=img_size, drop_path=0.0)
    with torch.device(device):
        return build_model(config, _ops(device)).train()


def _tp_share(block: nn.Module, tp: int) -> nn.Module:
    """`block` cut to what one of `tp` tensor-parallel ranks holds and computes between its all-reduces: the first
    heads / tp heads (q, k, v rows and proj columns, Swin's bias-table columns) and MLP hidden units / tp."""
    if tp == 1:
        return block
    attn, mlp = block.attn, block.mlp
    width, hidden = attn.qkv.weight.shape[1] // tp, mlp.fc1.weight.shape[0] // tp  # PackedQKV: (3, dim, dim)
    attn.heads //= tp
    for module, name, dim, length in [(attn.qkv, "weight", 1, width), (attn.qkv, "bias", 1, width),
                                      (attn.proj, "weight", 1, width), (mlp.fc1, "weight", 0, hidden),
                                      (mlp.fc1, "bias", 0, hidden), (mlp.fc2, "weight", 1, hidden)]:
        setattr(module, name, nn.Parameter(getattr(module, name).narrow(dim, 0, length).clone()))
    if hasattr(attn, "relative_position_bias_table"):
        attn.relative_position_bias_table = nn.Parameter(attn.relative_position_bias_table[:, :attn.heads].clone())
    return block


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _measure(module: nn.Module, make_input: Callable[[int], Tensor], batch: int, device: torch.device,
             run: Callable[[Tensor], Tensor] | None = None) -> Measured:
    batches = tuple(sorted({max(1, batch // 4), batch}))
    columns = zip(*(_measure_at(module, run or module, make_input(b), device) for b in batches), strict=True)
    return Measured(batches, *map(tuple, columns))


def _measure_at(module: nn.Module, run: Callable[[Tensor], Tensor], x: Tensor,
                device: torch.device) -> tuple[float | int, ...]:
    """Forward and backward seconds on the device (median) and on the host (least: interference from other
    processes or the garbage collector only ever adds to it), then retained and peak bytes."""
    # The warm-up also creates the weights' .grad, so that no timed backward allocates them.
    on_device = [_forward_backward_seconds(run, x, device, spin=True) for _ in range(WARMUP + ITERS)][WARMUP:]
    on_host = [_forward_backward_seconds(run, x, device, spin=False) for _ in range(ITERS)] \
        if device.type == "cuda" else on_device
    memory = _cuda_memory if device.type == "cuda" else _cpu_memory
    return (*(statistics.median(c) for c in zip(*on_device, strict=True)),
            *(min(c) for c in zip(*on_host, strict=True)), *memory(module, run, x))


def _forward_backward_seconds(run: Callable[[Tensor], Tensor], x: Tensor, device: torch.device,
                              spin: bool) -> tuple[float, float]:
    x.grad, out = None, []
    forward = _timed(lambda: out.append(_autocast(device, run, x)), device, spin)
    grad = torch.ones_like(out[0])
    return forward, _timed(lambda: out[0].backward(grad), device, spin)


def _timed(fn: Callable[[], object], device: torch.device, spin: bool) -> float:
    """Seconds of `fn`'s work on the device (`spin`), else of the host's issuing it (where `fn` itself waits for the
    device, that too); on a CPU both are the wall time."""
    if device.type == "cpu":
        return _wall_seconds(fn, device)
    torch.cuda.synchronize(device)
    if not spin:
        begin = time.perf_counter()
        fn()
        return time.perf_counter() - begin
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(_ahead_cycles(device.index or 0))  # the host queues all of fn's kernels while the GPU spins,
    start.record()  # so that the events time the kernels alone, not the gaps between their launches
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@functools.cache
def _ahead_cycles(index: int) -> int:
    """GPU clock cycles in HOST_AHEAD_S, for torch.cuda._sleep."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    return int(10**7 * HOST_AHEAD_S / (start.elapsed_time(end) / 1e3))


def _autocast(device: torch.device, run: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    context: AbstractContextManager = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" \
        else nullcontext()
    with context:
        return run(x)


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    """From the start of `fn`'s work to its end, as it runs beside whatever else is in flight."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _cuda_memory(module: nn.Module, run: Callable[[Tensor], Tensor], x: Tensor) -> tuple[int, int]:
    x.grad = None
    torch.cuda.synchronize(x.device)
    base = torch.cuda.memory_allocated(x.device)
    torch.cuda.reset_peak_memory_stats(x.device)
    out = _autocast(x.device, run, x)
    retained = torch.cuda.memory_allocated(x.device) - base - _nbytes(out)  # the output is the next one's input
    out.backward(torch.ones_like(out))
    return retained + _nbytes(x), torch.cuda.max_memory_allocated(x.device) - base + _nbytes(x)


class _Storages(TorchDispatchMode):
    """Every storage the ops under it create, but the weights': its size, and a weak reference that tells whether
    anything (autograd's saved tensors, a checkpoint's cache) still holds it."""

    def __init__(self, weights: set[int]) -> None:
        super().__init__()
        self.weights, self.live, self.created_bytes = weights, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and (storage := t.untyped_storage()).data_ptr() not in self.weights:
                known = self.live.get(storage.data_ptr())
                if storage.nbytes() and (known is None or known[0]() is None):  # new, or a freed one's address
                    self.live[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
                    self.created_bytes += storage.nbytes()
        return out

    def held_bytes(self, but: Tensor) -> int:
        """Bytes of the storages still alive, at their size now (FSDP frees its gathered weights by resizing)."""
        held = [ref() for ptr, (ref, _) in self.live.items() if ptr != but.untyped_storage().data_ptr()]
        return sum(storage.nbytes() for storage in held if storage is not None)


def _cpu_memory(module: nn.Module, run: Callable[[Tensor], Tensor], x: Tensor) -> tuple[int, int]:
    """CPU has no allocator statistics: the retained bytes are the storages the forward created that outlive it;
    the peak is bounded by all the forward created (which a checkpointed backward creates again) plus the input
    and the output's gradient."""
    x.grad = None
    local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
    with _Storages({p.untyped_storage().data_ptr() for p in local}) as storages:
        out = run(x)
    retained = storages.held_bytes(but=out) + _nbytes(x)
    out.backward(torch.ones_like(out))
    return retained, storages.created_bytes + _nbytes(x) + _nbytes(out)


# Collectives ------------------------------------------------------------------------------------------------------


def bus_factor(op: str, ranks: int) -> float:
    """How many times its size a collective moves through each rank's link (NCCL's bus bandwidth convention)."""
    return {"all_reduce": 2 * (ranks - 1) / ranks, "all_gather": (ranks - 1) / ranks,
            "reduce_scatter": (ranks - 1) / ranks, "send_recv": 1.0}[op]


def collective_sizes(device: torch.device) -> tuple[int, ...]:
    """Buffer sizes to time: 1 MiB to 1 GiB on GPUs, 16 KiB to 4 MiB on CPU ranks (gloo)."""
    return tuple(4**i << 20 for i in range(6)) if device.type == "cuda" else tuple(4**i << 14 for i in range(5))


def profile_collectives(group: dist.ProcessGroup | None, sizes_bytes: Sequence[int]) -> CollectiveProfile:
    """Seconds of all-reduce, all-gather, reduce-scatter and send/recv among `group`'s ranks per size, a latency +
    bandwidth line through them, and how much they slow compute beside them; every rank of `group` calls it."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    hosts: list[str | None] = [None] * ranks
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    sizes, seconds = [], {op: [] for op in COLLECTIVES}
    for size in sizes_bytes:
        full = torch.ones(max(1, size // 4 // ranks) * ranks, device=device)
        sizes.append(_nbytes(full))
        for op, call in _collective_calls(full, rank, ranks, group).items():
            seconds[op].append(_collective_seconds(call, group, device))
    slowest = torch.tensor([seconds[op] for op in COLLECTIVES], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    seconds = {op: tuple(slowest[i].tolist()) for i, op in enumerate(COLLECTIVES)}
    fits = {op: _fit(sizes, times, bus_factor(op, ranks)) for op, times in seconds.items()}
    return CollectiveProfile(ranks, len(set(hosts)), tuple(sizes), seconds, fits,
                             _overlap_slowdown(full, group, device))


def _collective_calls(full: Tensor, rank: int, ranks: int,
                      group: dist.ProcessGroup | None) -> dict[str, Callable[[], object]]:
    part = torch.empty(full.numel() // ranks, device=full.device)
    return {"all_reduce": lambda: dist.all_reduce(full, group=group),
            "all_gather": lambda: dist.all_gather_into_tensor(full, part, group=group),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full, group=group),
            "send_recv": lambda: _exchange(full, rank, ranks, group)}


def _exchange(buffer: Tensor, rank: int, ranks: int, group: dist.ProcessGroup | None) -> None:
    """Ranks 0 -> 1, 2 -> 3, ...: a pipeline's boundary transfer between neighbouring pairs at once."""
    peer = rank ^ 1
    if peer < ranks:
        (dist.send if rank % 2 == 0 else dist.recv)(buffer, dist.get_global_rank(group or dist.group.WORLD, peer),
                                                    group=group)


def _collective_seconds(call: Callable[[], object], group: dist.ProcessGroup | None, device: torch.device) -> float:
    times = []
    for _ in range(WARMUP + ITERS):
        dist.barrier(group=group)
        times.append(_wall_seconds(call, device))
    return statistics.median(times[WARMUP:])


def _wall_seconds(call: Callable[[], object], device: torch.device) -> float:
    """From the launch until the result, by the host's clock (NCCL runs on its own stream, beyond CUDA events on
    the current one)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    begin = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - begin


def _fit(sizes: Sequence[int], seconds: Sequence[float], factor: float) -> LinkFit:
    """Least-squares line seconds = latency + factor * size / bandwidth; bandwidth from the largest size when the
    points give no positive slope (latency-bound sizes only)."""
    mean_x, mean_y = statistics.fmean(sizes), statistics.fmean(seconds)
    spread = sum((x - mean_x) ** 2 for x in sizes)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes, seconds, strict=True)) / spread if spread else 0
    if slope <= 0:
        return LinkFit(0.0, factor * sizes[-1] / seconds[-1])
    return LinkFit(max(0.0, mean_y - slope * mean_x), factor / slope)


def _overlap_slowdown(buffer: Tensor, group: dist.ProcessGroup | None, device: torch.device) -> float:
    """Matmuls' time while all-reduces of `buffer` run beside them, over their time alone (at least 1)."""
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16) if device.type == "cuda" \
        else torch.randn(256, 256, device=device)
    matmuls = lambda: [a @ a for _ in range(20)]  # noqa: E731
    alone = statistics.median([_seconds(matmuls, device) for _ in range(WARMUP + ITERS)][WARMUP:])
    reduce_s = _collective_seconds(lambda: dist.all_reduce(buffer, group=group), group, device)
    count = torch.tensor([math.ceil(alone / reduce_s) + 1], device=device)  # enough to last the matmuls out,
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)  # and the same on every rank
    beside = []
    for _ in range(ITERS):
        dist.barrier(group=group)
        works = [dist.all_reduce(buffer, group=group, async_op=True) for _ in range(int(count))]
        beside.append(_seconds(matmuls, device))
        for work in works:
            work.wait()
    return max(1.0, statistics.median(beside) / alone)


def collective_groups(world: int, local: int) -> list[list[int]]:
    """Rank sets to measure: 2, 4, ... ranks of the first node (and all of them), and when there are several
    nodes, one rank of each of the first two and then every rank."""
    sizes = sorted({2**i for i in range(1, local.bit_length()) if 2**i <= local} | ({local} if local > 1 else set()))
    groups = [list(range(n)) for n in sizes]
    return groups + ([[0, local], list(range(world))] if world > local else [])


def measure_collectives(local: int, sizes_bytes: Sequence[int]) -> tuple[CollectiveProfile, ...]:
    """Every rank of the initialised default group calls this; rank 0's answer holds every group's measurement."""
    return tuple(_in_each_group(collective_groups(dist.get_world_size(), local),
                                lambda group: profile_collectives(group, sizes_bytes)))


def measure_fsdp_hosts(model_name: str, img_size: int, batch: int, local: int,
                       device: torch.device) -> tuple[FsdpHost, ...]:
    """`profile_fsdp_hosts` among 2, 4, ... ranks of the first node and all of them; every rank of the initialised
    default group calls this, rank 0's answer holds every group's measurement."""
    blocks = _distinct_blocks(model_name, img_size, device)
    groups = collective_groups(min(local, dist.get_world_size()), local)
    return tuple(h for hosts in _in_each_group(groups, lambda group: profile_fsdp_hosts(blocks, batch, group, device))
                 for h in hosts)


def _in_each_group(groups: Sequence[list[int]], measure: Callable[[dist.ProcessGroup], Any]) -> list[Any]:
    """`measure(group)` on the ranks of each group in turn (every rank makes every group, as torch requires); this
    rank's answers."""
    results = []
    for ranks in groups:
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            results.append(measure(group))
        dist.barrier()
    return results
