"""Typed run configuration: YAML presets, `--set a.b=value` overrides, validation up front."""

import dataclasses
import datetime
import difflib
import functools
import json
import math
import os
import re
import shlex
import types
import typing
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .recipe import CROP_MODES, ERASE_MODES, INTERPOLATIONS, RAND_GRAMMAR, parse_rand_augment

PRESETS = Path(__file__).parent / "presets"
FINETUNE_PRESETS = ("swin_l_22k_to_1k_224", "swin_l_22k_to_1k_384")  # recipes that start from pretrained weights
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure", "fp8")
# torchao's float8 scaling (one scale per tensor, or per row), or our own row-scaled matmuls (ops/float8_rows.py)
FP8_RECIPES = ("tensorwise", "rowwise", "fused_rowwise")
GRAD_REDUCE = ("auto", "after_backward", "overlap", "zero1")
COMPILE_MODES = ("default", "reduce-overhead")  # torch.compile modes; reduce-overhead replays CUDA graphs
CHECKPOINT = ("none", "selective", "full")  # activation checkpointing per block
INTERLEAVED = "interleaved_1f1b"  # the pipeline schedule that runs several stages per pipeline rank
SCHEDULES = ("gpipe", "1f1b", INTERLEAVED)


class ConfigError(ValueError):
    """A configuration value that cannot work, named by its dotted key."""


@dataclass
class ModelConfig:
    name: str = "vit_b16"
    num_classes: int = 1000
    img_size: int = 224
    window_size: int | None = None  # Swin only; None = the variant's default
    drop_path: float = 0.1
    pre_logits: bool = False  # ViT pretraining's MLP head (Linear + Tanh before the classifier)


@dataclass
class DataConfig:
    source: str = "auto"  # auto | dali | webdataset | synthetic
    path: str | None = None  # shard folder written by `vitctl data shard`
    batch_size: int = 128  # per rank
    workers: int = 4  # loader processes per rank
    # The index loader's stages on a GPU (on the CPU it is always pil). pil: the workers decode, crop and apply the
    # recipe with timm's transforms (the reference). pil-crop: the workers decode and crop; the recipe runs in torch
    # on the GPU. nvjpeg: the workers read and draw; the GPU decodes (torchvision's decode_jpeg), crops and augments.
    # nvjpeg is the default: it trained faster than pil-crop in every call on one H200 and evaluated 2-2.6x as fast
    # (docs/performance.md), and it needs few of the host's cores.
    decode: str = "nvjpeg"
    train_samples: int = 1_281_167  # synthetic data only: the epoch length it pretends to have
    # Normalisation of train and eval images, as fractions of 255; None: the model family's (recipe.MODEL_EVAL).
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None


@dataclass
class AugmentConfig:
    mixup: float = 0.8
    cutmix: float = 1.0
    mixup_switch_prob: float = 0.5  # with both on: the chance a batch gets cutmix rather than mixup
    label_smoothing: float = 0.1
    min_crop_scale: float = 0.08
    hflip: bool = True  # off for data where mirroring changes the class (digits, text)
    interpolation: str = "bicubic"  # the random-resized crop's (and RandAugment's geometric ops')
    rand_augment: str | None = None  # timm's RandAugment string, e.g. rand-m9-mstd0.5-inc1
    color_jitter: float = 0.0  # brightness, contrast and saturation factors in [1 - x, 1 + x]
    reprob: float = 0.0  # random erasing: the chance an image gets erased boxes
    remode: str = "pixel"  # const | rand | pixel: what fills an erased box
    recount: int = 1  # erased boxes per erased image: 1 up to this many
    repeated_aug: int = 1  # each drawn sample appears this many times in an epoch, on different ranks (DeiT)


@dataclass
class EvalConfig:
    """How val images are cropped; None: the model family's default (recipe.MODEL_EVAL)."""

    crop_pct: float | None = None  # timm's: resize to size / crop_pct, keep the centre size x size
    crop_mode: str | None = None  # center (the shorter side resized) | squash (both sides: the aspect is lost)
    interpolation: str | None = None


LR_REFERENCE_BATCH = 512  # optim.lr is for this global batch and scales linearly (DeiT, Swin)


