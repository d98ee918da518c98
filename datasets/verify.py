"""Check a shard folder: manifest against shards, each index against its shard, and a decode sample."""

import hashlib
import io
import random
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from . import manifest as mf
from .errors import DataError
from .index import index_path, parse_index, shard_samples
from .parallel import run_tasks

HASH_CHUNK = 1 << 20


@dataclass
class ShardCheck:
    name: str
    problems: list[str] = field(default_factory=list)
    jpg: list[tuple[int, int, int]] = field(default_factory=list)  # (offset, size, label) for decode checks


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _labels(shard: Path, samples: list) -> list[int]:
    labels = []
    with open(shard, "rb") as f:
        for sample in samples:
            cls = next((c for c in sample if c[0] == "cls"), None)
            if cls is None:
                labels.append(-1)
                continue
            f.seek(cls[1])
            raw = f.read(cls[2])
            labels.append(int(raw) if raw.strip().isdigit() else -1)
    return labels


def check_shard(folder: Path, entry: dict) -> ShardCheck:
    """Everything about one shard and its index that can be checked without decoding."""
    shard, check = folder / entry["name"], ShardCheck(entry["name"])
    if not shard.is_file():
        check.problems.append("shard file is missing")
        return check
    size = shard.stat().st_size
    if size != entry["bytes"]:
        check.problems.append(f"size {size} bytes, manifest says {entry['bytes']}")
    elif _sha256(shard) != entry["sha256"]:
        check.problems.append("sha256 differs from the manifest (the shard changed after it was written)")
    try:
        samples = shard_samples(shard)
    except DataError as e:
        check.problems.append(e.what)
        return check
    if len(samples) != entry["samples"]:
        check.problems.append(f"{len(samples)} samples, manifest says {entry['samples']}")
    check.problems += _check_index(index_path(shard), samples, size)
    labels = _labels(shard, samples)
    if "labels" in entry and mf.decode_labels(entry["labels"]) != labels:
        check.problems.append("the labels in the manifest differ from the shard's cls members")
    check.jpg = [(c[1], c[2], label) for sample, label in zip(samples, labels, strict=True)
                 for c in sample if c[0] == "jpg"]
    return check


def _check_index(path: Path, samples: list, shard_size: int) -> list[str]:
    if not path.is_file():
        return [f"index {path.name} is missing (run `vitctl data index`)"]
    try:
        indexed = parse_index(path.read_text(), str(path))
    except DataError as e:
        return [f"index {path.name}: {e.what}"]
    problems = []
    if len(indexed) != len(samples):
        problems.append(f"index {path.name} lists {len(indexed)} samples, the shard holds {len(samples)}")
    for line, (got, want) in enumerate(zip(indexed, samples, strict=False), start=2):
        bad = [c for c in got if c[1] % 512 or c[1] + c[2] > shard_size]
        if bad:
            problems.append(f"index {path.name} line {line}: offset {bad[0][1]} is not a 512-multiple inside the shard")
        elif got != want:
            problems.append(f"index {path.name} line {line}: lists {got[0][3]} at {got[0][1]}, the shard holds "
                            f"{want[0][3]} at {want[0][1]} (an index of another shard, or the shard changed)")
        if problems:
            break
    return problems


def decode_check(shard: Path, offset: int, size: int, label: int, classes: int) -> str | None:
    with open(shard, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            if image.format != "JPEG" or image.mode != "RGB":
                return f"image at offset {offset} is {image.format} {image.mode}, expected an RGB JPEG"
    except (OSError, SyntaxError) as e:
        return f"image at offset {offset} does not decode ({e})"
    if not 0 <= label < classes:
        return f"image at offset {offset} has label {label}, outside 0..{classes - 1}"
    return None


@dataclass
class VerifyReport:
    manifest: dict
    problems: dict[str, list[str]]  # by shard name (or "split <name>"); empty when all is well
    decoded: int


def verify(folder: Path, decode: int, workers: int, seed: int = 0) -> VerifyReport:
    """Check everything in `folder`; decode `decode` random images."""
    manifest = mf.load(folder)
    if manifest is None:
        raise DataError("no manifest.json", str(folder), "pass a folder written by `vitctl data shard`")
    entries = [entry for _, entry in mf.all_shards(manifest)]
    problems: dict[str, list[str]] = {}
    for split, info in manifest["splits"].items():
        if not info["complete"] or len(info["shards"]) != info["planned_shards"]:
            problems[f"split {split}"] = [f"incomplete: {len(info['shards'])} of {info['planned_shards']} shards "
                                          "written (rerun `vitctl data shard`)"]
    listed = {e["name"] for e in entries}
    for path in sorted(folder.glob("imagenet-*.tar")):
        if path.name not in listed:
            problems[path.name] = ["shard on disk is not in the manifest"]
    checks = list(run_tasks(check_shard, [(folder, e) for e in entries], workers))
    for check in checks:
        if check.problems:
            problems[check.name] = check.problems
    pool = [(c.name, *jpg) for c in checks if not c.problems for jpg in c.jpg]
    chosen = random.Random(seed).sample(pool, min(decode, len(pool)))
    for name, offset, size, label in chosen:
        problem = decode_check(folder / name, offset, size, label, len(manifest["classes"]))
        if problem:
            problems.setdefault(name, []).append(problem)
    return VerifyReport(manifest, problems, len(chosen))
