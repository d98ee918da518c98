"""Every check that can be made before a job starts, in one function. The CLI calls it before submitting, so a
Slurm user hears of a bad request at once rather than after the queue wait; each rank calls it again at start,
where the device is known."""

import contextlib
import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import torch

from vitctl.datasets import manifest
from vitctl.datasets.errors import DataError
from vitctl.datasets.index import index_path
from vitctl.datasets.manifest import MANIFEST
from vitctl.datasets.oserrors import file_in_the_way, what_it_is

from .checkpoint import check_files, checkpoint_dir, is_checkpoint, list_checkpoints, read_meta, resolve_checkpoint
from .config import ConfigError, RunConfig
from .data import dali_installed
from .data.images import gpu_decode_available
from .data.shards import SplitMissing, split_shards
from .fp8 import fp8_problems, has_float8
from .metrics import METRICS_FILE, SUPERSEDED_FILE
from .models import block_widths, build_model, model_error, model_shape
from .ops import parse_fused, resolve, unavailable_asked
from .parallel import parallel_dims
from .parallel.strategy import Strategy, strategy_from_config, strategy_problems
from .pretrained import exported_model, fit, shapes_only, source_kind
from .runlock import LOCK


def preflight(config: RunConfig, world_size: int, device: torch.device | None, resuming: bool = False,
              tasks_per_node: int | None = None) -> Strategy:
    """Raises one ConfigError listing every problem; returns the parallel strategy. `device` None: the ranks' device
    is not known here (a Slurm job's nodes), so its checks wait for the ranks. `resuming`: the weights come from the
    run's own checkpoint, not from finetune.from_ckpt. `tasks_per_node`, where the launch knows it: tensor-parallel
    groups must not span nodes."""
    problems, strategy = _config_checks(config, resuming, device)
    if strategy is not None and tasks_per_node and tasks_per_node % strategy.tp:
        # the mesh puts tp innermost: a group stays in a node when tp divides its ranks
        problems.append(f"parallel.tp={strategy.tp} would split tensor-parallel groups across nodes of "
                        f"{tasks_per_node} ranks (their all-reduces run every block); use a tp that divides "
                        f"{tasks_per_node}")
    dims = None
    if strategy is not None:
        found = strategy_problems(strategy, model_shape(config.model), world_size, config.data.batch_size,
                                  config.model.img_size)
        plan = config.parallel.plan  # the strategy's values are the plan file's, not parallel.* keys the user set
        problems += [f"parallel.plan {plan}: {p}" if plan else p for p in found]
        problems += _combination_problems(config, strategy)
        if not found:
            dims = parallel_dims(strategy, world_size)
            problems += filter(None, [_zero1_weights_error(config, dims.dp_size)])
    if device is not None:
        problems += _device_problems(config, device)
    problems += _data_problems(config, dims.dp_size if dims else _dp_size_guess(strategy, world_size))
    if problems:
        raise ConfigError("; ".join(problems))
    return strategy


def _dp_size_guess(strategy: Strategy | None, world_size: int) -> int | None:
    """The data-parallel ranks of a strategy that has problems, where its tp x pp still divides the ranks."""
    if strategy is None:
        return world_size
    model_ranks = strategy.tp * strategy.pp
    return world_size // model_ranks if world_size % model_ranks == 0 else None


def config_problems(config: RunConfig) -> list[str]:
    """The problems the config shows on its own, before ranks, devices and data are known (`vitctl config show`):
    the strategy's too, checked on the fewest ranks it runs on."""
    problems, strategy = _config_checks(config, resuming=False)
    if strategy is not None:
        fewest = strategy.world_size or strategy.tp * strategy.pp * (strategy.dp_shard if strategy.fsdp and
                                                                      strategy.dp_shard > 0 else 1)
        plan = config.parallel.plan
        problems += [f"parallel.plan {plan}: {p}" if plan else p
                     for p in strategy_problems(strategy, model_shape(config.model), fewest, config.data.batch_size,
                                                config.model.img_size)]
        problems += _combination_problems(config, strategy)
    return problems


