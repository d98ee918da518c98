"""What a user plausibly gets wrong when launching a job, here or on Slurm: a --time shorter than the time-limit
signal, more nodes or GPUs than the local executor has, --tasks-per-node beside --gpus, a partition whose nodes are
all drained or down, Slurm's daemons unreachable, a rendezvous port taken on the first node. Each ends in one message
(no traceback), and the fix it names is followed. The Slurm cases run against the dev cluster (slurm/dev-cluster/up)
and leave it as they found it."""

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_slurm import wait_for

from conftest import ok, vitctl
from vitctl.workflows import registry, status

QUICK = ["--config", "demo_vit", "--set", "data.source=synthetic", "--set", "data.train_samples=64", "--batch", 4,
         "--set", "data.workers=0", "--steps", 2]
LOCAL = [*QUICK, "--executor", "local", "--gpus", 0]
SLURM = [*QUICK, "--executor", "slurm", "--gpus", 0]


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("VITCTL_HOME", str(tmp_path / "home"))


@pytest.fixture
def cluster():
    if subprocess.run(["scontrol", "ping"], capture_output=True).returncode:
        pytest.fail("the dev cluster is not up: run slurm/dev-cluster/up (make test does)")


def no_sbatch(monkeypatch) -> None:
    """Only vitctl's own folder on PATH: a dry run is not checked against a cluster."""
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))


def refused(*args: object) -> str:
    result = vitctl("train", *args)
    assert result.exit_code == 1 and "Traceback" not in result.stderr and result.stdout == "", result.output
    return result.stderr


# ---------------------------------------------------------------- the time limit


@pytest.mark.slurm
def test_a_time_limit_within_slurms_warning_is_refused_before_submission(tmp_path, cluster):
    """Slurm signals USR2 90 s before the limit (up to a minute early): with --time 1 or 2 every attempt was told to
    checkpoint and requeue as it started, burning the requeues."""
    out = tmp_path / "run"
    for limit, minutes in (("1", 1), ("2", 2), ("0:30", 1)):
        for dry_run in ((), ("--dry-run",)):
            assert refused(*SLURM, "--time", limit, "--out", out, *dry_run) == (
                f"error: --time {limit} ({minutes} min) leaves no time to train: Slurm signals the job 90 s before its "
                "time limit (and up to a minute earlier still) for every rank to checkpoint and requeue, so each "
                "attempt would stop as soon as it starts; pass --time 3 or more\n")
    assert registry.load_records() == [] and not out.exists()
    script = ok("train", *SLURM, "--time", 3, "--out", out, "--dry-run").output  # the fix, followed
    assert "#SBATCH --time=3\n" in script and "#SBATCH --signal=USR2@90\n" in script


@pytest.mark.slurm
def test_a_container_image_on_a_cluster_without_pyxis_is_refused_before_submission(tmp_path, cluster):
    """Before: submitted; every rank failed at srun's usage error, and status guessed 'killed, or out of memory?'. A
    dry run warns instead: its script may be meant for another cluster (it was refused too)."""
    image = "nvcr.io#nvidia/pytorch:25.10-py3"
    problem = (f"--container-image {image} runs each rank in the image through pyxis, an srun plugin this cluster "
               "lacks (`srun --help` lists no --container-image): drop --container-image to run in this environment, "
               "or use a cluster with pyxis and enroot")
    said = refused(*SLURM, "--time", 10, "--out", tmp_path / "run", "--container-image", image)
    assert said == f"error: {problem}\n", said
    assert registry.load_records() == [] and not (tmp_path / "run").exists()
    script = ok("train", *SLURM, "--time", 10, "--out", tmp_path / "run", "--container-image", image, "--dry-run")
    assert f"warning: {problem}; the script's ranks would fail on this cluster" in " ".join(script.stderr.split())
    assert f"--container-image={image}" in script.stdout and registry.load_records() == []
    ok("train", *SLURM, "--time", 10, "--out", tmp_path / "run", "--dry-run")  # the fix, followed


