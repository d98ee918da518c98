"""Turn CLI choices into a validated run config and a launch: Slurm or this machine, both through submitit."""

import hashlib
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

import torch

from vitctl.datasets.atomic import write_text_atomic
from vitctl.datasets.manifest import MANIFEST
from vitctl.trainer import checkpoint
from vitctl.trainer.config import (
    FINETUNE_PRESETS,
    LR_REFERENCE_BATCH,
    ConfigError,
    RunConfig,
    as_set_value,
    load_config,
    parse_override,
    unread_settings,
)
from vitctl.trainer.data.shards import train_digest
from vitctl.trainer.metrics import read_metrics
from vitctl.trainer.parallel.mesh import describe_groups, parallel_dims
from vitctl.trainer.parallel.strategy import Strategy
from vitctl.trainer.preflight import (
    Schedule,
    config_problems,
    finished_note,
    preflight,
    schedule,
    steps_warning,
    unread_by_plan,
    warmup_warning,
)
from vitctl.trainer.pretrained import missing_source

from . import registry
from .errors import LaunchError
from .job import TrainJob
from .registry import JobRecord
from .submit import (
    LaunchRequest,
    availability_warning,
    check_run_dir,
    check_time,
    command_line,
    container_image_problem,
    cpus_warning,
    default_executor,
    local_cpus_warning,
    refuse_busy_run_dir,
    refuse_entries_of_another_kind,
    resolve_container_image,
    run_rank,
    sbatch_script,
    submit,
    validate_slurm,
    wait_local,
    with_cpus_per_task,
)

__all__ = ["ConfigError", "JobRecord", "LaunchError", "LaunchRequest", "RunConfig", "build_config", "checkpoint",
           "default_executor", "launch", "read_metrics", "resolved_yaml", "resumed_finetune_source", "run_one_rank",
           "visible_gpus"]


def build_config(preset: str | None, flags: dict[str, Any], overrides: list[str], resume: bool = False,
                 flag_names: dict[str, str] | None = None) -> RunConfig:
    """Preset < flags (e.g. {"data": {"path": ...}}) < `--set` overrides, validated; paths checked up front (not
    finetune.from_ckpt where `resume` goes on from the run's own checkpoints, which never reads it again).
    `flag_names` name the flags in messages ({"data.path": "--data"})."""
    if clashes := _flag_clashes(flags, overrides, flag_names or {}):
        raise ConfigError("; ".join(clashes))
    config = load_config(preset, overrides, flags)
    if config.data.source != "synthetic" and config.data.path is None:
        raise ConfigError("data.path is required (or data.source=synthetic): pass --data SHARDS")
    if config.data.source != "synthetic" and not Path(config.data.path).is_dir():
        path = Path(config.data.path)
        if path.is_file() and path.suffix == ".tar" and (path.parent / MANIFEST).is_file():
            raise ConfigError(f"data.path {path} is one shard of the shard folder {path.parent}; pass that folder")
        what = "is not a folder" if path.exists() else "does not exist"
        raise ConfigError(f"data.path {path} {what}; prepare one with `vitctl data shard`")
    if config.data.source != "synthetic" and _image_root(Path(config.data.path)):
        root, shards = Path(config.data.path), shlex.quote(str(Path(config.data.path).parent / "shards"))
        raise ConfigError(f"data.path {root} holds images (train/, val/), not shards: shard it first, `vitctl data "
                          f"shard {shlex.quote(str(root))} --out {shards} && vitctl data index {shards}`, then pass "
                          f"--data {shards}")
    source = config.finetune.from_ckpt
    resuming = resume and bool(checkpoint.list_checkpoints(Path(config.train.out_dir)))
    if preset in FINETUNE_PRESETS and not source and not resuming:
        raise ConfigError(f"preset {preset} finetunes pretrained weights ({config.train.epochs:g} epochs at lr "
                          f"{config.optim.lr:g}), which from random weights would train a poor model: pass them, "
                          f"`vitctl finetune --config {preset} --from-ckpt WEIGHTS`; to train from scratch with its "
                          f"settings anyway, `vitctl config show {preset} > mine.yaml` and pass --config ./mine.yaml")
    if source and not resuming and not Path(source).exists():
        given = flags.get("finetune", {}).get("from_ckpt") == source  # not from --set or a config file
        raise ConfigError(missing_source(source, "--from-ckpt" if given else "finetune.from_ckpt"))
    return config


