"""Bad input to `vitctl plan`, `vitctl bench train`, `vitctl config show`, config files, `--set` and `--plan` files:
one `error: ...` line naming what, where and how to fix it (exit 1), and the fix it names works."""

import hashlib
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_plan import BATCH, hand_made_profile

from conftest import CLASSES, ok, vitctl
from vitctl.trainer.parallel.strategy import BlockStrategy, Strategy

# A local dry run of vit_micro (4 blocks, 3 heads) on one CPU rank: the plan file is read before anything starts
DRY_RUN = ["train", "--config", "demo_vit", "--set", "data.source=synthetic", "--set", "data.train_samples=64",
           "--batch", 4, "--executor", "local", "--gpus", 0, "--dry-run"]
VALID_PLAN_KEYS = ("version, model, world_size, img_size, batch_size, tp, pp, dp_shard, microbatches, schedule, "
                   "virtual_stages, stages, fsdp_rest, groups, predicted")


def _plan(**changes) -> dict:
    """vitctl plan's file for vit_micro on one rank (blocks 0-1 plain, 2-3 selective), with `changes` to its keys."""
    written = Strategy(blocks=(BlockStrategy(),) * 2 + (BlockStrategy(checkpoint="selective"),) * 2)
    return {**json.loads(written.to_json("vit_micro", 1)), **changes}


def _train_with(tmp_path, plan: dict | str, *extra):
    path = tmp_path / "plan.json"
    path.write_text(plan if isinstance(plan, str) else json.dumps(plan))
    return path, vitctl(*DRY_RUN, "--out", tmp_path / "run", "--plan", path, *extra)


def _refused(result, message: str) -> None:
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr, result.output + result.stderr
    assert result.stderr == f"error: {message}\n"


# --plan files ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "problem"), [
    ({"fsdp": True}, f'unknown key "fsdp" (a plan holds {VALID_PLAN_KEYS})'),
    ({"groups": [{"blocks": 4, "fsdp": True, "checkpoint": "none", "ckpt": "full"}]},
     'groups[0] has the unknown key "ckpt" (a group holds blocks, fsdp, checkpoint)'),
], ids=["plan", "group"])
def test_a_plan_key_no_plan_holds_is_refused_naming_the_valid_ones(tmp_path, changes, problem):
    """Before, an unknown key was ignored: a misspelt key left the default in force, unseen."""
    path, result = _train_with(tmp_path, _plan(**changes))
    _refused(result, f"parallel.plan {path}: {problem}; fix these, or write the plan again with `vitctl plan`")
    _, result = _train_with(tmp_path, _plan())  # the key removed
    assert result.exit_code == 0, result.stderr


def test_a_plan_is_copied_into_the_run_folder_only_for_a_job_that_starts_and_a_script_writes_its_own(tmp_path):
    """The job reads the plan checked at launch from its copy (plan-SHA.json). Before: a --dry-run script's ranks read
    the plan file as it was when they started, and a refused launch left a copy behind."""
    path, result = _train_with(tmp_path, _plan())
    copy = tmp_path / "run" / f"plan-{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}.json"
    assert f"cat > {copy} <<'VITCTL_PLAN'\n{path.read_text()}\nVITCTL_PLAN\n" in result.stdout  # the script's own
    assert f"  plan: {copy}\n" in result.stdout and not copy.exists()
    run = [a for a in DRY_RUN if a != "--dry-run"] + ["--out", tmp_path / "run", "--plan", path, "--steps", 1]
    ok(*run)
    assert copy.read_text() == path.read_text() and [p.name for p in (tmp_path / "run").glob("plan-*")] == [copy.name]
    path.write_text(json.dumps(_plan(microbatches=2)))  # another plan, refused before the job: no copy of it
    assert vitctl(*run).exit_code == 1 and [p.name for p in (tmp_path / "run").glob("plan-*")] == [copy.name]
    path.unlink()  # a resume without the plan is told the copy that keeps it (was: the default layout, unsaid)
    plain = [a for a in run if a not in ("--plan", path)]
    said = " ".join(ok(*plain[:-1], 2, "--resume").stderr.split())
    assert f"was saved under the plan {copy}; this resume trains on the layout of the parallel.* keys" in said, said
    assert f"--plan {copy} keeps the plan" in said
    result = vitctl(*run[:-1], 3, "--resume")  # given again, deleted: the copy is named (was: write one with plan)
    assert result.exit_code == 1 and " ".join(result.stderr.split()) == (
        f"error: parallel.plan {path} does not exist; {tmp_path / 'run'} keeps a copy of the plan it trained under: "
        f"pass --plan {copy}"), result.stderr
    result = vitctl(*run[:-1], 3)  # and without --resume (was: only that the plan does not exist)
    assert result.exit_code == 1 and f"pass --plan {copy} with --resume, to go on from its checkpoints" in \
        " ".join(result.stderr.split()), result.stderr
    ok(*[copy if a == path else a for a in run[:-1]], 3, "--resume")  # the fix, followed


