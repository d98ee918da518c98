"""Consolidated weights out of a run: one safetensors file with timm's parameter names and shapes and a sha256 of its
tensors, which `finetune --from-ckpt` verifies."""

import errno
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save

from vitctl.datasets.atomic import atomic_open
from vitctl.datasets.oserrors import as_data_error, file_in_the_way, what_it_is, write_refusal
from vitctl.trainer.checkpoint import check_files, consolidated, list_checkpoints, read_meta, resolve_checkpoint
from vitctl.trainer.config import ConfigError
from vitctl.trainer.integrity import nonfinite, tensors_sha256
from vitctl.trainer.models import MODELS, default_window
from vitctl.trainer.models.layers import timm_layout
from vitctl.trainer.pretrained import EXPORT_SHA256
from vitctl.trainer.recipe import model_eval

from .out_file import replacing_refusal


@dataclass(frozen=True)
class Export:
    checkpoint: Path
    out: Path
    tensors: int
    parameters: int
    model: str
    timm: str  # how timm reads the file, or why it cannot


def timm_call(config: dict, out: Path) -> str:
    """The `timm.create_model` call that builds the run's model with the export's weights, head included, and the
    eval view it was trained for; or why none does. The class count goes in the overlay too: given only as a keyword,
    timm drops a head of another size."""
    model = config["model"]
    spec = MODELS.get(model["name"])
    if spec is None or spec.timm_name is None:
        return f"timm has no {model['name']}; `vitctl finetune --from-ckpt {shlex.quote(str(out))}` reads it"
    if model.get("pre_logits"):
        return ("timm's ViT has no pre-logits layer (it drops one on loading); `vitctl finetune --from-ckpt "
                f"{shlex.quote(str(out))}` reads it")
    size = model["img_size"]
    overlay = {"file": str(out.absolute()), "num_classes": model["num_classes"], **_eval_view(config)}
    extra = ""
    if size != 224:
        overlay["input_size"] = (3, size, size)
        extra += f", img_size={size}"
    if spec.family == "swin" and (window := model.get("window_size") or default_window(size)) != 7:
        extra += f", window_size={window}"
    return f"timm.create_model({spec.timm_name!r}, pretrained=True, pretrained_cfg_overlay={overlay!r}{extra})"


def _eval_view(config: dict) -> dict:
    """The run's eval preprocessing in timm's pretrained_cfg keys (what timm.data.resolve_data_config reads): its
    own where the config sets it, else the model family's, as the trainer resolves them (recipe.model_eval)."""
    model, data, view = config["model"], config.get("data", {}), config.get("eval", {})
    defaults = model_eval(model["name"], model["img_size"])
    return {"mean": tuple(data.get("mean") or defaults.mean), "std": tuple(data.get("std") or defaults.std),
            "crop_pct": view.get("crop_pct") or defaults.crop_pct, "crop_mode": view.get("crop_mode") or
            defaults.crop_mode, "interpolation": view.get("interpolation") or defaults.interpolation}


def export_weights(run: Path, out: Path, step: int | None = None, ema: bool = False) -> Export:
    """The weights (or their EMA) of a run's last checkpoint, or of `step`'s, written atomically to `out`."""
    _check_out(out)
    part = "ema" if ema else "model"
    source, meta, weights = _read(run, step, part)
    if bad := nonfinite(weights):
        raise ConfigError(_nonfinite(source, part, bad, out))
    tensors = {name: tensor.contiguous() for name, tensor in timm_layout(weights).items()}
    model = meta["config"]["model"]
    _write(out, tensors, {"format": "pt", "vitctl_model": json.dumps(model), "vitctl_step": str(meta["step"]),
                          "vitctl_weights": part, "vitctl_checkpoint": str(source.resolve()),
                          EXPORT_SHA256: tensors_sha256(tensors)})
    return Export(source, out, len(tensors), sum(t.numel() for t in tensors.values()), model["name"],
                  timm_call(meta["config"], out))


READ_ATTEMPTS = 3  # a run that saves every few seconds and keeps one checkpoint may remove each one export takes


