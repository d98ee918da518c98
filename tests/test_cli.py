import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest

from conftest import vitctl
from vitctl.cli import commands
from vitctl.cli.main import cli
from vitctl.workflows import registry

COMMANDS = ["synth", "extract", "valprep", "shard", "index", "verify"]


def test_version_from_the_installed_console_script():
    out = subprocess.run([str(Path(sys.executable).parent / "vitctl"), "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "vitctl, version 0.1.0"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_data_command_has_help(command):
    result = vitctl("data", command, "--help")
    assert result.exit_code == 0 and "Usage: cli data " + command in result.output


@pytest.mark.parametrize("command", ["train", "finetune"])
def test_every_option_of_train_and_finetune_says_what_it_does(command):
    """Before: --epochs, --precision, --partition, --account and --qos had no word in `--help`."""
    import click

    from vitctl.cli.main import cli

    found = cli.get_command(click.Context(cli), command)
    silent = [p.opts[0] for p in found.params if not getattr(p, "help", None)]
    assert silent == [], silent


def test_data_group_lists_every_command():
    output = vitctl("data", "--help").output
    assert all(f"  {c} " in output for c in COMMANDS)


def test_bad_synth_arguments_are_explained(tmp_path):
    result = vitctl("data", "synth", tmp_path, "--classes", 500)
    assert result.exit_code == 2  # a usage error, as every other range of synth's
    assert "Invalid value for '--classes': 500 is not in the range 3<=x<=36." in result.stderr
    assert "3 (for the PNG, CMYK and grayscale images) to 36 (the real WNIDs synth knows)" in " ".join(
        vitctl("data", "synth", "--help").output.split())
    assert not list(tmp_path.iterdir())


def test_verify_of_a_folder_without_manifest(tmp_path):
    result = vitctl("data", "verify", tmp_path)
    assert result.exit_code == 1 and "no manifest.json" in result.stderr and "vitctl data shard" in result.stderr


def test_doctor_says_which_ops_can_run_and_why_not():
    result = vitctl("doctor")
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert any("window_partition" in line and "reference" in line and "yes" in line for line in lines)
    if not __import__("torch").cuda.is_available():
        assert any("cuda" in line and "needs CUDA" in line for line in lines)


def test_doctor_without_a_gpu_does_not_promise_a_build_here(monkeypatch):
    """Before: 'not prebuilt: built just in time on first use', on a machine where no CUDA op can build or run."""
    from vitctl.trainer.ops import cuda
    from vitctl.workflows import doctor

    monkeypatch.setattr(cuda, "prebuilt", lambda: (None, "No module named 'vitctl_cuda_ops'"))
    monkeypatch.setattr(doctor.torch.cuda, "is_available", lambda: False)
    assert {state for _, state in doctor.op_builds()} == {
        "not prebuilt: built just in time on first use on a machine with a CUDA GPU (none here)"}
    monkeypatch.setattr(doctor.torch.cuda, "is_available", lambda: True)
    assert {state for _, state in doctor.op_builds()} == {"not prebuilt: built just in time on first use"}


def test_bench_compile_mode_needs_compile():
    result = vitctl("bench", "train", "--compile-mode", "reduce-overhead")
    assert result.exit_code == 2 and "--compile-mode reduce-overhead needs --compile" in result.output


@pytest.mark.parametrize("args, said", [
    (["--precision", "fp32", "--precisions", "bf16"], "--precision fp32 and --precisions: give one; --precisions "
                                                      "fp32,bf16 runs them all"),
    (["--timm-setting", "same"], "--timm-setting same needs --compare timm")])
def test_bench_refuses_options_it_would_ignore(args, said):
    """Before: --precision was dropped without a word, and --timm-setting did nothing."""
    result = vitctl("bench", "train", *args)
    assert result.exit_code == 2 and said in result.output


def test_bench_says_which_optimizer_each_row_ran(monkeypatch):
    from vitctl.trainer.bench import BenchResult
    from vitctl.workflows import bench

    ours = BenchResult("vitctl swin_b", "bf16-pure", 3000.0, 42.0, 10.0, 0.3, ops="mlp=cuda",
                       optimizer="one vitctl kernel")
    timm = [BenchResult("timm swin", f"bf16 {mode}", 2400.0, 53.0, 15.0, 0.2) for mode in ("default", "ro")]
    monkeypatch.setattr(bench, "bench_train", lambda *args: [ours, *timm])
    result = vitctl("bench", "train", "--compare", "timm")
    assert result.exit_code == 0
    assert "optimizer in rows 1: one vitctl kernel" in result.output
    assert "optimizer in rows 2, 3: torch fused AdamW" in result.output
    assert "ours / timm: 1.25x" in result.output


def test_data_help_gives_each_command_a_whole_sentence():
    output = vitctl("data", "--help").output
    listed = [line for line in output.splitlines() if line.startswith(tuple(f"  {c} " for c in COMMANDS))]
    assert len(listed) == len(COMMANDS)
    assert not [line for line in listed if line.endswith("...")]


def test_shard_and_synth_options_say_what_they_take():
    shard_help = vitctl("data", "shard", "--help").output
    assert all(unit in shard_help for unit in ("KB", "MB", "GB", "KiB", "MiB", "GiB"))
    synth_help = vitctl("data", "synth", "--help").output
    for option in ("--train-per-class", "--val-per-class", "--seed"):
        line = next(line for line in synth_help.splitlines() if line.strip().startswith(option))
        assert len(line.split()) > 3, line  # option, type, and words of help


def test_too_small_a_shard_size_or_image_count_is_a_usage_error_that_names_the_bound(tmp_path):
    """`shard --maxsize 5KB` and `synth --train-per-class 0` said `error: ... must be at least ...` with no fix."""
    for args, said in ((["data", "shard", tmp_path, "--out", tmp_path / "s", "--maxsize", "5KB"],
                        "Invalid value for '--maxsize': '5KB' is 5,000 bytes; give at least 10KB"),
                       (["data", "synth", tmp_path / "x", "--val-per-class", "0"],
                        "Invalid value for '--val-per-class': 0 is not in the range x>=1"),
                       (["data", "shard", tmp_path, "--out", tmp_path / "s", "--seed", "-1"],  # as synth's is
                        "Invalid value for '--seed': -1 is not in the range x>=0")):
        result = vitctl(*args)
        assert result.exit_code == 2 and said in result.stderr, result.stderr
    assert sorted(tmp_path.iterdir()) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])  # SIGTERM: was exit 143 without a word
