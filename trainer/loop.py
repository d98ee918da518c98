"""The training loop, run once per rank: model, data, optimizer, precision, checkpoints, eval, metrics."""

import contextlib
import logging
import math
import random
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import get_ema_multi_avg_fn

from . import checkpoint as ckpt
from . import runlock
from .config import LR_REFERENCE_BATCH, ConfigError, RunConfig, config_from_dict
from .data import Batch, build_data
from .fp8 import convert_to_float8
from .metrics import MetricsWriter, mfu
from .models import build_model
from .ops import resolve
from .optim import build_optimizer, lr_at, param_groups, set_lr, step_on_local_shards
from .parallel import (
    DistEnv,
    StopVote,
    build_mesh,
    expandable_cuda_memory,
    init_distributed,
    own_stream,
    parallel_dims,
    parallelize,
    shutdown,
    widen_cuda_queues,
)
from .precision import Precision, clip_gradients
from .preflight import epochs_trained, preflight, stop_step
from .pretrained import Pretrained, read_pretrained

log = logging.getLogger("vitctl.train")


class Diverged(ConfigError):
    """The loss or the weights became non-finite: the run stops without checkpointing them."""


@dataclass
class Position:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    sample: int = 0  # samples of this epoch's permutation consumed, over all data-parallel ranks


class EMA:
    """Exponential moving average of the fp32 weights (sharded like them under FSDP), by torch's EMA rule.

    Not torch's AveragedModel nor timm's ModelEmaV3: both deep-copy the module, which FSDP2 refuses ("FSDP does not
    support deepcopy"). The shadow is a dict of tensors named like the parameters: what checkpoints hold under "ema".
    """

    def __init__(self, weights: nn.Module, decay: float) -> None:
        self.decay = decay
        self.average = get_ema_multi_avg_fn(decay)
        self.shadow = {n: p.detach().clone() for n, p in weights.named_parameters()}

    @torch.no_grad()
    def update(self, weights: nn.Module, stepped_here: Callable[[nn.Parameter], bool]) -> None:
        """Average in the weights this rank steps (under ZeRO-1 its share; other ranks average in the rest)."""
        pairs = [(s, p.detach()) for s, p in zip(self.shadow.values(), weights.parameters(), strict=True)
                 if stepped_here(p)]
        for sharded in (False, True):  # foreach kernels take no mix of DTensors (tensor parallel) and tensors
            part = [(s, p) for s, p in pairs if isinstance(p, DTensor) == sharded]
            if part:
                self.average([s for s, _ in part], [p for _, p in part], None)

    @contextlib.contextmanager
    def swapped_into(self, module: nn.Module) -> Iterator[None]:
        """The EMA copied into `module`'s parameters (cast to bf16 for a bf16 model) while inside, its own weights
        after. In place, so the compiled forward and its CUDA graphs (which hold the parameters' addresses) run it
        as they are, and under bf16-pure the fp32 masters are never touched."""
        _reshard(module)
        params = list(module.parameters())
        trained = [p.detach().clone() for p in params]
        _copy(params, list(self.shadow.values()))
        try:
            yield
        finally:
            _reshard(module)
            _copy(params, trained)


@torch.no_grad()
def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    for target, source in zip(targets, sources, strict=True):  # one by one: DTensor has no _foreach_copy_
        target.copy_(source)


