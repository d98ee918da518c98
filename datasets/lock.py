"""One writer per folder: a data command holds an exclusive lock on the folder it writes while it writes there."""

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import DataError

_held: set[int] = set()  # the folder descriptors this process locks


def _forget_in_child() -> None:
    """A forked worker closes its copies of the locked descriptors: flock belongs to the open descriptor, and a
    worker that outlives a killed parent for a moment would otherwise keep the folder locked against the rerun."""
    for fd in _held:
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)
# Locking is best effort where the file system has no flock for folders (NFS without local locks: EBADF, ENOLCK)
_UNSUPPORTED = {errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


@contextmanager
def writing_in(folder: Path) -> Iterator[None]:
    """Hold `folder`'s lock for the block; another vitctl holding it (two commands into one folder) is refused.

    The lock is on the folder itself (flock), so no lock file is left in it, and it ends with the process, however it
    ends (SIGKILL too).
    """
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError("another vitctl command is writing in this folder right now", str(folder),
                            "wait until it has ended, then run this command again: it goes on from what the other "
                            "one finished") from None
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
        _held.add(fd)
        yield
    finally:
        _held.discard(fd)
        os.close(fd)


def check_no_writer(folder: Path, command: str) -> None:
    """Refuse to read `folder` while a data command writes there: half-written shards (or an extraction under way)
    would read as damage. `command`: what to run once it has ended.

    The lock is only probed (shared, without waiting) and let go at once, so a writer starting now is not refused.
    """
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise DataError("another vitctl command is writing in this folder right now", str(folder),
                        f"run `{command}` once it has ended") from None
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise
    finally:
        os.close(fd)  # which lets go of the lock
