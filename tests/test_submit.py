import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CLASSES, ok, vitctl
from vitctl.trainer import checkpoint as ckpt
from vitctl.trainer.config import ConfigError
from vitctl.trainer.data.shards import read_table, split_shards
from vitctl.workflows import registry, status
from vitctl.workflows.process import start_time
from vitctl.workflows.submit import TracebackFilter, parse_time, rendezvous_port, srun_torch_env


@pytest.mark.parametrize(("text", "minutes"), [("30", 30), ("4:00:00", 240), ("1-12", 2160), ("1-00:00:00", 1440),
                                               ("2-03:30", 3090), ("90:30", 90), ("0:30", 1)])
def test_slurm_time_formats(text, minutes):
    assert parse_time(text) == minutes


@pytest.mark.parametrize("text", ["abc", "0", "1:2:3:4", "-5"])
def test_bad_times_are_refused(text):
    with pytest.raises(ConfigError, match="time"):
        parse_time(text)


# ---------------------------------------------------------------- jobs on this machine, and their records

QUICK = ["--config", "demo_vit", "--set", "data.source=synthetic", "--set", "data.train_samples=64", "--batch", 4,
         "--executor", "local", "--gpus", 0]


def test_rendezvous_ports_are_below_the_ephemeral_range():
    ports = [rendezvous_port(str(job)) for job in range(100_000, 100_300)]
    assert all(20000 <= port < 32768 for port in [*ports, rendezvous_port("4242_7")])
    assert len(set(ports)) == len(ports)  # consecutive jobs on one node do not collide


@pytest.mark.parametrize(("tasks_per_node", "node", "local"), [("4", 0, 4), ("2(x3)", 2, 2), ("2(x2),1", 2, 1),
                                                             ("3,1(x2)", 0, 3)])
def test_a_plain_sbatch_rank_s_local_world_size_is_its_own_node_s_task_count(tmp_path, monkeypatch, tasks_per_node,
                                                                           node, local):
    """From SLURM_TASKS_PER_NODE, which Slurm sets for every job: before, SLURM_NTASKS_PER_NODE, which only
    --ntasks-per-node sets (else 1: CPU ranks of one node then each took all its cores for their threads)."""
    (tmp_path / "scontrol").write_text("#!/bin/sh\necho node1 node2 node3\n")  # show hostnames node[1-3]
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env = {"SLURM_JOB_NODELIST": "node[1-3]", "SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0",
           "SLURM_JOB_ID": "42", "SLURM_TASKS_PER_NODE": tasks_per_node, "SLURM_NODEID": str(node)}
    torch_env = srun_torch_env(env)
    assert torch_env["LOCAL_WORLD_SIZE"] == str(local) and torch_env["MASTER_ADDR"] == "node1"
    assert torch_env["RANK"] == "5" and torch_env["WORLD_SIZE"] == "7"


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory) -> registry.JobRecord:
    """A real two-rank job of the local executor, ended."""
    out = tmp_path_factory.mktemp("finished") / "run"
    ok("train", *QUICK, "--tasks-per-node", 2, "--steps", 2, "--out", out)
    return registry.find_record(str(out))


