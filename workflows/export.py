"""Consolidated weights out of a run: one safetensors file with timm's parameter names and shapes and a sha256 of its
tensors, which `finetune --from-ckpt` verifies."""

import json
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from vitctl.datasets.atomic import partial_path, publish
from vitctl.trainer.checkpoint import consolidated, read_meta, resolve_checkpoint
from vitctl.trainer.config import ConfigError
from vitctl.trainer.integrity import tensors_sha256
from vitctl.trainer.models.layers import timm_layout
from vitctl.trainer.pretrained import EXPORT_SHA256


@dataclass(frozen=True)
class Export:
    checkpoint: Path
    out: Path
    tensors: int
    parameters: int
    model: str


def export_weights(run: Path, out: Path, step: int | None = None, ema: bool = False) -> Export:
    """The weights (or their EMA) of a run's last checkpoint, or of `step`'s, written atomically to `out`."""
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give a file name such as {out / 'model.safetensors'}")
    source = resolve_checkpoint(run, step)
    meta = read_meta(source)
    weights = timm_layout(consolidated(source, "ema" if ema else "model"))
    tensors = {name: tensor.contiguous() for name, tensor in weights.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    model = meta["config"]["model"]
    save_file(tensors, str(partial_path(out)), metadata={
        "format": "pt", "vitctl_model": json.dumps(model), "vitctl_step": str(meta["step"]),
        "vitctl_weights": "ema" if ema else "model", "vitctl_checkpoint": str(source.resolve()),
        EXPORT_SHA256: tensors_sha256(tensors)})
    publish(out)
    return Export(source, out, len(tensors), sum(t.numel() for t in tensors.values()), model["name"])
