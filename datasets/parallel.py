"""Run independent tasks in worker processes, reporting each result as it completes."""

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any


def default_workers() -> int:
    return len(os.sched_getaffinity(0))


_stopping: Any = None  # in a worker: an event the parent sets when it stops, so that tasks still queued do not start
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Have the kernel send this worker SIGTERM when its parent dies, however it dies (SIGKILL, the OOM killer)."""
    # Without this, workers of a killed parent live on as orphans, holding their memory, until their tasks end.
    # The kernel watches the thread that forked the worker: run_tasks's caller, for as long as the pool lives.
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _start_worker(stopping: Any, parent: int) -> None:
    global _stopping
    _stopping = stopping
    _die_with_parent(parent)
    # Ctrl-C reaches the whole process group. A worker interrupted while it waits for work prints a traceback,
    # and can die holding the task queue's lock, which hangs the pool's shutdown: so only tasks are interrupted.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _interruptible(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a worker, stopped by Ctrl-C like the parent, so that it removes its temporary files."""
    if _stopping.is_set():
        return None  # nobody waits for the result any more
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return fn(*args)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_tasks(fn: Callable[..., Any], tasks: Sequence[tuple], workers: int) -> Iterator[Any]:
    """Yield `fn(*task)` for each task, in completion order; one process runs them inline.

    No more worker processes start than there are tasks, and they die with this process.
    At most `2 * workers` tasks are in flight, so a long task list is never materialised as futures.
    On error or interrupt, tasks not yet started are dropped (and running ones interrupted by the same Ctrl-C)
    before the exception propagates.
    """
    workers = min(workers, len(tasks))  # a pool forks all its workers at once: --workers 100000 would exhaust memory
    if workers <= 1:
        for task in tasks:
            yield fn(*task)
        return
    pending: set[Future] = set()
    stopping = multiprocessing.get_context().Event()
    with ProcessPoolExecutor(max_workers=workers, initializer=_start_worker, initargs=(stopping, os.getpid())) as pool:
        try:
            for task in tasks:
                if len(pending) >= 2 * workers:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    yield from (f.result() for f in done)
                pending.add(pool.submit(_interruptible, fn, *task))
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                yield from (f.result() for f in done)
        except BaseException:
            stopping.set()
            for f in pending:
                f.cancel()
            raise
