"""What reads a checkpoint (finetune --from-ckpt, export, --resume) refuses a bad one with one clear message: files
that are not checkpoints, files that need full unpickling, damaged checkpoints and exports, non-finite weights, a
missing head. The fix each message names works."""

import argparse
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import ok, vitctl
from vitctl.trainer import checkpoint as ckpt
from vitctl.trainer.config import ConfigError, ModelConfig, load_config
from vitctl.trainer.loop import train
from vitctl.trainer.models import build_model
from vitctl.trainer.models.layers import timm_layout
from vitctl.trainer.ops import resolve
from vitctl.trainer.pretrained import load_pretrained, read_state_dict

BASE = ["model.name=vit_micro", "model.num_classes=5", "model.img_size=32", "data.source=synthetic",
        "data.batch_size=8", "data.train_samples=64", "data.workers=0", "train.precision=fp32", "augment.mixup=0",
        "augment.cutmix=0", "train.checkpoint_every=2"]
SETS = [a for s in BASE for a in ("--set", s)]
ACCEPTED = "accepted: a vitctl run or checkpoint folder, a .safetensors file"


def config(out: Path, *extra: str):
    return load_config(None, [*BASE, f"train.out_dir={out}", *extra])


def finetune(source: Path, out: Path, *extra: object):
    return vitctl("finetune", "--from-ckpt", source, "--out", out, "--executor", "local", "--gpus", 0, "--steps", 1,
                  *SETS, *extra)


def micro_model(**kw) -> torch.nn.Module:
    return build_model(ModelConfig(name="vit_micro", num_classes=5, img_size=32, drop_path=0.0, **kw),
                       resolve("none", torch.device("cpu")))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A run folder with checkpoints of steps 2 and 3 (read-only: copy it before damaging it)."""
    out = tmp_path_factory.mktemp("pretrain") / "run"
    train(config(out, "train.max_steps=3"))
    return out


@pytest.fixture
def run_copy(pretrained, tmp_path) -> Path:
    return Path(shutil.copytree(pretrained, tmp_path / "run"))


@pytest.fixture(scope="module")
def weights(pretrained) -> dict[str, torch.Tensor]:
    return ckpt.consolidated(ckpt.list_checkpoints(pretrained)[-1])


def flip_bytes(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + 4] = bytes(255 - b for b in raw[offset:offset + 4])
    path.write_bytes(bytes(raw))


def follow(message: str, command: str) -> list[str]:
    """The arguments of the `command ...` the message tells the user to run, e.g. `mv A B` (the last one named)."""
    return shlex.split(re.findall(rf"(?<![\w`-]){command} [^)`;]*", message)[-1])[1:]


# ---------------------------------------------------------------- files that are not checkpoints


def _torch_zip_cut_short(path: Path, weights: dict) -> None:
    torch.save(weights, path)
    path.write_bytes(path.read_bytes()[:-4000])


def _safetensors_cut_short(path: Path, weights: dict) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in weights.items()}, path)
    path.write_bytes(path.read_bytes()[:-1000])


@pytest.mark.parametrize(("name", "make", "message"), [
    ("empty.pt", lambda p, w: p.write_bytes(b""), "is empty (0 bytes), not a checkpoint"),
    ("notes.pt", lambda p, w: p.write_text("epoch 3: top-1 71.2\n"),
     "is not a checkpoint: neither a torch.save file nor a safetensors file (it starts with b'epoch 3"),
    ("random.pth", lambda p, w: p.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator()
                                                            .manual_seed(3), dtype=torch.uint8).numpy().tobytes()),
     "is not a checkpoint: neither a torch.save file nor a safetensors file"),
    ("cut.pt", _torch_zip_cut_short, "is damaged or not a torch.save file (PytorchStreamReader failed reading zip"),
    ("model.safetensors", lambda p, w: p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"),
     "is not a readable safetensors file"),
    ("cut.safetensors", _safetensors_cut_short, "is cut short: it holds "),  # before: 'incomplete metadata, file not
])  # fully covered', blamed on its header
def test_a_file_that_is_no_checkpoint_is_refused_before_launch(weights, tmp_path, name, make, message):
    source = tmp_path / name
    make(source, weights)
    result = finetune(source, tmp_path / "ft")
    assert result.exit_code == 1, result.output
    assert f"error: finetune.from_ckpt {source} {message}" in result.stderr, result.stderr
    assert "Traceback" not in result.output + result.stderr and "full unpickling" not in result.stderr
    assert not (tmp_path / "ft").exists()  # nothing was launched
    if not name.endswith(".safetensors"):
        assert ACCEPTED in result.stderr


@pytest.mark.parametrize(("source", "said"), [
    ("timm:vit_small_patch16_224", "vit_small_patch16_224 is a timm model, and vitctl reads weights from files only"),
    ("swin_large_patch4_window7_224_22k.pth", "swin_large_patch4_window7_224_22k.pth is an official Swin release "
                                              "file, and vitctl downloads nothing; where there is network, download "
                                              "it from https://github.com/SwinTransformer/storage/releases"),
])
def test_weights_named_by_where_they_come_from_are_told_how_to_get_them(tmp_path, monkeypatch, source, said):
    """Before: `no such file or folder` alone, for the README's own example among them."""
    monkeypatch.chdir(tmp_path)
    result = finetune(source, tmp_path / "ft", "--dry-run")
    assert result.exit_code == 1 and said in result.stderr, result.stderr