@dataclass
class OptimConfig:
    lr: float = 1e-3  # for a global batch of LR_REFERENCE_BATCH; scaled linearly with the real one
    min_lr: float = 1e-5
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_epochs: float = 5.0
    warmup_lr: float = 0.0  # where the warmup starts, for a global batch of 512 as lr
    clip_grad: float | None = 5.0
    accum_steps: int = 1
    layer_decay: float | None = None  # layer-wise LR decay, finetuning


@dataclass
class TrainConfig:
    epochs: float = 300.0
    max_steps: int | None = None  # stop early (demos, benchmarks)
    precision: str = "bf16"
    # with precision=fp8: fused_rowwise | rowwise | tensorwise. fused_rowwise by measurement (docs/performance.md):
    # the fastest of the three on ViT-B/16 and Swin-B, its 1,000-step loss within 1.5% of bf16-pure's on ViT-B/16
    # and Swin-T; torchao's tensorwise ended 5.3% behind. tensorwise alone gathers float8 weights under FSDP2.
    fp8_recipe: str = "fused_rowwise"
    # Linears narrower than this (the smaller of in and out features) stay bf16. By measurement (docs/performance.md):
    # float8 paid at ViT-B's 768 and ViT-L's 1024; on Swin-B its 512-wide stage ran slower than in bf16 (the casts
    # cost more than float8 saves). 0 puts every block in float8, for the memory.
    fp8_min_width: int = 768
    fused: str = "all"  # all | none | comma-separated seams
    compile: bool = False
    compile_mode: str = "default"  # reduce-overhead: CUDA graphs, for steps whose kernel launches outrun the GPU
    ema_decay: float | None = None
    seed: int = 0
    log_every: int = 20
    eval_every_epochs: float = 1.0
    checkpoint_every: int = 1000  # steps
    keep_checkpoints: int = 3
    async_checkpoint: bool = False  # write checkpoints in the background while training goes on
    out_dir: str = "runs/default"


@dataclass
class ParallelConfig:
    fsdp: bool = False  # shard parameters, gradients and optimizer state (FSDP2) instead of replicating them (DDP)
    dp_shard: int = -1  # with fsdp: ranks each parameter is sharded over (-1: all); the others replicate it (HSDP)
    # Replicated weights: "after_backward" reduces all gradients at once, "overlap" reduces DDP's buckets during the
    # backward (across nodes, where the transfer is slow); "zero1" (bf16-pure, fp8): each rank receives the bf16
    # gradients of its share of the weights, steps that share and all-gathers the bf16 weights. "auto" picks by the
    # ranks' nodes: within one, zero1 under bf16-pure (without tp or pp), else after_backward; across nodes, overlap.
    grad_reduce: str = "auto"
    tp: int = 1  # tensor-parallel degree: each block's heads and MLP split over this many ranks of a node
    pp: int = 1  # pipeline ranks, each running virtual_stages stages (one, but under interleaved_1f1b)
    microbatches: int = 1  # per step, each data.batch_size / microbatches samples: through the pipeline, or
    # without one, run in turn with their gradients accumulated (less activation memory, the same batch)
    schedule: str = "1f1b"  # pipeline schedule: gpipe | 1f1b | interleaved_1f1b
    virtual_stages: int = 1  # with interleaved_1f1b: stages per pipeline rank (rank r runs stages r, r + pp, ...)
    stages: list[int] = field(default_factory=list)  # blocks per stage, pp x virtual_stages; empty: even
    checkpoint: str = "none"  # activation checkpointing per block: none | selective | full
    plan: str | None = None  # a JSON plan from `vitctl plan`: the strategy per block (replaces the keys above)


