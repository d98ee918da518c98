"""Mixed precision: fp32, bf16 / fp16 autocast (fp16 with a GradScaler), and bf16-pure with fp32 master weights."""

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16-pure": None}


@dataclass
class Precision:
    mode: str
    device: torch.device

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.mode == "bf16-pure" else torch.float32

    def autocast(self) -> AbstractContextManager:
        dtype = AUTOCAST[self.mode]
        return torch.autocast(self.device.type, dtype=dtype) if dtype else nullcontext()

    def scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(self.device.type) if self.mode == "fp16" else None


class MasterWeights:
    """fp32 copies of bf16 model parameters: the optimizer steps these, then they are copied back.

    This is what apex's O2 did; with FSDP2 a MixedPrecisionPolicy does the same and this class is not used.
    """

    def __init__(self, model: nn.Module) -> None:
        self.pairs = [(p, p.detach().float().clone().requires_grad_(True)) for p in model.parameters()
                      if p.requires_grad]
        self.master_of = {id(p): m for p, m in self.pairs}

    def swap_groups(self, groups: list[dict]) -> list[dict]:
        """The same groups over the fp32 master parameters."""
        return [dict(g, params=[self.master_of[id(p)] for p in g["params"]]) for g in groups]

    def grads_to_master(self) -> None:
        # One multi-tensor copy for all parameters: a copy per parameter left the GPU waiting on the host.
        with_grad = [(p, m) for p, m in self.pairs if p.grad is not None]
        for p, m in self.pairs:
            if p.grad is None:
                m.grad = None
            elif m.grad is None:
                m.grad = torch.empty_like(m)
        if with_grad:
            torch._foreach_copy_([m.grad for _, m in with_grad], [p.grad for p, _ in with_grad])
        for p, _ in with_grad:
            p.grad = None

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float = 0.0) -> None:
        """Clip the gradients to `max_norm` (when set), step the masters, copy them into the model; in one kernel
        where the optimizer has one (ops/cuda.py's MasterAdamW), else in three passes."""
        with_grad = [(p, m) for p, m in self.pairs if p.grad is not None]
        one_kernel = getattr(optimizer, "step_master_weights", None)
        if one_kernel is not None and one_kernel(with_grad, max_norm):
            for p, _ in with_grad:
                p.grad = None
            return
        self.grads_to_master()
        if max_norm:
            torch.nn.utils.clip_grad_norm_([m for _, m in self.pairs], max_norm)
        optimizer.step()
        self.master_to_model()

    @torch.no_grad()
    def master_to_model(self) -> None:
        torch._foreach_copy_([p for p, _ in self.pairs], [m for _, m in self.pairs])

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach() for _, m in self.pairs]

    @torch.no_grad()
    def load_state_dict(self, tensors: list[torch.Tensor]) -> None:
        for (_, m), t in zip(self.pairs, tensors, strict=True):
            m.copy_(t)
        self.master_to_model()
