"""Extract the nested ILSVRC2012 train tar and the flat val tar, in parallel, resumably and crash-safely.

Each class folder (and val/ as a whole) is written under a hidden `.partial` name and made durable, then recorded
in the ledger, and only then renamed into place: a folder under its final name is always complete and recorded.
The ledger also records whether each archive was extracted to its end, which `vitctl data shard` checks.
"""

import hashlib
import json
import os
import re
import shlex
import shutil
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .atomic import PARTIAL_SUFFIX, fsync_dir, partial_path, sync_filesystem, write_json_atomic
from .errors import DataError, listed
from .ilsvrc import DEVKIT_DIR, DEVKIT_NAME, TRAIN_ARCHIVE, VAL_ARCHIVE, VAL_PATTERN, WNID
from .lock import check_no_writer, writing_in
from .manifest import MANIFEST
from .oserrors import make_folder, os_errors_explained
from .parallel import run_tasks
from .tarscan import TarMember, check_safe, scan, scan_path

LEDGER = ".vitctl-extract.json"
# 1 (no "format" key) recorded counts only, not which archive they came from. Records of 2 written before "complete"
# and "path" were added: a train record said nothing of whether it finished, a val record was written at the end.
LEDGER_FORMAT = 2
ARCHIVE_NAMES = {"train": "ILSVRC2012_img_train.tar", "val": "ILSVRC2012_img_val.tar"}  # in commands, if unrecorded
IDENTITY_BYTES = 1 << 20  # hashed at each end of an archive: tells copies apart in milliseconds, even at 140 GB
COPY_CHUNK = 16 << 20
VAL_FILES_PER_TASK = 500  # small tasks keep the progress bar moving and read the archive in order
TRAIN_IMAGE_CLASS = re.compile(r"(n\d{8})_")  # a train image is named <wnid>_<number>.JPEG
CLASS_PARTIAL = re.compile(rf"\.n\d{{8}}{re.escape(PARTIAL_SUFFIX)}")
Progress = Callable[[int], None]  # advance by n bytes


@dataclass
class ExtractReport:
    classes: dict[str, int] = field(default_factory=dict)  # wnid -> images
    skipped: list[str] = field(default_factory=list)  # parts already complete from an earlier run

    @property
    def train_images(self) -> int:
        return sum(self.classes.values())