def test_a_plan_saved_with_a_byte_order_mark_is_read(tmp_path):
    """Before: `Unexpected UTF-8 BOM`, for a plan saved by an editor that writes one (YAML configs read it)."""
    _, result = _train_with(tmp_path, "\ufeff" + json.dumps(_plan()))
    assert result.exit_code == 0, result.stderr


def test_a_key_given_twice_in_a_plan_is_refused(tmp_path):
    """json.loads kept the last of the two, unseen."""
    text = json.dumps(_plan()).replace('"tp": 1', '"tp": 1, "tp": 3', 1)
    path, result = _train_with(tmp_path, text)
    _refused(result, f'parallel.plan {path} cannot be read as JSON (key "tp" appears more than once in one object); '
                     f"write it again with `vitctl plan`")


@pytest.mark.parametrize("groups", [
    [{"blocks": 2, "fsdp": False, "checkpoint": "none"}] * 4,  # a group pasted twice
    [{"blocks": 6, "fsdp": False, "checkpoint": "none"}],
    [],
], ids=["repeated-groups", "too-many", "none"])
def test_a_plan_whose_groups_do_not_cover_the_blocks_says_how_many_are_needed(tmp_path, groups):
    """Before: `... it was planned for 'vit_micro'` of a plan made for it, or `planned for None` without a model."""
    given = sum(g["blocks"] for g in groups)
    for plan in (_plan(groups=groups), {k: v for k, v in _plan(groups=groups).items() if k != "model"}):
        path, result = _train_with(tmp_path, plan)
        _refused(result, f'parallel.plan {path} gives strategies for {given} blocks (the "blocks" of its groups add up '
                         f"to {given}) but model vit_micro has 4; make them add up to 4, or write the plan again with "
                         f"`vitctl plan --model vit_micro ... --out {path}`")
    _, result = _train_with(tmp_path, _plan(groups=[{"blocks": 4, "fsdp": False, "checkpoint": "none"}]))
    assert result.exit_code == 0, result.stderr


@pytest.mark.parametrize(("changes", "problem"), [
    ({"tp": 0}, 'tp holds 0, not a whole number of at least 1, e.g. "tp": 2'),
    ({"microbatches": 0}, 'microbatches holds 0, not a whole number of at least 1, e.g. "microbatches": 4'),
    ({"dp_shard": 0}, "dp_shard holds 0, not -1 (every data-parallel rank) or a whole number of at least 1"),
    ({"schedule": "zigzag"}, 'schedule holds "zigzag", not one of "gpipe", "1f1b", "interleaved_1f1b"'),
    ({"groups": [{"blocks": 4, "fsdp": False, "checkpoint": "all"}]},
     'groups[0].checkpoint (blocks 0-3) holds "all", not one of "none", "selective", "full"'),
])
def test_a_plan_value_out_of_range_is_named_by_its_plan_key(tmp_path, changes, problem):
    """Before: `parallel.tp, parallel.pp, ... must each be at least 1`, naming keys the user never set."""
    path, result = _train_with(tmp_path, _plan(**changes))
    _refused(result, f"parallel.plan {path}: {problem}; fix these, or write the plan again with `vitctl plan`")


def test_a_plan_searched_for_other_ranks_is_refused_and_runs_on_them(tmp_path):
    """A plan for 2 ranks on 1 shards over half the ranks it predicted memory for; before, it ran unseen."""
    path, result = _train_with(tmp_path, _plan(world_size=2))
    _refused(result, f"parallel.plan {path}: the plan was searched for 2 ranks (its world_size), and this job has 1: "
                     f"its memory and time were predicted for 2; plan again for this job's nodes and GPUs (vitctl "
                     f"plan --nodes N --gpus G ...), or run it on 2 ranks")
    ok(*DRY_RUN, "--out", tmp_path / "run", "--plan", path, "--tasks-per-node", 2)


def test_a_plan_strategy_problem_names_the_plan_it_comes_from(tmp_path):
    path, result = _train_with(tmp_path, _plan(stages=[2, 2]))
    _refused(result, f"parallel.plan {path}: parallel.stages and parallel.virtual_stages need parallel.pp > 1")


