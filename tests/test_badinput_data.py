"""Bad input on the data side that earlier sweeps left open: images Pillow refuses as too large, and shard folders
changed after `vitctl data shard` wrote them (a shard deleted, cut short or replaced, the manifest's shard list,
classes or counts edited). Each test follows the fix the message names."""

import hashlib
import io
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from PIL import Image
from test_train import tiny
from test_verify import _edit_manifest, _fix_commands, _follow

from conftest import CLASSES, TRAIN_PER_CLASS, ok, vitctl
from vitctl.datasets import shard as shard_module
from vitctl.datasets.errors import DataError
from vitctl.datasets.extract import LEDGER
from vitctl.trainer.config import ConfigError
from vitctl.trainer.data.augment import Recipe
from vitctl.trainer.data.loader import LoaderSpec, TrainBatches
from vitctl.trainer.data.plan import EpochPlan
from vitctl.trainer.data.shards import read_table, split_shards
from vitctl.trainer.loop import train

TOO_LARGE = re.escape("Image size (400000000 pixels) exceeds limit of 178956970 pixels")


def _claiming_20000_square(jpeg: bytes) -> bytes:
    """The JPEG with its frame header claiming 20000 x 20000 pixels: Image.open refuses it before decoding."""
    data = bytearray(jpeg)
    sof = re.search(rb"\xff[\xc0-\xc2]", data).start()
    data[sof + 5:sof + 9] = (20000).to_bytes(2, "big") * 2
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(data))
    return bytes(data)


def _jpeg(mode: str) -> bytes:
    out = io.BytesIO()
    Image.new(mode, (40, 30), 90).save(out, format="JPEG")
    return out.getvalue()


def test_an_image_pillow_refuses_as_too_large_is_named_by_shard_and_skipped_when_asked(root_copy, tmp_path):
    wnid = sorted(p.name for p in (root_copy / "train").iterdir())[0]
    for name, mode in (("big_rgb", "RGB"), ("big_gray", "L")):  # an RGB JPEG is kept as it is, the others converted
        (root_copy / "train" / wnid / f"{name}.JPEG").write_bytes(_claiming_20000_square(_jpeg(mode)))
    command = ["data", "shard", root_copy, "--out", tmp_path / "s", "--split", "train", "--maxcount", 16]
    failed = vitctl(*command, "--on-bad-image", "fail")
    assert failed.exit_code == 1 and "Traceback" not in failed.stderr
    assert re.search(rf"error: {re.escape(str(root_copy / 'train' / wnid))}/big_(rgb|gray)\.JPEG: unreadable image "
                     rf"\({TOO_LARGE}", failed.stderr), failed.stderr
    assert "fix: rerun the same command with --on-bad-image skip to leave it out" in failed.stderr
    skipped = ok(*command, "--on-bad-image", "skip").output
    for name in ("big_rgb", "big_gray"):
        assert re.search(rf"train/{wnid}/{name}\.JPEG: unreadable image \({TOO_LARGE}", skipped), skipped
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert sorted(s["source"] for e in manifest["splits"]["train"]["shards"] for s in e["skipped"]) == [
        f"train/{wnid}/big_gray.JPEG", f"train/{wnid}/big_rgb.JPEG"]


def test_an_image_too_large_for_pillow_inside_a_shard_is_named_by_verify_and_the_loader(shards_copy):
    """As an earlier vitctl sharded it (it kept RGB JPEGs unopened): verify and training name it, no traceback."""
    table = read_table(shards_copy, split_shards(shards_copy, "train")[0])
    shard, offset, size = Path(table.paths[table.shard[0]]), int(table.offset[0]), int(table.size[0])
    raw = bytearray(shard.read_bytes())
    raw[offset:offset + size] = _claiming_20000_square(bytes(raw[offset:offset + size]))
    shard.write_bytes(bytes(raw))
    _edit_manifest(shards_copy, lambda m: next(e for e in m["splits"]["train"]["shards"] if e["name"] == shard.name)
                   .update(sha256=hashlib.sha256(raw).hexdigest()))
    verified = vitctl("data", "verify", shards_copy, "--decode", 10_000)
    assert verified.exit_code == 1 and "Traceback" not in verified.output + verified.stderr
    assert re.search(rf"FAIL {shard.name}: image \S+\.jpg at offset {offset} does not decode \({TOO_LARGE}",
                     verified.output), verified.output
    plan = EpochPlan(len(table), len(table), 0, 1, seed=0)
    batches = TrainBatches(table, LoaderSpec(Recipe(32), 0, 0, torch.device("cpu"), "pil"), plan)
    with pytest.raises(DataError, match=rf"{re.escape(str(shard))}: the JPEG at offset {offset} does not decode "
                                        rf"\({TOO_LARGE}"):
        next(batches(0, 0))


