"""Move flat validation images into WNID folders, checking everything before moving anything."""

import os
from pathlib import Path

from .errors import DataError
from .ilsvrc import WNID


def _sample(names: set[str] | list[str], n: int = 5) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _scan_val(val_dir: Path) -> tuple[set[str], dict[str, str]]:
    """Flat image names, and name -> WNID for images already in folders; foreign entries raise."""
    if not val_dir.is_dir():
        raise DataError("validation folder not found", str(val_dir), "run `vitctl data extract` first")
    flat, placed, foreign = set(), {}, []
    for entry in os.scandir(val_dir):
        if entry.is_file(follow_symlinks=False):
            flat.add(entry.name)
        elif entry.is_dir(follow_symlinks=False) and WNID.fullmatch(entry.name):
            for image in os.scandir(entry.path):
                placed[image.name] = entry.name
        else:
            foreign.append(entry.name)
    if foreign:
        raise DataError(f"unexpected entries (not images, not WNID folders): {_sample(foreign)}", str(val_dir),
                        "move them out of the validation folder; nothing was moved")
    return flat, placed


def check_train_classes(val_dir: Path, labels: dict[str, str], source: Path) -> None:
    """Refuse labels (read from `source`) naming WNIDs that are not class folders of the train/ beside `val_dir`.

    Shard numbers the labels of both splits by the train classes, so such images could never be sharded.
    """
    train = val_dir.parent / "train"
    classes = {e.name for e in os.scandir(train) if e.is_dir() and WNID.fullmatch(e.name)} if train.is_dir() else set()
    unknown = set(labels.values()) - classes
    if classes and unknown:
        raise DataError(f"the labels name {len(unknown)} WNIDs that are not classes under {train}: {_sample(unknown)}",
                        str(source), f"pass the devkit or solution file of the dataset in {train}, or finish "
                        "extracting its train archive first; nothing was moved")


def plan_moves(val_dir: Path, labels: dict[str, str]) -> list[tuple[str, str]]:
    """The (image name, WNID) moves still to do; raises, moving nothing, on any mismatch."""
    flat, placed = _scan_val(val_dir)
    both = flat & placed.keys()
    present = flat | placed.keys()
    problems = []
    if both:
        problems.append(f"{len(both)} images are both flat and in a folder: {_sample(both)}")
    missing, extra = labels.keys() - present, present - labels.keys()
    if missing:
        problems.append(f"{len(missing)} images named by the labels are missing: {_sample(missing)}")
    if extra:
        problems.append(f"{len(extra)} images are not in the labels: {_sample(extra)}")
    wrong = {name for name, wnid in placed.items() if labels.get(name, wnid) != wnid}
    if wrong:
        problems.append(f"{len(wrong)} images sit in the wrong WNID folder: {_sample(wrong)}")
    if problems:
        raise DataError(f"labels ({len(labels)} images) do not match the folder ({len(present)} images): "
                        + "; ".join(problems), str(val_dir),
                        "check that the devkit/solution file and the val archive belong together; nothing was moved")
    return sorted((name, labels[name]) for name in flat)


def move_into_folders(val_dir: Path, moves: list[tuple[str, str]]) -> None:
    """Each rename is atomic, so an interrupted run leaves a state the next run completes."""
    for wnid in {wnid for _, wnid in moves}:
        (val_dir / wnid).mkdir(exist_ok=True)
    for name, wnid in moves:
        os.replace(val_dir / name, val_dir / wnid / name)