# vitctl plan ------------------------------------------------------------------------------------------------------


def _plan_args(profile, out, *, batch=BATCH, gpus=4):
    return ("plan", "--model", "vit_mini", "--img-size", 32, "--gpus", gpus, "--memory-gib", 80, "--batch", batch,
            "--out", out, "--profile", profile)


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(hand_made_profile().to_json())
    return path


@pytest.mark.parametrize("name", ["profile.json", "notes.txt"])
def test_plan_out_that_holds_something_else_is_not_overwritten(tmp_path, profile, name):
    """Before, `--out profile.json` replaced the profile with the plan."""
    out = tmp_path / name
    if not out.exists():
        out.write_text("my notes\n")
    before = out.read_bytes()
    result = vitctl(*_plan_args(profile, out))
    _refused(result, f"--out {out} already holds a file that is not a plan; choose another --out, or move {out} away "
                     f"first")
    assert out.read_bytes() == before
    ok(*_plan_args(profile, tmp_path / "plan.json"))
    ok(*_plan_args(profile, tmp_path / "plan.json"))  # a plan it wrote before is replaced


@pytest.mark.parametrize(("gpus", "batch", "fix"), [(3, 7, "6 or --batch 9"), (3, 2, "3")])
def test_plan_with_a_batch_no_layout_divides_says_so(tmp_path, profile, gpus, batch, fix):
    """Before: `no strategy ... fits in --memory-gib 80; raise --memory-gib`, which could never help."""
    out = tmp_path / "plan.json"
    result = vitctl(*_plan_args(profile, out, batch=batch, gpus=gpus))
    assert result.exit_code == 1 and "Traceback" not in result.stderr and "cannot run" in result.stdout
    assert result.stderr == (f"error: no strategy can run a global batch of {batch} on 1 x {gpus} GPUs (the table "
                             f"says why each cannot run); give a multiple of {gpus}, which divides over every layout's "
                             f"data-parallel ranks, e.g. --batch {fix}\n")
    assert not out.exists()
    ok(*_plan_args(profile, out, batch=int(fix.split()[0]), gpus=gpus))


def _damage(raw: dict, how: str) -> object:
    match how:
        case "no-tp1-blocks":
            raw["blocks"] = [b for b in raw["blocks"] if b["tp"] != 1]
        case "no-head":
            raw["parts"] = [p for p in raw["parts"] if p["name"] != "head"]
        case "text-time":
            raw["blocks"][0]["measured"]["forward_s"] = ["a", "b"]
        case "short-column":
            raw["blocks"][0]["measured"]["forward_s"] = [1e-3]
        case "nan":
            raw["blocks"][0]["measured"]["forward_s"] = [float("nan"), 1e-3]
        case "null-measured":
            raw["blocks"][0]["measured"] = None
        case "zero-bandwidth":
            raw["collectives"][0]["fits"]["all_reduce"]["bus_bytes_per_s"] = 0
        case "list":
            return []
    return raw


@pytest.mark.parametrize(("how", "reason"), [
    ("no-tp1-blocks", "is damaged: the blocks are not all measured (each block shape without tensor parallel, in "
                      "every checkpoint mode, with and without FSDP)"),
    ("no-head", "is damaged: no measurement of head, outside the blocks"),
    ("text-time", "is damaged: blocks[0].measured.forward_s holds what is not a measurement (finite numbers, none "
                  "negative, one per batch size)"),
    ("short-column", "is damaged: blocks[0].measured.forward_s holds what is not a measurement"),
    ("nan", "is damaged: blocks[0].measured.forward_s holds what is not a measurement"),
    ("zero-bandwidth", "is damaged: collectives[0] holds what is not a measurement"),
    ("null-measured", "is not a profile this vitctl reads ('NoneType' object has no attribute 'items')"),
])
def test_plan_from_a_damaged_profile_says_how_to_measure_it_again(tmp_path, profile, how, reason):
    """Before: StopIteration, TypeError, ValueError or AttributeError tracebacks from the cost model (or, for nan, a
    plan written from it)."""
    damaged, out = tmp_path / "damaged.json", tmp_path / "plan.json"
    damaged.write_text(json.dumps(_damage(json.loads(profile.read_text()), how)))
    result = vitctl(*_plan_args(damaged, out))
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr
    assert result.stderr.startswith(f"error: profile {damaged} {reason}")
    assert result.stderr.endswith("; measure it again with `vitctl plan --profile-only --model vit_mini --img-size 32` "
                                  "on a GPU node (it replaces the cached one) and pass that file with --profile\n")
    assert not out.exists()


