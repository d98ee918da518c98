"""Load weights for finetuning: our exports (safetensors), run folders and checkpoints (current and single-file),
timm and official Swin checkpoints, plain state_dicts.

Every source is checked before its weights are used: ours against the checksums written with them, all for
non-finite values. A file holding Python objects besides tensors is unpickled in full (which can run code) only when
the user trusts it (finetune.trust_checkpoint).

Swaps the head when the class count differs (a new head is seeded apart from the pretraining's), drops a pretraining
MLP head, and interpolates ViT position embeddings and Swin relative-position tables to the new resolution or window.
"""

import contextlib
import hashlib
import json
import logging
import math
import os
import pickle
import re
import shlex
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn
from torch.serialization import MAGIC_NUMBER, get_unsafe_globals_in_checkpoint

from vitctl.datasets.errors import count

from .checkpoint import consolidated, read_meta, resolve_checkpoint, stored_tensors
from .checkpoint_files import list_checkpoints
from .config import ConfigError
from .integrity import nonfinite, tensors_sha256
from .models import weights_of
from .models.layers import copy_whole, init_module, packed_layout, timm_layout

log = logging.getLogger("vitctl.finetune")
HEAD_PREFIXES = ("head.", "pre_logits.")
EXPORT_SHA256 = "vitctl_sha256"  # safetensors metadata key: the digest `vitctl export` takes of the tensors
HEAD_SEED_SALT = "vitctl finetune head"
ACCEPTED = ("accepted: a vitctl run or checkpoint folder, a .safetensors file (`vitctl export`, timm), or a torch.save "
            "file (.pt, .pth, .bin: timm, official Swin, vitctl 0.1 checkpoints)")
DCP_METADATA = ".metadata"  # what torch.distributed.checkpoint writes beside a checkpoint's shard files
ZIP_MAGIC = b"PK\x03\x04"  # torch.save since torch 1.6 writes a zip archive
LEGACY_MAGIC = pickle.dumps(MAGIC_NUMBER, protocol=2)  # before, a pickle stream opening with this number
UNSAFE_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")
OFFICIAL_SWIN = re.compile(r"swin_(tiny|small|base|large)_patch4_window\d+_\d+(_22k(to1k)?)?\.pth")


def missing_source(source: str, key: str) -> str:
    """Weights that are not there; a timm model name (or hf-hub id) in their place is told how to save its weights
    where there is network, as vitctl downloads nothing."""
    said = f"{key} {source}: no such file or folder"
    if Path(source).is_symlink():  # the link is there; what it points to is not
        return (f"{key} {source} is a broken symbolic link (to {os.readlink(source)}): restore what it points to, or "
                "pass the weights' own path")
    if "/" in source and not Path(source).is_absolute():  # in a config file it reads as relative to that file
        said += f" (a relative path is read from the current folder, {Path.cwd()})"
    if OFFICIAL_SWIN.fullmatch(Path(source).name):
        return (f"{said}: {Path(source).name} is an official Swin release file, and vitctl downloads nothing; where "
                "there is network, download it from https://github.com/SwinTransformer/storage/releases "
                "(microsoft/Swin-Transformer's README links each file), then pass --from-ckpt with its path")
    name = source.removeprefix("hf-hub:").removeprefix("timm:").removeprefix("timm/")
    if not re.fullmatch(r"[\w.-]+", name):
        return said
    import timm  # a second or two, on this error's path only

    if not timm.is_model(name):
        return said
    file = f"{name}.safetensors"
    return (f"{said}: {name} is a timm model, and vitctl reads weights from files only (it downloads nothing); where "
            f"there is network, `python -c \"import timm, safetensors.torch as st; st.save_file(timm.create_model("
            f"'{name}', pretrained=True).state_dict(), '{file}')\"` saves them, then pass --from-ckpt {file}")