def archive_identity(path: Path) -> dict[str, Any]:
    """What tells one archive from another: its size and a hash of its first and last MiB."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(IDENTITY_BYTES))
        f.seek(max(size - IDENTITY_BYTES, 0))
        digest.update(f.read(IDENTITY_BYTES))
    return {"name": path.name, "bytes": size, "head_tail_sha256": digest.hexdigest()}


def _same_archive(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["bytes"], a["head_tail_sha256"]) == (b["bytes"], b["head_tail_sha256"])


def _check_same_archive(recorded: dict[str, Any], identity: dict[str, Any], folder: Path) -> None:
    if _same_archive(recorded, identity):
        return
    if (recorded["name"], recorded["bytes"]) == (identity["name"], identity["bytes"]):
        what = (f"holds what was extracted from another copy of {identity['name']}: the same name and size "
                f"({identity['bytes']:,} bytes), other contents (the SHA-256 of its first and last MiB differs; a new "
                "download, or one of the two damaged)")
    else:
        what = (f"holds what was extracted from another archive ({recorded['name']}, {recorded['bytes']:,} bytes), "
                f"not from this one ({identity['name']}, {identity['bytes']:,} bytes)")
    raise DataError(what, str(folder), f"extract this archive into another --out, or remove {folder} and rerun")


def _damaged(known: str, then: str = "rerun") -> str:
    return f"the archive is damaged or not the original: download {known} again and {then}"


def split_folder_around(path: Path) -> Path | None:
    """The split folder (ROOT/train, ROOT/val) that `path` is or lies in, of a dataset root extract wrote (its ledger)
    or holding both splits; None where there is none."""
    for folder in (path.absolute(), *path.absolute().parents):
        other = {"train": "val", "val": "train"}.get(folder.name)
        if other and ((folder.parent / LEDGER).is_file() or (folder.parent / other).is_dir()):
            return folder
    return None


def _check_places(archive: Path, root: Path) -> None:
    """Refuse a root that lies in another root's split folder, and an archive in this root's: shard would read either
    as a class folder or an image."""
    if split := split_folder_around(root):
        raise DataError(f"lies in {split}, a split folder of the dataset root {split.parent}: extract writes a root's "
                        "train/ and val/ itself", f"--out {root}", f"pass the dataset root, --out {split.parent}")
    for split in (root / "train", root / "val"):
        if archive.absolute().is_relative_to(split.absolute()):
            raise DataError(f"lies in {split}, which extract fills with class folders (and shard reads as such)",
                            str(archive), f"move it out of {split}, e.g. into {root}, and pass it from there")


def _check_archive(path: Path, wanted: str) -> None:
    if not path.is_file():
        raise DataError("not found" if not path.exists() else "not a file", str(path), "pass the archive file")
    if "devkit" in path.name.lower():  # else its gzip error's fix, followed, led to an "unsafe member path" error
        raise _devkit_given(path, wanted)


def _devkit_given(path: Path, wanted: str) -> DataError:
    return DataError(f"this is the ILSVRC2012 devkit ({DEVKIT_NAME}), not {wanted}", str(path),
                     f"pass it to `vitctl data valprep VAL_DIR --devkit {shlex.quote(str(path))}`, and {wanted} here")


def _refuse_devkit(members: list[TarMember], archive: Path, wanted: str) -> None:
    """An empty tar; a devkit renamed, or decompressed as the gzip error advised: its members lie in the devkit's
    folder. Extracted, an empty tar would be recorded as done, and the right archive then refused as another."""
    if not members:
        raise DataError("holds no files: an empty tar", str(archive), f"pass {wanted}")
    if all(m.name.startswith(f"{DEVKIT_DIR}/") for m in members):
        raise _devkit_given(archive, wanted)


def _check_file_names(members: list[TarMember], where: str, fix: str) -> None:
    """Each member must become a distinct visible file: no empty, hidden ('.') or repeated names."""
    seen = set()
    for m in members:
        try:
            check_safe(m, where)
        except DataError as e:  # its fix (use the original) leaves out what to remove first
            raise DataError(e.what, where, fix) from None
        if not m.name or m.name.startswith("."):
            raise DataError(f"member {m.name!r} is not a file name (empty or starting with a dot)", where, fix)
        if m.name in seen:
            raise DataError(f"member {m.name!r} appears twice", where, fix)
        seen.add(m.name)


def _class_tars(archive: Path, dest: Path) -> list[TarMember]:
    members = scan_path(archive)
    _refuse_devkit(members, archive, TRAIN_ARCHIVE)
    _check_file_names(members, str(archive), _train_damaged(dest))
    for m in members:
        if not (m.name.endswith(".tar") and WNID.fullmatch(m.name[:-4])):
            raise DataError(f"member {m.name!r} is not a per-class tar named <wnid>.tar", str(archive),
                            f"pass {TRAIN_ARCHIVE}, the outer archive of 1000 class tars; if you did, "
                            + _damaged("it", "rerun"))
    return members


def _train_damaged(dest: Path) -> str:
    return _damaged(TRAIN_ARCHIVE, f"rerun (remove {dest} first if it holds classes extracted from this copy)")


def _val_images(archive: Path) -> list[TarMember]:
    members = scan_path(archive)
    _refuse_devkit(members, archive, VAL_ARCHIVE)
    _check_file_names(members, str(archive), _damaged(VAL_ARCHIVE))
    for m in members:
        if not VAL_PATTERN.fullmatch(m.name):
            raise DataError(f"member {m.name!r} is not a validation image ILSVRC2012_val_<8 digits>.JPEG",
                            str(archive), f"pass {VAL_ARCHIVE}")
    return members


def _copy_member(archive: Path, src: int, member: TarMember, path: Path) -> None:
    """Copy one member's bytes from `archive`, open as `src`, into a new file (made durable by `sync_filesystem`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        end = member.offset + member.size
        for start in range(member.offset, end, COPY_CHUNK):
            data = memoryview(os.pread(src, min(COPY_CHUNK, end - start), start))
            if len(data) != min(COPY_CHUNK, end - start):
                raise DataError(f"the archive shrank while member {member.name!r} was read", str(archive),
                                "rerun the same command once nothing writes to the archive")
            while data:
                data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def _copy_members(archive: Path, members: list[TarMember], folder: Path) -> int:
    """Copy `members` as files into `folder`; returns the bytes copied."""
    with open(archive, "rb", buffering=0) as f:
        for m in members:
            _copy_member(archive, f.fileno(), m, folder / m.name)
    return sum(m.size for m in members)