def _flag_clashes(flags: dict[str, Any], overrides: list[str], flag_names: dict[str, str]) -> list[str]:
    """Each key a flag sets that a `--set` sets otherwise: the later would win, and the flag be ignored unseen."""
    clashes = []
    for text in overrides:
        ((section, values),) = parse_override(text).items()
        for key, value in values.items() if isinstance(values, dict) else ():
            flag = flags.get(section, {}).get(key)
            if flag is not None and not _same(flag, value):
                by = flag_names.get(f"{section}.{key}", "its flag")
                clashes.append(f"{section}.{key} is set twice, to {_shown(flag)} by {by} and to {_shown(value)} by "
                               f"--set {text}; give it once")
    return clashes


def _shown(value: Any) -> str:
    """A value as a message shows it: text quoted (its spaces seen), the rest as `--set` writes it (null, true)."""
    return repr(value) if isinstance(value, str) else as_set_value(value)


def _same(flag: Any, value: Any) -> bool:
    """The flag's value and a `--set` value as YAML read it: 2 and 2.0 agree, and so do the paths ./s and s."""
    if isinstance(flag, str) and isinstance(value, str):
        return Path(flag).expanduser() == Path(value).expanduser()
    return flag == value and isinstance(flag, bool) == isinstance(value, bool)


def resolved_yaml(preset: str | None, overrides: list[str]) -> tuple[str, list[str], list[str]]:
    """The config `vitctl train --config PRESET --set ...` would run, every key included, as YAML; the problems
    `vitctl train` would refuse it for whatever the ranks, devices and data; and the keys it would not read."""
    config = load_config(preset, overrides)
    return config.to_yaml(), config_problems(config), unread_settings(config)


def visible_gpus() -> int:
    return torch.cuda.device_count()


def _checked_against_cluster(request: LaunchRequest, dry_run: bool, echo) -> int | None:
    """The request checked against the cluster's partitions; returns a node's CPUs. A dry run away from any cluster,
    or while its controller does not answer, prints the script unchecked."""
    try:
        partition, node_cpus = validate_slurm(request, images_checked=not dry_run)
    except LaunchError as e:
        if not dry_run:
            raise
        echo(f"warning: the request was not checked against the cluster: {e}")
        return None
    if dry_run and (problem := container_image_problem(request)):  # the script may be meant for another cluster
        echo(f"warning: {problem}; the script's ranks would fail on this cluster")
    if warning := availability_warning(request, partition):
        echo(f"warning: {warning}")
    return node_cpus


