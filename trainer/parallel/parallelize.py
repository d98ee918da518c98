"""Apply the parallelisms to a model, one small function each (torchtitan's `parallelize_*` shape), in this order:
activation checkpointing per block, the pipeline stages, tensor parallel, compile, then data parallelism (FSDP2 for
the sharded blocks, one reduction after the backward or DDP for replicated weights). The model comes on the meta
device: what divides it (the stages, tensor parallel, FSDP2) is applied there, and only then does each rank allocate
and initialise its own part. The loop calls what this returns and never branches on the strategy."""

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ..config import TrainConfig
from ..models import blocks_of, stream_parameters
from ..precision import MasterWeights, Precision
from .data_parallel import ReduceAfterBackward, apply_ddp, apply_fsdp, one_node
from .mesh import Mesh
from .pipeline_parallel import Pipeline, rank_blocks, share_parameters, split_stages
from .strategy import Strategy
from .tensor_parallel import apply_tensor_parallel
from .zero import Zero1

LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class Parallelized:
    weights: nn.Module  # the module the optimizer, the checkpoints and the EMA see: fp32 (sharded under FSDP)
    module: nn.Module  # the module that runs (DDP's wrapper, the bf16 model): train() and eval() go to it
    forward: Callable[[Tensor], Tensor]  # `module`, compiled when asked
    precision: Precision
    master: MasterWeights | None  # bf16-pure outside FSDP
    ddp: DistributedDataParallel | None
    reducer: ReduceAfterBackward | None  # replicated weights reduced after the backward
    zero: Zero1 | None  # or each rank stepping its share of them
    fsdp: list[nn.Module]  # the FSDP2 roots (one per pipeline stage of this rank), when any weights are sharded
    pipeline: Pipeline | None
    accum_steps: int

    @property
    def norm_groups(self) -> list[dist.ProcessGroup]:
        """The groups over which the gradients' squares are summed for their total norm: the pipeline stages hold
        other weights, and under ZeRO-1 each data-parallel rank other gradients."""
        return [g for g in (self.pipeline and self.pipeline.group, self.zero and self.zero.group) if g is not None]

    def steps_here(self, weight: nn.Parameter) -> bool:
        """Whether this rank steps `weight` (one of `weights`'), and so holds it and its EMA up to date."""
        return self.zero is None or self.zero.steps(weight)

    def step_masters(self, optimizer: torch.optim.Optimizer, max_norm: float) -> Tensor | None:
        """Step the fp32 masters (this rank's share under ZeRO-1, then gathered) and the bf16 model from them; the
        gradients' norm when clipping to `max_norm`."""
        if self.zero is None:
            return self.master.step(optimizer, max_norm, self.norm_groups)
        norm = self.zero.step(self.master, optimizer, max_norm, self.norm_groups)
        self.zero.gather_weights()
        return norm

    def bring_up_to_date(self, copies: list[tuple[nn.Parameter, Tensor]]) -> None:
        """Before a checkpoint or an evaluation reads them: each (weight, fp32 copy of it) pair's copy as the rank
        that steps the weight holds it (a no-op but under ZeRO-1). One copy of a weight at most per call."""
        if self.zero is not None:
            self.zero.gather(copies)

    @property
    def input_dtype(self) -> torch.dtype | None:
        """What the images are cast to before the forward (a bf16 model takes bf16 inputs)."""
        return torch.bfloat16 if self.master is not None else None

    def forward_backward(self, images: Tensor, targets: Tensor, loss_fn: LossFn,
                         backward: Callable[[Tensor], None], sync: bool) -> Tensor:
        """One micro-batch: forward, loss, backward; `sync` on the last of a step reduces the gradients. Returns
        the loss, detached (zero on pipeline stages other than the last)."""
        if self.reducer is not None:
            self.reducer.accumulate_in_place()
        with self._micro_batch(sync):
            with self.precision.autocast():
                if self.pipeline is not None:  # the schedule runs the backward too
                    loss = self.pipeline.step(images, targets, loss_fn)
                else:
                    loss = loss_fn(self.forward(images), targets)
            if self.pipeline is None:
                backward(loss)
        self._after_backward(sync)
        return loss.detach()

    def predict(self, images: Tensor) -> Tensor | None:
        """Eval logits (None on pipeline stages other than the last)."""
        with self.precision.autocast():
            if self.pipeline is not None:
                return self.pipeline.predict(images)
            return self.forward(images)

    def _micro_batch(self, sync: bool) -> AbstractContextManager:
        for root in self.fsdp:
            root.set_requires_gradient_sync(sync)
        if self.ddp is not None and not sync:
            return self.ddp.no_sync()
        return nullcontext()

    def _after_backward(self, sync: bool) -> None:
        """Reduce after the last micro-batch (when not DDP's job); bf16 gradients that no reduction consumes are
        summed into the masters in fp32."""
        if sync and self.zero is not None:
            self.zero.reduce()
        elif sync and self.reducer is not None:
            self.reducer.reduce()
        elif self.master is not None and (not sync or (self.ddp is None and self.accum_steps > 1)):
            self.master.accumulate()