@pytest.mark.parametrize("executor", [LOCAL, SLURM])
def test_container_mounts_without_an_image_are_refused(tmp_path, executor):
    """Before: dropped without a word, the script's srun line without them."""
    said = refused(*executor, "--time", 10, "--out", tmp_path / "run", "--container-mounts", "/data:/data",
                   "--dry-run")
    assert said == ("error: --container-mounts /data:/data mounts folders into the image of --container-image, and "
                    "none is given: pass --container-image IMAGE, or drop --container-mounts (without an image the "
                    "ranks see this machine's folders as they are)\n"), said


def test_a_local_time_limit_within_the_warning_is_refused(tmp_path):
    """The local executor never signalled a limit of 90 s or less: at the limit it killed the ranks, no checkpoint
    kept, and `vitctl train` blamed 'killed, or out of memory?'."""
    out = tmp_path / "run"
    assert refused(*LOCAL, "--time", 1, "--out", out) == (
        "error: --time 1 (1 min) leaves no time to train: the local executor signals the ranks 90 s before the time "
        "limit to checkpoint, so a shorter limit kills them with no signal and no checkpoint; pass --time 2 or more\n")
    assert registry.load_records() == [] and not out.exists()
    ok("train", *LOCAL, "--time", 2, "--out", out)  # the fix, followed
    assert (out / "checkpoints/step-00000002").is_dir()


# ---------------------------------------------------------------- what the local executor cannot run


def test_several_nodes_with_the_local_executor_are_refused(tmp_path):
    """Before: accepted, one rank ran, and the job was recorded as 2 nodes (`vitctl logs --rank 1` found no log)."""
    out = tmp_path / "run"
    assert refused(*LOCAL, "--nodes", 2, "--out", out) == (
        "error: --nodes 2 with --executor local: the local executor runs every rank on this one machine; drop --nodes "
        "(or pass --nodes 1), or submit to Slurm with --executor slurm\n")
    assert registry.load_records() == [] and not out.exists()
    assert "srun" in ok("train", *LOCAL, "--nodes", 1, "--out", out, "--dry-run").output  # the fix, followed


def test_slurm_options_of_a_local_run_are_said_to_be_left_unused(tmp_path):
    """Before: `--partition bogus --account x` with --executor local trained without a word."""
    result = ok("train", *LOCAL, "--partition", "bogus", "--account", "x", "--out", tmp_path / "run")
    assert ("warning: --partition bogus, --account x only tell Slurm how to run the job: --executor local runs it "
            "here without them (pass --executor slurm to submit it, or --dry-run for its sbatch script)\n"
            ) in result.stderr, result.stderr
    assert "only tell Slurm" not in ok("train", *LOCAL, "--out", tmp_path / "again").stderr


def test_more_gpus_than_this_machine_has_names_the_ways_on(tmp_path):
    if torch.cuda.device_count():
        pytest.skip("this machine has a GPU")
    assert refused(*QUICK, "--executor", "local", "--gpus", 1, "--out", tmp_path / "run") == (
        "error: --gpus 1 but this machine has 0 CUDA devices; use --gpus 0 for as many CPU ranks, or run on GPU nodes "
        "with --executor slurm\n")
    # before: --gpus 0 alone, which ran one rank where a plan for two was given (a CPU plan's printed command)
    assert refused(*QUICK, "--executor", "local", "--gpus", 2, "--out", tmp_path / "run") == (
        "error: --gpus 2 but this machine has 0 CUDA devices; use --gpus 0 --tasks-per-node 2 for as many CPU ranks, "
        "or run on GPU nodes with --executor slurm\n")
    ok("train", *QUICK, "--executor", "local", "--gpus", 0, "--tasks-per-node", 2, "--out", tmp_path / "run")


def test_tasks_per_node_beside_gpus_is_refused_not_ignored(tmp_path, monkeypatch):
    """A GPU job runs one task per GPU: --tasks-per-node 4 with --gpus 2 silently ran 2 tasks."""
    no_sbatch(monkeypatch)
    out = tmp_path / "run"
    assert refused(*QUICK, "--executor", "slurm", "--gpus", 2, "--tasks-per-node", 4, "--out", out, "--dry-run") == (
        "error: --tasks-per-node 4 with --gpus 2: vitctl runs one task per GPU, 2 per node; drop --tasks-per-node, or "
        "pass --gpus 0 --tasks-per-node 4 for CPU ranks\n")
    for fixed in (["--gpus", 2], ["--gpus", 0, "--tasks-per-node", 4]):  # both fixes, followed
        script = ok("train", *QUICK, "--executor", "slurm", *fixed, "--out", out, "--dry-run").output
        assert f"#SBATCH --ntasks-per-node={fixed[1] or 4}\n" in script
    assert ok("train", *QUICK, "--executor", "slurm", "--gpus", 2, "--tasks-per-node", 2, "--out", out,
              "--dry-run").output  # the same count is no contradiction


