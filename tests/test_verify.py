import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import tarfile
from pathlib import Path

import pytest

from conftest import ok, vitctl
from vitctl.datasets import verify as verify_module


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


def test_an_index_of_bytes_that_are_not_text_is_named_by_verify_and_by_train(shards_copy, tmp_path):
    """Before: a traceback ending in UnicodeDecodeError from verify, and from train's rank a line naming no file."""
    index = shards_copy / "imagenet-train-000001.idx"
    index.write_bytes(b"v1.2 \xab\xc0" + bytes(range(256)))
    result = _verify(shards_copy)
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr
    assert "FAIL imagenet-train-000001.tar: index imagenet-train-000001.idx: not an index file: byte 5 is not text " \
        "(a damaged or foreign file)" in result.output
    trained = vitctl("train", "--config", "demo_vit", "--data", shards_copy, "--out", tmp_path / "run", "--executor",
                     "local", "--gpus", 0, "--steps", 1, "--set", "model.num_classes=5", "--batch", 4)
    assert trained.exit_code == 1 and f"{index}: not an index file: byte 5 is not text" in trained.stderr
    assert f"fix: rebuild the folder's index files with `vitctl data index {shards_copy}`" in trained.stderr
    ok("data", "index", shards_copy)  # the fix
    assert "FAIL" not in _verify(shards_copy).output


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
    assert result.exit_code == 1 and f"image {jpg[3]} at offset {offset} does not decode" in result.output
    assert "to fix imagenet-val-000001.tar: replace the source image its json member names" in result.output


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


def _fix_commands(output: str) -> list[list[str]]:
    """The command lines verify prints under 'run:', each split at '&&' into argument lists."""
    lines = output.splitlines()
    commands = [lines[i + 1].strip() for i, line in enumerate(lines) if line.endswith(" run:")]
    return [shlex.split(part) for command in commands for part in command.split(" && ")]


def _follow(commands: list[list[str]]) -> None:
    for args in commands:
        assert args[0] == "vitctl"
        ok(*args[1:])


def test_damaged_shards_and_index_come_with_commands_that_repair_them(shards_copy):
    shard = shards_copy / "imagenet-train-000001.tar"
    raw = bytearray(shard.read_bytes())
    raw[2000] ^= 0xFF
    shard.write_bytes(bytes(raw))
    (shards_copy / "imagenet-val-000001.tar").unlink()
    (shards_copy / "imagenet-val-000000.idx").unlink()
    result = _verify(shards_copy)
    assert result.exit_code == 1
    commands = _fix_commands(result.output)
    assert [args[2] for args in commands] == ["shard", "shard", "index"]
    assert [args[args.index("--split") + 1] for args in commands[:2]] == ["train", "val"]
    _follow(commands)
    assert "OK" in ok("data", "verify", shards_copy, "--decode", 1000).output


def test_damaged_shards_whose_images_are_gone_are_told_both_ways_to_fix_them_and_each_works(root_copy, tmp_path):
    """The shard command alone was named, and following it failed: ROOT does not exist (exit 2)."""
    shards, good = tmp_path / "shards", tmp_path / "good"
    ok("data", "shard", root_copy, "--out", shards, "--maxcount", 16, "--workers", 2)
    ok("data", "index", shards)
    shutil.copytree(shards, good)
    shard = shards / "imagenet-val-000001.tar"
    shard.write_bytes(shard.read_bytes()[:4096])
    away = Path(shutil.move(root_copy, tmp_path / "elsewhere"))
    result = _verify(shards)
    assert result.exit_code == 1
    assert (f"to fix imagenet-val-000001.tar: the images they were sharded from, {root_copy}, are not on this "
            f"machine; copy these shards and their .idx files again from a good copy of this folder (manifest.json "
            f"holds each one's sha256), or restore {root_copy} and run:") in result.output
    for name in ("imagenet-val-000001.tar", "imagenet-val-000001.idx"):  # the first way
        shutil.copy2(good / name, shards / name)
    assert "OK" in ok("data", "verify", shards, "--decode", 1000).output
    shard.write_bytes(shard.read_bytes()[:4096])
    shutil.move(away, root_copy)  # the second way
    _follow(_fix_commands(_verify(shards).output))
    assert "OK" in ok("data", "verify", shards, "--decode", 1000).output