def parallelize(model: nn.Module, mesh: Mesh, strategy: Strategy, precision: Precision, train: TrainConfig,
                grad_reduce: str, accum_steps: int, device: torch.device,
                init_weights: Callable[[nn.Module], None]) -> Parallelized:
    """`model` is fp32 on the meta device. Once divided, this rank's part is allocated on `device` and
    `init_weights` fills it, with the values the whole model would hold there (models/layers.py's init_tensor).
    Under a pipeline `model` becomes this rank's stages' part of the model, which holds their parameters; the stages
    run as modules that share them."""
    apply_checkpointing(model, strategy)
    stage_modules = [model]
    if strategy.pp > 1:
        blocks = rank_blocks(strategy, len(blocks_of(model)), mesh.pp_rank)
        stage_modules = split_stages(model, strategy, mesh.pp_rank)
        strategy = replace(strategy, blocks=tuple(strategy.blocks[i] for i in blocks))  # this rank's blocks
    if strategy.tp > 1:
        apply_tensor_parallel(model, mesh.sub("tp"))
    if strategy.fsdp:
        _shard(model, stage_modules, mesh, strategy, precision, train)
    materialize(model, stage_modules, device, init_weights)
    if strategy.fsdp:
        par = _sharded(model, stage_modules, mesh, strategy, precision, accum_steps)
    else:
        par = _replicate(model, mesh, strategy, precision, train, grad_reduce, accum_steps)
    if strategy.pp > 1:
        par.pipeline = Pipeline(stage_modules, strategy, mesh.pp_rank, mesh.sub("pp").get_group(),
                                next(par.weights.parameters()).device)
    return par


def materialize(model: nn.Module, stage_modules: list[nn.Module], device: torch.device,
                init_weights: Callable[[nn.Module], None]) -> None:
    """Allocate the parameters and buffers this rank holds on `device` (uninitialised memory) and fill them. After
    `to_empty` they are new tensors: what holds parameters (the masters, DDP, the reductions) is built after this.
    Under a pipeline the stage modules are allocated (FSDP2 roots among them reset their shards as they do) and the
    model is pointed at their parameters."""
    for module in stage_modules:
        module.to_empty(device=device)
    if stage_modules != [model]:
        share_parameters(model, stage_modules)
    init_weights(model)


def apply_checkpointing(model: nn.Module, strategy: Strategy) -> None:
    for block, choice in zip(blocks_of(model), strategy.blocks, strict=True):
        block.checkpoint = choice.checkpoint


def _replicate(model: nn.Module, mesh: Mesh, strategy: Strategy, precision: Precision, train: TrainConfig,
               grad_reduce: str, accum_steps: int) -> Parallelized:
    master = MasterWeights(model) if precision.pure else None
    ddp = reducer = zero = None
    if mesh.dims.dp_size > 1 and _steps_shares(grad_reduce, mesh, strategy, precision, master):
        # in bf16 but where micro-batches were summed in fp32
        exchange = torch.bfloat16 if accum_steps == 1 else torch.float32
        zero = Zero1(master, mesh.dp_group, mesh.dp_rank, mesh.dp_size, exchange)
    elif mesh.dims.dp_size > 1 and _reduce_after_backward(grad_reduce, mesh, strategy):
        pairs = master.pairs if master else [(p, p) for p in model.parameters() if p.requires_grad]
        reducer = ReduceAfterBackward(pairs, mesh.dp_group, mesh.dp_size)
    elif mesh.dims.dp_size > 1:
        ddp = apply_ddp(model, mesh, master)
    wrapped = ddp or model
    if train.compile and strategy.pp == 1 and strategy.tp == 1:
        forward = torch.compile(wrapped, mode=train.compile_mode)
    else:
        _compile_blocks(model, train)
        forward = wrapped
    return Parallelized(master.module if master else model, wrapped, forward, precision, master, ddp, reducer, zero,
                        [], None, accum_steps)


