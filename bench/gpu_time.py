"""The GPU's own time for a piece of work, for the probes: each run is queued while the GPU sleeps, so the events
time the kernels alone, not the host's time to launch them."""

import statistics
from collections.abc import Callable

import torch


def median_gpu_ms(fn: Callable[[], object], repeats: int = 20, warmup: int = 5,
                  ready: Callable[[], object] = lambda: None) -> float:
    """Median ms of `repeats` runs of `fn` after `warmup`; `ready` runs once before the timed runs (a barrier)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ready()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(20_000_000)  # ~10 ms: the host queues `fn` meanwhile
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
