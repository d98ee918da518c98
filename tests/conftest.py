"""Shared fixtures: one small synthetic ImageNet, prepared once per session and copied where a test mutates it."""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

from vitctl.cli.main import cli
from vitctl.datasets.synth import DEVKIT, TRAIN_TAR, VAL_TAR
from vitctl.workflows.process import children, start_time

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")

CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS = 5, 12, 4


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


@pytest.fixture(scope="module", autouse=True)
def fresh_compiles() -> None:
    """Each module compiles afresh: a training run compiles the recipe's graphs for one shape, the suite for dozens,
    and past dynamo's recompile limit per function a fullgraph compile fails (tests/test_gpu_augment.py did)."""
    torch._dynamo.reset()


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
