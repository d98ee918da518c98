"""The rank tests' launcher: a rank that dies by a signal or hangs is run once more, a rank that raises is not."""

import os
import signal
import time
from pathlib import Path

import pytest
from torch.multiprocessing.spawn import ProcessRaisedException

import conftest
from conftest import spawn_ranks


def _rank(rank: int, init: str, first: str, log: Path) -> None:
    """Rank 1 does `first` on the first attempt (an init file per attempt tells them apart); every rank logs its
    attempt."""
    attempt = init.rsplit("-", 1)[1]
    with open(log, "a") as f:
        f.write(f"{rank}:{attempt}\n")
    if rank == 1 and attempt == "1":
        if first == "abort":
            os.kill(os.getpid(), signal.SIGABRT)
        elif first == "hang":
            time.sleep(600)
        elif first == "raise":
            raise ValueError("a wrong result")


@pytest.mark.parametrize("first", ["abort", "hang"])
def test_a_rank_that_dies_by_a_signal_or_hangs_is_run_once_more(tmp_path, monkeypatch, first):
    monkeypatch.setattr(conftest, "RANKS_DEADLINE", 10.0)
    log = tmp_path / "log"
    with pytest.warns(UserWarning, match="running the ranks once more"):
        spawn_ranks(_rank, 2, tmp_path, first, log)
    # the second attempt ran both ranks (the first rank 0 may be stopped before it logs, when rank 1 aborts)
    assert {"1:1", "0:2", "1:2"} <= set(log.read_text().split()) <= {"0:1", "1:1", "0:2", "1:2"}


def test_a_rank_that_raises_fails_at_once(tmp_path):
    log = tmp_path / "log"
    with pytest.raises(ProcessRaisedException, match="a wrong result"):
        spawn_ranks(_rank, 2, tmp_path, "raise", log)
    assert "1:2" not in log.read_text().split()
