"""`vitctl data ...`: ImageNet-1k preparation from the original archives to verified shards."""

import os
from pathlib import Path

import click
from rich.markup import escape
from rich.table import Table

from vitctl.datasets import extract as ex
from vitctl.datasets import ilsvrc, manifest, valprep
from vitctl.datasets.errors import count
from vitctl.datasets.index import index_folder, unfinished_splits
from vitctl.datasets.parallel import default_workers
from vitctl.datasets.shard import ShardSpec, read_source, shard_split
from vitctl.datasets.synth import LEAVES, MIN_CLASSES, SynthSpec, write_synthetic
from vitctl.datasets.verify import verify as verify_folder

from .commands import summary
from .console import ByteSize, GivenPath, console, err_console, progress_bar

FULL_IMAGENET = {"classes": 1000, "train": 1_281_167, "val": 50_000}
workers_option = click.option("--workers", type=click.IntRange(min=1), default=default_workers, show_default="CPUs",
                              help="Worker processes.")


class ExistingPath(GivenPath):
    """click.Path(exists=True) that names a symbolic link leading nowhere as such, not as a path that does not exist."""

    def __init__(self, **kwargs) -> None:
        super().__init__(exists=True, path_type=Path, **kwargs)

    def convert(self, value, param, ctx):
        if isinstance(value, str | Path) and os.path.islink(value) and not os.path.exists(value):
            self.fail(f"{str(value)!r} is a symbolic link that leads nowhere (to {os.readlink(value)!r}: missing, "
                      "or a loop of links)", param, ctx)
        return super().convert(value, param, ctx)


existing = ExistingPath()
SPLIT_COLUMNS = ("split", "shards", "samples", "bytes", "converted", "skipped")
SHOWN = 5  # names listed in full before "and N more"


def split_row(split: str, entries: list[dict]) -> list[str]:
    """One split's totals from its manifest entries."""
    samples, size = sum(e["samples"] for e in entries), sum(e["bytes"] for e in entries)
    return [split, str(len(entries)), f"{samples:,}", f"{size:,}", str(sum(len(e["conversions"]) for e in entries)),
            str(sum(len(e["skipped"]) for e in entries))]