@dataclass
class FinetuneConfig:
    from_ckpt: str | None = None
    reset_head: bool | None = None  # None: reset when the class count differs
    trust_checkpoint: bool = False  # unpickle from_ckpt in full when it holds more than tensors (that can run code)


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """Every section and key, defaults included, as a preset file that loads back to this config."""
        lists = {section: {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
                 for section, values in self.to_dict().items()}  # safe_dump refuses tuples (optim.betas)
        return yaml.safe_dump(lists, sort_keys=False)


_SECTIONS = tuple(f.name for f in dataclasses.fields(RunConfig))
_ALL_KEYS = {f"{section.name}.{key.name}" for section in dataclasses.fields(RunConfig)
             for key in dataclasses.fields(section.type)}
_DOTTED_KEY = re.compile(r"\b[a-z_]+\.[a-z0-9_]+\b")


def _coerce(value: Any, kind: Any, key: str) -> Any:
    origin = typing.get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        kind = next(t for t in options if t is not type(None))
        origin = typing.get_origin(kind)
    if origin is tuple:
        items = typing.get_args(kind)
        if not isinstance(value, list | tuple) or len(value) != len(items):
            raise ConfigError(f"{key}: expected a list of {len(items)} values, got {value!r}")
        return tuple(_coerce(v, t, key) for v, t in zip(value, items, strict=True))
    if origin is list:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, typing.get_args(kind)[0], key) for v in value]
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    # YAML 1.1 reads 5e-3 and nan as strings; a finite number in quotes is refused below, as it is for ints
    if kind is float and isinstance(value, str) and (number := _as_number(value)) is not None \
            and (_YAML11_EXPONENT.fullmatch(value) or not math.isfinite(number)):
        return number
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is int and isinstance(value, str) and _YAML11_EXPONENT.fullmatch(value) and float(value).is_integer():
        return int(float(value))  # 1e3, which YAML 1.1 reads as a string
    if isinstance(value, dict):
        named = f"; there is no {key}.{next(iter(value))}" if value else ""
        raise ConfigError(f"{key} is a value, not a section of keys{named}: set it as {key}=VALUE")
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        got = "no value" if value is None else repr(value)
        if kind is int and isinstance(value, str) and _YAML11_EXPONENT.fullmatch(value):
            got += ", not a whole number"
        elif kind in (int, float) and isinstance(value, str) and (number := _as_number(value)) is not None \
                and math.isfinite(number):  # Python reads other scripts' digits (full-width ５), YAML does not
            got += (f"; a number in quotes is a string: write {value} without them" if value.isascii() else
                    f"; write it in ASCII digits: {''.join(str(unicodedata.decimal(c, c)) for c in value)}")
        if kind is str and isinstance(value, int | float | datetime.date):  # 2024-01-01, 001, yes, 12:30 in YAML
            got += f"; YAML reads the value as a {type(value).__name__}: put it in quotes"
        raise ConfigError(f"{key}: expected {kind.__name__}, got {got}")
    return value


_YAML11_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


# Keys that moved, with what replaces them: a preset or --set written for an older vitctl gets told.
MOVED = {"train.parallel": "parallel.fsdp (train.parallel=fsdp is now parallel.fsdp=true)",
         "train.activation_checkpointing": "parallel.checkpoint (true is now parallel.checkpoint=full)"}


def _build(cls: type, values: dict[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    unknown = sorted(f"{prefix}{k}" for k in set(values) - set(hints))
    moved = [f"{key} is now {MOVED[key]}" for key in unknown if key in MOVED]
    if moved:
        raise ConfigError("; ".join(moved))
    if unknown:
        raise ConfigError(f"unknown keys {unknown}; known: {sorted(hints)}{_did_you_mean(unknown, sorted(hints))}")
    kwargs = {}
    for name, value in values.items():
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigError(f"{prefix}{name} is a section of keys, not a value (got {value!r}); set one of its "
                                  f"keys: {prefix}{name}.KEY=VALUE, KEY one of {', '.join(sorted(_fields(kind)))}")
            kwargs[name] = _build(kind, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, kind, f"{prefix}{name}")
    return cls(**kwargs)


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _did_you_mean(unknown: list[str], known: list[str]) -> str:
    """The keys meant, where an unknown one is a known key of another section (`lr` for optim.lr) or a typo."""
    sections = {f.name: _fields(f.type) for f in dataclasses.fields(RunConfig)}
    meant = []
    for dotted in unknown:
        name = dotted.rsplit(".", 1)[-1]
        elsewhere = [f"{section}.{name}" for section, keys in sections.items() if name in keys]
        if elsewhere:
            meant += elsewhere
        elif close := difflib.get_close_matches(name, known, n=1):
            meant.append(dotted.removesuffix(name) + close[0])
    return f"; did you mean {' or '.join(meant)}?" if meant else ""


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return merged


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load, but a key given twice in one mapping is an error: YAML keeps the second silently, and a section
    written twice (two `model:` blocks) would lose the first one's keys."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # what `<<:` merges in, the mapping may override
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # SafeLoader refuses it itself
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping (first on line {seen[key]}), and the "
                    f"second would replace the first: keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


# YAML 1.1 reads 010 as 8 (octal) and 1:30 as 90 (base 60), which no one writing a batch size or a seed means: whole
# numbers are read as YAML 1.2 reads them, decimal (0x for hex); 1:30 stays text, which a number key refuses.
_INT = "tag:yaml.org,2002:int"
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != _INT]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_UniqueKeyLoader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9][0-9_]*|0x[0-9a-fA-F_]+)$"),
                                       list("-+0123456789"))