@pytest.mark.parametrize(("content", "reason"), [("[]", "it holds a JSON list, not an object"),
                                               ('{"format": "vitctl-shards/1"}', "it holds no profile version")])
def test_a_profile_that_is_another_json_file_is_named_so(tmp_path, content, reason):
    """Before: told to measure it again, as it replaced 'the cached one' (of an older version), which it was not."""
    other, out = tmp_path / "manifest.json", tmp_path / "plan.json"
    other.write_text(content)
    result = vitctl(*_plan_args(other, out))
    assert result.exit_code == 1 and result.stderr == (
        f"error: --profile {other} is not a profile ({reason}); pass the file `vitctl plan --profile-only` wrote, or "
        "measure one with `vitctl plan --profile-only --model vit_mini --img-size 32` on a GPU node\n"), result.stderr


# config files and --set -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("content", "message"), [
    ("model:\n  name: vit_micro\nmodel:\n  img_size: 64\n",
     "line 3, column 1: key 'model' appears twice in one mapping (first on line 1), and the second would replace the "
     "first: keep one"),
    ("model:\n  name: vit_micro\n  img_size: 32\n  img_size: 64\n",
     "line 4, column 3: key 'img_size' appears twice in one mapping (first on line 3)"),
    ("model:\n\tname: vit_micro\n", "line 2, column 1: found character '\\t' that cannot start any token (a tab: "
                                     "YAML takes spaces there)"),
], ids=["section", "key", "tab"])
def test_a_key_written_twice_or_a_tab_in_a_config_file_is_refused(tmp_path, content, message):
    """Before, YAML kept the second: a second `model:` block dropped model.name, which trained vit_b16; a tab said
    only that it `cannot start any token`."""
    path = tmp_path / "twice.yaml"
    path.write_text(content)
    result = vitctl("config", "show", path)
    assert result.exit_code == 1 and result.stderr.startswith(f"error: config file {path} is not valid YAML: {message}")
    path.write_text("model:\n  name: vit_micro\n  img_size: 64\n")  # kept once
    assert yaml.safe_load(ok("config", "show", path).stdout)["model"]["name"] == "vit_micro"


@pytest.mark.parametrize(("content", "held"), [
    ("", "only comments"), ("# model:\n#   name: vit_micro\n", "only comments"),
    ("model:\n#  name: vit_micro\noptim:\n#  lr: 1e-3\n", "only empty sections (model, optim)"),
])
def test_an_empty_config_file_is_refused(tmp_path, content, held):
    """Before, it gave the defaults: `train --config empty.yaml` trained vit_b16 (also where every key under its
    sections was commented out)."""
    path = tmp_path / "empty.yaml"
    path.write_text(content)
    _refused(vitctl("config", "show", path), f"config file {path} is empty (it holds {held}); write its sections' "
                                             f"keys into it, as `vitctl config show demo_vit` prints, or pass a "
                                             f"preset name instead")
    path.write_text(ok("config", "show", "demo_vit").stdout)
    ok("config", "show", path)


@pytest.mark.parametrize("content, message", [
    ("paralel: {tp: 2}\n", "unknown keys ['paralel']; known: ['augment', 'data', 'eval', 'finetune', 'model', "
                           "'optim', 'parallel', 'train']; did you mean parallel?"),
    ("parallel: {tp: 2.5}\n", "parallel.tp: expected int, got 2.5")])
def test_a_config_file_s_unknown_key_or_wrong_type_names_the_file(tmp_path, content, message):
    """Before: the problem alone, where its YAML syntax errors named the file."""
    path = tmp_path / "c.yaml"
    path.write_text(content)
    _refused(vitctl("train", "--config", path, "--dry-run"), f"config file {path}: {message}")


def test_a_toml_config_file_is_refused_as_toml_and_other_suffixes_are_read_as_files(tmp_path, monkeypatch):
    """Before: `no preset 'my.toml'; presets: ... (or pass a .yaml path)` for a file that is there."""
    monkeypatch.chdir(tmp_path)
    for name in ("my.toml", "MY.TOML"):
        (tmp_path / name).write_text('[model]\nname = "vit_micro"\n')
        _refused(vitctl("config", "show", name), f"config file {name} is TOML, and vitctl reads YAML: write its "
                                                 "tables as YAML sections (`[optim]` and `lr = 1e-3` become `optim:` "
                                                 "and an indented `lr: 1e-3`), as `vitctl config show demo_vit` "
                                                 "prints, in a .yaml file")
    for name in ("my.yaml", "my.cfg"):
        (tmp_path / name).write_text("model:\n  name: vit_micro\n")
        assert yaml.safe_load(ok("config", "show", name).stdout)["model"]["name"] == "vit_micro"


