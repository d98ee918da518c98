import errno
import fcntl
import gzip
import io
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS, ok, vitctl
from vitctl.datasets import extract as extract_module
from vitctl.datasets.extract import LEDGER
from vitctl.datasets.synth import DEVKIT, TRAIN_TAR, VAL_TAR

SMALL_CLASSES, SMALL_TRAIN_PER_CLASS, SMALL_VAL_PER_CLASS = 3, 2, 1

# Runs `vitctl data extract` with os.<call> counted; SIGKILLs itself just before or after the nth call.
KILL_AT_CALL = """
import os, signal, sys
from vitctl.cli.data import data

call, when, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
real, calls = getattr(os, call), 0

def counted(*args, **kwargs):
    global calls
    calls += 1
    if (calls, when) == (nth, "before"):
        os.kill(os.getpid(), signal.SIGKILL)
    result = real(*args, **kwargs)
    if (calls, when) == (nth, "after"):
        os.kill(os.getpid(), signal.SIGKILL)
    return result

setattr(os, call, counted)
data(sys.argv[4:], prog_name="vitctl data")
"""


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and p.name != LEDGER}


def _ledger(root: Path) -> dict:
    return json.loads((root / LEDGER).read_text())


def _leftovers(root: Path) -> list[str]:
    """Hidden entries extract may leave behind (temporary names), other than its ledger."""
    return sorted(p.name for p in root.rglob(".*") if p.name != LEDGER)


def _extract_args(archives: Path, out: Path) -> list[str]:
    return ["extract", "--train-tar", str(archives / TRAIN_TAR), "--val-tar", str(archives / VAL_TAR),
            "--out", str(out)]


def _extract(archives: Path, out: Path, *extra: object):
    return vitctl("data", *_extract_args(archives, out), *extra)


