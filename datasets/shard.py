"""Write WebDataset shards: a seeded plan, one independent writer process per shard, resumable."""

import contextlib
import hashlib
import json
import os
import random
import re
import shlex
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from . import manifest as mf
from .atomic import PARTIAL_SUFFIX, partial_open, partial_path, publish
from .errors import DataError, count, listed
from .extract import (
    ARCHIVE_NAMES,
    beside_archives,
    check_finished,
    check_train_intact,
    check_val_intact,
    extract_command,
)
from .ilsvrc import DEVKIT_NAME, WNID
from .images import to_rgb_jpeg
from .lock import check_no_writer, writing_in
from .oserrors import make_folder, os_errors_explained
from .parallel import run_tasks
from .tarscan import BLOCK, padded
from .tarwrite import UstarWriter

JSON_BYTES_ESTIMATE = 96
MAX_KEY_BYTES = 100 - len(".json")  # the longest member of a sample, `<key>.json`, in a plain ustar name field
Progress = Callable[[int], None]
MANIFEST_EVERY_S = 1.0  # how often finished shards are recorded while a split is written
_WHITESPACE = re.compile(r"\s").search


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


def _visible(folder: Path) -> list[os.DirEntry]:
    """The entries of `folder` in name order, less hidden ones (`.DS_Store`, `._x.JPEG`): they are not images."""
    return sorted((e for e in os.scandir(folder) if not e.name.startswith(".")), key=lambda e: e.name)


def _check_extracted(folder: Path) -> None:
    """Refuse a split folder in which `vitctl data extract` left a class half-written (`.<wnid>.partial`), or a
    symbolic link that leads nowhere."""
    for entry in os.scandir(folder):
        if entry.is_symlink() and not os.path.exists(entry.path) and not entry.name.startswith("."):  # or a loop
            raise DataError(f"a symbolic link that leads nowhere (to {os.readlink(entry.path)}: missing, or a loop "
                            "of links)", entry.path, "restore the folder it points to, or delete the link")
        wnid = entry.name[1:].removesuffix(PARTIAL_SUFFIX)
        if entry.name.endswith(PARTIAL_SUFFIX) and WNID.fullmatch(wnid) and not (folder / wnid).is_dir():
            raise DataError(f"class {wnid} is not completely extracted: {entry.name} is what an interrupted "
                            "`vitctl data extract` left", str(folder),
                            "rerun that `vitctl data extract` command: it finishes the class")


def list_classes(root: Path) -> list[str]:
    """Sorted WNIDs of the train split (else val): the sorted-WNID label convention."""
    for split in ("train", "val"):
        folder = root / split
        if folder.is_dir():
            _check_extracted(folder)
            wnids = [e.name for e in _visible(folder) if e.is_dir() and WNID.fullmatch(e.name)]
            if wnids:
                return wnids
    if root.name in ("train", "val") and any(e.is_dir() and WNID.fullmatch(e.name) for e in _visible(root)):
        raise DataError(f"no train/ or val/ folder here: this is the {root.name} folder itself, not the dataset root",
                        str(root), f"pass the dataset root {root.parent} (with --split {root.name} to shard this "
                        "split alone)")
    raise DataError(*_not_a_root(root))