def extract_class(archive: Path, inner: TarMember, dest: Path) -> tuple[str, int, int]:
    """Write one inner per-class tar, read in place from the outer archive, durably into its `.partial` folder."""
    wnid = inner.name.removesuffix(".tar")
    where, fix = f"{archive} member {inner.name}", _train_damaged(dest)
    with open(archive, "rb", buffering=0) as f:
        members = _inner_members(f, archive, inner, dest)
    _check_file_names(members, where, fix)
    _check_class_images(members, wnid, where, fix)
    partial = partial_path(dest / wnid)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    _copy_members(archive, [m._replace(offset=inner.offset + m.offset) for m in members], partial)
    sync_filesystem(partial)  # the class's files and names, at once: an fsync per image costs minutes on ImageNet
    return wnid, len(members), inner.size


def _inner_members(f: Any, archive: Path, inner: TarMember, dest: Path) -> list[TarMember]:
    """The members of the class tar `inner`, scanned where it lies in `archive` (open as `f`)."""
    where = f"{archive} member {inner.name}"
    try:
        return list(scan(_Window(f, inner.offset), inner.size, where))
    except DataError as e:  # its own fix (decompress it, download it again) names a file the user cannot pass
        raise DataError(e.what, where, _train_damaged(dest)) from None


def _check_class_images(members: list[TarMember], wnid: str, where: str, fix: str) -> None:
    """A class tar of no images (extracted, its class would train on nothing, and shard's fix, to move the empty
    folder away, would then be refused as a lost class), holding another class's images (named <wnid>_N.JPEG), or
    two members of one sample key (x.JPEG, x.JPEG.bak): shard refuses those, and moving one out, as it says, would
    be refused in turn as an image lost since extract."""
    if not members:
        raise DataError("holds no images: an empty class tar", where, fix)
    if stray := next((m.name for m in members if (named := TRAIN_IMAGE_CLASS.match(m.name)) and named[1] != wnid),
                     None):
        raise DataError(f"member {stray!r} is an image of another class than {wnid}", where, fix)
    first_of = {}
    for m in members:
        key = m.name.split(".", 1)[0]  # the sample key shard gives it
        if key in first_of:
            raise DataError(f"members {first_of[key]!r} and {m.name!r} share the sample key {key!r} (the name up to "
                            "the first dot): `vitctl data shard` would refuse them", where, fix)
        first_of[key] = m.name


class _Window:
    """A read-only view of a file starting at `base`, so an inner tar is scanned where it lies."""

    def __init__(self, f, base: int) -> None:
        self.f, self.base = f, base

    def seek(self, pos: int) -> None:
        self.f.seek(self.base + pos)

    def read(self, n: int) -> bytes:
        return self.f.read(n)


