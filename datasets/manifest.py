"""The shard folder's manifest.json: label convention, classes, and what each complete shard holds."""

import hashlib
import json
import re
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
    path = out / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"manifest is not valid JSON ({e})", str(path),
                        "restore it or shard into a new folder") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"manifest format {manifest.get('format')!r} is not {FORMAT!r}", str(path))
    return manifest


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