def test_a_file_named_as_a_preset_in_the_current_folder_is_warned_of_and_the_fix_reads_it(tmp_path, monkeypatch):
    """Before: `vitctl config show demo_vit > demo_vit`, edited, then `--config demo_vit` trained the shipped preset
    without a word."""
    monkeypatch.chdir(tmp_path)
    edited = ok("config", "show", "demo_vit").stdout.replace("img_size: 32", "img_size: 64")
    (tmp_path / "demo_vit").write_text(edited)
    for command in (["config", "show", "demo_vit"], ["train", "--config", "demo_vit", "--set", "data.source=synthetic",
                                                     "--executor", "local", "--gpus", 0, "--dry-run", "--out", "run"]):
        result = ok(*command)
        assert result.stderr.startswith("warning: --config demo_vit is the shipped preset; the file demo_vit here is "
                                        "not read: pass ./demo_vit\n"), result.stderr
    assert "img_size: 32" in ok("config", "show", "demo_vit").stdout
    assert "img_size: 64" in ok("config", "show", "./demo_vit").stdout  # the fix
    assert "warning" not in ok("config", "show", "./demo_vit").stderr


def test_a_config_file_named_with_a_dot_slash_is_read_and_a_folder_is_refused(tmp_path, monkeypatch):
    """Before: `no preset './myconf'` for a file that is there (Path drops the ./), and the same for a folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myconf").write_text(ok("config", "show", "demo_vit").stdout)
    result = vitctl("config", "show", "myconf")  # read as a preset's name, which it is not: the fix is named
    assert result.exit_code == 1 and "; myconf here is a file: pass ./myconf to read it as YAML" in result.stderr
    assert yaml.safe_load(ok("config", "show", "./myconf").stdout)["model"]["name"] == "vit_micro"
    (tmp_path / "my conf").write_text(ok("config", "show", "demo_vit").stdout)  # the fix quoted for the shell
    result = vitctl("config", "show", "my conf")
    fix = shlex.split(result.stderr.split("here is a file: pass ", 1)[1].split(" to read it", 1)[0])
    assert result.exit_code == 1 and fix == ["./my conf"], result.stderr
    assert yaml.safe_load(ok("config", "show", *fix).stdout)["model"]["name"] == "vit_micro"
    monkeypatch.setenv("HOME", str(tmp_path))  # --config=~/x: no shell expands a ~ after "="
    assert yaml.safe_load(ok("config", "show", "~/myconf").stdout)["model"]["name"] == "vit_micro"
    (tmp_path / "folder").mkdir()
    _refused(vitctl("config", "show", "./folder"), "config file folder is a folder; pass a YAML file in it, or a "
                                                   "preset name")


def test_an_empty_config_or_out_is_refused_not_taken_as_the_defaults_or_the_current_folder(tmp_path, monkeypatch):
    """An unset shell variable: `--config ""` trained vit_b16 at 224 px, `--out ""` wrote the run into the current
    folder, and `data shard --out ""` the shards."""
    monkeypatch.chdir(tmp_path)
    config_at = DRY_RUN.index("--config") + 1
    for command, name in (([*DRY_RUN[:config_at], "", *DRY_RUN[config_at + 1:], "--out", "run"], "--config"),
                          (["config", "show", ""], "[PRESET]")):
        result = vitctl(*command)
        assert result.exit_code == 2 and f"Invalid value for '{name}': is empty (an unset shell variable?); give a " \
            "preset name or a YAML file" in result.stderr, result.stderr
    for command in ([*DRY_RUN, "--out", ""], ["data", "shard", tmp_path, "--out", ""]):
        result = vitctl(*command)
        assert result.exit_code == 2 and "Invalid value for '--out': is empty (an unset shell variable?); give a " \
            "path" in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option", ["--partition", "--account", "--qos", "--mem", "--container-image",
                                    "--container-mounts"])
def test_an_empty_slurm_setting_is_a_usage_error(tmp_path, option):
    """Before: `--partition ""` reached sbatch, which said `invalid partition specified: (null)`."""
    result = vitctl(*DRY_RUN, "--out", tmp_path / "run", option, "")
    assert result.exit_code == 2 and f"Invalid value for '{option}': is empty (an unset shell variable?); give a " \
        "value, or leave the option out" in result.stderr, result.stderr


@pytest.mark.parametrize("option, value, said", [
    ("--model", "", "is empty (an unset shell variable?); give a model name, e.g. vit_b16 or swin_t, or leave the "
                    "option out"),
    ("--time", "", "is empty (an unset shell variable?); give a value, or leave the option out"),
    ("--time", "1:xx", "'1:xx' is not a Slurm time (e.g. 30, 4:00:00, 1-12:00:00)"),
    ("--time", "0", "'0' is no time to train; give a positive limit, e.g. --time 4:00:00")])
def test_an_empty_model_or_a_time_that_is_none_is_a_usage_error(tmp_path, option, value, said):
    """Before: exit 1 where `--out ""` and the other options' values exit 2."""
    result = vitctl(*DRY_RUN, "--out", tmp_path / "run", option, value)
    assert result.exit_code == 2 and f"Invalid value for '{option}': {said}" in result.stderr, result.stderr