# ---------------------------------------------------------------- Slurm: a partition that cannot start the job


def _node_state(node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], capture_output=True, text=True,
                          check=True).stdout.split()[0]


@pytest.fixture
def drained_partition(cluster):
    """A partition of its own holding n2 alone, with n2 drained: the job waits; the other partition keeps n1."""
    deadline = time.monotonic() + 120
    while _node_state("n2").rstrip("*") != "idle":  # another job on it: draining it would not leave it drained
        assert time.monotonic() < deadline, f"n2 stayed {_node_state('n2')}"
        time.sleep(1)
    name = f"vitctl-drained-{os.getpid()}"
    subprocess.run(["scontrol", "create", f"PartitionName={name}", "Nodes=n2", "MaxTime=INFINITE", "State=UP"],
                   check=True)
    subprocess.run(["scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=vitctl test"], check=True)
    try:
        yield name
    finally:
        subprocess.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], capture_output=True)
        subprocess.run(["scancel", "--partition", name], capture_output=True)
        deadline = time.monotonic() + 30
        while subprocess.run(["scontrol", "delete", f"PartitionName={name}"], capture_output=True).returncode:
            assert time.monotonic() < deadline, f"partition {name} could not be deleted"
            time.sleep(0.5)


@pytest.mark.slurm
def test_a_partition_whose_nodes_are_drained_is_named_at_submission(tmp_path, drained_partition):
    """Before: accepted without a word, and the job sat pending. It is a warning, not a refusal: drained nodes come
    back, and a job queued meanwhile then starts."""
    name, out = drained_partition, tmp_path / "run"
    warning = (f"warning: partition {name} has 0 nodes that can start a job now and the job needs 1 (drained: n2): it "
               f"waits in the queue until they return; `sinfo -R -p {name}` shows why they are out, an administrator "
               f"returns them with `scontrol update NodeName=n2 State=RESUME`; or cancel the job and submit to "
               "another --partition\n")
    submitted = ok("train", *SLURM, "--time", 10, "--partition", name, "--out", out)
    assert submitted.stderr == warning
    job = registry.load_records()[-1].job_id
    assert wait_for(job, {"PENDING"}) == "PENDING"
    subprocess.run(["scontrol", "update", "NodeName=n2", "State=RESUME"], check=True)  # the fix it names
    assert wait_for(job, status.TERMINAL) == "COMPLETED"
    assert ok("train", *SLURM, "--time", 10, "--partition", name, "--out", tmp_path / "again", "--dry-run").stderr == ""
    subprocess.run(["scontrol", "update", f"PartitionName={name}", "State=DOWN"], check=True)
    assert ok("train", *SLURM, "--time", 10, "--partition", name, "--out", tmp_path / "again", "--dry-run").stderr == (
        f"warning: partition {name} is down, not up: the job waits in the queue until an administrator sets it up "
        f"(`scontrol update PartitionName={name} State=UP`); `sinfo -p {name}` shows it; or cancel the job and submit "
        "to another --partition\n")


# ---------------------------------------------------------------- Slurm unreachable