def test_incomplete_split_comes_with_the_command_that_finishes_it(prepared_root, tmp_path):
    out = tmp_path / "s"
    ok("data", "shard", prepared_root, "--out", out, "--maxcount", 16, "--maxsize", "1MB", "--seed", 4)
    ok("data", "index", out)
    _edit_manifest(out, lambda m: m["splits"]["train"].update(complete=False,
                                                              shards=m["splits"]["train"]["shards"][1:]))
    result = _verify(out)
    assert result.exit_code == 1 and "split train: incomplete: 3 of 4 shards written" in result.output
    assert "imagenet-train-000000.tar: shard on disk is not in the manifest" in result.output
    commands = _fix_commands(result.output)
    assert commands[0][:3] == ["vitctl", "data", "shard"] and "--seed" in commands[0]
    _follow(commands)
    assert "OK" in ok("data", "verify", out).output


def _write_empty_shard(shards: Path) -> None:
    """A shard of no samples, as earlier versions wrote when every image of a shard was skipped."""
    path = shards / "imagenet-val-000002.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT):
        pass
    entry = {"name": path.name, "samples": 0, "bytes": path.stat().st_size,
             "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "conversions": [], "labels": "",
             "skipped": [{"source": "val/n01440764/x.JPEG", "reason": "unreadable image"}]}

    def add(manifest):
        info = manifest["splits"]["val"]
        info["shards"].append(entry)
        info["planned_shards"] += 1

    _edit_manifest(shards, add)


def test_an_empty_shard_is_flagged_and_not_indexed(shards_copy):
    _write_empty_shard(shards_copy)
    result = _verify(shards_copy)
    assert result.exit_code == 1
    assert "FAIL imagenet-val-000002.tar: the shard holds no samples" in result.output
    assert "to fix imagenet-val-000002.tar: replace or delete the images skipped for it" in result.output
    result = vitctl("data", "index", shards_copy)
    assert result.exit_code == 1 and "holds no samples, and DALI refuses an index of none" in result.stderr
    assert not (shards_copy / "imagenet-val-000002.idx").exists()


def test_verify_shows_its_progress_on_stderr(prepared_shards):
    result = ok("data", "verify", prepared_shards, "--workers", 1)
    assert "verify" in result.stderr and "6/6 shards" in result.stderr


@pytest.mark.parametrize("decode", ["-1", "lots"])
def test_bad_decode_count_is_a_usage_error(prepared_shards, decode):
    result = vitctl("data", "verify", prepared_shards, "--decode", decode)
    assert result.exit_code == 2 and "Invalid value for '--decode'" in result.stderr


SHAPE = "not a manifest `vitctl data shard` wrote: "


@pytest.mark.parametrize("manifest, says", [
    ('{"format": "vitctl-shards/1"}', SHAPE + "manifest.label_convention is missing"),
    ("[]", SHAPE + "it holds [], not an object"),
    ('{"format": 1}', "manifest format 1 is not 'vitctl-shards/1'"),
    ("{not json", "manifest is not valid JSON"),
    (lambda m: m["splits"]["val"].pop("complete"), SHAPE + "splits.val.complete is missing"),
    (lambda m: m["splits"]["train"].update(complete=None), SHAPE + "splits.train.complete is null, not true or false"),
    (lambda m: m["splits"]["train"]["shards"][1].update(samples="16"),
     SHAPE + 'splits.train.shards[1].samples is "16", not an integer'),
    (lambda m: m["splits"]["train"]["shards"][0].update(name="../../elsewhere.tar"),
     SHAPE + "splits.train.shards[0].name '../../elsewhere.tar' is not the name of a train shard"),
    (lambda m: m["splits"]["train"]["shards"].__setitem__(1, m["splits"]["train"]["shards"][0]),
     SHAPE + "splits.train.shards[1].name 'imagenet-train-000000.tar' is that of shards[0] too"),
])
@pytest.mark.parametrize("command", ["index", "verify", "shard"])
def test_a_manifest_of_the_wrong_shape_is_a_clear_error_and_its_fix_works(prepared_root, shards_copy, tmp_path,
                                                                          manifest, says, command):
    if callable(manifest):
        _edit_manifest(shards_copy, manifest)
    else:
        (shards_copy / "manifest.json").write_text(manifest)
    args = [prepared_root, "--out", shards_copy, "--maxcount", 16] if command == "shard" else [shards_copy]
    result = vitctl("data", command, *args)
    assert result.exit_code == 1 and f"{shards_copy / 'manifest.json'}: {says}" in result.stderr
    assert "Traceback" not in result.stderr
    assert "fix: restore it, or shard into a new --out folder (`vitctl data shard ROOT --out NEW`)" in result.stderr
    new = tmp_path / "new"
    ok("data", "shard", prepared_root, "--out", new, "--maxcount", 16)
    ok("data", "index", new)
    assert "OK" in ok("data", "verify", new).output


