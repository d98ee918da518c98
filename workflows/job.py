"""A training job: the config plus what to do on each rank. Local launches and Slurm submit the same object."""

import json
import sys
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

    def __call__(self) -> dict[str, Any]:
        from vitctl.trainer.loop import train

        return train(self.config, resume=self.resume, use_cuda=self.use_cuda)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"config": self.config, "resume": self.resume, "use_cuda": self.use_cuda}))

    @classmethod
    def read(cls, path: Path) -> "TrainJob":
        return cls(**json.loads(path.read_text()))


if __name__ == "__main__":  # one rank of a local multi-process launch
    result = TrainJob.read(Path(sys.argv[1]))()
    print(json.dumps(result))
