"""ZeRO-1 for a bf16 model with fp32 master weights (bf16-pure, fp8) replicated over the data-parallel ranks: each
rank steps the masters and the optimizer state of its share of the weights (whole tensors, balanced by size).

After the backward each rank sends every other rank the gradients of the weights that rank steps, in one all-to-all
(in bf16 when a step is one micro-batch: half the bytes of the fp32 all-reduce), and averages what it receives in
fp32 (at two ranks the fp32 all-reduce's very sum): where the optimizer is the master AdamW kernel (ops/cuda.py), the
kernel takes that mean as it reads the received bf16 parts, which saves a pass that writes it. After its step it
all-gathers the bf16 weights, which live in one flat buffer laid out by owner, so that the gather writes them in
place. Within one node both transfers go through the copy engines instead, overlapping the step (peer_copies.py).
The masters of the weights another rank steps go stale here, as do their EMA: `gather` brings such fp32 copies up to
date before anything reads them.
"""

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..config import ConfigError
from ..ops.cuda import parts_sum_of_squares
from ..precision import MasterWeights, clip_coefficient, summed_norm
from .peer_copies import PeerCopies, copy_engines_apply, runs_of, symmetric_zeros

ALIGN = 32  # elements: each weight starts 64-byte aligned in the buffers (Inductor copies misaligned inputs)
# torch 2.14 renamed it and warns at each call of the old name, the only one torch 2.11 has
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Zero1:
    def __init__(self, master: MasterWeights, group: dist.ProcessGroup | None, rank: int, size: int,
                 exchange: torch.dtype) -> None:
        self.pairs, self.group, self.rank, self.size = master.pairs, group, rank, size
        if len(self.pairs) < size:
            raise ConfigError(f"parallel.grad_reduce=zero1 gives each data-parallel rank whole weights to step: the "
                              f"model's {len(self.pairs)} weights cannot go round {size} ranks; use "
                              "parallel.grad_reduce=auto (and parallel.fsdp=true to shard them)")
        shapes = [p.shape for p, _ in self.pairs]
        owners, offsets, self.length = partition([s.numel() for s in shapes], size)
        self.owned = [i for i, owner in enumerate(owners) if owner == rank]
        self.owner_of = {id(m): owner for (_, m), owner in zip(self.pairs, owners, strict=True)}
        self.sources = [r if group is None else dist.get_global_rank(group, r) for r in range(size)]
        starts = [owner * self.length + offset for owner, offset in zip(owners, offsets, strict=True)]
        device = self.pairs[0][0].device
        peers = copy_engines_apply(group, size, device)
        buffer = symmetric_zeros if peers else lambda n, dtype, device: torch.zeros(n, dtype=dtype, device=device)
        self.weights = buffer(size * self.length, torch.bfloat16, device)
        self.sent = torch.zeros(size * self.length, dtype=exchange, device=device)
        self.received = buffer(size * self.length, exchange, device)
        self.grads = torch.empty(self.length, dtype=torch.float32, device=device)
        self.sent_views = _views(self.sent, starts, shapes)
        self.grad_views = _views(self.grads, [offsets[i] for i in self.owned], [shapes[i] for i in self.owned])
        # each weight's gradient from the first rank; the others' follow every `length` elements
        self.first_parts = _views(self.received, [offsets[i] for i in self.owned], [shapes[i] for i in self.owned])
        with torch.no_grad():  # the model's weights become views of the buffer the all-gather writes
            for view, (p, _) in zip(_views(self.weights, starts, shapes), self.pairs, strict=True):
                view.copy_(p)
                p.data = view
        self.copies = None
        if peers:
            runs = [runs_of([(offsets[i], shapes[i].numel()) for i in range(len(shapes)) if owners[i] == r])
                    for r in range(size)]
            self.copies = PeerCopies(self.received, self.weights, group, rank, size, self.length, runs)
            # the triples this rank steps, by run
            self.runs = [[i for i in self.owned if a <= offsets[i] < b] for a, b in runs[rank]]
        self.weights_sent = False

    def steps(self, master: nn.Parameter) -> bool:
        """Whether this rank steps `master`."""
        return self.owner_of.get(id(master)) == self.rank

    @torch.no_grad()
    def reduce(self) -> None:
        """After the last micro-batch's backward: every rank's gradients of the weights this rank steps to this rank;
        the bf16 gradients and the earlier micro-batches' sums are freed."""
        fresh = [(v, p.grad) for v, (p, _) in zip(self.sent_views, self.pairs, strict=True) if p.grad is not None]
        earlier = [(v, m.grad) for v, (_, m) in zip(self.sent_views, self.pairs, strict=True) if m.grad is not None]
        if len(fresh) < len(self.pairs):
            self.sent.zero_()
        if fresh:
            torch._foreach_copy_([v for v, _ in fresh], [g for _, g in fresh])
        if earlier:  # micro-batches summed by MasterWeights.accumulate (then the exchange is in fp32)
            torch._foreach_add_([v for v, _ in earlier], [g for _, g in earlier])
        for p, m in self.pairs:
            p.grad = m.grad = None
        if self.copies is not None:
            self.copies.send_gradients(self.sent)
        else:
            dist.all_to_all_single(self.received, self.sent, group=self.group)

    @torch.no_grad()
    def step(self, master: MasterWeights, optimizer: torch.optim.Optimizer, max_norm: float = 0.0,
             norm_groups: list[dist.ProcessGroup] | None = None) -> Tensor | None:
        """Step this rank's share from the mean of what `reduce` received, clipped to `max_norm` (when set) by the norm
        over every rank's share; returns that norm when clipping. The master AdamW kernel takes the mean of the bf16
        parts as it reads them; otherwise it is written in fp32 first."""
        first_part = dict(zip(self.owned, self.first_parts, strict=True))
        triples = [(first_part[i], *self.pairs[i]) for i in self.owned]
        applies = getattr(optimizer, "applies", None)
        if self.received.dtype != torch.bfloat16 or applies is None or not applies(triples):
            if self.copies is not None:
                self.copies.wait_gradients()
            self.average()
            return master.step(optimizer, max_norm, norm_groups)
        if self.copies is not None and max_norm:  # the norm needs every gradient before any run steps
            self.copies.wait_gradients()
        # the gaps between the weights are zeros in every part, so the whole share's sum is the weights'
        norm = summed_norm(parts_sum_of_squares(self.received, self.size), norm_groups) if max_norm else None
        clip = None if norm is None else clip_coefficient(norm, max_norm)
        if self.copies is None:
            optimizer.step_master_weights(triples, clip, self.received, self.size)
            return norm
        for k, run in enumerate(self.runs):
            if not max_norm:
                self.copies.wait_gradients(k)
            optimizer.step_master_weights([(first_part[i], *self.pairs[i]) for i in run], clip, self.received,
                                          self.size)
            self.copies.send_weights(k)
        self.weights_sent = True
        return norm

    @torch.no_grad()
    def average(self) -> None:
        """The mean over ranks of what `reduce` received, in fp32, as the gradients of the masters this rank steps."""
        torch.mean(self.received.view(self.size, self.length), dim=0, dtype=torch.float32, out=self.grads)
        for i, view in zip(self.owned, self.grad_views, strict=True):
            self.pairs[i][1].grad = view

    @torch.no_grad()
    def gather_weights(self) -> None:
        """After the step: every rank's stepped bf16 weights to every rank."""
        if self.copies is None:
            mine = self.weights[self.rank * self.length:(self.rank + 1) * self.length]
            ALL_GATHER(self.weights, mine, group=self.group)
            return
        if not self.weights_sent:  # stepped by torch's optimizer, in one piece
            for k in range(len(self.runs)):
                self.copies.send_weights(k)
        self.copies.finish()
        self.weights_sent = False

    @torch.no_grad()
    def gather(self, copies: list[tuple[nn.Parameter, Tensor]]) -> None:
        """Each fp32 `copy` of a master (the master itself, its EMA) made what the rank that steps it holds: one
        broadcast a weight, so that no buffer of the whole model is needed at a checkpoint."""
        for master, copy in copies:
            if (owner := self.owner_of.get(id(master))) is not None:
                dist.broadcast(copy, src=self.sources[owner], group=self.group)


def partition(sizes: list[int], ranks: int) -> tuple[list[int], list[int], int]:
    """Whole tensors over `ranks`, the largest first to the least loaded: (each one's rank, its offset in that rank's
    share, the longest share), offsets and lengths in ALIGN-element steps, in the tensors' own order."""
    owners, loads = [0] * len(sizes), [0] * ranks
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owners[i] = min(range(ranks), key=lambda r: loads[r])
        loads[owners[i]] += _aligned(sizes[i])
    offsets, ends = [], [0] * ranks
    for size, owner in zip(sizes, owners, strict=True):
        offsets.append(ends[owner])
        ends[owner] += _aligned(size)
    return owners, offsets, max(max(ends), ALIGN)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _views(flat: Tensor, starts: list[int], shapes: list[torch.Size]) -> list[Tensor]:
    return [flat[start:start + shape.numel()].view(shape) for start, shape in zip(starts, shapes, strict=True)]
