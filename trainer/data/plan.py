"""Which samples each data-parallel rank reads, and when.

Each epoch is one seeded permutation of ALL train samples, cut into global batches of dp_size x batch; rank r takes
the r-th slice of each. At most dp_size x batch - 1 samples are left out per epoch. A position is (epoch, samples
consumed in it), counted globally, so a run resumed onto another number of ranks continues the same permutation
where it stopped. Batches run on from one epoch into the next as one stream.

Repeated augmentation (DeiT's RASampler, timm's RepeatAugSampler) with r repeats: the epoch's order is the
permutation with each sample repeated r times in a row, cut to the epoch's length (so an epoch draws num_samples / r
samples, each r times, as timm's sampler does), and each global batch is dealt round-robin over the ranks, so a
sample's consecutive repeats land on r different ranks when there are at least r. The order holds draws, sample x r
+ repeat: each repeat has its own key for its augmentation's random numbers. With r = 1 a draw is the sample.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EpochPlan:
    num_samples: int
    batch: int  # per rank
    dp_rank: int
    dp_size: int
    seed: int
    repeats: int = 1  # repeated augmentation: draws of each sample in a row in the order

    @property
    def global_batch(self) -> int:
        return self.batch * self.dp_size

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's draws in order (sample x repeats + repeat), num_samples of them."""
        samples = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        if self.repeats == 1:
            return samples
        draws = samples[:, None] * self.repeats + np.arange(self.repeats)
        return draws.reshape(-1)[:self.num_samples]

    def sample(self, draws: np.ndarray) -> np.ndarray:
        """The samples (rows of the split) that draws read."""
        return draws // self.repeats

    def start(self, epoch: int, sample: int) -> tuple[int, int]:
        """Where a stream from (epoch, sample) begins: a position left by a run with a smaller global batch may not
        fit a whole batch of this one before the epoch ends, and then it is the next epoch's start."""
        return (epoch + 1, 0) if sample + self.global_batch > self.num_samples else (epoch, sample)

    def advance(self, epoch: int, sample: int) -> tuple[int, int]:
        """The position after one global batch from (epoch, sample)."""
        return self.start(epoch, sample + self.global_batch)

    def locate(self, epoch: int, sample: int, batches: int) -> tuple[int, int]:
        """The position `batches` global batches after (epoch, sample), in O(1)."""
        epoch, sample = self.start(epoch, sample)
        left = (self.num_samples - sample) // self.global_batch  # in the current epoch
        if batches < left:
            return epoch, sample + batches * self.global_batch
        epochs, into = divmod(batches - left, self.batches_per_epoch)
        return epoch + 1 + epochs, into * self.global_batch

    def rows(self, order: np.ndarray, sample: int) -> np.ndarray:
        """This rank's draws of the global batch that starts at `sample` of an epoch with this order."""
        if self.repeats > 1:  # round-robin: consecutive repeats go to consecutive ranks
            return order[sample + self.dp_rank:sample + self.global_batch:self.dp_size]
        start = sample + self.dp_rank * self.batch  # contiguous, as runs written before repeats were read
        return order[start:start + self.batch]

    def stream(self, epoch: int, sample: int) -> Iterator[tuple[int, np.ndarray]]:
        """(epoch, this rank's draws) for every batch from (epoch, sample) on, epoch after epoch."""
        epoch, sample = self.start(epoch, sample)
        order = self.order(epoch)
        while True:
            yield epoch, self.rows(order, sample)
            next_epoch, sample = self.advance(epoch, sample)
            if next_epoch != epoch:
                epoch, order = next_epoch, self.order(next_epoch)


def eval_rows(num_samples: int, dp_rank: int, dp_size: int) -> range:
    """This rank's contiguous share of the eval samples: every one exactly once over all ranks."""
    per_rank, extra = divmod(num_samples, dp_size)
    start = dp_rank * per_rank + min(dp_rank, extra)
    return range(start, start + per_rank + (dp_rank < extra))