def test_verify_while_a_data_command_writes_the_folder_says_so_and_works_once_it_has_ended(shards_copy, monkeypatch):
    """Before: false failures ("incomplete: 1356 of 1803"), and a fix the folder's lock then refused."""
    fd = os.open(shards_copy, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what `vitctl data shard` or `index` holds while it writes
    _edit_manifest(shards_copy, lambda m: m["splits"]["train"].update(complete=False))  # as the writer sees it
    try:
        result = _verify(shards_copy)
        assert result.exit_code == 1 and "FAIL" not in result.output and "Traceback" not in result.stderr
        assert result.stderr.endswith(f"error: {shards_copy}: another vitctl command is writing in this folder right "
                                      f"now\nfix: run `vitctl data verify {shards_copy}` once it has ended\n")
    finally:
        os.close(fd)
    _edit_manifest(shards_copy, lambda m: m["splits"]["train"].update(complete=True))  # as the writer leaves it
    ok("data", "verify", shards_copy)
    real_check = verify_module.check_shard

    def writer_starts(*args):  # a writer that begins while verify reads (one worker: in this process)
        if not held:
            held.append(os.open(shards_copy, os.O_RDONLY))
            fcntl.flock(held[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)  # verify holds no lock that would stop it
        return real_check(*args)

    held = []
    monkeypatch.setattr(verify_module, "check_shard", writer_starts)
    try:
        result = vitctl("data", "verify", shards_copy, "--workers", 1)
        assert result.exit_code == 1 and "another vitctl command is writing in this folder" in result.stderr
    finally:
        for fd in held:
            os.close(fd)


def test_a_class_list_put_out_of_order_is_caught(shards_copy):
    """Every check passed (OK, exit 0) with two WNIDs swapped: a reader of label -> WNID named the classes wrongly."""
    def swap_two_classes(manifest):
        manifest["classes"][0], manifest["classes"][1] = manifest["classes"][1], manifest["classes"][0]

    _edit_manifest(shards_copy, swap_two_classes)
    result = _verify(shards_copy)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "manifest.classes is not in sorted order without repeats, as its label_convention 'sorted-wnid-index' has " \
           "them (label i is the i-th WNID)" in result.stderr


@pytest.mark.parametrize("edit", ["renamed", "added"])
def test_a_class_list_renamed_or_grown_in_place_is_caught(shards_copy, edit):
    """Before: verify printed OK for a WNID renamed in place (still sorted) or a WNID added at the end."""
    classes = json.loads((shards_copy / "manifest.json").read_text())["classes"]
    if edit == "renamed":
        _edit_manifest(shards_copy, lambda m: m["classes"].__setitem__(0, "n00000001"))
        says = f"a sample of label 0 is of class {classes[0]} (its json member), and the manifest's class list names " \
               "label 0 n00000001"
    else:
        _edit_manifest(shards_copy, lambda m: m["classes"].append("n99999999"))
        says = f"class n99999999 (label {len(classes)}) has no train sample: the class list was edited after the " \
               "shards were written"
    result = _verify(shards_copy)
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.output
    assert says in " ".join(result.output.split()), result.output
    assert "manifest.json no longer describes the shard" in " ".join(result.output.split())
    _edit_manifest(shards_copy, lambda m: m.update(classes=classes))  # the fix: restore it
    assert _verify(shards_copy).exit_code == 0


def test_a_plan_count_edited_below_the_shards_listed_is_named_as_an_edit(shards_copy):
    """Before: `incomplete: 5 of 3 shards written`, and the fix was to shard again."""
    listed = len(json.loads((shards_copy / "manifest.json").read_text())["splits"]["train"]["shards"])
    _edit_manifest(shards_copy, lambda m: m["splits"]["train"].update(planned_shards=listed - 1))
    result = _verify(shards_copy)
    said = " ".join(result.output.split())
    assert result.exit_code == 1 and f"the manifest lists {listed} shards, more than the {listed - 1} its plan " \
        "holds" in said and "manifest.json no longer describes the shard" in said, result.output


def test_a_plan_count_edited_above_the_shards_is_repaired_by_the_shard_command_verify_names(prepared_root,
                                                                                           shards_copy):
    """Before: `incomplete: 6 of 10 shards written`, whose fix, the shard command, kept every shard and the edited
    count, so that verify said the same again, for ever."""
    listed = len(json.loads((shards_copy / "manifest.json").read_text())["splits"]["train"]["shards"])
    _edit_manifest(shards_copy, lambda m: m["splits"]["train"].update(planned_shards=listed + 4))
    said = " ".join(_verify(shards_copy).output.split())
    assert f"incomplete: {listed} of {listed + 4} shards written" in said, said
    command = re.search(r"run: (vitctl data shard [^&]*?) && vitctl data index", said).group(1)
    ok(*shlex.split(command)[1:])
    ok("data", "index", shards_copy)
    assert _verify(shards_copy).exit_code == 0


def test_index_of_an_unfinished_split_fails_with_the_command_that_finishes_it(prepared_root, tmp_path):
    """An index of a folder a `shard` stopped in (a full disk) said `index: 8 index files` and nothing more; then it
    warned, and exited 0, so that `shard && index && train` went on."""
    out = tmp_path / "s"
    ok("data", "shard", prepared_root, "--out", out, "--maxcount", 16, "--seed", 4)
    _edit_manifest(out, lambda m: m["splits"]["train"].update(complete=False,
                                                              shards=m["splits"]["train"]["shards"][1:]))
    failed = vitctl("data", "index", out)
    assert failed.exit_code == 1 and "index: 5 index files" in failed.output, failed.output  # val and 3 of train
    error = next(line for line in failed.stderr.splitlines() if line.startswith("error: "))
    finish = re.fullmatch(r"error: the train split is incomplete \(3 of 4 shards written\): finish it with `(.*)`, "
                          r"then index again", error)
    assert finish, error
    ok(*shlex.split(finish[1])[1:])
    assert "error" not in ok("data", "index", out).stderr
    assert "OK" in ok("data", "verify", out).output


@pytest.mark.parametrize("command", ["verify", "index"])
def test_shards_whose_manifest_was_moved_away_say_so_and_putting_it_back_works(shards_copy, tmp_path, command):
    """Before: "this folder was not written by `vitctl data shard`; pass the folder given to --out", which it was."""
    moved = tmp_path / "manifest.json"
    shutil.move(shards_copy / "manifest.json", moved)
    result = vitctl("data", command, shards_copy)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert re.search(r"no manifest\.json beside its \d+ shards \(imagenet-train-000000\.tar, \.\.\.\): it records what "
                     r"`vitctl data shard` wrote here", result.stderr), result.stderr
    assert "fix: put manifest.json back; else move the shards away and run the same `vitctl data shard ... --out" \
        in result.stderr
    shutil.move(moved, shards_copy / "manifest.json")
    ok("data", command, shards_copy)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "this folder was not written by `vitctl data shard`" in vitctl("data", command, empty).stderr