def _not_a_root(root: Path) -> tuple[str, str, str]:
    """Why `root` holds no class folders under train/ or val/, by what it holds instead: (what, where, fix)."""
    entries = [e for e in _visible(root) if e.is_dir() or e.is_file()] if root.is_dir() else []
    wnids = [e.name for e in entries if e.is_dir() and WNID.fullmatch(e.name)]
    deeper = [e.name for e in entries if e.is_dir() and any((root / e.name / s).is_dir() for s in ("train", "val"))]
    archives = [e.name for e in entries if e.is_file() and e.name in ARCHIVE_NAMES.values()]
    splits = [s for s in ("train", "val") if (root / s).is_dir()]
    named = [e.name for s in splits for e in _visible(root / s) if e.is_dir()]
    if (root / mf.MANIFEST).is_file():
        source = (mf.load(root) or {}).get("splits", {})
        from_root = next((info["source"] for info in source.values() if "source" in info), "the image root")
        return ("a shard folder (`vitctl data shard` wrote it), not an image root", str(root),
                f"pass the image root it was sharded from ({from_root}); to train on these shards, pass this folder "
                "to `vitctl train --data`")
    if wnids:
        return (f"the class folders lie directly in it ({listed(wnids, 3)}): shard reads ROOT/train/<wnid>/ and "
                "ROOT/val/<wnid>/", str(root), f"move them into {root / 'train'} (`mkdir {shlex.quote(str(root))}/"
                f"train && mv {shlex.quote(str(root))}/n[0-9]* {shlex.quote(str(root))}/train/`)")
    if deeper:
        return (f"the dataset root is a level deeper: {root / deeper[0]} holds train/ or val/", str(root),
                f"pass {root / deeper[0]}")
    if archives:
        options = " ".join(f"--{split}-tar {shlex.quote(str(root / name))}" for split, name in ARCHIVE_NAMES.items()
                           if name in archives)
        return (f"it holds the archives ({', '.join(archives)}), not their images", str(root),
                f"extract them first: `vitctl data extract {options} --out {shlex.quote(str(root / 'imagenet'))}`, "
                f"then pass {root / 'imagenet'}")
    if named:
        return (f"{' and '.join(f'{s}/' for s in splits)} hold{'s' if len(splits) == 1 else ''} folders, none named "
                f"by its WNID (e.g. {named[0]}): shard takes ImageNet's class folders, named like n01440764", str(root),
                "rename each class folder to its WNID")
    return ("no class folders found under train/ or val/", str(root),
            "run `vitctl data extract` (and `vitctl data valprep` for val) first")


def sample_key(entry: os.DirEntry, path: Path) -> str:
    """The sample key of the image `entry` at `path` (its name up to the first dot); what cannot be one raises."""
    if entry.is_dir():
        raise DataError("a folder inside a class folder, which holds only images", str(path),
                        "move it out of the class folder")
    if not entry.is_file():
        if entry.is_symlink():
            raise DataError(f"a broken symbolic link (to {os.readlink(path)})", str(path),
                            "restore the file it points to, or delete the link")
        raise DataError("not a regular file (a FIFO, socket or device)", str(path), "move it out of the class folder")
    key = entry.name.split(".", 1)[0]
    try:
        size = len(key.encode())
    except UnicodeEncodeError:  # a name that is not UTF-8 comes back holding surrogates
        raise DataError("its name is not valid UTF-8, as shard member names must be", str(path),
                        "rename the file") from None
    if _WHITESPACE(key):
        raise DataError(f"its sample key {key!r} (the name up to the first dot) holds whitespace, which DALI index "
                        "files cannot hold", str(path), "rename the file without whitespace")
    if size > MAX_KEY_BYTES:
        raise DataError(f"its sample key (the name up to the first dot) is {size} bytes, more than the "
                        f"{MAX_KEY_BYTES} a shard member name leaves for it", str(path), "rename the file shorter")
    return key


