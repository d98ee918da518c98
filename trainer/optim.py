"""Parameter groups (no weight decay on norms, biases and position tables; layer-wise LR decay), the LR schedule."""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .config import OptimConfig
from .ops import Ops

NO_DECAY_NAMES = ("pos_embed", "cls_token", "relative_position_bias_table")


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float | None) -> list[dict]:
    """Groups keyed by (decay, LR scale); each group's `lr_scale` multiplies the scheduled LR."""
    layers = getattr(model, "layer_id", lambda name: 0)
    top = layers("head.weight")  # the deepest layer, also on a pipeline stage that holds no head
    groups: dict[tuple[bool, float, bool], dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        decay = param.ndim > 1 and not name.endswith(".bias") and not any(n in name for n in NO_DECAY_NAMES)
        scale = layer_decay ** (top - layers(name)) if layer_decay else 1.0
        # DTensors (tensor-parallel weights) apart: the optimizers' foreach kernels take no mix of them and tensors.
        key = (decay, scale, isinstance(param, DTensor))
        group = groups.setdefault(key, {"params": [], "weight_decay": weight_decay if decay else 0.0,
                                        "lr_scale": scale})
        group["params"].append(param)
    return list(groups.values())


def build_optimizer(groups: list[dict], config: OptimConfig, ops: Ops, lr: float) -> torch.optim.Optimizer:
    return ops.optimizer(groups, lr, config.betas, config.eps)


def lr_at(epochs: float, total: float, warmup: float, base: float, minimum: float, start: float = 0.0) -> float:
    """The LR of the step that ends `epochs` into training: linear warmup from `start` over `warmup` epochs, then
    cosine decay to `minimum` at `total`. In epochs rather than steps, so a run resumed with another global batch
    keeps its place in the schedule."""
    if epochs <= warmup:
        return start + (base - start) * epochs / warmup
    progress = min(1.0, (epochs - warmup) / max(1e-9, total - warmup))
    return minimum + 0.5 * (base - minimum) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