@pytest.mark.slow
def test_an_error_in_a_rank_is_one_line_naming_its_log(finished_job, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(Path(finished_job.run_dir) / "checkpoints", run / "checkpoints")
    changed = vitctl("train", *QUICK, "--tasks-per-node", 2, "--steps", 4, "--out", run, "--resume",
                     "--set", "model.num_classes=7")  # seen in the checkpoint's meta.json before launch
    assert changed.exit_code == 1 and changed.stderr.startswith("error: ")
    assert re.search(r"was trained with model settings other than this run's: model.num_classes=\d+ \(now 7\)",
                     changed.stderr), changed.stderr
    assert not (run / "submitit").exists()
    shard = next(ckpt.list_checkpoints(run)[-1].glob("*.distcp"))  # its bytes are checked by the ranks
    shard.write_bytes(shard.read_bytes()[::-1])
    result = vitctl("train", *QUICK, "--tasks-per-node", 2, "--steps", 4, "--out", run, "--resume")
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(r"failed: rank \d raised ConfigError: checkpoint .* is damaged", errors[0])
    log = Path(re.search(r"\(traceback in (\S+)\)$", errors[0])[1])
    assert "Traceback (most recent call last)" in log.read_text()
    listed = json.loads(ok("status", registry.find_record(str(run)).job_id, "--json").output)[0]
    assert listed["state"] == "FAILED" and "raised ConfigError" in listed["note"] and str(log) in listed["note"]


@pytest.mark.slow
def test_images_whose_scans_are_damaged_are_named_however_dali_fails_on_them(shards_copy, tmp_path):
    """DALI's CPU decoder fails on some damaged scans with an error, and on others with a segfault that ends the rank.
    Before, the segfault read `no rank reported an error (killed, or out of memory?)`, with `run the same command
    again` as its fix."""
    table = read_table(shards_copy, split_shards(shards_copy, "train")[0])
    for path, offset in zip((table.paths[s] for s in table.shard), table.offset, strict=True):
        with open(path, "r+b") as shard:
            shard.seek(int(offset) + 200)
            shard.write(bytes(2000))
    result = vitctl("train", "--config", "demo_vit", "--data", shards_copy, "--executor", "local", "--gpus", 0,
                    "--steps", 2, "--set", f"model.num_classes={CLASSES}", "--set", "data.source=dali", "--out",
                    tmp_path / "run")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1, result.stderr
    assert "Fatal Python error" not in result.stderr and "Extension modules" not in result.stderr  # in the log only
    assert "leaked semaphore" not in result.stderr  # multiprocessing's word on a rank that ended abruptly
    crashed = re.search(r"rank 0 crashed \(Segmentation fault\) in \w+ \(\w+\.py:\d+\); DALI's decoder crashes on some "
                        r"damaged JPEGs: `(vitctl data verify \S+ --decode 100000000)` decodes every image", errors[0])
    raised = re.search(r"rank 0 raised DataError: \S+\.tar: the JPEG at offset \d+ does not decode .*; fix: "
                       r"`(vitctl data verify \S+)` names each damaged shard", errors[0])
    assert crashed or raised, errors[0]
    verified = vitctl(*shlex.split((crashed or raised)[1])[1:])
    assert verified.exit_code == 1 and "sha256 differs" in verified.output, verified.output


@pytest.mark.slow
@pytest.mark.parametrize("source", ["webdataset", "dali"])
def test_an_image_damaged_after_sharding_is_named_in_one_line_and_the_fix_named_repairs_it(shards_copy, tmp_path,
                                                                                           source):
    """A loader worker's error reaches the user as the worker's own error, naming the shard and the offset, not as the
    worker's traceback flattened; the fix it names (verify, then the command verify prints) lets the run train."""
    table = read_table(shards_copy, split_shards(shards_copy, "train")[0])
    for path, offset in zip((table.paths[s] for s in table.shard), table.offset, strict=True):
        with open(path, "r+b") as shard:  # every train image loses its JPEG header
            shard.seek(int(offset))
            shard.write(bytes(16))
    run = ["train", "--config", "demo_vit", "--data", shards_copy, "--executor", "local", "--gpus", 0, "--steps", 1,
           "--batch", 4, "--set", f"model.num_classes={CLASSES}", "--set", f"data.source={source}", "--set",
           "data.workers=1"]
    result = vitctl(*run, "--out", tmp_path / "run")
    assert result.exit_code == 1 and "Traceback" not in result.output + result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    # rank 0's log is echoed without the worker's error, its causes and the separators of their chain
    assert [line for line in result.stderr.splitlines() if not TracebackFilter.LOG_RECORD.match(line)] == errors
    found = re.search(r"failed: rank 0 raised DataError: (\S+\.tar): the JPEG at offset (\d+) does not decode \(not in "
                      r"any format Pillow reads\); fix: `(vitctl data verify \S+)` names each damaged shard", errors[0])
    assert len(errors) == 1 and found, errors
    assert int(found[2]) in table.offset[[p == found[1] for p in (table.paths[s] for s in table.shard)]]
    verified = vitctl(*shlex.split(found[3])[1:])
    assert verified.exit_code == 1, verified.output
    fixes = {line.strip() for line in verified.output.splitlines() if line.startswith("  vitctl data shard")}
    assert fixes, verified.output
    for fix in fixes:
        for command in fix.split(" && "):
            ok(*shlex.split(command)[1:])
    ok(*run, "--out", tmp_path / "again")


# A rank whose loader fails as DALI's does: the worker's error arrives without its frames (the chain's first cause,
# printed without a "Traceback" line), DALI raises again from it, and an error while handling that ends the rank
CHAINED_RANK = """
import logging, pickle, sys
from vitctl.workflows.submit import RankFailed, train_rank

logging.basicConfig(level=logging.INFO, format="%(asctime)s [rank 0] %(name)s: %(message)s")  # as the trainer's
log = logging.getLogger("vitctl.train")


def worker():
    try:
        raise ValueError("cannot identify image file")
    except ValueError as e:
        raise RuntimeError("x.tar: the JPEG at offset 1536 does not decode\\nfix: `vitctl data verify x`") from e


def job(should_stop):
    log.info("step=0 event=start")
    print("an ordinary line, not a log record", file=sys.stderr)
    print("note: one that looks like an exception line", file=sys.stderr)
    log.info("step=1 loss=6.9")
    print("submitit WARNING (2026-12-01 17:59:56,043) - Bypassing signal SIGCONT", file=sys.stderr)
    try:
        worker()
    except RuntimeError as e:
        arrived = pickle.loads(pickle.dumps(e))  # as from a worker process: without frames or cause
    try:
        raise Exception("\\n\\nException traceback received from worker thread:\\n\\n...") from arrived
    except Exception:
        raise LookupError("the batch of step 2")


class Running:
    is_set = staticmethod(lambda: False)


try:
    train_rank(job, Running())
except RankFailed as error:
    logging.getLogger("submitit").exception("Submitted job triggered an exception")  # as submitit does
    print(error)
"""


def test_a_chained_traceback_in_a_rank_s_log_is_hidden_whole_and_the_log_lines_kept():
    rank = subprocess.run([sys.executable, "-c", CHAINED_RANK], capture_output=True, text=True)
    log = rank.stderr.splitlines()
    assert "RuntimeError: x.tar: the JPEG at offset 1536 does not decode" in log  # a cause without "Traceback"
    assert "The above exception was the direct cause of the following exception:" in log
    assert "During handling of the above exception, another exception occurred:" in log
    hide = TracebackFilter()
    shown = [line for i, line in enumerate(log) for line in hide.shown([line], final=i == len(log) - 1)]  # read live
    assert [TracebackFilter.LOG_RECORD.sub("", line) for line in shown] == [
        "vitctl.train: step=0 event=start", "an ordinary line, not a log record",
        "note: one that looks like an exception line", "vitctl.train: step=1 loss=6.9"]  # not submitit's own line
    assert rank.stdout.splitlines()[-1] == "rank 0 raised LookupError: the batch of step 2"  # vitctl's one line


@pytest.mark.slow
def test_logs_merge_a_rank_s_stdout_and_stderr_in_time_and_name_the_ranks(finished_job):
    result = ok("logs", finished_job.job_id, "--rank", 1)
    shown = result.stdout.splitlines()
    assert result.stderr == f"note: job {finished_job.job_id} ended COMPLETED\n"  # was no word of how it ended
    out, err = status.log_paths(finished_job, 1)
    assert shown[0] == f"==> rank 1 of job {finished_job.job_id}: {out} and {err.name}, merged by time <=="
    assert sorted(shown[1:]) == sorted(out.read_text().splitlines() + err.read_text().splitlines())
    stamps = [m[0] for m in map(status.TIMESTAMP.search, shown[1:]) if m]
    assert stamps == sorted(stamps) and shown[-1].endswith("Exiting after successful completion")
    # submitit's lines once, from its stdout (before, a second time through the trainer's log, in stderr)
    assert [line for line in shown if "Exiting after successful completion" in line] == [shown[-1]]
    result = vitctl("logs", finished_job.job_id, "--rank", 9)
    assert result.exit_code == 1
    assert f"error: job {finished_job.job_id} has no rank 9: its ranks are 0-1 (1 node x 2 tasks)" in result.stderr


@pytest.mark.slow
def test_cancel_of_an_ended_job_says_so(finished_job):
    said = ok("cancel", finished_job.job_id).output
    assert f"job {finished_job.job_id} (vit_micro-run) has already ended (COMPLETED); nothing to cancel" in said


def _local_record(run_dir: Path, pid: int, started: int | None) -> registry.JobRecord:
    record = registry.JobRecord(str(pid), "local", "vit_micro-run", str(run_dir), str(run_dir / "submitit"), 1, 1, 0,
                                time.time(), started=started)
    registry.add_record(record)
    return record


def test_cancel_never_signals_a_process_that_took_over_the_pid(tmp_path):
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "run/submitit").mkdir(parents=True)
        _local_record(tmp_path / "run", stranger.pid, start_time(stranger.pid) - 1)  # the job's process started earlier
        result = ok("cancel", stranger.pid)
        assert f"job {stranger.pid} (vit_micro-run) has already ended (FAILED: " in result.output
        assert stranger.poll() is None  # not killed
    finally:
        stranger.kill()
        stranger.wait()


