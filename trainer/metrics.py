"""Rank-0 metrics as JSON lines in the run folder (and TensorBoard when it is installed); MFU estimates."""

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vitctl.datasets.atomic import write_text_atomic

if TYPE_CHECKING:  # `vitctl status` reads metrics without importing torch, which takes seconds
    import torch

log = logging.getLogger("vitctl.metrics")
METRICS_FILE = "metrics.jsonl"
# The records an attempt logged past its last checkpoint, which a later attempt trains and logs again: out of the run's
# curve, kept for the row of the job that trained them (`vitctl status`).
SUPERSEDED_FILE = "metrics.superseded.jsonl"
# Dense bf16 peak per GPU, from the vendors' datasheets; MFU is reported against it.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def peak_flops(device: "torch.device") -> float | None:
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def mfu(train_flops_per_image: float, images_per_second: float, device: "torch.device") -> float | None:
    peak = peak_flops(device)
    return None if peak is None else train_flops_per_image * images_per_second / peak


class MetricsWriter:
    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.enabled, self.path = enabled, run_dir / METRICS_FILE
        self.tensorboard = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError:
                pass

    def drop_after(self, step: int) -> None:
        """Rewrite the log (atomically) without the records past `step`: an attempt that ended before checkpointing
        them wrote them, and the run writes those steps again. A line cut short by a crash, or damaged, goes too."""
        if not self.enabled or not self.path.exists():
            return
        lines = self.path.read_text(errors="replace").splitlines()  # a damaged line is dropped as a cut one
        steps = list(map(_step_of, lines))
        kept = [line for line, at in zip(lines, steps, strict=True) if at is not None and at <= step]
        if len(kept) < len(lines):
            # Kept first: a crash before the rewrite leaves them in both files, which the reader takes once.
            with open(self.path.with_name(SUPERSEDED_FILE), "a") as f:
                f.writelines(f"{line}\n" for line, at in zip(lines, steps, strict=True) if at is not None and at > step)
            write_text_atomic(self.path, "".join(f"{line}\n" for line in kept))
            log.warning("%s: dropped %d records past step %d, which this run writes again", self.path,
                        len(lines) - len(kept), step)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"time": round(time.time(), 3), **record}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, int | float) and key not in ("time", "step"):
                    self.tensorboard.add_scalar(key, value, record.get("step", 0))
        log.info("%s", " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
                                if k != "time"))

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def _step_of(line: str) -> int | None:
    """The step of a record; None for a line that does not parse (cut short) or holds no step."""
    try:
        step = json.loads(line).get("step")
    except (json.JSONDecodeError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def read_metrics(run_dir: Path, superseded: bool = False) -> list[dict[str, Any]]:
    """The records; a line that does not parse (being written now, cut short by a crash, damaged) is left out. With
    `superseded`, also those a later attempt logged again, all in the order they were written."""
    lines = _lines(run_dir / METRICS_FILE)
    if superseded:
        lines = list(dict.fromkeys(_lines(run_dir / SUPERSEDED_FILE) + lines))
    records = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    records = [r for r in records if isinstance(r, dict)]
    return sorted(records, key=lambda r: r.get("time", 0)) if superseded else records


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:  # none yet, or not a file that can be read: no records (a launch says why)
        return []
