"""A training job: the config plus what to do on each rank. The local and Slurm executors run the same object."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TrainJob:
    config: dict[str, Any]  # RunConfig.to_dict()
    resume: bool = False
    use_cuda: bool = False

    @property
    def run_dir(self) -> Path:
        return Path(self.config["train"]["out_dir"])

    def __call__(self, should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        from vitctl.trainer.loop import train

        return train(self.config, resume=self.resume, use_cuda=self.use_cuda, should_stop=should_stop)
