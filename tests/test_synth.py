import io
import re
import tarfile

import scipy.io
from PIL import Image

from conftest import CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS
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
    from conftest import ok

    for name in ("a", "b"):
        ok("data", "synth", tmp_path / name, "--classes", 3, "--train-per-class", 2, "--val-per-class", 1)
    for archive in (TRAIN_TAR, VAL_TAR):
        assert (tmp_path / "a" / archive).read_bytes() == (tmp_path / "b" / archive).read_bytes()


def test_synth_into_a_path_under_a_file_is_a_clear_error(tmp_path):
    from conftest import vitctl

    (tmp_path / "file").write_text("x")
    result = vitctl("data", "synth", tmp_path / "file" / "archives")
    assert result.exit_code == 1 and f"{tmp_path / 'file'} is a file, not a folder" in result.stderr
    assert "choose another OUT" in result.stderr