def _load_ledger(root: Path) -> dict[str, Any]:
    path = root / LEDGER
    if not path.exists():
        return {"format": LEDGER_FORMAT, "train": None, "val": None}
    try:
        ledger = json.loads(path.read_text())
    except ValueError:
        ledger = None
    if not isinstance(ledger, dict) or ledger.get("format") != LEDGER_FORMAT:
        raise DataError("unreadable, or written by an older vitctl that did not record which archive was extracted",
                        str(path), f"extract into another --out, or remove {root / 'train'}, {root / 'val'} and "
                        f"{path} and rerun")
    return ledger


def _check_not_shards(root: Path) -> None:
    """Refuse an --out that `vitctl data shard` wrote: extracting there would mix a dataset root into its shards."""
    if (root / MANIFEST).is_file():
        raise DataError(f"holds {MANIFEST}: it is a folder of shards that `vitctl data shard` wrote, not a dataset "
                        "root", str(root), "extract into the dataset root that shard read from, or another --out")


def _rename_into_place(partial: Path, final: Path) -> None:
    os.replace(partial, final)
    fsync_dir(final.parent)


def _remove_partials(dest: Path) -> None:
    for entry in os.scandir(dest):
        if CLASS_PARTIAL.fullmatch(entry.name):
            shutil.rmtree(entry.path)


def _recorded_classes(ledger: dict[str, Any], identity: dict[str, Any], dest: Path) -> dict[str, int]:
    """wnid -> images of the classes an earlier run recorded, if any of them is still there; refuses another archive."""
    record = ledger["train"]
    if record is None or not any((dest / wnid).exists() for wnid in record["classes"]):
        return {}
    _check_same_archive(record["archive"], identity, dest)
    return record["classes"]


def _plan_classes(archive: Path, members: list[TarMember], recorded: dict[str, int], dest: Path,
                  progress: Progress) -> tuple[ExtractReport, list[tuple[Path, TarMember, Path]]]:
    """Report the classes an earlier run completed; the others are the tasks to do. Refuses folders not ours."""
    report, todo, foreign, changed = ExtractReport(), [], [], []
    for m in members:
        wnid = m.name[:-4]
        found = _count_files(dest / wnid)
        if wnid in recorded and found == recorded[wnid]:
            report.classes[wnid] = recorded[wnid]
            report.skipped.append(wnid)
            progress(m.size)
            continue
        if wnid not in recorded and os.path.lexists(dest / wnid):
            foreign.append(wnid)
        elif wnid in recorded and found >= 0:
            changed.append(m)
        todo.append((archive, m, dest))
    if len(foreign) == 1:
        raise DataError(f"{dest / foreign[0]} exists but was not written by `vitctl data extract`", str(dest),
                        "move it away or extract into an empty folder")
    if foreign:  # moving them away one at a time, one run each, would take a thousand runs
        ledger = dest.parent / LEDGER
        why = "" if ledger.exists() else f" ({ledger}, which records what extract wrote, is missing)"
        raise DataError(f"{dest / foreign[0]} and {len(foreign) - 1} more class folders exist but were not written "
                        f"by `vitctl data extract`{why}", str(dest),
                        f"move them away (all at once: `mv {shlex.quote(str(dest))} "
                        f"{shlex.quote(str(dest) + '.old')}`), or extract into an empty folder")
    _check_only_ours(archive, changed, dest)
    return report, todo


def _check_only_ours(archive: Path, changed: list[TarMember], dest: Path) -> None:
    """Refuse to redo recorded classes whose folders hold entries that are no member of their class tar: redoing a
    class removes its folder, and with it whatever the user added there (`augmented/`, `NOTES.txt`). Hidden files
    (`.DS_Store`, `._x.JPEG`: what file browsers write, and what the whole pipeline leaves out) go with it."""
    added = []
    with open(archive, "rb", buffering=0) as f:
        for inner in changed:
            folder = dest / inner.name[:-4]
            ours = {m.name for m in _inner_members(f, archive, inner, dest)}
            added += [f"{folder.name}/{e.name}" for e in os.scandir(folder) if not _ours_to_remove(e, ours)]
    if added:
        one = len(added) == 1
        raise DataError(f"{listed(added)}: {len(added)} {'entry' if one else 'entries'} that `vitctl data extract` "
                        "did not write, in class folders whose files changed since it recorded them: extracting "
                        f"those classes again would remove {'it' if one else 'them'}", str(dest),
                        f"move {'it' if one else 'them'} out of the class folder, then rerun")


