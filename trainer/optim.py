"""Parameter groups (no weight decay on norms, biases and position tables; layer-wise LR decay), the LR schedule, and
AdamW's step on sharded weights without DTensor's dispatch."""

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from .config import OptimConfig
from .ops import Ops

NO_DECAY_NAMES = ("pos_embed", "cls_token", "relative_position_bias_table")


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float | None,
                 stepped_here: Callable[[nn.Parameter], bool] = lambda p: True) -> list[dict]:
    """Groups keyed by (decay, LR scale) of the parameters this rank steps (under ZeRO-1 its share); each group's
    `lr_scale` multiplies the scheduled LR."""
    layers = getattr(model, "layer_id", lambda name: 0)
    top = layers("head.weight")  # the deepest layer, also on a pipeline stage that holds no head
    groups: dict[tuple[bool, float, bool], dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad or not stepped_here(param):
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


def step_on_local_shards(optimizer: torch.optim.Optimizer) -> bool:
    """torch's AdamW step, taken on the local shards of DTensor weights (FSDP2, tensor parallel): the same kernels on
    the same memory, without DTensor's dispatch, which costs the host tens of microseconds a weight a step. False,
    with nothing done, where it does not apply: no DTensor weights, another optimizer or option, or before the first
    step has made the optimizer's state."""
    groups = optimizer.param_groups
    if not isinstance(optimizer, torch.optim.AdamW) or \
            not any(isinstance(p, DTensor) for group in groups for p in group["params"]):
        return False  # checked first: replicated weights pay no more than this each step
    stepped = [[p for p in group["params"] if p.grad is not None] for group in groups]
    if not all("step" in optimizer.state.get(p, {}) for params in stepped for p in params):
        return False
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return False  # step() would run them
    if any(g["amsgrad"] or g["maximize"] or g["capturable"] or g["differentiable"] or isinstance(g["lr"], Tensor)
           or not g.get("decoupled_weight_decay", True) or not (g["foreach"] or g["fused"]) for g in groups):
        return False  # foreach=None: torch picks the kernels by the weights' type, which DTensors change
    with torch.no_grad():
        for group, params in zip(groups, stepped, strict=True):
            if not params:
                continue
            states = [optimizer.state[p] for p in params]
            beta1, beta2 = group["betas"]
            adamw([_local(p) for p in params], [_local(p.grad) for p in params],
                  [_local(s["exp_avg"]) for s in states], [_local(s["exp_avg_sq"]) for s in states], [],
                  [_local(s["step"]) for s in states], foreach=group["foreach"], fused=group["fused"], amsgrad=False,
                  beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                  maximize=False)
    return True


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