def list_samples(root: Path, split: str, classes: list[str]) -> tuple[list[Sample], dict[str, int]]:
    """Every image of the split, each checked to make a valid sample key, and each one's modification time (ns);
    hidden files are left out."""
    folder = root / split
    if not folder.is_dir():
        alone = " (or pass --split train to shard train alone)" if split == "val" else ""
        raise DataError(f"no {split}/ folder", str(root), f"extract the {split} archive first: "
                        f"`{extract_command(root, [split])}`{alone}")
    _check_extracted(folder)
    entries = _visible(folder)
    flat = [e.name for e in entries if not e.is_dir()]
    if flat:
        devkit = beside_archives(root, DEVKIT_NAME)
        fix = (f"run `vitctl data valprep {shlex.quote(str(folder))} --devkit {shlex.quote(devkit)}` (or "
               "--solution LOC_val_solution.csv) to move them into WNID folders" if split == "val"
               else f"move {'it' if len(flat) == 1 else 'them'} out: train/ holds one folder per class")
        raise DataError(f"{count(len(flat), 'file')} {'lies' if len(flat) == 1 else 'lie'} directly in {split}/ (e.g. "
                        f"{flat[0]})", str(folder), fix)
    label_of = {wnid: i for i, wnid in enumerate(classes)}
    samples, modified, keys, empty = [], {}, {}, []
    for class_dir in entries:
        if class_dir.name not in label_of:
            raise _not_a_train_class(root, split, class_dir.name, len(classes))
        images = _visible(folder / class_dir.name)
        empty += [] if images else [class_dir.name]
        for entry in images:
            source = f"{split}/{class_dir.name}/{entry.name}"
            key = sample_key(entry, root / source)
            if key in keys:
                raise DataError(f"two images share the key {key!r} (a sample's key is its file name up to the first "
                                f"dot): {keys[key]} and {source}", str(folder),
                                "rename one of them, or move out the one that is not an image (a .bak copy)")
            keys[key], stat = source, entry.stat()
            samples.append((source, key, label_of[class_dir.name], stat.st_size))
            modified[source] = stat.st_mtime_ns
    if not samples:
        raise DataError(f"no images under {split}/ (its class folders are empty)", str(folder),
                        f"put the images into their class folders ({folder}/<wnid>/<image>), or shard the folder "
                        "that `vitctl data extract --out` wrote")
    if empty:  # train: its label and output would train on nothing; val: the evaluation would leave it out unsaid
        more = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        fix = (f"put its images back into {folder / empty[0]}, or move that folder out of {folder} (and "
               f"{root / 'val' / empty[0]} with it, if there is one)" if split == "train" else
               f"put its images back into {folder / empty[0]} (valprep sorts them there), or move that folder out of "
               f"{folder} to evaluate without that class")
        raise DataError(f"class folder {empty[0]}{more} holds no images", str(folder), fix)
    return samples, modified


def _not_a_train_class(root: Path, split: str, name: str, classes: int) -> DataError:
    """The error for a folder of `split` that is none of the train classes, which number the labels."""
    folder = root / split
    if split == "train":
        return DataError(f"folder {name} is not a class folder named by its WNID (n and 8 digits)", str(folder),
                         f"move {folder / name} out of {folder}")
    return DataError(f"class folder {name} is not among the {classes} train classes: val/ was sorted with the labels "
                     "of another dataset, or train/ lacks the class", str(folder),
                     f"remove {folder}, then `{extract_command(root, ['val'])}` and `vitctl data valprep "
                     f"{shlex.quote(str(folder))}` with the devkit or solution file of this dataset; or add the class "
                     "to train/")


@dataclass(frozen=True)
class Source:
    """What shard reads from ROOT: the classes (sorted WNIDs), the images of each split and their modification
    times (ns, by source)."""

    classes: list[str]
    samples: dict[str, list[Sample]]
    modified: dict[str, int]


def read_source(root: Path, splits: Sequence[str]) -> Source:
    """Check `root` for the `splits` (extraction finished, class folders, image names) and list their images.

    Writes nothing, so that bad input is refused before anything is written.
    """
    with os_errors_explained(root):
        check_finished(root, splits)
        for split in splits:  # valprep sorting val/ now: its images would read as flat files, with valprep as the fix
            if (root / split).is_dir():
                check_no_writer(root / split, "vitctl data shard")
        classes = list_classes(root)
        check_train_intact(root, "train" in splits)  # before any split's images: a lost class shifts the labels
        listed = {split: list_samples(root, split, classes) for split in splits}
        samples = {split: found for split, (found, _) in listed.items()}
        if "val" in samples:
            check_val_intact(root, len(samples["val"]))
        modified = {source: ns for _, times in listed.values() for source, ns in times.items()}
        return Source(classes, samples, modified)


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
    # The bad-image policy leaves the plan as it is and may change between runs (`fail`, then `skip` to go on).
    # It stays in the digest, fixed, so that folders sharded before this rule still resume.
    h = hashlib.sha256(json.dumps(asdict(replace(spec, on_bad_image="skip"))).encode())
    for shard in shards:
        h.update(json.dumps(shard).encode())
    return h.hexdigest()


def sources_digest(samples: list[Sample], modified: dict[str, int]) -> str:
    """A digest of the samples' images with their modification times as listed: a rerun writes again a shard whose
    images were edited in place since (an edit during the run too), which the plan misses where an edit keeps an
    image's size."""
    h = hashlib.sha256()
    for source, *_ in samples:
        h.update(f"{source}\0{modified[source]}\n".encode())
    return h.hexdigest()


