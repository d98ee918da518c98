"""Pipeline parallelism with torch.distributed.pipelining. The model is cut into stages of consecutive blocks; rank r
of a pipeline of pp ranks runs stage r (GPipe, 1F1B) or, interleaved, the v stages r, r + pp, r + 2pp... (torch's
looped layout: a micro-batch passes every rank v times, and the bubble shrinks v-fold).

Each rank keeps its stages' blocks of the model and sets the rest to None, so that parameter names stay the whole
model's and checkpoints reshard between layouts; that model holds the rank's parameters for the optimizer, the
checkpoints and the EMA. Each stage runs as a copy of the model's containers pruned to its own blocks, sharing the
blocks, the other parts and every parameter with it. Eval runs the stages one after another, without a schedule,
because its batches vary in size."""

import copy
import itertools
from collections.abc import Callable, Collection

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from ..models import blocks_of
from ..models.swin import SwinTransformer
from ..models.vit import VisionTransformer
from .strategy import INTERLEAVED, Strategy

# The parts outside the blocks, run before the first block and after the last: they live on the end stages.
ENDS = {VisionTransformer: (("patch_embed", "cls_token", "pos_embed"), ("norm", "pre_logits", "head")),
        SwinTransformer: (("patch_embed",), ("norm", "head"))}


def rank_stages(strategy: Strategy, rank: int) -> list[int]:
    """The stages pipeline rank `rank` runs, in forward order."""
    return list(range(rank, strategy.n_stages, strategy.pp))


def stage_range(strategy: Strategy, n_blocks: int, stage: int) -> range:
    """The blocks (indices in forward order) of pipeline stage `stage`."""
    counts = strategy.stage_blocks(n_blocks)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def rank_blocks(strategy: Strategy, n_blocks: int, rank: int) -> list[int]:
    """The blocks of all the stages pipeline rank `rank` runs, in forward order."""
    return [block for stage in rank_stages(strategy, rank) for block in stage_range(strategy, n_blocks, stage)]


def keep_stage(model: nn.Module, blocks: Collection[int], first: bool, last: bool) -> None:
    """Set every part of `model` that another stage runs to None; the model's forward skips what is None."""
    before, after = ENDS[type(model)]
    for name in (() if first else before) + (() if last else after):
        setattr(model, name, None)
    all_blocks = blocks_of(model)
    if isinstance(model, SwinTransformer):  # a stage's patch merging runs with its first block
        for layer in model.layers:
            if layer.blocks[0] not in [all_blocks[i] for i in blocks]:
                layer.downsample = None
    parents = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    for index, block in enumerate(all_blocks):
        if index not in blocks:
            parent, name = parents[id(block)]
            setattr(parent, name, None)


def split_stages(model: nn.Module, strategy: Strategy, rank: int) -> list[nn.Module]:
    """The modules of the stages rank `rank` runs; `model` is pruned to their blocks and parts."""
    n_blocks, stages = len(blocks_of(model)), rank_stages(strategy, rank)
    modules = [_container_copy(model) for _ in stages]
    for module, stage in zip(modules, stages, strict=True):
        keep_stage(module, stage_range(strategy, n_blocks, stage), stage == 0, stage == strategy.n_stages - 1)
    keep_stage(model, set(rank_blocks(strategy, n_blocks, rank)), rank == 0, rank == strategy.pp - 1)
    return modules


def _container_copy(model: nn.Module) -> nn.Module:
    """A copy of the modules of `model` that hold blocks (the model, its block lists, Swin's stages), sharing every
    other module, every parameter and every buffer with it: pruning the copy leaves `model` whole."""
    blocks = {id(block) for block in blocks_of(model)}
    holders = {id(m) for m in model.modules() if id(m) not in blocks and any(id(b) in blocks for b in m.modules())}
    shared = itertools.chain((m for m in model.modules() if id(m) not in holders), model.parameters(), model.buffers())
    return copy.deepcopy(model, memo={id(x): x for x in shared})