def _train_dry_run(shards: Path, out: Path, classes: int = CLASSES):
    """`vitctl train --dry-run`: the checks done before anything is launched, nothing launched."""
    return vitctl("train", "--config", "demo_vit", "--data", shards, "--executor", "local", "--gpus", 0, "--steps", 1,
                  "--batch", 4, "--set", f"model.num_classes={classes}", "--out", out, "--dry-run")


def _cut_short(shards: Path) -> None:
    shard = shards / "imagenet-train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:-4096])


def _replaced_by_another(shards: Path) -> None:
    """Shard 0 and its index replaced by shard 3 and its index: without a check it trains on shard 0's labels."""
    for ext in ("tar", "idx"):
        shutil.copy(shards / f"imagenet-train-000003.{ext}", shards / f"imagenet-train-000000.{ext}")


@pytest.mark.parametrize(("change", "says"), [
    (lambda s: (s / "imagenet-train-000001.tar").unlink(), "shard imagenet-train-000001.tar is missing"),
    (_cut_short, r"shard imagenet-train-000001.tar is \d+ bytes, the manifest records \d+"),
    (_replaced_by_another, r"shard imagenet-train-000000.tar is \d+ bytes, the manifest records \d+"),
], ids=["deleted", "cut-short", "replaced"])
def test_training_on_shards_changed_after_sharding_is_refused_before_launch(shards_copy, tmp_path, change, says):
    change(shards_copy)
    result = _train_dry_run(shards_copy, tmp_path / "run")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    found = re.search(rf"error: data.path {re.escape(str(shards_copy))}: {says}: the shards changed since `vitctl "
                      r"data shard` wrote them; `(vitctl data verify \S+)` names every damaged shard", result.stderr)
    assert found, result.stderr
    verified = vitctl(*shlex.split(found[1])[1:])
    assert verified.exit_code == 1
    _follow(_fix_commands(verified.output))
    ok("data", "verify", shards_copy)
    assert _train_dry_run(shards_copy, tmp_path / "run").exit_code == 0


def test_a_shard_list_cut_short_in_a_complete_split_is_refused_with_the_command_that_finishes_it(shards_copy,
                                                                                                  tmp_path):
    _edit_manifest(shards_copy, lambda m: m["splits"]["train"]["shards"].pop())
    result = _train_dry_run(shards_copy, tmp_path / "run")
    assert result.exit_code == 1, result.output
    found = re.search(r"the train split is incomplete \(3 of 4 shards recorded\); finish it with `([^`]+)`",
                      result.stderr)
    assert found, result.stderr
    _follow([shlex.split(part) for part in found[1].split(" && ")])
    assert _train_dry_run(shards_copy, tmp_path / "run").exit_code == 0


def test_a_class_list_edited_shorter_than_the_labels_is_refused_by_train_and_verify(prepared_root, shards_copy,
                                                                                     tmp_path):
    _edit_manifest(shards_copy, lambda m: m["classes"].pop())
    says = (f"error: {shards_copy / 'manifest.json'}: not a manifest `vitctl data shard` wrote: "
            rf"splits.train.shards\[\d\].labels holds '{CLASSES - 1}', not a label of the {CLASSES - 1} classes "
            rf"\(0 to {CLASSES - 2}\)\nfix: restore it, or shard into a new --out folder")
    for result in (_train_dry_run(shards_copy, tmp_path / "run", CLASSES - 1), vitctl("data", "verify", shards_copy)):
        assert result.exit_code == 1 and re.search(says, result.stderr), result.output + result.stderr
    new = tmp_path / "new"
    ok("data", "shard", prepared_root, "--out", new, "--maxcount", 16)
    ok("data", "index", new)
    assert _train_dry_run(new, tmp_path / "run").exit_code == 0