@pytest.fixture
def immutable():
    """chattr +i (root ignores permission bits, not this flag); undone at the end, or pytest could not clean up."""
    made = []

    def make(path: Path) -> None:
        if subprocess.run(["chattr", "+i", path], capture_output=True).returncode:
            pytest.skip("chattr +i is not available on this filesystem")
        made.append(path)

    yield make
    for path in made:
        subprocess.run(["chattr", "-i", path], check=True)


@pytest.mark.parametrize("part", ["metrics.jsonl", "checkpoints"])
def test_a_part_of_the_run_folder_this_user_cannot_write_is_refused_before_launch(tmp_path, immutable, part):
    """Before: a rank's PermissionError on metrics.jsonl after launch, or for checkpoints/ the whole run trained
    and then failed to save."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").touch()
    immutable(run / part)
    _refused(vitctl(*DRY_RUN, "--out", run), f"run folder {run} (--out): this user cannot write {run / part} (its "
                                             "permissions, or read-only or immutable); give this user write access "
                                             "there, or choose another --out")


def test_a_dry_run_into_a_folder_that_cannot_be_made_is_refused(tmp_path, immutable):
    """Before: exit 0, while the job (and a real submission, at once) would fail to make it."""
    parent = tmp_path / "locked"
    parent.mkdir()
    immutable(parent)
    _refused(vitctl(*DRY_RUN, "--out", parent / "a/run"), f"run folder {parent / 'a/run'} (--out): this user cannot "
                                                          f"write {parent} (its permissions, or read-only or "
                                                          "immutable); give this user write access there, or choose "
                                                          "another --out")


def test_a_key_the_run_would_not_read_is_warned_of_by_train_and_config_show(tmp_path):
    """Before: `--set augment.recount=3` without random erasing was taken without a word."""
    said = "warning: augment.recount=3 applies with augment.reprob above 0 (random erasing) only: it has no effect here"
    result = ok(*DRY_RUN, "--set", "augment.recount=3", "--out", tmp_path / "run")
    assert said in result.stderr, result.stderr
    assert said in ok("config", "show", "demo_vit", "--set", "augment.recount=3").stderr
    assert "warning" not in ok(*DRY_RUN, "--set", "augment.recount=3", "--set", "augment.reprob=0.25", "--out",
                               tmp_path / "run").stderr


def test_a_gradient_reduction_beside_a_plan_that_shards_with_fsdp_is_warned_of(tmp_path):
    """Before: only beside parallel.fsdp=true; a plan's FSDP blocks reduce every gradient themselves as well."""
    sharded = json.loads(Strategy(blocks=(BlockStrategy(fsdp=True),) * 4, fsdp_rest=True).to_json("vit_micro", 1))
    path, result = _train_with(tmp_path, sharded, "--set", "parallel.grad_reduce=overlap")
    assert result.exit_code == 0 and result.stderr == (
        f"warning: parallel.grad_reduce=overlap applies to replicated weights only, and the plan {path} shards weights "
        "with FSDP, which then reduces every gradient itself: it has no effect here\n")
    _, result = _train_with(tmp_path, _plan(), "--set", "parallel.grad_reduce=overlap")  # replicated: it applies
    assert result.exit_code == 0 and result.stderr == ""


def test_a_submitit_folder_this_user_cannot_write_is_named_with_the_fix(tmp_path, immutable):
    """Before: `submission failed: [Errno 1] Operation not permitted: '.../submitit/<hash>.pkl'`, and no fix."""
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    immutable(run / "submitit")
    result = vitctl(*[arg for arg in DRY_RUN if arg != "--dry-run"], "--steps", 1, "--out", run)
    assert result.exit_code == 1 and "Traceback" not in result.stderr, result.stderr
    assert re.fullmatch(rf"error: submission failed: this user cannot write {re.escape(str(run))}/submitit/\w+\.pkl "
                        rf"\(Operation not permitted\); give this user write access to "
                        rf"{re.escape(str(run / 'submitit'))}, or choose another --out\n", result.stderr), result.stderr


