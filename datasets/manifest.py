"""The shard folder's manifest.json: label convention, classes, and what each complete shard holds."""

import hashlib
import json
import re
import shlex
from pathlib import Path
from typing import Any

from .atomic import write_json_atomic
from .errors import DataError
from .ilsvrc import LABEL_CONVENTION

MANIFEST = "manifest.json"
FORMAT = "vitctl-shards/1"
HASH_CHUNK = 1 << 20
SHARD_NAME = re.compile(r"imagenet-(train|val)-(\d{6})\.tar")


def shard_name(split: str, index: int) -> str:
    return f"imagenet-{split}-{index:06d}.tar"


def index_name(shard: str) -> str:
    return shard.removesuffix(".tar") + ".idx"


def encode_labels(labels: list[int]) -> str:
    """A shard's labels in tar order, as one line (a JSON list would take a line per sample)."""
    return " ".join(map(str, labels))


def decode_labels(text: str) -> list[int]:
    return [int(label) for label in text.split()]


def load(out: Path) -> dict[str, Any] | None:
    """The folder's manifest, checked to be one `vitctl data shard` wrote; None if there is none."""
    path = out / MANIFEST
    if not path.exists():
        return None
    fix = "restore it, or shard into a new --out folder (`vitctl data shard ROOT --out NEW`)"
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:  # UnicodeDecodeError too
        raise DataError(f"manifest is not valid JSON ({e})", str(path), fix) from None
    if not isinstance(manifest, dict):
        raise DataError(f"not a manifest `vitctl data shard` wrote: it holds {json.dumps(manifest)[:40]}, not an "
                        "object", str(path), fix)
    if manifest.get("format") != FORMAT:
        raise DataError(f"manifest format {manifest.get('format')!r} is not {FORMAT!r}", str(path), fix)
    problem = _shape_problem(manifest)
    if problem:
        raise DataError(f"not a manifest `vitctl data shard` wrote: {problem}", str(path), fix)
    return manifest


def no_manifest(folder: Path) -> DataError:
    """A folder given as shards that has no manifest.json: not a shard folder, or one whose manifest was lost."""
    shards = sorted(p.name for p in folder.glob("imagenet-*.tar") if SHARD_NAME.fullmatch(p.name)) \
        if folder.is_dir() else []
    if not shards:
        return DataError(f"no {MANIFEST}: this folder was not written by `vitctl data shard`", str(folder),
                         "pass the folder given to `vitctl data shard --out`")
    return DataError(f"no {MANIFEST} beside its {len(shards)} shards ({shards[0]}, ...): it records what `vitctl data "
                     "shard` wrote here (their sizes, checksums and labels), and was moved or deleted", str(folder),
                     f"put {MANIFEST} back; else move the shards away and run the same `vitctl data shard ... --out "
                     f"{shlex.quote(str(folder))}` again, which writes them again")


_TOP = {"label_convention": str, "classes": list, "splits": dict}
_SPLIT = {"plan": str, "maxsize": int, "maxcount": int, "seed": int, "on_bad_image": str, "planned_shards": int,
          "complete": bool, "shards": list, "source": str}
_SHARD = {"name": str, "samples": int, "bytes": int, "sha256": str, "conversions": list, "skipped": list,
          "labels": str, "sources": str}
_OPTIONAL = {"labels", "source", "sources"}  # absent from folders sharded by older versions
_TYPE_NAMES = {str: "a string", int: "an integer", bool: "true or false", list: "a list", dict: "an object"}


def _type_problem(obj: Any, keys: dict[str, type], where: str) -> str | None:
    """What is missing from the object `obj` or of the wrong type, or None."""
    if not isinstance(obj, dict):
        return f"{where} is not an object"
    for key, kind in keys.items():
        if key not in obj:
            if key in _OPTIONAL:
                continue
            return f"{where}.{key} is missing"
        value = obj[key]
        # bool is an int in Python, and no count in a manifest is true or false
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            return f"{where}.{key} is {json.dumps(value)[:40]}, not {_TYPE_NAMES[kind]}"
    return None


