"""`vitctl plan`: find (or measure) the profile of this GPU type, search the layerwise strategy for a job, write the
plan that `vitctl train --set parallel.plan=FILE` runs."""

import math
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vitctl.datasets.atomic import partial_open, publish
from vitctl.datasets.oserrors import file_in_the_way, what_it_is, write_refusal
from vitctl.trainer.config import ConfigError
from vitctl.trainer.parallel.env import init_distributed
from vitctl.trainer.parallel.strategy import Strategy, is_plan
from vitctl.trainer.planner.cost import ALLOCATOR_ROOM, Cluster
from vitctl.trainer.planner.profile import (
    SHIPPED,
    CollectiveProfile,
    FsdpHost,
    ModelLayout,
    Profile,
    collective_sizes,
    device_name,
    measure_collectives,
    measure_fsdp_hosts,
    model_layout,
    profile_blocks,
    profile_file,
    profile_optimizer,
    profile_parts,
    read_profile,
)
from vitctl.trainer.planner.search import SearchResult, search

from .out_file import replacing_refusal

PROFILE_BATCH = {"cuda": 32, "cpu": 4}  # samples per measurement (and a quarter of it); lines are fitted through both
MOST_GIB = 1024  # --memory-gib at most: above any GPU's memory (the largest, in 2026, hold under 300 GiB)


@dataclass(frozen=True)
class PlanRequest:
    model: str
    img_size: int
    nodes: int
    gpus: int  # per node
    memory_gib: float  # per GPU
    batch: int  # global: all data-parallel ranks together
    profile: Path | None  # None: the cached or shipped profile of this machine's GPU type


@dataclass(frozen=True)
class PlanOutcome:
    request: PlanRequest
    layout: ModelLayout
    profile: Profile
    profile_path: Path
    result: SearchResult

    @property
    def world(self) -> int:
        return self.request.nodes * self.request.gpus


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vitctl" / "profiles"


def visible_gpus() -> int:
    return torch.cuda.device_count()


def local_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def plan(request: PlanRequest, echo: Callable[[str], None]) -> PlanOutcome:
    """Search the strategy of `request`; the outcome's `result.best` is None when nothing fits (write_plan says)."""
    layout = model_layout(request.model, request.img_size)
    profile, path = load_profile(request.model, request.img_size, request.profile, echo)
    cluster = Cluster(request.nodes, request.gpus, ALLOCATOR_ROOM)
    if warning := _extrapolated(profile, cluster):
        echo(f"warning: {warning}")
    return PlanOutcome(request, layout, profile, path,
                       search(layout, profile, cluster, request.batch, request.memory_gib * 2**30))


def _extrapolated(profile: Profile, cluster: Cluster) -> str | None:
    """More ranks than the profile measured collectives among: their times are the fits' extrapolation."""
    measured = max((c.ranks for c in profile.collectives), default=0)
    if cluster.world <= measured:
        return None
    return (f"the profile measured collectives among {measured} GPUs at most; the times of {cluster.world} are "
            "extrapolated from them (a profile measured on more GPUs, `vitctl plan --profile-only` across their "
            "nodes, gives a closer plan)")


def write_plan(outcome: PlanOutcome, out: Path) -> None:
    """The plan file of the searched strategy; ConfigError when no strategy fits the budget."""
    request, best = outcome.request, outcome.result.best
    if best is None:
        raise ConfigError(_no_fit(outcome))
    p = best.prediction
    _write(out, best.strategy.to_json(request.model, outcome.world, predicted={
        "step_s": round(p.step_s, 4), "peak_gib": round(p.peak_gib, 2), "room_gib": round(p.room_bytes / 2**30, 2),
        "images_per_s": round(p.images_per_s, 1)}, img_size=request.img_size, batch_size=per_rank_batch(outcome)),
           "choose another --out")


def per_rank_batch(outcome: PlanOutcome) -> int:
    """The samples per data-parallel rank of the searched plan (its --batch is all data-parallel ranks')."""
    s = outcome.result.best.strategy
    return outcome.request.batch // (outcome.world // (s.tp * s.pp))


def check_out(out: Path) -> None:
    """Refuse an --out that cannot be written before the search, whose profile may first take minutes to measure, or
    that holds something other than a plan (the profile, notes), which the plan would replace."""
    if refusal := replacing_refusal(out):
        raise ConfigError(refusal)
    if out.exists() and not is_plan(out):
        raise ConfigError(f"--out {out} already holds a file that is not a plan; choose another --out, or move {out} "
                          "away first")
    if blocker := file_in_the_way(out.absolute().parent):
        raise ConfigError(_file_in_the_way(out, blocker, "choose another --out"))
    if refusal := write_refusal(out):
        raise ConfigError(f"cannot write the plan {out}: {refusal}; choose another --out")


