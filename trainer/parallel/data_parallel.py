"""Data parallelism on the mesh: replicated weights (DDP, or one all-reduce after the backward) or FSDP2 (sharded,
HSDP on a 2-D mesh).

Gradients are reduced in fp32 in all of them. FSDP2 does it by its mixed-precision policy. DDP does it as it is for
fp32 weights; for a bf16 model (bf16-pure) a communication hook upcasts each bucket, adds the earlier
micro-batches' fp32 sums, reduces in fp32 and hands the result to the fp32 master weights. Without DDP the gradients
are copied into one fp32 buffer and all-reduced after the backward, at once or in two parts (the later blocks' part
during the earlier blocks' backward).
"""

import functools
import itertools
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
    """Replicated data parallelism without DDP: one fp32 all-reduce per part of the gradients, handed to the fp32
    weights that step (the masters under bf16-pure, else the parameters themselves).

    `parts` come in the order their gradients are complete in the backward. Once the step's last micro-batch is
    armed, each part but the last is reduced as soon as all its gradients are accumulated, on a side stream, while
    the backward goes on; the last after the backward. With one part, everything is reduced after the backward.

    Within a node the whole model's gradients cross NVLink in about a millisecond; reduced in DDP's buckets during
    the backward they save little of it, because NCCL's kernels hold SMs that the backward needs
    (docs/performance.md); one large part started early is one NCCL kernel.
    """

    def __init__(self, parts: list[list[tuple[nn.Parameter, nn.Parameter]]], group: dist.ProcessGroup | None,
                 size: int) -> None:
        self.parts = [part for part in parts if part]  # (parameter the backward writes, one that steps)
        self.pairs = [pair for part in self.parts for pair in part]
        self.group, self.size = group, size
        shapes = [_local(p).shape for p, _ in self.pairs]  # a tensor-parallel weight's own shard
        device = self.pairs[0][0].device
        self.flat = torch.empty(sum(s.numel() for s in shapes), dtype=torch.float32, device=device)
        self.views = [v.view(s) for v, s in zip(self.flat.split([s.numel() for s in shapes]), shapes, strict=True)]
        ends = list(itertools.accumulate(len(part) for part in self.parts))
        self.spans = list(zip([0, *ends[:-1]], ends, strict=True))  # each part's pairs (and views)
        self.offsets = [0, *itertools.accumulate(s.numel() for s in shapes)]  # each view's start in `flat`
        self.average = dist.get_backend(group) == "nccl"  # gloo has no AVG
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and len(self.parts) > 1 else None
        self.works: list[dist.Work] = []
        self.waiting: list[int] = []  # per part, gradients not yet accumulated in the armed micro-batch
        for index, part in enumerate(self.parts[:-1]):
            for p, _ in part:
                p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, index))

    def arm(self) -> None:
        """The coming backward is the step's last micro-batch: start each part's reduction as soon as it can."""
        self.waiting = [len(part) for part in self.parts]

    def _accumulated(self, index: int, _: Tensor) -> None:
        if not self.waiting:
            return
        self.waiting[index] -= 1
        if self.waiting[index] == 0:
            self._launch_through(index)

    @torch.no_grad()
    def _launch_through(self, index: int) -> None:
        """Start the reductions of parts up to `index` not yet started, in order (the same on every rank)."""
        for part in range(len(self.works), index + 1):
            if self.stream is None:
                self.works.append(self._launch(*self.spans[part]))
                continue
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self.works.append(self._launch(*self.spans[part]))

    def _launch(self, first: int, end: int) -> dist.Work:
        pairs, views = self.pairs[first:end], self.views[first:end]
        fresh = [(v, _local(p.grad)) for v, (p, _) in zip(views, pairs, strict=True) if p.grad is not None]
        earlier = [(v, m.grad) for v, (p, m) in zip(views, pairs, strict=True)
                   if m is not p and m.grad is not None]  # bf16-pure micro-batches summed by MasterWeights
        flat = self.flat[self.offsets[first]:self.offsets[end]]
        if len(fresh) < len(views):
            flat.zero_()
        if fresh:
            torch._foreach_copy_([v for v, _ in fresh], [g for _, g in fresh])
        if earlier:
            torch._foreach_add_([v for v, _ in earlier], [g for _, g in earlier])
        if not self.average:
            flat.div_(self.size)
        return dist.all_reduce(flat, op=dist.ReduceOp.AVG if self.average else dist.ReduceOp.SUM, group=self.group,
                               async_op=True)

    @torch.no_grad()
    def reduce(self) -> None:
        """After the last micro-batch's backward: reduce what is left, wait for every part, hand the results on."""
        self._launch_through(len(self.parts) - 1)
        for work in self.works:
            work.wait()
        self.works, self.waiting = [], []
        for view, (p, m) in zip(self.views, self.pairs, strict=True):
            if m is not p:
                p.grad = None
            m.grad = DTensor.from_local(view, m.device_mesh, m.placements, run_check=False, shape=m.shape,
                                        stride=m.stride()) if isinstance(m, DTensor) else view


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


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