def test_a_timm_model_name_is_told_how_to_save_its_weights_and_the_file_so_saved_is_read(tmp_path, monkeypatch):
    """Before: `--from-ckpt vit_small_patch16_224` said only 'no such file or folder'."""
    monkeypatch.chdir(tmp_path)
    result = finetune("vit_small_patch16_224", tmp_path / "ft", "--set", "model.name=vit_s16", "--dry-run")
    assert result.exit_code == 1 and "vit_small_patch16_224 is a timm model, and vitctl reads weights from files " \
        "only (it downloads nothing)" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "ft").exists()
    command = re.search(r'`python -c "(.*)"` saves them', result.stderr)[1]
    exec(command.replace("pretrained=True", "pretrained=False"))  # the fix, without the network it downloads from
    saved = re.search(r"then pass --from-ckpt (\S+)", result.stderr)[1]
    assert Path(saved).is_file()
    ok("finetune", "--from-ckpt", saved, "--out", tmp_path / "ft", "--executor", "local", "--gpus", 0, *SETS,
       "--set", "model.name=vit_s16", "--dry-run")
    assert finetune("not_a_timm_model", tmp_path / "ft").stderr.rstrip().endswith(
        "--from-ckpt not_a_timm_model: no such file or folder")


def test_a_missing_source_from_a_config_file_is_named_by_its_key_and_where_a_relative_path_is_read(tmp_path,
                                                                                                    monkeypatch):
    """Before: `--from-ckpt ../run1: no such file or folder` for a source no flag gave (a config file, --set), and
    nothing said that a relative path is read from the current folder, not the config file's."""
    (tmp_path / "cfgs").mkdir()
    (tmp_path / "cfgs/ft.yaml").write_text("finetune:\n  from_ckpt: ../run1\n")
    monkeypatch.chdir(tmp_path)
    args = ["finetune", "--config", "cfgs/ft.yaml", "--out", tmp_path / "ft", "--executor", "local", "--gpus", 0, *SETS,
            "--dry-run"]
    result = vitctl(*args)
    assert result.exit_code == 1 and result.stderr == (f"error: finetune.from_ckpt ../run1: no such file or folder (a "
                                                       f"relative path is read from the current folder, {tmp_path})\n")
    (tmp_path / "cfgs/ft.yaml").write_text("finetune:\n  from_ckpt: cfgs/../../run1\n")
    assert vitctl(*args).stderr.startswith("error: finetune.from_ckpt cfgs/../../run1: no such file or folder")