_UniqueKeyLoader.add_constructor(_INT, lambda loader, node: int(loader.construct_scalar(node).replace("_", ""),
                                                                  16 if "x" in node.value else 10))


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)


def as_set_value(value: Any) -> str:
    """`value` as `--set key=VALUE` reads it back: null, true, [0.9, 0.999], not Python's None, True, (0.9, 0.999)."""
    return value if isinstance(value, str) else json.dumps(value)


def parse_override(text: str) -> dict[str, Any]:
    """`optim.lr=1e-3` -> {"optim": {"lr": 0.001}}; the value is read as YAML, but kept as written for a text key."""
    key, sep, raw = text.partition("=")
    parts, raw = [part.strip() for part in key.split(".")], raw.strip()  # quotes keep a value's own spaces
    if not sep or not all(parts):
        raise ConfigError(f"override {text!r} is not of the form section.key=value (e.g. optim.lr=1e-3)")
    if not raw:  # else a key that may be null were cleared by an unset variable in `--set KEY=$VAR`, unsaid
        if (kind := _hint(parts)) is None:  # a typo is the first thing to fix: its value would be refused anyway
            _build(RunConfig, functools.reduce(lambda value, part: {part: value}, reversed(parts), None), "")
        raise ConfigError(f"override {text!r} has no value (an unset shell variable?); give one"
                          f"{_empty_value(parts, kind)}")
    try:
        value: Any = raw if _is_text(parts) and _plain_text(raw) else _load_yaml(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: its value is not valid YAML ({_yaml_problem(e)}); close its "
                          f"brackets, or quote a value that holds YAML syntax: {key}='...'") from None
    for part in reversed(parts):
        value = {part: value}
    return value


def _empty_value(parts: list[str], kind: Any) -> str:
    """How to write the empty value of the key `parts` names, where it has one: null, or an empty list."""
    key = ".".join(parts)
    if type(None) in typing.get_args(kind):
        return f", or {key}=null for none"
    return f", or {key}=[] for an empty list" if typing.get_origin(kind) is list else ""


def _hint(parts: list[str]) -> Any:
    """The type of the key `parts` names (e.g. str | None), or None where no key has that name."""
    kind: Any = RunConfig
    for part in parts:
        if not dataclasses.is_dataclass(kind) or part not in (hints := typing.get_type_hints(kind)):
            return None
        kind = hints[part]
    return kind


def _is_text(parts: list[str]) -> bool:
    """Whether the key `parts` names holds text (str, or str or None)."""
    return _hint(parts) in (str, str | None)


def _plain_text(raw: str) -> bool:
    """Whether a text key's value is taken as written: YAML would read 2024-01-01 as a date, 001 as 1, yes as true
    and cut `runs/a #1` at its comment; null and a quoted value still go through YAML."""
    return raw.strip() not in ("", "null", "Null", "NULL", "~") and raw[:1] not in ("'", '"')


def _names_a_file(name: str) -> bool:
    """Whether --config NAME is a file's path: presets are named without a suffix, and Path drops the "./" of
    ./my_config."""
    return bool(Path(name).suffix) or "/" in name


def preset_path(name: str) -> Path:
    """A YAML file when `name` looks like one (a suffix, e.g. .yaml, or a slash in it), else a shipped preset."""
    if not name.strip():  # an unset shell variable: training the defaults (vit_b16) instead would go unseen
        raise ConfigError("--config is empty; pass a preset name or a YAML file")
    path = Path(name).expanduser()  # --config=~/x.yaml: the shell expands no ~ after "="
    if _names_a_file(name):
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist; check the path, or pass a preset name")
        if path.is_dir():
            raise ConfigError(f"config file {path} is a folder; pass a YAML file in it, or a preset name")
        if path.suffix.lower() == ".toml":
            raise ConfigError(f"config file {path} is TOML, and vitctl reads YAML: write its tables as YAML sections "
                              f"(`[optim]` and `lr = 1e-3` become `optim:` and an indented `lr: 1e-3`), as `vitctl "
                              f"config show demo_vit` prints, in a .yaml file")
        return path
    path = PRESETS / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in PRESETS.glob("*.yaml"))
        here = f"; {name} here is a file: pass {shlex.quote('./' + name)} to read it as YAML" if Path(name).is_file() \
            else ""
        raise ConfigError(f"no preset {name!r}; presets: {', '.join(known)} (or pass a .yaml path){here}")
    return path


