"""Move flat validation images into WNID folders, checking everything before moving anything."""

import os
import shlex
from pathlib import Path

from .errors import DataError, are, count, listed
from .extract import extract_command
from .ilsvrc import VAL_PATTERN, WNID
from .lock import writing_in
from .oserrors import os_errors_explained


def _check_exists(val_dir: Path) -> None:
    if not val_dir.is_dir():
        raise DataError("validation folder not found", str(val_dir), f"{_extract_into(val_dir)} first")


def _extract_into(val_dir: Path) -> str:
    """How to write `val_dir`: the extract command, where it is a root's val/."""
    if val_dir.name == "val":
        return f"extract the val archive into it: {_extract_val(val_dir)}"
    return f"extract the val archive ({_extract_val(val_dir)}) and pass ROOT/val"


def _extract_val(val_dir: Path) -> str:
    """The command that extracts the val archive into the root of `val_dir` (ROOT where it is not named val/)."""
    if val_dir.name == "val":
        return f"`{extract_command(val_dir.parent, ['val'])}`"
    return "`vitctl data extract --val-tar ILSVRC2012_img_val.tar --out ROOT`"


def _scan_val(val_dir: Path) -> tuple[set[str], dict[str, str]]:
    """Flat image names, and name -> WNID for images already in folders; foreign entries raise."""
    _check_exists(val_dir)
    flat, placed, foreign, links = set(), {}, [], []
    for entry in os.scandir(val_dir):
        if entry.name.startswith("."):  # not images (.DS_Store, ._x.JPEG), as shard leaves them out too
            continue
        if entry.is_symlink():
            links.append(entry.name)
        elif entry.is_file(follow_symlinks=False):
            flat.add(entry.name)
        elif entry.is_dir(follow_symlinks=False) and WNID.fullmatch(entry.name):
            for image in os.scandir(entry.path):
                if not image.name.startswith("."):
                    placed[image.name] = entry.name
        else:
            foreign.append(entry.name)
    splits = sorted(set(foreign) & {"train", "val"})
    if splits:  # moving them out, as the message below says, would take the dataset apart
        val = val_dir / "val"
        raise DataError(f"holds {' and '.join(f'{s}/' for s in splits)}: it is the dataset root, not its val folder",
                        str(val_dir), f"pass {val} as VAL_DIR" if val.is_dir() else
                        f"extract the val archive into it (`{extract_command(val_dir, ['val'])}`), then pass {val} as "
                        "VAL_DIR")
    if links:  # moved into a WNID folder, a relative link would point nowhere
        what = "is a symbolic link" if len(links) == 1 else "are symbolic links"
        raise DataError(f"{count(len(links), 'entry', 'entries')} {what}, e.g. {links[0]}: valprep moves each image "
                        "into its WNID folder, and relative links would break", str(val_dir),
                        "put the images themselves there: `vitctl data extract --val-tar ILSVRC2012_img_val.tar "
                        "--out ROOT` writes them into ROOT/val (or copy them in with cp -L); nothing was moved")
    if foreign:
        raise DataError(f"unexpected entries (not images, not WNID folders): {listed(foreign)}", str(val_dir),
                        "move them out of the validation folder; nothing was moved")
    if not flat and not placed:  # the labels would all be "missing", and the fix would blame them
        raise DataError("holds no images: the val archive has not been extracted into it", str(val_dir),
                        f"{_extract_into(val_dir)}, then run valprep again")
    others = sorted(name for name in flat | placed.keys() if not VAL_PATTERN.fullmatch(name))
    if others and len(others) == len(flat) + len(placed):  # the train folder, the archives' folder
        val = val_dir.parent / "val"
        example = f"{placed[others[0]]}/{others[0]}" if others[0] in placed else others[0]
        raise DataError(f"holds no validation images (ILSVRC2012_val_<8 digits>.JPEG) but {len(others)} other "
                        f"{'file' if len(others) == 1 else 'files'}, e.g. {example}: it is not the val folder",
                        str(val_dir),
                        f"pass {val} as VAL_DIR" if val.is_dir() and not val.samefile(val_dir) else
                        "pass the val/ folder that `vitctl data extract --val-tar ILSVRC2012_img_val.tar --out ROOT` "
                        "wrote (ROOT/val)")
    return flat, placed


