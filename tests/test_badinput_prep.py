"""Bad input as a first-day user gives the data commands while following README.md and `make demo`: steps run out of
order or on the wrong folder, an --out inside the input, shards whose manifest was lost, a ledger lost, symbolic links
that lead nowhere, synth's numbers out of range, two commands writing one folder at once, a rerun right after SIGKILL.
Each test follows the fix the message names."""

import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS, ok, vitctl
from vitctl.datasets.extract import LEDGER
from vitctl.datasets.synth import DEVKIT, TRAIN_TAR, VAL_TAR

VITCTL = str(Path(sys.executable).parent / "vitctl")


def _error(result, where: str, what: str) -> str:
    """The fix of a data command's one message, after checking its exit status, place and problem."""
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"error: {where}: {what}" in result.stderr, result.stderr
    return result.stderr.split("fix: ", 1)[1].strip()


def _quoted(fix: str) -> list[str]:
    """The command a fix quotes between backticks, as arguments to `vitctl`."""
    command = shlex.split(fix.split("`")[1])
    assert command[0] == "vitctl"
    return command[1:]


def _extracted(archives: Path, root: Path, *splits: str) -> Path:
    tars = {"train": ["--train-tar", archives / TRAIN_TAR], "val": ["--val-tar", archives / VAL_TAR]}
    ok("data", "extract", *(arg for split in splits for arg in tars[split]), "--out", root, "--workers", 1)
    return root


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(("flag", "wanted"), [("--val-tar", "ILSVRC2012_img_val.tar"),
                                              ("--train-tar", "ILSVRC2012_img_train.tar")])
@pytest.mark.parametrize("given", ["as shipped", "gunzipped and renamed"])
def test_the_devkit_given_for_an_image_archive_is_named_and_its_fix_works(archives, tmp_path, flag, wanted, given):
    """Before: 'the file is gzip-compressed ... decompress it', and, followed, 'unsafe member path
    ILSVRC2012_devkit_t12/data/meta.mat ... use the original archive'."""
    devkit = archives / DEVKIT
    if given != "as shipped":
        devkit = tmp_path / "dk.tar"
        subprocess.run(f"gunzip --stdout {shlex.quote(str(archives / DEVKIT))} > {devkit}", shell=True, check=True)
    result = vitctl("data", "extract", flag, devkit, "--out", tmp_path / "r")
    fix = _error(result, str(devkit), f"this is the ILSVRC2012 devkit (ILSVRC2012_devkit_t12.tar.gz), not {wanted}")
    assert fix.startswith("pass it to `vitctl data valprep VAL_DIR --devkit ") and not (tmp_path / "r").exists()
    root = _extracted(archives, tmp_path / "r", "val")
    ok(*[str(root / "val") if arg == "VAL_DIR" else arg for arg in _quoted(fix)])


def test_the_valprep_command_for_a_devkit_given_as_an_archive_quotes_a_path_with_a_space(archives, tmp_path):
    """Was `--devkit /x/my data/ILSVRC2012_devkit_t12.tar.gz`, which a shell splits in two."""
    devkit = tmp_path / "my data" / DEVKIT
    devkit.parent.mkdir()
    shutil.copy(archives / DEVKIT, devkit)
    result = vitctl("data", "extract", "--val-tar", devkit, "--out", tmp_path / "r")
    fix = _error(result, str(devkit), "this is the ILSVRC2012 devkit (ILSVRC2012_devkit_t12.tar.gz), not ")
    command = _quoted(fix)
    assert command == ["data", "valprep", "VAL_DIR", "--devkit", str(devkit)]
    root = _extracted(archives, tmp_path / "r", "val")
    ok(*[str(root / "val") if arg == "VAL_DIR" else arg for arg in command])


