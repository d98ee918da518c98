"""Training-step benchmark: our model and timm's same model, the same loop, synthetic data resident on the GPU."""

import gc
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .config import COMPILE_MODES, ConfigError, ModelConfig, TrainConfig
from .fp8 import convert_to_float8
from .metrics import mfu
from .models import MODELS, build_model
from .ops import resolve
from .precision import MasterWeights, Precision

TIMM_STRONGEST = "bf16 autocast + torch.compile + fused attention (TIMM_FUSED_ATTN=2)"


@dataclass
class BenchResult:
    name: str
    setting: str
    images_per_s: float
    ms_per_step: float  # median
    peak_gib: float
    mfu: float | None
    ops: str = ""  # the op implementations ours ran
    optimizer: str = "torch fused AdamW"


def timm_model(name: str, img_size: int, fused_attn: bool, drop_path: float = 0.0) -> nn.Module:
    import timm
    from timm.layers import set_fused_attn

    timm_name = MODELS[name].timm_name
    if timm_name is None:
        raise ValueError(f"{name} has no timm counterpart")
    set_fused_attn(fused_attn, experimental=fused_attn)  # experimental: Swin's masked SDPA path
    kwargs = {"img_size": img_size} if img_size != 224 else {}
    return timm.create_model(timm_name, pretrained=False, drop_path_rate=drop_path, **kwargs)


def training_step(model: nn.Module, precision: Precision, compile_: bool, fused_optimizer: Callable,
                  compile_mode: str = "default") -> Callable:
    """One training step (forward, loss, backward, optimizer) as the trainer runs it."""
    master = MasterWeights(model) if precision.pure else None  # casts the model to bf16
    weights = master.module if master else model
    optimizer = fused_optimizer([{"params": [p for p in weights.parameters() if p.requires_grad],
                                  "weight_decay": 0.05}], 1e-4, (0.9, 0.999), 1e-8)
    scaler = precision.scaler()
    forward = torch.compile(model, mode=compile_mode) if compile_ else model
    cuda_graphs = compile_ and compile_mode == "reduce-overhead"
    loss_fn = nn.CrossEntropyLoss()

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with precision.autocast():
            loss = loss_fn(forward(images.to(torch.bfloat16) if master else images).float(), labels)
        (scaler.scale(loss) if scaler else loss).backward()
        if master:
            master.step(optimizer)
        elif scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()  # set_to_none is the default; apex's FusedAdam takes no argument

    return step


def step_times(step: Callable, images: torch.Tensor, labels: torch.Tensor, warmup: int, steps: int) -> list[float]:
    """GPU ms of each of `steps` steps after `warmup`, run back to back as in training (no sync in between)."""
    for _ in range(warmup):
        step(images, labels)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        step(images, labels)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def measure(name: str, setting: str, model: nn.Module, precision: Precision, compile_: bool, batch: int,
            img_size: int, flops: float, steps: int, warmup: int, compile_mode: str = "default") -> BenchResult:
    device = precision.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    # Both sides get the same optimizer: torch's fused AdamW, which (ours, bf16-pure) also steps the master weights in
    # one kernel; timm's run has no master weights, so it runs torch's fused AdamW as it is.
    ops = resolve("optimizer", device)
    step = training_step(model.to(device).train(), precision, compile_, ops.optimizer, compile_mode)
    images = torch.randn(batch, 3, img_size, img_size, device=device)
    labels = torch.randint(0, 1000, (batch,), device=device)
    median_ms = statistics.median(step_times(step, images, labels, warmup, steps))
    rate = batch * 1000 / median_ms  # from the median step: one slow step (a stall, a recompile) does not skew it
    result = BenchResult(name, setting, rate, median_ms, torch.cuda.max_memory_allocated(device) / 2**30,
                         mfu(flops, rate, device))
    if precision.pure and dict(ops.chosen)["optimizer"] == "cuda":
        result.optimizer = "torch fused AdamW's arithmetic on float32 master weights, one vitctl kernel with the copies"
    return result


def _mode_note(mode: str) -> str:
    return "" if mode == "default" else f" ({mode})"


def _compiled(compile_: bool, mode: str) -> str:
    return f" + compile{_mode_note(mode)}" if compile_ else ""


def require_cuda(command: str, what: str) -> None:
    """ConfigError, for a benchmark on a machine whose torch sees no CUDA GPU."""
    if not torch.cuda.is_available():
        raise ConfigError(f"{command} {what} on a CUDA GPU, and torch {torch.__version__} sees none on this machine; "
                          f"run it on a GPU node: `srun --gpus 1` before this same command (`srun --gpus 1 "
                          f"{command} ...`, with the options given here)")


def cuda_or_exit(command: str) -> None:
    """For the scripts in bench/: exit 1 with require_cuda's message, not a traceback, where no GPU is seen."""
    try:
        require_cuda(command, "measures")
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


def bench_train(model_name: str, batch: int, precisions: list[str], compile_: bool, fused: str,
                compare: str | None, timm_setting: str, img_size: int = 224, steps: int = 30,
                warmup: int = 10, compile_mode: str = "default") -> list[BenchResult]:
    """Ours at each precision, then (with compare="timm") timm's same model; one process, one GPU.

    timm's strongest setting runs under every compile mode (the caller takes the faster as the baseline: on a host
    that launches kernels slowly, CUDA graphs are what make a compiled Swin step GPU-bound); "same" takes our flags."""
    if compare == "timm" and MODELS[model_name].timm_name is None:
        with_timm = ", ".join(name for name, spec in MODELS.items() if spec.timm_name)
        raise ConfigError(f"--compare timm: {model_name} has no timm counterpart; compare one of {with_timm}")
    require_cuda("vitctl bench train", "times a training step")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    results = []
    for precision in precisions:
        ops = resolve(fused, device, compiling=compile_)
        model = build_model(ModelConfig(name=model_name, img_size=img_size, drop_path=0.0), ops)
        if precision == "fp8":  # the default recipe; bench/bench_fp8.py times both
            defaults = TrainConfig()
            convert_to_float8(model, defaults.fp8_recipe, fsdp=False, min_width=defaults.fp8_min_width)
        flops = 3 * model.flops_per_image()
        setting = f"{precision}{_compiled(compile_, compile_mode)}, fused {fused}"
        result = measure(f"vitctl {model_name}", setting, model, Precision(precision, device), compile_, batch,
                         img_size, flops, steps, warmup, compile_mode)
        result.ops = ", ".join(f"{seam}={name}" for seam, name in ops.chosen if seam != "optimizer")
        results.append(result)
        del model
        gc.collect()
    if compare == "timm":
        strongest = timm_setting == "strongest"
        precision = "bf16" if strongest else precisions[0]
        for mode in COMPILE_MODES if strongest else (compile_mode,):
            use_compile = strongest or compile_
            model = timm_model(model_name, img_size, fused_attn=strongest)
            setting = (f"{TIMM_STRONGEST}{_mode_note(mode)}" if strongest
                       else f"{precision}{_compiled(use_compile, mode)}, timm defaults")
            results.append(measure(f"timm {MODELS[model_name].timm_name}", setting, model,
                                   Precision(precision, device), use_compile, batch, img_size, flops, steps, warmup,
                                   mode))
            del model
            gc.collect()
    return results