def _read(run: Path, step: int | None, part: str) -> tuple[Path, dict, dict[str, torch.Tensor]]:
    """The checkpoint `run` and `step` resolve to, its meta.json and its `part` weights. A run still training removes
    its checkpoints past the last train.keep_checkpoints: one removed while read gives way to the run's last."""
    attempts = 0
    while True:
        source = resolve_checkpoint(run, step)
        try:
            check_files(source)  # named as a checkpoint's file, not by the OS error consolidated would meet
            return source, read_meta(source), consolidated(source, part)
        except (OSError, ConfigError):
            attempts += 1
            if source.exists():  # not removed while read: the error says what is wrong with it
                raise
            if step is not None or attempts == READ_ATTEMPTS:
                again = "" if step is None else " without --step, or with the step of a checkpoint it keeps"
                raise ConfigError(f"checkpoint {source} was removed while it was read: its run is still training, "
                                  f"and keeps only its last train.keep_checkpoints; run the same command "
                                  f"again{again}") from None


TORCH_SAVE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def _check_out(out: Path) -> None:
    """Refuse an --out that cannot become a file (a folder, a path under something that is not a folder), or whose
    writing would destroy something: a file that is not an export (writing over an earlier export is how a damaged one
    is replaced), or anything in a checkpoint folder (its own files, or a file keep-last-K would trip over)."""
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file name such as {out / 'model.safetensors'}")
    if out.suffix in TORCH_SAVE_SUFFIXES:  # torch.load, which such a name invites, fails on a safetensors file
        raise ConfigError(f"--out {out}: {out.suffix} names a torch.save file, and an export is a safetensors file; "
                          f"name it {out.with_suffix('.safetensors')}")
    if blocker := file_in_the_way(out.parent):
        raise ConfigError(f"--out {out}: {what_it_is(blocker)}, not a folder; move it away or choose another --out")
    if refusal := replacing_refusal(out):
        raise ConfigError(refusal)
    if out.is_file() and out.stat().st_size and not _is_export(out):
        raise ConfigError(f"--out {out} exists and is not a vitctl export (no {EXPORT_SHA256} in its safetensors "
                          "header): writing over it would destroy it; choose another --out, or move the file away "
                          "first")


def _is_export(path: Path) -> bool:
    """Whether `path` begins with the safetensors header of a `vitctl export`; its tensors may be damaged (the header
    is read alone, so a damaged export can be written again)."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if length > min(path.stat().st_size, 1 << 27):
                return False
            header = json.loads(f.read(length))
    except (OSError, ValueError):
        return False
    return isinstance(header, dict) and EXPORT_SHA256 in (header.get("__metadata__") or {})


WRITE_FIXES = {
    errno.EACCES: "give this user write access there, or choose another --out",
    errno.ENOSPC: "free space there, or choose an --out on another device",
    errno.EDQUOT: "free space within your quota, or choose an --out elsewhere",
}


def _write(out: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """The safetensors file, under a temporary name until complete and durable; an OS refusal as one line."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(out) as f:
            f.write(save(tensors, metadata))
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and (refusal := write_refusal(out)):
            raise ConfigError(f"--out {out}: {refusal}; choose another --out") from None
        what, fix = as_data_error(e, out.parent).what, WRITE_FIXES.get(e.errno, "choose another --out")
        if e.errno == errno.ENOENT and out.parent.is_dir():
            what = "its file system takes no new files (a virtual one, as /proc and /sys are)"
        raise ConfigError(f"--out {out}: cannot write in {out.parent}: {what}; {fix}") from None


def _nonfinite(source: Path, part: str, bad: tuple[str, int], out: Path) -> str:
    """What a diverged checkpoint holds, and the export of the checkpoint before it (where its run has one)."""
    name, count = bad
    earlier = [p for p in list_checkpoints(source.parent.parent) if p.name < source.name]
    what = (f"checkpoint {source} holds non-finite {'EMA ' if part == 'ema' else ''}weights (tensor {name}: {count} "
            "inf or nan values): its run diverged before it was saved")
    if not earlier:
        return f"{what}, and its run folder holds no earlier checkpoint; train again with a lower optim.lr"
    command = shlex.join(["vitctl", "export", str(source.parent.parent), "--step", str(int(earlier[-1].name[5:])),
                          "--out", str(out)])
    return f"{what}; export the checkpoint before it instead ({command}{' --ema' if part == 'ema' else ''})"
