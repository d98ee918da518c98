"""Check a shard folder: manifest against shards, each index against its shard, and a decode sample."""

import io
import json
import random
import shlex
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from PIL import Image, UnidentifiedImageError

from . import manifest as mf
from .errors import DataError
from .images import PIL_ERRORS
from .index import index_path, read_index, shard_samples
from .lock import check_no_writer
from .oserrors import os_errors_explained
from .parallel import run_tasks
from .shard import shard_command

# How a problem is fixed: a command (write the shard again with its split's shard command, or index again),
# or one of the pieces of advice below.
REWRITE, INDEX = "rewrite", "index"
EMPTY, EDITED, UNDECODABLE, UNPLANNED = "empty", "edited", "undecodable", "unplanned"
ADVICE = {
    EMPTY: "replace or delete the images skipped for it (manifest.json lists them), then shard into a new --out folder",
    EDITED: "manifest.json no longer describes the shard (it was edited after the shard was written): restore it, "
            "or shard into a new --out folder",
    UNDECODABLE: "replace the source image its json member names, then shard into a new --out folder",
    UNPLANNED: "move it out of the folder: no `vitctl data shard` run here planned it",
}


@dataclass
class ShardCheck:
    name: str
    problems: list[str] = field(default_factory=list)
    repair: str | None = None  # how to fix the first problem; the others follow from it
    jpg: list[tuple[int, int, int, str]] = field(default_factory=list)  # (offset, size, label, name) to decode

    def fail(self, problem: str, repair: str) -> "ShardCheck":
        self.problems.append(problem)
        self.repair = self.repair or repair
        return self


def _member(f: BinaryIO, sample: list, ext: str) -> bytes | None:
    component = next((c for c in sample if c[0] == ext), None)
    if component is None:
        return None
    f.seek(component[1])
    return f.read(component[2])


def _labels_and_wnids(shard: Path, samples: list) -> tuple[list[int], list[str | None]]:
    """Each sample's label (its cls member; -1 where it has none that reads) and the WNID its json member names."""
    labels, wnids = [], []
    with open(shard, "rb") as f:
        for sample in samples:
            raw = _member(f, sample, "cls")
            labels.append(int(raw) if raw is not None and raw.strip().isdigit() else -1)
            try:
                wnids.append(json.loads(_member(f, sample, "json") or b"{}").get("wnid"))
            except (ValueError, AttributeError):  # not JSON, or not an object: no WNID to compare
                wnids.append(None)
    return labels, wnids


def check_shard(folder: Path, entry: dict, classes: list[str]) -> ShardCheck:
    """Everything about one shard and its index that can be checked without decoding."""
    shard, check = folder / entry["name"], ShardCheck(entry["name"])
    if not shard.is_file():
        return check.fail("shard file is missing", REWRITE)
    size = shard.stat().st_size
    if size != entry["bytes"]:
        check.fail(f"size {size} bytes, manifest says {entry['bytes']}", REWRITE)
    elif mf.file_sha256(shard) != entry["sha256"]:
        check.fail("sha256 differs from the manifest (the shard changed after it was written)", REWRITE)
    try:
        samples = shard_samples(shard)
    except DataError as e:
        return check.fail(e.what, REWRITE)
    if not samples:
        check.fail("the shard holds no samples: every image planned for it was skipped, and DALI refuses an "
                   "index of none", EMPTY)
    if len(samples) != entry["samples"]:
        check.fail(f"{len(samples)} samples, manifest says {entry['samples']}", EDITED)
    for problem in _check_index(index_path(shard), samples, size):
        check.fail(problem, INDEX)
    labels, wnids = _labels_and_wnids(shard, samples)
    if "labels" in entry and mf.decode_labels(entry["labels"]) != labels:
        check.fail("the labels in the manifest differ from the shard's cls members", EDITED)
    named = next(((label, wnid) for label, wnid in zip(labels, wnids, strict=True)
                  if wnid is not None and 0 <= label < len(classes) and classes[label] != wnid), None)
    if named:  # the class list renamed in place: label -> WNID would name every image of the class wrongly
        check.fail(f"a sample of label {named[0]} is of class {named[1]} (its json member), and the manifest's class "
                   f"list names label {named[0]} {classes[named[0]]}", EDITED)
    check.jpg = [(c[1], c[2], label, c[3]) for sample, label in zip(samples, labels, strict=True)
                 for c in sample if c[0] == "jpg"]
    return check


def _check_index(path: Path, samples: list, shard_size: int) -> list[str]:
    if not path.is_file():
        return [f"index {path.name} is missing"]
    try:
        indexed = read_index(path)
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


