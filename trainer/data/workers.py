"""Loader worker processes that leave the stop signals to their rank.

Slurm signals every process of a job step (USR2 before the time limit; TERM on a requeue, a pre-emption or `vitctl
cancel`), and Ctrl-C reaches the whole process group. A loader worker died of them, and its rank then failed
(torch's DataLoader: "worker killed by signal") or hung (DALI's pool waits on the dead worker's queue) instead of
checkpointing. Workers start inside `stop_signals_blocked`, so they inherit those signals blocked from their first
instruction; `leave_stop_signals_to_the_rank`, run in each, then takes them in a thread and ends the worker only at a
TERM from its rank, the way the loaders' own shutdown ends a worker that does not stop when asked.
"""

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import resource_tracker

STOP_SIGNALS = {signal.SIGTERM, signal.SIGUSR2, signal.SIGINT}


@contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Hold the stop signals back from this thread meanwhile; one that arrives is taken when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    # multiprocessing starts its resource tracker (at the first process started by spawn, as DALI's are) with SIGINT
    # and SIGTERM blocked, then unblocks them: started here, it keeps USR2 blocked too, and they are blocked again.
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def leave_stop_signals_to_the_rank(*_: object) -> None:
    """In a worker started inside `stop_signals_blocked`: take its stop signals, ending at its rank's TERM only."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # in case a library unblocked them since
    threading.Thread(target=_take_stop_signals, name="vitctl-stop-signals", daemon=True).start()


def _take_stop_signals() -> None:
    while True:
        taken = signal.sigwaitinfo(STOP_SIGNALS)
        if taken.si_signo == signal.SIGTERM and taken.si_pid == os.getppid():
            os._exit(0)
