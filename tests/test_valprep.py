import io
import os
import re
import shlex
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
import scipy.io

from conftest import CLASSES, VAL_PER_CLASS, ok, vitctl
from vitctl.datasets.ilsvrc import MEMBER_CAP
from vitctl.datasets.synth import DEVKIT, LEAVES, TRAIN_TAR, VAL_TAR, synset_struct


def _val_dir(archives: Path, tmp_path: Path) -> Path:
    ok("data", "extract", "--val-tar", archives / VAL_TAR, "--out", tmp_path / "r")
    return tmp_path / "r/val"


def _truth(archives: Path) -> list[int]:
    with tarfile.open(archives / DEVKIT) as tar:
        return [int(x) for x in tar.extractfile(
            "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt").read().split()]


def _layout(val: Path) -> dict[str, str]:
    return {p.name: p.parent.name for p in val.rglob("*.JPEG")}


def test_images_land_in_the_folder_of_their_ilsvrc_id(archives, tmp_path, prepared_root):
    val = _val_dir(archives, tmp_path)
    ok("data", "valprep", val, "--devkit", archives / DEVKIT)
    with tarfile.open(archives / DEVKIT) as tar:
        synsets = scipy.io.loadmat(io.BytesIO(tar.extractfile("ILSVRC2012_devkit_t12/data/meta.mat").read()),
                                   squeeze_me=True)["synsets"]
    wnid_of_id = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets}
    expected = {f"ILSVRC2012_val_{i + 1:08d}.JPEG": wnid_of_id[t] for i, t in enumerate(_truth(archives))}
    assert _layout(val) == expected
    assert not [p for p in val.iterdir() if p.is_file()]
    # Every val WNID is a train class, so sorted-WNID labels agree between the splits.
    assert set(expected.values()) <= {p.name for p in (prepared_root / "train").iterdir()}


def test_valprep_is_idempotent_and_resumes_a_partial_run(archives, tmp_path):
    val = _val_dir(archives, tmp_path)
    ok("data", "valprep", val, "--devkit", archives / DEVKIT)
    done = _layout(val)
    # Undo half of the moves, as an interrupted run would leave it.
    for name, wnid in list(done.items())[::2]:
        (val / wnid / name).rename(val / name)
    assert "already in place" in ok("data", "valprep", val, "--devkit", archives / DEVKIT).output
    assert _layout(val) == done
    assert "moved 0 images" in ok("data", "valprep", val, "--devkit", archives / DEVKIT).output


def test_solution_csv_gives_the_same_layout(archives, tmp_path, prepared_root):
    val = _val_dir(archives, tmp_path)
    reference = _layout(prepared_root / "val")
    csv = tmp_path / "LOC_val_solution.csv"
    csv.write_text("ImageId,PredictionString\n" + "".join(
        f"{name[:-5]},{wnid} 1 2 30 40 {wnid} 5 6 70 80\n" for name, wnid in sorted(reference.items())))
    ok("data", "valprep", val, "--solution", csv)
    assert _layout(val) == reference


def test_a_solution_from_a_pipe_is_read_and_a_devkit_from_one_is_named(archives, tmp_path, prepared_root):
    """Before: both were 'not found', though the path (/dev/fd/63 of `<(zcat ...)`) exists."""
    val, fifo = _val_dir(archives, tmp_path), tmp_path / "pipe"
    os.mkfifo(fifo)
    result = vitctl("data", "valprep", val, "--devkit", fifo)
    assert result.exit_code == 1 and result.stderr == (
        f"error: {fifo}: devkit is a pipe or a device, not a file: a tar archive is read from a file\nfix: save it "
        "to a file first, and pass the path of ILSVRC2012_devkit_t12.tar.gz\n"), result.stderr
    reference = _layout(prepared_root / "val")
    (tmp_path / "solution.csv").write_text(_solution(reference))
    writer = subprocess.Popen(["sh", "-c", f"cat {tmp_path / 'solution.csv'} > {fifo}"])  # as `<(cat ...)` does
    ok("data", "valprep", val, "--solution", fifo)
    assert writer.wait(timeout=60) == 0 and _layout(val) == reference