@pytest.mark.parametrize("wrong", ["root", "train"])
def test_valprep_of_the_root_or_the_train_folder_names_the_val_folder(archives, tmp_path, wrong):
    root = _extracted(archives, tmp_path / "r", "train", "val")
    given = root if wrong == "root" else root / "train"
    before = _tree(root)
    result = vitctl("data", "valprep", given, "--devkit", archives / DEVKIT)
    # was, for the root: "unexpected entries: train, val" / "fix: move them out of the validation folder"
    what = ("holds train/ and val/: it is the dataset root, not its val folder" if wrong == "root" else
            "holds no validation images (ILSVRC2012_val_<8 digits>.JPEG) but")
    assert _error(result, str(given), what) == f"pass {root / 'val'} as VAL_DIR"
    assert _tree(root) == before
    ok("data", "valprep", root / "val", "--devkit", archives / DEVKIT)
    ok("data", "shard", root, "--out", tmp_path / "s", "--maxcount", 16)


def test_valprep_of_the_archives_folder_says_it_is_not_the_val_folder(archives, tmp_path):
    before = _tree(archives)
    result = vitctl("data", "valprep", archives, "--devkit", archives / DEVKIT)
    fix = _error(result, str(archives), "holds no validation images (ILSVRC2012_val_<8 digits>.JPEG) but 3 other files")
    assert "pass the val/ folder that `vitctl data extract --val-tar ILSVRC2012_img_val.tar --out ROOT` wrote" in fix
    assert _tree(archives) == before
    root = _extracted(archives, tmp_path / "r", "val")
    ok("data", "valprep", root / "val", "--devkit", archives / DEVKIT)


def test_valprep_of_a_root_without_val_names_the_extract_command(archives, tmp_path):
    root = _extracted(archives, tmp_path / "r", "train")
    fix = _error(vitctl("data", "valprep", root, "--devkit", archives / DEVKIT), str(root),
                 "holds train/: it is the dataset root, not its val folder")
    ok(*_quoted(fix))
    assert fix.endswith(f"then pass {root / 'val'} as VAL_DIR")
    ok("data", "valprep", root / "val", "--devkit", archives / DEVKIT)


def test_hidden_files_in_val_are_left_alone_by_valprep_as_by_shard(archives, tmp_path):
    root = _extracted(archives, tmp_path / "r", "train", "val")
    (root / "val/.DS_Store").write_bytes(b"Bud1")  # was: "1 images are not in the labels: .DS_Store"
    ok("data", "valprep", root / "val", "--devkit", archives / DEVKIT)
    wnid = next(p for p in (root / "val").iterdir() if p.is_dir())
    (wnid / "._ILSVRC2012_val_00000001.JPEG").write_bytes(b"AppleDouble")
    assert "(20 were already in place)" in ok("data", "valprep", root / "val", "--devkit", archives / DEVKIT).output
    ok("data", "shard", root, "--out", tmp_path / "s", "--maxcount", 16)


@pytest.mark.parametrize("split", ["train", "val"])
def test_shard_of_one_split_folder_names_the_dataset_root(prepared_root, tmp_path, split):
    out = tmp_path / "s"
    result = vitctl("data", "shard", prepared_root / split, "--out", out)
    # was: "no class folders found under train/ or val/" / "fix: run `vitctl data extract` ... first"
    fix = _error(result, str(prepared_root / split),
                 f"no train/ or val/ folder here: this is the {split} folder itself, not the dataset root")
    assert fix == f"pass the dataset root {prepared_root} (with --split {split} to shard this split alone)"
    assert not out.exists()
    ok("data", "shard", prepared_root, "--out", out, "--split", split, "--maxcount", 16)


@pytest.mark.parametrize("inside", ["train/shards", "val/n01440764/s"])
def test_an_out_inside_a_split_folder_is_refused_before_anything_is_written(root_copy, inside):
    out = root_copy / inside
    before = _tree(root_copy)
    result = vitctl("data", "shard", root_copy, "--out", out, "--maxcount", 16)
    # was: sharded, and the next shard of this root refused the shard folder as a class folder
    split = inside.split("/")[0]
    fix = _error(result, f"--out {out}", f"lies inside {root_copy / split}, which holds only class folders")
    assert _tree(root_copy) == before
    assert fix == f"choose an --out outside {root_copy / 'train'} and {root_copy / 'val'}, e.g. {root_copy / 'shards'}"
    for _ in range(2):  # the rerun too
        ok("data", "shard", root_copy, "--out", root_copy / "shards", "--maxcount", 16)