def _config_checks(config: RunConfig, resuming: bool, device: torch.device | None = None
                   ) -> tuple[list[str], Strategy | None]:
    """The config's own problems, and its parallel strategy where the model and plan allow one. On a `device`
    without float8 the float8 layers' width is moot: the device's check says fp8 cannot run there at all."""
    model = model_error(config.model)
    source = None if resuming else _source_error(config, fits=model is None)
    width = None if model else _fp8_width_error(config)
    if width and device is not None and not has_float8(device):
        width = None
    problems = [p for p in (model, _fused_error(config.train.fused), _mixup_error(config), source, width,
                            _out_dir_error(config.train.out_dir), _out_in_data_error(config)) if p]
    strategy = None
    if model is None:
        try:
            strategy = strategy_from_config(config.parallel, model_shape(config.model).n_blocks, config.model.name)
        except ConfigError as e:
            problems.append(str(e))
    return problems, strategy


def _combination_problems(config: RunConfig, s: Strategy) -> list[str]:
    """What the strategy cannot be combined with."""
    problems = []
    if s.fsdp and config.train.compile_mode == "reduce-overhead":
        problems.append("train.compile_mode=reduce-overhead (CUDA graphs) does not run with FSDP, which gathers "
                        "each block's weights into new memory every step; use train.compile_mode=default")
    if s.pp > 1 and config.train.compile_mode == "reduce-overhead":
        problems.append("train.compile_mode=reduce-overhead (CUDA graphs) does not run with pipeline stages; use "
                        "train.compile_mode=default")
    if (s.tp > 1 or s.pp > 1) and config.parallel.grad_reduce == "overlap":
        problems.append("parallel.grad_reduce=overlap (DDP) does not run with tensor or pipeline parallel, whose "
                        "replicated gradients are reduced after the backward; use parallel.grad_reduce=auto")
    precision = config.train.precision
    if config.parallel.grad_reduce == "zero1" and (unsupported := _zero1_unsupported(config, s)):
        problems.append(f"parallel.grad_reduce=zero1 steps each data-parallel rank's share of a bf16 model's fp32 "
                        f"master weights, replicated over the ranks: it does not run with {' or '.join(unsupported)}; "
                        "use parallel.grad_reduce=auto")
    mixed = len({b.fsdp for b in s.blocks} | {s.fsdp_rest}) > 1
    if precision in ("bf16-pure", "fp8") and (mixed or s.tp > 1 and not s.fsdp):
        problems.append(f"train.precision={precision} needs every block sharded (FSDP2 keeps the fp32 weights) or, "
                        f"with parallel.tp=1, none; use train.precision=bf16 for this strategy")
    if precision == "fp16" and (s.tp > 1 or s.pp > 1):
        problems.append("train.precision=fp16 does not run with tensor or pipeline parallel: its loss scaler neither "
                        "scales the loss a pipeline schedule's backward starts from nor unscales split (DTensor) "
                        "gradients; use train.precision=bf16, which needs no loss scaling")
    if precision == "fp8" and s.tp > 1:
        problems.append("train.precision=fp8 does not run with tensor parallel yet (its split layers have no float8 "
                        "path); use parallel.tp=1 or train.precision=bf16-pure")
    return problems


def unread_by_plan(config: RunConfig, s: Strategy) -> list[str]:
    """The keys a plan file makes moot, where `unread_settings` cannot tell from the keys alone: any FSDP block
    reduces every gradient through FSDP, whatever parallel.grad_reduce says."""
    plan, reduce = config.parallel.plan, config.parallel.grad_reduce
    if plan and s.fsdp and reduce in ("after_backward", "overlap"):
        return [f"parallel.grad_reduce={reduce} applies to replicated weights only, and the plan {plan} shards "
                "weights with FSDP, which then reduces every gradient itself: it has no effect here"]
    return []


def _zero1_unsupported(config: RunConfig, s: Strategy) -> list[str]:
    """What of the run's settings ZeRO-1 does not run with, each as the user set it."""
    plan = f" (parallel.plan {config.parallel.plan})" if config.parallel.plan else ""
    found = [] if config.train.precision in ("bf16-pure", "fp8") else \
        [f"train.precision={config.train.precision} (only bf16-pure and fp8 keep fp32 master weights)"]
    found += [f"parallel.fsdp{plan}"] if s.fsdp or any(b.fsdp for b in s.blocks) else []
    found += [f"parallel.{name}={degree}{plan}" for name, degree in (("tp", s.tp), ("pp", s.pp)) if degree > 1]
    return found