def test_count_mismatch_is_refused_and_nothing_moves(archives, tmp_path):
    val = _val_dir(archives, tmp_path)
    victim = sorted(val.iterdir())[3]
    raw = victim.read_bytes()
    victim.unlink()
    before = sorted(p.name for p in val.iterdir())
    result = vitctl("data", "valprep", val, "--devkit", archives / DEVKIT)
    assert result.exit_code == 1
    assert "1 image named by the labels is missing" in result.stderr and victim.name in result.stderr
    # before, only the devkit was blamed: an image deleted by hand is named, to be put back
    assert f"fix: if images were moved, removed or added here by hand, put them back as the labels have them " \
        f"({victim.name}, of n" in result.stderr and "nothing was moved" in result.stderr
    assert sorted(p.name for p in val.iterdir()) == before
    victim.write_bytes(raw)  # the fix
    ok("data", "valprep", val, "--devkit", archives / DEVKIT)


def test_an_empty_val_folder_is_said_to_need_the_archive_and_the_fix_works(archives, tmp_path):
    """Before: every image "missing", and the fix blamed the devkit."""
    val = tmp_path / "r/val"
    val.mkdir(parents=True)
    result = vitctl("data", "valprep", val, "--devkit", archives / DEVKIT)
    assert result.exit_code == 1 and "holds no images: the val archive has not been extracted" in result.stderr
    fix = result.stderr.split("`")[1].replace(VAL_TAR, str(archives / VAL_TAR)).split()
    assert fix[:3] == ["vitctl", "data", "extract"], result.stderr
    ok(*fix[1:])
    ok("data", "valprep", val, "--devkit", archives / DEVKIT)
    assert len(_layout(val)) == len(_truth(archives))


def test_a_missing_val_folder_is_given_the_extract_command_and_it_works(archives, tmp_path):
    """Before: `run vitctl data extract first`, with no command (its siblings name one)."""
    root = tmp_path / "r"
    ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--out", root)
    result = vitctl("data", "valprep", root / "val", "--devkit", archives / DEVKIT)
    assert result.exit_code == 1 and "validation folder not found" in result.stderr
    fix = result.stderr.split("`")[1]
    assert fix == f"vitctl data extract --val-tar {archives / VAL_TAR} --out {root}", result.stderr
    ok(*shlex.split(fix)[1:])
    ok("data", "valprep", root / "val", "--devkit", archives / DEVKIT)


def test_an_image_whose_extension_lost_its_case_is_to_be_renamed_not_moved_out(archives, tmp_path):
    """Before: `move ILSVRC2012_val_00000001.jpeg out: not validation images`, which lost the image."""
    root = tmp_path / "r"
    ok("data", "extract", "--val-tar", archives / VAL_TAR, "--out", root)
    image = root / "val/ILSVRC2012_val_00000001.JPEG"
    image.rename(image.with_suffix(".jpeg"))
    result = vitctl("data", "valprep", root / "val", "--devkit", archives / DEVKIT)
    assert result.exit_code == 1 and ("fix: rename ILSVRC2012_val_00000001.jpeg to ILSVRC2012_val_00000001.JPEG: the "
                                      "names the labels give them; ") in result.stderr, result.stderr
    assert "not validation images" not in result.stderr and "put them back" not in result.stderr
    image.with_suffix(".jpeg").rename(image)
    ok("data", "valprep", root / "val", "--devkit", archives / DEVKIT)
    assert len(_layout(root / "val")) == len(_truth(archives))


def test_val_sorted_with_another_dataset_s_labels_is_given_a_way_to_start_over_and_it_works(archives, tmp_path):
    """Before: the fix sent the user to move images by hand, or to doubt the right devkit."""
    other = tmp_path / "other"
    ok("data", "synth", other, "--classes", CLASSES, "--train-per-class", 1, "--val-per-class", VAL_PER_CLASS,
       "--seed", 8)
    root = tmp_path / "r"
    ok("data", "extract", "--val-tar", archives / VAL_TAR, "--out", root)
    ok("data", "valprep", root / "val", "--devkit", other / DEVKIT)  # the wrong labels: they sort all the same
    (root / "val/notes.txt").write_text("mine")
    result = vitctl("data", "valprep", root / "val", "--devkit", archives / DEVKIT)
    assert result.exit_code == 1 and "images sit in the wrong WNID folder" in result.stderr, result.stderr
    assert f"fix: move notes.txt out of {root / 'val'}: not validation images; " in result.stderr, result.stderr
    start_over = re.search(r"to start over \(val sorted with another dataset's labels\), `(rm -r \S+)`, then "
                           r"`(vitctl data extract [^`]+)` and valprep", result.stderr)
    subprocess.run(shlex.split(start_over[1]), check=True)
    ok(*shlex.split(start_over[2])[1:])
    ok("data", "valprep", root / "val", "--devkit", archives / DEVKIT)
    assert len(_layout(root / "val")) == len(_truth(archives))


