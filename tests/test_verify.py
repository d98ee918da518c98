import hashlib
import json
import shutil
from pathlib import Path

from conftest import ok, vitctl


def _edit_manifest(shards: Path, edit) -> None:
    manifest = json.loads((shards / "manifest.json").read_text())
    edit(manifest)
    (shards / "manifest.json").write_text(json.dumps(manifest))


def _verify(shards: Path):
    return vitctl("data", "verify", shards, "--decode", 20, "--workers", 2)


def test_clean_shards_verify(prepared_shards):
    result = ok("data", "verify", prepared_shards, "--decode", 1000)
    assert "OK" in result.output and "FAIL" not in result.output


def test_shard_changed_after_indexing_is_caught(shards_copy):
    shard = shards_copy / "imagenet-train-000001.tar"
    raw = bytearray(shard.read_bytes())
    raw[2000] ^= 0xFF  # one flipped bit of image data: same size, different content
    shard.write_bytes(bytes(raw))
    result = _verify(shards_copy)
    assert result.exit_code == 1
    assert "FAIL imagenet-train-000001.tar: sha256 differs from the manifest" in result.output


def test_index_of_another_shard_is_caught(shards_copy):
    shutil.copy(shards_copy / "imagenet-train-000000.idx", shards_copy / "imagenet-train-000001.idx")
    result = _verify(shards_copy)
    assert result.exit_code == 1
    assert "imagenet-train-000001.tar: index imagenet-train-000001.idx line 2" in result.output
    assert "an index of another shard" in result.output


def test_missing_index_and_missing_shard_are_caught(shards_copy):
    (shards_copy / "imagenet-val-000000.idx").unlink()
    (shards_copy / "imagenet-train-000003.tar").unlink()
    result = _verify(shards_copy)
    assert result.exit_code == 1
    assert "imagenet-val-000000.tar: index imagenet-val-000000.idx is missing" in result.output
    assert "imagenet-train-000003.tar: shard file is missing" in result.output


def test_truncated_shard_is_caught(shards_copy):
    shard = shards_copy / "imagenet-train-000002.tar"
    shard.write_bytes(shard.read_bytes()[:-3000])
    result = _verify(shards_copy)
    assert result.exit_code == 1 and "imagenet-train-000002.tar: size" in result.output
    assert "truncated" in result.output


def test_manifest_count_mismatch_is_caught(shards_copy):
    _edit_manifest(shards_copy, lambda m: m["splits"]["val"]["shards"][0].update(samples=17))
    result = _verify(shards_copy)
    assert result.exit_code == 1 and "imagenet-val-000000.tar: 16 samples, manifest says 17" in result.output


def test_unlisted_shard_and_incomplete_split_are_caught(shards_copy):
    shutil.copy(shards_copy / "imagenet-val-000000.tar", shards_copy / "imagenet-val-000007.tar")
    _edit_manifest(shards_copy, lambda m: m["splits"]["train"].update(complete=False))
    result = _verify(shards_copy)
    assert result.exit_code == 1
    assert "imagenet-val-000007.tar: shard on disk is not in the manifest" in result.output
    assert "split train: incomplete" in result.output


def test_undecodable_image_is_caught(shards_copy):
    shard = shards_copy / "imagenet-val-000001.tar"
    idx = (shards_copy / "imagenet-val-000001.idx").read_text().splitlines()
    jpg = next(c for c in [idx[1].split()[i:i + 4] for i in range(0, 12, 4)] if c[0] == "jpg")
    raw = bytearray(shard.read_bytes())
    offset = int(jpg[1])
    raw[offset:offset + 64] = bytes(64)  # wipe the JPEG header, keep the size
    shard.write_bytes(bytes(raw))
    # Pretend it was written that way, so only the decode check can catch it.
    digest = hashlib.sha256(raw).hexdigest()
    _edit_manifest(shards_copy, lambda m: m["splits"]["val"]["shards"][1].update(sha256=digest))
    result = vitctl("data", "verify", shards_copy, "--decode", 10_000)
    assert result.exit_code == 1 and f"image at offset {offset} does not decode" in result.output


def test_manifest_labels_that_differ_from_the_shard_are_caught(shards_copy):
    def swap_two_labels(manifest):
        entry = manifest["splits"]["train"]["shards"][0]
        labels = entry["labels"].split()
        first = next(i for i, label in enumerate(labels) if label != labels[0])
        labels[0], labels[first] = labels[first], labels[0]
        entry["labels"] = " ".join(labels)

    _edit_manifest(shards_copy, swap_two_labels)
    result = _verify(shards_copy)
    assert result.exit_code == 1
    assert "imagenet-train-000000.tar: the labels in the manifest differ from the shard's cls members" in result.output
