"""A split's shards from the manifest, and the table of their samples (from our index files)."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vitctl.datasets import manifest as mf
from vitctl.datasets.index import index_path, parse_index

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


def split_shards(folder: Path, split: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The manifest's entries for a split's shards (name, samples, labels, ...), and the class list."""
    manifest = mf.load(folder)
    if manifest is None:
        raise ConfigError(f"data.path {folder}: no manifest.json; prepare it with `vitctl data shard` and `index`")
    info = manifest["splits"].get(split)
    if info is None or not info["complete"]:
        raise ConfigError(f"data.path {folder}: the {split} split is missing or incomplete; run `vitctl data shard`")
    return info["shards"], manifest["classes"]


def read_table(folder: Path, shards: list[dict[str, Any]]) -> SampleTable:
    """Offsets of every jpg from the shards' index files; labels from the manifest, or, for shards written before
    it recorded them, from each sample's cls member (a read per sample)."""
    paths, rows, labels = [], [], []
    for i, entry in enumerate(shards):
        path = folder / entry["name"]
        idx = index_path(path)
        if not idx.exists():
            raise ConfigError(f"{idx} is missing; run `vitctl data index {folder}`")
        samples = [{ext: (offset, size) for ext, offset, size, _ in sample}
                   for sample in parse_index(idx.read_text(), str(idx))]
        for number, parts in enumerate(samples):
            if "jpg" not in parts or "cls" not in parts:
                raise ConfigError(f"{idx}: sample {number} has members {sorted(parts)}, not jpg and cls; "
                                  f"reshard {folder} with `vitctl data shard`")
            rows.append((i, *parts["jpg"]))
        shard_labels = mf.decode_labels(entry["labels"]) if "labels" in entry else _read_labels(path, samples)
        if len(shard_labels) != len(samples):
            raise ConfigError(f"{path}: the manifest lists {len(shard_labels)} labels, the index {len(samples)} "
                              f"samples; run `vitctl data verify {folder}`")
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
