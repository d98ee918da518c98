"""DALI webdataset index files (format v1.2), computed in-process from the shard's tar headers."""

import re
from pathlib import Path

from .atomic import write_text_atomic
from .errors import DataError
from .manifest import index_name
from .tarscan import scan_path

VERSION = "v1.2"
_WHITESPACE = re.compile(r"\s").search
# One component of a sample: (extension, data offset, size, member name).
Component = tuple[str, int, int, str]


def split_name(name: str) -> tuple[str, str]:
    """WebDataset's key/extension split: at the first dot of the basename."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext


def shard_samples(shard: Path) -> list[list[Component]]:
    """The shard's samples in tar order, each a list of its components."""
    samples: list[list[Component]] = []
    seen: set[str] = set()
    last_key = None
    for m in scan_path(shard):
        if not m.is_file:
            continue
        if _WHITESPACE(m.name):
            raise DataError(f"member name {m.name!r} holds whitespace, which index files cannot express", str(shard))
        key, ext = split_name(m.name)
        if key != last_key:
            if key in seen:
                raise DataError(f"sample key {key!r} appears in two places; a sample's members must be adjacent",
                                str(shard))
            seen.add(key)
            samples.append([])
            last_key = key
        samples[-1].append((ext, m.offset, m.size, m.name))
    return samples


def format_index(samples: list[list[Component]]) -> str:
    lines = [f"{VERSION} {len(samples)}"]
    lines += [" ".join(f"{ext} {offset} {size} {name}" for ext, offset, size, name in sample) for sample in samples]
    return "\n".join(lines) + "\n"


def parse_index(text: str, where: str) -> list[list[Component]]:
    lines = text.splitlines()
    head = lines[0].split() if lines else []
    if len(head) != 2 or head[0] != VERSION or not head[1].isdigit():
        raise DataError(f"line 1 is {lines[0] if lines else ''!r}, expected '{VERSION} <samples>'", where,
                        "rebuild it with `vitctl data index`")
    samples = []
    for number, line in enumerate(lines[1:], start=2):
        fields = line.split()
        if not fields or len(fields) % 4:
            raise DataError(f"line {number} does not hold groups of '<ext> <offset> <size> <name>'", where)
        try:
            samples.append([(fields[i], int(fields[i + 1]), int(fields[i + 2]), fields[i + 3])
                            for i in range(0, len(fields), 4)])
        except ValueError:
            raise DataError(f"line {number} holds a non-integer offset or size", where) from None
    if len(samples) != int(head[1]):
        raise DataError(f"header says {head[1]} samples, the file lists {len(samples)}", where)
    return samples


def index_path(shard: Path) -> Path:
    return shard.with_name(index_name(shard.name))


def build_index(shard: Path) -> tuple[str, int]:
    """Write `<shard stem>.idx` beside the shard; returns (shard name, samples)."""
    samples = shard_samples(shard)
    write_text_atomic(index_path(shard), format_index(samples))
    return shard.name, len(samples)