def _ours_to_remove(entry: os.DirEntry, ours: set[str]) -> bool:
    """Whether redoing a class may remove `entry` of its folder: one of its images (`ours`), or a hidden file."""
    return entry.is_file(follow_symlinks=False) and (entry.name in ours or entry.name.startswith("."))


def extract_train(archive: Path, root: Path, workers: int, progress: Progress,
                  on_total: Progress) -> ExtractReport:
    """Extract the nested train tar into `root/train/<wnid>/`, keeping classes an earlier run completed."""
    with os_errors_explained(root):
        _check_archive(archive, TRAIN_ARCHIVE)
        _check_places(archive, root)
        _check_not_shards(root)
        dest = root / "train"
        _load_ledger(root)  # refused before the archive is read
        members = _class_tars(archive, dest)
        make_folder(root, "--out")
        with writing_in(root):  # a second extract into `root` at once would take this one's classes for foreign
            return _extract_train(archive, root, members, workers, progress, on_total)


def _extract_train(archive: Path, root: Path, members: list[TarMember], workers: int, progress: Progress,
                   on_total: Progress) -> ExtractReport:
    dest = root / "train"
    ledger, identity = _load_ledger(root), archive_identity(archive)
    recorded = _recorded_classes(ledger, identity, dest)
    on_total(sum(m.size for m in members))
    report, todo = _plan_classes(archive, members, recorded, dest, progress)
    make_folder(dest, "--out")
    record, ledger["train"] = ledger["train"], {"archive": identity, "path": str(archive.absolute()),
                                                "classes": recorded, "complete": not todo}
    if record != ledger["train"]:  # written only when changed, so that a read-only copy can still be checked
        write_json_atomic(root / LEDGER, ledger)
    try:
        _remove_partials(dest)
        for _, m, _ in todo:
            shutil.rmtree(dest / m.name[:-4], ignore_errors=True)  # recorded but incomplete: ours to redo
        with closing(run_tasks(extract_class, todo, workers)) as finished:
            for wnid, count, size in finished:
                recorded[wnid] = report.classes[wnid] = count
                write_json_atomic(root / LEDGER, ledger)  # first: whatever is under a class's name is recorded
                _rename_into_place(partial_path(dest / wnid), dest / wnid)
                progress(size)
    except BaseException:
        _remove_partials(dest)
        raise
    if todo:
        ledger["train"]["complete"] = True
        write_json_atomic(root / LEDGER, ledger)
    return report


def _count_files(path: Path) -> int:
    """The images in a class folder; hidden files (`.DS_Store`) are not among them, as shard leaves them out."""
    return sum(1 for e in path.iterdir() if not e.name.startswith(".")) if path.is_dir() else -1


def _images_under(folder: Path) -> int:
    """The files in `folder` and the folders below it (valprep's class folders), hidden ones left out."""
    return sum(1 for _, _, files in os.walk(folder) for name in files if not name.startswith("."))


def check_val_archive(archive: Path, root: Path) -> list[TarMember] | None:
    """The val tar's images, checked before anything is written (also before the train tar, hours earlier); None
    where `root/val` exists: a finished val/ is not read again."""
    with os_errors_explained(root):
        _check_archive(archive, VAL_ARCHIVE)
        _check_places(archive, root)
        _check_not_shards(root)
        _load_ledger(root)
        return None if os.path.lexists(root / "val") else _val_images(archive)