def test_a_val_shard_deleted_is_named_when_training_starts_not_at_the_first_eval(shards_copy, tmp_path):
    (shards_copy / "imagenet-val-000000.tar").unlink()
    with pytest.raises(ConfigError, match=r"shard imagenet-val-000000.tar is missing: the shards changed since"):
        train(tiny(shards_copy, tmp_path / "run", "train.max_steps=1"))
    _follow(_fix_commands(vitctl("data", "verify", shards_copy).output))
    train(tiny(shards_copy, tmp_path / "run", "train.max_steps=1"))


def test_a_sample_count_edited_in_the_manifest_is_named_when_training_starts(prepared_root, shards_copy, tmp_path):
    """The manifest's counts are what preflight checks the batch against: 100 in place of 12 let a batch larger than
    the split through, which ended in a ZeroDivisionError."""
    _edit_manifest(shards_copy, lambda m: m["splits"]["train"]["shards"][3].update(samples=100))
    with pytest.raises(ConfigError, match=r"imagenet-train-000003.tar: the manifest records 100 samples and 12 labels, "
                                          r"its index imagenet-train-000003.idx 12 samples; run `vitctl data verify"):
        train(tiny(shards_copy, tmp_path / "run", "train.max_steps=1", "data.batch_size=64"))
    verified = vitctl("data", "verify", shards_copy)
    assert "FAIL imagenet-train-000003.tar: 12 samples, manifest says 100" in verified.output
    assert "shard into a new --out folder" in verified.output  # its advice, followed:
    new = tmp_path / "new"
    ok("data", "shard", prepared_root, "--out", new, "--maxcount", 16)
    ok("data", "index", new)
    train(tiny(new, tmp_path / "run", "train.max_steps=1"))


def test_an_empty_train_class_folder_is_refused_and_either_fix_shards(root_copy, tmp_path):
    """Before, it became a class with no training images: a label and a model output that nothing trains."""
    (root_copy / LEDGER).unlink()  # a tree extract did not write: in one it did, the lost images are named (below)
    wnid = sorted(p.name for p in (root_copy / "train").iterdir())[0]
    images = tmp_path / "images"
    shutil.move(root_copy / "train" / wnid, images)
    (root_copy / "train" / wnid).mkdir()
    command = ["data", "shard", root_copy, "--out", tmp_path / "s", "--maxcount", 16]
    refused = vitctl(*command)
    assert refused.exit_code == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.endswith(
        f"error: {root_copy / 'train'}: class folder {wnid} holds no images\nfix: put its images back into "
        f"{root_copy / 'train' / wnid}, or move that folder out of {root_copy / 'train'} (and "
        f"{root_copy / 'val' / wnid} with it, if there is one)\n"), refused.stderr
    assert not (tmp_path / "s").exists()
    for split in ("train", "val"):  # the second way: the class leaves both splits
        shutil.move(root_copy / split / wnid, tmp_path / f"{split}-{wnid}")
    ok(*command)
    assert len(json.loads((tmp_path / "s" / "manifest.json").read_text())["classes"]) == CLASSES - 1
    for split in ("train", "val"):  # the first way: its images back
        shutil.move(tmp_path / f"{split}-{wnid}", root_copy / split / wnid)
    shutil.rmtree(root_copy / "train" / wnid)
    shutil.move(images, root_copy / "train" / wnid)
    ok(*command[:3], "--out", tmp_path / "s2", "--maxcount", 16)


def test_an_empty_val_class_folder_is_refused_and_moving_it_out_shards(root_copy, tmp_path):
    """Before: sharded without a word, and the evaluation left that class out."""
    (root_copy / LEDGER).unlink()  # a tree extract did not write (in one it did, the lost images are named)
    wnid = sorted(p.name for p in (root_copy / "val").iterdir())[0]
    for image in (root_copy / "val" / wnid).iterdir():
        image.unlink()
    command = ["data", "shard", root_copy, "--out", tmp_path / "s", "--maxcount", 16]
    refused = vitctl(*command)
    assert refused.exit_code == 1 and refused.stderr.endswith(
        f"error: {root_copy / 'val'}: class folder {wnid} holds no images\nfix: put its images back into "
        f"{root_copy / 'val' / wnid} (valprep sorts them there), or move that folder out of {root_copy / 'val'} to "
        "evaluate without that class\n"), refused.stderr
    (root_copy / "val" / wnid).rmdir()
    ok(*command)


