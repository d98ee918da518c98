"""Data parallelism on the mesh: DDP (replicated weights) or FSDP2 (sharded, HSDP on a 2-D mesh).

Gradients are reduced in fp32 in both. FSDP2 does it by its mixed-precision policy. DDP does it as it is for fp32
weights; for a bf16 model (bf16-pure) a communication hook upcasts each bucket, adds the earlier micro-batches'
fp32 sums, reduces in fp32 and hands the result to the fp32 master weights.
"""

import torch
import torch.distributed as dist
from torch import Tensor, nn
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


def _places(buffer: Tensor, grads: list[Tensor]) -> list[tuple[int, torch.Size]]:
    """Each gradient's offset and shape in the bucket's flat buffer."""
    base, size = buffer.data_ptr(), buffer.element_size()
    return [((g.data_ptr() - base) // size, g.shape) for g in grads]


def _cut(flat: Tensor, places: list[tuple[int, torch.Size]]) -> list[Tensor]:
    """The gradients as views of `flat`, a buffer of the bucket's layout in another dtype."""
    return [flat[start:start + shape.numel()].view(shape) for start, shape in places]


def apply_fsdp(model: nn.Module, mesh: Mesh, policy, blocks: list[nn.Module]) -> nn.Module:
    """FSDP2: each block its own unit, then the root (embeddings, final norm, head)."""
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh.data_parallel_mesh()
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return model