def launch(config: RunConfig, request: LaunchRequest, resume: bool, dry_run: bool, echo) -> JobRecord | str | None:
    """Validate, then submit (Slurm: returns at once) or run (local: waits, echoing rank 0's log).

    With `dry_run`, returns an sbatch script that runs the job and submits nothing; None where a resumed run has
    nothing left to train (echo said so), and nothing was started.
    """
    launch_problems = []  # reported with the config's, at once
    if request.executor == "local":
        try:
            check_local(request)
        except ConfigError as e:
            launch_problems.append(str(e))
        if not dry_run and (ignored := _slurm_only(request)):
            echo(f"warning: {ignored} only tell Slurm how to run the job: --executor local runs it here without "
                 "them (pass --executor slurm to submit it, or --dry-run for its sbatch script)")
        cpu_ranks = not request.gpus_per_node and not dry_run
        if cpu_ranks and (crowded := local_cpus_warning(request.tasks, len(os.sched_getaffinity(0)))):
            echo(f"warning: {crowded}")
    check_time(request)
    request = resolve_container_image(request)
    run_dir = Path(config.train.out_dir).resolve()  # one name per folder (not `..` or a link) for the registry
    if "%" in str(run_dir):  # submitit would write the logs elsewhere (%j) or refuse the folder (%a)
        raise ConfigError(f"run folder {run_dir} (--out) holds '%', which submitit reads in its log paths as a "
                          "placeholder (%j: the job id); choose an --out without '%'")
    config.train.out_dir = str(run_dir)  # tasks may start elsewhere
    if config.data.path:
        config.data.path = str(Path(config.data.path).absolute())
    if config.finetune.from_ckpt:
        config.finetune.from_ckpt = str(Path(config.finetune.from_ckpt).absolute())
    if config.parallel.plan:
        config.parallel.plan = str(Path(config.parallel.plan).absolute())
    name = f"{config.model.name}-{run_dir.name}"
    node_cpus = None
    if request.executor == "slurm" and (not dry_run or shutil.which("sbatch")):
        try:
            node_cpus = _checked_against_cluster(request, dry_run, echo)
        except (ConfigError, LaunchError) as e:  # the request against the partitions; Slurm not answering
            launch_problems.append(str(e))
    if request.executor == "slurm" or dry_run:  # a dry run prints an sbatch script, whatever the executor
        given = request.cpus_per_gpu is not None
        request = with_cpus_per_task(request, node_cpus, config.data.workers)
        if warning := cpus_warning(request, config.data.workers, node_cpus, given):
            echo(f"warning: {warning}")
    # A local job's device is this machine's; a Slurm job's is checked by its ranks when they start.
    local_device = torch.device("cuda" if request.gpus_per_node else "cpu") if request.executor == "local" else None
    # a run that goes on from its own checkpoints does not read finetune.from_ckpt again: it may be gone by now
    trained = bool(checkpoint.list_checkpoints(run_dir))
    resuming = resume and trained
    if trained and config.parallel.plan and not Path(config.parallel.plan).exists() and (kept := _kept_plan(run_dir)):
        raise ConfigError(f"parallel.plan {config.parallel.plan} does not exist; {run_dir} keeps a copy of the plan it "
                          f"trained under: pass --plan {shlex.quote(str(kept))}"
                          + ("" if resume else " with --resume, to go on from its checkpoints"))
    try:  # the device is not checked against a request that cannot have it
        strategy = preflight(config, request.nodes * request.tasks, None if launch_problems else local_device,
                             resuming, request.tasks)
    except ConfigError as e:
        raise ConfigError("; ".join([*launch_problems, str(e)])) from None
    if launch_problems:
        raise ConfigError("; ".join(launch_problems))
    plan = schedule(config, request.nodes * request.tasks, strategy)
    for warning in filter(None, [steps_warning(config, plan), warmup_warning(config), *unread_settings(config),
                                 *unread_by_plan(config, strategy)]):
        echo(f"warning: {warning}")
    existed = run_dir.exists()
    refuse_entries_of_another_kind(run_dir)
    if dry_run:
        found = checkpoint.checkpoints_to_resume(run_dir, resume=True)
        try:  # the script is still printed: it may be meant for later, once that job has ended
            refuse_busy_run_dir(run_dir, registry.load_records())
        except ConfigError as e:
            echo(f"warning: {e}; submitted now, the script's job would be refused by its rank 0")
    else:
        refuse_busy_run_dir(run_dir, registry.load_records())  # before its checkpoints are looked at
        found = check_run_dir(run_dir)
    check_resumable(found, config)  # first: where it refuses --resume, "pass --resume" is no fix
    if found and not resume:
        raise checkpoint.fresh_start_refused(run_dir, found[-1])
    if resume and not found and (run_dir / "submitit").is_dir():  # a job ran there, and stopped before a checkpoint
        echo(f"note: {run_dir} holds no checkpoint yet (its earlier job stopped before it saved one): the run starts "
             "at step 0")
    elif resume and not found:  # a mistyped --out would otherwise start a long run again from step 0, unsaid
        echo(f"warning: --resume, but {run_dir} {'holds no checkpoint' if existed else 'does not exist'}: the run "
             "starts at step 0; to continue a run, give its folder as --out")
    finished = bool(found) and _resume_notes(run_dir, found[-1], config, plan, echo, dry_run)
    # the job reads the plan checked here from its copy in the run folder, named by its content: the plan file may
    # be written again (`vitctl plan --out`) while the job waits, unchecked
    plan_copy = _plan_copy(Path(config.parallel.plan), run_dir) if config.parallel.plan else None
    if plan_copy:
        config.parallel.plan = str(plan_copy[0])
    if dry_run:  # the script writes the copy when its job starts
        return sbatch_script(config.to_dict(), request, name, layout_lines(strategy, request), plan_copy)
    if finished:  # a job would start and end at once, an empty row in `vitctl status`
        return None
    if plan_copy:
        _write_plan_copy(*plan_copy)
    # Submitted jobs always resume when their folder holds checkpoints: a requeued job must pick up its own.
    job = TrainJob(config.to_dict(), resume=True, use_cuda=request.gpus_per_node > 0)
    record, submitted, stop = submit(job, request, name, command_line())
    if request.executor == "local":
        wait_local(submitted, record, echo, stopped_already=stop is not None)
    return record