def test_an_index_of_another_shard_with_the_same_count_is_named_not_blamed_on_a_jpeg(shards_copy):
    """Shards 0 and 1 both hold 16 samples: shard 1's index over shard 0 passes every count and size check, and
    reading at its offsets gave "the JPEG at offset N does not decode", which names no index."""
    shutil.copy(shards_copy / "imagenet-train-000001.idx", shards_copy / "imagenet-train-000000.idx")

    def read_every_sample() -> None:
        table = read_table(shards_copy, split_shards(shards_copy, "train")[0])
        plan = EpochPlan(len(table), len(table), 0, 1, seed=0)  # one batch: every sample
        next(TrainBatches(table, LoaderSpec(Recipe(32), 0, 0, torch.device("cpu"), "pil"), plan)(0, 0))

    shard = shards_copy / "imagenet-train-000000.tar"
    with pytest.raises(DataError) as raised:
        read_every_sample()
    assert raised.value.where == str(shard)
    assert re.fullmatch(r"imagenet-train-000000.idx does not describe this shard: no member of \d+ bytes starts at "
                        r"offset \d+ \(an index of another shard, or the shard was written again since\)",
                        raised.value.what), raised.value.what
    assert raised.value.fix == f"`vitctl data index {shards_copy}` writes every index again from its shard"
    ok("data", "index", shards_copy)
    read_every_sample()


def test_a_shard_damaged_in_place_is_named_damaged_not_blamed_on_its_index(shards_copy):
    """Before: `X.idx does not describe this shard`, whose fix (`vitctl data index`) then failed on the damaged
    header; only `verify` named the cause."""
    table = read_table(shards_copy, split_shards(shards_copy, "train")[0])
    shard, offset = Path(table.paths[0]), int(table.offset[(table.shard == 0).nonzero()[0][3]])
    damaged = bytearray(shard.read_bytes())
    damaged[offset - 512:offset + 512] = bytes(range(256)) * 4  # its tar header and its JPEG's first bytes
    shard.write_bytes(bytes(damaged))
    plan = EpochPlan(len(table), len(table), 0, 1, seed=0)
    with pytest.raises(DataError) as raised:
        next(TrainBatches(table, LoaderSpec(Recipe(32), 0, 0, torch.device("cpu"), "pil"), plan)(0, 0))
    assert (raised.value.where, raised.value.what) == (str(shard), "damaged since it was sharded: its sha256 differs "
            f"from the one manifest.json records, and no tar header precedes the sample at offset {offset}")
    assert raised.value.fix.startswith(f"`vitctl data verify {shards_copy}` checks every shard")
    verified = vitctl("data", "verify", shards_copy)  # the fix's first step names the shard
    assert verified.exit_code == 1 and f"FAIL {shard.name}: sha256 differs from the manifest" in verified.output


def _lose_a_class_and_an_image(root: Path) -> tuple[str, str]:
    """Remove train's first class folder and one image of its second; returns their WNIDs."""
    first, second = sorted(p.name for p in (root / "train").iterdir())[:2]
    shutil.rmtree(root / "train" / first)
    min((root / "train" / second).iterdir()).unlink()
    (root / "train" / second / ".DS_Store").write_bytes(b"")  # not an image: it makes up for none
    return first, second


