"""Run independent tasks in worker processes, reporting each result as it completes."""

import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any


def default_workers() -> int:
    return len(os.sched_getaffinity(0))


def run_tasks(fn: Callable[..., Any], tasks: Iterable[tuple], workers: int) -> Iterator[Any]:
    """Yield `fn(*task)` for each task, in completion order; one process runs them inline.

    At most `2 * workers` tasks are in flight, so a long task list is never materialised as futures.
    On error or interrupt, pending tasks are cancelled before the exception propagates.
    """
    if workers <= 1:
        for task in tasks:
            yield fn(*task)
        return
    pending: set[Future] = set()
    with ProcessPoolExecutor(max_workers=workers) as pool:
        try:
            for task in tasks:
                if len(pending) >= 2 * workers:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    yield from (f.result() for f in done)
                pending.add(pool.submit(fn, *task))
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                yield from (f.result() for f in done)
        except BaseException:
            for f in pending:
                f.cancel()
            raise