def source_kind(path: Path, trust: bool) -> str:
    """folder, safetensors, zip or legacy (the two torch.save formats), checked as far as it can be without reading
    the tensors; a ConfigError says what the source is not. Cheap: preflight calls it before launch."""
    if path.is_dir():
        read_meta(resolve_checkpoint(path))
        return "folder"
    if not path.exists():
        raise ConfigError(missing_source(str(path), "finetune.from_ckpt"))
    if not path.is_file():
        raise ConfigError(f"finetune.from_ckpt {path} is neither a file nor a folder; {ACCEPTED}")
    if (path.parent / DCP_METADATA).is_file():  # its shards alone are no checkpoint: "damaged" would mislead
        raise ConfigError(f"finetune.from_ckpt {path} is one file of the checkpoint folder {path.parent}; pass that "
                          f"folder, or the run folder for its last checkpoint")
    kind = _file_kind(path)
    if kind == "zip":
        try:
            unsafe = get_unsafe_globals_in_checkpoint(path)
        except (RuntimeError, ValueError) as e:
            raise ConfigError(_unreadable(path, e)) from None
        if unsafe and not trust:
            raise ConfigError(_needs_trust(path, unsafe))
    elif kind == "safetensors":
        _safetensors_metadata(path)
    return kind


def _file_kind(path: Path) -> str:
    """By the first bytes (safetensors: a little-endian header length, then the JSON header)."""
    size = path.stat().st_size
    if not size:
        raise ConfigError(f"finetune.from_ckpt {path} is empty (0 bytes), not a checkpoint; {ACCEPTED}")
    with open(path, "rb") as f:
        head = f.read(len(LEGACY_MAGIC))
    if head.startswith((ZIP_MAGIC, LEGACY_MAGIC)) and path.suffix == ".safetensors":  # torch.load goes by the suffix
        raise ConfigError(f"finetune.from_ckpt {path} holds a torch.save file but is named .safetensors, which "
                          f"torch.load hands to safetensors; rename it, e.g. to {path.with_suffix('.pth')}")
    if head.startswith(ZIP_MAGIC):
        return "zip"
    if head.startswith(LEGACY_MAGIC):
        return "legacy"
    if looks_like_safetensors(path):
        return "safetensors"
    raise ConfigError(f"finetune.from_ckpt {path} is not a checkpoint: neither a torch.save file nor a safetensors "
                      f"file (it starts with {head[:12]!r}); {ACCEPTED}")


def looks_like_safetensors(path: Path) -> bool:
    """By the name, or the first bytes: a little-endian header length that fits in the file, then the JSON header."""
    with open(path, "rb") as f:
        head = f.read(9)
    return path.suffix == ".safetensors" or (8 + int.from_bytes(head[:8], "little") <= path.stat().st_size
                                             and head[8:9] == b"{")


def read_state_dict(path: Path, trust: bool = False) -> dict[str, torch.Tensor]:
    """The weights of `path`, verified against their checksums (ours) and checked for non-finite values (all), with
    timm's qkv shapes in our models' (PackedQKV)."""
    kind = source_kind(path, trust)
    if kind == "folder":  # a run folder (its last checkpoint) or one checkpoint folder; consolidated verifies it
        state = consolidated(resolve_checkpoint(path))
    elif kind == "safetensors":
        state = _read_safetensors(path)
    else:
        state = _tensors_of(path, _read_torch(path, trust))
    if bad := nonfinite(state):
        raise ConfigError(f"finetune.from_ckpt {path}: tensor {bad[0]} holds {count(bad[1], 'non-finite value')} "
                          "(inf or nan); the weights are damaged or come from a run that diverged: use another "
                          "checkpoint")
    return packed_layout(state)


def exported_model(path: Path) -> dict[str, Any] | None:
    """The model config a `vitctl export` recorded in a safetensors file; None for other files."""
    try:
        model = json.loads(_safetensors_metadata(path).get("vitctl_model", "null"))
    except json.JSONDecodeError:
        return None
    return model if isinstance(model, dict) else None


def _safetensors_metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(path, "pt") as f:
            return f.metadata() or {}
    except SafetensorError as e:
        raise ConfigError(_unreadable_safetensors(path, e)) from None


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    metadata = _safetensors_metadata(path)
    try:
        state = load_file(path)
    except SafetensorError as e:
        raise ConfigError(_unreadable_safetensors(path, e)) from None
    if EXPORT_SHA256 in metadata and tensors_sha256(state) != metadata[EXPORT_SHA256]:
        raise ConfigError(f"finetune.from_ckpt {path} is damaged: its tensors do not match the sha256 `vitctl export` "
                          f"recorded in it; {_export_again(path, metadata)}")
    return state


