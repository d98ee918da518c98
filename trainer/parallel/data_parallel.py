"""Data parallelism on the mesh: replicated weights (DDP, or one all-reduce after the backward) or FSDP2 (sharded,
HSDP on a 2-D mesh).

Gradients are reduced in fp32 in all of them. FSDP2 does it by its mixed-precision policy. DDP does it as it is for
fp32 weights; for a bf16 model (bf16-pure) a communication hook upcasts each bucket, adds the earlier
micro-batches' fp32 sums, reduces in fp32 and hands the result to the fp32 master weights. The reduction after the
backward all-reduces every gradient at once in one fp32 buffer: fp32 weights' gradients accumulate in it as the backward
writes them, a bf16 model's are copied into it.
"""

import socket

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ..precision import MasterWeights
from .mesh import Mesh


def apply_ddp(model: nn.Module, mesh: Mesh, master: MasterWeights | None) -> DistributedDataParallel:
    device = next(model.parameters()).device
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, process_group=mesh.dp_group,
        gradient_as_bucket_view=True,
        # DDP otherwise re-buckets after its first step in the order gradients arrived, so a resumed run's first step
        # would reduce in another layout (and another summation order) than the uninterrupted run's: not bitwise.
        find_unused_parameters=True)
    if master is not None:
        ddp.register_comm_hook(Fp32Reduction(master, mesh.dp_group, mesh.dp_size), Fp32Reduction.hook)
    return ddp