def _tar(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _members(raw: bytes) -> list[tuple[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


@pytest.fixture(scope="module")
def small_archives(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("small-archives")
    ok("data", "synth", out, "--classes", SMALL_CLASSES, "--train-per-class", SMALL_TRAIN_PER_CLASS,
       "--val-per-class", SMALL_VAL_PER_CLASS, "--seed", 3)
    return out


@pytest.fixture(scope="module")
def small_extracted(small_archives, tmp_path_factory) -> Path:
    """The small archives extracted by one uninterrupted run: what every interrupted run must end up as."""
    out = tmp_path_factory.mktemp("small-extracted") / "r"
    ok("data", *_extract_args(small_archives, out), "--workers", 1)
    return out


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


@pytest.mark.parametrize("added, lost", [("NOTES.txt", 0), ("augmented/flip.JPEG", 0), ("augmented/flip.JPEG", 2)])
def test_a_rerun_keeps_what_the_user_added_to_a_class_folder(small_archives, small_extracted, tmp_path, added, lost):
    """Before: the class's file count differed from the ledger, so its folder was removed with the user's files."""
    out = Path(shutil.copytree(small_extracted, tmp_path / "r"))
    folder = out / "train" / sorted(os.listdir(out / "train"))[0]
    (folder / added).parent.mkdir(exist_ok=True)
    (folder / added).write_bytes(b"the user's own")
    for image in sorted(folder.glob("*.JPEG"))[:lost]:
        image.unlink()
    result = vitctl("data", "extract", "--train-tar", small_archives / TRAIN_TAR, "--out", out)
    entry = f"{folder.name}/{added.split('/')[0]}"
    assert result.exit_code == 1 and f"{entry}: 1 entry that `vitctl data extract` did not write" in result.stderr
    assert "fix: move it out of the class folder, then rerun" in result.stderr
    assert (folder / added).read_bytes() == b"the user's own"
    shutil.move(folder / added.split("/")[0], tmp_path / "kept")  # the fix
    ok("data", "extract", "--train-tar", small_archives / TRAIN_TAR, "--out", out)
    assert _tree(out / "train") == _tree(small_extracted / "train")
    assert (tmp_path / "kept").exists()


def test_a_rerun_after_every_val_image_was_lost_keeps_a_folder_the_user_added(small_archives, small_extracted,
                                                                               tmp_path):
    """val/ is extracted again only when it holds no file but hidden ones: a folder of the user's files is kept."""
    out = Path(shutil.copytree(small_extracted, tmp_path / "r"))
    for image in (out / "val").iterdir():
        image.unlink()
    (out / "val/mine").mkdir()
    (out / "val/mine/notes.txt").write_text("mine")
    result = vitctl("data", "extract", "--val-tar", small_archives / VAL_TAR, "--out", out)
    assert result.exit_code == 1 and "val holds 1 of the" in result.stderr and "rm -r" in result.stderr
    assert (out / "val/mine/notes.txt").read_text() == "mine"


def test_missing_archive_is_a_clear_usage_error(tmp_path):
    result = vitctl("data", "extract", "--train-tar", tmp_path / "nope.tar", "--out", tmp_path / "r")
    assert result.exit_code == 2 and "does not exist" in result.stderr


@pytest.mark.parametrize("flag", ["--train-tar", "--val-tar"])
def test_a_folder_given_as_archive_is_a_clear_error(tmp_path, flag):
    result = vitctl("data", "extract", flag, tmp_path, "--out", tmp_path / "r")
    assert result.exit_code == 1 and f"{tmp_path}: not a file" in result.stderr and not (tmp_path / "r").exists()


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
    assert not (tmp_path / "r/train" / inners[1][0][:-4]).exists() and _leftovers(tmp_path / "r") == []


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


@pytest.mark.slow
@pytest.mark.parametrize("call, when", [("replace", "before"), ("replace", "after"), ("write", "after")])
def test_killed_at_every_phase_a_rerun_gives_the_uninterrupted_tree(small_archives, small_extracted, tmp_path,
                                                                    call, when):
    """SIGKILL just before or after each rename (class folder, val/, ledger), or after each image write, then rerun."""
    kills = 0
    for nth in itertools.count(1):
        out = tmp_path / f"{nth}"
        args = ["--workers", "1"]
        killed = subprocess.run([sys.executable, "-c", KILL_AT_CALL, call, when, str(nth),
                                 *_extract_args(small_archives, out), *args], capture_output=True, timeout=120)
        if killed.returncode == 0:  # past the last such call: every phase was interrupted once
            break
        assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
        kills += 1
        for folder in [*(out / "train").glob("n*"), out / "val"]:  # under its final name means complete
            if folder.exists():
                assert _tree(folder) == _tree(small_extracted / folder.relative_to(out)), folder
        ok("data", *_extract_args(small_archives, out), *args)
        assert _tree(out) == _tree(small_extracted) and _ledger(out) == _ledger(small_extracted)
        assert _leftovers(out) == []
    images = SMALL_CLASSES * (SMALL_TRAIN_PER_CLASS + SMALL_VAL_PER_CLASS)
    assert kills >= (images if call == "write" else 2 * SMALL_CLASSES + 2)


def _damaged_train(small_archives: Path, tmp_path: Path, fault: str) -> Path:
    """A copy of the small train archive with one fault in its last class tar, or in the outer tar."""
    classes = _members((small_archives / TRAIN_TAR).read_bytes())
    name, inner = classes[-1]
    images = _members(inner)
    if fault == "duplicate class tar":
        classes.append(classes[-1])
    elif fault == "empty class tar":
        classes[-1] = (name, _tar([]))
    elif fault == "gzipped class tar":
        classes[-1] = (name, gzip.compress(inner))
    elif fault == "another class's images":
        classes[-1] = (name, classes[0][1])
    else:
        odd = {"member '.'": (".", b"x"), "empty name": ("", b"x"), "duplicate image": images[0],
               "a .bak copy": (f"{images[0][0]}.bak", images[0][1])}[fault]
        classes[-1] = (name, _tar([*images, odd]))
    path = tmp_path / "copy" / TRAIN_TAR
    path.parent.mkdir()
    path.write_bytes(_tar(classes))
    return path


@pytest.mark.parametrize("fault, says", [("member '.'", "member '.' is not a file name"),
                                         ("empty name", "member '' is not a file name"),
                                         ("duplicate image", "appears twice"),
                                         ("a .bak copy", "share the sample key"),  # before: shard's fix looped
                                         ("duplicate class tar", "member 'n02110185.tar' appears twice"),
                                         ("empty class tar", "holds no images: an empty class tar"),
                                         ("gzipped class tar", "the file is gzip-compressed"),
                                         ("another class's images", "is an image of another class than n02110185")])
def test_odd_train_members_are_named_and_following_the_fix_works(small_archives, small_extracted, tmp_path,
                                                                fault, says):
    bad, out = _damaged_train(small_archives, tmp_path, fault), tmp_path / "r"
    result = vitctl("data", "extract", "--train-tar", bad, "--out", out, "--workers", 1)
    assert result.exit_code == 1 and str(bad) in result.stderr and says in result.stderr
    assert "download ILSVRC2012_img_train.tar" in result.stderr and "gunzip" not in result.stderr
    if fault != "duplicate class tar":
        assert "member n02110185.tar" in result.stderr  # the inner tar that holds the odd member
    assert _leftovers(out) == []
    # The fix: the original archive, into this folder once the classes taken from the damaged copy are removed.
    shutil.rmtree(out / "train", ignore_errors=True)
    ok("data", "extract", "--train-tar", small_archives / TRAIN_TAR, "--out", out, "--workers", 1)
    assert _tree(out / "train") == _tree(small_extracted / "train")


def _pax_class_tar(images: list[tuple[str, bytes]], pax: dict[str, str]) -> bytes:
    """A class tar of `images` whose first member has the PAX records `pax`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for i, (name, data) in enumerate(images):
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(data), pax if i == 0 else {}
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("pax, says", [
    ({"path": "n02110185_5\x00x.JPEG"}, "unsafe member path 'n02110185_5\\x00x.JPEG' (it holds a control character)"),
    ({"path": "n02110185_" + "x" * 290 + ".JPEG"}, "(a name of 305 bytes, more than the 255 a file system allows)"),
    ({"size": "-5"}, "(negative PAX size '-5')"),
], ids=["nul", "long", "negative-size"])
def test_member_names_and_sizes_no_file_system_takes_are_refused_before_extracting(small_archives, small_extracted,
                                                                                   tmp_path, pax, says):
    """Before: `ValueError: embedded null byte`; "File name too long" with a fix that looped; an empty image."""
    classes = _members((small_archives / TRAIN_TAR).read_bytes())
    classes[-1] = (classes[-1][0], _pax_class_tar(_members(classes[-1][1]), pax))
    bad, out = tmp_path / TRAIN_TAR, tmp_path / "r"
    bad.write_bytes(_tar(classes))
    result = vitctl("data", "extract", "--train-tar", bad, "--out", out, "--workers", 1)
    assert result.exit_code == 1 and f"{bad} member n02110185.tar: " in result.stderr, result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr
    assert _leftovers(out) == [] and not (out / "train/n02110185").exists()
    assert "fix: the archive is damaged or not the original: download ILSVRC2012_img_train.tar" in result.stderr
    shutil.rmtree(out / "train")  # the fix: the original archive, once the classes taken from this copy are removed
    ok("data", "extract", "--train-tar", small_archives / TRAIN_TAR, "--out", out, "--workers", 1)
    assert _tree(out / "train") == _tree(small_extracted / "train")


@pytest.mark.parametrize("odd, says", [((".", b"x"), "member '.' is not a file name"),
                                       (("", b"x"), "member '' is not a file name"),
                                       (None, "appears twice")])
def test_odd_val_members_are_named_and_nothing_is_left_behind(small_archives, small_extracted, tmp_path, odd, says):
    images = _members((small_archives / VAL_TAR).read_bytes())
    bad, out = tmp_path / VAL_TAR, tmp_path / "r"
    bad.write_bytes(_tar([*images, odd or images[0]]))
    result = vitctl("data", "extract", "--val-tar", bad, "--out", out, "--workers", 2)
    assert result.exit_code == 1 and str(bad) in result.stderr and says in result.stderr
    assert "download ILSVRC2012_img_val.tar" in result.stderr and "rerun" in result.stderr
    assert not out.exists() or sorted(os.listdir(out)) == []
    ok("data", "extract", "--val-tar", small_archives / VAL_TAR, "--out", out)
    assert _tree(out / "val") == _tree(small_extracted / "val")


def test_the_train_archive_given_as_val_is_refused(small_archives, tmp_path):
    result = vitctl("data", "extract", "--val-tar", small_archives / TRAIN_TAR, "--out", tmp_path / "r")
    assert result.exit_code == 1 and "is not a validation image ILSVRC2012_val_<8 digits>.JPEG" in result.stderr
    assert "pass ILSVRC2012_img_val.tar" in result.stderr and not (tmp_path / "r").exists()


@pytest.mark.parametrize("val", [TRAIN_TAR, "ILSVRC2012_devkit_t12.tar.gz"])
def test_a_wrong_val_archive_beside_the_train_one_is_refused_before_train_is_extracted(small_archives, tmp_path, val):
    """Before: found after the whole train archive was extracted, hours in on ImageNet."""
    result = vitctl("data", "extract", "--train-tar", small_archives / TRAIN_TAR, "--val-tar", small_archives / val,
                    "--out", tmp_path / "r")
    assert result.exit_code == 1 and str(small_archives / val) in result.stderr, result.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("split", ["train", "val"])
def test_an_empty_tar_is_refused_before_anything_is_recorded(small_archives, small_extracted, tmp_path, split):
    """Before: extracted as 0 images and recorded as done; the real archive was then refused as another."""
    empty, out = tmp_path / "empty.tar", tmp_path / "r"
    tarfile.open(empty, "w").close()
    result = vitctl("data", "extract", f"--{split}-tar", empty, "--out", out)
    assert result.exit_code == 1 and "holds no files: an empty tar" in result.stderr, result.stderr
    assert f"pass ILSVRC2012_img_{split}.tar" in result.stderr and not out.exists()
    ok("data", "extract", f"--{split}-tar", small_archives / (TRAIN_TAR if split == "train" else VAL_TAR), "--out", out)
    assert _tree(out / split) == _tree(small_extracted / split)


@pytest.mark.parametrize("split", ["train", "val"])
def test_another_archive_into_the_same_out_is_refused_until_its_folder_is_removed(archives, small_archives,
                                                                                 small_extracted, tmp_path, split):
    flag, name = (f"--{split}-tar", TRAIN_TAR if split == "train" else VAL_TAR)
    out = tmp_path / "r"
    ok("data", "extract", flag, archives / name, "--out", out)  # the wrong archive first
    before = _tree(out)
    result = vitctl("data", "extract", flag, small_archives / name, "--out", out)
    assert result.exit_code == 1 and "extracted from another archive" in result.stderr
    assert f"remove {out / split} and rerun" in result.stderr
    assert _tree(out) == before
    shutil.rmtree(out / split)
    ok("data", "extract", flag, small_archives / name, "--out", out)
    assert _tree(out / split) == _tree(small_extracted / split)


def test_the_train_archive_given_as_val_after_val_was_extracted_is_named_before_another_archive(small_archives,
                                                                                               small_extracted,
                                                                                               tmp_path):
    """Before: "holds what was extracted from another archive ... remove val and rerun"; followed, it lost the good
    val/ and only then said the archive was the train one."""
    out = Path(shutil.copytree(small_extracted, tmp_path / "r"))
    result = vitctl("data", "extract", "--val-tar", small_archives / TRAIN_TAR, "--out", out)
    assert result.exit_code == 1 and "is not a validation image ILSVRC2012_val_<8 digits>.JPEG" in result.stderr
    assert "pass ILSVRC2012_img_val.tar" in result.stderr and "remove" not in result.stderr, result.stderr
    assert _tree(out) == _tree(small_extracted)


def test_another_copy_of_an_archive_of_the_same_name_and_size_says_its_contents_differ(small_archives, tmp_path):
    """Before: "another archive (X.tar, N bytes), not from this one (X.tar, N bytes)", the two described alike."""
    out, copy = tmp_path / "r", tmp_path / "copy" / VAL_TAR
    ok("data", "extract", "--val-tar", small_archives / VAL_TAR, "--out", out)
    copy.parent.mkdir()
    members = _members((small_archives / VAL_TAR).read_bytes())
    copy.write_bytes(_tar([(name, data[::-1]) for name, data in members]))  # same names and sizes, other bytes
    assert copy.stat().st_size == (small_archives / VAL_TAR).stat().st_size
    result = vitctl("data", "extract", "--val-tar", copy, "--out", out)
    assert result.exit_code == 1 and (f"holds what was extracted from another copy of {VAL_TAR}: the same name and "
                                      "size") in result.stderr and "other contents" in result.stderr, result.stderr


@pytest.mark.parametrize("lost", ["all", "some"])
def test_a_rerun_after_val_images_were_lost_extracts_them_again_or_says_how(small_archives, small_extracted, tmp_path,
                                                                            lost):
    """Before: the rerun printed the recorded count and wrote nothing; valprep's fix (extract again) went round."""
    out = Path(shutil.copytree(small_extracted, tmp_path / "r"))
    images = sorted((out / "val").iterdir())
    for image in images if lost == "all" else images[:2]:
        image.unlink()
    result = vitctl("data", "extract", "--val-tar", small_archives / VAL_TAR, "--out", out)
    if lost == "all":  # nothing left to keep: extracted again
        assert result.exit_code == 0, result.stderr
        assert _tree(out / "val") == _tree(small_extracted / "val")
        return
    assert result.exit_code == 1 and (f"val holds {len(images) - 2} of the {len(images)} images `vitctl data "
                                      "extract` wrote: 2 were lost since") in result.stderr, result.stderr
    fix = re.search(r"extract val again: `(rm -r \S+)`, then `(vitctl data extract [^`]+)`", result.stderr)
    subprocess.run(fix[1], shell=True, check=True)
    ok(*shlex.split(fix[2])[1:])
    assert _tree(out / "val") == _tree(small_extracted / "val")


@pytest.mark.parametrize("split", ["train", "val"])
def test_extract_into_a_folder_of_shards_is_refused(small_archives, prepared_shards, tmp_path, split):
    """Before: accepted, and val/ with the extract's ledger written among the shards."""
    shards = Path(shutil.copytree(prepared_shards, tmp_path / "shards"))
    before = sorted(p.name for p in shards.iterdir())
    result = vitctl("data", "extract", f"--{split}-tar", small_archives / (TRAIN_TAR if split == "train" else VAL_TAR),
                    "--out", shards)
    assert result.exit_code == 1 and (f"{shards}: holds manifest.json: it is a folder of shards that `vitctl data "
                                      "shard` wrote, not a dataset root") in result.stderr, result.stderr
    assert sorted(p.name for p in shards.iterdir()) == before


def test_a_copy_of_the_same_archive_resumes(archives, tmp_path):
    copy = tmp_path / "elsewhere.tar"
    shutil.copyfile(archives / TRAIN_TAR, copy)  # another name and mtime, the same bytes
    out = tmp_path / "r"
    ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--out", out)
    assert f"{CLASSES} classes" in ok("data", "extract", "--train-tar", copy, "--out", out).output


@pytest.mark.parametrize("ledger", ['{"train": {"n02119789": 12}, "val": null}', "{not json"])
def test_an_old_or_unreadable_ledger_is_refused_and_the_fix_works(archives, tmp_path, ledger):
    out = tmp_path / "r"
    ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--out", out)
    (out / LEDGER).write_text(ledger)
    result = vitctl("data", "extract", "--train-tar", archives / TRAIN_TAR, "--out", out)
    assert result.exit_code == 1 and f"{out / LEDGER}: unreadable, or written by an older vitctl" in result.stderr
    assert f"remove {out / 'train'}, {out / 'val'} and {out / LEDGER} and rerun" in result.stderr
    shutil.rmtree(out / "train")
    (out / LEDGER).unlink()
    ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--out", out)


def _fail_under(monkeypatch, call: str, folder: Path, error: int, nth: int = 1) -> None:
    """Make os.<call> fail with `error` from its nth use on a path (or open file) under `folder`, as the OS would."""
    real, uses, folder = getattr(os, call), [], folder.resolve()

    def failing(target, *args, **kwargs):
        by_fd = isinstance(target, int)
        path = Path(os.readlink(f"/proc/self/fd/{target}") if by_fd else target).resolve()
        if path.is_relative_to(folder):
            uses.append(path)
            if len(uses) >= nth:
                raise OSError(error, os.strerror(error), *([] if by_fd else [str(target)]))
        return real(target, *args, **kwargs)

    monkeypatch.setattr(os, call, failing)


@pytest.mark.parametrize("nth", [3, 1 + SMALL_CLASSES * SMALL_TRAIN_PER_CLASS])  # in a class, in val
def test_disk_full_is_a_clear_error_and_a_rerun_after_freeing_space_completes(small_archives, small_extracted,
                                                                            tmp_path, monkeypatch, nth):
    out = tmp_path / "r"
    with monkeypatch.context() as patch:
        _fail_under(patch, "write", out, errno.ENOSPC, nth)
        result = vitctl("data", *_extract_args(small_archives, out), "--workers", 1)
    assert result.exit_code == 1 and "no space left on the device" in result.stderr
    assert "free space there" in result.stderr and "rerun the same command" in result.stderr
    assert _leftovers(out) == []
    kept = list((out / "train").iterdir())
    for folder in kept:
        assert _tree(folder) == _tree(small_extracted / "train" / folder.name)
    result = ok("data", *_extract_args(small_archives, out), "--workers", 1)
    assert _tree(out) == _tree(small_extracted) and f"{len(kept)} classes" in result.output


@pytest.mark.parametrize("error, says, fix", [
    (errno.EACCES, "permission denied", "give this user access to it, or use another folder"),
    (errno.EROFS, "read-only file system", "write to a folder on a writable file system")])
@pytest.mark.parametrize("split", ["--train-tar", "--val-tar"])
def test_unwritable_out_is_a_clear_error(small_archives, tmp_path, monkeypatch, error, says, fix, split):
    out = tmp_path / "r"
    out.mkdir()
    archive = small_archives / (TRAIN_TAR if split == "--train-tar" else VAL_TAR)
    with monkeypatch.context() as patch:
        _fail_under(patch, "mkdir", out, error)  # tests run as root, whom chmod does not stop: inject the OS error
        result = vitctl("data", "extract", split, archive, "--out", out)
    assert result.exit_code == 1 and f"{out}" in result.stderr and f"{says}\nfix: {fix}" in result.stderr
    assert os.listdir(out) == []
    ok("data", "extract", split, archive, "--out", out)


def test_rerun_of_a_complete_extraction_writes_nothing_so_a_read_only_copy_checks(small_archives, tmp_path,
                                                                                  monkeypatch):
    out = tmp_path / "r"
    ok("data", *_extract_args(small_archives, out))
    with monkeypatch.context() as patch:
        for call in ("mkdir", "replace", "rmdir", "unlink"):
            _fail_under(patch, call, out, errno.EROFS)
        assert f"{SMALL_CLASSES} classes" in ok("data", *_extract_args(small_archives, out)).output


@pytest.mark.parametrize("blocker, out", [("notes.txt", "notes.txt/imagenet"), ("r/train", "r")])
def test_out_under_a_regular_file_is_a_clear_error(archives, tmp_path, blocker, out):
    blocker, out = tmp_path / blocker, tmp_path / out
    blocker.parent.mkdir(exist_ok=True)
    blocker.write_text("mine")
    result = vitctl("data", "extract", "--train-tar", archives / TRAIN_TAR, "--out", out)
    assert result.exit_code == 1 and f"{blocker} is a file, not a folder" in result.stderr
    assert f"fix: move {blocker} away, or choose another --out" in result.stderr and blocker.read_text() == "mine"
    blocker.rename(tmp_path / "kept.txt")  # the fix followed (was: only "choose another --out")
    ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--out", out)


def test_progress_shows_human_sizes(archives, tmp_path):
    result = ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--out", tmp_path / "r")
    size = (archives / TRAIN_TAR).stat().st_size
    assert re.search(r"train\b.* [\d.]+/[\d.]+ kB", result.stderr) and f"{size}" not in result.stderr


def _shard_refuses_then_the_named_rerun_lets_it_shard(archives: Path, root: Path, tmp_path: Path,
                                                      unfinished: str, split: str) -> None:
    """`vitctl data shard` refuses the root naming the unfinished archive; its fix, followed, lets it shard."""
    result = vitctl("data", "shard", root, "--out", tmp_path / "s", "--split", split)
    assert result.exit_code == 1 and f"{root}: `vitctl data extract` stopped before the end of {unfinished}" \
        in result.stderr
    assert not (tmp_path / "s").exists()
    command = shlex.split(result.stderr.split("fix: rerun `")[1].split("`")[0])
    assert command[:3] == ["vitctl", "data", "extract"]
    ok(*command[1:])
    if split == "both":
        ok("data", "valprep", root / "val", "--devkit", archives / DEVKIT)
    ok("data", "shard", root, "--out", tmp_path / "s", "--split", split)
    manifest = json.loads((tmp_path / "s/manifest.json").read_text())
    assert len(manifest["classes"]) == SMALL_CLASSES
    assert sum(e["samples"] for e in manifest["splits"]["train"]["shards"]) == SMALL_CLASSES * SMALL_TRAIN_PER_CLASS


@pytest.mark.parametrize("call, nth, unfinished, split", [
    ("replace", 3, "ILSVRC2012_img_train.tar (1 class extracted)", "train"),  # after the first class's rename
    # the same, sharding both splits: before, the fix named --train-tar alone, and shard then asked for --val-tar
    ("replace", 3, "ILSVRC2012_img_train.tar (1 class extracted)", "both"),
    ("write", 1 + SMALL_CLASSES * SMALL_TRAIN_PER_CLASS, "ILSVRC2012_img_val.tar", "both"),  # after a val image
])
def test_shard_refuses_a_root_whose_extraction_was_killed(small_archives, tmp_path, call, nth, unfinished, split):
    root = tmp_path / "r"
    killed = subprocess.run([sys.executable, "-c", KILL_AT_CALL, call, "after", str(nth),
                             *_extract_args(small_archives, root), "--workers", "1"], capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    _shard_refuses_then_the_named_rerun_lets_it_shard(small_archives, root, tmp_path, unfinished, split)


def test_shard_refuses_a_root_whose_extraction_was_interrupted(small_archives, tmp_path, monkeypatch):
    root, real, calls = tmp_path / "r", extract_module.extract_class, []

    def ctrl_c_at_the_third_class(*args):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    with monkeypatch.context() as patch:
        patch.setattr(extract_module, "extract_class", ctrl_c_at_the_third_class)
        assert vitctl("data", *_extract_args(small_archives, root), "--workers", 1).exit_code == 130
    # before: "stopped before the end", and its fix, an extract, was then refused for the running one
    _shard_is_told_to_wait_for_the_writer_of(root, root, tmp_path / "s")  # an extract still running
    _shard_refuses_then_the_named_rerun_lets_it_shard(small_archives, root, tmp_path,
                                                      "ILSVRC2012_img_train.tar (2 classes extracted)", "train")


def test_shard_while_valprep_sorts_val_is_told_to_wait_for_it(small_extracted, tmp_path):
    """Before: `N files lie directly in val/`, with valprep as the fix, which the running valprep then refused."""
    root = Path(shutil.copytree(small_extracted, tmp_path / "r"))
    _shard_is_told_to_wait_for_the_writer_of(root / "val", root, tmp_path / "s")  # a valprep running in val/


def _shard_is_told_to_wait_for_the_writer_of(folder: Path, root: Path, out: Path) -> None:
    """`shard root` while `folder` is locked as a data command writing there holds it."""
    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        result = vitctl("data", "shard", root, "--out", out)
        assert result.exit_code == 1 and result.stderr.endswith(
            f"error: {folder}: another vitctl command is writing in this folder right now\nfix: run `vitctl data "
            "shard` once it has ended\n"), result.stderr
    finally:
        os.close(fd)


@pytest.mark.parametrize("inside", ["train", "train/n01440764", "val"])
def test_an_out_in_a_split_folder_of_another_root_is_refused_and_the_root_named(small_archives, small_extracted,
                                                                               tmp_path, inside):
    """Before: extracted into ROOT/train/train/ (or a class folder), which `shard ROOT` then refused."""
    root = Path(shutil.copytree(small_extracted, tmp_path / "r"))
    before = _tree(root)
    result = vitctl("data", *_extract_args(small_archives, root / inside))
    split = root / inside.split("/")[0]
    assert result.exit_code == 1 and result.stderr == (
        f"error: --out {root / inside}: lies in {split}, a split folder of the dataset root {root}: extract writes a "
        f"root's train/ and val/ itself\nfix: pass the dataset root, --out {root}\n"), result.stderr
    assert _tree(root) == before
    ok("data", *_extract_args(small_archives, root))  # the fix followed: the root goes on as it was
    assert _tree(root) == before


def test_an_archive_inside_the_out_s_train_folder_is_refused(small_archives, tmp_path):
    """Before: extracted, and `shard` then refused the archive it found among the class folders."""
    root = tmp_path / "r"
    (root / "train").mkdir(parents=True)
    archive = Path(shutil.copy(small_archives / TRAIN_TAR, root / "train"))
    result = vitctl("data", "extract", "--train-tar", archive, "--out", root)
    assert result.exit_code == 1 and f"error: {archive}: lies in {root / 'train'}, which extract fills with class " \
        f"folders (and shard reads as such)\nfix: move it out of {root / 'train'}, e.g. into {root}" in \
        result.stderr, result.stderr
    archive.rename(root / TRAIN_TAR)
    ok("data", "extract", "--train-tar", root / TRAIN_TAR, "--out", root)
    ok("data", "shard", root, "--out", tmp_path / "s", "--split", "train")


def test_a_tree_extract_did_not_write_shards_as_before(small_extracted, tmp_path):
    root = Path(shutil.copytree(small_extracted, tmp_path / "mine"))
    (root / LEDGER).unlink()
    shutil.rmtree(root / "val")
    ok("data", "shard", root, "--out", tmp_path / "s", "--split", "train")


def test_a_zip_archive_is_named_as_such(small_archives, tmp_path):
    packed = tmp_path / "val.zip"
    with zipfile.ZipFile(packed, "w") as z:
        z.write(small_archives / VAL_TAR, VAL_TAR)
    result = vitctl("data", "extract", "--val-tar", packed, "--out", tmp_path / "r")
    assert result.exit_code == 1 and (f"{packed}: the file is a zip archive (it begins with the zip bytes 50 4b 03 "
                                      "04), not a tar") in result.stderr, result.stderr
    assert "unzip it first" in result.stderr and not (tmp_path / "r").exists()


@pytest.mark.parametrize("flag, name", [("--train-tar", TRAIN_TAR), ("--val-tar", VAL_TAR)])
@pytest.mark.parametrize("compressor, suffix, magic, command", [
    ("gzip", ".gz", "1f 8b", "gunzip --keep"), ("bzip2", ".bz2", "42 5a 68", "bunzip2 --keep"),
    ("xz", ".xz", "fd 37 7a 58 5a 00", "unxz --keep"), ("zstd", ".zst", "28 b5 2f fd", "unzstd --keep")])
def test_a_compressed_archive_is_named_as_such_and_the_fix_works(small_archives, small_extracted, tmp_path, flag, name,
                                                                 compressor, suffix, magic, command):
    """Before, bzip2, xz and zstd: `not a tar archive or corrupt header at byte 0 (bad number ...)`."""
    if shutil.which(command.split()[0]) is None:
        pytest.skip(f"{command.split()[0]} is not installed")
    packed = tmp_path / f"{name}{suffix}"
    shutil.copyfile(small_archives / name, tmp_path / name)
    subprocess.run([compressor, tmp_path / name], check=True)  # writes `packed`
    (tmp_path / name).unlink(missing_ok=True)  # zstd keeps its input
    out = tmp_path / "r"
    result = vitctl("data", "extract", flag, packed, "--out", out)
    assert result.exit_code == 1 and f"{packed}: the file is {compressor}-compressed (it begins with the " \
        f"{compressor} bytes {magic}), not an uncompressed tar" in result.stderr, result.stderr
    assert not out.exists()
    fix = result.stderr.split("fix: decompress it (`")[1].split("`")[0]
    assert fix == f"{command} {packed}" and f"and pass {tmp_path / name}:" in result.stderr
    subprocess.run(shlex.split(fix), check=True)
    ok("data", "extract", flag, tmp_path / name, "--out", out)
    split = "train" if flag == "--train-tar" else "val"
    assert _tree(out / split) == _tree(small_extracted / split)


def test_a_compressed_archive_named_as_a_plain_tar_is_told_a_command_that_takes_its_name(small_archives,
                                                                                         small_extracted, tmp_path):
    """Before: `decompress it (e.g. with gunzip --keep)`, which refuses a name without .gz ("unknown suffix")."""
    packed = tmp_path / VAL_TAR
    subprocess.run(f"gzip -c {small_archives / VAL_TAR} > {packed}", shell=True, check=True)
    result = vitctl("data", "extract", "--val-tar", packed, "--out", tmp_path / "r")
    plain = tmp_path / "ILSVRC2012_img_val-decompressed.tar"
    assert result.exit_code == 1 and f"fix: decompress it (`gzip -dc {packed} > {plain}` writes {plain}) and pass " \
        f"{plain}:" in " ".join(result.stderr.split()), result.stderr
    subprocess.run(result.stderr.split("decompress it (`")[1].split("`")[0], shell=True, check=True)  # followed
    ok("data", "extract", "--val-tar", plain, "--out", tmp_path / "r")
    assert _tree(tmp_path / "r/val") == _tree(small_extracted / "val")


def test_a_rerun_over_a_finished_val_counts_the_bytes_a_fresh_run_counted(small_archives, tmp_path):
    """Before: the progress bar read 373.1 kB on the first run and 450.6 kB (the archive file's size) on the next."""
    archive = small_archives / "ILSVRC2012_img_val.tar"
    totals = []
    for _ in range(2):
        counted = []
        extract_module.extract_val(archive, tmp_path / "r", 1, counted.append, totals.append)
        assert sum(counted) == totals[-1]
    assert totals[0] == totals[1] < archive.stat().st_size
