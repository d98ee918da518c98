"""Run independent tasks in worker processes, reporting each result as it completes."""

import ctypes
import functools
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from typing import Any


def default_workers() -> int:
    return len(os.sched_getaffinity(0))


_POLL_S = 0.2  # how soon a Ctrl-C sent to this process alone (not its workers) stops the wait for results
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


def hangup_as_interrupt() -> None:
    """From now on a hangup (a closed terminal, a dropped SSH link) interrupts this process as Ctrl-C does, so that
    it stops as cleanly; unless hangups are ignored (nohup)."""
    if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        signal.signal(signal.SIGHUP, _interrupt_self)


def termination_as_interrupt() -> None:
    """From now on SIGTERM (`kill`, `timeout`) interrupts this process as Ctrl-C does: it removes its unfinished files
    and says so, where the default would end it at once and silently."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, terminated)


def terminated(signum: int, frame: Any) -> None:
    """SIGTERM's handler: what Ctrl-C's does now (it may defer the interrupt to the end of a write), and where SIGINT
    is ignored, as in a command started with `&` from a script, an interrupt all the same."""
    handler = signal.getsignal(signal.SIGINT)
    if not callable(handler):
        raise KeyboardInterrupt
    handler(signal.SIGINT, frame)


def _interrupt_self(signum: int, frame: object) -> None:
    os.kill(os.getpid(), signal.SIGINT)  # whatever SIGINT's handler is now: deferred, ignored, KeyboardInterrupt


def _worker_terminated(parent: int, signum: int, frame: object) -> None:
    """A worker's SIGTERM: from its parent's death (_die_with_parent) it ends at once, as nobody waits for its task;
    else it stops its task as Ctrl-C does (a `kill` of the process group), removing the task's unfinished files."""
    if os.getppid() != parent:
        os._exit(1)
    _interrupt_self(signum, frame)


def _start_worker(stopping: Any, parent: int) -> None:
    global _stopping
    _stopping = stopping
    _die_with_parent(parent)
    hangup_as_interrupt()
    signal.signal(signal.SIGTERM, functools.partial(_worker_terminated, parent))
    # Ctrl-C reaches the whole process group. A worker interrupted while it waits for work prints a traceback,
    # and can die holding the task queue's lock, which hangs the pool's shutdown: so only tasks are interrupted.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _interruptible(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a worker, stopped by Ctrl-C like the parent, so that it removes its temporary files."""
    if _stopping.is_set():
        return None  # nobody waits for the result any more
    pressed = []

    def on_ctrl_c(signum: int, frame: object) -> None:
        pressed.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        return fn(*args)
    except Exception:
        # Some code wraps the KeyboardInterrupt in another error: PIL's first Image.open imports its plugins, and a
        # Ctrl-C in a class body's __set_name__ comes out as RuntimeError. The parent must see an interrupt.
        if pressed:
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def _ctrl_c_deferred() -> Iterator[list[int]]:
    """Within the block Ctrl-C (and SIGTERM, where `terminated` takes it as Ctrl-C) is only recorded (in the list
    yielded); KeyboardInterrupt is raised as it ends.

    concurrent.futures takes its locks in steps of plain Python: wait() acquires each future's lock in a loop, and
    submit() records a task before it queues it. A KeyboardInterrupt raised between two steps leaves a lock held or a
    task never queued, and the pool's shutdown then waits for ever.
    """
    pressed: list[int] = []
    ours = [signum for signum, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, terminated))
            if signal.getsignal(signum) is handler]  # an ignored Ctrl-C (a command started with &) is not ours
    if threading.current_thread() is not threading.main_thread() or not ours:
        yield pressed
        return
    previous = {signum: signal.signal(signum, lambda signum, frame: pressed.append(signum)) for signum in ours}
    try:
        yield pressed
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if pressed:
        raise KeyboardInterrupt


def _wait_any(pending: set[Future]) -> tuple[set[Future], set[Future]]:
    """The futures of `pending` that are done (at least one) and those that are not."""
    done: set[Future] = set()
    with _ctrl_c_deferred() as pressed:
        while not done and not pressed:
            done, pending = wait(pending, timeout=_POLL_S, return_when=FIRST_COMPLETED)
    return done, pending


def run_tasks(fn: Callable[..., Any], tasks: Sequence[tuple], workers: int) -> Iterator[Any]:
    """Yield `fn(*task)` for each task, in completion order; one process runs them inline.

    No more worker processes start than there are tasks, and they die with this process.
    At most `2 * workers` tasks are in flight, so a long task list is never materialised as futures.
    On error or interrupt, or when the caller closes the generator (use `contextlib.closing`, so that this happens at
    once), tasks not yet started are dropped and running ones (which the same Ctrl-C interrupts) are waited for.
    """
    workers = min(workers, len(tasks))  # a pool forks all its workers at once: --workers 100000 would exhaust memory
    if workers <= 1:
        for task in tasks:
            yield fn(*task)
        return
    pending: set[Future] = set()
    stopping = multiprocessing.get_context().Event()
    pool = ProcessPoolExecutor(max_workers=workers, initializer=_start_worker, initargs=(stopping, os.getpid()))
    try:
        for task in tasks:
            if len(pending) >= 2 * workers:
                done, pending = _wait_any(pending)
                yield from (f.result() for f in done)
            with _ctrl_c_deferred():
                pending.add(pool.submit(_interruptible, fn, *task))
        while pending:
            done, pending = _wait_any(pending)
            yield from (f.result() for f in done)
    finally:
        with _ctrl_c_deferred():
            stopping.set()
            for f in pending:
                f.cancel()
            pool.shutdown()
