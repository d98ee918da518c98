"""A split's shards from the manifest, and the table of their samples (from our index files)."""

from dataclasses import dataclass
from pathlib import Path

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


def split_shards(folder: Path, split: str) -> tuple[list[tuple[str, int]], list[str]]:
    """[(shard name, samples)] of a split, and the class list, from the manifest."""
    manifest = mf.load(folder)
    if manifest is None:
        raise ConfigError(f"data.path {folder}: no manifest.json; prepare it with `vitctl data shard` and `index`")
    info = manifest["splits"].get(split)
    if info is None or not info["complete"]:
        raise ConfigError(f"data.path {folder}: the {split} split is missing or incomplete; run `vitctl data shard`")
    return [(e["name"], e["samples"]) for e in info["shards"]], manifest["classes"]


def read_table(folder: Path, shards: list[tuple[str, int]]) -> SampleTable:
    """Offsets of every jpg, and labels read from the cls members, via the shards' index files."""
    paths, rows, labels = [], [], []
    for i, (name, _) in enumerate(shards):
        path = folder / name
        idx = index_path(path)
        if not idx.exists():
            raise ConfigError(f"{idx} is missing; run `vitctl data index {folder}`")
        samples = parse_index(idx.read_text(), str(idx))
        paths.append(str(path))
        with open(path, "rb") as f:
            for number, sample in enumerate(samples):
                parts = {ext: (offset, size) for ext, offset, size, _ in sample}
                if "jpg" not in parts or "cls" not in parts:
                    raise ConfigError(f"{idx}: sample {number} has members {sorted(parts)}, not jpg and cls; "
                                      f"reshard {folder} with `vitctl data shard`")
                f.seek(parts["cls"][0])
                labels.append(int(f.read(parts["cls"][1])))
                rows.append((i, *parts["jpg"]))
    table = np.array(rows, dtype=np.int64).reshape(-1, 3)
    return SampleTable(paths, table[:, 0].astype(np.int32), table[:, 1], table[:, 2].astype(np.int32),
                       np.array(labels, dtype=np.int64))
