"""NVIDIA apex's fused LayerNorm, dense-GELU-dense and Adam, when apex imports (it is optional)."""

import importlib
import importlib.util

import torch

from . import register


def _installed() -> bool:
    try:
        return importlib.util.find_spec("apex") is not None
    except ValueError:  # in sys.modules without a spec: imported already
        return True


def _missing(module: str, name: str):
    """Available where `module` imports and has `name`: apex's API moves between its commits."""
    def unavailable(device: torch.device) -> str | None:
        if device.type != "cuda":  # what a GPU node would still lack, said here too
            return "needs CUDA" + ("" if _installed() else "; apex is not installed either")
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError as e:
            return f"apex not importable: {e}"
        return None if found else f"this apex's {module} has no {name}"
    return unavailable


@register("layer_norm", "apex", 30, _missing("apex.normalization.fused_layer_norm", "fused_layer_norm_affine"))
def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine

    return fused_layer_norm_affine(x, weight, bias, weight.shape, eps)


# The autograd Function itself: apex renamed its functional wrapper (fused_dense_gelu_dense_function, later a private
# _fused_dense_gelu_dense), while FusedDenseGeluDenseFunc stayed.
@register("mlp", "apex", 30, _missing("apex.fused_dense", "FusedDenseGeluDenseFunc"))
def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    from apex.fused_dense import FusedDenseGeluDenseFunc

    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
    shape = x.shape
    with torch.autocast("cuda", enabled=False):  # the kernel takes one dtype for all five, as apex's wrapper casts
        out = FusedDenseGeluDenseFunc.apply(*(t.to(dtype) for t in (x.reshape(-1, shape[-1]), w1, b1, w2, b2)))
    return out.view(*shape[:-1], w2.shape[0])


@register("optimizer", "apex", 30, _missing("apex.optimizers", "FusedAdam"))
def fused_adam(groups: list[dict], lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    from apex.optimizers import FusedAdam

    return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
