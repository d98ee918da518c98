"""Write WebDataset shards: a seeded plan, one independent writer process per shard, resumable."""

import hashlib
import json
import os
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import manifest as mf
from .atomic import PARTIAL_SUFFIX, partial_open, partial_path, publish
from .errors import DataError
from .ilsvrc import WNID
from .images import to_rgb_jpeg
from .parallel import run_tasks
from .tarscan import BLOCK, padded
from .tarwrite import UstarWriter

JSON_BYTES_ESTIMATE = 96
Progress = Callable[[int], None]


@dataclass(frozen=True)
class ShardSpec:
    maxsize: int = 1 << 30
    maxcount: int = 10_000
    seed: int = 0
    on_bad_image: str = "skip"

    def validate(self) -> None:
        if self.maxsize < 10_000:
            raise DataError(f"--maxsize must be at least 10KB, got {self.maxsize} bytes")
        if self.maxcount < 1:
            raise DataError(f"--maxcount must be at least 1, got {self.maxcount}")
        if self.on_bad_image not in ("skip", "fail"):
            raise DataError(f"--on-bad-image must be skip or fail, got {self.on_bad_image!r}")


# A sample as planned: (source path relative to the root, key, label, bytes on disk).
Sample = tuple[str, str, int, int]


def list_classes(root: Path) -> list[str]:
    """Sorted WNIDs of the train split (else val): the sorted-WNID label convention."""
    for split in ("train", "val"):
        folder = root / split
        if folder.is_dir():
            wnids = sorted(e.name for e in os.scandir(folder) if e.is_dir() and WNID.fullmatch(e.name))
            if wnids:
                return wnids
    raise DataError("no class folders found under train/ or val/", str(root),
                    "run `vitctl data extract` (and `vitctl data valprep` for val) first")


def list_samples(root: Path, split: str, classes: list[str]) -> list[Sample]:
    folder = root / split
    if not folder.is_dir():
        raise DataError(f"no {split}/ folder", str(root), f"extract the {split} archive first")
    flat = [e.name for e in os.scandir(folder) if e.is_file()]
    if flat:
        raise DataError(f"{len(flat)} images lie directly in {split}/ (e.g. {flat[0]})", str(folder),
                        "run `vitctl data valprep` to move them into WNID folders")
    label_of = {wnid: i for i, wnid in enumerate(classes)}
    samples, keys = [], {}
    for wnid in sorted(e.name for e in os.scandir(folder) if e.is_dir()):
        if wnid not in label_of:
            raise DataError(f"class folder {wnid} is not among the {len(classes)} train classes", str(folder))
        for entry in sorted(os.scandir(folder / wnid), key=lambda e: e.name):
            key = entry.name.split(".", 1)[0]
            if key in keys:
                raise DataError(f"two images share the key {key!r}: {keys[key]} and {split}/{wnid}/{entry.name}",
                                str(folder), "rename one of them")
            keys[key] = f"{split}/{wnid}/{entry.name}"
            samples.append((keys[key], key, label_of[wnid], entry.stat().st_size))
    if not samples:
        raise DataError(f"no images under {split}/", str(folder))
    return samples


def sample_bytes(size: int) -> int:
    """Bytes a sample takes in a shard: three headers, image, label and metadata, padded."""
    return 3 * BLOCK + padded(size) + BLOCK + padded(JSON_BYTES_ESTIMATE)


def plan_shards(samples: list[Sample], spec: ShardSpec) -> list[list[Sample]]:
    """Seeded shuffle, then cut into shards by count and estimated size."""
    order = list(samples)
    random.Random(spec.seed).shuffle(order)
    shards, current, current_bytes = [], [], 2 * BLOCK
    for sample in order:
        size = sample_bytes(sample[3])
        if current and (len(current) >= spec.maxcount or current_bytes + size > spec.maxsize):
            shards.append(current)
            current, current_bytes = [], 2 * BLOCK
        current.append(sample)
        current_bytes += size
    shards.append(current)
    return shards


def plan_digest(shards: list[list[Sample]], spec: ShardSpec) -> str:
    h = hashlib.sha256(json.dumps(asdict(spec)).encode())
    for shard in shards:
        h.update(json.dumps(shard).encode())
    return h.hexdigest()


class _HashingFile:
    def __init__(self, f) -> None:
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        self.sha256.update(data)
        self.bytes += len(data)
        self.f.write(data)