def test_status_reads_past_a_half_written_metrics_line(tmp_path):
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 2, "loss": 2.5, "images_per_s": 9.0, "step_time_s": 0.1, '
                                       '"total_steps": 8}\n{"step": 4, "loss": 2.')  # being appended right now
    record = _local_record(run, 1, None)
    listed = json.loads(ok("status", record.job_id, "--json").output)
    assert (listed[-1]["step"], listed[-1]["loss"]) == (2, 2.5)


@pytest.mark.slow
def test_status_watch_into_a_pipe_prints_a_snapshot_per_interval_until_the_end(tmp_path):
    job = subprocess.Popen(["sleep", "5"])  # stands for the job's controller: running, then gone
    (tmp_path / "run/submitit").mkdir(parents=True)
    record = _local_record(tmp_path / "run", job.pid, start_time(job.pid))
    watched = subprocess.run([Path(sys.executable).parent / "vitctl", "status", record.job_id, "--watch"],
                             capture_output=True, text=True, timeout=60, env=os.environ)
    job.wait()
    snapshots = [line.split("\t")[2] for line in watched.stdout.splitlines() if line.startswith(record.job_id)]
    assert watched.returncode == 0 and len(snapshots) >= 2, watched.stdout
    assert snapshots[0] == "RUNNING" and snapshots[-1] == "FAILED" and set(snapshots) == {"RUNNING", "FAILED"}


