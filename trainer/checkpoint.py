"""Checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards, and a load reshards them
onto any number of ranks and any data-parallel layout.

A checkpoint is a folder `checkpoints/step-NNNNNNNN/`: DCP's files plus `meta.json` (step, data position, world
size, config, and the sha256 of each of DCP's files). It is written under a hidden temporary name and renamed by rank 0
once DCP's metadata and meta.json are durable, so a half-written checkpoint is never taken for a complete one; every
read checks the checksums first, so a damaged one is never taken for an intact one. The last K are kept. The run folder
must be on a filesystem every node sees (as Slurm clusters' shared filesystems are): a load may read any rank's
files.
"""

import contextlib
import errno
import json
import logging
import os
import pickle
import random
import re
import shlex
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

from vitctl.datasets.atomic import fsync_dir, write_json_atomic
from vitctl.datasets.errors import listed
from vitctl.datasets.oserrors import as_data_error

from .checkpoint_files import META, NAME, checkpoint_dir, is_checkpoint, list_checkpoints
from .config import ConfigError, as_set_value
from .integrity import files_sha256
from .runlock import LOCK

log = logging.getLogger("vitctl.checkpoint")
FORMAT = "vitctl-checkpoint/2"
LEGACY_NAME = re.compile(r"step-(\d{8})\.pt")  # single-file checkpoints of vitctl 0.1's first releases
# What meta.json must hold, and of which type: it is not checksummed itself (it holds the checksums).
META_KEYS = {"step": int, "position": dict, "world_size": int, "mesh": dict, "config": dict, "config.model": dict}
# DCP warns at every save and load in one process (also from an async save's thread): that is what a 1-rank run means.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def legacy_checkpoints(run_dir: Path) -> list[Path]:
    folder = checkpoint_dir(run_dir)
    return sorted(p for p in folder.iterdir() if LEGACY_NAME.fullmatch(p.name)) if folder.is_dir() else []


def _lacks(folder: Path) -> str:
    """What a step folder lacks of a checkpoint, '' when nothing."""
    lost = [name for name in (META, ".metadata") if not (folder / name).is_file()]
    return f"{' and '.join(lost)} {'are' if len(lost) > 1 else 'is'} missing" if lost else ""


def _own_files(folder: Path) -> list[Path]:
    """The files in a checkpoint folder that DCP and vitctl write."""
    return [p for p in folder.iterdir() if p.name in (META, ".metadata") or p.suffix == ".distcp"]


def _refuse_incomplete(run_dir: Path, found: list[Path]) -> None:
    """A save names its folder only once meta.json and .metadata are written, so a newer step folder that holds part
    of a checkpoint without them is damaged (a file deleted, a copy cut short): taking the checkpoint before it
    unsaid would go back in time, and a resumed run would write over it. A step folder without any is passed over."""
    folder = checkpoint_dir(run_dir)
    steps = sorted(p for p in folder.iterdir() if NAME.fullmatch(p.name) and p.is_dir()) if folder.is_dir() else []
    named = [p for p in steps if _own_files(p)]
    if named and named[-1] not in found:
        raise ConfigError(_damaged(named[-1], _lacks(named[-1])))


def fresh_start_refused(run_dir: Path, last: Path) -> ConfigError:
    return ConfigError(f"{run_dir} already holds checkpoints (last: {last.name}); pass --resume to continue that run, "
                       "or choose another --out")


def checkpoints_to_resume(run_dir: Path, resume: bool) -> list[Path]:
    """The run folder's checkpoints; refuses to start afresh over them (that would mix two runs)."""
    found, legacy = list_checkpoints(run_dir), legacy_checkpoints(run_dir)
    _refuse_incomplete(run_dir, found)
    if (found or legacy) and not resume:
        raise fresh_start_refused(run_dir, (found or legacy)[-1])
    if legacy and not found:
        raise ConfigError(f"{run_dir} holds only single-file checkpoints of an earlier vitctl ({legacy[-1].name}), "
                          f"which --resume cannot continue; start a new run from its weights with --out NEW "
                          f"--from-ckpt {shlex.quote(str(legacy[-1]))} (vitctl finetune)")
    return found