def _export_again(path: Path, metadata: dict[str, str]) -> str:
    """The export command that writes `path` again, from its checkpoint, else from the last one of that run."""
    recorded = metadata.get("vitctl_checkpoint")
    ema = " --ema" if metadata.get("vitctl_weights") == "ema" else ""
    if recorded is None or Path(recorded).is_dir():
        return f"export it again ({shlex.join(['vitctl', 'export', recorded or 'RUN', '--out', str(path)])}{ema})"
    source = Path(recorded)
    run = source.parent.parent
    if source.parent.name == "checkpoints" and list_checkpoints(run):  # keep_checkpoints removed it since
        return (f"its checkpoint {source} is gone since; export that run's last one in its place ("
                f"{shlex.join(['vitctl', 'export', str(run), '--out', str(path)])}{ema}), or copy the export again "
                "from where it is kept")
    return f"its checkpoint {source} is gone too: copy the export again from where it is kept"


def _unreadable_safetensors(path: Path, error: Exception) -> str:
    """Why safetensors could not read `path`: cut short (its header gives the length it needs), or else its words."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError, IndexError):
        with open(path, "rb") as f:
            header_length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_length))
        needed = 8 + header_length + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                                         default=0)
        if (size := path.stat().st_size) < needed:
            return (f"finetune.from_ckpt {path} is cut short: it holds {size:,} of the {needed:,} bytes its header "
                    "lists (a copy or download that stopped); copy it again")
    return f"finetune.from_ckpt {path} is not a readable safetensors file ({error}); {ACCEPTED}"


def _read_torch(path: Path, trust: bool) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        needed = UNSAFE_GLOBAL.search(str(e))
        if needed is None:
            raise ConfigError(_unreadable(path, e)) from None
        if not trust:
            raise ConfigError(_needs_trust(path, [needed.group(1)])) from None
    except (RuntimeError, EOFError) as e:
        raise ConfigError(_unreadable(path, e)) from None
    log.warning("%s: unpickling it in full, as finetune.trust_checkpoint allows", path)
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except ModuleNotFoundError as e:
        raise ConfigError(f"finetune.from_ckpt {path} pickles objects of the Python module {e.name}, which is not "
                          "installed here; install it to read the file") from None
    except Exception as e:  # full unpickling runs the file's own code, which may raise anything
        raise ConfigError(_unreadable(path, e)) from None


def _tensors_of(path: Path, obj: Any) -> dict[str, torch.Tensor]:
    for key in ("model", "state_dict", "module"):  # ours and official Swin use "model", timm's training "state_dict"
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigError(f"finetune.from_ckpt {path} holds no state_dict of tensors (neither the whole file nor under "
                          f"the keys model, state_dict, module); {ACCEPTED}")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def _needs_trust(path: Path, names: list[str]) -> str:
    return (f"finetune.from_ckpt {path} holds Python objects besides tensors ({', '.join(names)}): this file needs "
            "full unpickling, which can run code; if you trust it, add --trust-checkpoint "
            "(--set finetune.trust_checkpoint=true)")


def _unreadable(path: Path, error: Exception) -> str:
    # The first sentence: torch's messages go on for a paragraph.
    reason = re.split(r"(?<=\.)\s", str(error).strip())[0][:200].rstrip(".") or type(error).__name__
    return (f"finetune.from_ckpt {path} is damaged or not a torch.save file ({reason}); copy it again or use another "
            f"checkpoint; {ACCEPTED}")


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


def _is_square(n: int) -> bool:
    return n > 0 and math.isqrt(n) ** 2 == n


def _resizable(key: str, value: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether `value` is a table the interpolation fits to `target`: ViT's class token and a square grid of patches
    (not DeiT's second, distillation token, nor a grid without class token), or a square Swin table of as many heads.
    Any other stays as it is, and read_pretrained names it a shape mismatch."""
    if key == "pos_embed":
        return (value.ndim == 3 and value.shape[0] == 1 and value.shape[2] == target.shape[2]
                and _is_square(value.shape[1] - 1))
    return (key.endswith("relative_position_bias_table") and value.ndim == 2 and value.shape[1] == target.shape[1]
            and _is_square(value.shape[0]))