def write_shard(root: Path, path: Path, samples: list[Sample], wnids: list[str], on_bad_image: str) -> dict[str, Any]:
    """Write one shard under its temporary name (`publish` names it); returns its manifest entry."""
    conversions, skipped, labels = [], [], []
    with partial_open(path) as f:
        out = _HashingFile(f)
        tar = UstarWriter(out)
        for source, key, label, _ in samples:
            data = (root / source).read_bytes()
            try:
                jpeg, conversion = to_rgb_jpeg(data, source)
            except DataError as e:
                if on_bad_image == "fail":
                    raise DataError(f"{e.what}; rerun with --on-bad-image skip to leave it out", source) from None
                skipped.append({"source": source, "reason": e.what})
                continue
            if conversion:
                conversions.append({"source": source, "conversion": conversion})
            tar.add(f"{key}.cls", str(label).encode())
            tar.add(f"{key}.jpg", jpeg)
            tar.add(f"{key}.json", json.dumps({"wnid": wnids[label], "source": source}).encode())
            labels.append(label)
        tar.close()
    return {"name": path.name, "samples": len(labels), "bytes": out.bytes, "sha256": out.sha256.hexdigest(),
            "conversions": conversions, "skipped": skipped, "labels": mf.encode_labels(labels)}


def _check_folder(out: Path, manifest: dict[str, Any] | None) -> None:
    """Refuse a folder holding files that vitctl did not write."""
    ours = {mf.MANIFEST}
    foreign = []
    for entry in os.scandir(out):
        name = entry.name.removeprefix(".").removesuffix(PARTIAL_SUFFIX)
        stem = name.removesuffix(".idx") + ".tar" if name.endswith(".idx") else name
        if name in ours or (mf.SHARD_NAME.fullmatch(stem) and manifest is not None):
            continue
        foreign.append(entry.name)
    if foreign:
        raise DataError(f"the output folder holds files vitctl did not write: {', '.join(sorted(foreign)[:5])}",
                        str(out), "shard into an empty folder, or move those files away")


def shard_split(root: Path, out: Path, split: str, spec: ShardSpec, workers: int,
                progress: Progress, on_total: Callable[[int], None]) -> dict[str, Any]:
    """Shard one split into `out`, skipping shards an earlier run completed; returns its manifest entry."""
    spec.validate()
    out.mkdir(parents=True, exist_ok=True)
    manifest = mf.load(out)
    _check_folder(out, manifest)
    classes = list_classes(root)
    if manifest is None:
        manifest = mf.new(classes)
    elif manifest["classes"] != classes:
        raise DataError("the classes under the source differ from the manifest's", str(out / mf.MANIFEST),
                        "shard into a new folder")
    shards = plan_shards(list_samples(root, split, classes), spec)
    digest = plan_digest(shards, spec)
    info = manifest["splits"].get(split)
    if info is not None and info["plan"] != digest:
        raise DataError(f"{split} shards here were made from other sources or settings (seed, maxsize, maxcount)",
                        str(out), "use a new --out folder, or delete this split's shards and its manifest entry")
    info = {"plan": digest, **asdict(spec), "planned_shards": len(shards), "complete": False,
            "shards": [] if info is None else info["shards"]}
    manifest["splits"][split] = info
    done = {e["name"]: e for e in info["shards"] if (out / e["name"]).is_file()
            and (out / e["name"]).stat().st_size == e["bytes"]}
    on_total(sum(len(s) for s in shards))
    todo = []
    for i, samples in enumerate(shards):
        path = out / mf.shard_name(split, i)
        if path.name in done:
            progress(len(samples))
            continue
        partial_path(path).unlink(missing_ok=True)
        (out / mf.index_name(path.name)).unlink(missing_ok=True)  # an index of an older shard is stale
        todo.append((root, path, samples, classes, spec.on_bad_image))
    info["shards"] = sorted(done.values(), key=lambda e: e["name"])
    mf.save(out, manifest)


    def finish(entry: dict[str, Any]) -> None:
        publish(out / entry["name"])
        info["shards"] = sorted([*info["shards"], entry], key=lambda e: e["name"])
        mf.save(out, manifest)
        progress(entry["samples"] + len(entry["skipped"]))

    # One thread fsyncs and renames finished shards (and records them) while the writers go on with the next.
    with ThreadPoolExecutor(max_workers=1) as finisher:
        finished = [finisher.submit(finish, entry) for entry in run_tasks(write_shard, todo, workers)]
    for future in finished:
        future.result()
    info["complete"] = True
    mf.save(out, manifest)
    return info
