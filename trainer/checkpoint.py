"""Checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards, and a load reshards them
onto any number of ranks and any data-parallel layout.

A checkpoint is a folder `checkpoints/step-NNNNNNNN/`: DCP's files plus `meta.json` (step, data position, world
size, config, and the sha256 of each of DCP's files). It is written under a hidden temporary name and renamed by rank 0
once DCP's metadata and meta.json are durable, so a half-written checkpoint is never taken for a complete one; every
read checks the checksums first, so a damaged one is never taken for an intact one. The last K are kept. The run folder
must be on a filesystem every node sees (as Slurm clusters' shared filesystems are): a load may read any rank's
files.
"""

import json
import logging
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from vitctl.datasets.atomic import fsync_dir, write_json_atomic

from .config import ConfigError
from .integrity import files_sha256

log = logging.getLogger("vitctl.checkpoint")
FORMAT = "vitctl-checkpoint/2"
META = "meta.json"
NAME = re.compile(r"step-(\d{8})")
LEGACY_NAME = re.compile(r"step-(\d{8})\.pt")  # single-file checkpoints of vitctl 0.1's first releases
# DCP warns at every save and load in one process (also from an async save's thread): that is what a 1-rank run means.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def is_checkpoint(path: Path) -> bool:
    return (path / META).is_file() and (path / ".metadata").is_file()


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (one being written has a hidden temporary name)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if NAME.fullmatch(p.name) and is_checkpoint(p))


def legacy_checkpoints(run_dir: Path) -> list[Path]:
    folder = checkpoint_dir(run_dir)
    return sorted(p for p in folder.iterdir() if LEGACY_NAME.fullmatch(p.name)) if folder.is_dir() else []


def checkpoints_to_resume(run_dir: Path, resume: bool) -> list[Path]:
    """The run folder's checkpoints; refuses to start afresh over them (that would mix two runs)."""
    found, legacy = list_checkpoints(run_dir), legacy_checkpoints(run_dir)
    if (found or legacy) and not resume:
        last = (found or legacy)[-1]
        raise ConfigError(f"{run_dir} already holds checkpoints (last: {last.name}); pass --resume to continue that "
                          "run, or choose another --out")
    if legacy and not found:
        raise ConfigError(f"{run_dir} holds only single-file checkpoints of an earlier vitctl ({legacy[-1].name}), "
                          f"which --resume cannot continue; start a new run from its weights with --out NEW "
                          f"--from-ckpt {legacy[-1]} (vitctl finetune)")
    return found


def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / META).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(_damaged(path, f"{META} is not readable JSON ({e})")) from None
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a vitctl checkpoint ({FORMAT})")
    return meta


def read_checked(path: Path) -> dict[str, Any]:
    """meta.json of a checkpoint whose files all match the checksums taken when it was saved. Under
    torch.distributed every rank calls it, and each hashes its share of the files."""
    meta = read_meta(path)
    recorded = meta.get("files", {})  # checkpoints of vitctl releases before checksums have none
    names = sorted(recorded)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problems = _mismatches(path, names[rank::world], recorded)
    if world > 1:
        gathered: list[list[str]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, problems)
        problems = sorted(p for part in gathered for p in part)
    if problems:
        raise ConfigError(_damaged(path, "; ".join(problems)))
    return meta


def _mismatches(path: Path, names: list[str], recorded: dict[str, dict[str, Any]]) -> list[str]:
    problems, same_size = [], []
    for name in names:
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None:
            problems.append(f"{name} is missing")
        elif size != recorded[name]["bytes"]:
            problems.append(f"{name} has {size} bytes, not the {recorded[name]['bytes']} it was saved with")
        else:
            same_size.append(name)
    digests = files_sha256([path / name for name in same_size])
    return problems + [f"{name} does not match the sha256 taken when it was saved"
                       for name, digest in zip(same_size, digests, strict=True) if digest != recorded[name]["sha256"]]


def _damaged(path: Path, what: str) -> str:
    """How to go on without the damaged checkpoint `path`: its run folder's previous one, where there is one."""
    earlier = [p for p in list_checkpoints(path.parent.parent) if p.name < path.name]
    aside = f"mv {path} {path}.damaged"
    if not earlier:
        return (f"checkpoint {path} is damaged: {what}. Its run folder holds no earlier checkpoint: move it aside "
                f"({aside}) and --resume starts the run afresh; or finetune from another checkpoint")
    return (f"checkpoint {path} is damaged: {what}. To go on from the previous checkpoint, {earlier[-1].name}, move "
            f"this one aside ({aside}): --resume, `vitctl export` and --from-ckpt of the run folder then take it")


