"""The training loop, run once per rank: model, data, optimizer, precision, checkpoints, eval, metrics."""

import logging
import math
import random
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from . import checkpoint as ckpt
from .config import ConfigError, RunConfig, config_from_dict
from .data import build_data
from .distributed import (
    DistEnv,
    all_reduce_sum,
    apply_ddp,
    apply_fsdp,
    barrier,
    gather_objects,
    init_distributed,
    shutdown,
)
from .metrics import MetricsWriter, mfu
from .models import build_model, set_activation_checkpointing
from .ops import resolve
from .optim import build_optimizer, lr_at, param_groups, set_lr
from .precision import MasterWeights, Precision
from .pretrained import load_pretrained

log = logging.getLogger("vitctl.train")
LR_REFERENCE_BATCH = 512  # optim.lr is for this global batch and scales linearly (DeiT, Swin)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


@dataclass
class Position:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch: int = 0  # batches consumed in this epoch


class EMA:
    """Exponential moving average of the parameters, in fp32."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.shadow = {n: p.detach().float().clone() for n, p in model.named_parameters()}

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, param in model.named_parameters():
            self.shadow[name].lerp_(param.detach().float(), 1 - self.decay)


class Trainer:
    def __init__(self, config: RunConfig, env: DistEnv, resume: bool) -> None:
        self.c, self.env, self.run_dir = config, env, Path(config.train.out_dir)
        _seed(config.train.seed + env.rank)
        self.data = build_data(config, env)
        if self.data.num_classes not in (None, config.model.num_classes):
            raise ConfigError(f"model.num_classes is {config.model.num_classes} but the shards hold "
                              f"{self.data.num_classes} classes; pass --set model.num_classes={self.data.num_classes}")
        self.ops = resolve(config.train.fused, env.device, compiling=config.train.compile)
        self.precision = Precision(config.train.precision, env.device)
        checkpoints = ckpt.checkpoints_to_resume(self.run_dir, resume)
        self.fsdp = config.train.parallel == "fsdp" and env.world_size > 1
        self.model = self._build_model(load_weights=not checkpoints)
        pure = config.train.precision == "bf16-pure"
        self.master = MasterWeights(self.model) if pure and not self.fsdp else None
        if self.fsdp:
            self.model = apply_fsdp(self.model, torch.bfloat16 if pure else None)
            self.wrapped = self.model
        else:
            self.wrapped = apply_ddp(self.model, env)
        groups = param_groups(self.model, config.optim.weight_decay, config.optim.layer_decay)
        self.optimizer = build_optimizer(self.master.swap_groups(groups) if self.master else groups, config.optim,
                                         self.ops, config.optim.lr)
        self.scaler = self.precision.scaler()
        self.ema = EMA(self.model, config.train.ema_decay) if config.train.ema_decay else None
        self.forward = torch.compile(self.wrapped, mode=config.train.compile_mode) if config.train.compile \
            else self.wrapped
        self.cuda_graphs = config.train.compile and config.train.compile_mode == "reduce-overhead"
        self.mixup, self.loss_fn = _mixup_and_loss(config)
        self._schedule()
        self.position = Position()
        self.metrics = MetricsWriter(self.run_dir, env.is_main)
        if checkpoints:
            self._restore(checkpoints[-1])

    def _build_model(self, load_weights: bool) -> nn.Module:
        c = self.c
        model = build_model(c.model, self.ops)
        if c.finetune.from_ckpt and load_weights:
            load_pretrained(model, Path(c.finetune.from_ckpt), c.finetune.reset_head, c.model.name)
        set_activation_checkpointing(model, c.train.activation_checkpointing)
        dtype = torch.bfloat16 if c.train.precision == "bf16-pure" and not self.fsdp else None
        return model.to(self.env.device, dtype=dtype)

    def _schedule(self) -> None:
        c, accum = self.c, self.c.optim.accum_steps
        self.steps_per_epoch = self.data.batches_per_epoch // accum
        if self.steps_per_epoch == 0:
            raise ConfigError(f"optim.accum_steps {accum} exceeds the {self.data.batches_per_epoch} batches per epoch")
        self.total_steps = math.ceil(c.train.epochs * self.steps_per_epoch)
        self.stop_step = min(self.total_steps, c.train.max_steps or self.total_steps)
        self.warmup = round(c.optim.warmup_epochs * self.steps_per_epoch)
        global_batch = c.data.batch_size * self.env.world_size * accum
        self.base_lr = c.optim.lr * global_batch / LR_REFERENCE_BATCH
        self.min_lr = c.optim.min_lr * global_batch / LR_REFERENCE_BATCH
        self.eval_interval = max(1, round(c.train.eval_every_epochs * self.steps_per_epoch))
        self.global_batch = global_batch

    # ---------------------------------------------------------------- checkpoints

    def _optimizer_state(self) -> dict:
        if self.master:
            return self.optimizer.state_dict()
        return get_optimizer_state_dict(self.wrapped, self.optimizer, options=FULL)

    def _model_state(self) -> dict[str, torch.Tensor]:
        if self.master:  # the fp32 master weights are the real ones
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]
            return dict(zip(names, (t.cpu().clone() for t in self.master.state_dict()), strict=True))
        return get_model_state_dict(self.wrapped, options=FULL)

    def save(self) -> None:
        payload = {"format": ckpt.FORMAT, "position": asdict(self.position), "model": self._model_state(),
                   "optimizer": self._optimizer_state(), "scheduler": {"step": self.position.step},
                   "scaler": self.scaler.state_dict() if self.scaler else None,
                   "ema": {k: v.cpu() for k, v in self.ema.shadow.items()} if self.ema else None,
                   "rng": gather_objects(ckpt.rng_state()), "world_size": self.env.world_size,
                   "config": self.c.to_dict()}
        if self.env.is_main:
            path = ckpt.save(self.run_dir, self.position.step, payload, self.c.train.keep_checkpoints)
            log.info("checkpoint %s", path)
        barrier()

    def _restore(self, path: Path) -> None:
        payload = ckpt.load(path)
        if payload["config"]["model"] != self.c.to_dict()["model"]:
            raise ConfigError(f"{path} was trained with model {payload['config']['model']}, "
                              f"not {self.c.to_dict()['model']}; use another --out")
        if self.master:
            self.master.load_state_dict([payload["model"][n] for n, p in self.model.named_parameters()
                                         if p.requires_grad])
            self.optimizer.load_state_dict(payload["optimizer"])
        else:
            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.wrapped, payload["model"], options=options)
            set_optimizer_state_dict(self.wrapped, self.optimizer, payload["optimizer"], options=options)
        if self.scaler and payload["scaler"]:
            self.scaler.load_state_dict(payload["scaler"])
        if self.ema and payload["ema"]:
            self.ema.shadow = {k: v.to(self.env.device) for k, v in payload["ema"].items()}
        if payload["world_size"] == self.env.world_size:
            ckpt.set_rng_state(payload["rng"][self.env.rank])
        else:
            log.warning("resuming on %d ranks from %d: random streams restart", self.env.world_size,
                        payload["world_size"])
        self.position = Position(**payload["position"])
        self.metrics.write({"step": self.position.step, "event": "resume", "checkpoint": path.name})
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, self.position.step, self.position.epoch,
                 self.position.batch)

    # ---------------------------------------------------------------- steps

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def train_step(self, batches) -> tuple[float, float]:
        """One optimizer step over accum_steps batches; returns (loss, seconds waiting for data)."""
        accum, total, waited = self.c.optim.accum_steps, 0.0, 0.0
        for micro in range(accum):
            start = time.perf_counter()
            images, labels = next(batches)
            waited += time.perf_counter() - start
            if self.mixup:
                images, labels = self.mixup(images, labels)
            if self.c.train.precision == "bf16-pure" and not self.fsdp:
                images = images.to(torch.bfloat16)
            last = micro == accum - 1
            sync = nullcontext() if last or not hasattr(self.wrapped, "no_sync") else self.wrapped.no_sync()
            if self.fsdp:
                self.model.set_requires_gradient_sync(last)
            self._graph_step_begin()
            with sync:
                with self.precision.autocast():
                    loss = self.loss_fn(self.forward(images).float(), labels) / accum
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            total += loss.detach()
        if self.master:
            self.master.step(self.optimizer, self.c.optim.clip_grad or 0.0)
        else:
            self._optimizer_step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema:
            self.ema.update(self.model)
        return float(total), waited

    def _optimizer_step(self) -> None:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.c.optim.clip_grad:
            torch.nn.utils.clip_grad_norm_(self._params(), self.c.optim.clip_grad)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()

    def _graph_step_begin(self) -> None:
        """Under CUDA graphs: the previous forward's outputs are consumed, so their memory may be reused."""
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if self.data.eval is None:
            return {}
        self.wrapped.eval()
        correct1 = correct5 = count = loss_sum = 0.0
        for batch in self.data.eval():
            if batch is None:  # padding: run a dummy forward so FSDP collectives stay in step
                if self.fsdp:
                    size = self.c.model.img_size
                    self.forward(torch.zeros(1, 3, size, size, device=self.env.device))
                continue
            images, labels = batch
            if self.c.train.precision == "bf16-pure" and not self.fsdp:
                images = images.to(torch.bfloat16)
            self._graph_step_begin()
            with self.precision.autocast():
                logits = self.forward(images).float()
            loss_sum += float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
            top5 = logits.topk(min(5, logits.shape[1]), dim=1).indices
            correct1 += float((top5[:, 0] == labels).sum())
            correct5 += float((top5 == labels[:, None]).any(dim=1).sum())
            count += len(labels)
        self.wrapped.train()
        correct1, correct5, count, loss_sum = all_reduce_sum([correct1, correct5, count, loss_sum], self.env.device)
        return {"eval_top1": 100 * correct1 / count, "eval_top5": 100 * correct5 / count,
                "eval_loss": loss_sum / count, "eval_samples": int(count)}

    # ---------------------------------------------------------------- the loop

    def stop_agreed(self, requested: bool) -> bool:
        """True on every rank when any rank was asked to stop (signals reach ranks at slightly different steps)."""
        return all_reduce_sum([float(requested)], self.env.device)[0] > 0

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """Train to the stop step; when `should_stop` says so (checked at log steps), checkpoint and return."""
        c, p, env = self.c, self.position, self.env
        if env.is_main:
            log.info("run %s: %d steps of %d images (%d per epoch), lr %.3g, ops %s, data %s", self.run_dir,
                     self.stop_step, self.global_batch, self.steps_per_epoch, self.base_lr, self.ops.describe(),
                     self.data.source)
        flops = 3 * self.model.flops_per_image()  # forward + backward
        self.wrapped.train()
        last_eval: dict[str, float] = {}
        window_start, window_steps, window_wait, loss = time.perf_counter(), 0, 0.0, float("nan")
        while p.step < self.stop_step:
            batches = iter(self.data.train(p.epoch, p.batch))
            while p.batch + c.optim.accum_steps <= self.steps_per_epoch * c.optim.accum_steps \
                    and p.step < self.stop_step:
                set_lr(self.optimizer, lr_at(p.step, self.total_steps, self.warmup, self.base_lr, self.min_lr))
                loss, waited = self.train_step(batches)
                p.step, p.batch = p.step + 1, p.batch + c.optim.accum_steps
                window_steps, window_wait = window_steps + 1, window_wait + waited
                if p.step % c.train.log_every == 0 or p.step == self.stop_step:
                    self._log(loss, flops, time.perf_counter() - window_start, window_steps, window_wait)
                    window_start, window_steps, window_wait = time.perf_counter(), 0, 0.0
                    if p.step < self.stop_step and self.stop_agreed(should_stop()):
                        self._end_epoch_if_done()
                        self.save()
                        self.metrics.write({"step": p.step, "event": "stopped"})
                        self.metrics.close()
                        return {"step": p.step, "loss": loss, "stopped": True}
                if p.step % self.eval_interval == 0 or p.step == self.stop_step:
                    last_eval = self.evaluate()
                    if last_eval:
                        self.metrics.write({"step": p.step, "epoch": p.epoch, **last_eval})
                if p.step % c.train.checkpoint_every == 0 or p.step == self.stop_step:
                    self.save()
            self._end_epoch_if_done()
        self.metrics.close()
        return {"step": p.step, "loss": loss, **last_eval}

    def _end_epoch_if_done(self) -> None:
        p, accum = self.position, self.c.optim.accum_steps
        if p.batch + accum > self.steps_per_epoch * accum:
            p.epoch, p.batch = p.epoch + 1, 0

    def _log(self, loss: float, flops: float, seconds: float, steps: int, waited: float) -> None:
        loss = all_reduce_sum([loss], self.env.device)[0] / self.env.world_size
        images_per_s = steps * self.global_batch / seconds
        record = {"step": self.position.step, "epoch": self.position.epoch, "loss": loss,
                  "lr": self.optimizer.param_groups[0]["lr"] / self.optimizer.param_groups[0].get("lr_scale", 1.0),
                  "images_per_s": images_per_s, "step_time_s": seconds / steps, "data_wait_s": waited / steps,
                  "total_steps": self.stop_step}
        if self.env.device.type == "cuda":
            record["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.env.device) / 2**30
            util = mfu(flops, images_per_s / self.env.world_size, self.env.device)
            if util is not None:
                record["mfu"] = util
        self.metrics.write(record)


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _mixup_and_loss(config: RunConfig):
    a = config.augment
    if a.mixup > 0 or a.cutmix > 0:
        from timm.data import Mixup
        from timm.loss import SoftTargetCrossEntropy

        if config.data.batch_size % 2:
            raise ConfigError("mixup/cutmix need an even data.batch_size (or set augment.mixup=0 augment.cutmix=0)")
        mixup = Mixup(mixup_alpha=a.mixup, cutmix_alpha=a.cutmix, label_smoothing=a.label_smoothing,
                      num_classes=config.model.num_classes)
        return mixup, SoftTargetCrossEntropy()
    return None, nn.CrossEntropyLoss(label_smoothing=a.label_smoothing)


def train(config: RunConfig | dict, resume: bool = False, use_cuda: bool | None = None,
          should_stop: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """Train on this process's rank (single process when no launcher environment is set).

    `should_stop` (e.g. set by a pre-emption signal) makes every rank checkpoint and return early.
    """
    if isinstance(config, dict):
        config = config_from_dict(config)
    env = init_distributed(torch.cuda.is_available() if use_cuda is None else use_cuda)
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING,
                        format=f"%(asctime)s [rank {env.rank}] %(name)s: %(message)s")
    try:
        return Trainer(config, env, resume).run(should_stop)
    finally:
        shutdown()