def _steps_shares(grad_reduce: str, mesh: Mesh, strategy: Strategy, precision: Precision,
                  master: MasterWeights | None) -> bool:
    """ZeRO-1 where asked (preflight: bf16-pure or fp8, no tp, pp or fsdp), and under auto for bf16-pure on one node
    with a weight for each rank: there it beat the all-reduce after the backward (docs/performance.md; fp8 was not
    measured with it)."""
    if grad_reduce == "zero1":
        return True
    return (grad_reduce == "auto" and precision.mode == "bf16-pure" and strategy.tp == strategy.pp == 1
            and len(master.pairs) >= mesh.dims.dp_size and one_node(mesh.dp_group))


def _reduce_after_backward(grad_reduce: str, mesh: Mesh, strategy: Strategy) -> bool:
    if strategy.tp > 1 or strategy.pp > 1:  # DDP does not take DTensor weights or pipeline stages
        return True
    return grad_reduce == "after_backward" or (grad_reduce == "auto" and one_node(mesh.dp_group))


def _shard(model: nn.Module, roots: list[nn.Module], mesh: Mesh, strategy: Strategy, precision: Precision,
           train: TrainConfig) -> None:
    """FSDP2 for the blocks marked fsdp (and the rest when fsdp_rest), on the meta device (each rank then allocates
    only its shards), under one root per stage module: the pipeline schedule reduces each stage's gradients once per
    step through its root."""
    _compile_blocks(model, train)  # per block, as FSDP2 expects: its hooks run between the compiled blocks
    sharded = [b for b, s in zip(blocks_of(model), strategy.blocks, strict=True) if s.fsdp]
    apply_fsdp(roots, mesh, precision.fsdp_policy(), sharded, set(_replicated(model, strategy, precision)))


def _sharded(model: nn.Module, roots: list[nn.Module], mesh: Mesh, strategy: Strategy, precision: Precision,
             accum_steps: int) -> Parallelized:
    """The FSDP2 model, materialised; what stays replicated is reduced over the data-parallel ranks after the
    backward."""
    replicated = _replicated(model, strategy, precision)
    reducer = ReduceAfterBackward([(p, p) for p in replicated if p.requires_grad], mesh.dp_group, mesh.dp_size) \
        if replicated and mesh.dp_size > 1 else None
    return Parallelized(model, model, model, precision, None, None, reducer, None, roots, None, accum_steps)


def _replicated(model: nn.Module, strategy: Strategy, precision: Precision) -> list[nn.Parameter]:
    """The parameters FSDP2 leaves whole: those of blocks not marked fsdp, all outside the blocks unless fsdp_rest,
    and under bf16 autocast those added to the residual stream (gathered in bf16 they would make it bf16, where
    replicated it is fp32)."""
    blocks = blocks_of(model)
    replicated = [p for b, s in zip(blocks, strategy.blocks, strict=True) if not s.fsdp for p in b.parameters()]
    if not strategy.fsdp_rest:
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        replicated += [p for p in model.parameters() if id(p) not in in_blocks]
    elif precision.stream_kept_fp32:
        replicated += stream_parameters(model)
    return replicated


def _compile_blocks(model: nn.Module, train: TrainConfig) -> None:
    """Each block compiled on its own, every one of them, with static shapes."""
    if not train.compile:
        return
    blocks = blocks_of(model)
    # The blocks share one `forward`, which Dynamo compiles again for each (its own drop-path rate is a constant to it;
    # Swin's stages differ in shape). Past the recompile limit (8) the rest would run eager, and after a change of shape
    # Dynamo would trace symbolic sizes. Three per block: training, evaluation, the evaluation's last partial batch.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 3 * len(blocks))
    for block in blocks:
        block.compile(mode=train.compile_mode, dynamic=False)