def decode_check(shard: Path, offset: int, size: int, label: int, classes: int, member: str) -> str | None:
    """What is wrong with the image `member` of the shard, or None."""
    with open(shard, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            if image.format != "JPEG" or image.mode != "RGB":
                return f"image {member} at offset {offset} is {image.format} {image.mode}, expected an RGB JPEG"
    except UnidentifiedImageError:  # its message holds the repr of the BytesIO
        return f"image {member} at offset {offset} does not decode (not in any format Pillow reads)"
    except PIL_ERRORS as e:
        return f"image {member} at offset {offset} does not decode ({e})"
    if not 0 <= label < classes:
        return f"image {member} at offset {offset} has label {label}, outside 0..{classes - 1}"
    return None


@dataclass
class VerifyReport:
    manifest: dict
    problems: dict[str, list[str]]  # by shard name (or "split <name>"); empty when all is well
    command: str | None  # one command line that fixes the problems of the names in `fixed_by_command`
    fixed_by_command: list[str]
    advice: dict[str, list[str]]  # what to do, for problems no command fixes -> the names
    decoded: int
    gone_sources: list[str] = field(default_factory=list)  # image folders the command reads that are not here


def verify(folder: Path, decode: int, workers: int, progress: Callable[[int], None],
           on_total: Callable[[int], None], seed: int = 0) -> VerifyReport:
    """Check everything in `folder`; decode `decode` random images. `progress` counts checked shards."""
    again = f"vitctl data verify {shlex.quote(str(folder))}"
    with os_errors_explained(folder):
        check_no_writer(folder, again)
        report = _verify(folder, decode, workers, progress, on_total, seed)
        check_no_writer(folder, again)  # a writer that began meanwhile may have changed what was read
        return report


def _verify(folder: Path, decode: int, workers: int, progress: Callable[[int], None],
            on_total: Callable[[int], None], seed: int) -> VerifyReport:
    manifest = mf.load(folder)
    if manifest is None:
        raise mf.no_manifest(folder)
    entries = [entry for _, entry in mf.all_shards(manifest)]
    splits = manifest["splits"]
    problems: dict[str, list[str]] = {}
    repairs: dict[str, str] = {}  # name -> how to fix its problems
    for split, info in splits.items():
        listed_count, planned = len(info["shards"]), info["planned_shards"]
        if listed_count > planned:  # no run writes more than it planned: the manifest was edited
            problems[f"split {split}"] = [f"the manifest lists {listed_count} shards, more than the {planned} its plan "
                                          "holds"]
            repairs[f"split {split}"] = EDITED
        elif mf.unfinished(info):
            problems[f"split {split}"] = [f"incomplete: {listed_count} of {planned} shards written"]
            repairs[f"split {split}"] = REWRITE
    listed = {e["name"] for e in entries}
    for path in sorted(folder.glob("imagenet-*.tar")):
        if path.name not in listed:
            problems[path.name] = ["shard on disk is not in the manifest"]
            repairs[path.name] = REWRITE if _planned(path.name, splits) else UNPLANNED
    on_total(len(entries))
    checks = []
    train = splits.get("train")  # shard refuses to finish a train split that leaves a class without a sample
    if train and not mf.unfinished(train) and (empty := mf.classes_without_samples(manifest["classes"],
                                                                                     train["shards"])):
        problems["manifest"] = [f"class {empty[0]} (label {manifest['classes'].index(empty[0])}) has no train sample: "
                                "the class list was edited after the shards were written"]
        repairs["manifest"] = EDITED
    with closing(run_tasks(check_shard, [(folder, e, manifest["classes"]) for e in entries], workers)) as checked:
        for check in checked:
            checks.append(check)
            progress(1)
            if check.problems:
                problems[check.name], repairs[check.name] = check.problems, check.repair
    pool = [(c.name, *jpg) for c in checks if not c.problems for jpg in c.jpg]
    chosen = random.Random(seed).sample(pool, min(decode, len(pool)))
    for name, offset, size, label, member in chosen:
        problem = decode_check(folder / name, offset, size, label, len(manifest["classes"]), member)
        if problem:
            problems.setdefault(name, []).append(problem)
            repairs[name] = UNDECODABLE
    advice: dict[str, list[str]] = {}
    for name, repair in sorted(repairs.items()):
        if repair in ADVICE:
            advice.setdefault(ADVICE[repair], []).append(name)
    fixed = sorted(name for name, repair in repairs.items() if repair not in ADVICE)
    rewrite = sorted({_split_of(name) for name, repair in repairs.items() if repair == REWRITE})
    # Indexing needs every shard there, so the shards are written first; one line fixes everything it can.
    command = " && ".join([*(shard_command(folder, split, splits[split]) for split in rewrite),
                           f"vitctl data index {shlex.quote(str(folder))}"]) if fixed else None
    gone = sorted({splits[split]["source"] for split in rewrite
                   if "source" in splits[split] and not Path(splits[split]["source"]).is_dir()})
    return VerifyReport(manifest, problems, command, fixed, advice, len(chosen), gone)


def _split_of(name: str) -> str:
    match = mf.SHARD_NAME.fullmatch(name)
    return match[1] if match else name.removeprefix("split ")


def _planned(name: str, splits: dict) -> bool:
    """Whether `name` is a shard the plan of its split holds (a run stopped before it recorded it)."""
    match = mf.SHARD_NAME.fullmatch(name)
    return match is not None and match[1] in splits and int(match[2]) < splits[match[1]]["planned_shards"]