def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / META).read_text())
    except PermissionError:
        raise ConfigError(_not_readable(path, [META])) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(_damaged(path, f"{META} is not readable JSON ({e})")) from None
    if not isinstance(meta, dict):
        raise ConfigError(_damaged(path, f"{META} holds {type(meta).__name__}, not an object"))
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a vitctl checkpoint ({FORMAT})")
    if problems := _meta_problems(meta):
        raise ConfigError(_damaged(path, f"{META}: {', '.join(problems)}"))
    return meta


def _may_read(path: Path) -> bool:
    """False only where opening `path` is refused: a missing or damaged file is named by the checksums' check."""
    try:
        path.open("rb").close()
    except PermissionError:
        return False
    except OSError:
        pass
    return True


def _not_readable(path: Path, names: list[str]) -> str:
    return (f"checkpoint {path}: this user may not read {listed(names)} (permission denied); give this user read "
            f"access to {'it' if len(names) == 1 else 'them'} (`ls -l {shlex.quote(str(path))}` shows owner and mode)")


def _meta_problems(meta: dict[str, Any]) -> list[str]:
    """meta.json's keys that are missing or of another type (checkpoints written before checksums have no files)."""
    values = {key: meta.get(key) for key in META_KEYS if key != "config.model"}
    if isinstance(meta.get("config"), dict):  # else config's own problem says enough
        values["config.model"] = meta["config"].get("model")
    problems = [f"{key} is missing" if value is None else f"{key} is not a {META_KEYS[key].__name__}"
                for key, value in values.items() if not isinstance(value, META_KEYS[key])]
    files = meta.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(f, dict) and isinstance(f.get("bytes"), int)
                                               and isinstance(f.get("sha256"), str) for f in files.values()):
        problems.append("files is not a mapping of file names to their sizes and sha256 digests")
    return problems


