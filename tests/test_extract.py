import io
import os
import tarfile
from pathlib import Path

import pytest

from conftest import CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS, ok, vitctl
from vitctl.datasets.extract import LEDGER
from vitctl.datasets.synth import TRAIN_TAR, VAL_TAR


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and p.name != LEDGER}


def _extract(archives: Path, out: Path, *extra: object):
    return vitctl("data", "extract", "--train-tar", archives / TRAIN_TAR, "--val-tar", archives / VAL_TAR,
                  "--out", out, *extra)


def test_extract_writes_every_image_byte_for_byte(archives, tmp_path):
    assert _extract(archives, tmp_path / "r", "--workers", 2).exit_code == 0
    with tarfile.open(archives / TRAIN_TAR) as outer:
        for name in outer.getnames():
            with tarfile.open(fileobj=outer.extractfile(name)) as inner:
                for m in inner.getmembers():
                    assert (tmp_path / "r/train" / name[:-4] / m.name).read_bytes() == inner.extractfile(m).read()
    assert len(list((tmp_path / "r/train").iterdir())) == CLASSES
    assert len(list((tmp_path / "r/val").iterdir())) == CLASSES * VAL_PER_CLASS


def test_one_worker_and_two_workers_give_the_same_tree(archives, tmp_path):
    _extract(archives, tmp_path / "one", "--workers", 1)
    _extract(archives, tmp_path / "two", "--workers", 2)
    assert _tree(tmp_path / "one") == _tree(tmp_path / "two")


def test_rerun_skips_finished_classes_and_redoes_a_partial_one(archives, tmp_path):
    root = tmp_path / "r"
    _extract(archives, root)
    classes = sorted((root / "train").iterdir())
    done, broken = classes[0], classes[1]
    done_mtime = done.stat().st_mtime_ns
    # Simulate an interrupt: one class half written under its temporary name, another lost entirely.
    os.rename(broken, broken.with_name(f".{broken.name}.partial"))
    next(broken.with_name(f".{broken.name}.partial").iterdir()).unlink()
    result = _extract(archives, root)
    assert result.exit_code == 0
    assert f"{CLASSES - 1} classes" in result.output  # all but the broken class were resumed
    assert done.stat().st_mtime_ns == done_mtime
    assert len(list(broken.iterdir())) == TRAIN_PER_CLASS
    assert not list((root / "train").glob(".*"))


def test_rerun_after_a_class_lost_files_redoes_that_class(archives, tmp_path):
    root = tmp_path / "r"
    _extract(archives, root)
    damaged = sorted((root / "train").iterdir())[2]
    next(damaged.iterdir()).unlink()
    assert _extract(archives, root).exit_code == 0
    assert len(list(damaged.iterdir())) == TRAIN_PER_CLASS


def test_missing_archive_is_a_clear_usage_error(tmp_path):
    result = vitctl("data", "extract", "--train-tar", tmp_path / "nope.tar", "--out", tmp_path / "r")
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_truncated_train_archive_fails_and_leaves_no_complete_looking_class(archives, tmp_path):
    raw = (archives / TRAIN_TAR).read_bytes()
    cut = tmp_path / TRAIN_TAR
    cut.write_bytes(raw[: len(raw) // 2])
    result = vitctl("data", "extract", "--train-tar", cut, "--out", tmp_path / "r")
    assert result.exit_code == 1
    assert "truncated" in result.stderr and str(cut) in result.stderr
    assert not (tmp_path / "r/train").exists() or not list((tmp_path / "r/train").iterdir())


def test_truncated_inner_tar_is_reported_and_its_class_not_marked(archives, tmp_path):
    # An outer tar whose second class tar is cut short but correctly sized in the outer header.
    with tarfile.open(archives / TRAIN_TAR) as outer:
        inners = [(m.name, outer.extractfile(m).read()) for m in outer.getmembers()]
    bad = tmp_path / TRAIN_TAR
    with tarfile.open(bad, "w", format=tarfile.GNU_FORMAT) as outer:
        for i, (name, data) in enumerate(inners):
            data = data[: len(data) // 3] if i == 1 else data
            info = tarfile.TarInfo(name)
            info.size = len(data)
            outer.addfile(info, io.BytesIO(data))
    result = vitctl("data", "extract", "--train-tar", bad, "--out", tmp_path / "r", "--workers", 1)
    assert result.exit_code == 1 and f"member {inners[1][0]}" in result.stderr and "truncated" in result.stderr
    assert not (tmp_path / "r/train" / inners[1][0][:-4]).exists()


@pytest.mark.parametrize("member", ["../evil.JPEG", "/abs.JPEG"])
def test_unsafe_member_in_val_is_rejected_and_nothing_extracted(tmp_path, member):
    bad = tmp_path / VAL_TAR
    with tarfile.open(bad, "w", format=tarfile.GNU_FORMAT) as tar:
        for name in ("ILSVRC2012_val_00000001.JPEG", member):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    result = vitctl("data", "extract", "--val-tar", bad, "--out", tmp_path / "r")
    assert result.exit_code == 1 and "unsafe member path" in result.stderr
    assert not (tmp_path / "r/val").exists() and not (tmp_path / "evil.JPEG").exists()


def test_symlink_in_train_is_rejected(tmp_path):
    inner = io.BytesIO()
    with tarfile.open(fileobj=inner, mode="w") as tar:
        info = tarfile.TarInfo("n01440764_1.JPEG")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    bad = tmp_path / TRAIN_TAR
    with tarfile.open(bad, "w") as outer:
        info = tarfile.TarInfo("n01440764.tar")
        info.size = len(inner.getvalue())
        outer.addfile(info, io.BytesIO(inner.getvalue()))
    result = vitctl("data", "extract", "--train-tar", bad, "--out", tmp_path / "r")
    assert result.exit_code == 1 and "symbolic link" in result.stderr


def test_outer_tar_that_is_not_per_class_is_rejected(archives, tmp_path):
    result = vitctl("data", "extract", "--train-tar", archives / VAL_TAR, "--out", tmp_path / "r")
    assert result.exit_code == 1 and "<wnid>.tar" in result.stderr


def test_foreign_class_folder_is_refused_not_overwritten(archives, tmp_path):
    foreign = tmp_path / "r/train/n02119789"
    foreign.mkdir(parents=True)
    (foreign / "mine.txt").write_text("keep me")
    result = _extract(archives, tmp_path / "r")
    assert result.exit_code == 1 and "was not written by `vitctl data extract`" in result.stderr
    assert (foreign / "mine.txt").read_text() == "keep me"


def test_extract_output_is_usable_by_the_rest_of_the_pipeline(archives, tmp_path):
    ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--out", tmp_path / "r")
    with tarfile.open(archives / TRAIN_TAR) as outer:
        expected = sorted(n.removesuffix(".tar") for n in outer.getnames())
    assert sorted(p.name for p in (tmp_path / "r/train").iterdir()) == expected