def _zero1_weights_error(config: RunConfig, dp_size: int) -> str | None:
    """ZeRO-1 gives each data-parallel rank whole weights to step: more ranks than weights leave one none."""
    if config.parallel.grad_reduce != "zero1" or dp_size == 1:
        return None
    with torch.device("meta"):
        count = sum(p.requires_grad for p in build_model(config.model, resolve("none", torch.device("cpu")))
                    .parameters())
    if count >= dp_size:
        return None
    return (f"parallel.grad_reduce=zero1 gives each data-parallel rank whole weights to step: {config.model.name}'s "
            f"{count} weights cannot go round {dp_size} ranks; use parallel.grad_reduce=auto (and parallel.fsdp=true "
            "to shard them)")


def _fp8_width_error(config: RunConfig) -> str | None:
    """fp8 that would put no layer in float8: every block narrower than train.fp8_min_width."""
    if config.train.precision != "fp8":
        return None
    widest = max(block_widths(config.model))
    if widest >= config.train.fp8_min_width:
        return None
    return (f"train.precision=fp8 would put no layer of {config.model.name} in float8: its widest blocks are {widest} "
            f"wide, under train.fp8_min_width={config.train.fp8_min_width}; --set train.fp8_min_width={widest} puts "
            f"them in float8 (narrower than 768, float8 ran slower than bf16 on Swin-B: docs/performance.md), or use "
            f"--precision bf16-pure")


def _fused_error(spec: str) -> str | None:
    try:
        parse_fused(spec)
    except ValueError as e:
        return str(e)
    return None


def _source_error(config: RunConfig, fits: bool) -> str | None:
    """What can be known of finetune.from_ckpt without reading its weights: its format, whether it needs trust, and
    (`fits`: the model is valid) whether its names and shapes fit the model."""
    if not config.finetune.from_ckpt:
        return None
    source = Path(config.finetune.from_ckpt)
    try:
        if source.is_dir():  # what source_kind checks of a folder, its meta.json kept for the model's name
            weights = resolve_checkpoint(source)
            check_files(weights)  # a file missing or unreadable would fail the ranks, after the queue on Slurm
            if error := _architecture_error(config, source, read_meta(weights)):
                return error
            kind = "folder"
        else:
            weights, kind = source, source_kind(source, config.finetune.trust_checkpoint)
        if kind == "safetensors" and (model := exported_model(source)) and (
                error := _architecture_error(config, source, {"config": {"model": model}})):
            return error
        if fits and (shapes := shapes_only(weights, kind)) is not None:
            with torch.device("meta"):
                fit(shapes, source, build_model(config.model, resolve("none", torch.device("cpu"))),
                    config.finetune.reset_head, config.model.name)
    except ConfigError as e:
        return str(e)
    return None


def _architecture_error(config: RunConfig, source: Path, meta: dict) -> str | None:
    """A vitctl checkpoint or export of another model: its meta.json (or header) says which, so the fix can name it
    before launch (after launch, the ranks listed the keys that did not match)."""
    trained = meta.get("config", {}).get("model")
    if not isinstance(trained, dict) or trained.get("name") in (None, config.model.name):
        return None
    # the window of the model it is; none for a ViT, where this run's config (a Swin preset's) sets one
    window = f" --set model.window_size={trained['window_size']}" if trained.get("window_size") else \
        " --set model.window_size=null" if config.model.window_size else ""
    return f"finetune.from_ckpt {source} holds a {trained['name']}, and this run builds a {config.model.name}; " \
           f"finetune it as the model it is: --model {trained['name']}{window}"


