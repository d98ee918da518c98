"""A split's shards from the manifest, and the table of their samples (from our index files)."""

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vitctl.datasets import manifest as mf
from vitctl.datasets.index import index_path, read_index
from vitctl.datasets.shard import shard_command

from ..config import ConfigError


@dataclass(frozen=True)
class SampleTable:
    """Where each sample's JPEG lies, and its label: one row per sample of a split, in shard order."""

    paths: list[str]
    shard: np.ndarray  # int32 index into paths
    offset: np.ndarray  # int64 byte offset of the jpg member's data
    size: np.ndarray  # int32
    label: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.label)


class SplitMissing(ConfigError):
    """The manifest has no split of that name (training goes on without evaluation when it is val)."""


class SplitIncomplete(ConfigError):
    """A `vitctl data shard` of the split began and did not finish: an error for val too, whose evaluation it would
    otherwise skip without a word."""


def split_shards(folder: Path, split: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The manifest's entries for a split's shards (name, samples, labels, ...), and the class list; each shard is
    checked to be on disk at the size the manifest records (a stat: reading them all is `vitctl data verify`'s job)."""
    manifest = mf.load(folder)
    if manifest is None and not folder.exists():  # launch checked it: a job's ranks see it gone since
        raise ConfigError(f"data.path {folder} does not exist (moved or deleted?); put the shards back there, or give "
                          "their new place as --data (with --resume, a run goes on from its last checkpoint)")
    if manifest is None:
        raise ConfigError(f"data.path {folder}: no manifest.json; prepare it with `vitctl data shard` and `index`")
    info, quoted = manifest["splits"].get(split), shlex.quote(str(folder))
    if info is None:
        raise SplitMissing(f"data.path {folder}: the {split} split is missing; shard it with `vitctl data shard ROOT "
                           f"--out {quoted} --split {split}` (ROOT: the --out of `vitctl data extract`) and `vitctl "
                           f"data index {quoted}`")
    # a split whose shard list was cut short would train on fewer samples without a word
    if mf.unfinished(info):
        raise SplitIncomplete(f"data.path {folder}: the {split} split is incomplete ({len(info['shards'])} of "
                              f"{info['planned_shards']} shards recorded); finish it with "
                              f"`{shard_command(folder, split, info)} && vitctl data index {quoted}`")
    changed = [problem for entry in info["shards"] if (problem := _changed(folder, entry))]
    if changed:
        # an index then points into other bytes, and the manifest's labels may be another shard's
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise ConfigError(f"data.path {folder}: {changed[0]}{more}: the shards changed since `vitctl data shard` "
                          f"wrote them; `vitctl data verify {quoted}` names every damaged shard and the command that "
                          "writes it again")
    return info["shards"], manifest["classes"]


def train_digest(folder: Path) -> str | None:
    """The identity of the folder's train samples (manifest.split_digest), as a checkpoint records it; None without a
    manifest or a train split."""
    manifest = mf.load(folder)
    train = manifest["splits"].get("train") if manifest else None
    return mf.split_digest(manifest["classes"], train["shards"]) if train else None


def _changed(folder: Path, entry: dict[str, Any]) -> str | None:
    """How the shard differs from its manifest entry by its size alone, or None."""
    path = folder / entry["name"]
    if not path.is_file():
        return f"shard {entry['name']} is missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"shard {entry['name']} is {size} bytes, the manifest records {entry['bytes']}"
    return None


def read_table(folder: Path, shards: list[dict[str, Any]]) -> SampleTable:
    """Offsets of every jpg from the shards' index files; labels from the manifest, or, for shards written before
    it recorded them, from each sample's cls member (a read per sample)."""
    paths, rows, labels = [], [], []
    for i, entry in enumerate(shards):
        path = folder / entry["name"]
        idx = index_path(path)
        if not idx.exists():
            raise ConfigError(f"{idx} is missing; run `vitctl data index {shlex.quote(str(folder))}`")
        samples = [{ext: (offset, size) for ext, offset, size, _ in sample}
                   for sample in read_index(idx)]
        for number, parts in enumerate(samples):
            if "jpg" not in parts or "cls" not in parts:
                raise ConfigError(f"{idx}: sample {number} has members {sorted(parts)}, not jpg and cls; "
                                  f"reshard {folder} with `vitctl data shard`")
            rows.append((i, *parts["jpg"]))
        shard_labels = mf.decode_labels(entry["labels"]) if "labels" in entry else _read_labels(path, samples)
        # the manifest's count is what preflight checks the batch against, the index's what is trained on
        if not len(shard_labels) == entry["samples"] == len(samples):
            raise ConfigError(f"{path}: the manifest records {entry['samples']} samples and {len(shard_labels)} "
                              f"labels, its index {idx.name} {len(samples)} samples; run `vitctl data verify "
                              f"{shlex.quote(str(folder))}`")
        labels += shard_labels
        paths.append(str(path))
    table = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return SampleTable(paths, table[:, 0].astype(np.int32), table[:, 1], table[:, 2].astype(np.int32),
                       np.array(labels, dtype=np.int64))


def _read_labels(path: Path, samples: list[dict[str, tuple[int, int]]]) -> list[int]:
    with open(path, "rb") as f:
        labels = []
        for parts in samples:
            f.seek(parts["cls"][0])
            labels.append(int(f.read(parts["cls"][1])))
        return labels