def _kept_plan(run_dir: Path) -> Path | None:
    """The run folder's copy of the plan its last checkpoint was saved under, else of the plan it trained under last."""
    copies = sorted(run_dir.glob("plan-*.json"), key=lambda copy: copy.stat().st_mtime)
    try:
        planned = checkpoint.read_meta(checkpoint.list_checkpoints(run_dir)[-1])["config"].get("parallel", {})["plan"]
    except (ConfigError, OSError, KeyError):  # a damaged checkpoint is named where the resume reads it
        planned = None
    return next((copy for copy in copies if str(copy) == planned), copies[-1] if copies else None)


def _plan_copy(plan: Path, run_dir: Path) -> tuple[Path, str]:
    """Where the run folder keeps the plan's copy (named by its content), and the plan's text."""
    try:
        text = plan.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise ConfigError(f"parallel.plan {plan} could not be read again ({e.strerror}); run the command again"
                          ) from None
    return run_dir / f"plan-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json", text


def _write_plan_copy(copy: Path, text: str) -> None:
    try:
        if not copy.exists():
            write_text_atomic(copy, text)
    except OSError as e:
        raise ConfigError(f"the plan could not be copied into run folder {copy.parent} ({e.strerror}); free space "
                          "there, or choose another --out") from None


def _resume_notes(run_dir: Path, last: Path, config: RunConfig, plan: Schedule | None, echo, dry_run: bool) -> bool:
    """What a resumed run should know of its last checkpoint `last`: nothing left to train (then True, and nothing
    is started), other settings, other train samples; a file of it missing, before any rank starts."""
    started = "a job of the script below would train nothing" if dry_run else "no job was started"
    checkpoint.check_files(last)
    meta = checkpoint.read_meta(last)
    step = meta["step"]
    if config.train.max_steps and step > config.train.max_steps:
        echo(f"warning: {run_dir} is at step {step} already, past train.max_steps={config.train.max_steps} (--steps): "
             f"there is nothing to train, and {started}; pass --steps above {step} to train on")
        return True
    saved_epochs = meta["config"].get("train", {}).get("epochs", config.train.epochs)
    if note := finished_note(config, plan, meta["position"], saved_epochs):
        echo(f"note: {run_dir} is at step {step} already: {note}; {started}")
        return True
    if config.train.epochs != saved_epochs:
        echo(f"note: --resume with train.epochs={config.train.epochs:g}, where {run_dir} began with {saved_epochs:g}: "
             f"its learning-rate schedule (warmup, cosine) is the one of {config.train.epochs:g} epochs from here on"
             f"; --epochs {saved_epochs:g} keeps it")
    # the batch a rank takes and its accumulation only matter through the global batch, which _other_batch names: a
    # fix for them alone would change it (--set data.batch_size=64 on twice the ranks doubles it)
    changed = [c for c in checkpoint.settings_change(meta["config"], config.to_dict())
               if not c.startswith(("data.batch_size=", "optim.accum_steps="))]
    if changed:
        echo(f"warning: --resume with other settings than {last} was saved with: {', '.join(changed)}; the run "
             "goes on with the new ones (--set the saved values to keep them)")
    for warning in filter(None, [_other_samples(run_dir, meta, config), _other_batch(last, meta, config, plan)]):
        echo(f"warning: {warning}")
    if (planned := meta["config"].get("parallel", {}).get("plan")) and not config.parallel.plan:
        echo(f"note: {last} was saved under the plan {planned}; this resume trains on the layout of the parallel.* "
             f"keys (the same numbers, maybe slower or in more memory); --plan {shlex.quote(planned)} keeps the plan")
    return False