def adapt(state: dict[str, torch.Tensor], model: nn.Module, reset_head: bool | None) -> tuple[dict, list[str]]:
    """The state resized to the model; returns it and the keys left to the model's initialisation."""
    target = model.state_dict()
    if "layers.0.downsample.reduction.weight" in state and "layers.0.downsample.reduction.weight" not in target:
        state = official_swin_to_timm(state)
    state = {k: v for k, v in state.items() if not k.endswith(("relative_position_index", "attn_mask"))}
    fresh = []
    for key, value in list(state.items()):
        if key in target and value.shape != target[key].shape and _resizable(key, value, target[key]):
            state[key] = (interpolate_pos_embed(value, target[key].shape[1]) if key == "pos_embed" else
                          interpolate_bias_table(value, target[key].shape[0]))
            if not value.is_meta:  # the check before launch fits shapes alone: the load that follows logs it
                log.info("resized %s %s -> %s", key, tuple(value.shape), tuple(state[key].shape))
    head_differs = any(k.startswith(HEAD_PREFIXES) and (k not in target or state[k].shape != target[k].shape)
                       for k in state)
    if reset_head or (reset_head is None and head_differs):
        if not any(v.is_meta for v in state.values()):  # as above: logged by the load, not the check before launch
            misfits = [f"{k} {tuple(v.shape)} -> {tuple(target[k].shape)}" for k, v in state.items()
                       if k.startswith(HEAD_PREFIXES) and k in target and v.shape != target[k].shape]
            log.info("a new head: %s", "finetune.reset_head=true" if reset_head else
                     f"the file's does not fit the model ({', '.join(misfits) or 'other keys'})")
        state = {k: v for k, v in state.items() if not k.startswith(HEAD_PREFIXES)}
        fresh = sorted(k for k in target if k.startswith(HEAD_PREFIXES))
    return state, fresh


@dataclass
class Pretrained:
    """Weights read for finetuning, fitted to the model: written over its initialisation by `load_into`."""

    path: Path
    state: dict[str, torch.Tensor]  # whole tensors, by the model's names
    fresh: list[str]  # the model's keys left to a new initialisation (a new head)

    @torch.no_grad()
    def load_into(self, model: nn.Module, seed: int) -> None:
        """Write the weights into `model`, whole or divided (a pipeline stage keeps some of them, a DTensor its
        shard), and initialise the fresh keys from streams of their own: seeded like the pretraining run's, the new
        head would be that run's initial head bit for bit."""
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name in self.state:
                copy_whole(tensor, self.state[name])
        digest = hashlib.sha256(f"{HEAD_SEED_SALT} {seed}".encode()).digest()
        head_seed = int.from_bytes(digest[:8], "little") >> 1
        for name, module in model.named_modules():
            own = [f"{name}.{p}" if name else p for p, _ in module.named_parameters(recurse=False)]
            if own and set(own) <= set(self.fresh):
                init_module(module, name, head_seed)
        log.info("loaded %s (%s%d tensors); initialised afresh: %s", self.path, _origin(self.path), len(self.state),
                 ", ".join(self.fresh) or "nothing")


def _origin(path: Path) -> str:
    """The step a checkpoint folder holds, or the step, checkpoint and weights (EMA) a `vitctl export` recorded, for the
    log."""
    if path.is_dir():
        return f"step {read_meta(path)['step']}, "
    with contextlib.suppress(ConfigError, OSError):  # a file gone since it was read: the log just says less
        if looks_like_safetensors(path) and "vitctl_step" in (meta := _safetensors_metadata(path)):
            ema = "EMA weights " if meta.get("vitctl_weights") == "ema" else ""
            return f"{ema}exported from step {meta['vitctl_step']} of {meta.get('vitctl_checkpoint', 'a run')}, "
    return ""


