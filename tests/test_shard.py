import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from PIL import Image

from conftest import CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS, ok, vitctl
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


def test_ctrl_c_halfway_leaves_only_complete_shards_and_a_rerun_finishes(prepared_root, tmp_path):
    out = tmp_path / "s"
    args = [VITCTL, "data", "shard", str(prepared_root), "--out", str(out), "--maxcount", "1", "--workers", "2"]
    proc = subprocess.Popen(args, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list(out.glob("imagenet-train-*.tar")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    proc.wait(timeout=60)
    written = sorted(out.glob("imagenet-*.tar"))
    total = CLASSES * (TRAIN_PER_CLASS + VAL_PER_CLASS)
    assert proc.returncode != 0 and 0 < len(written) < total, "interrupt came too late to test anything"
    recorded = {e["name"]: e for e in _manifest(out)["splits"]["train"]["shards"]}
    for shard in written:
        scan_path(shard)  # every file under a shard name is a whole tar, end marker included
        if shard.name in recorded:
            assert hashlib.sha256(shard.read_bytes()).hexdigest() == recorded[shard.name]["sha256"]
    ok("data", "shard", prepared_root, "--out", out, "--maxcount", 1, "--workers", 2)
    ok("data", "shard", prepared_root, "--out", tmp_path / "clean", "--maxcount", 1, "--workers", 2)
    assert _shard_bytes(out) == _shard_bytes(tmp_path / "clean")
    assert not list(out.glob(".*"))


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
    assert result.exit_code == 1 and "other sources or settings" in result.stderr
    assert _shard_bytes(shards_copy) == before


def test_val_before_valprep_is_a_clear_error(archives, tmp_path):
    from vitctl.datasets.synth import TRAIN_TAR, VAL_TAR

    root = tmp_path / "r"
    ok("data", "extract", "--train-tar", archives / TRAIN_TAR, "--val-tar", archives / VAL_TAR, "--out", root)
    result = vitctl("data", "shard", root, "--out", tmp_path / "s", "--split", "val")
    assert result.exit_code == 1 and "vitctl data valprep" in result.stderr


@pytest.mark.parametrize("size", ["1XB", "lots"])
def test_bad_maxsize_is_a_usage_error(prepared_root, tmp_path, size):
    result = vitctl("data", "shard", prepared_root, "--out", tmp_path / "s", "--maxsize", size)
    assert result.exit_code == 2 and "is not a size" in result.stderr