def model_change(path: Path, saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """None if the checkpoint's model config is this run's; else the keys set otherwise, and the two ways on: resume
    with the model as it was saved, or finetune a new run from its weights (which fits a new head, a resolution)."""
    keys = _changed_keys(saved, now)
    if not keys:
        return None
    way = f"rerun with {_sets(saved, keys)} to go on with the model it saved"
    if "name" not in keys:
        way += (f", or start a new run from its weights: `vitctl finetune --from-ckpt {shlex.quote(str(path))} "
                f"--out NEW {_sets(now, keys)}` (with the other options of this command)")
    differ = ", ".join(f"model.{k}={as_set_value(saved.get(k))} (now {as_set_value(now.get(k))})" for k in keys)
    return f"{path} was trained with model settings other than this run's: {differ}; --resume cannot change them: {way}"


def saved_model_sets(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """The `--set model.KEY=VALUE` options (each after a space) that give this run the model a checkpoint saved."""
    keys = _changed_keys(saved, now)
    return f" {_sets(saved, keys)}" if keys else ""


def _changed_keys(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    return sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))


def _sets(model: dict[str, Any], keys: list[str]) -> str:
    """The options that set `keys` as `model` has them: --model for the name (`--set model.name` beside a --model
    would be refused as set twice), --set for the rest."""
    return " ".join(f"--model {model.get(k)}" if k == "name" else f"--set model.{k}={json.dumps(model.get(k))}"
                    for k in keys)  # JSON's values are YAML's too


# What a resumed run is expected to change: how long it trains, where its data and folder are.
RESUME_MAY_CHANGE = ("train.max_steps", "train.epochs", "train.out_dir", "data.path", "finetune.from_ckpt")


def settings_change(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The config keys (model's aside: model_change refuses them; and the layout's) that a resumed run sets otherwise
    than its checkpoint was saved with, as `key=saved (now new)`."""
    changed, now = [], json.loads(json.dumps(now))  # as meta.json holds it: tuples as lists
    # parallel.*: a layout, which a resume reshards the checkpoint to; it trains the same numbers
    for section in sorted((saved.keys() | now.keys()) - {"model", "parallel"}):
        old, new = saved.get(section) or {}, now.get(section) or {}
        for key in sorted(old.keys() | new.keys()):
            if f"{section}.{key}" not in RESUME_MAY_CHANGE and old.get(key) != new.get(key):
                changed.append(f"{section}.{key}={as_set_value(old.get(key))} (now {as_set_value(new.get(key))})")
    return changed


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


def check_files(path: Path) -> None:
    """ConfigError where a file the checkpoint's meta.json records is missing, of another size or one this user may
    not read: what a launch checks at once, before any rank starts (the ranks compare every file's sha256 too)."""
    recorded = read_meta(path).get("files", {})
    if problems := _size_problems(path, sorted(recorded), recorded)[0]:
        raise ConfigError(_damaged(path, "; ".join(problems)))
    if denied := [name for name in sorted(recorded) if not _may_read(path / name)]:
        raise ConfigError(_not_readable(path, denied))


def _size_problems(path: Path, names: list[str], recorded: dict[str, dict[str, Any]]) -> tuple[list[str], list[str]]:
    """(the files missing or of another size, the names of the others)."""
    problems, same_size = [], []
    for name in names:
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None:
            problems.append(f"{name} is missing")
        elif size != recorded[name]["bytes"]:
            problems.append(f"{name} has {size} bytes, not the {recorded[name]['bytes']} it was saved with")
        else:
            same_size.append(name)
    return problems, same_size


def _mismatches(path: Path, names: list[str], recorded: dict[str, dict[str, Any]]) -> list[str]:
    problems, same_size = _size_problems(path, names, recorded)
    digests = files_sha256([path / name for name in same_size])
    return problems + [f"{name} does not match the sha256 taken when it was saved"
                       for name, digest in zip(same_size, digests, strict=True) if digest != recorded[name]["sha256"]]


def _damaged(path: Path, what: str) -> str:
    """How to go on without the damaged checkpoint `path`: its run folder's previous one, where there is one."""
    others = list_checkpoints(path.parent.parent)
    earlier = [p for p in others if p.name < path.name]
    aside = shlex.join(["mv", str(path), f"{path}.damaged"])
    if later := [p for p in others if p.name > path.name]:  # asked for by --step: the run goes on from the last
        step = int(later[-1].name.split("-")[-1])
        return (f"checkpoint {path} is damaged: {what}. A later one is what --resume and the run folder take: "
                f"export or finetune from {later[-1].name} (drop --step, or --step {step})")
    if not earlier:
        return (f"checkpoint {path} is damaged: {what}. Its run folder holds no earlier checkpoint: move it aside "
                f"({aside}) and --resume starts the run afresh; or finetune from another checkpoint")
    return (f"checkpoint {path} is damaged: {what}. To go on from the previous checkpoint, {earlier[-1].name}, move "
            f"this one aside ({aside}): --resume, `vitctl export` and --from-ckpt of the run folder then take it")


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written: the run stops, the checkpoints written before stay as they were."""


def _nbytes(state: Any) -> int:
    """The bytes of the tensors in a (nested) state: about what this rank's save writes."""
    if isinstance(state, dict):
        return sum(_nbytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(_nbytes(value) for value in state)
    if isinstance(state, DTensor):
        state = state.to_local()
    return state.numel() * state.element_size() if isinstance(state, torch.Tensor) else 0


def _causes(error: BaseException) -> list[BaseException]:
    """The error, what caused it, and what failed on each rank of a DCP CheckpointException, outermost first."""
    found: list[BaseException] = []
    pending = [error]
    while pending:
        e = pending.pop(0)
        if e is None or any(e is seen for seen in found):
            continue
        found.append(e)
        pending += [exc for exc, _ in e.failures.values()] if isinstance(e, CheckpointException) else []
        pending += [e.__cause__, e.__context__]
    return found


def _innermost(error: BaseException) -> str:
    """The error at the root of `error` as `Name: its first line` (DCP's own message is a traceback per rank)."""
    inner = next(e for e in reversed(_causes(error)) if not isinstance(e, CheckpointException))
    text = str(inner).strip()
    return f"{type(inner).__name__}: {text.splitlines()[0]}" if text else type(inner).__name__


def _write_failed(path: Path, error: BaseException, full: bool) -> str:
    """Why the save of `path` failed and how to go on. torch's writer reports a full disk as a RuntimeError ("unexpected
    pos"), without errno: `full` (less space left than the save needed) tells it apart."""
    causes = _causes(error)
    os_error = next((e for e in causes if isinstance(e, OSError) and e.errno), None)
    if os_error is None and full:
        os_error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    what = as_data_error(os_error, path.parent).what if os_error is not None else _innermost(error)
    no_room = os_error is not None and os_error.errno in (errno.ENOSPC, errno.EDQUOT)
    mend = (f"free space in {path.parent} (or move the run folder to a device with room)" if no_room else
            "mend what stopped the write (the run's log holds its traceback)")
    earlier = list_checkpoints(path.parent.parent)
    way = (f"its last checkpoint, {earlier[-1].name}, is intact: {mend}, then rerun the same command with --resume to "
           "go on from it" if earlier else f"it had saved no checkpoint yet: {mend}, then run it again")
    return (f"cannot write checkpoint {path.name} in {path.parent}: {what}. Nothing of it was kept, and the run "
            f"stopped; {way}")


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
        tmp, size = _partial(path), _nbytes(state)
        with self._writing(path, size):
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)  # left by a crash at this step in an earlier attempt
                tmp.mkdir(parents=True)
            if dist.is_initialized():
                dist.barrier()
            if self.async_save and not blocking:
                self.pending = (dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group,
                                               no_dist=not dist.is_initialized()), path, meta, size)
                return
            dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
            self._publish(path, meta)

    def poll(self) -> None:
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        if self.pending is not None:
            future, path, meta, size = self.pending
            self.pending = None
            with self._writing(path, size):
                future.result()
                self._publish(path, meta)

    @contextlib.contextmanager
    def _writing(self, path: Path, size: int) -> Iterator[None]:
        """A save that fails (a full disk, a quota, an I/O error) raises CheckpointWriteError, its unfinished folder
        removed: that frees the space, without which the rank could not even report the error (its log and result
        are written to the run folder too)."""
        try:
            yield
        except (OSError, RuntimeError, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            existing = next(p for p in (self.folder, *self.folder.parents) if p.exists())
            full = shutil.disk_usage(existing).free < size
            if self.is_main:
                shutil.rmtree(_partial(path), ignore_errors=True)
            raise CheckpointWriteError(_write_failed(path, e, full)) from e

    def _publish(self, path: Path, meta: dict[str, Any]) -> None:
        if not self.is_main:
            return
        tmp = _partial(path)
        names = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != META)
        files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": digest}
                 for name, digest in zip(names, files_sha256([tmp / name for name in names]), strict=True)}
        write_json_atomic(tmp / META, {"format": FORMAT, **meta, "files": files})
        fsync_dir(tmp)
        _clear_step_folder(path)
        tmp.rename(path)
        fsync_dir(self.folder)
        for old in list_checkpoints(self.folder.parent)[:-self.keep]:
            _remove_old(old)
        log.info("checkpoint %s", path)


def _clear_step_folder(path: Path) -> None:
    """Make way for this step's checkpoint: an earlier attempt's files of the same step are removed; anything else
    in the folder (a user's files) is moved aside with it, never deleted."""
    if path.is_symlink() or path.is_file():
        aside = _aside(path)
        path.rename(aside)
        log.warning("%s was not a checkpoint folder: moved it to %s to publish this step's checkpoint", path, aside)
        return
    if not path.is_dir():
        return
    for own in sorted(_own_files(path), key=lambda p: p.name != META):  # meta.json first
        own.unlink()
    if any(path.iterdir()):
        aside = _aside(path)
        path.rename(aside)
        log.warning("%s held files vitctl did not write (%s): moved them to %s to publish this step's checkpoint",
                    path, ", ".join(sorted(p.name for p in aside.iterdir())), aside)
    else:
        path.rmdir()


def _aside(path: Path) -> Path:
    """A free name beside `path` that no checkpoint listing takes for a step."""
    n = 1
    while (aside := path.with_name(f"{path.name}.moved-{n}")).exists() or aside.is_symlink():
        n += 1
    return aside


def _remove_old(checkpoint: Path) -> None:
    """Keep-last-K's removal of `checkpoint`: the files DCP and vitctl wrote in it (meta.json first, so that a removal
    cut short leaves no checkpoint), never anyone else's, nothing through a symbolic link. What it cannot remove is
    logged, not raised: the new checkpoint is complete either way, and the run goes on."""
    if checkpoint.is_symlink():
        log.warning("%s is a symbolic link, not a checkpoint folder of this run: left it (and what it points to) "
                    "as it is; train.keep_checkpoints no longer counts it", checkpoint)
        return
    try:
        for own in sorted(_own_files(checkpoint), key=lambda p: p.name != META):  # meta.json first
            own.unlink()
        checkpoint.rmdir()
    except OSError as e:
        why = e.strerror
        if e.errno == errno.ENOTEMPTY:
            why = f"it holds files vitctl did not write ({', '.join(sorted(p.name for p in checkpoint.iterdir()))})"
        log.warning("could not remove the old checkpoint %s (train.keep_checkpoints): %s; move out what you need of "
                    "it, then delete it", checkpoint, why)


def remove_partial(run_dir: Path) -> None:
    """Temporary folders of saves that never finished (a crash, a kill): nothing can resume from them."""
    folder = checkpoint_dir(run_dir)
    if folder.is_dir():
        for stale in folder.glob(".step-*.partial"):
            shutil.rmtree(stale, ignore_errors=True)


def load(path: Path, state: dict[str, Any]) -> None:
    """Fill `state` (the same structure a save was given, on this run's layout) from the checkpoint: DCP reads
    each rank's part, resharding as needed."""
    with _reading(path):
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """DCP's failure to read a checkpoint as one line (its CheckpointException is a BaseException, which a rank would
    not even report): damage where meta.json holds no checksums (written before vitctl took them) to rule it out.
    DCP's own warning with a traceback, on a file gone while read (a running job's rotation), is left unsaid."""
    logging.root.addFilter(_unsaid_dcp_warning)  # DCP logs to the root logger
    try:
        yield
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, CheckpointException) as e:
        if any(isinstance(cause, KeyboardInterrupt) for cause in _causes(e)):  # Ctrl-C, which DCP wraps
            raise KeyboardInterrupt from None
        if read_meta(path).get("files"):  # read_checked found every file as it was saved
            raise ConfigError(f"DCP cannot read checkpoint {path} ({_innermost(e)}), although its files match the "
                              "checksums taken when it was saved: please report it, with the traceback") from e
        raise ConfigError(_damaged(path, f"DCP cannot read it ({_innermost(e)})")) from e
    finally:
        logging.root.removeFilter(_unsaid_dcp_warning)