@pytest.mark.slurm
def test_status_and_cancel_say_slurm_is_unreachable_not_that_the_job_is_unknown(tmp_path, monkeypatch, cluster):
    """Both daemons unreachable (a copy of the cluster's slurm.conf pointing at ports nothing listens on): status said
    'neither squeue nor sacct knows it', and cancel 'Slurm knows no job'."""
    conf = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).read_text().splitlines()
    dead = [line for line in conf if not line.startswith(("SlurmctldPort=", "AccountingStoragePort="))]
    (tmp_path / "slurm.conf").write_text("\n".join([*dead, "SlurmctldPort=9", "AccountingStoragePort=9",
                                                    "MessageTimeout=1", "TCPTimeout=1"]) + "\n")
    (tmp_path / "old/submitit").mkdir(parents=True)
    registry.add_record(registry.JobRecord("999999", "slurm", "vit_micro-old", str(tmp_path / "old"),
                                           str(tmp_path / "old/submitit"), 1, 1, 0, time.time()))
    with monkeypatch.context() as patch:
        patch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
        listed = json.loads(ok("status", "999999", "--json").output)[0]
        assert listed["state"] == "UNKNOWN"
        assert listed["note"].startswith("Slurm is unreachable: sacct: error: Problem talking to the database: "
                                         "Connection refused; squeue: slurm_load_jobs error: Unable to contact slurm "
                                         "controller (connect failure); check `scontrol ping`, then try again")
        cancelled = vitctl("cancel", "999999")
        assert cancelled.exit_code == 1 and cancelled.stderr == f"error: cannot cancel job 999999: {listed['note']}\n"
    accounting = [line for line in conf if not line.startswith("AccountingStoragePort=")]
    (tmp_path / "slurm.conf").write_text("\n".join([*accounting, "AccountingStoragePort=9"]) + "\n")
    with monkeypatch.context() as patch:  # slurmdbd alone: `scontrol ping`, which the note named, says UP
        patch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
        listed = json.loads(ok("status", "999999", "--json").output)[0]
        assert listed["note"] == ("Slurm's accounting (slurmdbd), where sacct reads the states of ended jobs, does not "
                                  "answer: sacct: error: Problem talking to the database: Connection refused; check "
                                  "that slurmdbd runs (`scontrol show config | grep AccountingStorageHost` names its "
                                  "host), then try again"), listed["note"]
        (tmp_path / "old/submitit/999999_0_result.pkl").write_bytes(pickle.dumps(("success", {"step": 8})))
        ended = json.loads(ok("status", "999999", "--json").output)[0]  # its rank 0 saved how it ended
        assert (ended["state"], ended["note"]) == ("COMPLETED", f"as rank 0's result says; {listed['note']}")
        (tmp_path / "old/submitit/999999_0_result.pkl").unlink()
    listed = json.loads(ok("status", "999999", "--json").output)[0]  # the fix: once Slurm answers, it says
    assert (listed["state"], listed["note"].split(";")[0]) == ("UNKNOWN", "neither squeue nor sacct knows it")


# ---------------------------------------------------------------- Slurm: a rank that cannot start


@pytest.mark.slurm
def test_a_taken_rendezvous_port_fails_the_job_at_once_and_says_what_to_do(tmp_path, monkeypatch, cluster):
    """Rank 0 could not listen on the job's rendezvous port; before, the job stayed RUNNING, rank 1 waiting for it
    for torch.distributed's 30 minutes, and the error named no way on."""
    (tmp_path / "bin").mkdir()  # an sbatch that holds the job: its id, hence its port, is known before it starts
    (tmp_path / "bin/sbatch").write_text(f'#!/bin/sh\nexec {shutil.which("sbatch")} --hold "$@"\n')
    (tmp_path / "bin/sbatch").chmod(0o755)
    out, two = tmp_path / "run", [*SLURM, "--tasks-per-node", 2, "--time", 10]
    with monkeypatch.context() as patch:
        patch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
        ok("train", *two, "--out", out)
    record = registry.load_records()[-1]
    port = 20000 + int(record.job_id) % 12768  # submit.rendezvous_port
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", port))
        taken.listen()
        subprocess.run(["scontrol", "release", record.job_id], check=True)
        assert wait_for(record.job_id, status.TERMINAL, timeout=60) == "FAILED"
    note = json.loads(ok("status", record.job_id, "--json").output)[0]["note"]
    assert f"name: EADDRINUSE, message: address already in use; port {port}, where rank 0 waits for the other ranks, " \
           "is taken by another process on n1: run the same command again, and the new job gets another port (it " \
           f"follows from the job id) (traceback in {record.folder}/{record.job_id}_0_log.err)" in note, note
    ok("train", *two, "--out", out)  # the fix, followed
    assert wait_for(registry.load_records()[-1].job_id, status.TERMINAL) == "COMPLETED"