def test_train_classes_or_images_lost_since_extract_are_refused_and_the_extract_rerun_restores_them(root_copy,
                                                                                                    tmp_path):
    """Before: sharded with a class fewer (the labels after it shifted), or, with both splits, val was blamed."""
    first, second = _lose_a_class_and_an_image(root_copy)
    for split in ("train", "both"):
        refused = vitctl("data", "shard", root_copy, "--out", tmp_path / "s", "--split", split, "--maxcount", 16)
        assert refused.exit_code == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert (f"error: {root_copy / 'train'}: lost since `vitctl data extract` wrote it: class folder {first} is "
                f"missing; class {second} holds {TRAIN_PER_CLASS - 1} of its {TRAIN_PER_CLASS} images: sharding would "
                "leave them out") in refused.stderr, refused.stderr
        assert not (tmp_path / "s").exists()
    fix = refused.stderr.split("fix: rerun `", 1)[1].split("`", 1)[0]
    assert fix.startswith("vitctl data extract --train-tar ")
    ok(*shlex.split(fix)[1:])
    assert len(list((root_copy / "train" / second).glob("*.JPEG"))) == TRAIN_PER_CLASS
    ok("data", "shard", root_copy, "--out", tmp_path / "s", "--maxcount", 16)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert len(manifest["classes"]) == CLASSES
    assert sum(e["samples"] for e in manifest["splits"]["train"]["shards"]) == CLASSES * TRAIN_PER_CLASS


def test_val_images_lost_since_extract_are_refused_and_the_fix_brings_them_back(root_copy, tmp_path):
    """Before: val was sharded with the images left, and every evaluation scored part of the val set unsaid."""
    val_images = sorted((root_copy / "val").glob("*/*.JPEG"))
    val_images[0].unlink()
    refused = vitctl("data", "shard", root_copy, "--out", tmp_path / "s", "--maxcount", 16)
    assert refused.exit_code == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert (f"error: {root_copy / 'val'}: val holds {len(val_images) - 1} of the {len(val_images)} images `vitctl "
            "data extract` wrote: 1 was lost since") in refused.stderr, refused.stderr
    assert not (tmp_path / "s").exists()
    remove, extract, valprep = re.findall(r"`([^`]+)`", refused.stderr.split("fix: ", 1)[1])[:3]
    assert shlex.split(remove)[:2] == ["rm", "-r"]
    shutil.rmtree(shlex.split(remove)[2])
    for command in (extract, valprep):
        assert command.startswith("vitctl data ")
        ok(*shlex.split(command)[1:])
    assert sorted(p.relative_to(root_copy) for p in (root_copy / "val").glob("*/*.JPEG")) == \
        [p.relative_to(root_copy) for p in val_images]
    ok("data", "shard", root_copy, "--out", tmp_path / "s", "--maxcount", 16)


def test_the_fixes_for_lost_images_quote_a_root_whose_path_holds_a_space(prepared_root, tmp_path):
    """Each command the fixes name parses back, in bash, to the root's own path and runs there (they printed it
    unquoted: pasted, `--out /x/my imagenet` reached extract as two arguments)."""
    root = Path(shutil.copytree(prepared_root, tmp_path / "my imagenet"))
    _lose_a_class_and_an_image(root)
    refused = vitctl("data", "shard", root, "--out", tmp_path / "s", "--split", "train", "--maxcount", 16)
    assert refused.exit_code == 1 and "lost since `vitctl data extract` wrote it" in refused.stderr, refused.stderr
    extract = shlex.split(refused.stderr.split("fix: rerun `", 1)[1].split("`", 1)[0])
    assert extract[:4] == ["vitctl", "data", "extract", "--train-tar"] and extract[5:] == ["--out", str(root)]
    ok(*extract[1:])
    min((root / "val").glob("*/*.JPEG")).unlink()
    refused = vitctl("data", "shard", root, "--out", tmp_path / "s", "--maxcount", 16)
    assert refused.exit_code == 1 and "1 was lost since" in refused.stderr, refused.stderr
    remove, extract, valprep = re.findall(r"`([^`]+)`", refused.stderr.split("fix: ", 1)[1])[:3]
    assert shlex.split(remove) == ["rm", "-r", str(root / "val")]
    subprocess.run(["bash", "-c", remove], check=True)  # as pasted into a shell
    assert not (root / "val").exists() and root.is_dir()
    extract, valprep = shlex.split(extract), shlex.split(valprep)
    assert extract[:4] == ["vitctl", "data", "extract", "--val-tar"] and extract[5:] == ["--out", str(root)]
    assert valprep[:4] == ["vitctl", "data", "valprep", str(root / "val")] and valprep[4] == "--devkit"
    ok(*extract[1:])
    ok(*valprep[1:])
    ok("data", "shard", root, "--out", tmp_path / "s", "--maxcount", 16)