def _partial(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


class CheckpointWriter:
    """Every rank calls `save`; rank 0 publishes the folder once complete. With `async_save`, DCP writes in the
    background from a staged copy and the training continues; the next save, `wait` or `poll` publishes it."""

    def __init__(self, run_dir: Path, keep: int, is_main: bool, async_save: bool) -> None:
        self.folder, self.keep, self.is_main = checkpoint_dir(run_dir), keep, is_main
        self.async_save = async_save
        # DCP's collectives for a background save run on their own gloo group, off the training's NCCL stream.
        self.group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        self.pending: tuple[Any, Path, dict] | None = None

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], blocking: bool = False) -> None:
        self.wait()
        path = self.folder / f"step-{step:08d}"
        tmp = _partial(path)
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crash at this step in an earlier attempt
            tmp.mkdir(parents=True)
        if dist.is_initialized():
            dist.barrier()
        if self.async_save and not blocking:
            self.pending = (dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group,
                                           no_dist=not dist.is_initialized()), path, meta)
            return
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        self._publish(path, meta)

    def poll(self) -> None:
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is not None:
            future, path, meta = self.pending
            self.pending = None
            future.result()
            self._publish(path, meta)

    def _publish(self, path: Path, meta: dict[str, Any]) -> None:
        if not self.is_main:
            return
        tmp = _partial(path)
        names = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != META)
        files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": digest}
                 for name, digest in zip(names, files_sha256([tmp / name for name in names]), strict=True)}
        write_json_atomic(tmp / META, {"format": FORMAT, **meta, "files": files})
        fsync_dir(tmp)
        shutil.rmtree(path, ignore_errors=True)  # a complete checkpoint of this step from an earlier attempt
        tmp.rename(path)
        fsync_dir(self.folder)
        for old in list_checkpoints(self.folder.parent)[:-self.keep]:
            shutil.rmtree(old)
        log.info("checkpoint %s", path)


def remove_partial(run_dir: Path) -> None:
    """Temporary folders of saves that never finished (a crash, a kill): nothing can resume from them."""
    folder = checkpoint_dir(run_dir)
    if folder.is_dir():
        for stale in folder.glob(".step-*.partial"):
            shutil.rmtree(stale, ignore_errors=True)


def load(path: Path, state: dict[str, Any]) -> None:
    """Fill `state` (the same structure a save was given, on this run's layout) from the checkpoint: DCP reads
    each rank's part, resharding as needed."""
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())


def saved_keys(path: Path) -> set[str]:
    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def shape_mismatches(path: Path, model: dict[str, torch.Tensor]) -> list[str]:
    """The model tensors whose saved (whole) shape differs from this run's, as 'name saved -> now'."""
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    found = []
    for name, tensor in model.items():
        meta = stored.get(f"model.{name}")
        if isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(tensor.shape):
            found.append(f"{name} {tuple(meta.size)} -> {tuple(tensor.shape)}")
    return found


def consolidated(path: Path, prefix: str = "model") -> dict[str, torch.Tensor]:
    """Whole tensors of one part of a checkpoint (`model` or `ema`), named as the model names its parameters;
    gathered from every rank's shards by one process, after the checkpoint's checksums are verified."""
    read_checked(path)
    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in stored.items()
             if key.startswith(f"{prefix}.") and isinstance(meta, TensorStorageMetadata)}
    if not state:
        raise ConfigError(f"{path} holds no {prefix} weights")
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return {key.removeprefix(f"{prefix}."): tensor for key, tensor in state.items()}


def resolve_checkpoint(path: Path, step: int | None = None) -> Path:
    """A checkpoint folder from a run folder (its last, or the one of `step`) or a checkpoint folder itself."""
    if is_checkpoint(path):
        if step is not None and (saved := read_meta(path)["step"]) != step:
            raise ConfigError(_not_of_step(path, saved, step))
        return path
    found = list_checkpoints(path)
    if not found:
        raise ConfigError(f"{path} is neither a checkpoint folder nor a run folder with checkpoints")
    if step is None:
        return found[-1]
    match = [p for p in found if int(NAME.fullmatch(p.name).group(1)) == step]
    if not match:
        raise ConfigError(f"{path} has no checkpoint of step {step}; it has steps "
                          f"{', '.join(str(int(p.name[5:])) for p in found)}")
    return match[0]


def _not_of_step(path: Path, saved: int, step: int) -> str:
    """A checkpoint folder given with the step of another: drop --step, or let its run folder pick the step."""
    run = path.parent.parent
    within = f", or give its run folder {run} with --step {step}" if path in list_checkpoints(run) else ""
    return f"{path} is the checkpoint of step {saved}, not of --step {step}: drop --step to take this one{within}"


# ---------------------------------------------------------------- random streams, as tensors


def rng_state() -> dict[str, torch.Tensor]:
    """This process's random streams as tensors (saved as tensors, loaded without unpickling)."""
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, python_gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
             "numpy_rest": torch.tensor([pos, has_gauss, gauss], dtype=torch.float64),
             "python": torch.tensor([version, *internal], dtype=torch.int64),
             "python_gauss": torch.tensor([float("nan") if python_gauss is None else python_gauss],
                                          dtype=torch.float64)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    pos, has_gauss, gauss = state["numpy_rest"].tolist()
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), int(pos), int(has_gauss), gauss))
    version, *internal = state["python"].tolist()
    python_gauss = state["python_gauss"].item()
    random.setstate((version, tuple(internal), None if python_gauss != python_gauss else python_gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
