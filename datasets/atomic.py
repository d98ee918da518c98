"""Atomic file writes: a temporary name in the same folder, fsync, then rename."""

import ctypes
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

PARTIAL_SUFFIX = ".partial"
_LIBC = ctypes.CDLL(None, use_errno=True)  # for syncfs, which the os module does not offer


def partial_path(path: Path) -> Path:
    """The hidden temporary name a file is written under before it is renamed to `path`."""
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


@contextmanager
def partial_open(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open the temporary name of `path` for writing; the file is removed again if the block fails."""
    tmp = partial_path(path)
    try:
        with open(tmp, mode) as f:
            yield f
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_dir(folder: Path) -> None:
    """Make the folder's entries (new names, renames) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_filesystem(folder: Path) -> None:
    """Make everything written to the filesystem holding `folder` durable: one syncfs instead of an fsync per file."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        if _LIBC.syncfs(fd) != 0:  # Linux reports writeback errors here since 5.8
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error), str(folder))
    finally:
        os.close(fd)


def publish(path: Path) -> None:
    """Make the file written by `partial_open(path)` durable (fsync), then give it its name, durably too."""
    fd = os.open(partial_path(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial_path(path), path)
    fsync_dir(path.parent)


@contextmanager
def atomic_open(path: Path, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open `path` for writing so that it appears under its name only once complete and durable."""
    with partial_open(path, mode) as f:
        yield f
    publish(path)


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1) + "\n")