def test_images_that_are_symbolic_links_are_refused_and_the_copied_images_sort(archives, prepared_root, tmp_path):
    """Before: `unexpected entries (not images, not WNID folders)` and `move them out`, which emptied the folder."""
    files, val = _val_dir(archives, tmp_path), tmp_path / "links/val"
    val.mkdir(parents=True)
    for image in files.iterdir():
        (val / image.name).symlink_to(os.path.relpath(image, val))
    result = vitctl("data", "valprep", val, "--devkit", archives / DEVKIT)
    assert result.exit_code == 1 and "entries are symbolic links, e.g. ILSVRC2012_val_" in result.stderr
    assert "cp -L" in result.stderr and all(p.is_symlink() for p in val.iterdir())
    for link in val.iterdir():  # the fix: the images themselves
        shutil.copyfile(link, link.with_suffix(".tmp"))
        link.with_suffix(".tmp").replace(link)
    ok("data", "valprep", val, "--devkit", archives / DEVKIT)
    assert _layout(val) == _layout(prepared_root / "val")


def test_foreign_file_is_refused_and_nothing_moves(archives, tmp_path):
    val = _val_dir(archives, tmp_path)
    (val / "notes").mkdir()
    result = vitctl("data", "valprep", val, "--devkit", archives / DEVKIT)
    assert result.exit_code == 1 and "notes" in result.stderr
    assert not [p for p in val.iterdir() if p.is_dir() and p.name != "notes"]