def test_a_percent_sign_in_out_is_refused_before_submitit_misreads_it(tmp_path):
    """Before: `--out runs/5%aug` ended in submitit's traceback ('%a ... not a job array'), leaving a record stuck
    as submitting; `pct%jx` trained into a folder named after the job id and reported the job as failed."""
    for name in ("5%aug", "pct%jx"):
        result = vitctl("train", *LOCAL, "--out", tmp_path / name)
        assert result.exit_code == 1 and result.stderr.strip() == (
            f"error: run folder {tmp_path / name} (--out) holds '%', which submitit reads in its log paths as a "
            "placeholder (%j: the job id); choose an --out without '%'"), result.stderr
    assert not list(tmp_path.glob("*%*")) and registry.load_records() == []
    ok("train", *LOCAL, "--out", tmp_path / "5aug")


def test_a_name_longer_than_the_file_system_takes_is_one_line_not_a_traceback(tmp_path):
    long = "a" * 300
    for args in (["train", *LOCAL, "--out", tmp_path / long], ["config", "show", f"{long}.yaml"]):
        done = subprocess.run([str(Path(sys.executable).parent / "vitctl"), *map(str, args)], capture_output=True,
                              text=True, env=os.environ, timeout=120)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.startswith("error: a name in ") and done.stderr.rstrip().endswith(
            "is longer than the file system allows (255 bytes a name): shorten it"), done.stderr


def test_a_finetuning_preset_without_weights_is_refused_and_both_ways_out_work(tmp_path):
    """Before: `vitctl train --config swin_l_22k_to_1k_224` trained Swin-L from random weights at lr 2e-5."""
    tiny = ["--set", "data.source=synthetic", "--set", "data.train_samples=8", "--batch", 2, "--steps", 1, "--set",
            "model.img_size=32", "--set", "model.window_size=1", "--set", "model.num_classes=3", "--no-compile",
            "--precision", "fp32", "--set", "data.workers=0", "--executor", "local", "--gpus", 0, "--dry-run"]
    result = vitctl("train", "--config", "swin_l_22k_to_1k_224", *tiny, "--out", tmp_path / "a")
    assert result.exit_code == 1 and result.stderr.startswith(
        "error: preset swin_l_22k_to_1k_224 finetunes pretrained weights (30 epochs at lr 2e-05)"), result.stderr
    (tmp_path / "mine.yaml").write_text(ok("config", "show", "swin_l_22k_to_1k_224").output)
    ok("train", "--config", tmp_path / "mine.yaml", *tiny, "--out", tmp_path / "a")
    weights = tmp_path / "w.safetensors"
    ok("train", "--config", tmp_path / "mine.yaml", *[a for a in tiny if a != "--dry-run"], "--out", tmp_path / "b")
    ok("export", tmp_path / "b", "--out", weights)
    ok("finetune", "--config", "swin_l_22k_to_1k_224", "--from-ckpt", weights, *tiny, "--out", tmp_path / "c")


def test_an_unlimited_time_says_a_limit_is_needed():
    result = vitctl("train", *SLURM, "--time", "UNLIMITED", "--dry-run")
    assert result.exit_code == 2 and "Invalid value for '--time': 'UNLIMITED' is no limit: vitctl needs one, to " \
        "checkpoint before it and requeue; give the partition's longest" in result.stderr, result.stderr


