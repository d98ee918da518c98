"""Shared fixtures: one small synthetic ImageNet, prepared once per session and copied where a test mutates it."""

import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from click.testing import CliRunner, Result
from torch.multiprocessing.spawn import ProcessContext, ProcessExitedException

from vitctl.cli.main import cli
from vitctl.datasets.synth import DEVKIT, TRAIN_TAR, VAL_TAR
from vitctl.workflows.process import children, start_time

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS = 5, 12, 4


# `vitctl` as root without its override of file modes: it reads and writes as a file's mode says, as users do.
AS_A_USER = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps",
             "-dac_override,-dac_read_search", sys.executable, "-m", "vitctl.cli"]


def vitctl(*args: object) -> Result:
    """Run the real CLI in-process; returns click's result (exit_code, stdout, stderr)."""
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def ok(*args: object) -> Result:
    result = vitctl(*args)
    assert result.exit_code == 0, result.output + result.stderr
    return result


def live_children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, zombies left out."""
    return [child for child in children(pid) if start_time(child) is not None]


def survivors_of_killing(parent: subprocess.Popen, workers: list[int], within: float) -> list[int]:
    """SIGKILL `parent` (no handler of it runs), wait up to `within` seconds for `workers` to end, and return those
    still running (killed then, so that a failing test leaves no orphans)."""
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + within
    while (left := [w for w in workers if start_time(w) is not None]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


RANKS_DEADLINE = 300.0  # seconds; the slowest rank test takes about 20 on this 2-core machine


def spawn_ranks(fn: Callable[..., None], nprocs: int, folder: Path, *args: object) -> None:
    """Run `fn(rank, init, *args)` on `nprocs` spawned processes that meet through a file in `folder`. Ranks that die
    by a signal or outlive RANKS_DEADLINE are killed and run once more: under torch's gloo, four ranks on two cores
    have aborted on heap corruption and hung (once each, in tests that pass otherwise). A rank that raises fails."""
    for attempt in (1, 2):
        init = f"file://{folder / f'gloo-init-{attempt}'}"
        context = mp.start_processes(fn, args=(init, *args), nprocs=nprocs, join=False, start_method="spawn")
        try:
            if _joined_within(context, RANKS_DEADLINE):
                return
            failure = f"a rank was still running after {RANKS_DEADLINE:.0f} s"
        except ProcessExitedException as e:
            if e.signal_name is None:
                raise
            failure = str(e)
        if attempt == 2:
            pytest.fail(f"{failure}, on the second attempt too")
        warnings.warn(f"{failure}; running the ranks once more", stacklevel=2)


def _joined_within(context: ProcessContext, seconds: float) -> bool:
    """Whether every process ended within `seconds` (those left are killed); raises as `join` does on a failure."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if context.join(timeout=1.0):
            return True
    for process in context.processes:
        process.kill()
        process.join()
    return False


@pytest.fixture(scope="module", autouse=True)
def fresh_compiles() -> None:
    """Each module compiles afresh: a training run compiles the recipe's graphs for one shape, the suite for dozens,
    and past dynamo's recompile limit per function a fullgraph compile fails (tests/test_gpu_augment.py did)."""
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def no_signals_left_blocked():
    """Blocked signals are inherited: a test that left Ctrl-C or SIGTERM blocked in pytest's main thread made every
    process the later tests started ignore them, and those tests failed, far from the cause."""
    yield
    if blocked := signal.pthread_sigmask(signal.SIG_BLOCK, []):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        pytest.fail(f"the test left {', '.join(sorted(s.name for s in blocked))} blocked in pytest's main thread")


@pytest.fixture(scope="session", autouse=True)
def job_registry(tmp_path_factory):
    """Jobs the tests submit are recorded in a temporary registry, not the user's ~/.vitctl."""
    home = tmp_path_factory.mktemp("vitctl-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VITCTL_HOME", str(home))
        yield home


@pytest.fixture(scope="session")
def archives(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("archives")
    ok("data", "synth", out, "--classes", CLASSES, "--train-per-class", TRAIN_PER_CLASS,
       "--val-per-class", VAL_PER_CLASS, "--seed", 7)
    return out


@pytest.fixture(scope="session")
def prepared_root(archives, tmp_path_factory) -> Path:
    """Extracted and valprepped dataset root (read-only for tests: copy before changing it)."""
    root = tmp_path_factory.mktemp("prepared") / "imagenet"
    ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--val-tar", archives / VAL_TAR, "--out", root,
       "--workers", 2)
    ok("data", "valprep", root / "val", "--devkit", archives / DEVKIT)
    return root


@pytest.fixture(scope="session")
def prepared_shards(prepared_root, tmp_path_factory) -> Path:
    """Shards with index files (read-only for tests: use `shards_copy` to change them)."""
    out = tmp_path_factory.mktemp("shards") / "shards"
    ok("data", "shard", prepared_root, "--out", out, "--maxcount", 16, "--workers", 2)
    ok("data", "index", out, "--workers", 2)
    return out


@pytest.fixture
def root_copy(prepared_root, tmp_path) -> Path:
    return Path(shutil.copytree(prepared_root, tmp_path / "imagenet"))


@pytest.fixture
def shards_copy(prepared_shards, tmp_path) -> Path:
    return Path(shutil.copytree(prepared_shards, tmp_path / "shards"))
