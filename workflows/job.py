"""A training job: the config plus what to do on each rank. The local and Slurm executors run the same object."""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .provenance import check_same_vitctl, git_commit, vitctl_version


@dataclass(frozen=True)
class TrainJob:
    config: dict[str, Any]  # RunConfig.to_dict()
    resume: bool = False
    use_cuda: bool = False
    # The submitter's vitctl, pickled with the job: a rank in a container image may run another one.
    vitctl_version: str | None = field(default_factory=vitctl_version)
    git_commit: str | None = field(default_factory=git_commit)

    @property
    def run_dir(self) -> Path:
        return Path(self.config["train"]["out_dir"])

    def __call__(self, should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        # getattr: a job pickled by a vitctl that recorded no version.
        check_same_vitctl(getattr(self, "vitctl_version", None), getattr(self, "git_commit", None))
        from vitctl.trainer.loop import train

        return train(self.config, resume=self.resume, use_cuda=self.use_cuda, should_stop=should_stop)