def test_shards_whose_manifest_was_deleted_are_named_and_moving_them_away_rewrites_them(prepared_root, shards_copy,
                                                                                     tmp_path):
    (shards_copy / "manifest.json").unlink()
    result = vitctl("data", "shard", prepared_root, "--out", shards_copy, "--maxcount", 16)
    fix = _error(result, str(shards_copy), "the output folder holds files vitctl did not write: imagenet-")
    assert "named as shards, but with no manifest.json" in result.stderr
    assert "if an earlier `vitctl data shard` wrote them and its manifest was lost, moving them away and running the " \
           "same command writes them again" in fix
    away = tmp_path / "away"
    away.mkdir()
    for path in shards_copy.glob("imagenet-*"):
        path.rename(away / path.name)
    ok("data", "shard", prepared_root, "--out", shards_copy, "--maxcount", 16)
    ok("data", "index", shards_copy)
    ok("data", "verify", shards_copy)
    assert all((shards_copy / p.name).read_bytes() == p.read_bytes() for p in away.iterdir())


def test_extract_into_a_root_whose_ledger_was_deleted_names_every_class_folder_at_once(archives, tmp_path):
    root = _extracted(archives, tmp_path / "r", "train")
    (root / LEDGER).unlink()
    result = vitctl("data", "extract", "--train-tar", archives / TRAIN_TAR, "--out", root)
    # was: one class folder named, so that moving them away took a run per class
    fix = _error(result, str(root / "train"), f"{root / 'train'}/n")
    assert (f"and {CLASSES - 1} more class folders exist but were not written by `vitctl data extract` "
            f"({root / LEDGER}, which records what extract wrote, is missing)") in result.stderr
    mv = shlex.split(fix.split("`")[1])
    assert mv[0] == "mv"
    subprocess.run(mv, check=True)
    ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--out", root)
    assert _tree(root / "train") == _tree(root / "train.old")


def test_shard_before_extracting_val_or_before_valprep_names_the_commands(archives, tmp_path):
    root = _extracted(archives, tmp_path / "r", "train")
    out = tmp_path / "s"
    fix = _error(vitctl("data", "shard", root, "--out", out), str(root), "no val/ folder")
    assert fix.endswith("(or pass --split train to shard train alone)")
    assert f"--val-tar {archives / VAL_TAR} " in fix  # found beside the train archive extract recorded
    ok(*_quoted(fix))
    fix = _error(vitctl("data", "shard", root, "--out", out), str(root / "val"),
                 f"{CLASSES * VAL_PER_CLASS} files lie directly in val/")
    assert f"--devkit {archives / DEVKIT}`" in fix
    ok(*_quoted(fix))
    ok("data", "shard", root, "--out", out, "--maxcount", 16)
    assert not out.with_name("s-train").exists()
    ok("data", "shard", root, "--out", tmp_path / "s-train", "--split", "train", "--maxcount", 16)


@pytest.mark.parametrize(("files", "said", "fix"), [(["a.JPEG"], "1 file lies directly in train/ (e.g. a.JPEG)",
                                                     "move it out: train/ holds one folder per class"),
                                                    (["a.JPEG", "b.JPEG"], "2 files lie directly in train/",
                                                     "move them out: train/ holds one folder per class")])
def test_files_lying_in_train_are_counted_in_words_that_agree(root_copy, tmp_path, files, said, fix):
    """Before: `1 files lie directly in train/`, and `move them out` for one."""
    for name in files:
        (root_copy / "train" / name).write_bytes(b"x")
    assert _error(vitctl("data", "shard", root_copy, "--out", tmp_path / "s"), str(root_copy / "train"), said) == fix