def shadowed_file(name: str | None) -> str | None:
    """Where --config NAME takes the shipped preset while a file of that name lies in the current folder: a warning
    (a preset's output saved as `vitctl config show demo_vit > demo_vit`, then edited, was not read)."""
    if not name or _names_a_file(name) or not (PRESETS / f"{name}.yaml").is_file() or not Path(name).is_file():
        return None
    return f"--config {name} is the shipped preset; the file {name} here is not read: pass {shlex.quote('./' + name)}"


def preset_summaries() -> dict[str, str]:
    """Each preset's name and the first sentence of the comment it opens with."""
    summaries = {}
    for path in sorted(PRESETS.glob("*.yaml")):
        comment = " ".join(line.removeprefix("#").strip() for line in path.read_text().splitlines()
                           if line.startswith("#"))
        summaries[path.stem] = comment.split(": ")[0].split(". ")[0].removesuffix(".")
    return summaries


def _yaml_problem(e: yaml.YAMLError) -> str:
    """What the YAML parser objects to, and where (line and column counted from 1)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    if "'\\t'" in problem:  # YAML takes no tab for indentation or after a key's colon
        problem += " (a tab: YAML takes spaces there)"
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


def _read_preset(path: Path) -> dict[str, Any]:
    """The sections of a preset file; ConfigError naming the file when it is unreadable, not YAML or not a mapping."""
    try:
        values = _load_yaml(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        line, column = e.object.count(b"\n", 0, e.start) + 1, e.start - e.object.rfind(b"\n", 0, e.start)
        raise ConfigError(f"config file {path} is not UTF-8 text (line {line}, column {column}: byte "
                          f"{e.object[e.start]:#04x}); save it as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {_yaml_problem(e)}; fix it there") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror}); pass a readable YAML file") from None
    # a file cut short, saved empty, or with every key commented out: training the defaults (vit_b16) would go unseen
    if values is None or (isinstance(values, dict) and values and not any(values.values())):
        held = "only comments" if values is None else f"only empty sections ({', '.join(map(str, values))})"
        raise ConfigError(f"config file {path} is empty (it holds {held}); write its sections' keys into it, as "
                          f"`vitctl config show demo_vit` prints, or pass a preset name instead")
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} holds a {type(values).__name__} at its top level, not a mapping of "
                          f"sections; write it as `section:` lines ({', '.join(_SECTIONS)}) with `key: value` lines "
                          f"indented under each, as `vitctl config show demo_vit` prints")
    # checked here, not only when built: a CLI flag that sets a section (--model) would replace it unseen
    flat = [f"{name}: {value!r}" for name, value in values.items() if not isinstance(value, dict | None)]
    if flat:
        raise ConfigError(f"config file {path} has sections that are not mappings of keys ({', '.join(flat)}); indent "
                          f"`key: value` lines under each section, as `vitctl config show demo_vit` prints")
    # a section whose keys are all commented out is None: it keeps its defaults
    return {name: value for name, value in values.items() if value is not None}


def load_config(preset: str | None, overrides: list[str] = (), extra: dict[str, Any] | None = None) -> RunConfig:
    """Preset, then `extra` (from CLI flags), then `--set` overrides; validated."""
    values: dict[str, Any] = _read_preset(preset_path(preset)) if preset is not None else {}
    try:  # the file's own keys and types first, for its problems to name it
        _build(RunConfig, values, "")
    except ConfigError as e:
        raise ConfigError(f"config file {preset_path(preset)}: {e}") from None
    from_file = _dotted_keys(values) if preset is not None and _names_a_file(preset) else set()
    values, given = _merge(values, extra or {}), _dotted_keys(extra or {})
    for text in overrides:
        override = parse_override(text)
        values, given = _merge(values, override), given | _dotted_keys(override)
    config = _build(RunConfig, values, "")
    _expand_home(config)
    if problems := value_problems(config):
        if from_file - given:
            problems = _naming_the_file(problems, from_file - given, given, preset_path(preset))
        raise ConfigError("; ".join(problems))
    return config


def _dotted_keys(values: dict[str, Any]) -> set[str]:
    """The `section.key` names a nested mapping of sections sets."""
    return {f"{section}.{key}" for section, keys in values.items() if isinstance(keys, dict) for key in keys}


def _naming_the_file(problems: list[str], from_file: set[str], given: set[str], path: Path) -> list[str]:
    """The problems, those with a key from the config file at `path` and none from a flag or --set (`given`) last,
    after the file's name: they are to be fixed there."""
    in_file = []
    for problem in problems:
        keys = {match.group() for match in _DOTTED_KEY.finditer(problem)} & _ALL_KEYS
        if keys & from_file and not keys & given:
            in_file.append(problem)
    others = [problem for problem in problems if problem not in in_file]
    return [*others, f"config file {path}: {'; '.join(in_file)}"] if in_file else others


