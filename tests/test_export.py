"""`vitctl export` and what `finetune --from-ckpt` reads: exports, run folders, checkpoint folders, single-file
checkpoints of earlier versions."""

import errno
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import AS_A_USER, CLASSES, ok, vitctl
from vitctl.datasets import atomic
from vitctl.trainer import checkpoint as ckpt
from vitctl.trainer.config import ConfigError, ModelConfig, load_config
from vitctl.trainer.data.augment import recipe_of
from vitctl.trainer.loop import train
from vitctl.trainer.models import build_model
from vitctl.trainer.models.layers import timm_layout
from vitctl.trainer.ops import resolve
from vitctl.trainer.pretrained import load_pretrained, read_state_dict

CPU = torch.device("cpu")
BASE = [f"model.num_classes={CLASSES}", "model.img_size=32", "data.batch_size=8", "data.workers=0",
        "data.source=webdataset", "train.precision=fp32", "augment.mixup=0", "augment.cutmix=0",
        "train.checkpoint_every=2", "train.ema_decay=0.9"]


def run(shards: Path, out: Path, *extra: str) -> dict:
    return train(load_config(None, [*BASE, f"data.path={shards}", f"train.out_dir={out}", *extra]))


@pytest.fixture(scope="module")
def micro_run(prepared_shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("micro") / "run"
    run(prepared_shards, out, "model.name=vit_micro", "train.max_steps=3")
    return out


@pytest.mark.parametrize("model", [["model.name=vit_s16", "data.mean=[0.485,0.456,0.406]",
                                    "data.std=[0.229,0.224,0.225]", "eval.crop_pct=1.0"],
                                   ["model.name=swin_t", "model.img_size=64", "model.window_size=2"]])
def test_export_has_timm_names_and_the_timm_call_it_prints_loads_every_weight(prepared_shards, tmp_path, model):
    """The call `export --help` named before, `create_model(NAME, pretrained=True, pretrained_cfg_overlay={"file":
    OUT})`, failed on a head of CLASSES classes; with num_classes=CLASSES added, timm dropped the trained head."""
    import timm

    run(prepared_shards, tmp_path / "run", *model, "train.max_steps=1")
    printed = ok("export", tmp_path / "run", "--out", tmp_path / "w.safetensors").output
    call = re.search(r"^timm: (timm\.create_model\(.*\))$", printed, re.M)[1]
    built = eval(call, {"timm": timm})  # as a user pastes it
    weights = load_file(tmp_path / "w.safetensors")
    assert built.state_dict().keys() == weights.keys() and all(torch.equal(built.state_dict()[k], weights[k])
                                                               for k in weights)
    saved = timm_layout(ckpt.consolidated(ckpt.list_checkpoints(tmp_path / "run")[-1]))
    assert all(torch.equal(weights[k], saved[k]) for k in saved)
    config = load_config(None, [*BASE, *model])
    assert built(torch.zeros(1, 3, *[config.model.img_size] * 2)).shape == (1, CLASSES)
    view, trained = timm.data.resolve_data_config({}, model=built), recipe_of(config)  # was timm's (0.5, 0.9)
    assert (view["mean"], view["std"], view["crop_pct"], view["crop_mode"], view["interpolation"]) == \
        (trained.mean, trained.std, trained.eval_crop_pct, trained.eval_crop_mode, trained.eval_interpolation)


def test_export_of_a_model_timm_lacks_names_what_reads_it(micro_run, tmp_path):
    printed = ok("export", micro_run, "--out", tmp_path / "w.safetensors").output
    assert f"\ntimm: timm has no vit_micro; `vitctl finetune --from-ckpt {tmp_path / 'w.safetensors'}` reads it\n" in \
        printed
    spaced = tmp_path / "sub dir" / "w.safetensors"  # before: printed unquoted, so the pasted command read `sub`
    printed = " ".join(ok("export", micro_run, "--out", spaced).output.split())
    assert f"`vitctl finetune --from-ckpt '{spaced}'` reads it" in printed, printed


def test_export_of_a_step_and_of_the_ema(micro_run, tmp_path, caplog):
    result = ok("export", micro_run, "--step", 2, "--ema", "--out", tmp_path / "ema.safetensors")
    assert "EMA of" in result.output and "step-00000002" in result.output
    ema = load_file(tmp_path / "ema.safetensors")
    saved = timm_layout(ckpt.consolidated(micro_run / "checkpoints/step-00000002", "ema"))
    assert all(torch.equal(ema[k], v) for k, v in saved.items())
    assert not list(tmp_path.glob(".*partial"))
    model = build_model(ModelConfig(name="vit_micro", num_classes=CLASSES, img_size=32), resolve("none", CPU))
    with caplog.at_level("INFO", logger="vitctl.finetune"):  # before: as if the weights it trained
        load_pretrained(model, tmp_path / "ema.safetensors", None, "vit_micro")
    assert f"loaded {tmp_path / 'ema.safetensors'} (EMA weights exported from step 2 of " in caplog.text, caplog.text


@pytest.mark.parametrize(("args", "message"), [
    (["--step", 7], "has no checkpoint of step 7; it has steps 2, 3"),
    (["--out", "."], "is a folder"),
    (["--out", "w.pt"], "--out w.pt: .pt names a torch.save file, and an export is a safetensors file; name it "
                        "w.safetensors"),
])
def test_export_errors_say_what_to_do(micro_run, tmp_path, args, message):
    out = [] if "--out" in args else ["--out", tmp_path / "w.safetensors"]
    result = vitctl("export", micro_run, *out, *args)
    assert result.exit_code == 1 and message in result.stderr, result.stderr


def test_export_of_a_folder_without_checkpoints(tmp_path):
    result = vitctl("export", tmp_path, "--out", tmp_path / "w.safetensors")
    assert result.exit_code == 1 and "neither a checkpoint folder nor a run folder" in result.stderr



def test_a_folder_of_weight_files_as_from_ckpt_names_the_file_to_pass(micro_run, prepared_shards, tmp_path):
    """A Hugging Face snapshot's folder: before, only 'neither a checkpoint folder nor a run folder'."""
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    ok("export", micro_run, "--out", snapshot / "model.safetensors")
    with pytest.raises(ConfigError, match=f"it holds {snapshot / 'model.safetensors'}: to finetune from it, pass that "
                                          "file to --from-ckpt"):
        read_state_dict(snapshot)
    assert read_state_dict(snapshot / "model.safetensors").keys()


def test_finetune_reads_exports_run_folders_checkpoints_and_old_single_files(micro_run, tmp_path):
    weights = ckpt.consolidated(ckpt.list_checkpoints(micro_run)[-1])
    ok("export", micro_run, "--out", tmp_path / "w.safetensors")
    old = tmp_path / "step-00000003.pt"  # what vitctl wrote before checkpoints became DCP folders
    torch.save({"format": "vitctl-checkpoint/1", "model": weights, "optimizer": {}}, old)
    for source in (tmp_path / "w.safetensors", micro_run, ckpt.list_checkpoints(micro_run)[-1], old):
        got = read_state_dict(source)
        assert got.keys() == weights.keys() and all(torch.equal(got[k], weights[k]) for k in weights), source


def test_finetune_from_a_run_folder_at_a_new_resolution(prepared_shards, micro_run, tmp_path):
    result = run(prepared_shards, tmp_path / "ft", "model.name=vit_micro", "model.img_size=48", "train.max_steps=1",
                 f"finetune.from_ckpt={micro_run}")
    assert result["step"] == 1


def test_a_run_folder_of_single_file_checkpoints_is_not_resumed_but_explained(prepared_shards, tmp_path):
    (tmp_path / "run/checkpoints").mkdir(parents=True)
    torch.save({"format": "vitctl-checkpoint/1", "model": {}}, tmp_path / "run/checkpoints/step-00000005.pt")
    with pytest.raises(ConfigError, match="already holds checkpoints .last: step-00000005.pt.; pass --resume"):
        run(prepared_shards, tmp_path / "run", "model.name=vit_micro", "train.max_steps=1")
    with pytest.raises(ConfigError, match="single-file checkpoints of an earlier vitctl .* which --resume cannot "
                                          "continue; start a new run from its weights"):
        train(load_config(None, [*BASE, "model.name=vit_micro", f"data.path={prepared_shards}",
                                 f"train.out_dir={tmp_path / 'run'}"]), resume=True)


def test_a_checkpoint_folder_with_another_step_is_refused_and_its_run_folder_takes_the_step(micro_run, tmp_path):
    folder, out = micro_run / "checkpoints/step-00000003", tmp_path / "w.safetensors"
    result = vitctl("export", folder, "--step", 2, "--out", out)
    assert result.exit_code == 1 and not out.exists()
    assert (f"error: {folder} is the checkpoint of step 3, not of --step 2: drop --step to take this one, or give "
            f"its run folder {micro_run} with --step 2") in result.stderr, result.stderr
    assert "step-00000002" in ok("export", micro_run, "--step", 2, "--out", out).output
    assert "step-00000003" in ok("export", folder, "--step", 3, "--out", out).output
    result = vitctl("export", folder, "--step", 7, "--out", out)  # a step the run lacks: only drop --step helps
    assert result.exit_code == 1 and (f"{folder} is the checkpoint of step 3, not of --step 7: drop --step to take "
                                      f"this one; its run {micro_run} has no checkpoint of step 7 either (it has "
                                      "steps ") in result.stderr, result.stderr


def test_out_under_a_file_is_refused_and_moving_the_file_away_lets_it_export(micro_run, tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    out = blocker / "w.safetensors"
    result = vitctl("export", micro_run, "--out", out)
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr
    assert f"error: --out {out}: {blocker} is a file, not a folder; move it away or choose another --out" \
        in result.stderr, result.stderr
    blocker.unlink()
    ok("export", micro_run, "--out", out)
    assert load_file(out).keys()


def test_out_in_a_folder_this_user_may_not_write_is_one_clear_line(micro_run, tmp_path, monkeypatch):
    out = tmp_path / "ro/w.safetensors"

    def refuse(path, *args, **kwargs):  # what creating a file in a read-only folder raises (root passes chmod)
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    with monkeypatch.context() as patch:
        patch.setattr(atomic, "open", refuse, raising=False)
        result = vitctl("export", micro_run, "--out", out)
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr
    assert (f"error: --out {out}: cannot write in {out.parent}: permission denied; give this user write access "
            "there, or choose another --out") in result.stderr, result.stderr
    assert list(out.parent.iterdir()) == []
    ok("export", micro_run, "--out", tmp_path / "w.safetensors")


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv (util-linux)")
@pytest.mark.parametrize(("denied", "said"), [
    ("checkpoints/step-00000003/meta.json", "checkpoint {step}: this user may not read meta.json (permission denied); "
                                            "give this user read access to it (`ls -l {step}` shows owner and mode)"),
    ("checkpoints/step-00000003/__0_0.distcp", "checkpoint {step}: this user may not read __0_0.distcp"),
    ("checkpoints", "error: {run}/checkpoints: permission denied fix: give this user access to it")])
def test_a_checkpoint_file_this_user_may_not_read_is_one_clear_line_before_launch(micro_run, prepared_shards, tmp_path,
                                                                                  denied, said):
    """Before: a traceback ending in PermissionError from export and finetune's preflight; a shard file of the
    checkpoint let finetune launch, and its rank failed."""
    run = tmp_path / "run"
    shutil.copytree(micro_run, run)
    (run / denied).chmod(0)
    said = said.format(run=run, step=run / "checkpoints/step-00000003")
    finetune = ["finetune", "--from-ckpt", run, "--data", prepared_shards, "--out", tmp_path / "ft", "--executor",
                "local", "--gpus", 0, "--dry-run", *(arg for key in BASE for arg in ("--set", key))]
    for args in (["export", run, "--out", tmp_path / "w.safetensors"], finetune):
        done = subprocess.run([*AS_A_USER, *map(str, args)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 1 and said in " ".join(done.stderr.split()), done.stderr
        assert "Traceback" not in done.stderr
    (run / denied).chmod(0o755 if (run / denied).is_dir() else 0o644)
    ok("export", run, "--out", tmp_path / "w.safetensors")  # the fix followed


def test_out_in_an_immutable_folder_is_told_the_flag_that_stops_root(micro_run, tmp_path):
    """Before: `give this user write access there`, which root has; the immutable flag stopped the write."""
    folder = tmp_path / "frozen"
    folder.mkdir()
    if subprocess.run(["chattr", "+i", folder], capture_output=True).returncode:
        pytest.skip("chattr +i is not available on this filesystem")
    try:  # also into a folder to be made in it: the immutable one is named (was: the one that did not exist)
        results = [vitctl("export", micro_run, "--out", folder / name) for name in ("w.safetensors", "a/w.safetensors")]
    finally:
        subprocess.run(["chattr", "-i", folder], check=True)
    for result in results:
        assert result.exit_code == 1 and f"{folder} takes no new files: operation not permitted (an immutable " \
            f"folder, with an i in `lsattr -d {folder}`, needs `chattr -i {folder}`); choose another --out" in \
            " ".join(result.stderr.split()), result.stderr
    ok("export", micro_run, "--out", folder / "w.safetensors")  # the fix followed


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_out_on_a_file_system_that_takes_no_files_says_so(micro_run):
    """Before: `No such file or directory` for a folder that exists, with a fix naming permissions and free space."""
    result = vitctl("export", micro_run, "--out", "/proc/w.safetensors")
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr
    assert ("error: --out /proc/w.safetensors: cannot write in /proc: its file system takes no new files (a virtual "
            "one, as /proc and /sys are); choose another --out") in result.stderr, result.stderr


def _diverged_checkpoint(run: Path, step: int) -> None:
    """A checkpoint of non-finite weights, as a vitctl that did not check its runs for divergence saved them."""
    previous = ckpt.list_checkpoints(run)[-1]
    weights = {name: tensor.clone() for name, tensor in ckpt.consolidated(previous).items()}
    weights["head.weight"][0, :3] = float("nan")
    meta = {k: v for k, v in ckpt.read_meta(previous).items() if k not in ("format", "files")} | {"step": step}
    ckpt.CheckpointWriter(run, 10, True, False).save(step, {"model": weights}, meta)


def test_export_refuses_non_finite_weights_and_the_checkpoint_it_names_exports(micro_run, tmp_path):
    run, out = Path(shutil.copytree(micro_run, tmp_path / "run")), tmp_path / "w.safetensors"
    _diverged_checkpoint(run, 4)
    result = vitctl("export", run, "--out", out)
    assert result.exit_code == 1 and not out.exists() and "Traceback" not in result.output + result.stderr
    assert (f"error: checkpoint {run / 'checkpoints/step-00000004'} holds non-finite weights (tensor head.weight: 3 "
            "inf or nan values): its run diverged before it was saved; export the checkpoint before it instead "
            f"(vitctl export {run} --step 3 --out {out})") in result.stderr, result.stderr
    fix = re.search(r"\(vitctl (export [^)]*)\)", result.stderr).group(1).split()
    assert "step-00000003" in ok(*fix).output
    assert all(torch.isfinite(t).all() for t in load_file(out).values())


def test_a_checkpoint_removed_while_export_reads_it_gives_way_to_the_runs_last(micro_run, tmp_path, monkeypatch):
    """A run still training removes checkpoints past its last train.keep_checkpoints: export of its run folder ended
    in a FileNotFoundError traceback (meta.json, a .distcp file) when it read one being removed."""
    from vitctl.workflows import export

    run, read, removed = tmp_path / "run", export.consolidated, []
    shutil.copytree(micro_run, run)
    earlier, latest = ckpt.list_checkpoints(run)[-2:]

    def removed_the_first_time(source, part):
        if not removed:
            removed.append(source.name)
            shutil.rmtree(source)
        return read(source, part)

    monkeypatch.setattr(export, "consolidated", removed_the_first_time)
    assert export.export_weights(run, tmp_path / "w.safetensors").checkpoint.name == earlier.name
    assert removed == [latest.name]
    removed.clear()
    with pytest.raises(ConfigError, match=f"checkpoint {re.escape(str(earlier))} was removed while it was read: its "
                                          "run is still training, .* run the same command again without --step, or "
                                          "with the step of a checkpoint it keeps"):
        export.export_weights(run, tmp_path / "w.safetensors", step=int(earlier.name[5:]))


def test_a_checkpoint_removed_as_dcp_reads_it_gives_way_without_a_traceback(micro_run, tmp_path, monkeypatch,
                                                                           caplog):
    """A run's rotation removed the checkpoint between its checksums and DCP's read: DCP logged `Global metadata is
    not found` with a traceback before export went on to the run's last checkpoint."""
    from vitctl.workflows import export

    run, listed, removed = tmp_path / "run", ckpt.stored_tensors, []
    shutil.copytree(micro_run, run)
    earlier, latest = ckpt.list_checkpoints(run)[-2:]

    def removed_once_listed(path, prefix):
        tensors = listed(path, prefix)
        if not removed:
            removed.append(path.name)
            shutil.rmtree(path)
        return tensors

    monkeypatch.setattr(ckpt, "stored_tensors", removed_once_listed)
    assert export.export_weights(run, tmp_path / "w.safetensors").checkpoint.name == earlier.name
    assert removed == [latest.name]
    assert "Global metadata is not found" not in caplog.text, caplog.text  # DCP logs it to the root logger


def test_an_out_ending_with_a_slash_is_refused_not_written_as_a_file(micro_run, tmp_path):
    """`--out exp/` wrote the export as a file named exp: Path drops the slash."""
    result = vitctl("export", micro_run, "--out", f"{tmp_path / 'exp'}/")
    assert result.exit_code == 2 and f"Invalid value for '--out': '{tmp_path / 'exp'}/' ends with a slash, which " \
        "names a folder; give a file's name" in result.stderr, result.stderr
    assert not (tmp_path / "exp").exists()