def _unsaid_dcp_warning(record: logging.LogRecord) -> bool:
    """Whether a record of the root logger is to be logged: not DCP's warnings of a read (the error says why)."""
    return not (record.levelno == logging.WARNING and "distributed/checkpoint" in record.pathname.replace("\\", "/"))


def _stored(path: Path) -> dict[str, Any]:
    """What the checkpoint's .metadata says it holds: each saved key's metadata."""
    with _reading(path):
        return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata


def stored_tensors(path: Path, prefix: str = "model") -> dict[str, TensorStorageMetadata]:
    """The metadata (shape, dtype) of the whole tensors of one part of a checkpoint, named as the model names them."""
    return {key.removeprefix(f"{prefix}."): meta for key, meta in _stored(path).items()
            if key.startswith(f"{prefix}.") and isinstance(meta, TensorStorageMetadata)}


def saved_keys(path: Path) -> set[str]:
    return set(_stored(path))


def shape_mismatches(path: Path, model: dict[str, torch.Tensor]) -> list[str]:
    """The model tensors whose saved (whole) shape differs from this run's, as 'name saved -> now'."""
    stored = _stored(path)
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
    state = {f"{prefix}.{key}": torch.empty(meta.size, dtype=meta.properties.dtype)
             for key, meta in stored_tensors(path, prefix).items()}
    if not state:
        raise ConfigError(f"{path} holds no EMA weights: its run was trained without train.ema_decay; drop --ema to "
                          "export its weights" if prefix == "ema" else f"{path} holds no {prefix} weights")
    with _reading(path):
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return {key.removeprefix(f"{prefix}."): tensor for key, tensor in state.items()}


