"""Pipeline parallelism with torch.distributed.pipelining: each rank keeps its stage's blocks of the model (the rest
set to None, so parameter names stay the whole model's and checkpoints reshard between layouts) and runs them under
a GPipe or 1F1B schedule over micro-batches. Eval runs the stages one after another, without a schedule, because
its batches vary in size."""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..models import blocks_of
from ..models.swin import SwinTransformer
from ..models.vit import VisionTransformer
from .strategy import Strategy

# The parts outside the blocks, run before the first block and after the last: they live on the end stages.
ENDS = {VisionTransformer: (("patch_embed", "cls_token", "pos_embed"), ("norm", "pre_logits", "head")),
        SwinTransformer: (("patch_embed",), ("norm", "head"))}


def stage_range(strategy: Strategy, n_blocks: int, stage: int) -> range:
    """The blocks (indices in forward order) of pipeline stage `stage`."""
    counts = strategy.stage_blocks(n_blocks)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def keep_stage(model: nn.Module, blocks: range, first: bool, last: bool) -> None:
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


class Pipeline:
    """This rank's stage and the schedule that runs a step's micro-batches through all stages."""

    def __init__(self, stage_module: nn.Module, strategy: Strategy, stage: int, group: dist.ProcessGroup,
                 device: torch.device) -> None:
        self.stage, self.stages, self.group, self.device = stage, strategy.pp, group, device
        self.first, self.last = stage == 0, stage == strategy.pp - 1
        self.microbatches = strategy.microbatches
        self.loss_fn: Callable[[Tensor, Tensor], Tensor] | None = None
        _send_contiguous(stage_module)
        # Imported here: torch.distributed.pipelining takes a second to import, which every CLI command would pay.
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.pipeline_stage = PipelineStage(stage_module, stage, strategy.pp, device, group=group)
        # scale_grads=False: the loss of each micro-batch is divided by their count instead (`_loss`), so that the
        # sum of the micro-batch gradients is the batch mean's, as without a pipeline.
        schedules = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
        self.schedule = schedules[strategy.schedule](self.pipeline_stage, strategy.microbatches, loss_fn=self._loss,
                                                     scale_grads=False)

    def _loss(self, output: Tensor, target: Tensor) -> Tensor:
        return self.loss_fn(output, target) / self.microbatches

    def step(self, images: Tensor, targets: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """Forward and backward of one batch; its loss on the last stage, zero on the others."""
        self.loss_fn, losses = loss_fn, []
        inputs = (images,) if self.first else ()
        self.schedule.step(*inputs, target=targets if self.last else None, losses=losses)
        return torch.stack(losses).sum().detach() if self.last else torch.zeros((), device=self.device)

    @torch.no_grad()
    def predict(self, module: nn.Module, images: Tensor) -> Tensor | None:
        """The logits on the last stage (None on the others), the stages run in turn."""
        x = images if self.first else _receive(self._peer(-1), self.group, self.device)
        x = module(x)
        if self.last:
            return x
        _send(x, self._peer(1), self.group)
        return None

    def _peer(self, offset: int) -> int:
        return dist.get_global_rank(self.group, self.stage + offset)


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