def _reshard(module: nn.Module) -> None:
    """FSDP2 keeps the root's parameters gathered after a forward with no backward (an eval's): shard them again,
    so that the parameters are the DTensor shards the EMA mirrors and the next forward gathers what they hold."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


class Trainer:
    def __init__(self, config: RunConfig, env: DistEnv, resume: bool) -> None:
        self.c, self.env, self.run_dir = config, env, Path(config.train.out_dir)
        checkpoints = ckpt.checkpoints_to_resume(self.run_dir, resume)
        self.strategy = preflight(config, env.world_size, env.device, resuming=bool(checkpoints))
        self.mesh = build_mesh(parallel_dims(self.strategy, env.world_size), env.device)
        self.data = build_data(config, self.mesh.dp_rank, self.mesh.dp_size, env.device)
        self.ops = resolve(config.train.fused, env.device, compiling=config.train.compile)
        self.precision = Precision(config.train.precision, env.device)
        # On the meta device: parallelize divides it, then each rank allocates and initialises only its own part.
        with torch.device("meta"):
            model = build_model(config.model, self.ops, config.train.seed)
        pretrained = self._read_pretrained(model) if not checkpoints else None  # a resumed run loads its own
        if self.precision.fp8:  # before parallelize: FSDP2 shards and the masters copy what this swaps in
            convert_to_float8(model, config.train.fp8_recipe, fsdp=self.strategy.fsdp,
                              min_width=config.train.fp8_min_width)
        self.flops_per_image = model.flops_per_image()  # of the whole model: a pipeline stage keeps part of it
        # Each data-parallel rank its own drop path and mixup. The ranks of one data-parallel coordinate draw the
        # same mixup (a pipeline's first stage mixes the images, its last the targets) and, within a stage, the same
        # drop path (a tensor-parallel group's ranks hold one copy of the activations).
        _seed(config.train.seed + self.mesh.dp_rank)
        if self.mesh.pp_rank:
            torch.manual_seed(config.train.seed + self.mesh.dp_rank + 7919 * self.mesh.pp_rank)
        # Without a pipeline, parallel.microbatches splits each batch; its gradients accumulate like accum_steps'.
        self.chunks = self.strategy.microbatches if self.strategy.pp == 1 else 1
        self.par = parallelize(model, self.mesh, self.strategy, self.precision, config.train,
                               config.parallel.grad_reduce, config.optim.accum_steps * self.chunks, env.device,
                               lambda part: self._init_weights(part, pretrained))
        groups = param_groups(self.par.weights, config.optim.weight_decay, config.optim.layer_decay,
                              self.par.steps_here)
        self.optimizer = build_optimizer(groups, config.optim, self.ops, config.optim.lr)
        self.scaler = self.precision.scaler()
        self.ema = EMA(self.par.weights, config.train.ema_decay) if config.train.ema_decay else None
        self.cuda_graphs = config.train.compile and config.train.compile_mode == "reduce-overhead"
        self.mixup, self.loss_fn = _mixup_and_loss(config)
        self.position = Position()
        self.metrics = MetricsWriter(self.run_dir, env.is_main)
        if env.is_main:
            ckpt.remove_partial(self.run_dir)
        self.writer = ckpt.CheckpointWriter(self.run_dir, config.train.keep_checkpoints, env.is_main,
                                            config.train.async_checkpoint)
        if checkpoints:
            self._restore(checkpoints[-1])
        else:
            self.metrics.drop_after(0)  # an earlier attempt here that saved no checkpoint: this run redoes its steps
        # the last step whose loss is known finite: it vouches for the weights up to the step before it
        self.finite_through = self.position.step
        self._schedule()

    def _read_pretrained(self, model: nn.Module) -> Pretrained | None:
        """finetune.from_ckpt's weights, checked against the whole model (on the meta device: its names and shapes)."""
        c = self.c.finetune
        if not c.from_ckpt:
            return None
        return read_pretrained(model, Path(c.from_ckpt), c.reset_head, self.c.model.name, trust=c.trust_checkpoint)

    def _init_weights(self, part: nn.Module, pretrained: Pretrained | None) -> None:
        """This rank's part of the model, just allocated: initialised from train.seed (the same values on every
        layout), then the finetuning weights over it. A resumed run's checkpoint overwrites it later (_restore)."""
        part.init_weights(self.c.train.seed)
        if pretrained is not None:
            pretrained.load_into(part, self.c.train.seed)

    def _schedule(self) -> None:
        """Steps and the LR schedule in epochs of the current global batch (a resumed run may have another)."""
        c, plan = self.c, self.data.plan
        self.global_batch = plan.global_batch * c.optim.accum_steps
        self.base_lr = c.optim.lr * self.global_batch / LR_REFERENCE_BATCH
        self.min_lr = c.optim.min_lr * self.global_batch / LR_REFERENCE_BATCH
        self.warmup_lr = c.optim.warmup_lr * self.global_batch / LR_REFERENCE_BATCH  # scaled as Swin's main.py does
        self.epoch_steps = plan.batches_per_epoch / c.optim.accum_steps  # fractional: a step may span two epochs
        self.stop_step = stop_step(self.position.step, self.epochs_done(), c.train.epochs, plan.batches_per_epoch,
                                   c.optim.accum_steps)
        if c.train.max_steps:
            self.stop_step = min(self.stop_step, c.train.max_steps)

    def epochs_done(self) -> float:
        p, plan = self.position, self.data.plan
        return epochs_trained(p.epoch, p.sample, plan.batches_per_epoch, plan.global_batch)

    # ---------------------------------------------------------------- checkpoints

    def _state(self, rng: bool, by_name: bool = True) -> dict[str, Any]:
        """What a checkpoint holds, as DCP saves and loads it: tensors sharded or whole, named by parameter.
        `by_name`: the optimizer's hyperparameters too, so that a layout that groups the parameters otherwise (a
        pipeline stage holds some of them; tensor-parallel ones are grouped apart) loads them."""
        options = StateDictOptions(flatten_optimizer_state_dict=by_name)
        state: dict[str, Any] = {"model": get_model_state_dict(self.par.weights),
                                 "optimizer": get_optimizer_state_dict(self.par.weights, self.optimizer,
                                                                       options=options)}
        if self.scaler:
            state["scaler"] = {k: torch.tensor(float(v), dtype=torch.float64)
                               for k, v in self.scaler.state_dict().items()}
        if self.ema:
            state["ema"] = self.ema.shadow
        if rng:  # each rank's streams under its own key
            state["rng"] = {f"rank{self.env.rank}": ckpt.rng_state()}
        return state

    def save(self, window: "Window", blocking: bool = False) -> None:
        """Checkpoint this step, unless the loss since the last log or the weights are not finite (Diverged)."""
        self._bring_up_to_date(masters=True)
        state = self._state(rng=True)
        self._refuse_nonfinite(window, state["model"])
        meta = {"step": self.position.step, "position": asdict(self.position), "world_size": self.env.world_size,
                "mesh": asdict(self.mesh.dims), "layout": self.strategy.layout(self.env.world_size),
                "config": self.c.to_dict(), "data": self.data.digest, "time": time.time()}
        self.writer.save(self.position.step, state, meta, blocking)

    def _bring_up_to_date(self, masters: bool) -> None:
        """Under ZeRO-1: the fp32 masters (when asked) and the EMA of the weights that other ranks step, as those ranks
        hold them."""
        weights = list(self.par.weights.parameters())
        if masters:
            self.par.bring_up_to_date([(w, w.detach()) for w in weights])
        if self.ema:
            self.par.bring_up_to_date(list(zip(weights, self.ema.shadow.values(), strict=True)))

    def _refuse_nonfinite(self, window: "Window", weights: dict[str, Any]) -> None:
        """Raise Diverged on every rank when any rank's loss since the last log or part of the weights is not
        finite: a finite loss does not make the update after it finite (one all-reduce, at checkpoint steps only)."""
        parts = [w.to_local() if isinstance(w, DTensor) else w for w in weights.values()]
        finite = torch.stack([torch.isfinite(p).all() for p in parts])
        bad = torch.stack([~torch.isfinite(window.sums[0]), ~finite.all()]).float()
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        loss_bad, weights_bad = bad.tolist()
        if loss_bad:
            raise self._diverged("the training loss is not finite")
        if weights_bad:
            raise self._diverged("the weights hold non-finite values (inf or nan) after the update", from_loss=False)
        self.finite_through = self.position.step

    def _diverged(self, what: str, from_loss: bool = True) -> Diverged:
        """The error that stops a diverged run, naming the way on: a lower learning rate, from the last checkpoint, or
        from the one before it where the last one's weights gave the non-finite loss (`from_loss`) themselves."""
        self.writer.wait()  # a save still in flight was checked before it began: publish it, it is the way on
        found, c = ckpt.list_checkpoints(self.run_dir), self.c
        lower = f"lower the learning rate (--set optim.lr=..., now {c.optim.lr:g})"
        if c.train.precision == "fp16":
            lower += " or use --precision bf16 (fp16 overflows where bf16 does not)"
        last = int(ckpt.NAME.fullmatch(found[-1].name)[1]) if found else None
        if last is not None and last >= self.finite_through:  # no finite loss came from its weights: they may be off
            aside = (f"move it aside (mv {shlex.quote(str(found[-1]))} {shlex.quote(str(found[-1]))}.diverged) and "
                     + (f"rerun with --resume from the one before it, {found[-2]}" if len(found) > 1 else
                        "start again"))
            if from_loss and self.position.step == last + 1:  # the loss of its very weights, whatever the rate
                way = (f"The weights of the last checkpoint, {found[-1]}, give that loss themselves: {aside}; where "
                       f"this run's learning rate made them diverge, {lower} too")
            else:
                way = (f"To go on from the last checkpoint, {found[-1]}, {lower} and rerun with --resume; no finite "
                       f"loss has come from its weights, which may be diverging already: if it diverges again, "
                       f"{aside}")
        elif found:
            way = f"To go on from the last checkpoint, {found[-1]}, {lower} and rerun with --resume"
        else:
            way = f"No checkpoint was saved before it: {lower} and start again"
        return Diverged(f"step {self.position.step}: {what}: the run diverged, and nothing from this step on is "
                        f"checkpointed. {way}")

    def _restore(self, path: Path) -> None:
        meta = ckpt.read_checked(path)
        if changed := ckpt.model_change(path, meta["config"]["model"], self.c.to_dict()["model"]):
            raise ConfigError(changed)
        same_layout = meta["world_size"] == self.env.world_size and meta["mesh"] == asdict(self.mesh.dims)
        keys = ckpt.saved_keys(path)
        by_name = not any(key.startswith("optimizer.param_groups.0.") for key in keys)  # vitctl <= 0.1: by index
        saved = {key.split(".")[0] for key in keys}
        state = {part: value for part, value in self._state(same_layout, by_name).items() if part in saved}
        if mismatched := ckpt.shape_mismatches(path, state["model"]):
            raise ConfigError(f"{path} holds weights of other shapes than this vitctl's model ({mismatched[0]}; "
                              f"{len(mismatched)} in all): it was written by an earlier version. Start a new run "
                              f"from it with `vitctl finetune --from-ckpt {shlex.quote(str(path))}` (which converts "
                              "them), new --out")
        ckpt.load(path, state)
        set_model_state_dict(self.par.weights, state["model"])
        set_optimizer_state_dict(self.par.weights, self.optimizer, state["optimizer"],
                                 options=StateDictOptions(flatten_optimizer_state_dict=by_name))
        if self.par.master is not None:
            self.par.master.master_to_model()
        if self.scaler and "scaler" in state:
            kinds = self.scaler.state_dict()
            self.scaler.load_state_dict({k: type(kinds[k])(v.item()) for k, v in state["scaler"].items()})
        if self.ema and "ema" not in state:  # the EMA starts from the resumed weights
            self.ema = EMA(self.par.weights, self.ema.decay)
        if same_layout:
            ckpt.set_rng_state(state["rng"][f"rank{self.env.rank}"])
        else:
            log.warning("resuming as %s from %s: model, optimizer and data position are resharded; the random "
                        "streams (drop path, mixup) restart", self.strategy.layout(self.env.world_size),
                        meta.get("layout", f"{meta['world_size']} ranks"))
        self.position = Position(**meta["position"])
        self.position.epoch, self.position.sample = self.data.plan.start(self.position.epoch, self.position.sample)
        self.metrics.drop_after(self.position.step)
        self.metrics.write({"step": self.position.step, "event": "resume", "checkpoint": path.name,
                            "from_world_size": meta["world_size"], "world_size": self.env.world_size})
        log.info("resumed from %s at step %d (epoch %d, sample %d)", path, self.position.step, self.position.epoch,
                 self.position.sample)

    # ---------------------------------------------------------------- steps

    def train_step(self, batches: Iterator[Batch]) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """One optimizer step over accum_steps batches, each in `chunks` micro-batches: (mean loss, gradient norm or
        None, seconds waiting for data). The loss and norm stay on the device: nothing here waits for the GPU."""
        micros, total, waited = self.c.optim.accum_steps * self.chunks, None, 0.0
        for batch in range(self.c.optim.accum_steps):
            start = time.perf_counter()
            images, labels, _ = next(batches)
            waited += time.perf_counter() - start
            if self.mixup:
                images, labels = self.mixup(images, labels)
            if self.par.input_dtype is not None:
                images = images.to(self.par.input_dtype)
            for chunk, (x, y) in enumerate(zip(images.chunk(self.chunks), labels.chunk(self.chunks), strict=True)):
                micro = batch * self.chunks + chunk
                self._graph_step_begin()
                loss = self.par.forward_backward(x, y, lambda logits, t: self.loss_fn(logits.float(), t) / micros,
                                                 self._backward, sync=micro == micros - 1)
                # Summed at once: under CUDA graphs `loss` is a graph output that the next replay overwrites.
                total = loss.clone() if total is None else total.add_(loss)
        norm = self._optimizer_step()
        self.optimizer.zero_grad()  # set_to_none is the default; apex's FusedAdam takes no argument
        if self.ema:
            self.ema.update(self.par.weights, self.par.steps_here)
        return total, norm, waited

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def _optimizer_step(self) -> torch.Tensor | None:
        clip, groups = self.c.optim.clip_grad or 0.0, self.par.norm_groups
        if self.par.master is not None:
            return self.par.step_masters(self.optimizer, clip)
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = None
        if clip:
            norm = clip_gradients([p for g in self.optimizer.param_groups for p in g["params"]], clip, groups)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif not step_on_local_shards(self.optimizer):
            self.optimizer.step()
        return norm

    def _graph_step_begin(self) -> None:
        """Under CUDA graphs: the previous forward's outputs are consumed, so their memory may be reused."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def evaluate(self) -> dict[str, float]:
        """Top-1, top-5 and loss on the eval split, of the weights and (`eval_ema_*`) of their EMA when kept."""
        if self.data.eval is None:
            return {}
        result = self._evaluate_weights()
        if self.ema:
            self._bring_up_to_date(masters=False)
            with self.ema.swapped_into(self.par.module):  # its parameters come in the order of `weights`
                ema = self._evaluate_weights()
            result.update({f"eval_ema_{key.removeprefix('eval_')}": ema[key]
                           for key in ("eval_top1", "eval_top5", "eval_loss")})
        return result

    @torch.no_grad()
    def _evaluate_weights(self) -> dict[str, float]:
        self.par.module.eval()
        sums = torch.zeros(4, dtype=torch.float64, device=self.env.device)  # top-1, top-5, count, loss
        for batch in self.data.eval():
            if batch is None:  # padding: run a dummy forward so FSDP collectives stay in step
                if self.par.fsdp:
                    size = self.c.model.img_size
                    self.par.predict(torch.zeros(1, 3, size, size, device=self.env.device, dtype=self.par.input_dtype))
                continue
            images, labels, _ = batch
            if self.par.input_dtype is not None:
                images = images.to(self.par.input_dtype)
            self._graph_step_begin()
            logits = self.par.predict(images)
            if logits is None:  # a pipeline stage before the last: the last one counts
                continue
            logits = logits.float()
            top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
            sums += torch.stack([(top5[:, 0] == labels).sum(), (top5 == labels[:, None]).any(dim=1).sum(),
                                 torch.tensor(len(labels), device=labels.device),
                                 nn.functional.cross_entropy(logits, labels, reduction="sum")]).double()
        self.par.module.train()
        if dist.is_initialized():
            dist.all_reduce(sums, group=self.mesh.metrics_group)
        correct1, correct5, count, loss_sum = sums.tolist()
        return {"eval_top1": 100 * correct1 / count, "eval_top5": 100 * correct5 / count,
                "eval_loss": loss_sum / count, "eval_samples": int(count)}

    # ---------------------------------------------------------------- the loop

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """Train to the stop step; when `should_stop` says so (checked every step), checkpoint and return."""
        c, p, env = self.c, self.position, self.env
        if env.is_main:
            log.info("run %s: %s, %d steps of %d images (%.3g an epoch), lr %.3g, ops %s, data %s", self.run_dir,
                     self.strategy.layout(env.world_size), self.stop_step, self.global_batch, self.epoch_steps,
                     self.base_lr, self.ops.describe(), self.data.source)
        self.metrics.write({"step": p.step, "event": "start", "layout": self.strategy.layout(env.world_size),
                            **({"data": c.data.path} if c.data.path else {})})
        window = Window(self.env.device)
        self.par.module.train()
        batches = self.data.train(p.epoch, p.sample)
        last_eval: dict[str, float] = {}
        loss = float("nan")
        eval_every = max(1e-9, c.train.eval_every_epochs)
        vote = StopVote(env.device)
        while p.step < self.stop_step:
            set_lr(self.optimizer, lr_at(self.epochs_done() + 1 / self.epoch_steps, c.train.epochs,
                                         c.optim.warmup_epochs, self.base_lr, self.min_lr, self.warmup_lr))
            evals_before = math.floor(self.epochs_done() / eval_every + 1e-9)
            window.add(*self.train_step(batches))
            p.step += 1
            for _ in range(c.optim.accum_steps):
                p.epoch, p.sample = self.data.plan.advance(p.epoch, p.sample)
            stop = p.step < self.stop_step and vote.agreed(should_stop())
            if stop or p.step % c.train.log_every == 0 or p.step == self.stop_step:
                loss = self._log(window)
                if not math.isfinite(loss):  # here the loss is on the host already: no extra sync
                    raise self._diverged(f"the training loss is {loss} (not finite)")
                self.finite_through = p.step
                self.writer.poll()
            if stop:  # a signal leaves a grace time (Slurm's KillWait) for the checkpoint alone: no eval
                vote.close()
                self.save(window, blocking=True)
                self.metrics.write({"step": p.step, "event": "stopped"})
                self.metrics.close()
                return {"step": p.step, "loss": loss, "stopped": True}
            if math.floor(self.epochs_done() / eval_every + 1e-9) > evals_before or p.step == self.stop_step:
                last_eval = self.evaluate()
                if last_eval:
                    self.metrics.write({"step": p.step, "epoch": p.epoch, **last_eval})
            if p.step % c.train.checkpoint_every == 0 or p.step == self.stop_step:
                self.save(window, blocking=p.step == self.stop_step)
        vote.close()
        self.writer.wait()
        self.metrics.close()
        return {"step": p.step, "loss": loss, **last_eval}

    def _log(self, window: "Window") -> float:
        """Reduce the window's on-device sums over the data-parallel ranks and write one record (one host sync)."""
        steps, seconds, waited = window.steps, time.perf_counter() - window.start, window.waited
        loss_sum, norm_sum = window.take(self.mesh.metrics_group)
        loss = loss_sum / (steps * self.mesh.dp_size)
        images_per_s = steps * self.global_batch / seconds
        record = {"step": self.position.step, "epoch": self.position.epoch, "loss": loss,
                  "lr": self.optimizer.param_groups[0]["lr"] / self.optimizer.param_groups[0].get("lr_scale", 1.0),
                  "images_per_s": images_per_s, "step_time_s": seconds / steps, "data_wait_s": waited / steps,
                  "total_steps": self.stop_step}
        if norm_sum is not None:
            record["grad_norm"] = norm_sum / steps
        if self.env.device.type == "cuda":
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.env.device) / 2**30
            util = mfu(3 * self.flops_per_image, images_per_s / self.env.world_size, self.env.device)
            if util is not None:
                record["mfu"] = util
        self.metrics.write(record)
        return loss