PATH_KEYS = (("data", "path"), ("train", "out_dir"), ("finetune", "from_ckpt"), ("parallel", "plan"))


def _expand_home(config: RunConfig) -> None:
    """A leading ~ in a path key, as a shell expands it on the command line: in a config file or after `--set key=`
    no shell does, and the run would write in a folder named ~."""
    for section, key in PATH_KEYS:
        part = getattr(config, section)
        if (value := getattr(part, key)) and value.startswith("~"):
            setattr(part, key, os.path.expanduser(value))


def config_from_dict(values: dict[str, Any]) -> RunConfig:
    config = _build(RunConfig, values, "")
    if problems := value_problems(config):
        raise ConfigError("; ".join(problems))
    return config


LOADER_BRANCHES = ("pil", "pil-crop", "nvjpeg")  # data.decode's values


def unread_settings(c: RunConfig) -> list[str]:
    """Keys set away from their defaults that this config never reads, each with what would read it."""
    d, a = RunConfig(), c.augment
    unread = [
        (c.data.source != "synthetic" and c.data.train_samples != d.data.train_samples,
         f"data.train_samples={c.data.train_samples} is the epoch of synthetic data only (data.source=synthetic); "
         "other sources' epoch is their train split"),
        (c.train.precision != "fp8" and c.train.fp8_recipe != d.train.fp8_recipe,
         f"train.fp8_recipe={c.train.fp8_recipe} applies under train.precision=fp8 only"),
        (c.train.precision != "fp8" and c.train.fp8_min_width != d.train.fp8_min_width,
         f"train.fp8_min_width={c.train.fp8_min_width} applies under train.precision=fp8 only"),
        (not c.finetune.from_ckpt and c.finetune.reset_head is not None,
         f"finetune.reset_head={str(c.finetune.reset_head).lower()} applies with finetune.from_ckpt only"),
        (not c.finetune.from_ckpt and c.finetune.trust_checkpoint,
         "finetune.trust_checkpoint=true applies with finetune.from_ckpt only"),
        (a.reprob == 0 and a.recount != d.augment.recount,
         f"augment.recount={a.recount} applies with augment.reprob above 0 (random erasing) only"),
        (a.reprob == 0 and a.remode != d.augment.remode,
         f"augment.remode={a.remode} applies with augment.reprob above 0 (random erasing) only"),
        (c.parallel.fsdp and c.parallel.grad_reduce in ("after_backward", "overlap"),  # zero1 is refused beside it
         f"parallel.grad_reduce={c.parallel.grad_reduce} applies to replicated weights only (parallel.fsdp=false); "
         "FSDP reduces its gradients itself"),
        ((a.mixup == 0 or a.cutmix == 0) and a.mixup_switch_prob != d.augment.mixup_switch_prob,
         f"augment.mixup_switch_prob={a.mixup_switch_prob:g} applies with both augment.mixup and augment.cutmix "
         "above 0 only"),
    ]
    return [f"{note}: it has no effect here" for applies, note in unread if applies]