def some(names: list[str]) -> str:
    """The first few names, and how many more there are."""
    return ", ".join(names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


@click.group(short_help=summary("data"))
def data() -> None:
    """Prepare ImageNet-1k: synth, extract, valprep, shard, index, verify."""


@data.command(short_help="Write a small dataset in the ILSVRC2012 archive formats.")
@click.argument("out", type=GivenPath(file_okay=False, path_type=Path))
@click.option("--classes", type=click.IntRange(MIN_CLASSES, len(LEAVES)), metavar="N", default=10, show_default=True,
              help=f"Number of classes: {MIN_CLASSES} (for the PNG, CMYK and grayscale images) to {len(LEAVES)} (the "
                   "real WNIDs synth knows).")
@click.option("--train-per-class", type=click.IntRange(min=1), metavar="N", default=20, show_default=True,
              help="Train images per class.")
@click.option("--val-per-class", type=click.IntRange(min=1), metavar="N", default=5, show_default=True,
              help="Validation images per class.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the images and of the val labels.")
def synth(out: Path, classes: int, train_per_class: int, val_per_class: int, seed: int) -> None:
    """Write a small dataset in the real ILSVRC2012 archive formats into OUT."""
    paths = write_synthetic(out, SynthSpec(classes, train_per_class, val_per_class, seed))
    table = Table("archive", "bytes", title=f"synthetic ILSVRC2012 ({classes} classes)")
    for path in paths.values():
        table.add_row(str(path), f"{path.stat().st_size:,}")
    console.print(table)


@data.command(short_help="Extract the ILSVRC2012 archives into a dataset root; a rerun resumes.")
@click.option("--train-tar", type=existing, help="ILSVRC2012_img_train.tar (nested per-class tars).")
@click.option("--val-tar", type=existing, help="ILSVRC2012_img_val.tar (flat).")
@click.option("--out", "root", required=True, type=GivenPath(file_okay=False, path_type=Path), help="Dataset root.")
@workers_option
def extract(train_tar: Path | None, val_tar: Path | None, root: Path, workers: int) -> None:
    """Extract the archives into ROOT/train/<wnid>/ and ROOT/val/; a rerun resumes."""
    if train_tar is None and val_tar is None:
        raise click.UsageError("pass --train-tar, --val-tar or both")
    table = Table("split", "classes", "images", "resumed", title=f"extracted into {root}")
    val_members = ex.check_val_archive(val_tar, root) if val_tar else None  # not after hours of train
    if train_tar:
        with progress_bar("train", unit="bytes") as bar:
            report = ex.extract_train(train_tar, root, workers, bar.advance, bar.set_total)
        table.add_row("train", str(len(report.classes)), f"{report.train_images:,}", f"{len(report.skipped)} classes")
    if val_tar:
        with progress_bar("val", unit="bytes") as bar:
            count = ex.extract_val(val_tar, root, workers, bar.advance, bar.set_total, val_members)
        table.add_row("val", "", f"{count:,}", "")
    console.print(table)
    if train_tar and (len(report.classes), report.train_images) != (FULL_IMAGENET["classes"], FULL_IMAGENET["train"]):
        console.print(f"note: not the full ImageNet-1k train set ({FULL_IMAGENET['classes']} classes, "
                      f"{FULL_IMAGENET['train']:,} images)")


@data.command(name="valprep", short_help="Move the flat val images into WNID folders.")
@click.argument("val_dir", type=GivenPath(file_okay=False, path_type=Path))
@click.option("--devkit", type=existing, help="ILSVRC2012_devkit_t12.tar.gz (or --solution).")
@click.option("--solution", type=existing, help="Kaggle's LOC_val_solution.csv (or --devkit).")
def valprep_command(val_dir: Path, devkit: Path | None, solution: Path | None) -> None:
    """Move VAL_DIR's flat images into WNID folders, labelled by --devkit or --solution (one of the two; no
    network; idempotent)."""
    if (devkit is None) == (solution is None):
        raise click.UsageError("pass exactly one of --devkit and --solution")
    labels = ilsvrc.val_labels_from_devkit(devkit) if devkit else ilsvrc.val_labels_from_solution(solution)
    valprep.check_train_classes(val_dir, labels, devkit or solution)
    moved = valprep.sort_into_folders(val_dir, labels)
    done = len(labels) - moved
    console.print(f"valprep: moved {count(moved, 'image')} into {count(len(set(labels.values())), 'WNID folder')}"
                  + (f" ({count(done, 'was', 'were')} already in place)" if done else ""))


@data.command(short_help="Write WebDataset shards and manifest.json; a rerun resumes.")
@click.argument("root", type=ExistingPath(file_okay=False))
@click.option("--out", required=True, type=GivenPath(file_okay=False, path_type=Path),
              help="Shard folder (created; a rerun into it resumes).")
@click.option("--split", type=click.Choice(["train", "val", "both"]), default="both", show_default=True,
              help="The split(s) to shard.")
@click.option("--maxsize", type=ByteSize(at_least="10KB"), default="1GB", show_default=True,
              help="Target bytes per shard: a number of bytes, or with a unit KB, MB, GB, TB (powers of 1000) or "
                   "KiB, MiB, GiB, TiB (powers of 1024); at least 10KB.")
@click.option("--maxcount", type=click.IntRange(min=1), default=10_000, show_default=True, help="Samples per shard.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Shuffle seed.")
@click.option("--on-bad-image", type=click.Choice(["skip", "fail"]), default="skip", show_default=True,
              help="An image found unreadable: leave it out (manifest.json lists it) or stop. RGB JPEGs are checked by "
                   "their headers and end marker, not decoded (`vitctl data verify --decode N` decodes them); others "
                   "are decoded to convert them. A rerun may change this.")
@workers_option
def shard(root: Path, out: Path, split: str, maxsize: int, maxcount: int, seed: int, on_bad_image: str,
          workers: int) -> None:
    """Write ROOT's images as WebDataset shards OUT/imagenet-{train,val}-NNNNNN.tar, and OUT/manifest.json.

    ROOT is the folder `vitctl data extract --out` wrote (val/ sorted by `vitctl data valprep`). A rerun checks
    the shards written before (sha256), writes again any that is missing or damaged, and writes the rest.
    Hidden files (.DS_Store, ._*) are not images and are left out.
    """
    spec = ShardSpec(maxsize, maxcount, seed, on_bad_image)
    spec.validate()
    splits = ("train", "val") if split == "both" else (split,)
    with progress_bar("listing images", unit="samples"):
        source = read_source(root, splits)  # every split's input is checked before anything is written
    table = Table(*SPLIT_COLUMNS, title=f"shards in {out}")
    notes = []
    for name in splits:
        with progress_bar(f"{name}: planning", unit="samples") as bar:
            result = shard_split(root, out, name, spec, workers, bar.advance, lambda n, name=name: bar.phase(name, n),
                                 source)
        table.add_row(*split_row(name, result.info["shards"]))
        skipped = [s for entry in result.info["shards"] for s in entry["skipped"]]
        if skipped:
            images = "image" if len(skipped) == 1 else "images"
            notes.append(f"{name}: skipped {len(skipped)} unreadable {images} (all listed under \"skipped\" in "
                         f"{out / manifest.MANIFEST}):")
            notes += [f"  {s['source']}: {s['reason']}" for s in skipped[:SHOWN]]
            notes += [f"  and {len(skipped) - SHOWN} more"] if len(skipped) > SHOWN else []
        if result.kept:
            total = len(result.info["shards"])
            which = ("the one shard" if total == 1 else f"all {total} shards") if result.kept == total else \
                f"{result.kept} of {total} shards"
            notes.append(f"{name}: kept {which} an earlier run wrote (each checked against its recorded sha256)")
        if result.rewritten:
            which = "shard that was" if len(result.rewritten) == 1 else "shards that were"
            notes.append(f"{name}: wrote again {len(result.rewritten)} {which} missing or did not match the "
                         f"recorded sha256: {some(result.rewritten)}")
        if result.changed:
            which = "shard whose images" if len(result.changed) == 1 else "shards whose images"
            notes.append(f"{name}: wrote again {len(result.changed)} {which} changed since they were written "
                         f"(their modification times): {some(result.changed)}")
    console.print(table)
    for note in notes:
        console.print(note, highlight=False, markup=False, soft_wrap=True)


@data.command(short_help="Write a DALI index file beside each shard of SHARDS.")
@click.argument("shards", type=ExistingPath(file_okay=False))
@workers_option
def index(shards: Path, workers: int) -> None:
    """Write a DALI index file (v1.2) beside each shard that SHARDS/manifest.json lists.

    SHARDS is the folder `vitctl data shard --out` wrote; run this after every `vitctl data shard` into it. Exits 1
    if a split's shards are not all written yet (those written are indexed), or if a shard the manifest lists is
    missing or changed (none is indexed: the error names the shard command to rerun first).
    """
    with progress_bar("index", unit="shards") as bar:
        files, samples = index_folder(shards, workers, bar.advance, bar.set_total)
    console.print(f"index: {files} index files, {samples:,} samples")
    unfinished = unfinished_splits(shards)
    for problem in unfinished:  # the shards written so far are indexed; the folder is not ready to train from
        err_console.print(f"error: {problem}", highlight=False, markup=False, soft_wrap=True)
    if unfinished:
        raise SystemExit(1)


@data.command(name="verify", short_help="Check shards, indexes and manifest.json; decode some images.")
@click.argument("shards", type=ExistingPath(file_okay=False))
@click.option("--decode", type=click.IntRange(min=0), default=32, show_default=True,
              help="Random images to decode.")
@workers_option
def verify_command(shards: Path, decode: int, workers: int) -> None:
    """Check manifest vs shards, each index vs its shard, and decode random images; exit 1 on any problem.

    Each problem comes with its fix: the command that writes the shard again, or what to do.
    """
    with progress_bar("verify", unit="shards") as bar:
        report = verify_folder(shards, decode, workers, bar.advance, bar.set_total)
    found = report.manifest
    table = Table(*SPLIT_COLUMNS,
                  title=f"{shards} ({len(found['classes'])} classes, labels: {found['label_convention']})")
    for split, info in sorted(found["splits"].items()):
        table.add_row(*split_row(split, info["shards"]))
    console.print(table)
    for name, problems in sorted(report.problems.items()):
        for problem in problems:
            console.print(f"[red]FAIL[/] {escape(name)}: {escape(problem)}", highlight=False, soft_wrap=True)
    gone = ", ".join(report.gone_sources)
    how = (f": the images they were sharded from, {gone}, are not on this machine; copy these shards and their .idx "
           f"files again from a good copy of this folder (manifest.json holds each one's sha256), or restore {gone} "
           "and run" if gone else ", run")
    lines = [f"to fix {some(report.fixed_by_command)}{how}:\n  {report.command}"] if report.command else []
    lines += [f"to fix {some(names)}: {advice}" for advice, names in report.advice.items()]
    for line in lines:
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    if report.problems:
        raise SystemExit(1)
    console.print(f"[green]OK[/] every shard matches the manifest and its index; {count(report.decoded, 'image')} "
                  "decoded")