def extract_val(archive: Path, root: Path, workers: int, progress: Progress, on_total: Progress,
                members: list[TarMember] | None = None) -> int:
    """Extract the flat val tar into `root/val/`; returns the image count. `members`: check_val_archive's."""
    members = check_val_archive(archive, root) if members is None else members
    with os_errors_explained(root):
        make_folder(root, "--out")
        with writing_in(root):  # a second extract into `root` at once would remove this one's val/.partial
            return _extract_val(archive, root, members, workers, progress, on_total)


def _extract_val(archive: Path, root: Path, members: list[TarMember] | None, workers: int, progress: Progress,
                 on_total: Progress) -> int:
    ledger = _load_ledger(root)
    dest, partial = root / "val", partial_path(root / "val")
    if ledger["val"] is None and dest.is_dir() and not dest.is_symlink() and not any(dest.iterdir()):
        dest.rmdir()  # an empty val/ made by hand (as valprep's fix assumes) holds nothing to keep
    if os.path.lexists(dest):
        if ledger["val"] is None or not ledger["val"].get("complete", True):
            raise DataError(f"{dest} exists but was not written by `vitctl data extract`", str(root),
                            "move it away or extract into an empty folder")
        identity = archive_identity(archive)
        if not _same_archive(ledger["val"]["archive"], identity):
            _val_images(archive)  # not a val archive at all: that, before advice to remove val/
        _check_same_archive(ledger["val"]["archive"], identity, dest)
        found = _images_under(dest)
        if found or dest.is_symlink() or not dest.is_dir():
            check_val_intact(root, found)  # some lost since: extracting them again would mix into valprep's folders
            done = ledger["val"].get("bytes", archive.stat().st_size)  # as a fresh run counts (older: the file)
            on_total(done)
            progress(done)
            return ledger["val"]["images"]
        shutil.rmtree(dest)  # every image gone (folders at most): nothing to keep, extracted again below
    members = _val_images(archive) if members is None else members
    total = sum(m.size for m in members)
    on_total(total)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        ledger["val"] = {"archive": archive_identity(archive), "path": str(archive.absolute()),
                         "images": len(members), "bytes": total, "complete": False}
        write_json_atomic(root / LEDGER, ledger)
        tasks = [(archive, members[i:i + VAL_FILES_PER_TASK], partial)
                 for i in range(0, len(members), VAL_FILES_PER_TASK)]
        with closing(run_tasks(_copy_members, tasks, workers)) as finished:
            for task_bytes in finished:
                progress(task_bytes)
        sync_filesystem(partial)
        ledger["val"]["complete"] = True
        write_json_atomic(root / LEDGER, ledger)  # first: whatever is under the name val/ is recorded
        _rename_into_place(partial, dest)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return len(members)


def _unfinished(ledger: dict[str, Any], splits: Sequence[str]) -> list[str]:
    """Which of `splits` an extraction into this root began and did not record as finished (see LEDGER_FORMAT)."""
    return [s for s in splits if ledger[s] is not None and not ledger[s].get("complete", s == "val")]


def extract_command(root: Path, splits: Sequence[str]) -> str:
    """The `vitctl data extract` command for `splits` into `root`, naming the archives an earlier run recorded."""
    ledger = _load_ledger(root)
    paths = {s: _archive_path(ledger[s]) if ledger[s] else _beside_recorded(ledger, ARCHIVE_NAMES[s]) for s in splits}
    archives = [f"--{s}-tar {shlex.quote(path)}" for s, path in paths.items()]
    return f"vitctl data extract {' '.join(archives)} --out {shlex.quote(str(root))}"


def _archive_path(record: dict[str, Any]) -> str:
    return record.get("path", record["archive"]["name"])  # an older vitctl recorded the name only


def _beside_recorded(ledger: dict[str, Any], name: str) -> str:
    """The path of `name` beside an archive an earlier run recorded, where it is there; else `name` alone."""
    for record in filter(None, (ledger[s] for s in ARCHIVE_NAMES)):
        beside = Path(_archive_path(record)).parent / name
        if beside.is_absolute() and beside.is_file():
            return str(beside)
    return name


