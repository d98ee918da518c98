"""Training losses of runs side by side, from their metrics.jsonl: the loss at each logged step and each run's final
loss (the mean of its last logged values) relative to the first run's. For parity checks such as apex's ops
against `--fused none` on the same seed and data."""

import argparse
import statistics
from pathlib import Path

from vitctl.trainer.metrics import read_metrics


def losses(run_dir: Path) -> dict[int, float]:
    """step -> the logged training loss (the last run wins where a resumed run logged a step twice)."""
    return {row["step"]: row["loss"] for row in read_metrics(run_dir) if "loss" in row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (--out of vitctl train); the first is "
                                                           "the reference")
    parser.add_argument("--last", type=int, default=5, help="logged values averaged into the final loss")
    args = parser.parse_args()
    curves = {run: losses(run) for run in args.runs}
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    if not steps:
        parser.error("the runs logged no training loss at a common step")
    print("| step | " + " | ".join(run.name for run in args.runs) + " |")
    print("|---:|" + "---:|" * len(args.runs))
    for step in steps:
        print(f"| {step} | " + " | ".join(f"{curves[run][step]:.4f}" for run in args.runs) + " |")
    finals = {run: statistics.fmean(curves[run][s] for s in steps[-args.last:]) for run in args.runs}
    reference = finals[args.runs[0]]
    for run, value in finals.items():
        print(f"{run.name}: final loss {value:.4f} (mean of the last {min(args.last, len(steps))} logged), "
              f"{(value - reference) / reference:+.2%} vs {args.runs[0].name}")


if __name__ == "__main__":
    main()