def test_devkit_from_another_year_is_refused(archives, tmp_path):
    val = _val_dir(archives, tmp_path)
    synsets = np.zeros((2, 1), dtype=[("ILSVRC2010_ID", "O"), ("WNID", "O"), ("num_children", "O")])
    for i in range(2):
        synsets[i, 0]["ILSVRC2010_ID"], synsets[i, 0]["WNID"], synsets[i, 0]["num_children"] = i + 1, "n01440764", 0
    mat = io.BytesIO()
    scipy.io.savemat(mat, {"synsets": synsets})
    devkit = tmp_path / "ILSVRC2010_devkit-1.0.tar.gz"
    with tarfile.open(devkit, "w:gz") as tar:
        for name, data in [("ILSVRC2010_devkit-1.0/data/meta.mat", mat.getvalue()),
                           ("ILSVRC2010_devkit-1.0/data/ILSVRC2010_validation_ground_truth.txt", b"1\n")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    result = vitctl("data", "valprep", val, "--devkit", devkit)
    assert result.exit_code == 1 and "ILSVRC2010" in result.stderr and "ILSVRC2012_devkit_t12" in result.stderr
    assert not [p for p in val.iterdir() if p.is_dir()]


def test_truncated_devkit_is_refused(archives, tmp_path):
    val = _val_dir(archives, tmp_path)
    cut = tmp_path / DEVKIT
    raw = (archives / DEVKIT).read_bytes()
    cut.write_bytes(raw[: len(raw) // 2])
    result = vitctl("data", "valprep", val, "--devkit", cut)
    assert result.exit_code == 1 and "damaged or truncated" in result.stderr


def test_devkit_or_solution_is_required(tmp_path):
    (tmp_path / "val").mkdir()
    assert vitctl("data", "valprep", tmp_path / "val").exit_code == 2


@pytest.mark.parametrize(("split", "archive"), [("train", TRAIN_TAR), ("val", VAL_TAR)])
def test_an_image_archive_as_devkit_is_named_with_where_it_goes(archives, tmp_path, split, archive):
    """Before: `not an ILSVRC2012 devkit: no data/meta.mat (it names ILSVRC2012)`, the val archive's image names."""
    val = _val_dir(archives, tmp_path)
    shutil.copy(archives / archive, tmp_path / "devkit.tar.gz")
    result = vitctl("data", "valprep", val, "--devkit", tmp_path / "devkit.tar.gz")
    assert result.exit_code == 1 and (f"devkit.tar.gz: this is ILSVRC2012_img_{split}.tar (the {split} images), not "
                                      "the devkit") in result.stderr, result.stderr
    assert f"fix: pass it to `vitctl data extract --{split}-tar`, and ILSVRC2012_devkit_t12.tar.gz as --devkit" \
        in result.stderr


@pytest.mark.parametrize("content", [b"", b"not an archive at all\n" * 40])
def test_a_file_that_is_no_archive_as_devkit_says_so_in_one_line(archives, tmp_path, content):
    """Before: tarfile's list of why each of its methods failed, over five lines."""
    val = _val_dir(archives, tmp_path)
    (tmp_path / "devkit.tar.gz").write_bytes(content)
    result = vitctl("data", "valprep", val, "--devkit", tmp_path / "devkit.tar.gz")
    assert result.exit_code == 1 and "cannot read the devkit archive (not a tar archive, plain or compressed)" \
        in result.stderr and "method gz" not in result.stderr, result.stderr


def _solution(val_labels: dict[str, str]) -> str:
    return "ImageId,PredictionString\n" + "".join(f"{name[:-5]},{wnid} 1 2 30 40\n"
                                                  for name, wnid in sorted(val_labels.items()))


def test_the_devkit_s_folder_or_the_solution_csv_as_devkit_are_named_and_the_fix_works(archives, prepared_root,
                                                                                         tmp_path):
    """Before: `devkit not found` for the unpacked folder, `damaged or truncated; download it again` for the CSV."""
    val, reference = _val_dir(archives, tmp_path), _layout(prepared_root / "val")
    unpacked = tmp_path / "devkit"
    unpacked.mkdir()
    result = vitctl("data", "valprep", val, "--devkit", unpacked)
    assert result.exit_code == 1 and "is a folder: --devkit takes the archive itself" in result.stderr, result.stderr
    csv = tmp_path / "LOC_val_solution.csv"
    csv.write_text(_solution(reference))
    result = vitctl("data", "valprep", val, "--devkit", csv)
    assert result.exit_code == 1 and "this is Kaggle's LOC_val_solution.csv, not the devkit" in result.stderr
    ok("data", "valprep", val, *result.stderr.split("fix: pass it with ", 1)[1].split(" instead")[0].split())
    assert _layout(val) == reference


def test_labels_naming_a_class_train_lacks_are_refused_before_anything_moves(archives, prepared_root, tmp_path):
    ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--val-tar", archives / VAL_TAR, "--out",
       tmp_path / "r")
    val, reference = tmp_path / "r/val", _layout(prepared_root / "val")
    wrong = dict(reference, **{min(reference): "n01440764"})  # tench: a real WNID, not among the train classes
    csv = tmp_path / "LOC_val_solution.csv"
    csv.write_text(_solution(wrong))
    before = sorted(p.name for p in val.iterdir())
    result = vitctl("data", "valprep", val, "--solution", csv)
    assert result.exit_code == 1
    assert f"{csv}: the labels name 1 WNID that is not a class under {tmp_path / 'r/train'}: n01440764" \
        in result.stderr
    assert "pass the devkit or solution file of the dataset in" in result.stderr and "nothing was moved" \
        in result.stderr
    assert sorted(p.name for p in val.iterdir()) == before
    csv.write_text(_solution(reference))  # the fix: the solution file of this dataset
    ok("data", "valprep", val, "--solution", csv)
    assert _layout(val) == reference
    ok("data", "shard", tmp_path / "r", "--out", tmp_path / "s")


def test_without_train_beside_val_any_wnid_is_taken(archives, prepared_root, tmp_path):
    val, reference = _val_dir(archives, tmp_path), _layout(prepared_root / "val")
    labels = dict(reference, **{min(reference): "n01440764"})
    csv = tmp_path / "LOC_val_solution.csv"
    csv.write_text(_solution(labels))
    ok("data", "valprep", val, "--solution", csv)
    assert _layout(val) == labels


@pytest.mark.parametrize("content, says", [
    (None, "not a CSV text file ('utf-8' codec can't decode"),  # the val tar given as the solution
    (b"\xff\xfeI\x00m\x00", "not a CSV text file ('utf-8' codec can't decode"),
    (b"ImageId,Prediction\nILSVRC2012_val_00000001,n02119789\n",
     "expected the columns ImageId,PredictionString, the header is 'ImageId,Prediction'"),
])
def test_a_solution_file_that_is_not_the_csv_is_a_clear_error(archives, prepared_root, tmp_path, content, says):
    val = _val_dir(archives, tmp_path)
    bad = tmp_path / "solution.csv"
    bad.write_bytes((archives / VAL_TAR).read_bytes() if content is None else content)
    result = vitctl("data", "valprep", val, "--solution", bad)
    assert result.exit_code == 1 and f"{bad}: {says}" in result.stderr and "Traceback" not in result.stderr
    assert "fix: pass Kaggle's LOC_val_solution.csv (a CSV text file with the columns ImageId,PredictionString)" \
        in result.stderr
    assert not [p for p in val.iterdir() if p.is_dir()]
    good = tmp_path / "LOC_val_solution.csv"
    good.write_text(_solution(_layout(prepared_root / "val")))
    ok("data", "valprep", val, "--solution", good)


def test_a_row_without_a_wnid_is_named_and_its_fix_works(archives, prepared_root, tmp_path):
    val, reference = _val_dir(archives, tmp_path), _layout(prepared_root / "val")
    rows = _solution(reference).splitlines()
    image_id = rows[3].split(",")[0]
    rows[3] = f"{image_id},garbage"
    csv = tmp_path / "LOC_val_solution.csv"
    csv.write_text("\n".join(rows) + "\n")
    result = vitctl("data", "valprep", val, "--solution", csv)
    assert result.exit_code == 1 and f"{csv}: row 4: no WNID in 'garbage'" in result.stderr
    assert "fix: begin row 4's PredictionString with the image's WNID (n and 8 digits)" in result.stderr
    rows[3] = f"{image_id},{reference[image_id + '.JPEG']} 1 2 3 4"
    csv.write_text("\n".join(rows) + "\n")
    ok("data", "valprep", val, "--solution", csv)
    assert _layout(val) == reference


def _damaged_devkit(archives: Path, tmp_path: Path, member: str, damage) -> Path:
    """The devkit with `member` (under ILSVRC2012_devkit_t12/data/) replaced by `damage(its bytes)`."""
    bad = tmp_path / "bad" / DEVKIT
    bad.parent.mkdir()
    with tarfile.open(archives / DEVKIT) as src, tarfile.open(bad, "w:gz") as dst:
        for info in src.getmembers():
            data = src.extractfile(info).read() if info.isfile() else None
            if info.name.endswith(f"/data/{member}"):
                data = damage(data)
                info.size = len(data)
            dst.addfile(info, None if data is None else io.BytesIO(data))
    return bad


@pytest.mark.parametrize(("member", "damage", "says"), [
    ("meta.mat", lambda b: b[:len(b) // 2], "is damaged (could not read bytes)"),
    ("meta.mat", lambda b: b"", "is damaged (Mat file appears to be truncated)"),
    ("ILSVRC2012_validation_ground_truth.txt", lambda b: b"\xff\xfe" + b, "is damaged: not text ('utf-8' codec"),
], ids=["meta-cut-short", "meta-empty", "truth-not-utf8"])
def test_a_damaged_devkit_member_is_named_and_a_good_devkit_works(archives, tmp_path, member, damage, says):
    """Before: a traceback (OSError, MatReadError, UnicodeDecodeError)."""
    val = _val_dir(archives, tmp_path)
    bad = _damaged_devkit(archives, tmp_path, member, damage)
    before = sorted(p.name for p in val.iterdir())
    result = vitctl("data", "valprep", val, "--devkit", bad)
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"error: {bad}: member ILSVRC2012_devkit_t12/data/{member} {says}" in result.stderr, result.stderr
    assert f"fix: download {DEVKIT} again" in result.stderr
    assert sorted(p.name for p in val.iterdir()) == before
    ok("data", "valprep", val, "--devkit", archives / DEVKIT)  # the fix: the devkit as downloaded


def _meta_mat(leaves: list[tuple[str, str]]) -> bytes:
    out = io.BytesIO()
    scipy.io.savemat(out, {"synsets": synset_struct(leaves)}, format="5")
    return out.getvalue()


@pytest.mark.parametrize("repeated, says", [("wnid", "the same WNID: n02119789"),
                                            ("id", "the same ILSVRC2012_ID: 2")])
def test_a_meta_mat_that_repeats_a_wnid_or_an_id_is_refused(archives, tmp_path, repeated, says):
    """Before: two leaf IDs of one WNID were taken, and valprep merged their images into one class."""
    val = _val_dir(archives, tmp_path)
    leaves = LEAVES[:CLASSES]
    if repeated == "wnid":
        leaves[1] = (leaves[0][0], leaves[1][1])
        meta = _meta_mat(leaves)
    else:
        struct = synset_struct(leaves)
        struct[2, 0]["ILSVRC2012_ID"] = 2
        out = io.BytesIO()
        scipy.io.savemat(out, {"synsets": struct}, format="5")
        meta = out.getvalue()
    bad = _damaged_devkit(archives, tmp_path, "meta.mat", lambda _: meta)
    before = sorted(p.name for p in val.iterdir())
    result = vitctl("data", "valprep", val, "--devkit", bad)
    assert result.exit_code == 1 and f"meta.mat gives more than one synset {says}" in result.stderr, result.stderr
    assert f"fix: the devkit is not the original: download {DEVKIT} again" in result.stderr
    assert sorted(p.name for p in val.iterdir()) == before
    ok("data", "valprep", val, "--devkit", archives / DEVKIT)


def test_a_devkit_member_larger_than_the_original_is_refused_unread(archives, tmp_path):
    """Before: read whole into memory, whatever its size (a 9 MB gzip held a 2 GiB meta.mat)."""
    val = _val_dir(archives, tmp_path)
    bad = _damaged_devkit(archives, tmp_path, "ILSVRC2012_validation_ground_truth.txt",
                          lambda b: b + b"1\n" * (9 << 20))
    result = vitctl("data", "valprep", val, "--devkit", bad)
    assert result.exit_code == 1 and "ground_truth.txt is 18,874,4" in result.stderr, result.stderr
    assert f"where the original's is under 1 MB (vitctl reads at most {MEMBER_CAP:,})" in result.stderr
    ok("data", "valprep", val, "--devkit", archives / DEVKIT)


def test_a_ground_truth_line_that_is_no_number_names_the_devkit_to_download(archives, tmp_path):
    """Before: the error had no fix line."""
    val = _val_dir(archives, tmp_path)
    bad = _damaged_devkit(archives, tmp_path, "ILSVRC2012_validation_ground_truth.txt", lambda b: b"x\n" + b)
    result = vitctl("data", "valprep", val, "--devkit", bad)
    assert result.exit_code == 1 and "holds a non-integer line" in result.stderr, result.stderr
    assert f"fix: download {DEVKIT} again" in result.stderr
    ok("data", "valprep", val, "--devkit", archives / DEVKIT)


def test_a_meta_mat_that_crashes_scipy_is_named_damaged_and_valprep_lives_on(archives, tmp_path, monkeypatch):
    """Some byte flips in meta.mat crash scipy's loadmat with a segfault, which no `except` catches: before, valprep
    died with the process. loadmat here crashes as they made it crash."""
    import os
    import signal

    val = _val_dir(archives, tmp_path)
    monkeypatch.setattr("scipy.io.loadmat", lambda *a, **k: os.kill(os.getpid(), signal.SIGSEGV))
    result = vitctl("data", "valprep", val, "--devkit", archives / DEVKIT)
    assert result.exit_code == 1 and (f"error: {archives / DEVKIT}: member ILSVRC2012_devkit_t12/data/meta.mat is "
                                      "damaged (reading it crashed scipy's loadmat)\n"
                                      f"fix: download {DEVKIT} again") in result.stderr, result.stderr


def test_an_image_with_two_rows_in_the_solution_is_refused_and_its_fix_works(archives, prepared_root, tmp_path):
    """Before: the later row won, without a word."""
    val, reference = _val_dir(archives, tmp_path), _layout(prepared_root / "val")
    first = min(reference)
    other = next(w for w in sorted(set(reference.values())) if w != reference[first])
    rows = _solution(reference).splitlines()
    rows.insert(2, f"{first[:-5]},{other} 1 2 3 4")
    csv = tmp_path / "LOC_val_solution.csv"
    csv.write_text("\n".join(rows) + "\n")
    before = sorted(p.name for p in val.iterdir())
    result = vitctl("data", "valprep", val, "--solution", csv)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert (f"error: {csv}: image {first[:-5]} has two rows: row 2 ({reference[first]}) and row 3 ({other})\n"
            f"fix: keep the row of {first[:-5]} with its right WNID and delete the other") in result.stderr
    assert sorted(p.name for p in val.iterdir()) == before
    del rows[2]
    csv.write_text("\n".join(rows) + "\n")
    ok("data", "valprep", val, "--solution", csv)
    assert _layout(val) == reference


def test_a_solution_file_beginning_with_a_utf8_bom_is_read(archives, prepared_root, tmp_path):
    """Before: 'expected the columns ImageId,PredictionString, the header is '\\ufeffImageId,PredictionString''."""
    val, reference = _val_dir(archives, tmp_path), _layout(prepared_root / "val")
    csv = tmp_path / "LOC_val_solution.csv"
    csv.write_bytes(b"\xef\xbb\xbf" + _solution(reference).encode())
    ok("data", "valprep", val, "--solution", csv)
    assert _layout(val) == reference
