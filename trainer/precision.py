"""One precision layer: autocast and the grad scaler, FSDP2's mixed-precision policy, and for bf16-pure the fp32
master weights. fp8 is bf16-pure whose blocks' matmuls run in float8 (fp8.py). In every mode gradients are
accumulated and reduced in fp32."""

import copy
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16-pure": None, "fp8": None}


@dataclass
class Precision:
    mode: str
    device: torch.device

    @property
    def pure(self) -> bool:
        """A bf16 model with fp32 master weights (or FSDP2's fp32 shards): bf16-pure, and fp8 on top of it."""
        return self.mode in ("bf16-pure", "fp8")

    @property
    def fp8(self) -> bool:
        return self.mode == "fp8"

    def autocast(self) -> AbstractContextManager:
        dtype = AUTOCAST[self.mode]
        return torch.autocast(self.device.type, dtype=dtype) if dtype else nullcontext()

    def scaler(self) -> torch.amp.GradScaler | None:
        return torch.amp.GradScaler(self.device.type) if self.mode == "fp16" else None

    @property
    def stream_kept_fp32(self) -> bool:
        """Whether the residual stream is fp32 while FSDP2 gathers bf16 weights (bf16 autocast): the weights added to
        the stream outside the blocks must then stay whole and fp32, as replicated, or they would make it bf16."""
        return self.mode == "bf16"

    def fsdp_policy(self):
        """FSDP2 keeps fp32 sharded weights and gathers them as bf16 where the matmuls run in bf16 (bf16 autocast,
        bf16-pure): half the bytes of an fp32 gather. Under autocast the inputs stay as they come (the residual
        stream in fp32, as without FSDP, with `stream_kept_fp32`'s weights left out of FSDP2). Gradients reduce in
        fp32 in every mode (and FSDP2 accumulates unsynchronised micro-batches in the reduce dtype)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        gathered = torch.bfloat16 if self.pure or self.mode == "bf16" else None
        return MixedPrecisionPolicy(param_dtype=gathered, reduce_dtype=torch.float32, cast_forward_inputs=self.pure)


class MasterWeights:
    """fp32 master copies of a bf16 model's parameters (bf16-pure without FSDP), what apex's O2 did.

    The masters live in a copy of the model, so they keep the model's parameter names: checkpoints, the optimizer's
    state and the EMA are keyed like any other model's. Gradients reach them in fp32: upcast and summed over
    micro-batches here, or reduced in fp32 across ranks by the data-parallel hook (parallel/data_parallel.py).
    """

    def __init__(self, model: nn.Module) -> None:
        self.module = copy.deepcopy(model).float()
        model.to(torch.bfloat16)
        self.pairs = [(p, m) for p, m in zip(model.parameters(), self.module.parameters(), strict=True)
                      if p.requires_grad]
        self.master_of = {id(p): m for p, m in self.pairs}

    def accumulate(self) -> None:
        """Fold the bf16 gradients of a micro-batch into the masters' fp32 gradients (and free them)."""
        pairs = [(p, m) for p, m in self.pairs if p.grad is not None]
        for _, m in pairs:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        if pairs:
            torch._foreach_add_([m.grad for _, m in pairs], [p.grad.float() for p, _ in pairs])
        for p, _ in pairs:
            p.grad = None

    def step(self, optimizer: torch.optim.Optimizer, max_norm: float = 0.0,
             norm_groups: list[dist.ProcessGroup] | None = None) -> Tensor | None:
        """Clip to `max_norm` (when set), step the masters that have gradients, copy them into the model; in one
        kernel where the optimizer has one (ops/cuda.py's MasterAdamW), else in three passes. Returns the gradients'
        total norm (over `norm_groups` too) when clipping, on the device: no host sync."""
        triples = [(m.grad if m.grad is not None else p.grad, p, m) for p, m in self.pairs
                   if m.grad is not None or p.grad is not None]
        norm = total_norm([g for g, _, _ in triples], norm_groups) if max_norm and triples else None
        one_kernel = getattr(optimizer, "step_master_weights", None)
        if one_kernel is None or not one_kernel(triples, clip_coefficient(norm, max_norm) if norm is not None
                                                 else None):
            for grad, _, m in triples:
                m.grad = grad if grad.dtype == torch.float32 else grad.float()
            if norm is not None:
                torch._foreach_mul_([m.grad for _, _, m in triples], clip_coefficient(norm, max_norm))
            optimizer.step()
            if triples:  # those without gradients were not stepped (under ZeRO-1, another rank's)
                with torch.no_grad():
                    torch._foreach_copy_([p for _, p, _ in triples], [m for _, _, m in triples])
        for p, m in self.pairs:
            p.grad = m.grad = None
        return norm

    @torch.no_grad()
    def master_to_model(self) -> None:
        torch._foreach_copy_([p for p, _ in self.pairs], [m for _, m in self.pairs])


def total_norm(grads: list[Tensor], groups: list[dist.ProcessGroup] | None = None) -> Tensor:
    """The gradients' total L2 norm over every shard and the ranks of `groups` (pipeline stages, ZeRO-1's
    data-parallel ranks), each norm taken in fp32, on their device.
    A DTensor's shards are summed over the mesh dimensions it is sharded on, never over those it is replicated on."""
    plain = [g for g in grads if not isinstance(g, DTensor)]
    squares = [_sum_of_squares(plain)] if plain else []
    by_sharding: dict[tuple[int, tuple[int, ...]], tuple[DeviceMesh, list[Tensor]]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            dims = tuple(i for i, p in enumerate(g.placements) if p.is_shard())
            by_sharding.setdefault((id(g.device_mesh), dims), (g.device_mesh, []))[1].append(g.to_local())
    for (_, dims), (mesh, shards) in by_sharding.items():
        square = _sum_of_squares(shards)
        for dim in dims:
            dist.all_reduce(square, group=mesh.get_group(dim))
        squares.append(square)
    return summed_norm(torch.stack(squares).sum(), groups)


def summed_norm(square: Tensor, groups: list[dist.ProcessGroup] | None = None) -> Tensor:
    """The L2 norm whose sum of squares is `square` here plus theirs on the other ranks of `groups`."""
    for group in groups or []:
        dist.all_reduce(square, group=group)
    return square.sqrt()


def _sum_of_squares(tensors: list[Tensor]) -> Tensor:
    return torch.stack(torch._foreach_norm(tensors, 2.0, dtype=torch.float32)).square().sum()


def clip_gradients(params: list[Tensor], max_norm: float, groups: list[dist.ProcessGroup]) -> Tensor:
    """clip_grad_norm_ over every shard and the ranks of `groups`; returns the total norm (on the device)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = total_norm(grads, groups)
    torch._foreach_mul_([g.to_local() if isinstance(g, DTensor) else g for g in grads],
                        clip_coefficient(norm, max_norm))
    return norm


def clip_coefficient(norm: Tensor, max_norm: float) -> Tensor:
    """clip_grad_norm_'s coefficient, min(1, max_norm / (norm + 1e-6)), left on the device."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