class Window:
    """Sums over the steps since the last log, kept on the device until the log step reads them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss, gradient norm
        self.steps, self.waited, self.has_norm, self.start = 0, 0.0, False, time.perf_counter()

    def add(self, loss: torch.Tensor, norm: torch.Tensor | None, waited: float) -> None:
        self.sums[0] += loss.double()
        if norm is not None:
            self.sums[1] += _local(norm).double()
            self.has_norm = True
        self.steps, self.waited = self.steps + 1, self.waited + waited

    def take(self, group: dist.ProcessGroup | None) -> tuple[float, float | None]:
        """(loss summed over steps and data-parallel ranks, gradient norm summed over steps); starts a new window.
        `group` spans the pipeline stages too: the stages before the last add zeros."""
        loss = self.sums[0].clone()
        if dist.is_initialized():
            dist.all_reduce(loss, group=group)
        result = loss.item(), self.sums[1].item() if self.has_norm else None
        self.reset()
        return result


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's value as a plain tensor (a norm under FSDP is replicated)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _mixup_and_loss(config: RunConfig):
    a = config.augment
    if a.mixup > 0 or a.cutmix > 0:
        from timm.data import Mixup
        from timm.loss import SoftTargetCrossEntropy

        mixup = Mixup(mixup_alpha=a.mixup, cutmix_alpha=a.cutmix, switch_prob=a.mixup_switch_prob,
                      label_smoothing=a.label_smoothing, num_classes=config.model.num_classes)
        return mixup, SoftTargetCrossEntropy()
    return None, nn.CrossEntropyLoss(label_smoothing=a.label_smoothing)


def train(config: RunConfig | dict, resume: bool = False, use_cuda: bool | None = None,
          should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Train on this process's rank (single process when no launcher environment is set).

    `should_stop` (e.g. set by a pre-emption signal) makes every rank checkpoint and return early.
    """
    if isinstance(config, dict):
        config = config_from_dict(config)
    widen_cuda_queues()
    expandable_cuda_memory()
    env = init_distributed(torch.cuda.is_available() if use_cuda is None else use_cuda)
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING,
                        format=f"%(asctime)s [rank {env.rank}] %(name)s: %(message)s")
    try:
        with runlock.holding(Path(config.train.out_dir)) if env.is_main else contextlib.nullcontext(), \
                own_stream(env.device):
            return Trainer(config, env, resume).run(should_stop)
    finally:
        shutdown()