def _no_fit(outcome: PlanOutcome) -> str:
    r, least = outcome.request, outcome.result.least
    if least is None:
        return (f"no strategy for {r.model} on {r.nodes} x {r.gpus} GPUs with a global batch of {r.batch} fits in "
                f"--memory-gib {r.memory_gib:g}; raise --memory-gib, add GPUs (--nodes, --gpus) or lower --batch")
    least_gib = math.ceil(least.prediction.needs_bytes / 2**30 * 100) / 100  # rounded up: the figure given then fits
    if least_gib > MOST_GIB:
        return (f"no strategy for {r.model} on {r.nodes} x {r.gpus} GPUs with a global batch of {r.batch} fits in "
                f"--memory-gib {r.memory_gib:g}; the least any searched strategy needs is {least_gib:,.1f} GiB a GPU, "
                f"more than any GPU holds: add GPUs (--nodes, --gpus) or lower --batch")
    # A budget within the allocator's room fits no plan on any number of GPUs or at any batch.
    within_room = r.memory_gib * 2**30 <= min(ALLOCATOR_ROOM)
    elsewhere = "" if within_room else ", or add GPUs (--nodes, --gpus) or lower --batch"
    return (f"no strategy for {r.model} on {r.nodes} x {r.gpus} GPUs with a global batch of {r.batch} fits in "
            f"--memory-gib {r.memory_gib:g}; the least any searched strategy needs is {least_gib:g} GiB "
            f"({least.strategy.layout(outcome.world)}, {_blocks(least.strategy)}): pass --memory-gib "
            f"{least_gib:g} or more{elsewhere}")


def _blocks(strategy: Strategy) -> str:
    """How a strategy keeps its blocks, as the plan's table names it: e.g. `every block fsdp, checkpoint full`."""
    kinds = Counter(("fsdp" if b.fsdp else "dp", b.checkpoint) for b in strategy.blocks)
    if len(kinds) == 1:
        (weights, checkpoint), = kinds
        return f"every block {weights}, checkpoint {checkpoint}"
    return "; ".join(f"{n} blocks {weights}, checkpoint {checkpoint}" for (weights, checkpoint), n in kinds.items())


def load_profile(model: str, img_size: int, path: Path | None,
                 echo: Callable[[str], None]) -> tuple[Profile, Path]:
    """The profile at `path`; else the cached or shipped one of this GPU type and torch; else, on a GPU, one
    measured now (and cached)."""
    if path is None:
        device = local_device()
        name = profile_file(device_name(device), torch.__version__, model, img_size)
        path = next((folder / name for folder in (cache_dir(), SHIPPED) if (folder / name).exists()), None)
        if path is None and device.type == "cpu":
            raise ConfigError(_missing(model, img_size, name))
        if path is None:
            _check_cache(model, img_size, device)
            echo(f"no profile of {model} at {img_size} px for {device_name(device)} yet: measuring it (minutes)")
            path = save_profile(measure_profile(model, img_size, device,
                                                *local_measurements(model, img_size, visible_gpus(), device)))
    return read_profile(path, model, img_size), path


def _missing(model: str, img_size: int, name: str) -> str:
    shipped = sorted(SHIPPED.glob(f"*-{model}-{img_size}.json"))
    known = f"; profiles shipped for it: {', '.join(map(str, shipped))} (pass one with --profile)" if shipped else ""
    return (f"no profile {name} in {cache_dir()} or {SHIPPED}, and this machine has no GPU to measure one "
            f"(`--profile-only` here measures this CPU){known}; "
            f"measure it on a GPU node with `vitctl plan --profile-only --model {model} --img-size {img_size}` and "
            f"pass the file it writes with --profile")


def measure_profile(model: str, img_size: int, device: torch.device, collectives: tuple[CollectiveProfile, ...],
                    fsdp_hosts: tuple[FsdpHost, ...]) -> Profile:
    """Blocks, parts and the optimizer measured on `device`, with what was measured among ranks."""
    batch = PROFILE_BATCH[device.type]
    return Profile(device_name(device), torch.__version__, model, img_size,
                   profile_blocks(model, img_size, batch, device), profile_parts(model, img_size, batch, device),
                   profile_optimizer(device), collectives, fsdp_hosts)


