"""Extract the nested ILSVRC2012 train tar and the flat val tar, in parallel and resumably."""

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import write_json_atomic
from .errors import DataError
from .ilsvrc import WNID
from .parallel import run_tasks
from .tarscan import TarMember, check_safe, scan, scan_path

LEDGER = ".vitctl-extract.json"
Progress = Callable[[int], None]  # advance by n bytes


@dataclass
class ExtractReport:
    classes: dict[str, int] = field(default_factory=dict)  # wnid -> images
    val_images: int = 0
    skipped: list[str] = field(default_factory=list)  # parts already complete from an earlier run

    @property
    def train_images(self) -> int:
        return sum(self.classes.values())


def _archive_members(path: Path) -> list[TarMember]:
    if not path.is_file():
        raise DataError("archive not found", str(path), "check the path")
    members = scan_path(path)
    for m in members:
        check_safe(m, str(path))
    return members


def _copy_members(archive: Path, members: list[TarMember], dest: Path) -> None:
    with open(archive, "rb") as f:
        for m in members:
            f.seek(m.offset)
            with open(dest / m.name, "wb") as out:
                out.write(f.read(m.size))


def extract_class(archive: Path, inner: TarMember, dest: Path) -> tuple[str, int, int]:
    """Extract one inner per-class tar, read in place from the outer archive, into `dest/<wnid>/`."""
    wnid = inner.name.removesuffix(".tar")
    where = f"{archive} member {inner.name}"
    with open(archive, "rb", buffering=0) as f:
        f.seek(inner.offset)
        members = list(scan(_Window(f, inner.offset), inner.size, where))
    for m in members:
        check_safe(m, where)
    partial = dest / f".{wnid}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    _copy_members(archive, [TarMember(m.name, m.type, inner.offset + m.offset, m.size) for m in members], partial)
    os.replace(partial, dest / wnid)
    return wnid, len(members), inner.size


class _Window:
    """A read-only view of a file starting at `base`, so an inner tar is scanned where it lies."""

    def __init__(self, f, base: int) -> None:
        self.f, self.base = f, base

    def seek(self, pos: int) -> None:
        self.f.seek(self.base + pos)

    def read(self, n: int) -> bytes:
        return self.f.read(n)


def _load_ledger(root: Path) -> dict:
    path = root / LEDGER
    return json.loads(path.read_text()) if path.exists() else {"train": {}, "val": None}


def _check_not_foreign(dest: Path, name: str, ledger_has: bool) -> None:
    if (dest / name).exists() and not ledger_has:
        raise DataError(f"{dest / name} exists but was not written by `vitctl data extract`", str(dest),
                        "move it away or extract into an empty folder")


def extract_train(archive: Path, root: Path, workers: int, progress: Progress,
                  on_total: Progress) -> ExtractReport:
    members = _archive_members(archive)
    on_total(sum(m.size for m in members))
    for m in members:
        if not (m.name.endswith(".tar") and WNID.fullmatch(m.name[:-4])):
            raise DataError(f"member {m.name!r} is not a per-class tar named <wnid>.tar", str(archive),
                            "pass ILSVRC2012_img_train.tar (the outer archive of 1000 class tars)")
    dest = root / "train"
    dest.mkdir(parents=True, exist_ok=True)
    ledger = _load_ledger(root)
    report, todo = ExtractReport(), []
    for m in members:
        wnid = m.name[:-4]
        done = ledger["train"].get(wnid)
        _check_not_foreign(dest, wnid, done is not None)
        if done is not None and _count_files(dest / wnid) == done:
            report.classes[wnid] = done
            report.skipped.append(wnid)
            progress(m.size)
        else:
            shutil.rmtree(dest / wnid, ignore_errors=True)
            todo.append((archive, m, dest))
    for wnid, count, size in run_tasks(extract_class, todo, workers):
        report.classes[wnid] = ledger["train"][wnid] = count
        write_json_atomic(root / LEDGER, ledger)
        progress(size)
    return report


def _count_files(path: Path) -> int:
    return sum(1 for _ in path.iterdir()) if path.is_dir() else -1


def extract_val(archive: Path, root: Path, workers: int, progress: Progress, on_total: Progress) -> int:
    """Extract the flat val tar into `root/val/`; returns the image count."""
    members = _archive_members(archive)
    on_total(sum(m.size for m in members))
    ledger = _load_ledger(root)
    dest = root / "val"
    _check_not_foreign(root, "val", ledger["val"] is not None)
    if ledger["val"] is not None and dest.is_dir():
        progress(sum(m.size for m in members))
        return ledger["val"]
    partial = root / ".val.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    chunks = [members[i::workers] for i in range(workers)]
    for chunk_bytes in run_tasks(_copy_chunk, [(archive, c, partial) for c in chunks if c], workers):
        progress(chunk_bytes)
    if _count_files(partial) != len(members):
        raise DataError(f"{_count_files(partial)} files written, {len(members)} in the archive (repeated names?)",
                        str(archive), "use the original archive")
    os.replace(partial, dest)
    ledger["val"] = len(members)
    write_json_atomic(root / LEDGER, ledger)
    return len(members)


def _copy_chunk(archive: Path, members: list[TarMember], dest: Path) -> int:
    _copy_members(archive, members, dest)
    return sum(m.size for m in members)


def check_counts(report: ExtractReport, root: Path) -> None:
    """After extraction, every class folder holds exactly the images its inner tar listed."""
    for wnid, expected in report.classes.items():
        found = _count_files(root / "train" / wnid)
        if found != expected:
            raise DataError(f"class {wnid}: {found} files on disk, {expected} in the archive",
                            str(root / "train" / wnid), "rerun the same command to redo it")