def test_an_unanswering_sinfo_is_a_clear_error(tmp_path, monkeypatch):
    for command, script in [("sinfo", "sleep 10"), ("sbatch", "exit 1")]:
        (tmp_path / command).write_text(f"#!/bin/sh\n{script}\n")
        (tmp_path / command).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(status, "SLURM_TIMEOUT_S", 1)
    result = vitctl("train", "--config", "demo_vit", "--set", "data.source=synthetic", "--executor", "slurm",
                    "--gpus", 0, "--out", tmp_path / "run")
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    assert "error: sinfo did not answer within 1 s: slurmctld is down or overloaded" in result.stderr


def fake_cluster(folder: Path, node_cpus: int) -> None:
    """sinfo and sbatch on PATH for a partition `gpu` of two idle nodes with 8 GPUs and `node_cpus` CPUs each."""
    folder.mkdir()
    partition = f"gpu*|2|{node_cpus}|gpu:h200:8|infinite"
    (folder / "sinfo").write_text(f'#!/bin/sh\ncase "$*" in *%P*) echo "{partition}";; *) echo "idle|2|n[1-2]|up";; '
                                  "esac\n")
    (folder / "sbatch").write_text("#!/bin/sh\nexit 1\n")
    for tool in ("sinfo", "sbatch"):
        (folder / tool).chmod(0o755)


def cpus_per_task(*args) -> tuple[int, str]:
    result = vitctl("train", "--config", "swin_b_pretrain", "--set", "data.source=synthetic", "--executor", "slurm",
                    "--nodes", 2, "--gpus", 8, "--dry-run", *args)
    assert result.exit_code == 0, result.output + result.stderr
    return int(re.search(r"^#SBATCH --cpus-per-task=(\d+)$", result.output, re.MULTILINE)[1]), result.stderr