def read_pretrained(model: nn.Module, path: Path, reset_head: bool | None, model_name: str, *,
                    trust: bool = False) -> Pretrained:
    """`path`'s weights fitted to `model`, whole (on the meta device: only its names and shapes are read); raises
    ConfigError naming the keys when the architectures do not match, or when the source is unusable."""
    source = resolve_checkpoint(path) if path.is_dir() else path  # the log names the checkpoint a run folder meant
    return replace(fit(read_state_dict(source, trust), path, model, reset_head, model_name), path=source)


def shapes_only(path: Path, kind: str) -> dict[str, torch.Tensor] | None:
    """`path`'s tensors as meta tensors of their shapes, read without their data (a checkpoint folder's .metadata, a
    safetensors header, a torch.save zip file mapped to memory), for `fit` before launch; None for the legacy format
    or a file that needs full unpickling, whose tensors only the ranks read."""
    if kind == "folder":
        shapes = {k: meta.size for k, meta in stored_tensors(path).items()}
    elif kind == "safetensors":
        with safe_open(path, "pt") as f:
            shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    elif kind == "zip":
        try:
            obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except pickle.UnpicklingError:  # Python objects, which finetune.trust_checkpoint lets the ranks unpickle
            return None
        except (RuntimeError, EOFError) as e:
            raise ConfigError(_unreadable(path, e)) from None
        shapes = {k: v.shape for k, v in _tensors_of(path, obj).items()}
    else:
        return None
    return packed_layout({k: torch.empty(shape, device="meta") for k, shape in shapes.items()})


def fit(state: dict[str, torch.Tensor], path: Path, model: nn.Module, reset_head: bool | None,
        model_name: str) -> Pretrained:
    """`state` (read from `path`) fitted to `model`; raises ConfigError naming the keys that do not match."""
    state, fresh = adapt(state, model, reset_head)
    target = model.state_dict()
    missing = sorted(set(target) - set(state) - set(fresh))
    unexpected = sorted(set(state) - set(target))
    mismatched = sorted(k for k in set(state) & set(target) if state[k].shape != target[k].shape)
    if missing or unexpected or mismatched:
        def few(keys: list[str]) -> str:
            return ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")

        # in timm's shapes, as exports and timm's files hold them (not the packed qkv the model keeps)
        ours, theirs = (timm_layout({k: torch.empty(d[k].shape, device="meta") for k in mismatched})
                        for d in (state, target))
        shapes = [f"{k} {tuple(ours[k].shape)} -> {tuple(theirs[k].shape)}" for k in mismatched]
        details = [f"{name} ({len(keys)}): {few(keys)}" for name, keys in
                   (("missing", missing), ("unexpected", unexpected), ("shape mismatch, file -> model", shapes))
                   if keys]
        if all(k.startswith(HEAD_PREFIXES) for k in missing + unexpected + mismatched):
            details.append("the checkpoint has no classifier head that fits this model: start a new one with "
                           "--set finetune.reset_head=true")
        else:  # a new head would leave the rest unfitted: these are weights of another architecture
            details.append(_other_architecture(state, model_name))
        raise ConfigError(f"finetune.from_ckpt {path} does not fit model {model_name}: " + "; ".join(details))
    return Pretrained(path, state, fresh)


def _other_architecture(state: dict[str, torch.Tensor], model_name: str) -> str:
    """How to fit weights of another architecture, naming it where a registered model matches."""
    held = weights_of(state)
    if held is None or held[0] == model_name:
        return f"use weights of a {model_name}, or --model set to the architecture they are of"
    name, window = held
    of = name if window is None else f"{name} at window {window}"
    return f"the file holds the weights of a {of}: finetune them with --model {name}, or use weights of a {model_name}"


def load_pretrained(model: nn.Module, path: Path, reset_head: bool | None, model_name: str, *, trust: bool = False,
                    seed: int = 0) -> list[str]:
    """Load `path` into `model` (a new head seeded from `seed`); returns the keys initialised afresh. Raises
    ConfigError as `read_pretrained` does."""
    pretrained = read_pretrained(model, path, reset_head, model_name, trust=trust)
    pretrained.load_into(model, seed)
    return pretrained.fresh
