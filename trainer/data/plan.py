"""Which samples each data-parallel rank reads, and when.

Each epoch is one seeded permutation of ALL train samples, cut into global batches of dp_size x batch; rank r takes
the r-th slice of each. At most dp_size x batch - 1 samples are left out per epoch. A position is (epoch, samples
consumed in it), counted globally, so a run resumed onto another number of ranks continues the same permutation
where it stopped. Batches run on from one epoch into the next as one stream.
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

    @property
    def global_batch(self) -> int:
        return self.batch * self.dp_size

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

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
        """This rank's rows of the global batch that starts at `sample` of an epoch with this order."""
        start = sample + self.dp_rank * self.batch
        return order[start:start + self.batch]

    def stream(self, epoch: int, sample: int) -> Iterator[tuple[int, np.ndarray]]:
        """(epoch, this rank's rows) for every batch from (epoch, sample) on, epoch after epoch."""
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
