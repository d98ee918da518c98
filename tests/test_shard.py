import errno
import hashlib
import json
import multiprocessing
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from PIL import Image

from conftest import CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS, live_children, ok, survivors_of_killing, vitctl
from vitctl.datasets import manifest as manifest_module
from vitctl.datasets import parallel
from vitctl.datasets import shard as shard_module
from vitctl.datasets.extract import LEDGER
from vitctl.datasets.tarscan import scan_path

VITCTL = str(Path(sys.executable).parent / "vitctl")


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("imagenet-*.tar"))}


def _samples(shard: Path) -> list[dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(shard) as tar:
        for m in tar.getmembers():
            key, ext = m.name.split(".", 1)
            samples.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return list(samples.values())


def test_shards_are_plain_ustar_with_cls_jpg_json_per_dot_free_key(prepared_shards):
    names = sorted(p.name for p in prepared_shards.glob("*.tar"))
    assert names == [f"imagenet-train-{i:06d}.tar" for i in range(4)] + ["imagenet-val-000000.tar",
                                                                           "imagenet-val-000001.tar"]
    for name in names:
        with tarfile.open(prepared_shards / name) as tar:
            infos = tar.getmembers()
        assert all(i.type == tarfile.REGTYPE and not i.pax_headers and i.mtime == 0 for i in infos)
        assert all(i.name.count(".") == 1 for i in infos)
        exts = [i.name.split(".")[1] for i in infos]
        assert exts == ["cls", "jpg", "json"] * (len(infos) // 3)
        raw = (prepared_shards / name).read_bytes()
        assert b"ustar\x0000" in raw[257:265]
        assert all(raw[i.offset:i.offset + 512][156:157] == b"0" for i in infos)  # no PAX 'x' headers anywhere


def test_every_source_image_is_in_the_shards_with_its_sorted_wnid_label(prepared_shards, prepared_root):
    manifest = _manifest(prepared_shards)
    classes = manifest["classes"]
    assert manifest["label_convention"] == "sorted-wnid-index" and classes == sorted(classes)
    converted = {c["source"] for _, info in manifest["splits"].items() for s in info["shards"]
                 for c in s["conversions"]}
    seen = {}
    for shard in sorted(prepared_shards.glob("*.tar")):
        for sample in _samples(shard):
            meta = json.loads(sample["json"])
            assert int(sample["cls"]) == classes.index(meta["wnid"])
            assert meta["source"].split("/")[1] == meta["wnid"]
            source = (prepared_root / meta["source"]).read_bytes()
            if meta["source"] in converted:
                assert sample["jpg"] != source
            else:
                assert sample["jpg"] == source
            seen[meta["source"]] = shard.name
    assert len(seen) == CLASSES * (TRAIN_PER_CLASS + VAL_PER_CLASS)
    assert {s.split("/")[0] for s in seen} == {"train", "val"}


def test_png_cmyk_and_grayscale_become_rgb_jpeg_and_are_recorded(prepared_shards):
    import io

    conversions = [c for s in _manifest(prepared_shards)["splits"]["train"]["shards"] for c in s["conversions"]]
    assert sorted(c["conversion"] for c in conversions) == [
        "jpeg CMYK -> RGB JPEG", "jpeg L -> RGB JPEG", "png RGB -> RGB JPEG"]
    sources = {c["source"] for c in conversions}
    for shard in prepared_shards.glob("imagenet-train-*.tar"):
        for sample in _samples(shard):
            if json.loads(sample["json"])["source"] in sources:
                with Image.open(io.BytesIO(sample["jpg"])) as image:
                    assert (image.format, image.mode) == ("JPEG", "RGB")


def test_manifest_records_count_bytes_and_sha256_of_each_shard(prepared_shards):
    for info in _manifest(prepared_shards)["splits"].values():
        assert info["complete"] and info["planned_shards"] == len(info["shards"])
        for entry in info["shards"]:
            raw = (prepared_shards / entry["name"]).read_bytes()
            assert entry["bytes"] == len(raw) and entry["sha256"] == hashlib.sha256(raw).hexdigest()
            assert entry["samples"] == len(_samples(prepared_shards / entry["name"])) and entry["samples"] <= 16


def test_same_seed_gives_identical_bytes_and_another_seed_another_order(prepared_root, tmp_path, prepared_shards):
    ok("data", "shard", prepared_root, "--out", tmp_path / "a", "--maxcount", 16, "--workers", 1)
    assert _shard_bytes(tmp_path / "a") == _shard_bytes(prepared_shards)  # 1 worker == 2 workers
    ok("data", "shard", prepared_root, "--out", tmp_path / "b", "--maxcount", 16, "--seed", 1, "--split", "train")
    assert _shard_bytes(tmp_path / "b")["imagenet-train-000000.tar"] != _shard_bytes(prepared_shards)[
        "imagenet-train-000000.tar"]


def test_maxsize_cuts_shards_by_bytes(prepared_root, tmp_path):
    ok("data", "shard", prepared_root, "--out", tmp_path / "s", "--split", "train", "--maxsize", "64KB")
    sizes = [p.stat().st_size for p in (tmp_path / "s").glob("*.tar")]
    assert len(sizes) > 3 and max(sizes) <= 64_000


def test_truncated_jpeg_is_skipped_and_recorded(root_copy, tmp_path):
    victim = sorted((root_copy / "train").glob("*/*.JPEG"))[5]
    raw = victim.read_bytes()
    victim.write_bytes(raw[: len(raw) // 2])
    ok("data", "shard", root_copy, "--out", tmp_path / "s", "--split", "train")
    info = _manifest(tmp_path / "s")["splits"]["train"]
    skipped = [s for e in info["shards"] for s in e["skipped"]]
    source = str(victim.relative_to(root_copy))
    assert skipped == [{"source": source, "reason": "truncated JPEG (no end-of-image marker)"}]
    assert sum(e["samples"] for e in info["shards"]) == CLASSES * TRAIN_PER_CLASS - 1


@pytest.mark.parametrize("split, why", [("train", "its label would train on nothing"),
                                        ("val", "the evaluation would leave the class out")])
def test_a_class_whose_every_image_is_unreadable_is_refused_and_replacing_them_works(root_copy, tmp_path, split, why):
    """Before: exit 0 and verify OK, with the class's label in the model and no sample of it in the shards (val:
    "skipped 4 unreadable images", and the evaluation without that class)."""
    images = sorted((root_copy / split).iterdir())[1].glob("*.JPEG")
    originals = {image: image.read_bytes() for image in images}
    for image in originals:
        image.write_bytes(b"")
    result = vitctl("data", "shard", root_copy, "--out", tmp_path / "s", "--split", split, "--maxcount", 4)
    wnid = next(iter(originals)).parent.name
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
    assert (f"every {split} image of class {wnid} is unreadable, so {why}: "
            f"{split}/{wnid}/") in result.stderr and "(empty file (0 bytes))" in result.stderr
    assert not _manifest(tmp_path / "s")["splits"][split]["complete"]  # nothing takes it for a finished split
    assert vitctl("data", "verify", tmp_path / "s").exit_code == 1
    for image, raw in originals.items():  # the fix
        image.write_bytes(raw)
    ok("data", "shard", root_copy, "--out", tmp_path / "new", "--split", split, "--maxcount", 4)


def test_a_val_split_without_some_train_classes_is_sharded(root_copy, tmp_path):
    """A class that val/ lacks altogether is no class lost to unreadable images."""
    shutil.move(sorted((root_copy / "val").iterdir())[1], tmp_path / "moved")
    (root_copy / LEDGER).unlink()  # else shard refuses the val images lost since extract
    ok("data", "shard", root_copy, "--out", tmp_path / "s", "--split", "val")


def test_truncated_jpeg_with_fail_policy_stops_naming_the_file(root_copy, tmp_path):
    victim = sorted((root_copy / "train").glob("*/*.JPEG"))[5]
    victim.write_bytes(victim.read_bytes()[:300])
    result = vitctl("data", "shard", root_copy, "--out", tmp_path / "s", "--on-bad-image", "fail")
    assert result.exit_code == 1 and str(victim.relative_to(root_copy)) in result.stderr
    assert "--on-bad-image skip" in result.stderr
    assert not _manifest(tmp_path / "s")["splits"]["train"]["complete"]
    assert not list((tmp_path / "s").glob(".*.partial"))


def test_rerun_redoes_only_missing_or_partial_shards(prepared_shards, shards_copy, prepared_root):
    lost = shards_copy / "imagenet-train-000002.tar"
    lost.unlink()
    (shards_copy / ".imagenet-train-000002.tar.partial").write_bytes(b"half a shard")
    kept = shards_copy / "imagenet-train-000001.tar"
    kept_mtime = kept.stat().st_mtime_ns
    ok("data", "shard", prepared_root, "--out", shards_copy, "--maxcount", 16)
    assert kept.stat().st_mtime_ns == kept_mtime
    assert _shard_bytes(shards_copy) == _shard_bytes(prepared_shards)
    assert not list(shards_copy.glob(".*"))
    assert not (shards_copy / "imagenet-train-000002.idx").exists()  # its index was stale, so removed


def test_a_rerun_over_finished_shards_writes_nothing_so_a_read_only_copy_checks(prepared_root, shards_copy):
    """Before: `.manifest.json.partial: operation not permitted`, though there was nothing to write."""
    if subprocess.run(["chattr", "+i", shards_copy], capture_output=True).returncode:
        pytest.skip("chattr +i is not available on this filesystem")
    try:
        result = vitctl("data", "shard", prepared_root, "--out", shards_copy, "--maxcount", 16)
    finally:
        subprocess.run(["chattr", "-i", shards_copy], check=True)
    assert result.exit_code == 0, result.stderr
    assert re.search(r"train: kept all \d+ shards an earlier run wrote", result.output), result.output


def test_a_rerun_that_keeps_a_split_s_one_shard_says_so_in_the_singular(prepared_root, tmp_path):
    """Before: `kept all 1 shards`."""
    ok("data", "shard", prepared_root, "--out", tmp_path / "s", "--maxcount", 100_000)
    said = ok("data", "shard", prepared_root, "--out", tmp_path / "s", "--maxcount", 100_000).output
    assert "train: kept the one shard an earlier run wrote (each checked against its recorded sha256)" in \
        " ".join(said.split()), said


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGHUP, signal.SIGTERM])
def test_ctrl_c_halfway_leaves_only_complete_shards_and_a_rerun_finishes(prepared_root, tmp_path, stop):
    """SIGHUP (a closed terminal) and SIGTERM (`kill`, a batch system's stop) as Ctrl-C: before, each killed vitctl
    and its workers at once (exit 129 or 143, no word, their temporary files left)."""
    out = tmp_path / "s"
    args = [VITCTL, "data", "shard", str(prepared_root), "--out", str(out), "--maxcount", "1", "--workers", "2"]
    proc = subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list(out.glob("imagenet-train-*.tar")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, stop)  # what Ctrl-C in a terminal, or its hangup, does: the whole process group
    err = proc.communicate(timeout=60)[1].decode()
    written = sorted(out.glob("imagenet-*.tar"))
    total = CLASSES * (TRAIN_PER_CLASS + VAL_PER_CLASS)
    assert 0 < len(written) < total, "interrupt came too late to test anything"
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err, err
    assert not list(out.glob(".*.partial"))  # the writers the interrupt stopped removed their temporary files
    recorded = {e["name"]: e for e in _manifest(out)["splits"]["train"]["shards"]}
    for shard in written:
        scan_path(shard)  # every file under a shard name is a whole tar, end marker included
        if shard.name in recorded:
            assert hashlib.sha256(shard.read_bytes()).hexdigest() == recorded[shard.name]["sha256"]
    ok("data", "shard", prepared_root, "--out", out, "--maxcount", 1, "--workers", 2)
    ok("data", "shard", prepared_root, "--out", tmp_path / "clean", "--maxcount", 1, "--workers", 2)
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "clean")
    assert not list(out.glob(".*"))


def test_sigterm_stops_a_data_command_started_in_the_background(prepared_root, tmp_path):
    """`cmd &` in a script starts it with SIGINT ignored: before, SIGTERM, passed on as SIGINT, then did nothing, and
    the command went on to the end."""
    out = tmp_path / "s"
    args = [VITCTL, "data", "shard", str(prepared_root), "--out", str(out), "--maxcount", "1", "--workers", "2"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    deadline = time.monotonic() + 60
    while not list(out.glob("imagenet-train-*.tar")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # `kill PID`: vitctl alone, not its workers
    err = proc.communicate(timeout=60)[1].decode()
    assert 0 < len(list(out.glob("imagenet-*.tar"))) < CLASSES * (TRAIN_PER_CLASS + VAL_PER_CLASS), "too late"
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err
    assert not list(out.glob(".*.partial"))
    ok("data", "shard", prepared_root, "--out", out, "--maxcount", 1, "--workers", 2)


def test_folder_with_foreign_files_is_refused_and_left_alone(prepared_root, tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    (out / "imagenet-train-000000.tar").write_bytes(b"someone else's shard")
    result = vitctl("data", "shard", prepared_root, "--out", out)
    assert result.exit_code == 1 and "files vitctl did not write: imagenet-train-000000.tar" in result.stderr
    assert (out / "imagenet-train-000000.tar").read_bytes() == b"someone else's shard"
    assert sorted(p.name for p in out.iterdir()) == ["imagenet-train-000000.tar"]


def test_other_settings_into_the_same_folder_are_refused(prepared_root, shards_copy):
    before = _shard_bytes(shards_copy)
    result = vitctl("data", "shard", prepared_root, "--out", shards_copy, "--maxcount", 16, "--seed", 3)
    assert result.exit_code == 1 and "train shards here were made with other settings: --seed 3 (this folder's: 0)" \
        in result.stderr
    assert _shard_bytes(shards_copy) == before
    command = shlex.split(result.stderr.split("go on with this folder's settings: ")[1])
    assert command[:3] == ["vitctl", "data", "shard"]
    assert command[command.index("--split") + 1] == "both"  # what was asked (before: train, and val was left out)
    ok(*command[1:])
    assert _shard_bytes(shards_copy) == before
    result = vitctl("data", "shard", prepared_root, "--out", shards_copy, "--split", "val", "--seed", 3)
    assert "val shards here were made with other settings" in result.stderr and "--split val " in result.stderr


def test_other_images_under_the_same_settings_are_refused(root_copy, shards_copy):
    image = next((root_copy / "val").glob("*/*.JPEG"))
    shutil.copy(image, image.with_name("ILSVRC2012_val_00099999.JPEG"))  # (one lost is refused as lost)
    result = vitctl("data", "shard", root_copy, "--out", shards_copy, "--maxcount", 16, "--split", "val")
    assert result.exit_code == 1 and "val shards here were made from other images" in result.stderr
    source = json.loads((shards_copy / "manifest.json").read_text())["splits"]["val"]["source"]
    assert (f"from {source}, and this run reads {root_copy}" in result.stderr  # named: another root, not changed
            and f"shard into a new --out folder (or, to go on with this one, shard {source} into it)" in result.stderr)
    ok("data", "shard", source, "--out", shards_copy, "--maxcount", 16, "--split", "val")


def test_the_dataset_root_as_out_is_refused(root_copy):
    """Before: `holds files vitctl did not write: .vitctl-extract.json, train, val`, fix: move those away."""
    result = vitctl("data", "shard", root_copy, "--out", root_copy)
    assert result.exit_code == 1 and "is the dataset root itself" in result.stderr, result.stderr
    ok("data", "shard", root_copy, "--out", root_copy / "shards", "--maxcount", 16)  # the --out it names


def test_val_before_valprep_is_a_clear_error(archives, tmp_path):
    from vitctl.datasets.synth import TRAIN_TAR, VAL_TAR

    root = tmp_path / "r"
    ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--val-tar", archives / VAL_TAR, "--out", root)
    result = vitctl("data", "shard", root, "--out", tmp_path / "s", "--split", "val")
    assert result.exit_code == 1 and "vitctl data valprep" in result.stderr
    assert not (tmp_path / "s").exists()  # the input is checked before the output folder is made


@pytest.mark.parametrize("size", ["1XB", "lots"])
def test_bad_maxsize_is_a_usage_error(prepared_root, tmp_path, size):
    result = vitctl("data", "shard", prepared_root, "--out", tmp_path / "s", "--maxsize", size)
    assert result.exit_code == 2 and "is not a size" in result.stderr


def _damage_one_image(root: Path) -> Path:
    victim = sorted((root / "train").glob("*/*.JPEG"))[5]
    victim.write_bytes(b"not an image at all")
    return victim


def test_a_damaged_shard_of_the_same_size_is_written_again(prepared_shards, shards_copy, prepared_root):
    shard = shards_copy / "imagenet-train-000002.tar"
    raw = bytearray(shard.read_bytes())
    raw[3000] ^= 0xFF
    shard.write_bytes(bytes(raw))
    kept = shards_copy / "imagenet-train-000001.tar"
    kept_mtime = kept.stat().st_mtime_ns
    result = ok("data", "shard", prepared_root, "--out", shards_copy, "--maxcount", 16)
    assert "train: wrote again 1 shard that was missing or did not match the recorded sha256: " \
           "imagenet-train-000002.tar" in result.output
    total = len(json.loads((shards_copy / "manifest.json").read_text())["splits"]["train"]["shards"])
    assert f"train: kept {total - 1} of {total} shards an earlier run wrote (each checked against its recorded " \
           "sha256)" in result.output, result.output  # before, nothing said which were kept
    assert _shard_bytes(shards_copy) == _shard_bytes(prepared_shards)
    assert kept.stat().st_mtime_ns == kept_mtime
    assert not (shards_copy / "imagenet-train-000002.idx").exists()  # the index of the damaged shard is stale


def test_an_image_edited_in_place_keeping_its_size_has_its_shard_written_again(root_copy, tmp_path):
    """Before: the plan holds each image's size, so a rerun after a same-size edit kept the shard with the old bytes."""
    out = tmp_path / "s"
    ok("data", "shard", root_copy, "--out", out, "--split", "train", "--maxcount", 16)
    before = _shard_bytes(out)
    victim = sorted((root_copy / "train").glob("*/*.JPEG"))[5]
    edited = bytearray(victim.read_bytes())
    edited[-40] ^= 0x01  # in the scan data: the same size, still a JPEG shard takes as it is
    victim.write_bytes(bytes(edited))
    os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 2_000_000_000))
    holder = next(name for name in before if any(
        json.loads(s["json"])["source"] == f"train/{victim.parent.name}/{victim.name}" for s in _samples(out / name)))
    result = ok("data", "shard", root_copy, "--out", out, "--split", "train", "--maxcount", 16)
    assert (f"train: wrote again 1 shard whose images changed since they were written (their modification times): "
            f"{holder}") in result.output, result.output
    assert bytes(edited) in [s["jpg"] for s in _samples(out / holder)]
    after = _shard_bytes(out)
    assert after[holder] != before[holder] and {n: b for n, b in after.items() if n != holder} == \
        {n: b for n, b in before.items() if n != holder}
    again = ok("data", "shard", root_copy, "--out", out, "--split", "train", "--maxcount", 16)
    assert "wrote again" not in again.output, again.output  # recorded with its new time


def test_a_file_that_is_no_image_is_named_as_such(root_copy, tmp_path):
    """Before: notes.txt in a class folder was `unreadable image`; x.JPEG.bak beside x.JPEG `two images share the key
    'x'`, not saying what a key is."""
    image = next((root_copy / "train").glob("*/*.JPEG"))
    (image.parent / "notes.txt").write_text("to do")
    result = ok("data", "shard", root_copy, "--out", tmp_path / "a", "--split", "train")
    assert f"  train/{image.parent.name}/notes.txt: not an image (a .txt file, in no format Pillow reads)" \
        in result.output, result.output
    shutil.copy(image, f"{image}.bak")
    refused = vitctl("data", "shard", root_copy, "--out", tmp_path / "b", "--split", "train")
    assert refused.exit_code == 1 and (f"two images share the key {image.stem!r} (a sample's key is its file name up "
                                       "to the first dot)") in refused.stderr, refused.stderr
    assert "move out the one that is not an image (a .bak copy)" in refused.stderr


def test_skipped_images_are_named_and_their_reasons_reproducible(root_copy, tmp_path):
    victim = _damage_one_image(root_copy)
    source = str(victim.relative_to(root_copy))
    result = ok("data", "shard", root_copy, "--out", tmp_path / "a", "--split", "train")
    assert f"train: skipped 1 unreadable image (all listed under \"skipped\" in {tmp_path / 'a'}" in result.output
    assert f"  {source}: unreadable image (not in any format Pillow reads)" in result.output
    ok("data", "shard", root_copy, "--out", tmp_path / "b", "--split", "train")
    manifests = [(tmp_path / name / "manifest.json").read_text() for name in "ab"]
    assert manifests[0] == manifests[1] and "0x" not in manifests[0]


def test_fail_policy_advice_works_when_followed(root_copy, tmp_path):
    _damage_one_image(root_copy)
    out = tmp_path / "s"
    result = vitctl("data", "shard", root_copy, "--out", out, "--maxcount", 8, "--on-bad-image", "fail")
    assert result.exit_code == 1 and "rerun the same command with --on-bad-image skip" in result.stderr
    ok("data", "shard", root_copy, "--out", out, "--maxcount", 8, "--on-bad-image", "skip")
    ok("data", "shard", root_copy, "--out", tmp_path / "clean", "--maxcount", 8)
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "clean")
    assert _manifest(out)["splits"]["train"]["on_bad_image"] == "skip"


def test_a_shard_whose_every_image_is_unreadable_is_never_written(root_copy, tmp_path):
    victim = _damage_one_image(root_copy)
    out = tmp_path / "s"
    result = vitctl("data", "shard", root_copy, "--out", out, "--maxcount", 1, "--split", "train")
    assert result.exit_code == 1 and "is unreadable, and no shard may be empty" in result.stderr
    assert str(victim.relative_to(root_copy)) in result.stderr
    assert all(entry["samples"] > 0 for entry in _manifest(out)["splits"]["train"]["shards"])
    assert not list(out.glob(".*.partial"))
    victim.unlink()  # what the message says to do, then into a new folder
    command = ["data", "shard", root_copy, "--out", tmp_path / "new", "--maxcount", 1, "--split", "train"]
    refused = vitctl(*command)  # extract recorded the image: the rerun it names brings back the undamaged one
    assert refused.exit_code == 1 and f"class {victim.parent.name} holds" in refused.stderr, refused.stderr
    ok(*shlex.split(refused.stderr.split("fix: rerun `", 1)[1].split("`", 1)[0])[1:])
    ok(*command)
    (root_copy / LEDGER).rename(tmp_path / LEDGER)  # the other way: shard the tree without the image
    victim.unlink()
    ok(*command[:3], "--out", tmp_path / "without", *command[5:])
    ok("data", "index", tmp_path / "new")


@pytest.mark.parametrize(("make", "message", "follow_fix"), [
    (lambda c: (c / "my image.JPEG").write_bytes((next(c.iterdir())).read_bytes()),
     "its sample key 'my image' (the name up to the first dot) holds whitespace",
     lambda c: (c / "my image.JPEG").rename(c / "my_image.JPEG")),
    (lambda c: (c / "sub").mkdir(), "a folder inside a class folder", lambda c: (c / "sub").rmdir()),
    (lambda c: (c / "gone.JPEG").symlink_to(c / "nowhere"), "a broken symbolic link (to ",
     lambda c: (c / "gone.JPEG").unlink()),
    (lambda c: os.mkfifo(c / "pipe.JPEG"), "not a regular file", lambda c: (c / "pipe.JPEG").unlink()),
    (lambda c: (c / ("k" * 96 + ".JPEG")).write_bytes(b""), "sample key (the name up to the first dot) is 96 bytes",
     lambda c: (c / ("k" * 96 + ".JPEG")).rename(c / "short.JPEG")),
])
def test_names_and_entries_a_shard_cannot_hold_are_refused_up_front(root_copy, tmp_path, make, message, follow_fix):
    class_dir = next((root_copy / "train").iterdir())
    make(class_dir)
    out = tmp_path / "s"
    result = vitctl("data", "shard", root_copy, "--out", out)
    assert result.exit_code == 1 and message in result.stderr and str(class_dir) in result.stderr
    assert not list(out.glob("*.tar"))
    follow_fix(class_dir)
    ok("data", "shard", root_copy, "--out", out, "--split", "train")
    ok("data", "index", out)


def test_hidden_files_and_a_finished_class_left_partial_are_ignored(root_copy, prepared_shards, tmp_path):
    class_dir = next((root_copy / "train").iterdir())
    (class_dir / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (root_copy / "train" / f".{class_dir.name}.partial").mkdir()
    ok("data", "shard", root_copy, "--out", tmp_path / "s", "--maxcount", 16)
    assert _shard_bytes(tmp_path / "s") == _shard_bytes(prepared_shards)


def test_a_class_an_interrupted_extract_left_partial_is_refused_until_extract_finishes(archives, tmp_path):
    from vitctl.datasets.synth import TRAIN_TAR

    root = tmp_path / "r"
    ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--out", root)
    wnid = sorted(p.name for p in (root / "train").iterdir())[2]
    (root / "train" / wnid).rename(root / "train" / f".{wnid}.partial")  # where extract writes a class
    result = vitctl("data", "shard", root, "--out", tmp_path / "s", "--split", "train")
    assert result.exit_code == 1 and f"class {wnid} is not completely extracted" in result.stderr
    assert "rerun that `vitctl data extract` command" in result.stderr
    ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--out", root)
    ok("data", "shard", root, "--out", tmp_path / "s", "--split", "train")
    assert wnid in _manifest(tmp_path / "s")["classes"]


@pytest.mark.parametrize(("blocker", "out", "kind"), [("file", "file/shards", "a file"),
                                                     ("link", "link", "a broken symbolic link")])
def test_an_out_folder_that_cannot_be_made_is_a_clear_error(prepared_root, tmp_path, blocker, out, kind):
    if blocker == "file":
        (tmp_path / blocker).write_text("x")
    else:
        (tmp_path / blocker).symlink_to(tmp_path / "nowhere")
    result = vitctl("data", "shard", prepared_root, "--out", tmp_path / out)
    assert result.exit_code == 1 and f"{tmp_path / blocker} is {kind}, not a folder" in result.stderr
    assert "choose another --out" in result.stderr


def _write_fails(monkeypatch, error: OSError, after_bytes: int) -> None:
    """Inject `error` at the shard writer's write once `after_bytes` are written (one worker: in this process)."""
    written = 0
    real_write = shard_module._HashingFile.write

    def write(self, data: bytes) -> None:
        nonlocal written
        written += len(data)
        if written > after_bytes:
            raise error
        real_write(self, data)

    monkeypatch.setattr(shard_module._HashingFile, "write", write)


def test_a_full_disk_stops_cleanly_and_a_rerun_finishes(prepared_root, prepared_shards, tmp_path, monkeypatch):
    out = tmp_path / "s"
    _write_fails(monkeypatch, OSError(errno.ENOSPC, "No space left on device"), after_bytes=150_000)
    result = vitctl("data", "shard", prepared_root, "--out", out, "--maxcount", 16, "--workers", 1)
    assert result.exit_code == 1 and f"{out}: no space left on the device" in result.stderr
    assert "rerun the same command: it keeps what is finished" in result.stderr
    assert 0 < len(_manifest(out)["splits"]["train"]["shards"]) < 4 and not list(out.glob(".*.partial"))
    monkeypatch.undo()
    ok("data", "shard", prepared_root, "--out", out, "--maxcount", 16, "--workers", 1)
    assert _shard_bytes(out) == _shard_bytes(prepared_shards)


def test_a_folder_this_user_may_not_write_is_a_clear_error(prepared_root, tmp_path, monkeypatch):
    out = tmp_path / "s"

    def refuse(path, obj):  # what writing into a read-only folder raises (the tests run as root, whom chmod allows)
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(manifest_module, "write_json_atomic", refuse)
    result = vitctl("data", "shard", prepared_root, "--out", out, "--workers", 1)
    assert result.exit_code == 1
    assert f"{out / 'manifest.json'}: permission denied" in result.stderr and "give this user access" in result.stderr


def test_listing_then_the_real_total_show_on_the_progress_bar(prepared_root, tmp_path):
    result = ok("data", "shard", prepared_root, "--out", tmp_path / "s", "--split", "train", "--workers", 1)
    assert "train" in result.stderr and "60/60 samples" in result.stderr and "?" not in result.stderr


def test_more_workers_than_shards_starts_one_process_per_shard(prepared_root, prepared_shards, tmp_path,
                                                               monkeypatch):
    alive = []  # (tasks, worker processes alive) each time a result comes back

    def counting(fn, tasks, workers):
        for result in parallel.run_tasks(fn, tasks, workers):
            alive.append((len(tasks), len(multiprocessing.active_children())))
            yield result

    monkeypatch.setattr(shard_module, "run_tasks", counting)
    # 64, not 100000: were the bound to break, this test must not fork the machine to death.
    ok("data", "shard", prepared_root, "--out", tmp_path / "s", "--maxcount", 16, "--workers", 64)
    assert sorted(set(alive)) == [(2, 2), (4, 4)]  # val's 2 shards, train's 4: a worker each, no more
    assert _shard_bytes(tmp_path / "s") == _shard_bytes(prepared_shards)


# `vitctl data shard` whose shard writers never finish, so that its workers are alive when it is killed.
SHARD_WITH_STUCK_WRITERS = """
import sys, time
from vitctl.cli.data import data
from vitctl.datasets import shard

def write_shard(*args):
    time.sleep(600)

shard.write_shard = write_shard
data(sys.argv[1:], prog_name="vitctl data")
"""


def test_workers_die_with_a_killed_parent(prepared_root, tmp_path):
    args = ["data", "shard", str(prepared_root), "--out", str(tmp_path / "s"), "--workers", "2", "--maxcount", "16"]
    proc = subprocess.Popen([sys.executable, "-c", SHARD_WITH_STUCK_WRITERS, *args[1:]], stderr=subprocess.PIPE)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
            workers = live_children(proc.pid)
        assert len(workers) == 2, proc.stderr.read().decode() if proc.poll() is not None else workers
        assert not survivors_of_killing(proc, workers, within=5)
    finally:
        survivors_of_killing(proc, workers, within=0)


def test_a_val_class_train_lacks_is_refused_before_anything_is_written(root_copy, prepared_shards, archives,
                                                                      tmp_path):
    from vitctl.datasets.synth import DEVKIT

    image = next((root_copy / "val").glob("*/*.JPEG"))
    (root_copy / "val/n01440764").mkdir()
    image.rename(root_copy / "val/n01440764" / image.name)  # as valprep with the labels of another dataset sorts it
    out = tmp_path / "s"
    result = vitctl("data", "shard", root_copy, "--out", out, "--maxcount", 16)
    assert result.exit_code == 1
    assert f"{root_copy / 'val'}: class folder n01440764 is not among the {CLASSES} train classes" in result.stderr
    assert f"fix: remove {root_copy / 'val'}, then `vitctl data extract --val-tar " in result.stderr
    assert not out.exists()
    shutil.rmtree(root_copy / "val")
    ok(*shlex.split(result.stderr.split(", then `")[1].split("`")[0])[1:])
    ok("data", "valprep", root_copy / "val", "--devkit", archives / DEVKIT)
    ok("data", "shard", root_copy, "--out", out, "--maxcount", 16)
    assert _shard_bytes(out) == _shard_bytes(prepared_shards)


def test_class_folders_without_images_are_a_clear_error_and_its_fix_works(prepared_root, tmp_path):
    root = tmp_path / "mine"  # the user's own tree, not written by `vitctl data extract`
    classes = sorted(p.name for p in (prepared_root / "train").iterdir())
    for wnid in classes:
        (root / "train" / wnid).mkdir(parents=True)
    out = tmp_path / "s"
    result = vitctl("data", "shard", root, "--out", out)
    assert result.exit_code == 1 and f"{root / 'train'}: no images under train/" in result.stderr
    assert f"fix: put the images into their class folders ({root / 'train'}/<wnid>/<image>)" in result.stderr
    assert not out.exists()
    for wnid in classes:
        for image in (prepared_root / "train" / wnid).iterdir():
            shutil.copy(image, root / "train" / wnid)
    ok("data", "shard", root, "--out", out, "--split", "train")


def test_other_classes_into_the_same_folder_are_named(root_copy, shards_copy):
    (root_copy / LEDGER).unlink()  # shard takes the tree as it is
    gone = sorted((root_copy / "train").iterdir())[0].name
    for split in ("train", "val"):
        shutil.rmtree(root_copy / split / gone)
    result = vitctl("data", "shard", root_copy, "--out", shards_copy, "--maxcount", 16)
    assert result.exit_code == 1 and (f"the {CLASSES - 1} classes under {root_copy} differ from the {CLASSES} this "
                                      f"folder's shards were made with (in one but not the other: {gone})"
                                      ) in result.stderr, result.stderr


def _fix_of(result) -> str:
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr.split("\nfix: ", 1)[1].strip()


def test_a_root_laid_out_otherwise_is_told_what_it_holds_and_the_fix_shards(prepared_root, archives, tmp_path):
    """Before, each of these was `no class folders found under train/ or val/`, with `run vitctl data extract` as
    the fix: for class folders one level too high or low, a shard folder, the archives' folder."""
    flat = tmp_path / "flat"
    shutil.copytree(prepared_root / "train", flat)
    fix = _fix_of(vitctl("data", "shard", flat, "--out", tmp_path / "s1"))
    subprocess.run(re.search(r"\(`(.+)`\)$", fix)[1], shell=True, check=True)
    ok("data", "shard", flat, "--out", tmp_path / "s1", "--split", "train")

    deeper = tmp_path / "deeper"
    shutil.copytree(prepared_root, deeper / "ILSVRC")
    assert _fix_of(vitctl("data", "shard", deeper, "--out", tmp_path / "s2")) == f"pass {deeper / 'ILSVRC'}"

    shards = tmp_path / "s1"
    result = vitctl("data", "shard", shards, "--out", tmp_path / "s3")
    assert "a shard folder (`vitctl data shard` wrote it), not an image root" in result.stderr
    assert _fix_of(result).startswith(f"pass the image root it was sharded from ({flat.resolve()})")

    downloads = Path(shutil.copytree(archives, tmp_path / "downloads"))
    fix = _fix_of(vitctl("data", "shard", downloads, "--out", tmp_path / "s4"))
    command = re.search(r"`vitctl (data extract [^`]+)`", fix)[1]
    assert f"--train-tar {downloads / 'ILSVRC2012_img_train.tar'}" in command
    ok(*shlex.split(command))
    assert (downloads / "imagenet/train").is_dir()
