"""Which vitctl this is: its version, and the git commit it was built from. A job records both when it is submitted;
each rank compares them with its own (a container image may hold another vitctl than the one that submitted)."""

import contextlib
import hashlib
import os
import subprocess
from importlib.metadata import version
from pathlib import Path

from .errors import LaunchError

IMAGE_COMMIT_ENV = "VITCTL_GIT_COMMIT"  # set in the image to the commit it was built from
SOURCE = Path(__file__).resolve().parents[1]


def vitctl_version() -> str:
    return version("vitctl")


def image_commit() -> str | None:
    """The commit the image was built from, inside the image."""
    commit = os.environ.get(IMAGE_COMMIT_ENV, "unknown")
    return None if commit == "unknown" else commit


def git_commit() -> str | None:
    """The image's commit; else, for vitctl run from a git checkout, its HEAD, with `-dirty-DIGEST` where the checkout
    holds uncommitted changes (an image built from it holds them too); else None."""
    if commit := image_commit():
        return commit
    out = _git("rev-parse", "--show-toplevel", "HEAD")
    lines = out.decode().split() if out is not None else []
    # A vitctl installed into a virtual environment inside some other checkout must not take that one's commit.
    if len(lines) != 2 or Path(lines[0]) != SOURCE:
        return None
    changes = _changes_digest()
    return lines[1] + (f"-dirty-{changes}" if changes else "")


# What makes vitctl, as an image copies it (containers/Containerfile): changes elsewhere (docs, tests) leave it be.
CODE_PATHS = ("pyproject.toml", "setup.py", "cli", "datasets", "trainer", "workflows", "csrc", "containers")


def _changes_digest() -> str | None:
    """A digest of the uncommitted changes to CODE_PATHS (to tracked files, and files git does not track or ignore);
    None where there are none. The same changes give the same digest."""
    diff = _git("diff", "HEAD", "--binary", "--", *CODE_PATHS)
    untracked = _git("ls-files", "--others", "--exclude-standard", "-z", "--", *CODE_PATHS)
    if diff is None or untracked is None or not (diff or untracked):
        return None
    digest = hashlib.sha256(diff)
    for name in sorted(filter(None, untracked.split(b"\0"))):
        digest.update(b"\0" + name + b"\0")
        with contextlib.suppress(OSError):  # gone meanwhile, or unreadable: its name still counts
            digest.update((SOURCE / os.fsdecode(name)).read_bytes())
    return digest.hexdigest()[:12]


def _git(*args: str) -> bytes | None:
    """git's output for `args` in the source folder; None where git is missing or fails."""
    try:
        out = subprocess.run(["git", "-C", str(SOURCE), *args], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def describe(version_: str, commit: str | None) -> str:
    return f"vitctl {version_}" + (f" (commit {commit[:12]}{commit[40:]})" if commit else "")  # [40:]: -dirty-...


def check_same_vitctl(submitted_version: str | None, submitted_commit: str | None) -> None:
    """LaunchError unless this rank runs the vitctl that submitted the job. Commits are compared inside an image only:
    outside one, an editable checkout moves on while a job waits or is requeued, and refusing would strand it."""
    if submitted_version is None:  # pickled before jobs recorded their version
        return
    here, commit = vitctl_version(), image_commit()
    if submitted_version != here or (commit and submitted_commit and commit != submitted_commit):
        raise LaunchError(
            f"this job was submitted by {describe(submitted_version, submitted_commit)} but this rank runs "
            f"{describe(here, commit)}{' (the container image)' if commit else ''}: submit it with the vitctl the "
            "image was built from, or build the image from this checkout (vitctl image build) and pass it with "
            "--container-image")