def _shard_problem(entry: Any, split: str, where: str, labels: frozenset[str]) -> str | None:
    """What is wrong with a shard entry, `labels` the classes' labels as encode_labels writes them."""
    problem = _type_problem(entry, _SHARD, where)
    if problem:
        return problem
    match = SHARD_NAME.fullmatch(entry["name"])
    if match is None or match[1] != split:  # the name is joined to the folder: never a path out of it
        return f"{where}.name {entry['name']!r} is not the name of a {split} shard"
    if not all(isinstance(s, dict) and isinstance(s.get("source"), str) and isinstance(s.get("reason"), str)
               for s in entry["skipped"]):
        return f"{where}.skipped holds an entry without a source and a reason"
    # a label past the classes (the class list edited) reaches the loss as an index out of its bounds
    stray = min(set(entry.get("labels", "").split()) - labels, default=None)
    if stray is not None:
        return f"{where}.labels holds {stray!r}, not a label of the {len(labels)} classes (0 to {len(labels) - 1})"
    return None


def _shape_problem(manifest: dict[str, Any]) -> str | None:
    """What a reader of the manifest needs and this one lacks, or None."""
    problem = _type_problem(manifest, _TOP, "manifest")
    if problem or not all(isinstance(c, str) for c in manifest["classes"]):
        return problem or "manifest.classes is not a list of WNIDs"
    classes = manifest["classes"]
    if manifest["label_convention"] == LABEL_CONVENTION and classes != sorted(set(classes)):
        # label i names the i-th WNID in sorted order: a reordered list would name every label wrongly
        return (f"manifest.classes is not in sorted order without repeats, as its label_convention "
                f"{LABEL_CONVENTION!r} has them (label i is the i-th WNID)")
    labels = frozenset(map(str, range(len(manifest["classes"]))))
    for split, info in manifest["splits"].items():
        where = f"splits.{split}"
        problem = _type_problem(info, _SPLIT, where) or next(
            filter(None, (_shard_problem(e, split, f"{where}.shards[{i}]", labels)
                          for i, e in enumerate(info["shards"]))), None)
        if problem:
            return problem
        names = [e["name"] for e in info["shards"]]
        if twice := next((i for i, name in enumerate(names) if name in names[:i]), None):
            # a trainer would read that shard's samples twice an epoch, and count them twice
            return f"{where}.shards[{twice}].name {names[twice]!r} is that of shards[{names.index(names[twice])}] too"
    return None


def repair_advice(folder: Path) -> str:
    """How to mend a shard of `folder` that is damaged or missing since `vitctl data shard` wrote it."""
    return (f"`vitctl data verify {shlex.quote(str(folder))}` checks every shard against manifest.json and prints the "
            "command that writes the damaged or missing ones again")


def unfinished(info: dict[str, Any]) -> bool:
    """Whether a split's `vitctl data shard` began and did not finish (or its shard list was cut short since)."""
    return not info["complete"] or len(info["shards"]) != info["planned_shards"]


def classes_without_samples(classes: list[str], shards: list[dict[str, Any]]) -> list[str]:
    """The classes no sample of `shards` is labelled with (none where an entry predates the labels' listing)."""
    if any("labels" not in entry for entry in shards):
        return []
    kept = {label for entry in shards for label in decode_labels(entry["labels"])}
    return [wnid for label, wnid in enumerate(classes) if label not in kept]


def split_digest(classes: list[str], shards: list[dict[str, Any]]) -> str:
    """What identifies a split's samples and labels: the class list and each shard's name and sha256 (a copy of the
    folder elsewhere has the same)."""
    names = [[entry["name"], entry["sha256"]] for entry in shards]
    return hashlib.sha256(json.dumps([classes, names]).encode()).hexdigest()[:16]


def new(classes: list[str]) -> dict[str, Any]:
    return {"format": FORMAT, "label_convention": LABEL_CONVENTION, "classes": classes, "splits": {}}


def save(out: Path, manifest: dict[str, Any]) -> None:
    write_json_atomic(out / MANIFEST, manifest)


def all_shards(manifest: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(split, shard entry) for every shard the manifest records as complete, in name order."""
    return [(split, entry) for split, info in sorted(manifest["splits"].items()) for entry in info["shards"]]


def file_sha256(path: Path) -> str:
    """The sha256 a shard entry records of its file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()