class _HashingFile:
    def __init__(self, f) -> None:
        self.f, self.sha256, self.bytes = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> None:
        self.sha256.update(data)
        self.bytes += len(data)
        self.f.write(data)


def _some(skipped: list[dict[str, str]]) -> str:
    """The first three skipped images with their reasons, and how many more there are."""
    listed = "; ".join(f"{s['source']} ({s['reason']})" for s in skipped[:3])
    return listed + (f"; and {len(skipped) - 3} more" if len(skipped) > 3 else "")


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
                    raise DataError(e.what, str(root / source), "rerun the same command with --on-bad-image skip to "
                                    "leave it out (finished shards are kept), or replace the image") from None
                skipped.append({"source": source, "reason": e.what})
                continue
            if conversion:
                conversions.append({"source": source, "conversion": conversion})
            tar.add(f"{key}.cls", str(label).encode())
            tar.add(f"{key}.jpg", jpeg)
            tar.add(f"{key}.json", json.dumps({"wnid": wnids[label], "source": source}).encode())
            labels.append(label)
        if not labels:  # DALI refuses the index of an empty shard
            raise DataError(f"every image planned for {path.name} is unreadable, and no shard may be empty: "
                            f"{_some(skipped)}", str(root), "replace or delete those images, then shard into a new "
                            "--out folder (the plan changes with the images)")
        tar.close()
    return {"name": path.name, "samples": len(labels), "bytes": out.bytes, "sha256": out.sha256.hexdigest(),
            "conversions": conversions, "skipped": skipped, "labels": mf.encode_labels(labels)}


def _check_folder(out: Path, manifest: dict[str, Any] | None) -> None:
    """Refuse a folder holding files that vitctl did not write."""
    ours = {mf.MANIFEST}
    foreign, shard_named = [], True
    for entry in os.scandir(out):
        name = entry.name.removeprefix(".").removesuffix(PARTIAL_SUFFIX)
        stem = name.removesuffix(".idx") + ".tar" if name.endswith(".idx") else name
        if name in ours or (mf.SHARD_NAME.fullmatch(stem) and manifest is not None):
            continue
        foreign.append(entry.name)
        shard_named = shard_named and mf.SHARD_NAME.fullmatch(stem) is not None
    if foreign:
        # shards of an earlier run whose manifest.json was deleted look the same as anyone else's
        lost = (f" (named as shards, but with no {mf.MANIFEST}, which records what `vitctl data shard` wrote here, "
                "whose they are cannot be told)") if shard_named else ""
        again = ("; if an earlier `vitctl data shard` wrote them and its manifest was lost, moving them away and "
                 "running the same command writes them again") if shard_named else ""
        raise DataError(f"the output folder holds files vitctl did not write: {', '.join(sorted(foreign)[:5])}{lost}",
                        str(out), f"shard into an empty folder, or move those files away{again}")


def _intact(path: Path, entry: dict[str, Any]) -> str | None:
    """The shard's name if its file is the one its manifest entry records (size and sha256), else None."""
    if path.is_file() and path.stat().st_size == entry["bytes"] and mf.file_sha256(path) == entry["sha256"]:
        return path.name
    return None


def shard_command(folder: Path, split: str, info: dict[str, Any]) -> str:
    """The `vitctl data shard` command that finishes `split` in `folder`, or writes again its damaged shards."""
    source = shlex.quote(info["source"]) if "source" in info else "ROOT"  # folders sharded before it was recorded
    return (f"vitctl data shard {source} --out {shlex.quote(str(folder))} --split {split} --maxsize {info['maxsize']} "
            f"--maxcount {info['maxcount']} --seed {info['seed']} --on-bad-image {info['on_bad_image']}")