def value_problems(c: RunConfig) -> list[str]:
    """Each value out of its key's range, or that another key's value rules out."""
    checks = [
        (c.train.precision in PRECISIONS,
         f"train.precision must be one of {', '.join(PRECISIONS)}, got {c.train.precision!r}"),
        # numpy's generators, seeded from it in every rank, take no other
        (0 <= c.train.seed < 2**32, f"train.seed must be in [0, {2**32 - 1}], got {c.train.seed}"),
        (c.train.fp8_recipe in FP8_RECIPES,
         f"train.fp8_recipe must be one of {', '.join(FP8_RECIPES)}, got {c.train.fp8_recipe!r}"),
        (c.train.fp8_min_width >= 0, f"train.fp8_min_width must be 0 or more, got {c.train.fp8_min_width}"),
        (c.parallel.dp_shard == -1 or c.parallel.dp_shard >= 1, "parallel.dp_shard must be -1 (all) or at least 1"),
        # beside a plan, which sets both, read_plan names dp_shard as a key the plan sets
        (c.parallel.plan or c.parallel.fsdp or c.parallel.dp_shard in (-1, 1), "parallel.dp_shard needs "
                                                                                "parallel.fsdp=true"),
        (c.parallel.grad_reduce in GRAD_REDUCE,
         f"parallel.grad_reduce must be one of {', '.join(GRAD_REDUCE)}, got {c.parallel.grad_reduce!r}"),
        (c.train.compile_mode in COMPILE_MODES,
         f"train.compile_mode must be one of {', '.join(COMPILE_MODES)}, got {c.train.compile_mode!r}"),
        (c.train.compile or c.train.compile_mode == "default",
         f"train.compile_mode={c.train.compile_mode} needs train.compile=true"),
        (c.data.source in ("auto", "dali", "webdataset", "synthetic"),
         f"data.source must be auto, dali, webdataset or synthetic, got {c.data.source!r}"),
        (c.data.decode in LOADER_BRANCHES,
         f"data.decode must be one of {', '.join(LOADER_BRANCHES)}, got {c.data.decode!r}"),
        (c.data.batch_size >= 1, "data.batch_size must be at least 1"),
        (c.data.train_samples >= 1, f"data.train_samples must be at least 1, got {c.data.train_samples}"),
        (c.data.workers >= 0, "data.workers must be at least 0"),
        (c.model.num_classes >= 2, "model.num_classes must be at least 2"),
        (c.model.img_size >= 32, "model.img_size must be at least 32"),
        (0 <= c.model.drop_path < 1, "model.drop_path must be in [0, 1)"),
        (c.optim.lr > 0, f"optim.lr must be positive, got {c.optim.lr:g}"),
        (c.optim.min_lr >= 0, f"optim.min_lr must not be negative, got {c.optim.min_lr:g}"),
        (c.optim.accum_steps >= 1, "optim.accum_steps must be at least 1"),
        (c.optim.layer_decay is None or 0 < c.optim.layer_decay <= 1, "optim.layer_decay must be in (0, 1]"),
        (c.train.epochs > 0, "train.epochs must be positive"),
        (c.train.max_steps is None or c.train.max_steps >= 1, "train.max_steps must be at least 1"),
        (c.train.keep_checkpoints >= 1, "train.keep_checkpoints must be at least 1"),
        (c.train.ema_decay is None or 0 < c.train.ema_decay < 1, "train.ema_decay must be in (0, 1)"),
        (0 <= c.augment.label_smoothing < 1, "augment.label_smoothing must be in [0, 1)"),
        (0 < c.augment.min_crop_scale <= 1, "augment.min_crop_scale must be in (0, 1]"),
        (c.optim.warmup_lr >= 0, "optim.warmup_lr must not be negative"),
        (c.optim.lr <= 0 or c.optim.min_lr <= c.optim.lr,  # a bad optim.lr is the one to name
         f"optim.min_lr {c.optim.min_lr:g} is above optim.lr {c.optim.lr:g}, from which the schedule decays down to "
         "it; lower optim.min_lr"),
        # torch's AdamW refuses these only inside the ranks; a negative clip_grad would flip every gradient
        (c.optim.eps > 0, "optim.eps must be positive"),
        (c.optim.weight_decay >= 0, "optim.weight_decay must not be negative"),
        (all(0 <= beta < 1 for beta in c.optim.betas), "optim.betas must each be in [0, 1)"),
        (c.optim.clip_grad is None or c.optim.clip_grad >= 0, "optim.clip_grad must not be negative (null: no "
                                                              "clipping)"),
        (c.optim.warmup_epochs >= 0, "optim.warmup_epochs must not be negative"),
        (c.train.log_every >= 1, "train.log_every must be at least 1 (steps)"),
        (c.train.checkpoint_every >= 1, "train.checkpoint_every must be at least 1 (steps)"),
        (c.train.eval_every_epochs > 0, "train.eval_every_epochs must be positive"),
        (c.model.window_size is None or c.model.window_size >= 1, "model.window_size must be at least 1 (null: the "
                                                                  "model's own)"),
    ]
    non_finite = _non_finite(c)
    others = ([message for ok, message in checks if not ok] + _empty_paths(c) + _recipe_problems(c) +
              _parallel_problems(c.parallel))
    # what a comparison with nan or inf says of its key (not positive, above optim.lr) is noise beside the key's name
    mentions = [re.compile(rf"(?<![\w.]){re.escape(key)}(?!\w)") for key in non_finite]
    return [*non_finite.values(), *(m for m in others if not any(key.search(m) for key in mentions))]