def test_a_data_path_that_is_missing_or_a_file_is_said_to_be_so(tmp_path):
    (tmp_path / "file").touch()
    for name, what in (("missing", "does not exist"), ("file", "is not a folder")):
        _refused(vitctl("train", "--config", "demo_vit", "--data", tmp_path / name, "--out", tmp_path / "run",
                        "--executor", "local", "--gpus", 0, "--dry-run"),
                 f"data.path {tmp_path / name} {what}; prepare one with `vitctl data shard`")


def test_an_image_root_or_one_shard_as_data_is_named_and_the_fix_trains(prepared_root, prepared_shards, tmp_path):
    """Before: `no manifest.json; prepare it with vitctl data shard and index`, and `is not a folder`."""
    root = Path(shutil.copytree(prepared_root, tmp_path / "imagenet"))
    run = ["train", "--config", "demo_vit", "--out", tmp_path / "run", "--executor", "local", "--gpus", 0,
           "--set", f"model.num_classes={CLASSES}", "--dry-run"]
    result = vitctl(*run, "--data", root)
    assert result.exit_code == 1 and "holds images (train/, val/), not shards: shard it first" in result.stderr
    commands = re.search(r"`vitctl (data shard .+) && vitctl (data index .+)`, then pass --data (\S+)$",
                         result.stderr.strip())
    ok(*shlex.split(commands[1]))
    ok(*shlex.split(commands[2]))
    ok(*run, "--data", commands[3])
    shard = sorted(prepared_shards.glob("*.tar"))[0]
    _refused(vitctl(*run, "--data", shard), f"data.path {shard} is one shard of the shard folder {prepared_shards}; "
                                            "pass that folder")


@pytest.mark.parametrize("inside", ["", "run"])
def test_a_run_folder_in_the_shard_folder_is_refused(prepared_shards, tmp_path, inside):
    """Before, the run's checkpoints and logs went in among the shards, and a later `vitctl data shard` into that
    folder refused the files vitctl itself had written there."""
    shards = shutil.copytree(prepared_shards, tmp_path / "shards")
    out = shards / inside
    train = ["train", "--config", "demo_vit", "--data", shards, "--batch", 4, "--executor", "local", "--gpus", 0,
             "--dry-run", "--set", "model.num_classes=5"]
    where = "" if not inside else "inside "
    _refused(vitctl(*train, "--out", out), f"run folder {out} (--out) is {where}the shard folder {shards} (--data); "
                                           "choose a run folder outside it")
    other = shutil.copytree(prepared_shards, tmp_path / "other")  # another dataset's shards: not --data
    _refused(vitctl(*train, "--out", other / inside), f"run folder {other / inside} (--out) is {where}the shard "
                                                      f"folder {other} (it holds the manifest.json of `vitctl data "
                                                      "shard`); choose a run folder outside it")
    (tmp_path / "web").mkdir()
    (tmp_path / "web/manifest.json").write_text('{"name": "a web app"}')  # another tool's file of that name
    ok(*train, "--out", tmp_path / "web/run")
    ok(*train, "--out", tmp_path / "run")


@pytest.mark.parametrize(("override", "message", "fix"), [
    ("optim.lr.x=1", "optim.lr is a value, not a section of keys; there is no optim.lr.x: set it as optim.lr=VALUE",
     "optim.lr=1"),
    ("optim=5", "optim is a section of keys, not a value (got 5); set one of its keys: optim.KEY=VALUE, KEY one of "
                "accum_steps, betas, clip_grad, eps, layer_decay, lr, min_lr, warmup_epochs, warmup_lr, weight_decay",
     "optim.lr=5"),
    ("optim..lr=1", "override 'optim..lr=1' is not of the form section.key=value (e.g. optim.lr=1e-3)", "optim.lr=1"),
    ("lr=1e-3", "unknown keys ['lr']; known: ['augment', 'data', 'eval', 'finetune', 'model', 'optim', 'parallel', "
                "'train']; did you mean optim.lr?", "optim.lr=1e-3"),
    ("optim.batch_size=2", "unknown keys ['optim.batch_size']; known: ['accum_steps', 'betas', 'clip_grad', 'eps', "
                           "'layer_decay', 'lr', 'min_lr', 'warmup_epochs', 'warmup_lr', 'weight_decay']; did you mean "
                           "data.batch_size?", "data.batch_size=2"),
])
def test_an_override_of_the_wrong_shape_says_which_key_is_meant(override, message, fix):
    """Before: `optim.lr: expected float, got {'x': 1}`, `optim: expected a mapping, got 5`, `unknown keys
    ['optim.']`, and no hint where `lr` lives."""
    _refused(vitctl("config", "show", "demo_vit", "--set", override), message)
    ok("config", "show", "demo_vit", "--set", fix)


