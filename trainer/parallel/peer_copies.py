"""ZeRO-1's exchange within one node through symmetric memory: each rank's copy engines write the gradients into its
peers' received buffers and its stepped weights into their weight buffers, so that the transfers take no SMs from the
step they overlap. The share steps in runs of whole tensors: run k's gradients land while run k - 1 steps, and its
weights leave while run k + 1 steps (docs/performance.md: ViT-B's exchange and step of its share 1.03-1.04 ms over
NCCL, 0.70-0.74 here, on two H200s).

VITCTL_ZERO1_EXCHANGE=nccl keeps NCCL's all-to-all and all-gather: for a comparison, or where symmetric memory cannot
map the peers' buffers (a container without a shared IPC namespace).
"""

import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
from torch import Tensor

from .data_parallel import one_node

RUNS = 3  # by measurement: 3 runs beat 2 and 4-8 (each run's signals cost some 20 us)
TIMEOUT_MS = 600_000  # a peer that never signals ends the wait in an error, as NCCL's watchdog does after 10 min


def copy_engines_apply(group: dist.ProcessGroup | None, size: int, device: torch.device) -> bool:
    """Whether the exchange goes through the copy engines: CUDA ranks of one node, NCCL's group, not turned off."""
    return (size > 1 and device.type == "cuda" and dist.get_backend(group) == "nccl"
            and os.environ.get("VITCTL_ZERO1_EXCHANGE", "copy_engines") != "nccl" and one_node(group))


def symmetric_zeros(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A buffer the peers can map (zeros: the gaps between weights are summed into the gradients' norm)."""
    return symm_mem.empty(numel, dtype=dtype, device=device).zero_()


def runs_of(tensors: list[tuple[int, int]], count: int = RUNS) -> list[tuple[int, int]]:
    """A share's (offset, length) tensors, in order, cut into up to `count` runs of whole tensors: (start, end)."""
    total = tensors[-1][0] + tensors[-1][1] if tensors else 0
    runs, first = [], 0
    for k in range(count):
        last = first
        while last < len(tensors) and (tensors[last][0] < total * (k + 1) // count or k == count - 1):
            last += 1
        if last > first:
            runs.append((tensors[first][0], tensors[last - 1][0] + tensors[last - 1][1]))
        first = last
    return runs


class PeerCopies:
    """The transfers of one ZeRO-1 step: `send_gradients`, then per run `wait_gradients` and `send_weights` around
    its step, then `finish`. `runs[p]` is rank p's share cut by `runs_of`; buffers are laid out by owner, `length`
    elements each."""

    def __init__(self, received: Tensor, weights: Tensor, group: dist.ProcessGroup | None, rank: int, size: int,
                 length: int, runs: list[list[tuple[int, int]]]) -> None:
        name = (group or dist.group.WORLD).group_name
        self.received, self.weights, self.rank, self.length, self.runs = received, weights, rank, length, runs
        self.handles = symm_mem.rendezvous(received, name), symm_mem.rendezvous(weights, name)
        self.peers = [p for p in range(size) if p != rank]
        self.gradients_out, self.weights_out = torch.cuda.Stream(), torch.cuda.Stream()
        # views of this rank's part of each peer's buffers, by run: mapped once, not at every step
        self.peer_gradients = {p: [self._peer_view(0, p, a, b) for a, b in runs[p]] for p in self.peers}
        self.peer_weights = {p: [self._peer_view(1, p, a, b) for a, b in runs[rank]] for p in self.peers}

    def send_gradients(self, sent: Tensor) -> None:
        """Each peer's part of `sent` into its received buffer, run by run, each run signalled on channel 1 + k."""
        mine = slice(self.rank * self.length, (self.rank + 1) * self.length)
        self.received[mine].copy_(sent[mine])
        self.gradients_out.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.gradients_out):
            for k in range(max(len(r) for r in self.runs)):
                for p in self.peers:
                    if k < len(self.runs[p]):
                        a, b = self.runs[p][k]
                        self.peer_gradients[p][k].copy_(sent[p * self.length + a:p * self.length + b])
                        self.handles[0].put_signal(p, 1 + k, TIMEOUT_MS)

    def wait_gradients(self, run: int | None = None) -> None:
        """The current stream waits for every peer's gradients of this rank's `run` (None: of all runs)."""
        for k in range(len(self.runs[self.rank])) if run is None else (run,):
            for p in self.peers:
                self.handles[0].wait_signal(p, 1 + k, TIMEOUT_MS)

    def send_weights(self, run: int) -> None:
        """This rank's weights of its `run`, stepped on the current stream, into every peer's weight buffer."""
        stepped = torch.cuda.current_stream().record_event()
        a, b = self.runs[self.rank][run]
        with torch.cuda.stream(self.weights_out):
            self.weights_out.wait_event(stepped)
            for p in self.peers:
                self.peer_weights[p][run].copy_(self.weights[self.rank * self.length + a:self.rank * self.length + b])

    def finish(self) -> None:
        """The current stream waits for this rank's transfers, then for its peers': their weights have landed."""
        current = torch.cuda.current_stream()
        current.wait_stream(self.gradients_out)
        current.wait_stream(self.weights_out)
        self.handles[1].barrier(0, TIMEOUT_MS)

    def _peer_view(self, handle: int, peer: int, start: int, end: int) -> Tensor:
        """Elements start:end of this rank's part of `peer`'s buffer (0: received, 1: weights)."""
        buffer = (self.received, self.weights)[handle]
        return self.handles[handle].get_buffer(peer, (end - start,), buffer.dtype, self.rank * self.length + start)