def test_a_rank_gets_a_share_of_its_node_s_cpus_for_its_loader_unless_told(tmp_path, monkeypatch):
    # Slurm's default is one CPU a task: the preset's 8 loader workers (and DALI's threads) would share it
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no cluster: its loader workers and the rank
    assert cpus_per_task("--out", tmp_path / "a") == (9, "")
    assert cpus_per_task("--out", tmp_path / "b", "--set", "data.workers=3") == (4, "")
    fake_cluster(tmp_path / "big", node_cpus=96)
    monkeypatch.setenv("PATH", f"{tmp_path / 'big'}:{Path(sys.executable).parent}")
    assert cpus_per_task("--out", tmp_path / "c") == (9, "")
    assert cpus_per_task("--out", tmp_path / "d", "--cpus-per-gpu", 10) == (10, "")
    fake_cluster(tmp_path / "small", node_cpus=32)
    monkeypatch.setenv("PATH", f"{tmp_path / 'small'}:{Path(sys.executable).parent}")
    cpus, warning = cpus_per_task("--out", tmp_path / "e")  # as many as 8 tasks on 32 CPUs can each have
    assert cpus == 4 and warning.strip() == (
        "warning: 4 CPUs a task (a node's 32 over its 8 tasks): each rank's 8 loader workers and the rank itself would "
        "share 4 CPUs, and loading may hold the step back; a node's 32 CPUs give each of its 8 tasks at most 4: "
        "--set data.workers=3, or fewer --tasks-per-node")  # before: no word
    assert cpus_per_task("--out", tmp_path / "f", "--set", "data.workers=3") == (4, "")  # the fix
    cpus, warning = cpus_per_task("--out", tmp_path / "g", "--cpus-per-gpu", 2)
    assert (cpus, warning.split("; ", 1)[1].strip()) == (2, "a node's 32 CPUs give each of its 8 tasks at most 4: "
                                                            "--cpus-per-gpu 4 --set data.workers=3 or --set "
                                                            "data.workers=1, or fewer --tasks-per-node")
    for fix in (["--cpus-per-gpu", 4, "--set", "data.workers=3"], ["--cpus-per-gpu", 2, "--set", "data.workers=1"]):
        assert cpus_per_task("--out", tmp_path / "h", *fix)[1] == ""
    fake_cluster(tmp_path / "tiny", node_cpus=4)  # one task a node already has all of its CPUs: no fewer tasks
    monkeypatch.setenv("PATH", f"{tmp_path / 'tiny'}:{Path(sys.executable).parent}")
    cpus, warning = cpus_per_task("--out", tmp_path / "i", "--gpus", 1)
    assert cpus == 4 and warning.strip().endswith("a node's 4 CPUs are all its one task has: --set data.workers=3"), \
        warning


def test_a_local_dry_run_prints_the_script_with_the_cpus_a_slurm_dry_run_asks_for(tmp_path, monkeypatch):
    """Its script says to submit it as it is, and asked for one CPU a task: the 8 loader workers would share it."""
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no cluster

    def script(executor: str, *args) -> tuple[str, str]:
        result = vitctl("train", "--config", "swin_b_pretrain", "--set", "data.source=synthetic", "--executor",
                        executor, "--gpus", 0, "--tasks-per-node", 2, "--dry-run", "--out", tmp_path / "run", *args)
        assert result.exit_code == 0, result.output + result.stderr
        return re.findall(r"^#SBATCH --cpus-per-task=\d+$", result.output, re.MULTILINE), result.stderr

    assert script("local") == script("slurm") == (["#SBATCH --cpus-per-task=9"], "")
    cpus, warning = script("local", "--cpus-per-gpu", 4)
    assert cpus == ["#SBATCH --cpus-per-task=4"] and warning.startswith(
        "warning: --cpus-per-gpu 4: each rank's 8 loader workers")


def test_too_few_cpus_for_the_loader_are_a_warning_whose_fix_works(tmp_path, monkeypatch):
    fake_cluster(tmp_path / "bin", node_cpus=96)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{Path(sys.executable).parent}")
    cpus, warning = cpus_per_task("--out", tmp_path / "a", "--cpus-per-gpu", 4)
    assert cpus == 4 and warning.startswith("warning: --cpus-per-gpu 4: each rank's 8 loader workers and the rank "
                                            "itself would share 4 CPUs")
    fixes = re.findall(r"give (--cpus-per-gpu \d+) or more .*, or (--set data.workers=\d+)$", warning.strip())[0]
    assert fixes == ("--cpus-per-gpu 9", "--set data.workers=3")
    assert cpus_per_task("--out", tmp_path / "b", *fixes[0].split()) == (9, "")
    assert cpus_per_task("--out", tmp_path / "c", "--cpus-per-gpu", 4, *fixes[1].split()) == (4, "")


def test_a_dry_run_while_the_controller_does_not_answer_prints_the_script_with_a_warning(tmp_path, monkeypatch):
    """Before: `sinfo failed` refused the dry run, which needs no cluster."""
    fake_cluster(tmp_path / "bin", node_cpus=96)
    (tmp_path / "bin/sinfo").write_text("#!/bin/sh\necho 'slurm_load_partitions: Unable to contact slurm controller "
                                        "(connect failure)' >&2\nexit 1\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{Path(sys.executable).parent}")
    cpus, warning = cpus_per_task("--out", tmp_path / "a")
    assert cpus == 9 and warning.startswith("warning: the request was not checked against the cluster: sinfo failed: "
                                            "slurm_load_partitions: Unable to contact slurm controller")
    submitted = vitctl("train", "--config", "swin_b_pretrain", "--set", "data.source=synthetic", "--executor",
                       "slurm", "--gpus", 8, "--out", tmp_path / "b")
    assert submitted.exit_code == 1 and "error: sinfo failed" in submitted.stderr, submitted.stderr


