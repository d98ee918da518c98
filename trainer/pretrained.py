"""Load weights for finetuning: our exports (safetensors), run folders and checkpoints (current and single-file),
timm and official Swin checkpoints, plain state_dicts.

Swaps the head when the class count differs, drops a pretraining MLP head, and interpolates ViT position
embeddings and Swin relative-position tables to the new resolution or window.
"""

import logging
import math
import pickle
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from .checkpoint import consolidated, resolve_checkpoint
from .config import ConfigError

log = logging.getLogger("vitctl.finetune")
HEAD_PREFIXES = ("head.", "pre_logits.")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if path.is_dir():  # a run folder (its last checkpoint) or one checkpoint folder
        return consolidated(resolve_checkpoint(path))
    if not path.is_file():
        raise ConfigError(f"finetune.from_ckpt {path}: no such file or folder")
    if path.suffix == ".safetensors":
        try:
            return load_file(path)
        except SafetensorError as e:
            raise ConfigError(f"finetune.from_ckpt {path}: not a readable safetensors file ({e})") from None
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # Official Swin checkpoints pickle their yacs config; load them only from a path the user chose.
        log.warning("%s holds more than tensors; loading it with full unpickling", path)
        obj = torch.load(path, map_location="cpu", weights_only=False)
    for key in ("model", "state_dict", "module"):  # ours and official Swin use "model"
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigError(f"finetune.from_ckpt {path}: no state_dict of tensors found")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def official_swin_to_timm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Official Swin puts patch merging at the end of stage i; timm (and we) at the start of stage i + 1."""
    out = {}
    for key, value in state.items():
        if key.endswith(("relative_position_index", "attn_mask")):
            continue  # buffers we rebuild
        parts = key.split(".")
        if parts[0] == "layers" and parts[2] == "downsample":
            parts[1] = str(int(parts[1]) + 1)
        elif parts[0] == "head" and parts[1] in ("weight", "bias"):
            parts.insert(1, "fc")
        out[".".join(parts)] = value
    return out


def interpolate_pos_embed(pos: torch.Tensor, tokens: int) -> torch.Tensor:
    """(1, 1 + g*g, D) -> (1, 1 + g'*g', D), bicubic over the patch grid, class token kept."""
    cls, grid = pos[:, :1], pos[:, 1:]
    old, new = math.isqrt(grid.shape[1]), math.isqrt(tokens - 1)
    grid = grid.reshape(1, old, old, -1).permute(0, 3, 1, 2).float()
    grid = F.interpolate(grid, size=(new, new), mode="bicubic", align_corners=False)
    return torch.cat([cls, grid.permute(0, 2, 3, 1).reshape(1, new * new, -1).to(pos.dtype)], dim=1)


def interpolate_bias_table(table: torch.Tensor, rows: int) -> torch.Tensor:
    """((2w-1)^2, heads) -> ((2w'-1)^2, heads), bicubic: a window of 7 becomes one of 12."""
    old, new = math.isqrt(table.shape[0]), math.isqrt(rows)
    grid = table.T.reshape(1, -1, old, old).float()
    grid = F.interpolate(grid, size=(new, new), mode="bicubic", align_corners=False)
    return grid.reshape(-1, new * new).T.contiguous().to(table.dtype)


def adapt(state: dict[str, torch.Tensor], model: nn.Module, reset_head: bool | None) -> tuple[dict, list[str]]:
    """The state resized to the model; returns it and the keys left to the model's initialisation."""
    target = model.state_dict()
    if "layers.0.downsample.reduction.weight" in state and "layers.0.downsample.reduction.weight" not in target:
        state = official_swin_to_timm(state)
    state = {k: v for k, v in state.items() if not k.endswith(("relative_position_index", "attn_mask"))}
    fresh = []
    for key, value in list(state.items()):
        if key not in target or value.shape == target[key].shape:
            continue
        if key == "pos_embed":
            state[key] = interpolate_pos_embed(value, target[key].shape[1])
        elif key.endswith("relative_position_bias_table"):
            state[key] = interpolate_bias_table(value, target[key].shape[0])
    head_differs = any(k.startswith(HEAD_PREFIXES) and (k not in target or state[k].shape != target[k].shape)
                       for k in state)
    if reset_head or (reset_head is None and head_differs):
        state = {k: v for k, v in state.items() if not k.startswith(HEAD_PREFIXES)}
        fresh = sorted(k for k in target if k.startswith(HEAD_PREFIXES))
    return state, fresh


def load_pretrained(model: nn.Module, path: Path, reset_head: bool | None, model_name: str) -> list[str]:
    """Load `path` into `model`; raises ConfigError naming the keys when the architectures do not match."""
    state, fresh = adapt(read_state_dict(path), model, reset_head)
    target = model.state_dict()
    missing = sorted(set(target) - set(state) - set(fresh))
    unexpected = sorted(set(state) - set(target))
    mismatched = sorted(k for k in set(state) & set(target) if state[k].shape != target[k].shape)
    if missing or unexpected or mismatched:
        def few(keys: list[str]) -> str:
            return ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")

        details = [f"{name} ({len(keys)}): {few(keys)}" for name, keys in
                   (("missing", missing), ("unexpected", unexpected), ("shape mismatch", mismatched)) if keys]
        raise ConfigError(f"finetune.from_ckpt {path} does not fit model {model_name}: " + "; ".join(details))
    model.load_state_dict(state, strict=False)
    log.info("loaded %s (%d tensors); initialised afresh: %s", path, len(state), ", ".join(fresh) or "nothing")
    return fresh