def share_parameters(model: nn.Module, stage_modules: list[nn.Module]) -> None:
    """Point `model` at the parameters its stage modules hold. FSDP2 registers its sharded parameters on the modules
    that hold them, which for those of a stage's container copy itself (ViT's cls_token and pos_embed) is not one of
    the model's: the model would keep the unsharded originals."""
    for module in stage_modules:
        for name, param in module.named_parameters():
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, param)


class Pipeline:
    """This rank's stages and the schedule that runs a step's micro-batches through all stages."""

    def __init__(self, stage_modules: list[nn.Module], strategy: Strategy, rank: int, group: dist.ProcessGroup,
                 device: torch.device) -> None:
        self.modules, self.stages = stage_modules, rank_stages(strategy, rank)
        self.n_stages, self.pp, self.group, self.device = strategy.n_stages, strategy.pp, group, device
        self.first, self.last = rank == 0, rank == strategy.pp - 1
        self.microbatches = strategy.microbatches
        self.loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None
        for module in stage_modules:
            _send_contiguous(module)
        # Imported here: torch.distributed.pipelining takes a second to import, which every CLI command would pay.
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        stages = [PipelineStage(module, stage, self.n_stages, device, group=group)
                  for module, stage in zip(stage_modules, self.stages, strict=True)]
        # scale_grads=False: the loss of each micro-batch is divided by their count instead (`_loss`), so that the
        # sum of the micro-batch gradients is the batch mean's, as without a pipeline.
        schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, INTERLEAVED: ScheduleInterleaved1F1B}
        runs = stages if strategy.schedule == INTERLEAVED else stages[0]  # the others take one stage per rank
        self.schedule = schedules[strategy.schedule](runs, strategy.microbatches, loss_fn=self._loss,
                                                     scale_grads=False)

    def _loss(self, output: Tensor, target: Tensor) -> Tensor:
        return self.loss_fn(output, target) / self.microbatches

    def step(self, images: Tensor, targets: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """Forward and backward of one batch; its loss on the last stage's rank, zero on the others."""
        self.loss_fn, losses = loss_fn, []
        inputs = (images,) if self.first else ()
        self.schedule.step(*inputs, target=targets if self.last else None, losses=losses)
        return torch.stack(losses).sum().detach() if self.last else torch.zeros((), device=self.device)

    @torch.no_grad()
    def predict(self, images: Tensor) -> Tensor | None:
        """The logits on the last stage's rank (None on the others), the stages run in turn."""
        x = images
        for stage, module in zip(self.stages, self.modules, strict=True):
            if stage > 0:
                x = _receive(self._rank_of(stage - 1), self.group, self.device)
            x = module(x)
            if stage < self.n_stages - 1:
                _send(x, self._rank_of(stage + 1), self.group)
        # An FSDP2 root keeps its parameters gathered after a forward without backward: shard them again, so that
        # the model holding the parameters (which the EMA swaps and checkpoints save) holds its shards.
        for module in self.modules:
            if isinstance(module, FSDPModule):
                module.reshard()
        return x if self.last else None

    def _rank_of(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage % self.pp)


def _send_contiguous(module: nn.Module) -> None:
    """gloo sends only contiguous tensors, and a Swin stage's output (and its input's gradient) may be laid out
    otherwise after the window permutations. Hooks, not a wrapper: the schedule must see an FSDP stage as one, to
    reduce its gradients once per step rather than once per micro-batch."""
    module.register_forward_pre_hook(lambda _, args: tuple(_ContiguousGradient.apply(a) for a in args))
    module.register_forward_hook(lambda _, args, output: output.contiguous())


class _ContiguousGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _send(x: Tensor, peer: int, group: dist.ProcessGroup) -> None:
    header = torch.tensor([x.ndim, DTYPES.index(x.dtype), *x.shape] + [0] * (6 - x.ndim), device=x.device)
    dist.send(header, peer, group=group)
    dist.send(x.contiguous(), peer, group=group)


def _receive(peer: int, group: dist.ProcessGroup, device: torch.device) -> Tensor:
    header = torch.zeros(8, dtype=torch.int64, device=device)
    dist.recv(header, peer, group=group)
    ndim, dtype, *shape = header.tolist()
    x = torch.empty(shape[:ndim], dtype=DTYPES[dtype], device=device)
    dist.recv(x, peer, group=group)
    return x
