import io
import re
import tarfile
import time

import pytest
import scipy.io
from PIL import Image

from conftest import CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS, ok, vitctl
from vitctl.datasets import synth as synth_module
from vitctl.datasets.synth import DEVKIT, TRAIN_TAR, VAL_TAR


def test_train_tar_is_an_outer_tar_of_per_wnid_inner_tars(archives):
    with tarfile.open(archives / TRAIN_TAR) as outer:
        inner_names = outer.getnames()
        assert len(inner_names) == CLASSES and all(re.fullmatch(r"n\d{8}\.tar", n) for n in inner_names)
        for name in inner_names:
            with tarfile.open(fileobj=outer.extractfile(name)) as inner:
                members = inner.getnames()
            wnid = name[:-4]
            numbers = [int(re.fullmatch(rf"{wnid}_(\d+)\.JPEG", m).group(1)) for m in members]
            assert len(numbers) == TRAIN_PER_CLASS
            assert sorted(numbers) != list(range(numbers[0], numbers[0] + len(numbers)))  # not consecutive


def test_val_tar_is_flat_and_numbered(archives):
    with tarfile.open(archives / VAL_TAR) as tar:
        names = tar.getnames()
    assert names == [f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(1, CLASSES * VAL_PER_CLASS + 1)]


def test_devkit_has_real_synsets_and_ilsvrc_ids_not_sorted_indices(archives):
    with tarfile.open(archives / DEVKIT) as tar:
        meta = scipy.io.loadmat(io.BytesIO(tar.extractfile("ILSVRC2012_devkit_t12/data/meta.mat").read()),
                                squeeze_me=True)["synsets"]
        truth = tar.extractfile("ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt").read().split()
    assert set(meta.dtype.names) >= {"ILSVRC2012_ID", "WNID", "words", "num_children", "children"}
    leaves = [s for s in meta if s["num_children"] == 0]
    internal = [s for s in meta if s["num_children"] > 0]
    assert [int(s["ILSVRC2012_ID"]) for s in leaves] == list(range(1, CLASSES + 1))
    assert internal and all(int(s["ILSVRC2012_ID"]) > CLASSES for s in internal)
    assert leaves[0]["WNID"] == "n02119789"  # ID 1 is kit fox, as in the real devkit
    wnids = [str(s["WNID"]) for s in leaves]
    assert wnids != sorted(wnids)
    assert sorted(int(t) for t in truth) == sorted(list(range(1, CLASSES + 1)) * VAL_PER_CLASS)


def test_train_holds_the_png_cmyk_and_grayscale_gotchas(archives):
    kinds = []
    with tarfile.open(archives / TRAIN_TAR) as outer:
        for name in outer.getnames():
            with tarfile.open(fileobj=outer.extractfile(name)) as inner:
                for member in inner.getmembers():
                    with Image.open(inner.extractfile(member)) as image:
                        kinds.append((image.format, image.mode))
    assert kinds.count(("PNG", "RGB")) == 1
    assert kinds.count(("JPEG", "CMYK")) == 1
    assert kinds.count(("JPEG", "L")) == 1
    assert kinds.count(("JPEG", "RGB")) == CLASSES * TRAIN_PER_CLASS - 3


def test_synth_is_deterministic(tmp_path):
    for name in ("a", "b"):
        ok("data", "synth", tmp_path / name, "--classes", 3, "--train-per-class", 2, "--val-per-class", 1)
    for archive in (TRAIN_TAR, VAL_TAR):
        assert (tmp_path / "a" / archive).read_bytes() == (tmp_path / "b" / archive).read_bytes()


def test_synth_into_a_path_under_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    result = vitctl("data", "synth", tmp_path / "file" / "archives")
    assert result.exit_code == 1 and f"{tmp_path / 'file'} is a file, not a folder" in result.stderr
    assert "choose another OUT" in result.stderr