def resolve_checkpoint(path: Path, step: int | None = None) -> Path:
    """A checkpoint folder from a run folder (its last, or the one of `step`) or a checkpoint folder itself."""
    if is_checkpoint(path):
        if step is not None and (saved := read_meta(path)["step"]) != step:
            raise ConfigError(_not_of_step(path, saved, step))
        return path
    if NAME.fullmatch(path.name) and path.is_dir():
        raise ConfigError(_damaged(path, _lacks(path)))
    found = list_checkpoints(path)
    if step is None or not found:
        _refuse_incomplete(path, found)
    if not found:
        raise ConfigError(_no_checkpoint(path))
    if step is None:
        return found[-1]
    match = [p for p in found if int(NAME.fullmatch(p.name).group(1)) == step]
    if not match:
        raise ConfigError(f"{path} has no checkpoint of step {step}; it has {_steps([int(p.name[5:]) for p in found])}")
    return match[0]


def _steps(steps: list[int]) -> str:
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"


def _no_checkpoint(path: Path) -> str:
    """A folder holding no checkpoint, and where the checkpoints the user meant are, as far as can be told."""
    if path.name == "checkpoints" and (found := list_checkpoints(path.parent)):
        return (f"{path} is the checkpoints folder of the run {path.parent}: pass the run folder (its last checkpoint) "
                f"or one checkpoint folder, such as {found[-1]}")
    what = f"{path} is neither a checkpoint folder nor a run folder with checkpoints"
    if unfinished := sorted(checkpoint_dir(path).glob(".step-*.partial")):
        return (f"{what}: its run stopped before its first checkpoint was complete ({unfinished[-1].name} is the "
                "save it left unfinished); resume it (--resume) until it saves one, or pass another run")
    if path.is_dir() and (weights := sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)):
        return f"{what}; it holds {weights[0]}: to finetune from it, pass that file to --from-ckpt"
    if (path / LOCK).is_file():  # a job was launched into it
        return (f"{path} is a run folder whose run has saved no checkpoint yet: a running job saves its first at step "
                f"train.checkpoint_every (`vitctl status {shlex.quote(str(path))}` shows where it is); resume a "
                "stopped one (--resume) until it saves one, or pass another run")
    return what


WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def _not_of_step(path: Path, saved: int, step: int) -> str:
    """A checkpoint folder given with the step of another: drop --step, or let its run folder pick the step where
    it has one of that step."""
    run, within = path.parent.parent, ""
    if path in (found := list_checkpoints(run)):
        steps = [int(NAME.fullmatch(p.name).group(1)) for p in found]
        within = (f", or give its run folder {run} with --step {step}" if step in steps else
                  f"; its run {run} has no checkpoint of step {step} either (it has {_steps(steps)})")
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