def _other_batch(last: Path, meta: dict, config: RunConfig, plan: Schedule | None) -> str | None:
    """A resume at another global batch (other data-parallel ranks, batch or accumulation): the learning rate, which
    scales with it, and the steps of an epoch change with it."""
    saved = meta["config"]
    dp = meta["mesh"]["dp_replicate"] * meta["mesh"]["dp_shard"]
    before = saved["data"]["batch_size"] * dp * saved["optim"]["accum_steps"]
    if plan is None or (now := plan.global_batch * config.optim.accum_steps) == before:
        return None
    ranks = plan.global_batch // config.data.batch_size
    keep = before // (ranks * config.optim.accum_steps)
    fix = f"; --batch {keep} keeps the saved one" if keep * ranks * config.optim.accum_steps == before else ""
    return (f"--resume at a global batch of {now} samples a step, where {last} trained at {before}: the learning "
            f"rate scales with it (peak {saved['optim']['lr'] * before / LR_REFERENCE_BATCH:g} -> "
            f"{config.optim.lr * now / LR_REFERENCE_BATCH:g}), and so do the steps of an epoch{fix}")


def _other_samples(run_dir: Path, meta: dict, config: RunConfig) -> str | None:
    """A resume onto train shards of the same classes but other samples than the run saved (a folder sharded again,
    or another one): its place in the epoch then counts into another order of other images."""
    saved, path = meta.get("data"), config.data.path
    if not saved or config.data.source == "synthetic" or not path or train_digest(Path(path)) in (saved, None):
        return None
    return (f"--resume onto other train samples than {run_dir} was trained on: the shards of --data {path} differ "
            f"from those its checkpoint recorded (their names and sha256); the run goes on with them, from its place "
            f"in an epoch of the old ones. To go on with the data it began with, pass --data with it (a copy anywhere "
            f"will do); to train on this data from its weights, `vitctl finetune --from-ckpt "
            f"{shlex.quote(str(run_dir))} --out NEW --data {shlex.quote(str(path))}`")


def layout_lines(strategy: Strategy, request: LaunchRequest) -> list[str]:
    """How the job's ranks divide: its layout (as `vitctl status` shows it) and its device mesh's groups."""
    world = request.nodes * request.tasks
    if world == 1:
        return ["layout: 1 rank"]
    return [f"layout: {strategy.layout(world)} on {world} ranks",
            *describe_groups(parallel_dims(strategy, world), request.tasks)]


def _slurm_only(request: LaunchRequest) -> str:
    """The options given that only a Slurm job reads, as the command line has them."""
    given = {"--partition": request.partition, "--account": request.account, "--qos": request.qos,
             "--mem": request.mem, "--cpus-per-gpu": request.cpus_per_gpu}
    return ", ".join(f"{option} {value}" for option, value in given.items() if value is not None)


def _image_root(folder: Path) -> bool:
    """An extracted ImageNet root (train/ or val/ of class folders) with no manifest: what shard reads, not writes."""
    return not (folder / MANIFEST).exists() and any((folder / split).is_dir() for split in ("train", "val"))


