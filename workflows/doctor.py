"""`vitctl doctor`'s checks beyond the op table: how the CUDA ops were built, and everything the container image
promises (prebuilt ops, apex, DALI for the image's CUDA, the cuDNN frontend, submitit, webdataset), none of which
needs a GPU."""

import importlib
import os
from dataclasses import dataclass
from importlib.metadata import distributions

import torch

from vitctl.trainer.ops import cuda

from .provenance import describe, git_commit, vitctl_version

# What trainer/ops/cuda.py calls on the compiled module.
OP_FUNCTIONS = ("window_partition", "window_merge", "window_softmax_forward", "window_softmax_backward",
                "window_attention_forward", "window_attention_backward", "fused_mlp_forward", "fused_mlp_backward",
                "master_adamw")
# apex's Python modules vitctl imports (trainer/ops/apex_ops.py) and the compiled extensions behind them.
APEX_MODULES = ("apex.normalization.fused_layer_norm", "apex.optimizers", "apex.fused_dense", "apex.mlp",
                "fused_layer_norm_cuda", "amp_C", "fused_dense_cuda", "mlp_cuda")


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def in_image() -> bool:
    return cuda.prebuilt_only()


def this_vitctl() -> str:
    return describe(vitctl_version(), git_commit())


def op_builds() -> list[tuple[str, str]]:
    """(function of vitctl_cuda_ops, 'prebuilt', 'not prebuilt: built just in time on first use ...' or 'missing:
    why')."""
    module, why = cuda.prebuilt()
    if module is None:
        state = f"missing: {why}" if cuda.prebuilt_only() else "not prebuilt: built just in time on first use" + (
            "" if torch.cuda.is_available() else " on a machine with a CUDA GPU (none here)")
        return [(name, state) for name in OP_FUNCTIONS]
    return [(name, "prebuilt" if hasattr(module, name) else "missing from the prebuilt module")
            for name in OP_FUNCTIONS]


def _prebuilt_only_setting() -> str:
    """The variable as set, and what it means here: only 1 turns the check on."""
    value = os.environ.get(cuda.PREBUILT_ONLY_ENV)
    if value == "1":
        return f"{cuda.PREBUILT_ONLY_ENV}=1"
    said = "unset" if value is None else f"{value!r}: only 1 turns it on"
    return f"{cuda.PREBUILT_ONLY_ENV}={value or ''} ({said}: a missing op would be compiled on first use)"


def _imports(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as e:  # an ImportError, or a compiled module that fails to load (OSError, undefined symbol)
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
    return None


def _dali_cuda() -> Check:
    """DALI imports and is the build for torch's CUDA major version (nvidia-dali-cuda130 for CUDA 13)."""
    wanted = f"nvidia-dali-cuda{torch.version.cuda.split('.')[0]}0" if torch.version.cuda else None
    installed = sorted(d.metadata["Name"] for d in distributions() if d.metadata["Name"].startswith("nvidia-dali-cuda"))
    problem = _imports("nvidia.dali")
    if problem is None and wanted not in installed:
        problem = f"installed {', '.join(installed) or 'no nvidia-dali-cuda*'}, torch's CUDA needs {wanted}"
    return Check("DALI", problem is None, problem or f"{wanted} imports")


def image_checks() -> list[Check]:
    """Every promise of the image, kept or not."""
    ops = op_builds()
    not_prebuilt = [name for name, state in ops if state != "prebuilt"]
    checks = [
        Check("torch CUDA build", torch.version.cuda is not None,
              f"torch {torch.__version__}, CUDA {torch.version.cuda}"),
        Check("CUDA ops prebuilt", not not_prebuilt,
              f"all {len(ops)} in {cuda.prebuilt()[0].__file__}" if not not_prebuilt else
              f"{', '.join(not_prebuilt)}: {ops[0][1] if len(not_prebuilt) == len(ops) else 'missing'}"),
        Check("no just-in-time builds", cuda.prebuilt_only(), _prebuilt_only_setting()),
    ]
    for module in APEX_MODULES:
        problem = _imports(module)
        checks.append(Check(f"apex: {module}", problem is None, problem or "imports"))
    checks.append(_dali_cuda())
    for name, module in (("cuDNN frontend", "cudnn"), ("submitit", "submitit"), ("webdataset", "webdataset")):
        problem = _imports(module)
        checks.append(Check(name, problem is None, problem or "imports"))
    return checks