def _other_plan(root: Path, out: Path, split: str, spec: ShardSpec, info: dict[str, Any], asked: str) -> DataError:
    """The error for a rerun whose plan is not the one the folder's shards were written to; its fix shards the
    split(s) the rerun `asked` for."""
    changed = [f"--{key} {getattr(spec, key)} (this folder's: {info[key]})" for key in ("maxsize", "maxcount", "seed")
               if getattr(spec, key) != info[key]]
    if changed:
        return DataError(f"{split} shards here were made with other settings: {', '.join(changed)}", str(out),
                         f"use a new --out folder, or go on with this folder's settings: "
                         f"{shard_command(out, asked, info)}")
    source = Path(info.get("source", root.resolve()))  # not recorded by the vitctl of older folders
    since = "the images under it changed since" if source == root.resolve() else f"this run reads {root}"
    other = f" (or, to go on with this one, shard {source} into it)" if source != root.resolve() else ""
    return DataError(f"{split} shards here were made from other images: from {source}, and {since}", str(out),
                     f"shard into a new --out folder{other}")


def _check_out(root: Path, out: Path) -> None:
    """Refuse an `out` inside a split folder of `root`: shard would read it as a class folder the next time."""
    if out.resolve() == root.resolve():
        raise DataError("is the dataset root itself: the shards would lie among its train/ and val/ folders",
                        f"--out {out}", f"choose an --out outside {root / 'train'} and {root / 'val'}, e.g. "
                        f"{root / 'shards'}")
    for split in ("train", "val"):
        folder = (root / split).resolve()
        if out.resolve().is_relative_to(folder):
            raise DataError(f"lies inside {root / split}, which holds only class folders: the next `vitctl data "
                            "shard` of this root would refuse the shard folder there", f"--out {out}",
                            f"choose an --out outside {root / 'train'} and {root / 'val'}, e.g. {root / 'shards'}")


@dataclass
class SplitResult:
    info: dict[str, Any]  # the split's manifest entry
    rewritten: list[str]  # shards a run before recorded whose file was missing or damaged, written again
    kept: int = 0  # shards a run before wrote, checked against their sha256 and kept
    changed: list[str] = field(default_factory=list)  # shards a run before wrote whose images were edited since


def _started(root: Path, shards: list[list[Sample]], spec: ShardSpec) -> dict[str, Any]:
    """The manifest entry of a split planned as `shards` and not yet written."""
    return {"plan": plan_digest(shards, spec), **asdict(spec), "source": str(root.resolve()),
            "planned_shards": len(shards), "complete": False, "shards": []}


def shard_split(root: Path, out: Path, split: str, spec: ShardSpec, workers: int, progress: Progress,
                on_total: Callable[[int], None], source: Source | None = None) -> SplitResult:
    """Shard one split into `out`, keeping the shards an earlier run completed once their sha256 is checked.

    `source` is what `read_source` found under `root`; it is read here when not given.
    """
    spec.validate()
    _check_out(root, out)
    source = source or read_source(root, [split])
    with os_errors_explained(out):
        make_folder(out, "--out")
        with writing_in(out):  # a second shard (or index) into `out` at once would overwrite this one's files
            return _shard_split(root, out, split, spec, workers, progress, on_total, source)


