"""torch.distributed set-up from the launcher's environment."""

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def widen_cuda_queues() -> None:
    """Give this process CUDA's most hardware work queues (32, not 8), unless the environment sets its own; only
    effective before CUDA starts in the process.

    CUDA maps streams onto these queues, and work on one queue runs in order whatever its stream: on an H200 with 8,
    torchvision's nvjpeg decode behind 60 ms of matmuls queued on another stream returned when they had finished, with
    32 after 15 ms while they ran on (docs/performance.md)."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")


def expandable_cuda_memory() -> None:
    """PyTorch's expandable segments for the CUDA caching allocator, unless the environment configures the allocator
    itself; only effective before the process first allocates on a GPU.

    Without them a job whose peak comes near its memory limit fragments the allocator's cache, which then frees it
    and retries, waiting for the GPU each time: a ViT-H/14 plan at 22.2 of 24 GiB ran 0.294 s a step (two retries a
    step) against 0.236 s with them (docs/performance.md)."""
    if not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(os.environ):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def init_distributed(use_cuda: bool) -> DistEnv:
    """Read RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT (torchrun, submitit, `vitctl train --gpus N`)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    # Modulo: a launcher may already have narrowed CUDA_VISIBLE_DEVICES to this rank's GPU.
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:
        share_cpu_threads(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if world > 1 and not dist.is_initialized():
        if missing := [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]:
            raise ConfigError(f"WORLD_SIZE={world}, but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                              "not set: the ranks meet at rank 0's address and port; launch them with torchrun, srun "
                              "or `vitctl train`, which set both, or set MASTER_ADDR and MASTER_PORT")
        with _stoppable():
            dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                    device_id=device if use_cuda else None)
    return DistEnv(rank, world, local_rank, device)


def share_cpu_threads(local_ranks: int) -> None:
    """Give each of a machine's CPU ranks its share of the CPUs for torch's threads, unless OMP_NUM_THREADS sets them.

    By default each rank takes every CPU it may run on, and their threads contend (torchrun sets one a rank for the
    same reason): four vit_mini ranks on two cores took 15 s for 10 steps, against 4.4 s with one thread each. A rank
    that Slurm binds to its own CPUs keeps them all, when they are fewer than its share of the machine."""
    if local_ranks > 1 and "OMP_NUM_THREADS" not in os.environ:
        allowed = len(os.sched_getaffinity(0))
        torch.set_num_threads(max(1, min(allowed, (os.cpu_count() or allowed) // local_ranks)))


@contextlib.contextmanager
def _stoppable() -> Iterator[None]:
    """While the ranks gather, SIGTERM and Ctrl-C end this one at once: it has nothing to checkpoint yet, and a
    Python handler (the stop that checkpoints, KeyboardInterrupt) would not run before a missing rank came, as the
    wait is torch's C++. Signals ignored (a terminal's SIGINT under `vitctl train`) stay ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    for signum, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def own_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """Run on a high-priority CUDA stream of torch's pool rather than the legacy default stream (on the CPU: no
    stream).

    Measured, not explained: on one H200 DALI's batches fed the compiled step 3-4% faster on a pool stream (Swin-B
    b128 2,832 against 2,720 img/s, ViT-B b256 3,559 against 3,445; synthetic data alike on both, and a GPU sleep in
    place of the step). docs/performance.md has the command. From the high-priority pool because torch hands out
    its low-priority streams round robin to libraries too: torchvision's nvjpeg decoder takes one, and a decode on
    the stream of a queued step would wait for the step (on an H200 a sleep on one of the 32 held a decode 205 ms)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device, priority=-1))  # -1: the high-priority pool


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class StopVote:
    """Whether any rank was asked to stop, agreed by all ranks every step. Each step's votes are summed while the
    next step runs and read after it, so that no step waits for the host: every rank stops after the same step,
    one step after the first request."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = torch.zeros(1, pin_memory=device.type == "cuda")  # where a CUDA sum lands, read after its event
        self.pending: tuple[Any, torch.cuda.Event | None] | None = None

    def agreed(self, requested: bool) -> bool:
        """Cast this step's vote; True when the previous step's votes asked to stop."""
        if not dist.is_initialized():
            return requested
        stop = self.close()
        vote = torch.full((1,), float(requested), device=self.device)
        work = dist.all_reduce(vote, async_op=True)
        if self.device.type == "cuda":
            work.wait()  # the stream waits for the sum, the host does not
            self.host.copy_(vote, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending = None, event
        else:
            self.host, self.pending = vote, (work, None)
        return stop

    def close(self) -> bool:
        """Wait for the outstanding vote (before the process group goes away); True if it asked to stop."""
        if self.pending is None:
            return False
        work, event = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        else:
            work.wait()
        return self.host.item() > 0