@pytest.mark.parametrize("target", ["itself", "missing"])
def test_a_class_folder_that_is_a_link_leading_nowhere_is_named_as_such(root_copy, tmp_path, target):
    link = root_copy / "train/n01440764"
    os.symlink(link.name if target == "itself" else tmp_path / "gone", link)
    # was: "Too many levels of symbolic links" / "check the file system"; or "1 files lie directly in train/"
    fix = _error(vitctl("data", "shard", root_copy, "--out", tmp_path / "s"), str(link),
                 "a symbolic link that leads nowhere")
    assert fix == "restore the folder it points to, or delete the link"
    link.unlink()
    ok("data", "shard", root_copy, "--out", tmp_path / "s", "--maxcount", 16)


@pytest.mark.parametrize("command", ["shard", "index", "verify"])
def test_a_root_or_shard_folder_that_is_a_symlink_loop_is_named_as_such(tmp_path, command):
    loop = tmp_path / "data"
    os.symlink(loop, loop)
    args = [loop, "--out", tmp_path / "s"] if command == "shard" else [loop]
    result = vitctl("data", command, *args)
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert f"'{loop}' is a symbolic link that leads nowhere (to '{loop}': missing, or a loop of links)" \
        in result.stderr  # was: "Directory '...' does not exist."


@pytest.mark.parametrize("option, value, says", [
    ("--train-per-class", 40_000, "--train-per-class must be at most 39,999"),
    ("--val-per-class", 40_000_000, "--classes x --val-per-class must be at most 99,999,999"),
])
def test_synth_numbers_past_its_naming_are_refused(tmp_path, option, value, says):
    result = vitctl("data", "synth", tmp_path / "a", "--classes", 3, option, value)
    # was: numpy's ValueError traceback ("Cannot take a larger sample than population"), or hours of writing
    assert result.exit_code == 1 and "Traceback" not in result.stderr and f"error: {says}" in result.stderr
    assert not (tmp_path / "a").exists()


def _held(folder: Path):
    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


@pytest.mark.parametrize("command", ["extract", "valprep", "shard", "index"])
def test_a_second_command_writing_the_same_folder_at_once_is_refused(archives, root_copy, shards_copy, tmp_path,
                                                                     command):
    root = tmp_path / "r"
    root.mkdir()
    args, folder = {
        "extract": (["--train-tar", archives / TRAIN_TAR, "--val-tar", archives / VAL_TAR, "--out", root], root),
        "valprep": ([root_copy / "val", "--devkit", archives / DEVKIT], root_copy / "val"),
        "shard": ([root_copy, "--out", shards_copy, "--maxcount", 16], shards_copy),
        "index": ([shards_copy], shards_copy),
    }[command]
    before = _tree(folder)
    fd = _held(folder)  # as the other command holds it while it writes there
    try:
        result = vitctl("data", command, *args)
        # was: both wrote; extract took the other's classes for foreign, or both failed on "No such file"
        fix = _error(result, str(folder), "another vitctl command is writing in this folder right now")
        assert fix == "wait until it has ended, then run this command again: it goes on from what the other one " \
                      "finished"
        assert _tree(folder) == before
    finally:
        os.close(fd)
    ok("data", command, *args)


def test_a_shard_killed_with_sigkill_leaves_the_folder_free_for_the_rerun_at_once(prepared_root, prepared_shards,
                                                                                  tmp_path):
    out = tmp_path / "s"
    proc = subprocess.Popen([VITCTL, "data", "shard", str(prepared_root), "--out", str(out), "--maxcount", "1",
                             "--workers", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not list(out.glob("imagenet-train-*.tar")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        assert proc.poll() is None, proc.stderr.read().decode()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # the writers it forked may live a moment longer: they do not hold the folder's lock
        os.close(_held(out))
    finally:
        proc.kill()
    # the lock is free at once: a rerun with other settings is refused for them, not as "another vitctl is writing"
    _error(vitctl("data", "shard", prepared_root, "--out", out, "--maxcount", 16), str(out),
           "train shards here were made with other settings: --maxcount 16 (this folder's: 1)")
    assert len(list(out.glob("imagenet-train-*.tar"))) < CLASSES * TRAIN_PER_CLASS
    ok("data", "shard", prepared_root, "--out", out, "--maxcount", 1)
    ok("data", "index", out)
    ok("data", "verify", out)