def _out_dir_error(out_dir: str) -> str | None:
    """A file where the run folder (or one above it) would have to be, or a part of it this user cannot write: found
    before launch, not by a rank (the metrics) or after the whole run (its first checkpoint)."""
    blocker = file_in_the_way(Path(out_dir))
    if blocker is not None:
        return f"run folder {out_dir} (--out, train.out_dir) cannot be made: {what_it_is(blocker)}, not a folder; " \
               "choose another --out"
    run = Path(out_dir)
    if inside := next((p for p in [run.absolute(), *run.absolute().parents] if is_checkpoint(p)), None):
        return f"run folder {out_dir} (--out) lies in the checkpoint folder {inside}, which holds what its run " \
               f"wrote there alone (keep-last-K would delete it with that checkpoint); to go on with that run, pass " \
               f"its folder: --out {shlex.quote(str(inside.parent.parent))} --resume; else choose an --out outside it"
    if run.is_dir() and run.absolute() == checkpoint_dir(run.absolute().parent) \
            and any(is_checkpoint(p) for p in run.iterdir()):
        return f"run folder {out_dir} (--out) is the checkpoints folder of the run {run.absolute().parent}; to go " \
               f"on with that run, pass its folder: --out {shlex.quote(str(run.absolute().parent))} --resume; else " \
               "choose another --out"
    logs = [run / METRICS_FILE, run / SUPERSEDED_FILE]
    if in_the_way := _of_another_kind(folders=[checkpoint_dir(run)], files=[*logs, run / LOCK]):
        return f"run folder {out_dir}: {in_the_way}: move it away, or choose another --out"
    if _foreign_metrics(run):
        return f"run folder {out_dir} (--out) holds a {METRICS_FILE} that no vitctl run wrote there (no {LOCK} or " \
               f"checkpoint beside it), which a run would rewrite: move {run / METRICS_FILE} away, or choose " \
               "another --out"
    parts = [run, checkpoint_dir(run), *logs, run / LOCK]
    if not run.exists():  # the folder it would be made in (a dry run makes nothing)
        parts.append(next((p for p in run.absolute().parents if p.exists()), Path("/")))
    if locked := [p for p in parts if p.exists() and not os.access(p, os.W_OK | (os.X_OK if p.is_dir() else 0))]:
        return f"run folder {out_dir} (--out): this user cannot write {', '.join(map(str, locked))} (its " \
               "permissions, or read-only or immutable); give this user write access there, or choose another --out"
    return None


def _foreign_metrics(run: Path) -> bool:
    """A non-empty metrics log in a folder no vitctl job ran in (rank 0 leaves its lock file, a run of a vitctl
    before the lock its checkpoints): another tool's, or a copy, which the run's fresh start would cut to step 0."""
    metrics = run / METRICS_FILE
    if not metrics.is_file() or not metrics.stat().st_size or (run / LOCK).exists():
        return False
    return not list_checkpoints(run)


def _of_another_kind(folders: list[Path], files: list[Path]) -> str:
    """Which of the run folder's `folders` are files and `files` folders, where vitctl writes them (the run would
    fail at its first write there: a checkpoint, after training); '' where none."""
    return "; ".join([f"{p} is a file, where vitctl writes a folder" for p in folders if p.exists() and not p.is_dir()]
                     + [f"{p} is a folder, where vitctl writes a file" for p in files if p.is_dir()])


def _out_in_data_error(config: RunConfig) -> str | None:
    """A run folder in a shard folder (--data's, or another's): its checkpoints and logs would mix with the shards,
    and a later `vitctl data shard` into that folder refuses the files it did not write."""
    out = Path(config.train.out_dir).resolve()
    data = None if config.data.source == "synthetic" or config.data.path is None else Path(config.data.path).resolve()
    shards = next((f for f in (out, *out.parents) if f == data or _is_shard_folder(f)), None)
    if shards is None:
        return None
    which = f"the shard folder {config.data.path} (--data)" if shards == data else \
        f"the shard folder {shards} (it holds the {MANIFEST} of `vitctl data shard`)"
    return f"run folder {config.train.out_dir} (--out) is {'' if out == shards else 'inside '}{which}; choose a " \
           "run folder outside it"


def _is_shard_folder(folder: Path) -> bool:
    """Whether `folder` holds a manifest.json `vitctl data shard` wrote (another tool's file of that name is not)."""
    try:
        return manifest.load(folder) is not None
    except (DataError, OSError):
        return False