@pytest.mark.parametrize(("override", "message"), [
    ("train.log_every=0", "train.log_every must be at least 1 (steps)"),  # the ranks divided by it
    ("train.checkpoint_every=0", "train.checkpoint_every must be at least 1 (steps)"),
    ("train.eval_every_epochs=0", "train.eval_every_epochs must be positive"),  # evaluated after every step
    ("optim.clip_grad=-1", "optim.clip_grad must not be negative (null: no clipping)"),  # flipped every gradient
    ("optim.eps=0", "optim.eps must be positive"),
    ("optim.weight_decay=-0.05", "optim.weight_decay must not be negative"),
    ("optim.betas=[0.9, 1.5]", "optim.betas must each be in [0, 1)"),
    ("optim.warmup_epochs=-1", "optim.warmup_epochs must not be negative"),
    ("optim.min_lr=1", "optim.min_lr 1 is above optim.lr 0.002, from which the schedule decays down to it; lower "
                       "optim.min_lr"),
    ("optim.lr=-1", "optim.lr must be positive, got -1"),  # was also told to lower optim.min_lr
    ("optim.lr=0", "optim.lr must be positive, got 0"),
    ("optim.min_lr=-1", "optim.min_lr must not be negative, got -1"),
    ("model.window_size=-7", "model.window_size must be at least 1 (null: the model's own)"),  # was a traceback
    ("train.seed=-1", "train.seed must be in [0, 4294967295], got -1"),  # numpy's ValueError in the ranks
    ("train.seed=4294967296", "train.seed must be in [0, 4294967295], got 4294967296"),
    ("parallel.tp=0", "parallel.tp must be at least 1, got 0"),
    ("parallel.checkpoint=al", "parallel.checkpoint must be one of none, selective, full, got 'al'"),
    ("parallel.schedule=zigzag", "parallel.schedule must be one of gpipe, 1f1b, interleaved_1f1b, got 'zigzag'"),
])
def test_a_value_no_run_takes_is_refused_when_the_config_loads(tmp_path, override, message):
    """Before, `config show` accepted these; training failed inside the ranks, or ran wrongly."""
    _refused(vitctl("config", "show", "demo_vit", "--set", override), message)
    result = vitctl(*DRY_RUN, "--out", tmp_path / "run", "--set", override)
    _refused(result, message)


def test_a_warmup_longer_than_the_run_is_warned_of(tmp_path):
    """Before: accepted without a word; the run ended at 2% of its learning rate."""
    result = ok(*DRY_RUN, "--out", tmp_path / "run", "--epochs", 2, "--set", "optim.warmup_epochs=100")
    assert ("warning: optim.warmup_epochs=100 is longer than train.epochs=2: the learning rate warms up for the whole "
            "run and ends at about 2% of optim.lr; set optim.warmup_epochs below 2 (e.g. --set "
            "optim.warmup_epochs=0.1, a twentieth of the run)\n") in result.stderr, result.stderr
    fixed = ok(*DRY_RUN, "--out", tmp_path / "run", "--epochs", 2, "--set", "optim.warmup_epochs=0.1")
    assert "warmup" not in fixed.stderr


# vitctl bench train -----------------------------------------------------------------------------------------------


def test_bench_refuses_an_unknown_op_and_a_size_the_model_cannot_take_before_looking_for_a_gpu():
    """On a GPU, `--fused bogus` ended in a ValueError traceback, and a bad size failed after the GPU was set up."""
    result = vitctl("bench", "train", "--model", "vit_micro", "--img-size", 36, "--fused", "bogus")
    assert result.exit_code == 2 and result.stderr.endswith(
        "Error: model vit_micro: image size 36 is not a multiple of the patch size 8; the nearest that is: 32; "
        "--fused: unknown op 'bogus'; choose from all, none, window_partition, window_merge, window_attention, "
        "attention, layer_norm, mlp, optimizer\n"), result.stderr
    result = vitctl("bench", "train", "--img-size", 0)
    assert result.exit_code == 2 and "Invalid value for '--img-size': 0 is not in the range x>=32" in result.stderr