def test_a_run_folder_entry_of_the_wrong_kind_is_refused_before_launch_and_status_reads_around_it(tmp_path):
    """`checkpoints` a file: the run trained, then failed at its first checkpoint; `metrics.jsonl` a folder: the rank
    failed with IsADirectoryError, and from then on `vitctl status` of every job ended in a traceback."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("")
    (run / "metrics.jsonl").mkdir()
    result = vitctl("train", *LOCAL, "--out", run, "--dry-run")
    assert result.exit_code == 1 and result.stderr.strip() == (
        f"error: run folder {run}: {run / 'checkpoints'} is a file, where vitctl writes a folder; "
        f"{run / 'metrics.jsonl'} is a folder, where vitctl writes a file: move it away, or choose another --out")
    registry.add_record(registry.JobRecord("999999999", "local", "vit_micro-run", str(run), str(run / "submitit"), 1,
                                           1, 0, time.time()))
    assert "vit_micro-run" in ok("status").output
    (run / "checkpoints").unlink()
    (run / "metrics.jsonl").rmdir()
    (run / "submitit").write_text("")  # where the job's logs go: `submission failed: [Errno 17] File exists` before
    result = vitctl("train", *LOCAL, "--out", run, "--dry-run")
    assert result.exit_code == 1 and result.stderr.strip() == (
        f"error: run folder {run}: {run / 'submitit'} is a file, where vitctl writes a folder: move it away, or choose "
        "another --out")
    (run / "submitit").unlink()
    assert "srun" in ok("train", *LOCAL, "--out", run, "--dry-run").output  # the fix it names


def test_a_local_job_of_more_ranks_than_cpus_is_warned_of(tmp_path, monkeypatch):
    """Before: 8 ranks on 2 CPUs started without a word, and its first step had not ended after 17 minutes."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # vitctl runs in this process
    stderr = refused(*LOCAL, "--tasks-per-node", 8, "--set", "parallel.tp=3", "--out", tmp_path / "run")
    assert ("warning: --tasks-per-node 8 runs 8 ranks on this machine's 2 CPUs: they would take turns, and each step "
            "may take many times as long; --tasks-per-node 2 or fewer\n") in stderr
    stderr = refused(*LOCAL, "--tasks-per-node", 2, "--set", "parallel.tp=3", "--out", tmp_path / "run")
    assert "warning: --tasks-per-node" not in stderr  # the fix, followed


def test_a_request_this_machine_cannot_run_is_reported_with_the_config_s_problems_at_once(tmp_path):
    """Before: `--gpus 64 but this machine has N CUDA devices` alone; the image size's problem came on the next try."""
    stderr = refused(*QUICK, "--executor", "local", "--gpus", 64, "--set", "model.img_size=100", "--out",
                     tmp_path / "run")
    assert stderr.startswith("error: --gpus 64 but this machine has ") and \
        "; model vit_micro: image size 100 is not a multiple of the patch size 8; the nearest that is: 96" in stderr


@pytest.mark.slurm
def test_a_partition_that_does_not_exist_is_reported_with_the_config_s_problems_at_once(tmp_path, cluster):
    """Before: the partition's problem alone, hiding the image size's."""
    stderr = refused(*SLURM, "--partition", "gpu", "--set", "model.img_size=100", "--out", tmp_path / "run")
    assert "--partition 'gpu' does not exist; partitions: debug" in stderr and \
        "; model vit_micro: image size 100 is not a multiple of the patch size 8; the nearest that is: 96" in stderr


def test_tensor_parallel_groups_across_nodes_are_reported_with_the_other_problems(tmp_path, monkeypatch):
    """Before: the batch's problem alone, and once fixed, on the next try, tp's."""
    no_sbatch(monkeypatch)
    stderr = refused(*SLURM, "--nodes", 2, "--tasks-per-node", 1, "--batch", 65, "--set", "parallel.tp=2",
                     "--model", "vit_mini", "--dry-run", "--out", tmp_path / "run")
    assert "parallel.tp=2 would split tensor-parallel groups across nodes of 1 ranks" in stderr, stderr
    assert "data.batch_size 65 x 1 data-parallel ranks = 65 samples a step, more than the 64 train samples" \
        in stderr, stderr


def test_a_resume_of_a_run_folder_whose_job_saved_no_checkpoint_is_a_note_and_of_a_missing_one_a_warning(tmp_path):
    """Before: a rerun after a job stopped before its first checkpoint (`make demo` interrupted early) was warned to
    `give its folder as --out`, which it was."""
    run = tmp_path / "run"
    said = ok("train", *LOCAL, "--out", run, "--resume", "--dry-run").stderr
    assert f"warning: --resume, but {run} does not exist: the run starts at step 0; to continue a run, give its " \
           "folder as --out" in " ".join(said.split()), said
    (run / "submitit").mkdir(parents=True)  # a job's folder, as one cancelled before it saved a checkpoint leaves it
    said = " ".join(ok("train", *LOCAL, "--out", run, "--resume", "--dry-run").stderr.split())
    assert f"note: {run} holds no checkpoint yet (its earlier job stopped before it saved one): the run starts at " \
           "step 0" in said and "warning" not in said, said
