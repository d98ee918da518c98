import subprocess
import sys
from pathlib import Path

import pytest

from conftest import vitctl

COMMANDS = ["synth", "extract", "valprep", "shard", "index", "verify"]


def test_version_from_the_installed_console_script():
    out = subprocess.run([str(Path(sys.executable).parent / "vitctl"), "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "vitctl, version 0.1.0"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_data_command_has_help(command):
    result = vitctl("data", command, "--help")
    assert result.exit_code == 0 and "Usage: cli data " + command in result.output


def test_data_group_lists_every_command():
    output = vitctl("data", "--help").output
    assert all(f"  {c} " in output for c in COMMANDS)


def test_bad_synth_arguments_are_explained(tmp_path):
    result = vitctl("data", "synth", tmp_path, "--classes", 500)
    assert result.exit_code == 1 and "--classes must be between 1 and 36" in result.stderr
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


def test_bench_compile_mode_needs_compile():
    result = vitctl("bench", "train", "--compile-mode", "reduce-overhead")
    assert result.exit_code == 2 and "--compile-mode reduce-overhead needs --compile" in result.output


def test_bench_says_which_optimizer_each_row_ran(monkeypatch):
    from vitctl.cli import bench
    from vitctl.trainer.bench import BenchResult

    ours = BenchResult("vitctl swin_b", "bf16-pure", 3000.0, 42.0, 10.0, 0.3, ops="mlp=cuda",
                       optimizer="one vitctl kernel")
    timm = [BenchResult("timm swin", f"bf16 {mode}", 2400.0, 53.0, 15.0, 0.2) for mode in ("default", "ro")]
    monkeypatch.setattr(bench, "bench_train", lambda *args: [ours, *timm])
    result = vitctl("bench", "train", "--compare", "timm")
    assert result.exit_code == 0
    assert "optimizer in rows 1: one vitctl kernel" in result.output
    assert "optimizer in rows 2, 3: torch fused AdamW" in result.output
    assert "ours / timm: 1.25x" in result.output