def test_ctrl_c_or_sigterm_while_vitctl_loads_exits_130_with_one_line(tmp_path, signum):
    args = [str(Path(sys.executable).parent / "vitctl"), "train", "--config", "demo_vit", "--out", str(tmp_path / "r"),
            "--executor", "local", "--gpus", "0", "--dry-run"]
    proc = subprocess.Popen(args, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # Python is up; loading the train command (torch) takes seconds more
    os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err


def test_job_commands_and_the_help_load_no_torch(tmp_path, monkeypatch):
    """`status`, `jobs`, `logs`, `cancel`, `vitctl --help` and the help of the commands that run a job answer at
    once: torch's import took 5 s of each. plan's and bench's list the models from their registry."""
    monkeypatch.setenv("VITCTL_HOME", str(tmp_path / "home"))
    run = tmp_path / "run"
    (run / "checkpoints/step-00000002").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 2, "loss": 1.5, "images_per_s": 10.0, "time": 1}\n')
    registry.add_record(registry.JobRecord("999999999", "local", "vit_micro-run", str(run), str(run / "submitit"), 1,
                                           1, 0, 0.0))
    commands = [["status"], ["status", "--json"], ["jobs"], ["logs", "999999999"], ["cancel", "999999999"],
                ["--help"], ["train", "--help"], ["finetune", "--help"], ["rank", "--help"],
                ["config", "show", "--help"], ["config", "list"], ["export", "--help"], ["plan", "--help"],
                ["bench", "train", "--help"],
                ["doctor", "--help"]]
    code = (f"import sys\nfrom vitctl.cli.main import cli\nfor args in {commands}:\n"
            "    try:\n        cli(args)\n    except SystemExit:\n        pass\n"
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, timeout=60)
    assert done.stdout.splitlines()[-1] == "False", done.stdout + done.stderr
    assert "vit_micro-run" in done.stdout and '"step": 2' in done.stdout  # the job, read from its run folder
    assert "  cancel    Cancel a job: its ranks checkpoint, then stop." in done.stdout  # the help's list
    for option in ("--max-requeues", "--from-ckpt", "--trust-checkpoint", "Override any config value", "--ema",
                   "--profile-only", "--timm-setting", "--expect-image", "swin_micro"):
        assert option in done.stdout, option  # each command's own help (train, finetune, config show, export)