class Fp32Reduction:
    """State of the DDP hook that reduces a bf16 model's gradient buckets in fp32 into its master weights."""

    def __init__(self, master: MasterWeights, group: dist.ProcessGroup | None, size: int) -> None:
        self.master_of, self.group, self.size = master.master_of, group, size

    @staticmethod
    def hook(state: "Fp32Reduction", bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        buffer = bucket.buffer()
        flat = buffer.to(torch.float32)
        masters = [state.master_of[id(p)] for p in bucket.parameters()]
        places = _places(buffer, bucket.gradients())
        earlier = [(view, m.grad) for view, m in zip(_cut(flat, places), masters, strict=True) if m.grad is not None]
        if earlier:  # micro-batches accumulated without synchronisation (MasterWeights.accumulate)
            torch._foreach_add_([v for v, _ in earlier], [g for _, g in earlier])
        flat.div_(state.size)
        reduced = dist.all_reduce(flat, group=state.group, async_op=True).get_future()

        def to_masters(future: torch.futures.Future[list[Tensor]]) -> Tensor:
            result = future.value()[0]
            for m, view in zip(masters, _cut(result, places), strict=True):
                m.grad = view
            return buffer  # the bf16 gradients are left as they were; the step reads the masters'

        return reduced.then(to_masters)


def one_node(group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of `group` runs on this host."""
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


class ReduceAfterBackward:
    """Replicated data parallelism without DDP: after the last micro-batch's backward, one fp32 all-reduce of every
    gradient, handed to the fp32 weights that step (the masters under bf16-pure, else the parameters themselves).

    Within a node the whole model's gradients cross NVLink in about a millisecond; reduced during the backward (DDP)
    they save little of it, because NCCL's kernels hold SMs that the backward needs (docs/performance.md).
    """

    def __init__(self, pairs: list[tuple[nn.Parameter, nn.Parameter]], group: dist.ProcessGroup | None,
                 size: int) -> None:
        self.pairs, self.group, self.size = pairs, group, size  # (parameter the backward writes, one that steps)
        shapes = [_local(p).shape for p, _ in pairs]  # a tensor-parallel weight's own shard
        self.flat = torch.empty(sum(s.numel() for s in shapes), dtype=torch.float32, device=pairs[0][0].device)
        self.views = [v.view(s) for v, s in zip(self.flat.split([s.numel() for s in shapes]), shapes, strict=True)]
        self.average = dist.get_backend(group) == "nccl"  # gloo has no AVG
        # fp32 weights' gradients accumulate in their views of the buffer, as DDP's gradient_as_bucket_view: a second
        # fp32 copy of them would otherwise peak beside it at the end of the backward (4 bytes a weight: 4 GB of
        # Swin-H's, where its memory peaks)
        self.in_place = all(m is p and p.dtype == torch.float32 for p, m in pairs)

    @torch.no_grad()
    def accumulate_in_place(self) -> None:
        """Before a micro-batch's backward: a step's first makes the weights' gradients zeroed views of the buffer,
        which the backward then adds to."""
        if not self.in_place or self.pairs[0][0].grad is not None:
            return
        self.flat.zero_()
        for view, (p, _) in zip(self.views, self.pairs, strict=True):
            p.grad = _like(view, p)

    @torch.no_grad()
    def reduce(self) -> None:
        if self.in_place:
            self._adopt_replaced()
        else:
            self._copy_in()
        if not self.average:
            self.flat.div_(self.size)
        dist.all_reduce(self.flat, op=dist.ReduceOp.AVG if self.average else dist.ReduceOp.SUM, group=self.group)
        if self.in_place:
            return
        for view, (p, m) in zip(self.views, self.pairs, strict=True):
            p.grad = None
            m.grad = _like(view, m)

    def _adopt_replaced(self) -> None:
        """Gradients that are no longer views of the buffer are copied into it, and a view whose weight then has none
        is zeroed: the buffer holds what the weights' gradients do, as the copy would. torch's pipeline, on its first
        step, infers shapes with a real backward and then sets its FSDP modules' gradients, ignored weights too, to
        None."""
        for view, (p, _) in zip(self.views, self.pairs, strict=True):
            if p.grad is None:
                view.zero_()
            elif _local(p.grad).data_ptr() != view.data_ptr():
                view.copy_(_local(p.grad))
            else:
                continue
            p.grad = _like(view, p)

    def _copy_in(self) -> None:
        """The bf16 gradients of this micro-batch, and the fp32 sums of the earlier ones', into the buffer."""
        fresh = [(v, _local(p.grad)) for v, (p, _) in zip(self.views, self.pairs, strict=True) if p.grad is not None]
        earlier = [(v, m.grad) for v, (p, m) in zip(self.views, self.pairs, strict=True)
                   if m is not p and m.grad is not None]  # bf16-pure micro-batches summed by MasterWeights
        if len(fresh) < len(self.views):
            self.flat.zero_()
        if fresh:
            torch._foreach_copy_([v for v, _ in fresh], [g for _, g in fresh])
        if earlier:
            torch._foreach_add_([v for v, _ in earlier], [g for _, g in earlier])


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(view: Tensor, weight: Tensor) -> Tensor:
    """`view` as the gradient of `weight`: a DTensor of the same layout for a tensor-parallel weight."""
    if isinstance(weight, DTensor):
        return DTensor.from_local(view, weight.device_mesh, weight.placements, run_check=False, shape=weight.shape,
                                  stride=weight.stride())
    return view


def _places(buffer: Tensor, grads: list[Tensor]) -> list[tuple[int, torch.Size]]:
    """Each gradient's offset and shape in the bucket's flat buffer."""
    base, size = buffer.data_ptr(), buffer.element_size()
    return [((g.data_ptr() - base) // size, g.shape) for g in grads]


def _cut(flat: Tensor, places: list[tuple[int, torch.Size]]) -> list[Tensor]:
    """The gradients as views of `flat`, a buffer of the bucket's layout in another dtype."""
    return [flat[start:start + shape.numel()].view(shape) for start, shape in places]


def apply_fsdp(roots: list[nn.Module], mesh: Mesh, policy, blocks: list[nn.Module],
               ignored: set[nn.Parameter]) -> None:
    """FSDP2: each of `blocks` its own unit, then each root (the model, or each pipeline stage module) for the rest
    of it but `ignored` (left replicated)."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=mesh.fsdp_mesh(), mp_policy=policy)
    for root in roots:
        fully_shard(root, mesh=mesh.fsdp_mesh(), mp_policy=policy, ignored_params=ignored or None)
