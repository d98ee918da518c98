"""Synthetic batches resident on the device: for benchmarks and for runs without data."""

from collections.abc import Iterator

import torch


class SyntheticBatches:
    def __init__(self, batch: int, img_size: int, num_classes: int, device: torch.device, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randn(batch, 3, img_size, img_size, generator=generator).to(device)
        self.labels = torch.randint(0, num_classes, (batch,), generator=generator).to(device)
        self.rows = torch.arange(batch)

    def __call__(self, epoch: int, sample: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        while True:
            yield self.images, self.labels, self.rows