def beside_archives(root: Path, name: str) -> str:
    """`name` (the devkit, say) as a path beside the archives extracted into `root`, where it lies there."""
    return _beside_recorded(_load_ledger(root), name)


def check_finished(root: Path, splits: Sequence[str]) -> None:
    """Refuse a root whose extraction of the train archive (its classes label every split) or of `splits` stopped.

    A root that `vitctl data extract` did not write (no ledger) is the user's own tree, and passes.
    """
    if not (root / LEDGER).exists():
        return
    ledger = _load_ledger(root)
    unfinished = _unfinished(ledger, [s for s in ("train", "val") if s == "train" or s in splits])
    if unfinished:
        check_no_writer(root, "vitctl data shard")  # still extracting: not stopped
        archives = " and ".join(_progress_of(ledger, s) for s in unfinished)
        # a split that run never began (killed before it), which shard would ask for next, goes in the same command
        never = [s for s in ("train", "val") if s in splits and ledger[s] is None and not (root / s).exists()]
        raise DataError(f"`vitctl data extract` stopped before the end of {archives}: sharding it would leave out "
                        "the rest", str(root),
                        f"rerun `{extract_command(root, [*unfinished, *never])}`: it resumes where it stopped")


def check_train_intact(root: Path, count_images: bool) -> None:
    """Refuse a root whose train classes (with `count_images`, their images too) are fewer than extract recorded:
    a class left out would shift the label of every class after it. A root without a ledger passes."""
    if not (root / LEDGER).exists():
        return
    record = _load_ledger(root)["train"]
    if record is None:
        return
    dest, recorded = root / "train", record["classes"]
    missing = sorted(w for w in recorded if not (dest / w).is_dir())
    counts = {w: _count_files(dest / w) for w in recorded if count_images and w not in missing}
    short = [f"{w} holds {counts[w]} of its {recorded[w]} images" for w in sorted(counts) if counts[w] < recorded[w]]
    lost = [f"class folder {listed(missing, 3)} {'is' if len(missing) == 1 else 'are'} missing"] if missing else []
    lost += [f"class {listed(short, 3)}"] if short else []
    if lost:
        raise DataError(f"lost since `vitctl data extract` wrote it: {'; '.join(lost)}: sharding would leave them "
                        "out, and a class left out shifts the labels of the classes after it", str(dest),
                        f"rerun `{extract_command(root, ['train'])}`: it extracts those classes again (or, to shard "
                        f"without them, move {root / LEDGER} away: without it shard takes the tree as it is)")


def check_val_intact(root: Path, found: int) -> None:
    """Refuse a val split of fewer images than extract recorded: an evaluation would score part of it unsaid. A
    root without a ledger passes."""
    if not (root / LEDGER).exists():
        return
    record = _load_ledger(root)["val"]
    if record is None or not record.get("complete", True) or found >= record["images"]:
        return
    val, lost = root / "val", record["images"] - found
    devkit = shlex.quote(_beside_recorded(_load_ledger(root), DEVKIT_NAME))
    raise DataError(f"val holds {found} of the {record['images']} images `vitctl data extract` wrote: {lost} "
                    f"{'was' if lost == 1 else 'were'} lost since, and an evaluation would score part of the val set",
                    str(val),
                    f"extract val again: `rm -r {shlex.quote(str(val))}`, then `{extract_command(root, ['val'])}` "
                    f"and `vitctl data valprep {shlex.quote(str(val))} --devkit {devkit}` (or, to shard without "
                    f"them, move {root / LEDGER} away: without it shard takes the tree as it is)")


def _progress_of(ledger: dict[str, Any], split: str) -> str:
    name = ledger[split]["archive"]["name"]
    if split == "val":
        return name
    done = len(ledger[split]["classes"])
    return f"{name} ({done} {'class' if done == 1 else 'classes'} extracted)"