def test_synth_into_a_shard_or_run_folder_is_refused(prepared_shards, tmp_path):
    """Before: the three archives were written among the shards, or a run's checkpoints."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for folder, kind in ((prepared_shards, "a shard folder"), (run, "a run folder")):
        before = sorted(p.name for p in folder.iterdir())
        result = vitctl("data", "synth", folder)
        assert result.exit_code == 1 and f"{folder}: is {kind}" in result.stderr, result.stderr
        assert f"fix: choose a folder of their own, e.g. {folder.parent / 'archives'}" in result.stderr
        assert sorted(p.name for p in folder.iterdir()) == before


@pytest.mark.parametrize("inside", ["", "train", "val/n01440764"])
def test_synth_into_a_dataset_root_or_its_split_folders_is_refused(prepared_root, inside):
    """Before: archives among a root's class folders (or images), which `shard ROOT` then refused."""
    out = prepared_root / inside if inside else prepared_root
    before = sorted(p.relative_to(prepared_root) for p in prepared_root.rglob("*"))
    result = vitctl("data", "synth", out)
    said = "is a dataset root (`vitctl data extract` wrote it)" if not inside else \
        f"lies in {prepared_root / inside.split('/')[0]}, a split folder of the dataset root {prepared_root}"
    assert result.exit_code == 1 and f"error: {out}: {said}" in result.stderr, result.stderr
    assert f"fix: choose a folder of their own, e.g. {prepared_root.parent / 'archives'}" in result.stderr
    assert sorted(p.relative_to(prepared_root) for p in prepared_root.rglob("*")) == before


@pytest.mark.parametrize("classes", [0, 2, 37])
def test_classes_out_of_range_give_the_range_synth_accepts(tmp_path, classes):
    result = vitctl("data", "synth", tmp_path / "a", "--classes", classes)
    assert result.exit_code == 2 and f"Invalid value for '--classes': {classes} is not in the range 3<=x<=36." \
        in result.stderr
    assert not (tmp_path / "a").exists()
    ok("data", "synth", tmp_path / "a", "--classes", 3, "--train-per-class", 1, "--val-per-class", 1)


SMALL = ("--classes", 3, "--train-per-class", 1, "--val-per-class", 1)


def test_a_negative_seed_is_refused_before_anything_is_written(tmp_path):
    """Before: numpy's ValueError as a traceback, and an empty OUT left behind."""
    result = vitctl("data", "synth", tmp_path / "a", *SMALL, "--seed", -1)
    assert result.exit_code == 2 and "Invalid value for '--seed': -1 is not in the range x>=0" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "a").exists()


@pytest.mark.parametrize("earlier_synth", [False, True])
def test_archives_synth_did_not_write_are_never_replaced(tmp_path, earlier_synth):
    out = tmp_path / "downloads"
    if earlier_synth:  # synth wrote here before, then the user put the real archive in place of its own
        ok("data", "synth", out, *SMALL)
    out.mkdir(exist_ok=True)
    (out / TRAIN_TAR).write_bytes(b"the real 147 GB archive")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    result = vitctl("data", "synth", out, *SMALL)
    assert result.exit_code == 1
    assert f"{out}: holds {TRAIN_TAR}, which `vitctl data synth` did not write" in result.stderr
    assert "fix: choose another OUT" in result.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    ok("data", "synth", tmp_path / "another", *SMALL)
    assert (out / TRAIN_TAR).read_bytes() == b"the real 147 GB archive"


def test_synth_replaces_its_own_archives_even_after_an_interrupted_rerun(tmp_path, monkeypatch):
    out = tmp_path / "a"
    ok("data", "synth", out, *SMALL)
    real, published = synth_module.publish, []

    def ctrl_c_before_the_second_rename(path):  # the marker already records the new val archive, not yet in place
        published.append(path)
        if len(published) == 2:
            raise KeyboardInterrupt
        real(path)

    with monkeypatch.context() as patch:
        patch.setattr(synth_module, "publish", ctrl_c_before_the_second_rename)
        assert vitctl("data", "synth", out, "--classes", 4, "--train-per-class", 1, "--val-per-class", 1,
                      ).exit_code == 130
    ok("data", "synth", out, "--classes", 5, "--train-per-class", 1, "--val-per-class", 1)
    ok("data", "synth", tmp_path / "b", "--classes", 5, "--train-per-class", 1, "--val-per-class", 1)
    for archive in (TRAIN_TAR, VAL_TAR, DEVKIT):
        assert (out / archive).read_bytes() == (tmp_path / "b" / archive).read_bytes()


def test_the_devkit_holds_no_clock_time():
    """savemat's header and gzip's both hold the time of writing: a rerun a second later wrote other bytes."""
    classes, truth = [("n01440764", "tench"), ("n01443537", "goldfish")], [1, 2, 1]
    first = synth_module.devkit_bytes(classes, truth)
    time.sleep(1.1)
    assert synth_module.devkit_bytes(classes, truth) == first