def test_a_broken_link_as_source_is_named_with_where_it_points(pretrained, tmp_path):
    """Before: `no such file or folder`, of a link that is there."""
    link = tmp_path / "w.safetensors"
    link.symlink_to(tmp_path / "moved/w.safetensors")
    result = finetune(link, tmp_path / "ft", "--dry-run")
    assert result.exit_code == 1 and result.stderr == (
        f"error: --from-ckpt {link} is a broken symbolic link (to {tmp_path / 'moved/w.safetensors'}): restore what "
        "it points to, or pass the weights' own path\n"), result.stderr
    (tmp_path / "moved").mkdir()
    ok("export", pretrained, "--out", tmp_path / "moved/w.safetensors")  # restored
    restored = finetune(link, tmp_path / "ft", "--dry-run")
    assert restored.exit_code == 0, restored.stderr


def test_a_torch_save_file_named_safetensors_is_told_to_be_renamed_and_that_works(weights, tmp_path):
    """torch.load goes by the suffix and handed it to safetensors: a SafetensorError traceback ('header too large')."""
    source = tmp_path / "model.safetensors"
    torch.save(timm_layout(weights), source)
    result = finetune(source, tmp_path / "ft")
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr, result.stderr
    assert result.stderr.strip() == (f"error: finetune.from_ckpt {source} holds a torch.save file but is named "
                                     ".safetensors, which torch.load hands to safetensors; rename it, e.g. to "
                                     f"{tmp_path / 'model.pth'}")
    source.rename(tmp_path / "model.pth")
    ok("finetune", "--from-ckpt", tmp_path / "model.pth", "--out", tmp_path / "ft", "--executor", "local", "--gpus", 0,
       "--steps", 1, *SETS)


@pytest.mark.parametrize("name", ["__0_0.distcp", "meta.json", ".metadata"])
def test_a_file_inside_a_checkpoint_folder_names_the_folder_and_that_works(pretrained, tmp_path, name):
    """Before, a shard file was 'damaged or not a torch.save file (PytorchStreamReader failed ...); copy it again'."""
    folder = ckpt.list_checkpoints(pretrained)[-1]
    result = finetune(folder / name, tmp_path / "ft")
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr, result.stderr
    assert result.stderr == (f"error: finetune.from_ckpt {folder / name} is one file of the checkpoint folder "
                             f"{folder}; pass that folder, or the run folder for its last checkpoint\n")
    ok("finetune", "--from-ckpt", folder, "--out", tmp_path / "ft", "--executor", "local", "--gpus", 0, "--steps", 1,
       *SETS)


@pytest.mark.slow
def test_python_objects_need_trust_which_the_flag_gives_the_ranks(weights, tmp_path):
    """timm's training checkpoints pickle their argparse arguments (official Swin's, a yacs config)."""
    source = tmp_path / "checkpoint-3.pth.tar"
    torch.save({"state_dict": weights, "args": argparse.Namespace(lr=0.1), "epoch": 3}, source)
    refused = finetune(source, tmp_path / "ft")
    assert refused.exit_code == 1
    assert (f"error: finetune.from_ckpt {source} holds Python objects besides tensors (argparse.Namespace): this file "
            "needs full unpickling, which can run code; if you trust it, add --trust-checkpoint") in refused.stderr
    assert not (tmp_path / "ft").exists()
    tuned = finetune(source, tmp_path / "ft", "--trust-checkpoint")
    assert tuned.exit_code == 0, tuned.output + tuned.stderr
    assert "unpickling it in full, as finetune.trust_checkpoint allows" in tuned.stderr


def test_a_single_file_checkpoint_of_the_old_format_needs_trust_too(weights, tmp_path):
    """torch.save's format before torch 1.6 is checked when read: the message is the same."""
    source = tmp_path / "old.pth"
    torch.save({"model": weights, "args": argparse.Namespace(lr=0.1)}, source, _use_new_zipfile_serialization=False)
    with pytest.raises(ConfigError, match=r"argparse\.Namespace\): this file needs full unpickling.*--trust-checkp"):
        read_state_dict(source)
    got = read_state_dict(source, trust=True)
    assert all(torch.equal(got[k], weights[k]) for k in weights)