def _shard_split(root: Path, out: Path, split: str, spec: ShardSpec, workers: int,
                 progress: Progress, on_total: Callable[[int], None], source: Source) -> SplitResult:
    manifest = mf.load(out)
    _check_folder(out, manifest)
    classes = source.classes
    if manifest is None:
        manifest = mf.new(classes)
    elif manifest["classes"] != classes:
        differ = listed(set(manifest["classes"]) ^ set(classes), 3) or "their order"
        raise DataError(f"the {len(classes)} classes under {root} differ from the {len(manifest['classes'])} this "
                        f"folder's shards were made with (in one but not the other: {differ})",
                        str(out / mf.MANIFEST), "shard into a new --out folder")
    shards = plan_shards(source.samples[split], spec)
    digest = plan_digest(shards, spec)
    info = manifest["splits"].get(split)
    if info is not None and info["plan"] != digest:
        raise _other_plan(root, out, split, spec, info, "both" if len(source.samples) > 1 else split)
    recorded = {} if info is None else {e["name"]: e for e in info["shards"]}
    recorded_info, recorded_complete = info, info is not None and info["complete"]
    added = sorted(source.samples.keys() - manifest["splits"].keys() - {split})
    info = manifest["splits"][split] = _started(root, shards, spec)
    for other in added:
        # recorded as started now: a run stopped before it gets there leaves it incomplete (verify's fix and training
        # then name it), not absent, which training takes for a dataset without that split
        manifest["splits"][other] = _started(root, plan_shards(source.samples[other], spec), spec)
    on_total(sum(len(s) for s in shards))
    planned = {mf.shard_name(split, i): samples for i, samples in enumerate(shards)}
    sources = {name: sources_digest(samples, source.modified) for name, samples in planned.items()}
    # an entry without the digest comes from an older vitctl: its images' times are unknown
    changed = sorted(name for name, e in recorded.items() if "sources" in e and e["sources"] != sources.get(name))
    unchanged = [(out / name, e) for name, e in recorded.items() if name not in changed]
    intact = set()
    with contextlib.closing(run_tasks(_intact, unchanged, workers)) as checked:
        for name in checked:
            if name is not None:
                intact.add(name)
                progress(len(planned[name]))
    # nothing to write (a read-only copy checks too); a planned_shards edited by hand is written again, as planned
    if recorded_complete and len(intact) == len(planned) == recorded_info["planned_shards"] and added == []:
        return SplitResult(recorded_info, [], len(intact))
    todo = []
    for name, samples in planned.items():
        path = out / name
        if name in intact:
            info["shards"].append(recorded[name])
            continue
        partial_path(path).unlink(missing_ok=True)
        (out / mf.index_name(path.name)).unlink(missing_ok=True)  # an index of an older shard is stale
        todo.append((root, path, samples, classes, spec.on_bad_image))
    mf.save(out, manifest)

    saved = time.monotonic()

    def finish(entry: dict[str, Any]) -> None:
        nonlocal saved
        publish(out / entry["name"])
        info["shards"].append({**entry, "sources": sources[entry["name"]]})
        # Recorded once a second, not after every shard: rewriting the whole manifest per shard took minutes with
        # thousands of small shards. A shard published since is rewritten by a rerun, as an unpublished one is.
        if time.monotonic() - saved >= MANIFEST_EVERY_S:
            record()
            saved = time.monotonic()
        progress(entry["samples"] + len(entry["skipped"]))

    def record() -> None:
        info["shards"].sort(key=lambda e: e["name"])
        mf.save(out, manifest)

    # One thread fsyncs and renames finished shards (and records them) while the writers go on with the next.
    try:
        # `closing` stops the writers (a Ctrl-C interrupts them) before the finisher is waited for and the except runs
        writers = contextlib.closing(run_tasks(write_shard, todo, workers))
        with ThreadPoolExecutor(max_workers=1) as finisher, writers as written:
            finished = [finisher.submit(finish, entry) for entry in written]
    except BaseException:  # every writer has stopped by now; one that finished after the error was not published
        for task in todo:
            partial_path(task[1]).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # a rerun keeps what was published (a full disk may refuse even this)
            record()
        raise
    for future in finished:
        future.result()
    _check_every_class_kept(root, split, info, classes, {sample[2] for sample in source.samples[split]})
    info["complete"] = True
    record()
    return SplitResult(info, sorted(set(recorded) - intact - set(changed)), len(intact), changed)


def _check_every_class_kept(root: Path, split: str, info: dict[str, Any], classes: list[str],
                            planned: set[int]) -> None:
    """Refuse a split in which every image of a class (one of the `planned` labels) was skipped as unreadable, as an
    empty class folder is refused before sharding: train would have a label with nothing to train on, val would
    leave the class out of the evaluation unsaid. The split stays unfinished."""
    without = set(mf.classes_without_samples(classes, info["shards"]))
    lost = [classes[label] for label in sorted(planned) if classes[label] in without]
    if not lost:
        return
    skipped = [s for e in info["shards"] for s in e["skipped"] if s["source"].split("/")[1] == lost[0]]
    more = f" (and {len(lost) - 1} more classes)" if len(lost) > 1 else ""
    why = "its label would train on nothing" if split == "train" else "the evaluation would leave the class out"
    raise DataError(f"every {split} image of class {lost[0]}{more} is unreadable, so {why}: {_some(skipped)}",
                    str(root), "replace them with readable images, then shard into a new --out folder (the plan "
                    "changes with the images)")