def test_a_tree_extract_did_not_write_is_sharded_with_what_it_holds(root_copy, tmp_path):
    (root_copy / LEDGER).unlink()
    _lose_a_class_and_an_image(root_copy)
    ok("data", "shard", root_copy, "--out", tmp_path / "s", "--split", "train", "--maxcount", 16)
    assert len(json.loads((tmp_path / "s" / "manifest.json").read_text())["classes"]) == CLASSES - 1


def test_a_val_split_stopped_midway_is_refused_before_launch_and_its_fix_finishes_it(shards_copy, tmp_path):
    """As a killed `shard --split val` leaves it. Before, training went on and skipped every evaluation."""
    def stopped_after_one(manifest: dict) -> None:
        manifest["splits"]["val"].update(complete=False)
        (shards_copy / manifest["splits"]["val"]["shards"].pop()["name"]).unlink()

    _edit_manifest(shards_copy, stopped_after_one)
    refused = vitctl("train", "--config", "demo_vit", "--data", shards_copy, "--out", tmp_path / "cli", "--executor",
                     "local", "--gpus", 0, "--set", f"model.num_classes={CLASSES}")
    assert refused.exit_code == 1 and "the val split is incomplete (1 of 2 shards" in refused.stderr, refused.stderr
    assert not (tmp_path / "cli").exists()  # refused before launch
    with pytest.raises(ConfigError, match=r"the val split is incomplete \(1 of 2 shards recorded\); finish it with `"
                       ) as raised:
        train(tiny(shards_copy, tmp_path / "run", "train.max_steps=1"))
    fix = str(raised.value).split("finish it with `", 1)[1].split("`")[0]
    _follow([shlex.split(part) for part in fix.split(" && ")])
    ok("data", "verify", shards_copy)
    train(tiny(shards_copy, tmp_path / "run", "train.max_steps=1"))


def test_a_shard_folder_without_a_val_split_trains_without_evaluation(shards_copy, tmp_path):
    _edit_manifest(shards_copy, lambda m: m["splits"].pop("val"))
    for shard in shards_copy.glob("imagenet-val-*"):
        shard.unlink()
    train(tiny(shards_copy, tmp_path / "run", "train.max_steps=1"))


def test_a_shard_of_both_splits_stopped_in_train_is_finished_by_verify_s_fix_val_included(prepared_root, tmp_path,
                                                                                          monkeypatch):
    """Before, val was not in the manifest yet: verify's fix sharded train alone, and verify then said OK."""
    out, written = tmp_path / "s", []

    def stops_at_the_second(*args):
        if written:
            raise DataError("stopped here, as a kill would", str(out))
        written.append(args)
        return real_write_shard(*args)

    real_write_shard = shard_module.write_shard
    monkeypatch.setattr(shard_module, "write_shard", stops_at_the_second)
    assert vitctl("data", "shard", prepared_root, "--out", out, "--maxcount", 16, "--workers", 1).exit_code == 1
    monkeypatch.undo()
    verified = vitctl("data", "verify", out)
    assert verified.exit_code == 1 and "split val: incomplete: 0 of 2 shards written" in verified.output
    _follow(_fix_commands(verified.output))
    ok("data", "verify", out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert all(manifest["splits"][split]["complete"] for split in ("train", "val"))


def test_a_shard_folder_gone_since_launch_is_named_gone_not_unprepared(tmp_path):
    """A job's ranks read data.path after launch checked it; deleted or moved since, it was told to be prepared with
    `vitctl data shard` and `index`."""
    with pytest.raises(ConfigError) as gone:
        split_shards(tmp_path / "shards", "train")
    assert str(gone.value) == (f"data.path {tmp_path / 'shards'} does not exist (moved or deleted?); put the shards "
                               "back there, or give their new place as --data (with --resume, a run goes on from its "
                               "last checkpoint)")
    (tmp_path / "shards").mkdir()  # there, but no shard folder
    with pytest.raises(ConfigError, match="no manifest.json; prepare it with `vitctl data shard` and `index`"):
        split_shards(tmp_path / "shards", "train")
