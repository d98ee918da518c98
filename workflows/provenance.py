"""Which vitctl this is: its version, and the git commit it was built from. A job records both when it is submitted;
each rank compares them with its own (a container image may hold another vitctl than the one that submitted)."""

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
    """The image's commit; else, for vitctl run from a git checkout, its HEAD; else None."""
    if commit := image_commit():
        return commit
    try:
        out = subprocess.run(["git", "-C", str(SOURCE), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.split()
    # A vitctl installed into a virtual environment inside some other checkout must not take that one's commit.
    return lines[1] if out.returncode == 0 and len(lines) == 2 and Path(lines[0]) == SOURCE else None


def describe(version_: str, commit: str | None) -> str:
    return f"vitctl {version_}" + (f" (commit {commit[:12]})" if commit else "")


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