def check_local(request: LaunchRequest) -> None:
    """ConfigError for what the local executor cannot run: more than one node, more GPUs than this machine has."""
    if request.nodes > 1:
        raise ConfigError(f"--nodes {request.nodes} with --executor local: the local executor runs every rank on this "
                          f"one machine; drop --nodes (or pass --nodes 1), or submit to Slurm with --executor slurm")
    have = visible_gpus()
    if request.gpus_per_node > have:
        fewer = f"--gpus {have} or fewer, or " if have else ""  # "CUDA devices": as torch counts them
        cpu = "--gpus 0" if request.gpus_per_node == 1 else f"--gpus 0 --tasks-per-node {request.gpus_per_node}"
        raise ConfigError(f"--gpus {request.gpus_per_node} but this machine has {have} CUDA devices; use {fewer}"
                          f"{cpu} for as many CPU ranks, or run on GPU nodes with --executor slurm")


def _other_data(last: Path, saved: dict, config: RunConfig) -> str | None:
    """A resume onto shards of another number of classes: said as such, where the model's num_classes and the data's
    checks would each send the user to the other's fix."""
    was, classes = saved.get("data", {}).get("path"), saved["model"].get("num_classes")
    now = config.data.path
    if not was or not now or Path(was).resolve() == Path(now).resolve() or classes == config.model.num_classes:
        return None
    run_dir = last.parent.parent
    return (f"{run_dir} was trained on {was} ({classes} classes), and --data {now} is another shard folder, for "
            f"model.num_classes={config.model.num_classes}: --resume goes on with the data a run began with; pass "
            f"--data {shlex.quote(str(was))}, or start a new run from its weights: `vitctl finetune --from-ckpt "
            f"{shlex.quote(str(run_dir))} --out NEW --data {shlex.quote(str(now))}` (with the other options of this "
            "command)")


def resumed_finetune_source(config: RunConfig) -> str | None:
    """The weights the finetune in train.out_dir started from, where --resume goes on from its checkpoints."""
    if found := checkpoint.list_checkpoints(Path(config.train.out_dir)):
        return checkpoint.read_meta(found[-1])["config"].get("finetune", {}).get("from_ckpt")
    return None


def _same_file(a: str, b: str) -> bool:
    """By the file system where both exist (a link and its target agree), else by name."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).absolute() == Path(b).absolute()


def check_resumable(checkpoints: list[Path], config: RunConfig) -> None:
    """ConfigError if --resume would continue a pretraining run as a finetune or the reverse (finetune.from_ckpt would
    be ignored without a word), or with other model settings than it saved (the ranks would refuse, on Slurm only
    after the queue wait)."""
    if not checkpoints:
        return
    saved = checkpoint.read_meta(checkpoints[-1])["config"]
    source = saved.get("finetune", {}).get("from_ckpt")
    wanted = config.finetune.from_ckpt
    run_dir = checkpoints[-1].parent.parent
    if source and wanted and not _same_file(source, wanted):
        raise ConfigError(f"{run_dir} holds the checkpoints of a finetune from {source}, not from {wanted} (a run "
                          f"goes on from its own checkpoints, not from --from-ckpt); continue it with --from-ckpt "
                          f"{shlex.quote(str(source))} --resume, or choose another --out to finetune from {wanted}")
    sets = checkpoint.saved_model_sets(saved["model"], config.to_dict()["model"])
    if wanted and not source:
        raise ConfigError(f"{run_dir} holds the checkpoints of a pretraining run (`vitctl train`), which a finetune "
                          f"from --from-ckpt {wanted} would write over: choose another --out to finetune, or continue "
                          f"that run with `vitctl train --resume{sets}`")
    if source and not wanted:
        raise ConfigError(f"{run_dir} holds the checkpoints of a finetune from {source}: continue it with `vitctl "
                          f"finetune --from-ckpt {shlex.quote(str(source))} --resume{sets}`, or choose another --out "
                          "to pretrain")
    if other_data := _other_data(checkpoints[-1], saved, config):
        raise ConfigError(other_data)
    if changed := checkpoint.model_change(checkpoints[-1], saved["model"], config.to_dict()["model"]):
        raise ConfigError(changed)


def run_one_rank(config: RunConfig, max_requeues: int) -> dict[str, Any]:
    """This process is one rank of a job srun or torchrun started; resumes from the run folder's checkpoints."""
    return run_rank(TrainJob(config.to_dict(), resume=True, use_cuda=visible_gpus() > 0), max_requeues)
