"""Op seams and the registry that maps each seam to implementations: reference, sdpa, apex, torch-fused, cuda, cudnn.

A model is built with an `Ops` bundle; `resolve` picks, per seam, the best available implementation that
`--fused` allows, and logs every fallback.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("vitctl.ops")

SEAMS = ("window_partition", "window_merge", "window_attention", "attention", "layer_norm", "mlp", "optimizer")


@dataclass(frozen=True)
class Impl:
    name: str
    fn: Callable
    priority: int  # the best available implementation has the highest
    unavailable: Callable[[torch.device], str | None]  # why it cannot run on that device, or None
    under_compile: bool = True  # False: torch.compile does better with the reference (it fuses across it)
    in_eager: bool = True  # False: it beats the reference only under torch.compile


REGISTRY: dict[str, dict[str, Impl]] = {seam: {} for seam in SEAMS}


def first_line(e: Exception) -> str:
    """An exception's first line, cut to 200 characters: how an unavailable implementation says why."""
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


def register(seam: str, name: str, priority: int,
             unavailable: Callable[[torch.device], str | None] = lambda device: None,
             under_compile: bool = True, in_eager: bool = True) -> Callable:
    def add(fn: Callable) -> Callable:
        REGISTRY[seam][name] = Impl(name, fn, priority, unavailable, under_compile, in_eager)
        return fn
    return add


@dataclass(frozen=True)
class Ops:
    window_partition: Callable
    window_merge: Callable
    window_attention: Callable
    attention: Callable
    layer_norm: Callable
    mlp: Callable
    optimizer: Callable
    chosen: tuple[tuple[str, str], ...]  # (seam, implementation name)

    def describe(self) -> str:
        return ", ".join(f"{seam}={name}" for seam, name in self.chosen)


def parse_fused(spec: str) -> dict[str, str | None]:
    """`all`, `none`, or a comma-separated list of seams, each optionally `seam=implementation`.

    Returns seam -> the implementation asked for (None: the best available). `all,optimizer=apex` asks for
    the best everywhere and apex's FusedAdam for the optimizer.
    """
    if not spec.strip():
        raise ValueError("--fused is empty; give all (the best available ops), none (the reference ops) or "
                         f"seams from {', '.join(SEAMS)}, comma-separated")
    wanted: dict[str, str | None] = {}
    for item in (s.strip() for s in spec.split(",")):
        seam, _, impl = item.partition("=")
        if item == "all":
            wanted |= {s: wanted.get(s) for s in SEAMS}
        elif item in ("none", ""):  # "" : a stray comma
            continue
        elif seam not in SEAMS:
            raise ValueError(f"--fused: unknown op {seam!r}; choose from all, none, {', '.join(SEAMS)}")
        elif impl and impl not in REGISTRY[seam]:
            raise ValueError(f"--fused: {seam} has no implementation {impl!r}; it has {', '.join(REGISTRY[seam])}")
        else:
            wanted[seam] = impl or None
    return wanted


def unavailable_asked(spec: str, device: torch.device) -> list[str]:
    """Why each implementation `spec` names (`seam=implementation`) cannot run on `device`: named, it is not
    swapped for another."""
    return [f"--fused {seam}={impl}: {impl} cannot run on {device} ({why}); drop '={impl}' to take the best one "
            "that can"
            for seam, impl in parse_fused(spec).items()
            if impl is not None and (why := REGISTRY[seam][impl].unavailable(device))]


def _pick(seam: str, device: torch.device, asked: str | None, compiling: bool) -> Impl:
    candidates = sorted(REGISTRY[seam].values(), key=lambda i: (i.name != asked, -i.priority))
    skipped = []
    for impl in candidates:
        reason = impl.unavailable(device)
        if reason is None and compiling and not impl.under_compile and impl.name != asked:
            reason = "torch.compile fuses the reference better"
        if reason is None and not compiling and not impl.in_eager and impl.name != asked:
            reason = "faster than the reference only under torch.compile"
        if reason is None:
            if skipped:
                log.warning("op %s: %s; using %s", seam, "; ".join(skipped), impl.name)
            return impl
        skipped.append(f"{impl.name} unavailable ({reason})")
    raise AssertionError(f"no implementation of {seam}")  # reference is always available


def report(device: torch.device) -> list[tuple[str, str, str | None]]:
    """(seam, implementation, why it is unavailable or None) for every registered implementation."""
    return [(seam, impl.name, impl.unavailable(device))
            for seam in SEAMS for impl in sorted(REGISTRY[seam].values(), key=lambda i: -i.priority)]


def resolve(fused: str, device: torch.device, compiling: bool = False) -> Ops:
    """The Ops bundle for `--fused` on `device` (`compiling`: the model will run under torch.compile)."""
    wanted = parse_fused(fused)
    chosen = {seam: (_pick(seam, device, wanted[seam], compiling) if seam in wanted else REGISTRY[seam]["reference"])
              for seam in SEAMS}
    # Not logged here: checks build models too (on the meta device, with the reference ops); a run's log line names
    # the ops it trains with.
    return Ops(**{seam: impl.fn for seam, impl in chosen.items()},
               chosen=tuple((seam, impl.name) for seam, impl in chosen.items()))


from . import apex_ops, cuda, cudnn_attention, reference, sdpa  # noqa: E402, F401  (importing them registers the implementations)
