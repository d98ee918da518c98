"""Processes: which one a PID names now (a PID is reused once its process ends, so a recorded PID is checked against
the start time recorded with it before anything is sent to it), and how vitctl's own end."""

import atexit
import contextlib
import ctypes
import gc
import os
import socket
from pathlib import Path


def start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat field 22); None if it is gone (or a
    zombie, which has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name before ")" may hold spaces
    state, started = fields[0], fields[19]  # fields 3 and 22
    return None if state in ("Z", "X") else int(started)


def children(pid: int) -> list[int]:
    """The PIDs of the processes whose parent is `pid` (/proc/PID/stat field 4)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended meanwhile
            continue
        if int(text[text.rindex(")") + 2:].split()[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def with_environment(name: str, value: str) -> list[int]:
    """The PIDs of the live processes whose environment sets `name` to `value` (those this user may read)."""
    entry = f"{name}={value}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if entry in environ.read_bytes().split(b"\0") and start_time(int(environ.parent.name)) is not None:
                found.append(int(environ.parent.name))
        except OSError:  # ended meanwhile, or another user's
            continue
    return found


def is_running(pid: int, started: int | None) -> bool:
    """Process `pid` is alive and is the one that started at `started` (not a later process given the same PID)."""
    return started is not None and start_time(pid) == started


def this_process() -> tuple[int, int]:
    pid = os.getpid()
    return pid, start_time(pid) or 0


def started_at(ticks: int) -> float:
    """A start time (clock ticks since boot) as unix time."""
    boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime "))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def pid_space() -> tuple[str, str]:
    """This host's name and PID namespace: where a recorded PID names a process this one can see and signal."""
    return socket.gethostname(), os.readlink("/proc/self/ns/pid")


def skip_final_collection() -> None:
    """At exit, skip the collector's last walk over every object: with torch loaded it took 0.7 of a process's 1.0 s
    shutdown on a 2-core VM, and a job's ranks end at once. atexit handlers and finalizers still run."""
    atexit.register(gc.freeze)  # atexit runs before the interpreter's final collections; frozen objects skip them


PR_SET_PDEATHSIG = 1  # prctl(2)


def signal_when_parent_ends(signum: int, parent: int) -> bool:
    """Have the kernel send this process `signum` when its parent ends (Linux's parent-death signal, where libc has
    prctl); whether `parent` is still this process's parent (checked after: an end before the call sends nothing)."""
    with contextlib.suppress(OSError, AttributeError):  # no prctl: not Linux
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)
    return os.getppid() == parent