# ---------------------------------------------------------------- damaged checkpoints: checksums


def _flip_data(step: Path) -> str:
    flip_bytes(step / "__0_0.distcp", (step / "__0_0.distcp").stat().st_size // 2)
    return "__0_0.distcp does not match the sha256 taken when it was saved"


def _cut_metadata(step: Path) -> str:
    size = (step / ".metadata").stat().st_size
    (step / ".metadata").write_bytes((step / ".metadata").read_bytes()[:100])
    return f".metadata has 100 bytes, not the {size} it was saved with"


def _garble_meta(step: Path) -> str:
    (step / "meta.json").write_text((step / "meta.json").read_text()[:50])
    return "meta.json is not readable JSON (Unterminated string"


@pytest.mark.parametrize("damage", [_flip_data, _cut_metadata, _garble_meta])
def test_a_damaged_checkpoint_is_refused_by_every_reader(run_copy, tmp_path, damage):
    last = run_copy / "checkpoints/step-00000003"
    what = damage(last)
    expected = (f"checkpoint {last} is damaged: {what}", "To go on from the previous checkpoint, step-00000002, "
                f"move this one aside (mv {last} {last}.damaged): --resume, `vitctl export` and --from-ckpt")
    result = vitctl("export", run_copy, "--out", tmp_path / "w.safetensors")
    assert result.exit_code == 1 and all(part in result.stderr for part in expected), result.stderr
    assert "Traceback" not in result.output + result.stderr and not (tmp_path / "w.safetensors").exists()
    with pytest.raises(ConfigError) as finetune_error:
        read_state_dict(run_copy)
    with pytest.raises(ConfigError) as resume_error:
        train(config(run_copy, "train.max_steps=4"), resume=True)
    assert all(part in str(e.value) for e in (finetune_error, resume_error) for part in expected)


def test_the_way_on_from_a_damaged_checkpoint_works(run_copy, tmp_path):
    _flip_data(run_copy / "checkpoints/step-00000003")
    result = vitctl("export", run_copy, "--out", tmp_path / "w.safetensors")
    assert result.exit_code == 1
    shutil.move(*follow(result.stderr, "mv"))
    assert "step-00000002" in ok("export", run_copy, "--out", tmp_path / "w.safetensors").output
    assert read_state_dict(run_copy).keys() == read_state_dict(tmp_path / "w.safetensors").keys()
    assert train(config(run_copy, "train.max_steps=4"), resume=True)["step"] == 4
    events = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert [e["checkpoint"] for e in events if e.get("event") == "resume"] == ["step-00000002"]


def test_a_damaged_only_checkpoint_says_there_is_none_before_it(run_copy):
    shutil.rmtree(run_copy / "checkpoints/step-00000002")
    _flip_data(run_copy / "checkpoints/step-00000003")
    with pytest.raises(ConfigError, match="holds no earlier checkpoint: move it aside .* --resume starts the run "
                                          "afresh"):
        read_state_dict(run_copy)


@pytest.mark.slow
def test_two_ranks_share_the_check_and_both_refuse(run_copy, tmp_path):
    _flip_data(run_copy / "checkpoints/step-00000003")
    result = finetune(run_copy, tmp_path / "ft", "--tasks-per-node", 2)
    assert result.exit_code == 1 and "__0_0.distcp does not match the sha256" in result.output + result.stderr


def test_an_export_carries_a_checksum_that_is_verified(pretrained, weights, tmp_path):
    export = tmp_path / "w.safetensors"
    ok("export", pretrained, "--out", export)
    header = int.from_bytes(export.read_bytes()[:8], "little")
    flip_bytes(export, 8 + header + (export.stat().st_size - 8 - header) // 2)
    with pytest.raises(ConfigError) as error:
        read_state_dict(export)
    assert (f"finetune.from_ckpt {export} is damaged: its tensors do not match the sha256 `vitctl export` recorded "
            "in it; export it again (vitctl export ") in str(error.value)
    ok(*follow(str(error.value), "vitctl"))
    got = read_state_dict(export)
    assert all(torch.equal(got[k], weights[k]) for k in weights)


# ---------------------------------------------------------------- foreign weights: finite values


def test_a_damaged_export_whose_checkpoint_is_gone_is_told_the_run_s_last_one(run_copy, weights, tmp_path):
    """Before: `export it again (vitctl export RUN/checkpoints/step-00000002 ...)`, a folder keep_checkpoints had
    removed since, which the command then said does not exist."""
    export = tmp_path / "w.safetensors"
    ok("export", run_copy, "--step", 2, "--out", export)
    shutil.rmtree(run_copy / "checkpoints/step-00000002")
    header = int.from_bytes(export.read_bytes()[:8], "little")
    flip_bytes(export, 8 + header + (export.stat().st_size - 8 - header) // 2)
    with pytest.raises(ConfigError) as error:
        read_state_dict(export)
    assert (f"its checkpoint {run_copy / 'checkpoints/step-00000002'} is gone since; export that run's last one in "
            f"its place (vitctl export {run_copy} --out {export})") in str(error.value), error.value
    ok(*follow(str(error.value), "vitctl"))
    got = read_state_dict(export)
    assert all(torch.equal(got[k], weights[k]) for k in weights)  # step 3's
    shutil.rmtree(run_copy)
    flip_bytes(export, 8 + header + (export.stat().st_size - 8 - header) // 2)
    with pytest.raises(ConfigError, match="is gone too: copy the export again from where it is kept"):
        read_state_dict(export)


@pytest.mark.parametrize(("suffix", "bad", "said"), [(".pth", [float("inf"), float("nan")], "2 non-finite values"),
                                                     (".safetensors", [float("nan")], "1 non-finite value"),
                                                     (".safetensors", [float("inf")] * 2, "2 non-finite values")])
def test_non_finite_foreign_weights_name_the_tensor(weights, tmp_path, suffix, bad, said):
    state = {k: v.clone() for k, v in timm_layout(weights).items()}  # timm's shapes, as foreign weights have them
    state["blocks.1.attn.qkv.weight"][3, :len(bad)] = torch.tensor(bad)
    source = tmp_path / f"timm{suffix}"
    save_file(state, source) if suffix == ".safetensors" else torch.save(state, source)
    with pytest.raises(ConfigError, match=rf"tensor blocks\.1\.attn\.qkv\.weight holds {said} \(inf or nan\)"):
        read_state_dict(source)


# ---------------------------------------------------------------- the head, resized tables


def test_a_checkpoint_without_a_head_says_how_to_start_one_and_that_works(weights, tmp_path):
    source = tmp_path / "backbone.pth"
    torch.save({k: v for k, v in weights.items() if not k.startswith("head.")}, source)
    with pytest.raises(ConfigError, match=r"missing \(2\): head\.bias, head\.weight; the checkpoint has no classifier "
                                          r"head that fits this model: start a new one with --set "
                                          r"finetune.reset_head=true") as error:
        load_pretrained(micro_model(), source, None, "vit_micro")
    fix = follow(str(error.value), "--set")  # what --set would add to the config, here given to the trainer itself
    assert train(config(tmp_path / "ft", "train.max_steps=1", f"finetune.from_ckpt={source}", *fix))["step"] == 1


def test_a_run_of_another_model_is_named_before_launch_and_the_fix_works(pretrained, tmp_path):
    """Before, the ranks listed 50 missing and 76 unexpected keys after launch and said `--model set to the
    architecture they are of` without naming it (a vitctl run records it)."""
    result = finetune(pretrained, tmp_path / "ft", "--set", "model.name=swin_micro", "--set", "model.window_size=4")
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr, result.stderr
    assert result.stderr == (f"error: finetune.from_ckpt {pretrained} holds a vit_micro, and this run builds a "
                             "swin_micro; finetune it as the model it is: --model vit_micro --set "
                             "model.window_size=null\n")
    assert not (tmp_path / "ft").exists()  # nothing was launched
    fix = result.stderr.rstrip().split("as the model it is: ")[1].split()  # before, a second error: window_size
    ok("finetune", "--from-ckpt", pretrained, "--out", tmp_path / "ft", "--executor", "local", "--gpus", 0, "--steps",
       1, *[a for s in BASE if not s.startswith("model.name") for a in ("--set", s)], "--set", "model.window_size=4",
       *fix)


def test_an_export_of_another_model_is_named_before_launch(pretrained, tmp_path):
    """Before, as for a run folder: the ranks listed the keys that did not match, after launch."""
    export = tmp_path / "w.safetensors"
    ok("export", pretrained, "--out", export)
    result = finetune(export, tmp_path / "ft", "--set", "model.name=swin_micro", "--set", "model.window_size=4")
    assert result.stderr == (f"error: finetune.from_ckpt {export} holds a vit_micro, and this run builds a "
                             "swin_micro; finetune it as the model it is: --model vit_micro --set "
                             "model.window_size=null\n"), result.stderr
    assert not (tmp_path / "ft").exists()


@pytest.mark.parametrize("name, saved, error", [
    ("other.pth", {"foo.weight": torch.zeros(3)}, r"does not fit model vit_micro: missing \(5\d\): .*; unexpected "
                                                  r"\(1\): foo\.weight; use weights of a vit_micro"),
    ("other.safetensors", {"foo.weight": torch.zeros(3)}, r"does not fit model vit_micro: .*unexpected \(1\)"),
    ("args.pth", {"epoch": 3, "arch": "vit"}, "holds no state_dict of tensors"),
    ("empty.pth", {}, "holds no state_dict of tensors"),
])
def test_weights_that_do_not_fit_are_refused_before_launch(tmp_path, name, saved, error):
    """Before, only the file's format was checked before launch: on Slurm, the ranks said this after the queue."""
    source = tmp_path / name
    save_file(saved, source) if name.endswith(".safetensors") else torch.save(saved, source)
    result = finetune(source, tmp_path / "ft")
    assert result.exit_code == 1 and re.search(error, result.stderr), result.output + result.stderr
    assert not (tmp_path / "ft").exists()  # nothing was launched


def test_a_qkv_of_another_width_is_named_in_the_file_s_shapes(pretrained, tmp_path):
    """Before: in the packed (3, out, in) shapes the model keeps, as if the file's: (3, 192, 96) for its (576, 96)."""
    state = timm_layout(ckpt.consolidated(ckpt.list_checkpoints(pretrained)[-1]))
    state |= {"blocks.0.attn.qkv.weight": torch.zeros(576, 96), "blocks.0.attn.qkv.bias": torch.zeros(576)}
    save_file(state, tmp_path / "wider.safetensors")
    result = finetune(tmp_path / "wider.safetensors", tmp_path / "ft")
    assert result.exit_code == 1 and "shape mismatch, file -> model (2): blocks.0.attn.qkv.bias (576,) -> (288,), " \
        "blocks.0.attn.qkv.weight (576, 96) -> (288, 96)" in result.stderr, result.stderr


def test_a_run_folder_whose_head_does_not_fit_is_refused_before_launch_and_the_fix_works(pretrained, tmp_path):
    """Before, a run folder's format alone was checked before launch: --dry-run passed, and on Slurm the ranks named
    the head's shapes after the queue wait."""
    args = ["--set", "model.num_classes=4", "--set", "finetune.reset_head=false"]
    result = finetune(pretrained, tmp_path / "ft", *args, "--dry-run")
    assert result.exit_code == 1 and "shape mismatch, file -> model (2): head.bias (5,) -> (4,), head.weight " \
        "(5, 96) -> (4, 96); the checkpoint has no classifier head that fits this model: start a new one with --set " \
        "finetune.reset_head=true" in result.stderr, result.stderr
    assert not (tmp_path / "ft").exists()
    ok("finetune", "--from-ckpt", pretrained, "--out", tmp_path / "ft", "--executor", "local", "--gpus", 0, "--steps",
       1, *SETS, "--set", "model.num_classes=4", "--set", "finetune.reset_head=true")


def test_finetune_asks_for_weights_and_takes_them_from_set_as_from_flag(pretrained, tmp_path):
    """Without weights finetune says how to give them; `--set finetune.from_ckpt=` gives them as --from-ckpt does."""
    where = ["--out", tmp_path / "ft", "--executor", "local", "--gpus", 0, "--steps", 1, *SETS]
    result = vitctl("finetune", *where)
    assert result.exit_code == 2 and "vitctl finetune needs the weights to start from: pass --from-ckpt PATH" \
        in result.stderr, result.stderr
    assert not (tmp_path / "ft").exists()
    ok("finetune", *where, "--set", f"finetune.from_ckpt={pretrained}")
    saved = ckpt.read_meta(ckpt.list_checkpoints(tmp_path / "ft")[-1])["config"]
    assert saved["finetune"]["from_ckpt"] == str(pretrained.absolute())


def test_weights_resized_to_the_model_with_a_new_head_pass_the_check_before_launch(pretrained, tmp_path):
    """The check reads names and shapes only (a safetensors header), and resizes position embeddings as the ranks do."""
    export = tmp_path / "w.safetensors"
    ok("export", pretrained, "--out", export)
    ok("finetune", "--from-ckpt", export, "--out", tmp_path / "ft", "--executor", "local", "--gpus", 0, "--steps", 1,
       *SETS, "--set", "model.img_size=48", "--set", "model.num_classes=3")


@pytest.mark.parametrize("reset_head", [None, True])
def test_weights_of_another_architecture_are_not_told_to_reset_the_head(tmp_path, reset_head):
    """A new head would leave the rest unfitted: the message names the architecture instead."""
    source = tmp_path / "other.pth"
    torch.save({"foo.weight": torch.zeros(3)}, source)
    with pytest.raises(ConfigError, match=r"does not fit model vit_micro: missing \(5\d\): .*; unexpected \(1\): "
                                          r"foo\.weight; use weights of a vit_micro, or --model set to the "
                                          r"architecture they are of$") as error:
        load_pretrained(micro_model(), source, reset_head, "vit_micro")
    assert "reset_head" not in str(error.value)


def test_a_new_head_is_not_the_pretraining_runs_initial_head(pretrained):
    """Both runs start from train.seed: the finetune's model is built from the same stream as the pretraining's."""
    torch.manual_seed(0)
    initial = micro_model().head  # the pretraining run's initial head
    heads = []
    for _ in range(2):
        torch.manual_seed(0)
        model = micro_model()
        assert load_pretrained(model, pretrained, True, "vit_micro", seed=0) == ["head.bias", "head.weight"]
        heads.append(model.head)
    assert not torch.equal(heads[0].weight, initial.weight)
    assert torch.equal(heads[0].weight, heads[1].weight)  # still reproducible from the seed
    assert heads[0].weight.std().item() == pytest.approx(0.02, rel=0.2) and not heads[0].bias.any()
    torch.manual_seed(0)
    other = micro_model()
    load_pretrained(other, pretrained, True, "vit_micro", seed=1)
    assert not torch.equal(other.head.weight, heads[0].weight)


def test_the_log_names_the_checkpoint_and_step_a_run_folder_stood_for(pretrained, caplog):
    with caplog.at_level("INFO", logger="vitctl.finetune"):
        load_pretrained(micro_model(), pretrained, True, "vit_micro")
    last = ckpt.list_checkpoints(pretrained)[-1]
    assert any(r.getMessage().startswith(f"loaded {last} (step 3, ") for r in caplog.records), caplog.text


def test_the_log_names_an_export_s_step_and_why_the_head_is_new(pretrained, tmp_path, caplog):
    exported = tmp_path / "w.safetensors"
    assert vitctl("export", pretrained, "--out", exported).exit_code == 0
    model = build_model(ModelConfig(name="vit_micro", num_classes=3, img_size=32, drop_path=0.0),
                        resolve("none", torch.device("cpu")))
    with caplog.at_level("INFO", logger="vitctl.finetune"):
        load_pretrained(model, exported, None, "vit_micro")
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"loaded {exported} (exported from step 3 of ") for m in said), said
    assert any(m.startswith("a new head: the file's does not fit the model (") and "head.weight (5, " in m
               and "-> (3, " in m for m in said), said


def test_resized_tables_are_logged_once(pretrained, tmp_path, caplog):
    swin = build_model(ModelConfig(name="swin_micro", img_size=64, window_size=4, drop_path=0.0),
                       resolve("none", torch.device("cpu")))
    torch.save(swin.state_dict(), tmp_path / "swin.pth")
    target = build_model(ModelConfig(name="swin_micro", img_size=96, window_size=6, drop_path=0.0),
                         resolve("none", torch.device("cpu")))
    with caplog.at_level("INFO", logger="vitctl.finetune"):
        load_pretrained(target, tmp_path / "swin.pth", None, "swin_micro")
    resized = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resized")]
    assert len(resized) == 5 and "resized layers.0.blocks.0.attn.relative_position_bias_table (49, 1) -> (121, 1)" \
        in resized


@pytest.mark.slow
def test_two_ranks_finetune_from_a_run_folder_and_rank_0_logs_the_resize(pretrained, tmp_path):
    result = finetune(pretrained, tmp_path / "ft", "--tasks-per-node", 2, "--set", "model.img_size=48")
    assert result.exit_code == 0, result.output + result.stderr
    assert result.stderr.count("resized pos_embed (1, 17, 96) -> (1, 37, 96)") == 1, result.stderr


def test_a_resumed_finetune_needs_its_source_no_more(weights, tmp_path):
    """A requeued finetune resumes from its own checkpoint, even after the file it started from is gone."""
    source = tmp_path / "source.pth"
    torch.save(weights, source)
    assert train(config(tmp_path / "ft", "train.max_steps=2", f"finetune.from_ckpt={source}"))["step"] == 2
    source.unlink()
    resumed = train(config(tmp_path / "ft", "train.max_steps=3", f"finetune.from_ckpt={source}"), resume=True)
    assert resumed["step"] == 3


def test_finetune_resume_takes_the_source_its_checkpoints_name_and_a_link_to_it(weights, tmp_path):
    """Before: `finetune --resume` without --from-ckpt was told to pass one, and a link to the same file was refused
    as another source."""
    source, link = tmp_path / "source.pth", tmp_path / "link.pth"
    torch.save(weights, source)
    link.symlink_to(source)
    assert finetune(source, tmp_path / "ft").exit_code == 0
    base = ["finetune", "--out", tmp_path / "ft", "--executor", "local", "--gpus", 0, *SETS, "--resume"]
    for steps, given in ((2, []), (3, ["--from-ckpt", link])):
        result = vitctl(*base, "--steps", steps, *given)
        assert result.exit_code == 0, result.stderr
        assert ckpt.read_meta(ckpt.list_checkpoints(tmp_path / "ft")[-1])["step"] == steps


def test_a_ctrl_c_inside_dcp_s_read_is_an_interrupt_not_a_bug_to_report(tmp_path, monkeypatch):
    """DCP wraps a KeyboardInterrupt in its CheckpointException: `export` said 'please report it' (exit 1)."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    monkeypatch.setattr(ckpt, "read_meta", lambda path: {"files": {"x": "sha"}})
    with pytest.raises(KeyboardInterrupt), ckpt._reading(tmp_path):
        raise CheckpointException("load failed", {0: (KeyboardInterrupt(), traceback.extract_stack())})
    with pytest.raises(ConfigError, match="please report it"), ckpt._reading(tmp_path):  # any other failure
        raise CheckpointException("load failed", {0: (RuntimeError("boom"), traceback.extract_stack())})
