"""DALI webdataset index files (format v1.2), computed in-process from the shard's tar headers."""

import re
import shlex
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

from . import manifest as mf
from .atomic import partial_path, write_text_atomic
from .errors import DataError, are, count
from .lock import writing_in
from .oserrors import os_errors_explained
from .parallel import run_tasks
from .shard import shard_command
from .tarscan import SPARSE, scan_path

VERSION = "v1.2"
_WHITESPACE = re.compile(r"\s").search
# webdataset 1.0's rules (tariterators.py): `base_plus_ext` splits key and extension at the first dot of the
# basename and leaves out names it does not match (no extension, a hidden name at the top); names of the form
# `__x__` are metadata and left out; the extensions are lower-cased, and a sample holds each at most once.
_WDS_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_WDS_META = re.compile(r"__[^/]*__($|/)")
_WDS_FIELDS = frozenset(("__key__", "__url__"))  # in every webdataset sample already
# One component of a sample: (extension, data offset, size, member name).
Component = tuple[str, int, int, str]


def split_name(name: str) -> tuple[str, str] | None:
    """WebDataset's (key, extension) of a member name; None for a member that belongs to no sample."""
    if ("/" not in name and name.startswith("__") and name.endswith("__")) or _WDS_META.match(name):
        return None
    match = _WDS_KEY_EXT.match(name)
    return (match[1], match[2]) if match else None


def shard_samples(shard: Path) -> list[list[Component]]:
    """The shard's samples in tar order as webdataset groups them, each a list of its components."""
    samples: list[list[Component]] = []
    seen: set[str] = set()
    last_key, exts = None, set()
    for m in scan_path(shard):
        if m.type == SPARSE:
            raise DataError(f"member {m.name!r} is a GNU sparse file: its bytes are not stored in one run, so no "
                            "index can point at them", str(shard), "repack the shard without --sparse")
        split = split_name(m.name) if m.is_file else None
        if split is None:
            continue
        if _WHITESPACE(m.name):
            raise DataError(f"member name {m.name!r} holds whitespace, which index files cannot express", str(shard))
        key, ext = split
        if key != last_key:
            if key in seen:
                raise DataError(f"sample key {key!r} appears in two places; a sample's members must be adjacent",
                                str(shard))
            seen.add(key)
            samples.append([])
            last_key, exts = key, set(_WDS_FIELDS)
        if ext.lower() in exts:
            raise DataError(f"member {m.name!r} repeats the extension {ext.lower()!r} of sample {key!r} "
                            "(webdataset lower-cases extensions and refuses a repeated one)", str(shard))
        exts.add(ext.lower())
        samples[-1].append((ext, m.offset, m.size, m.name))
    return samples


def format_index(samples: list[list[Component]]) -> str:
    lines = [f"{VERSION} {len(samples)}"]
    lines += [" ".join(f"{ext} {offset} {size} {name}" for ext, offset, size, name in sample) for sample in samples]
    return "\n".join(lines) + "\n"


def read_index(path: Path) -> list[list[Component]]:
    """The samples of the index file `path`; DataError where it is not one (also where its bytes are not text)."""
    data = path.read_bytes()
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise DataError(f"not an index file: byte {e.start} is not text (a damaged or foreign file)", str(path),
                        _rebuild(str(path))) from None
    return parse_index(text, str(path))


def _rebuild(where: str) -> str:
    return f"rebuild the folder's index files with `vitctl data index {shlex.quote(str(Path(where).parent))}`"


def parse_index(text: str, where: str) -> list[list[Component]]:
    rebuild = _rebuild(where)
    lines = text.splitlines()
    head = lines[0].split() if lines else []
    if len(head) != 2 or head[0] != VERSION or not head[1].isdigit():
        raise DataError(f"line 1 is {lines[0] if lines else ''!r}, expected '{VERSION} <samples>'", where, rebuild)
    samples = []
    for number, line in enumerate(lines[1:], start=2):
        fields = line.split()
        if not fields or len(fields) % 4:
            raise DataError(f"line {number} does not hold groups of '<ext> <offset> <size> <name>'", where, rebuild)
        try:
            samples.append([(fields[i], int(fields[i + 1]), int(fields[i + 2]), fields[i + 3])
                            for i in range(0, len(fields), 4)])
        except ValueError:
            raise DataError(f"line {number} holds a non-integer offset or size", where, rebuild) from None
    if len(samples) != int(head[1]):
        raise DataError(f"header says {head[1]} samples, the file lists {len(samples)}", where, rebuild)
    return samples


