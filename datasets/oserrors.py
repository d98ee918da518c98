"""The operating system's refusals (permissions, a full disk, a read-only file system) as DataError with a fix."""

import errno
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .atomic import PARTIAL_SUFFIX
from .errors import DataError

_RERUN = "then rerun the same command: it keeps what is finished"
_EXPLAINED = {
    errno.EACCES: ("permission denied", "give this user access to it, or use another folder"),
    errno.EPERM: ("operation not permitted", "give this user access to it, or use another folder"),  # see _immutable
    errno.EROFS: ("read-only file system", "write to a folder on a writable file system"),
    errno.ENOSPC: ("no space left on the device", f"free space there or use a folder on another device, {_RERUN}"),
    errno.EDQUOT: ("disk quota exceeded", f"free space within your quota, {_RERUN}"),
}


def as_data_error(e: OSError, folder: Path) -> DataError:
    """`e` as a message saying what failed on which file (else in `folder`), and how to fix it."""
    what, fix = _EXPLAINED.get(e.errno, (e.strerror or str(e), f"check the file system, {_RERUN}"))
    if e.filename is None:  # a failed write() names no file
        return DataError(what, str(folder), fix)
    where = _written(str(e.filename)) if e.filename2 is None else f"{e.filename} -> {e.filename2}"
    if e.errno == errno.EPERM and e.filename2 is None:
        fix = _immutable(Path(where))
    return DataError(what, where, fix)


def _immutable(path: Path) -> str:
    """EPERM's fix for `path` where root meets it: the immutable flag of it, or of the folder it would be made in."""
    flagged = path if path.exists() else next(p for p in path.absolute().parents if p.exists())
    return f"give this user access to it ({_flag(flagged, 'an immutable file or folder')}), or use another folder"


def _flag(path: Path, what: str) -> str:
    """How to see and clear the immutable flag that stops even root writing at `path`."""
    return f"{what}, with an i in `lsattr -d {path}`, needs `chattr -i {path}`"


def _written(filename: str) -> str:
    """The file a write was for: `partial_path`'s hidden temporary name means the file it becomes."""
    folder, name = os.path.split(filename)
    if name.startswith(".") and name.endswith(PARTIAL_SUFFIX):
        return os.path.join(folder, name[1:-len(PARTIAL_SUFFIX)])
    return filename


def write_refusal(path: Path) -> str | None:
    """Why no file can be created at `path` (a file to write; tried in the nearest folder of it that exists: os.access
    tells neither a read-only mount nor an immutable folder from a lack of permission), with its fix; None where one
    can."""
    folder = next(p for p in path.absolute().parents if p.exists())
    try:
        tempfile.TemporaryFile(dir=folder).close()
        return None
    except OSError as e:
        if e.errno == errno.EROFS:
            return f"{folder} is on a read-only file system"
        if e.errno == errno.EPERM:
            return f"{folder} takes no new files: operation not permitted ({_flag(folder, 'an immutable folder')})"
        return f"this user may not write in {folder} (give this user write access to {folder})"


def file_in_the_way(path: Path) -> Path | None:
    """The part of `path` (itself or a folder above it) that exists and is not a folder, or None."""
    existing = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    return None if existing is None or existing.is_dir() else existing


def what_it_is(blocker: Path) -> str:
    """`file_in_the_way`'s find, for a message: "X is a file" or "X is a broken symbolic link"."""
    return f"{blocker} is {'a broken symbolic link' if blocker.is_symlink() and not blocker.exists() else 'a file'}"


def make_folder(path: Path, option: str) -> None:
    """Create the folder `path` (given as `option`) and its parents; a file or a broken link in the way is bad input."""
    if blocker := file_in_the_way(path):
        raise DataError(f"{what_it_is(blocker)}, not a folder", str(path),
                        f"move {blocker} away, or choose another {option}: each part of its path must be a folder or "
                        "not exist yet")
    path.mkdir(parents=True, exist_ok=True)


@contextmanager
def os_errors_explained(folder: Path) -> Iterator[None]:
    """Re-raise any OSError in the block, where `folder` is written, as DataError (one line, not a traceback)."""
    try:
        yield
    except OSError as e:
        raise as_data_error(e, folder) from None
