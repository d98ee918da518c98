"""The model run as two segments, the first blocks and the rest, each compiled on its own. One compiled graph returns
all its gradients when its backward ends; two let the reduction of the later segment's gradients run while the
earlier segment's backward does (parallel/data_parallel.py's ReduceAfterBackward, grad_reduce=segmented)."""

import math
from collections.abc import Callable

from torch import Tensor, nn

from ..models import blocks_of
from .pipeline_parallel import container_copy, keep_stage


def head_blocks(n_blocks: int) -> int:
    """Blocks in the first segment: an eighth, at least one. Its backward (an eighth of the step's, 4-8 ms for ViT-B
    and Swin-B on an H200) hides the reduction of the rest (about a millisecond within a node); the first segment's
    own gradients, reduced after the backward, are few (the early blocks, and in Swin the narrow stages)."""
    return max(1, math.ceil(n_blocks / 8))


def split_segments(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(head, tail): copies of the model's containers pruned to the first blocks and to the rest, sharing every
    block, other module and parameter with `model`; tail(head(x)) is model(x)."""
    n_blocks = len(blocks_of(model))
    first = head_blocks(n_blocks)
    head, tail = container_copy(model), container_copy(model)
    keep_stage(head, range(first), first=True, last=False)
    keep_stage(tail, range(first, n_blocks), first=False, last=True)
    return head, tail


def run_segments(head: Callable[[Tensor], Tensor], tail: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    return lambda images: tail(head(images))