def index_path(shard: Path) -> Path:
    return shard.with_name(mf.index_name(shard.name))


def build_index(shard: Path, recorded: int | None = None) -> tuple[str, int]:
    """Write `<shard stem>.idx` beside the shard; returns (shard name, samples). `recorded`: the samples its manifest
    entry lists, which the shard must hold (the labels a trainer reads are the manifest's, in tar order)."""
    samples = shard_samples(shard)
    if recorded is not None and len(samples) != recorded:
        raise DataError(f"holds {len(samples)} samples, and the manifest records {recorded}: changed since `vitctl "
                        "data shard` wrote it", str(shard))
    if not samples:
        raise DataError("the shard holds no samples, and DALI refuses an index of none", str(shard),
                        "replace or delete the images skipped for it (manifest.json lists them) and shard into a "
                        "new --out folder")
    text, path = format_index(samples), index_path(shard)
    if not _holds(path, text):  # a right index is kept, so that a read-only copy of a finished folder indexes as done
        write_text_atomic(path, text)
    return shard.name, len(samples)


def _holds(path: Path, text: str) -> bool:
    try:
        return path.read_text() == text
    except (OSError, ValueError):  # none yet, or not text
        return False


def unfinished_splits(folder: Path) -> list[str]:
    """Each split of the folder that a `vitctl data shard` began and did not finish, with the command that does."""
    manifest = mf.load(folder) or {"splits": {}}
    return [f"the {split} split is incomplete ({len(info['shards'])} of {info['planned_shards']} shards written): "
            f"finish it with `{shard_command(folder, split, info)}`, then index again"
            for split, info in sorted(manifest["splits"].items())
            if mf.unfinished(info)]


def index_folder(folder: Path, workers: int, progress: Callable[[int], None],
                 on_total: Callable[[int], None]) -> tuple[int, int]:
    """Index every shard `folder/manifest.json` lists; returns (index files, samples)."""
    with os_errors_explained(folder), writing_in(folder):
        manifest = mf.load(folder)
        if manifest is None:
            raise mf.no_manifest(folder)
        entries = [entry for _, entry in mf.all_shards(manifest)]
        paths = [folder / entry["name"] for entry in entries]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise DataError(f"{count(len(missing), 'shard')} in the manifest {are(len(missing))} missing, e.g. "
                            f"{missing[0]}", str(folder),
                            "rerun the `vitctl data shard` command that wrote this folder (`vitctl data verify` "
                            "prints it)")
        sizes = [(p, p.stat().st_size, e["bytes"]) for p, e in zip(paths, entries, strict=True)]
        if resized := [(p, size, recorded) for p, size, recorded in sizes if size != recorded]:
            path, size, recorded = resized[0]
            more = f" (and {len(resized) - 1} more)" if len(resized) > 1 else ""
            raise DataError(f"{path.name}{more} is {size:,} bytes, and the manifest records {recorded:,}: changed "
                            "since `vitctl data shard` wrote it", str(folder),
                            mf.repair_advice(folder))
        on_total(len(paths))
        samples = 0
        tasks = [(p, e["samples"]) for p, e in zip(paths, entries, strict=True)]
        try:
            with closing(run_tasks(build_index, tasks, workers)) as built:
                for _, held in built:
                    samples += held
                    progress(1)
        except DataError as e:  # a shard `vitctl data shard` wrote, damaged since: verify names how to write it again
            raise DataError(e.what, e.where, mf.repair_advice(folder)) from None
        finally:  # a worker stopped mid-write (Ctrl-C) leaves its temporary file; every worker has stopped by now
            for path in paths:
                partial_path(index_path(path)).unlink(missing_ok=True)
    return len(paths), samples