def _mixup_error(config: RunConfig) -> str | None:
    mixing = config.augment.mixup > 0 or config.augment.cutmix > 0
    if mixing and config.data.batch_size % 2:
        return (f"mixup/cutmix pair the samples of a batch and need an even data.batch_size, not "
                f"{config.data.batch_size} (or set augment.mixup=0 augment.cutmix=0)")
    return None


def _device_problems(config: RunConfig, device: torch.device) -> list[str]:
    problems = [] if _fused_error(config.train.fused) else unavailable_asked(config.train.fused, device)
    precision = config.train.precision
    if device.type == "cuda" and precision in ("bf16", "bf16-pure") and not torch.cuda.is_bf16_supported():
        problems.append(f"train.precision={precision} needs a GPU with bfloat16 (Ampere or newer), not "
                        f"{torch.cuda.get_device_name(device)}; use --precision fp16")
    if precision == "fp8":
        problems += fp8_problems(config, device)
    if device.type != "cuda" and config.train.compile_mode == "reduce-overhead":
        problems.append("train.compile_mode=reduce-overhead replays CUDA graphs and needs a GPU; use "
                        "train.compile_mode=default")
    if config.data.source == "dali" and not dali_installed():
        problems.append("data.source=dali but nvidia-dali is not installed (pip install 'vitctl[dali]')")
    # evaluation reads through the index loader whatever the train source
    if device.type == "cuda" and config.data.source != "synthetic" and config.data.decode == "nvjpeg" \
            and not gpu_decode_available():
        problems.append("data.decode=nvjpeg decodes with torchvision's CUDA decode_jpeg, which this torchvision lacks; "
                        "set data.decode=pil-crop (PIL decodes in the loader workers)")
    return problems


def _check_val_split(folder: Path) -> None:
    """ConfigError for a val split begun and not finished, or changed; a dataset without one trains unevaluated."""
    with contextlib.suppress(SplitMissing):
        split_shards(folder, "val")


@dataclass
class Schedule:
    """How long a run trains: its samples, global batch, optimizer steps an epoch and the step train.epochs ends at."""

    samples: int
    global_batch: int
    epoch_steps: float
    epochs_end: int


def schedule(config: RunConfig, world_size: int, strategy: Strategy) -> Schedule | None:
    """The run's schedule, as the trainer counts it; None where there is no data to count (no data.path)."""
    if config.data.source != "synthetic" and config.data.path is None:
        return None
    samples = _train_samples(config)[0]
    global_batch = config.data.batch_size * parallel_dims(strategy, world_size).dp_size
    batches, accum = samples // global_batch, config.optim.accum_steps
    return Schedule(samples, global_batch, batches / accum, stop_step(0, 0.0, config.train.epochs, batches, accum))


def epochs_trained(epoch: int, sample: int, batches_per_epoch: int, global_batch: int) -> float:
    """Epochs done at a position (`sample`: the samples of epoch `epoch` consumed), in epochs of this global batch."""
    return epoch + sample / (batches_per_epoch * global_batch)


def stop_step(step: int, epochs_done: float, epochs: float, batches_per_epoch: int, accum_steps: int) -> int:
    """The step a run at `step`, `epochs_done` epochs in, ends at once it has trained `epochs`: the steps left are
    counted at the current global batch, which a resumed run may have changed."""
    left = math.ceil(max(0.0, epochs - epochs_done) * batches_per_epoch - 1e-9)
    return step + math.ceil(left / accum_steps)