def check_train_classes(val_dir: Path, labels: dict[str, str], source: Path) -> None:
    """Refuse labels (read from `source`) naming WNIDs that are not class folders of the train/ beside `val_dir`.

    Shard numbers the labels of both splits by the train classes, so such images could never be sharded.
    """
    train = val_dir.parent / "train"
    classes = {e.name for e in os.scandir(train) if e.is_dir() and WNID.fullmatch(e.name)} if train.is_dir() else set()
    unknown = set(labels.values()) - classes
    if classes and unknown:
        raise DataError(f"the labels name {count(len(unknown), 'WNID')} that "
                        f"{'is not a class' if len(unknown) == 1 else 'are not classes'} under "
                        f"{train}: {listed(unknown)}",
                        str(source), f"pass the devkit or solution file of the dataset in {train}, or finish "
                        "extracting its train archive first; nothing was moved")


def plan_moves(val_dir: Path, labels: dict[str, str]) -> list[tuple[str, str]]:
    """The (image name, WNID) moves still to do; raises, moving nothing, on any mismatch."""
    flat, placed = _scan_val(val_dir)
    both = flat & placed.keys()
    present = flat | placed.keys()
    problems = []
    if both:
        problems.append(f"{count(len(both), 'image')} {are(len(both))} both flat and in a folder: {listed(both)}")
    missing, extra = labels.keys() - present, present - labels.keys()
    if missing:
        problems.append(f"{count(len(missing), 'image')} named by the labels {are(len(missing))} missing: "
                        f"{listed(missing)}")
    if extra:
        problems.append(f"{count(len(extra), 'image')} {are(len(extra))} not in the labels: {listed(extra)}")
    wrong = {name for name, wnid in placed.items() if labels.get(name, wnid) != wnid}
    if wrong:
        sit = "sits" if len(wrong) == 1 else "sit"
        problems.append(f"{count(len(wrong), 'image')} {sit} in the wrong WNID folder: {listed(wrong)}")
    if problems:
        raise DataError(f"labels ({count(len(labels), 'image')}) do not match the folder "
                        f"({count(len(present), 'image')}): " + "; ".join(problems), str(val_dir),
                        _mismatch_fix(val_dir, labels, wrong, missing, extra))
    return sorted((name, labels[name]) for name in flat)


def _mismatch_fix(val_dir: Path, labels: dict[str, str], wrong: set[str], missing: set[str], extra: set[str]) -> str:
    """A few images moved, deleted or added by hand, as often as labels of another archive (or an earlier valprep
    with them): the fix names each, and how to start over."""
    # a validation image whose extension's case was changed (.jpeg) is the labels' image under another name
    renamed = {name: f"{name[:-5]}.JPEG" for name in extra if name[-5:].lower() == ".jpeg"
               and f"{name[:-5]}.JPEG" in missing}
    missing, extra = missing - set(renamed.values()), extra - renamed.keys()
    strays = {name for name in extra if not VAL_PATTERN.fullmatch(name)}
    fixes = [f"rename {', '.join(f'{old} to {new}' for old, new in sorted(renamed.items())[:3])}"
             f"{' (and the others alike)' if len(renamed) > 3 else ''}: the names the labels give them"] \
        if renamed else []
    fixes += [f"move {listed(strays)} out of {val_dir}: not validation images"] if strays else []
    example = f" ({min(wrong)} belongs in {val_dir / labels[min(wrong)]})" if wrong else \
        f" ({min(missing)}, of {labels[min(missing)]}, is in ILSVRC2012_img_val.tar)" if missing else ""
    if wrong or missing or extra - strays:
        fixes.append(f"if images were moved, removed or added here by hand, put them back as the labels have "
                     f"them{example}")
    fixes.append(f"else check that the devkit/solution file and the val archive belong together; to start over (val "
                 f"sorted with another dataset's labels), `rm -r {shlex.quote(str(val_dir))}`, then "
                 f"{_extract_val(val_dir)} and valprep with this dataset's devkit; nothing was moved")
    return "; ".join(fixes)


def move_into_folders(val_dir: Path, moves: list[tuple[str, str]]) -> None:
    """Each rename is atomic, so an interrupted run leaves a state the next run completes."""
    for wnid in {wnid for _, wnid in moves}:
        (val_dir / wnid).mkdir(exist_ok=True)
    for name, wnid in moves:
        os.replace(val_dir / name, val_dir / wnid / name)


def sort_into_folders(val_dir: Path, labels: dict[str, str]) -> int:
    """Check, then make the moves into WNID folders; returns how many images were moved."""
    _check_exists(val_dir)
    with os_errors_explained(val_dir), writing_in(val_dir):  # two valprep at once would move the same images
        moves = plan_moves(val_dir, labels)
        move_into_folders(val_dir, moves)
    return len(moves)