def _empty_paths(c: RunConfig) -> list[str]:
    """Path keys set to an empty string (`--set KEY=''`, `KEY: ""` in a file): taken as given, the run folder would be
    the current one, and an empty plan, source or data path would be no setting, unsaid."""
    paths = {"train.out_dir": c.train.out_dir, "data.path": c.data.path, "finetune.from_ckpt": c.finetune.from_ckpt,
             "parallel.plan": c.parallel.plan}
    return [f"{key} is empty; give a path{'' if key == 'train.out_dir' else ', or null for none'}"
            for key, value in paths.items() if value is not None and not value.strip()]


def _non_finite(c: RunConfig) -> dict[str, str]:
    """Every float key holding inf or nan, and its problem: each would overflow a step count or turn the loss to nan
    mid-run."""
    problems = {}
    for section, values in c.to_dict().items():
        for key, value in values.items():
            several = isinstance(value, tuple | list)
            if any(isinstance(v, float) and not math.isfinite(v) for v in (value if several else [value])):
                problems[f"{section}.{key}"] = (f"{section}.{key} must be "
                                                f"{'finite numbers' if several else 'a finite number'}, got "
                                                f"{list(value) if several else value}")
    return problems


def _parallel_problems(p: ParallelConfig) -> list[str]:
    """The parallel keys that no job takes, whatever its ranks (those are checked before launch)."""
    problems = [f"parallel.{key} must be at least 1, got {getattr(p, key)}"
                for key in ("tp", "pp", "microbatches", "virtual_stages") if getattr(p, key) < 1]
    return problems + _one_of("parallel.checkpoint", p.checkpoint, CHECKPOINT) + \
        _one_of("parallel.schedule", p.schedule, SCHEDULES)


def _one_of(key: str, value: str | None, options: tuple[str, ...]) -> list[str]:
    return [] if value is None or value in options else [f"{key} must be one of {', '.join(options)}, got {value!r}"]


def _recipe_problems(c: RunConfig) -> list[str]:
    """The augmentation, eval view and normalisation keys."""
    a, e = c.augment, c.eval
    checks = [
        (a.mixup >= 0 and a.cutmix >= 0, "augment.mixup and augment.cutmix must not be negative"),
        (0 <= a.mixup_switch_prob <= 1, "augment.mixup_switch_prob must be in [0, 1]"),
        (a.color_jitter >= 0, "augment.color_jitter must not be negative"),
        (0 <= a.reprob <= 1, "augment.reprob must be in [0, 1]"),
        (a.recount >= 1, "augment.recount must be at least 1"),
        (a.repeated_aug >= 1, "augment.repeated_aug must be at least 1 (1: no repeats)"),
        (e.crop_pct is None or 0 < e.crop_pct <= 1, "eval.crop_pct must be in (0, 1]"),
        (c.data.std is None or min(c.data.std) > 0, "data.std must be positive"),
    ]
    problems = [message for ok, message in checks if not ok]
    for key, values in (("mean", c.data.mean), ("std", c.data.std)):
        if values is not None and max(values) > 1:  # mmcv's and official Swin's are in pixels: [123.675, ...]
            problems.append(f"data.{key} {list(values)} is in pixel values; vitctl takes fractions of 255: "
                            f"--set 'data.{key}=[{', '.join(f'{v / 255:.4g}' for v in values)}]'")
    problems += _one_of("augment.interpolation", a.interpolation, INTERPOLATIONS)
    problems += _one_of("augment.remode", a.remode, ERASE_MODES)
    problems += _one_of("eval.crop_mode", e.crop_mode, CROP_MODES)
    problems += _one_of("eval.interpolation", e.interpolation, INTERPOLATIONS)
    if a.rand_augment is not None:
        try:
            parse_rand_augment(a.rand_augment)
        except ValueError as error:
            problems.append(f"augment.rand_augment: {error}; write it as {RAND_GRAMMAR}, or null for none")
    return problems