CACHE_FIX = "point XDG_CACHE_HOME at a folder this user can write, where profiles are cached"


def save_profile(profile: Profile, folder: Path | None = None) -> Path:
    path = (folder or cache_dir()) / profile_file(profile.device, profile.torch, profile.model, profile.img_size)
    _write(path, profile.to_json(), CACHE_FIX)
    return path


def _check_cache(model: str, img_size: int, device: torch.device) -> None:
    """Refuse before minutes of measuring a profile that could not be cached."""
    path = cache_dir() / profile_file(device_name(device), torch.__version__, model, img_size)
    if blocker := file_in_the_way(path.parent):
        raise ConfigError(_file_in_the_way(path, blocker, CACHE_FIX))
    if refusal := write_refusal(path):
        raise ConfigError(f"cannot write {path}: {refusal}; {CACHE_FIX}")


def _write(path: Path, text: str, fix: str) -> None:
    """Write `path` atomically; ConfigError ending with `fix` when the file system refuses."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with partial_open(path, "w") as f:
            f.write(text)
        publish(path)
    except OSError as e:
        blocker = file_in_the_way(path.parent)
        raise ConfigError(_file_in_the_way(path, blocker, fix) if blocker else
                          f"cannot write {path} ({e.strerror}); {fix}") from None


def _file_in_the_way(path: Path, blocker: Path, fix: str) -> str:
    return f"cannot write {path}: {what_it_is(blocker)}, not a folder; {fix}"


def cpu_profile_warning(profile: Profile, path: Path) -> str | None:
    """A profile measured on the CPU (`--profile-only` where there is no GPU) plans GPUs from a CPU's timings."""
    if profile.device != "cpu":
        return None
    return (f"profile {path} was measured on the CPU: the plan's timings, and the strategy picked from them, are a "
            f"CPU's, not a GPU's; measure one on a GPU node (`vitctl plan --profile-only --model {profile.model} "
            f"--img-size {profile.img_size}`) and pass it with --profile")


def profile_only(model: str, img_size: int, ranks: int | None) -> Path | None:
    """Measure and cache this machine's profile: what needs several ranks among `ranks` local ranks (default: every
    GPU, or 2 CPU ranks), spawned here, or among all ranks when a launcher (torchrun) started one process per GPU, of
    which rank 0 then measures the rest and returns the file (the others None)."""
    model_layout(model, img_size)  # a bad model or image size fails before minutes of measuring
    device = local_device()
    _check_cache(model, img_size, device)
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:
        among = local_measurements(model, img_size, ranks or visible_gpus() or 2, device)
        return save_profile(measure_profile(model, img_size, device, *among))
    env = init_distributed(use_cuda=device.type == "cuda")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count() or 1))
    among = measure_among_ranks(model, img_size, local, env.device)
    dist.destroy_process_group()
    return save_profile(measure_profile(model, img_size, env.device, *among)) if env.is_main else None


def measure_among_ranks(model: str, img_size: int, local: int, device: torch.device
                        ) -> tuple[tuple[CollectiveProfile, ...], tuple[FsdpHost, ...]]:
    """The collectives, then FSDP blocks' host times, among groups of the first node's `local` ranks; every rank of
    the initialised default group calls it, rank 0's answer holds every group's measurement."""
    return (measure_collectives(local, collective_sizes(device)),
            measure_fsdp_hosts(model, img_size, PROFILE_BATCH[device.type] // 4, local, device))


def local_measurements(model: str, img_size: int, ranks: int, device: torch.device
                       ) -> tuple[tuple[CollectiveProfile, ...], tuple[FsdpHost, ...]]:
    """`measure_among_ranks` in `ranks` processes spawned on this machine, one per GPU (NCCL) or CPU ranks (gloo);
    nothing for one rank."""
    if ranks == 1:
        return (), ()
    results = mp.Manager().dict()
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_measuring_rank, args=(model, img_size, ranks, f"file://{folder}/init", device.type, results),
                 nprocs=ranks)
    return results[0]


def _measuring_rank(rank: int, model: str, img_size: int, ranks: int, init: str, device_type: str,
                    results: dict) -> None:
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=init, rank=rank,
                            world_size=ranks)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    measured = measure_among_ranks(model, img_size, ranks, device)
    if rank == 0:
        results[0] = measured
    dist.destroy_process_group()