def test_dry_run_prints_a_complete_script_byte_for_byte(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no sbatch: nothing to check it against
    monkeypatch.setenv("VITCTL_HOME", str(tmp_path / "home"))
    image = "nvcr.io#nvidia/pytorch:25.10-py3"
    result = ok("train", "--set", "data.source=synthetic", "--out", tmp_path / "run", "--config", "swin_b_pretrain",
                "--executor", "slurm", "--nodes", 2, "--gpus", 8, "--cpus-per-gpu", 12, "--time", "1-00:00:00",
                "--partition", "gpu", "--account", "vision", "--container-image", image,
                "--container-mounts", "/data:/data,/scratch/a/long/path/to/make/the/line/wide:/scratch", "--dry-run")
    script = result.output
    lines = script.splitlines()
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=12", "#SBATCH --time=1440", "#SBATCH --partition=gpu",
                 "#SBATCH --account=vision", "#SBATCH --signal=USR2@90", "#SBATCH --requeue"]:
        assert line in lines, line
    srun = next(line for line in lines if line.startswith("srun "))
    run = tmp_path / "run"  # mounted too: the ranks write it at the same path inside the image
    assert srun == (f"srun '--container-image={image}' --container-mounts=/data:/data,/scratch/a/long/path/to/make/the"
                    f'/line/wide:/scratch,{run}:{run} python3 -m vitctl.cli rank --max-requeues 3 --config "$config"')
    assert "wckey" not in script and "submitit" not in script and script.endswith("VITCTL_CONFIG\n" + srun + "\n")
    assert registry.load_records() == [] and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("flag", "setting", "says", "same"), [
    (["--steps", 2], "train.max_steps=4", "train.max_steps is set twice, to 2 by --steps and to 4 by --set "
                                          "train.max_steps=4; give it once", "2"),
    (["--batch", 8], "data.batch_size=4", "data.batch_size is set twice, to 8 by --batch and to 4", "8"),
    (["--model", "vit_micro"], "model.name=vit_mini", "model.name is set twice, to 'vit_micro' by --model",
     "vit_micro"),
    (["--no-compile"], "train.compile=true", "train.compile is set twice, to false by --compile/--no-compile and to "
                                             "true by --set train.compile=true", "false"),  # before: False, True
])
def test_a_flag_and_a_set_of_the_same_key_that_disagree_are_refused(tmp_path, monkeypatch, flag, setting, says,
                                                                    same):
    """Before: the --set won and the flag was ignored without a word (--steps 2 trained 4 steps)."""
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no sbatch: the dry run is not checked
    args = ["train", "--config", "demo_vit", "--set", "data.source=synthetic", "--executor", "slurm", "--gpus", 1,
            "--out", tmp_path / "run", "--dry-run", *flag]
    result = vitctl(*args, "--set", setting)
    assert result.exit_code == 1 and f"error: {says}" in result.stderr, result.stderr
    ok(*args, "--set", f"{setting.split('=')[0]}={same}")  # the same value twice agrees
    ok(*args)


def test_a_plain_sbatch_job_counts_only_its_time_limits_against_max_requeues(tmp_path, monkeypatch):
    """As submitit counts for `vitctl train`'s jobs: before, Slurm's SLURM_RESTART_COUNT counted pre-emptions and
    `scontrol requeue` too, so one flag meant two things."""
    import signal

    from vitctl.workflows import submit
    from vitctl.workflows.errors import TimeLimitReached
    from vitctl.workflows.job import TrainJob

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    (tmp_path / "bin/scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "5")  # five pre-emptions before

    def stopped_by_the_time_limit(job, stop):
        stop.received = signal.SIGUSR2
        return {"stopped": True, "step": 5}

    monkeypatch.setattr(submit, "train_rank", stopped_by_the_time_limit)
    job = TrainJob({"train": {"out_dir": str(tmp_path / "run")}})
    (tmp_path / "run").mkdir()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        submit.run_rank(job, 1)
        assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n"
        with pytest.raises(TimeLimitReached, match=r"--max-requeues 1, requeued on 1 time limit before"):
            submit.run_rank(job, 1)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert (tmp_path / "scontrol.log").read_text() == "requeue 77\n"