def steps_warning(config: RunConfig, plan: Schedule | None) -> str | None:
    """A train.max_steps past the end of train.epochs, which the run stops at instead (--steps only stops early)."""
    steps = config.train.max_steps
    if not steps or plan is None or steps <= plan.epochs_end:
        return None
    batches = plan.samples // plan.global_batch
    epochs = -(-steps * config.optim.accum_steps // batches)  # in integers: a float rounds a big --steps' epochs
    return (f"train.max_steps={steps} (--steps) is past the end of train.epochs={config.train.epochs:g}: "
            f"{plan.samples} train samples make {plan.epoch_steps:g} steps an epoch at a global batch of "
            f"{plan.global_batch}, so the run stops at step {plan.epochs_end}; add --epochs "
            f"{epochs} to train {steps} steps")


def warmup_warning(config: RunConfig) -> str | None:
    """A warmup longer than the run: the learning rate never reaches optim.lr."""
    warmup, epochs = config.optim.warmup_epochs, config.train.epochs
    if warmup <= epochs:
        return None
    return (f"optim.warmup_epochs={warmup:g} is longer than train.epochs={epochs:g}: the learning rate warms up for "
            f"the whole run and ends at about {100 * epochs / warmup:.0f}% of optim.lr; set optim.warmup_epochs below "
            f"{epochs:g} (e.g. --set optim.warmup_epochs={epochs / 20:g}, a twentieth of the run)")


def finished_note(config: RunConfig, plan: Schedule | None, position: dict[str, int],
                  saved_epochs: float) -> str | None:
    """A resumed run whose checkpoint (at `position`: step, epoch, sample; of a run begun with `saved_epochs`) has
    trained as far as this run goes: there is nothing to train. Counted in epochs, as the trainer counts them: a
    resume on other ranks steps otherwise."""
    step, steps = position["step"], config.train.max_steps
    if plan is None or (steps and step > steps):  # a step past train.max_steps gets a warning of its own
        return None
    batches = plan.samples // plan.global_batch
    done = epochs_trained(position["epoch"], position["sample"], batches, plan.global_batch)
    end = stop_step(step, done, config.train.epochs, batches, config.optim.accum_steps)
    end = min(end, steps) if steps else end
    if step < end:
        return None
    if end == steps:
        return f"the run ends there (train.max_steps={steps}, --steps): nothing to train; pass --steps above {step} " \
               "to train on"
    trained = f"it has trained {done:g} epoch{'' if done == 1 else 's'}, and train.epochs={config.train.epochs:g}: " \
              "nothing to train"
    if saved_epochs > done + 1e-9:  # a resume without the run's --epochs, which the preset's cut short
        return f"{trained}; the run began with train.epochs={saved_epochs:g}: pass --epochs {saved_epochs:g} to " \
               "finish it on its learning-rate schedule"
    return f"{trained}; pass --epochs {math.floor(done + 1e-9) + 1} to train on"


def _train_samples(config: RunConfig) -> tuple[int, int | None]:
    """The train split's sample and class counts (None: synthetic data has no class list); ConfigError for a dataset
    that cannot be read."""
    c = config.data
    if c.source == "synthetic":
        return c.train_samples, None
    folder = Path(c.path)
    shards, class_list = split_shards(folder, "train")
    _check_val_split(folder)
    missing = [e["name"] for e in shards if not index_path(folder / e["name"]).exists()]
    if missing:
        raise ConfigError(f"data.path {folder}: {len(missing)} train shards have no index file (first: {missing[0]}); "
                          f"run `vitctl data index {shlex.quote(str(folder))}`")
    return sum(e["samples"] for e in shards), len(class_list)


def _data_problems(config: RunConfig, dp_size: int | None) -> list[str]:
    """The data's problems; those of a step's samples only where the data-parallel ranks are known (`dp_size`)."""
    c = config.data
    if c.source != "synthetic" and c.path is None:  # here, not when loading: `config show` prints a preset without data
        return ["data.path is required (or data.source=synthetic)"]
    try:
        samples, classes = _train_samples(config)
    except ConfigError as e:
        return [str(e)]
    problems = []
    if classes is not None and config.model.num_classes != classes:
        problems.append(f"model.num_classes is {config.model.num_classes} but the shards hold {classes} classes; "
                        f"pass --set model.num_classes={classes}")
    accum = config.optim.accum_steps
    if dp_size is None:
        return problems
    global_batch = c.batch_size * dp_size
    if samples < global_batch:
        problems.append(f"data.batch_size {c.batch_size} x {dp_size} data-parallel ranks = {global_batch} samples "
                        f"a step, more than the {samples} train samples; lower data.batch_size or use fewer ranks")
    elif samples < global_batch * accum:  # one optimizer step would span epochs, and --steps would count past them
        problems.append(f"data.batch_size {c.batch_size} x {dp_size} data-parallel ranks x optim.accum_steps {accum} "
                        f"= {global_batch * accum} samples an optimizer step, more than the {samples} train samples "
                        f"of an epoch; use --set optim.accum_steps={samples // global_batch} or lower")
    return problems