def test_each_command_has_the_summary_that_the_help_lists():
    """`vitctl --help` lists the commands from their table without loading them; each, loaded, says the same."""
    context = click.Context(cli)
    for name, command in commands.COMMANDS.items():
        assert cli.get_command(context, name).get_short_help_str() == command.summary, name


def test_bench_precision_is_a_choice():
    result = vitctl("bench", "train", "--precision", "fp64")
    assert result.exit_code == 2 and "'fp64' is not one of 'fp32', 'bf16', 'fp16', 'bf16-pure'" in result.output
    result = vitctl("bench", "train", "--precisions", "bf16,fp64")
    assert result.exit_code == 2 and "'fp64': not a precision; choose from fp32, bf16, fp16, bf16-pure" in result.output


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="says what it needs only where CUDA is missing")
def test_bench_without_cuda_says_where_to_run_it():
    result = vitctl("bench", "train", "--model", "vit_micro", "--steps", 5)
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "error: vitctl bench train times a training step on a CUDA GPU" in result.stderr
    assert "run it on a GPU node: `srun --gpus 1` before this same command (`srun --gpus 1 vitctl bench train ...`, " \
        "with the options given here)" in " ".join(result.stderr.split()), result.stderr  # was: without its options


def test_the_summary_of_a_run_resumed_without_its_ema_shows_both_evals(tmp_path, capsys):
    """A run that kept an EMA and was resumed without one: its last evals lack EMA top-1, and still print."""
    from vitctl.cli.train import print_summary

    records = [{"step": 1, "loss": 2.5, "images_per_s": 10.0},
               {"step": 1, "eval_top1": 11.0, "eval_top5": 51.0, "eval_ema_top1": 9.5},
               {"step": 2, "loss": 2.25, "images_per_s": 10.0},
               {"step": 2, "eval_top1": 12.0, "eval_top5": 52.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print_summary(tmp_path, 1000)
    out = capsys.readouterr().out
    assert "EMA top-1" in out and "9.50" in out and "12.00" in out and "52.00" in out
    print_summary(tmp_path, 5)  # before: top-5 shown as 100 for 3-5 classes, where every image is in its top 5
    out = capsys.readouterr().out
    assert "top-5" not in out and "52.00" not in out and "12.00" in out


def test_output_that_cannot_be_written_ends_in_one_line_not_a_traceback(prepared_shards):
    """Before: verify into a full disk (or a terminal closed while it ran) checked every shard, then printed a
    traceback from rich."""
    command = [str(Path(sys.executable).parent / "vitctl"), "data", "verify", str(prepared_shards)]
    with open("/dev/full", "w") as full:
        done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == ("error: the output could not be written (No space left on device); what "
                                            "the command did before is done")
    reader = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reader.stdout.close()  # a reader that left (`| head`): nothing to say, and no traceback
    said = reader.stderr.read()
    assert reader.wait(timeout=120) == 141 and "Traceback" not in said and "error" not in said, said  # was 1


def test_the_summary_of_a_long_run_shows_every_eval_and_says_it_shows_the_last_steps(tmp_path, capsys):
    """Before: the last 5 logged steps only, the evals before them left out without a word."""
    from vitctl.cli.train import print_summary

    records = [{"step": step, "loss": 3.0 - step / 100, "images_per_s": 10.0} for step in range(10, 110, 10)]
    records += [{"step": step, "eval_top1": top1, "eval_top5": 90.0} for step, top1 in ((20, 61.5), (50, 77.25))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print_summary(tmp_path, 1000)
    out = capsys.readouterr().out
    assert "61.50" in out and "77.25" in out and "the last 5 of 10 logged steps, and every eval" in out, out
    rows = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert rows == ["20", "50", "60", "70", "80", "90", "100"], rows


@pytest.mark.parametrize(("best_steps", "rows", "said"), [
    ((7,), ["7", *map(str, range(191, 201))], "the last 10 of 200 evals and the best one (step 7)"),
    ((7, 150), ["150", *map(str, range(191, 201))], "the last 10 of 200 evals and the best one (step 150)"),
    ((195,), list(map(str, range(191, 201))), "the last 10 of 200 evals;")])
def test_the_summary_of_a_run_of_many_evals_shows_the_last_ones_and_the_best(tmp_path, capsys, best_steps, rows,
                                                                              said):
    """Before: every eval, 200 rows after a resume of a finished 200-epoch run (one eval an epoch). Of tied bests the
    latest is shown; where the best is among the last 10, the caption does not speak of another row."""
    from vitctl.cli.train import print_summary

    records = [{"step": step, "loss": 1.0, "images_per_s": 10.0} for step in range(1, 201)]
    records += [{"step": step, "eval_top1": 99.0 if step in best_steps else 50.0 + step / 10} for step in range(1, 201)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print_summary(tmp_path, 1000)
    out = capsys.readouterr().out
    shown = [line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│")]
    assert shown == rows, shown
    assert f"the last 5 of 200 logged steps, and {said}" in " ".join(out.split()), out


@pytest.mark.parametrize("width", [200, 120, 100, 80])
def test_the_status_table_keeps_every_cell_and_note_whole_in_a_terminal(width):
    """Before, at 120 columns: `vit_micr…` and `step-000…` beside empty ETA and note columns; at 100, `COMPL…`; at
    80, the default terminal, `1…` for layout, elapsed, step and loss, and the note `…`."""
    from rich.console import Console

    from vitctl.cli.jobs import status_table
    from vitctl.workflows.status import JobStatus

    done = JobStatus("7288", "vit_micro-pretrain", "local", "COMPLETED", "1x1 CPU", "00:00:12", 96, 96, 1.1814,
                     [111.0, 767.0, 700.0, 720.0], None, "step-00000096", 0, "/runs/pretrain", "")
    console = Console(record=True, width=width, force_terminal=True)
    console.print(status_table([done], width))
    text = console.export_text()
    assert all(cell in text for cell in ("7288", "vit_micro-pretrain", "COMPLETED", "step-00000096")), text
    assert "ETA" not in text and "note" not in text and "restarts" not in text  # nothing in any row: left out
    note = ("waiting for nodes that are down, drained or reserved (ReqNodeNotAvail, UnavailableNodes:n1,n2); an "
            "administrator returns them")
    waiting = JobStatus("7407", "vit_micro-finetune", "local", "PENDING", "1x1 CPU", "", None, None, None, [], None,
                        None, 0, "/runs/finetune", note)
    console = Console(record=True, width=width, force_terminal=True)
    console.print(status_table([done, waiting], width))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= width and "…" not in text, text
    cells = ("vit_micro-pretrain", "vit_micro-finetune", "step-00000096", "1x1 CPU", "00:00:12", "96/96", "1.1814")
    assert all(cell in text for cell in cells), text
    assert note in " ".join(line.strip() for line in text[text.index("7407: "):].splitlines()), text  # whole, below
    assert (width < 120) == ("7288: checkpoint step-00000096" in text), text  # moved below only where narrow


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU here runs them")
@pytest.mark.parametrize("script", ["profile_step", "bench_fp8", "bench_ops", "fp8_parity"])
def test_the_gpu_benchmark_scripts_on_a_machine_without_one_say_so(script):
    """Before: `RuntimeError: Found no NVIDIA driver on your system` and a traceback (profile_step.py: the README)."""
    done = subprocess.run([sys.executable, f"bench/{script}.py"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"error: python bench/{script}.py measures on a CUDA GPU, and torch ")
