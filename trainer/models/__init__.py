"""The registered models (registry.py) built by name, and what their registry entry tells without building them."""

import math
import re
from dataclasses import dataclass

from torch import Tensor, nn

from ..config import ConfigError, ModelConfig
from ..ops import Ops
from ..registry import MODELS, ModelSpec
from . import swin, vit
from .swin import SwinTransformer
from .vit import VisionTransformer

FAMILIES: dict[str, type[nn.Module]] = {"vit": VisionTransformer, "swin": SwinTransformer}


@dataclass(frozen=True)
class ModelShape:
    """What the strategy is checked against: the model's blocks and each block's attention heads."""

    name: str
    heads: tuple[int, ...]  # per block, in order
    hidden: tuple[int, ...] = ()  # MLP hidden units per block

    @property
    def n_blocks(self) -> int:
        return len(self.heads)


def default_window(img_size: int) -> int:
    return 12 if img_size % 384 == 0 else 7


def model_error(config: ModelConfig) -> str | None:
    """Why this model cannot be built (unknown name, image size vs patch or window), or None."""
    spec = MODELS.get(config.name)
    if spec is None:
        return f"model.name {config.name!r} is unknown; models: {', '.join(MODELS)}"
    if spec.family == "swin":
        error = swin.geometry_error(config.img_size, config.window_size or default_window(config.img_size),
                                    spec.kwargs["depths"])
        if error and config.window_size is None:  # plan and bench have no window option: say where 7 came from
            error += (f" (the default window at {config.img_size} px, 12 at multiples of 384; `vitctl train` takes "
                      "another as --set model.window_size=W, `vitctl plan` and `bench` only the default)")
        if config.pre_logits:  # a ViT setting: Swin would build without it, unsaid
            error = "model.pre_logits=true is a ViT setting (its head's hidden layer), and Swin has none; pass --set " \
                    "model.pre_logits=false"
    else:
        error = vit.geometry_error(config.img_size, spec.kwargs["patch"])
        if config.window_size is not None:  # from a Swin preset, or --set: the run's config would record it
            error = f"model.window_size={config.window_size} is a Swin setting, and a ViT has no windows; pass --set " \
                    "model.window_size=null"
    return error and f"model {config.name}: {error}"


def model_shape(config: ModelConfig) -> ModelShape:
    """Each block's heads and MLP width, as parallel strategies are checked against them (no model is built)."""
    spec = MODELS[config.name]
    if spec.family == "swin":
        heads = tuple(h for depth, h in zip(spec.kwargs["depths"], spec.kwargs["heads"], strict=True)
                      for _ in range(depth))
    else:
        heads = (spec.kwargs["heads"],) * spec.kwargs["depth"]
    ratio = spec.kwargs.get("mlp_ratio", 4.0)
    return ModelShape(config.name, heads, tuple(int(width * ratio) for width in block_widths(config)))


def block_widths(config: ModelConfig) -> tuple[int, ...]:
    """Each block's embedding width (its qkv's, proj's and fc1's input), in order (no model is built)."""
    spec = MODELS[config.name]
    if spec.family == "swin":
        return tuple(spec.kwargs["dim"] * 2**i for i, depth in enumerate(spec.kwargs["depths"]) for _ in range(depth))
    return (spec.kwargs["dim"],) * spec.kwargs["depth"]


def build_model(config: ModelConfig, ops: Ops, seed: int = 0) -> nn.Module:
    """The model, initialised from `seed` (`init_weights`); under `torch.device("meta")` it holds no memory and no
    values until `to_empty` and `init_weights`, which the training loop calls after the parallelisms divide it."""
    if error := model_error(config):
        raise ConfigError(error)
    spec = MODELS[config.name]
    kwargs = dict(spec.kwargs, img_size=config.img_size, num_classes=config.num_classes, drop_path=config.drop_path,
                  seed=seed)
    if spec.family == "swin":
        kwargs["window"] = config.window_size or default_window(config.img_size)
    elif config.pre_logits:
        kwargs["pre_logits"] = True
    return FAMILIES[spec.family](ops, **kwargs)


def stream_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The weights added to the residual stream outside the blocks (ViT's class token and position embedding), whose
    dtype sets the stream's under autocast; those this rank holds (a pipeline stage may hold neither)."""
    if not isinstance(model, VisionTransformer):
        return []
    return [p for p in (model.cls_token, model.pos_embed) if p is not None]


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks in forward order: the units of checkpointing, FSDP and pipeline stages."""
    from .layers import CheckpointableBlock

    return [m for m in model.modules() if isinstance(m, CheckpointableBlock)]


def weights_of(state: dict[str, Tensor]) -> tuple[str, int | None] | None:
    """The registered model whose weights `state` (timm's names) holds, and a Swin's window; None when none fits."""
    embed = state.get("patch_embed.proj.weight")
    if embed is None or embed.ndim != 4:
        return None
    family = "vit" if "pos_embed" in state else "swin"
    if not {key.split(".")[0] for key in state} <= FAMILIES[family].STATE_ROOTS:
        return None
    if family == "vit":
        depth = _count(state, r"blocks\.(\d+)\.")
        fc1 = state.get("blocks.0.mlp.fc1.weight")
        found = {"family": "vit", "patch": embed.shape[-1], "dim": embed.shape[0], "depth": depth,
                 "hidden": fc1.shape[0] if fc1 is not None else None}
        window = None
    else:
        stages = _count(state, r"layers\.(\d+)\.")
        depths = tuple(_count(state, rf"layers\.{i}\.blocks\.(\d+)\.") for i in range(stages))
        tables = [state.get(f"layers.{i}.blocks.0.attn.relative_position_bias_table") for i in range(stages)]
        if any(t is None or t.ndim != 2 for t in tables):
            return None
        found = {"family": "swin", "dim": embed.shape[0], "depths": depths,
                 "heads": tuple(t.shape[1] for t in tables)}
        window = (math.isqrt(tables[0].shape[0]) + 1) // 2
    for name, spec in MODELS.items():
        if _spec_fields(spec) == found:
            return name, window
    return None


def _count(state: dict[str, Tensor], pattern: str) -> int:
    """One more than the largest index `pattern` captures at the start of a key (0 when none does)."""
    indices = [int(m.group(1)) for key in state if (m := re.match(pattern, key))]
    return max(indices, default=-1) + 1


def _spec_fields(spec: ModelSpec) -> dict:
    """What `weights_of` reads off a state_dict, for a registered model."""
    kw = spec.kwargs
    if spec.family == "swin":
        return {"family": "swin", "dim": kw["dim"], "depths": kw["depths"], "heads": kw["heads"]}
    return {"family": "vit", "patch": kw["patch"], "dim": kw["dim"], "depth": kw["depth"],
            "hidden": int(kw["dim"] * kw.get("mlp_ratio", 4.0))}
