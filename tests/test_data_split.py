"""The data split over data-parallel ranks, through the loaders (the index loader's three branches and DALI, on the
CPU): every sample once per epoch, a new order each epoch, and a resumed stream that continues with the same
batches (with the whole recipe on: RandAugment, colour jitter, random erasing); repeated augmentation's plan."""

import gc
import importlib.util
import itertools
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import live_children, survivors_of_killing
from vitctl.trainer.data.augment import Recipe
from vitctl.trainer.data.loader import EvalBatches, LoaderSpec, TrainBatches
from vitctl.trainer.data.plan import EpochPlan, eval_rows
from vitctl.trainer.data.shards import SampleTable, read_table, split_shards
from vitctl.workflows.process import start_time

RANKS, BATCH = 3, 7  # 60 train samples in shards of 16, 16, 16, 12: 2 global batches of 21 per epoch, 18 left out


RECIPE = Recipe(32, min_scale=0.35, rand_augment="rand-m9-mstd0.5-inc1", color_jitter=0.4, reprob=0.25)


def spec(workers: int = 0, branch: str = "pil", device: str = "cpu") -> LoaderSpec:
    return LoaderSpec(RECIPE, seed=5, workers=workers, device=torch.device(device), branch=branch)


def loader(kind: str, table, plan: EpochPlan, workers: int = 0, device: str = "cpu"):
    """index: the index loader's PIL workers; pil-crop, nvjpeg: its GPU branches (here on the CPU); dali: DALI."""
    if kind == "dali":
        from vitctl.trainer.data.dali import DaliTrainBatches

        return DaliTrainBatches(table, spec(workers, device=device), plan, threads=1)
    return TrainBatches(table, spec(workers, "pil" if kind == "index" else kind, device), plan)


@pytest.fixture(scope="module")
def table(prepared_shards):
    shards, _ = split_shards(prepared_shards, "train")
    assert len({e["samples"] for e in shards}) > 1  # uneven shards
    return read_table(prepared_shards, shards)


def test_labels_come_from_the_manifest_and_older_folders_read_them_from_the_shards(prepared_shards, table):
    shards, _ = split_shards(prepared_shards, "train")
    assert all("labels" in e for e in shards)
    older = read_table(prepared_shards, [{k: v for k, v in e.items() if k != "labels"} for e in shards])
    assert np.array_equal(older.label, table.label) and np.array_equal(older.offset, table.offset)


@pytest.mark.parametrize(("kind", "workers"), [("index", 0), ("index", 2), ("pil-crop", 2), ("nvjpeg", 2),
                                                 ("dali", 0), ("dali", 1)])
def test_every_sample_once_per_epoch_over_three_ranks(table, kind, workers):
    plans = [EpochPlan(len(table), BATCH, rank, RANKS, seed=5) for rank in range(RANKS)]
    streams = [loader(kind, table, plan, workers)(0, 0) for plan in plans]
    per_epoch = plans[0].batches_per_epoch
    orders = []
    for _ in range(2):
        rows = []
        for _ in range(per_epoch):
            for stream in streams:
                images, labels, batch_rows = next(stream)
                assert images.shape == (BATCH, 3, 32, 32)
                assert torch.equal(labels, torch.from_numpy(table.label[batch_rows.numpy()]))
                rows += batch_rows.tolist()
        assert len(rows) == len(set(rows)) == per_epoch * RANKS * BATCH
        assert len(table) - len(rows) < RANKS * BATCH  # fewer than one global batch left out
        orders.append(rows)
    assert orders[0] != orders[1]


@pytest.mark.parametrize("kind", ["index", "pil-crop", "nvjpeg", "dali"])
def test_a_stream_resumed_mid_epoch_gives_the_same_remaining_batches(table, kind):
    plan = EpochPlan(len(table), BATCH, 1, RANKS, seed=5)
    whole = list(itertools.islice(loader(kind, table, plan)(0, 0), 5))  # across the epoch boundary
    epoch, sample = plan.locate(0, 0, 1)
    resumed = list(itertools.islice(loader(kind, table, plan)(epoch, sample), 4))
    for (a_images, a_labels, a_rows), (b_images, b_labels, b_rows) in zip(whole[1:], resumed, strict=True):
        assert torch.equal(a_rows, b_rows) and torch.equal(a_labels, b_labels)
        assert torch.equal(a_images, b_images)  # the same augmentations: they depend on (seed, epoch, draw)


DALI_RANK = """
import sys, time
from pathlib import Path
import torch
from vitctl.trainer.data.augment import Recipe
from vitctl.trainer.data.dali import DaliTrainBatches
from vitctl.trainer.data.loader import LoaderSpec
from vitctl.trainer.data.plan import EpochPlan
from vitctl.trainer.data.shards import read_table, split_shards

shards, _ = split_shards(Path(sys.argv[1]), "train")
table = read_table(Path(sys.argv[1]), shards)
spec = LoaderSpec(Recipe(32), seed=5, workers=2, device=torch.device("cpu"), branch="pil")
batches = DaliTrainBatches(table, spec, EpochPlan(len(table), 7, 0, 1, seed=5), threads=1)(0, 0)
next(batches)
print("ready", flush=True)
time.sleep(600)
"""


def test_dali_workers_end_with_a_rank_killed_outright(prepared_shards):
    """Before, a rank killed with SIGKILL (or by the OOM killer) left its DALI workers running, 680 MB each."""
    rank = subprocess.Popen([sys.executable, "-c", DALI_RANK, str(prepared_shards)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        assert rank.stdout.readline().strip() == "ready", rank.stderr.read()
        workers = live_children(rank.pid)
        assert len(workers) >= 2
        assert not survivors_of_killing(rank, workers, within=10)
    finally:
        survivors_of_killing(rank, workers, within=0)


SIGNALLED_RANK = """
import signal, sys
from pathlib import Path
import torch
from vitctl.trainer.data.augment import Recipe
from vitctl.trainer.data.dali import DaliTrainBatches
from vitctl.trainer.data.loader import LoaderSpec, TrainBatches
from vitctl.trainer.data.plan import EpochPlan
from vitctl.trainer.data.shards import read_table, split_shards

received = []
for signum in (signal.SIGTERM, signal.SIGUSR2):  # as a rank's StopSignals: noted, acted on at the next step
    signal.signal(signum, lambda s, frame: received.append(s))
shards, _ = split_shards(Path(sys.argv[1]), "train")
table = read_table(Path(sys.argv[1]), shards)
spec = LoaderSpec(Recipe(32), seed=5, workers=2, device=torch.device("cpu"), branch="pil")
plan = EpochPlan(len(table), 7, 0, 1, seed=5)
kind = DaliTrainBatches(table, spec, plan, threads=1) if sys.argv[2] == "dali" else TrainBatches(table, spec, plan)
batches = kind(0, 0)
next(batches)
print("ready", flush=True)
sys.stdin.readline()
for _ in range(4):
    next(batches)
print("trained on; the rank took", sorted(received), flush=True)
"""


@pytest.mark.parametrize("kind", ["index", "dali"])
def test_loader_workers_leave_slurms_stop_signals_to_their_rank(prepared_shards, kind):
    """Slurm signals every process of a job: USR2 before its time limit, TERM for a requeue or a cancel. Before, the
    signals killed the loader workers, and the rank failed (DataLoader) or hung (DALI) instead of checkpointing."""
    rank = subprocess.Popen([sys.executable, "-c", SIGNALLED_RANK, str(prepared_shards), kind], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        assert rank.stdout.readline().strip() == "ready", rank.stderr.read()
        workers = live_children(rank.pid)
        assert len(workers) >= 2
        for pid in [rank.pid, *workers]:
            for signum in (signal.SIGUSR2, signal.SIGTERM):
                os.kill(pid, signum)
        time.sleep(1)
        assert all(start_time(w) is not None for w in workers)
        out, err = rank.communicate("\n", timeout=60)
        assert rank.returncode == 0, err  # it ended its workers (multiprocessing's exit sends them TERM), not hung
        assert out.strip() == f"trained on; the rank took {sorted([int(signal.SIGTERM), int(signal.SIGUSR2)])}", err
    finally:
        survivors_of_killing(rank, workers, within=10)


def test_what_dali_sends_each_worker_stays_small_however_many_samples(table):
    """A spawned worker's payload over a pipe's 64 KiB makes every worker's start wait for the one before."""
    from vitctl.trainer.data.dali import BatchSource, TableFile

    many = SampleTable(table.paths, *(np.tile(a, 2000) for a in (table.shard, table.offset, table.size, table.label)))
    source = BatchSource(TableFile(many), EpochPlan(len(many), BATCH, 0, 1, seed=5), spec(2), 0, 0)
    source(SimpleNamespace(iteration=0))  # an epoch's order, as large as the table, stays behind too
    payload = pickle.dumps(source)
    assert len(many) == 120_000 and len(payload) < 16 * 1024
    worker = pickle.loads(payload)
    for name in ("shard", "offset", "size", "label"):
        assert np.array_equal(getattr(worker.reader.table, name), getattr(many, name))
    assert worker.reader.table.paths == many.paths
    rows = (0, 59, 119_999)
    assert [worker.reader.read(row) for row in rows] == [source.reader.read(row) for row in rows]
    path = Path(source.table.path)
    del worker
    gc.collect()
    assert path.is_file()  # a worker's copy leaves the file to the process that wrote it
    del source
    gc.collect()
    assert not path.exists()


def test_resharded_stream_continues_the_same_permutation():
    """Global positions: 2 ranks of 6 continue where 4 ranks of 3 stopped, reading the same samples."""
    four = [EpochPlan(50, 3, r, 4, seed=1) for r in range(4)]
    two = [EpochPlan(50, 6, r, 2, seed=1) for r in range(2)]
    order = four[0].order(0)
    position = four[0].locate(0, 0, 2)
    assert position == two[0].locate(0, 0, 2)
    assert [r for p in four for r in p.rows(order, position[1])] == [r for p in two for r in p.rows(order, position[1])]


def test_a_position_that_no_longer_fits_a_global_batch_starts_the_next_epoch():
    """2 ranks of 12 stopped at sample 24 of 60; 2 ranks of 20 cannot read 40 more: they start epoch 1."""
    plan = EpochPlan(60, 20, 0, 2, seed=1)
    epoch, rows = next(plan.stream(0, 24))
    assert epoch == 1 and len(rows) == 20 and plan.locate(0, 24, 0) == (1, 0)


@pytest.mark.parametrize(("samples", "batch", "ranks"), [(60, 7, 3), (61, 4, 5), (8, 2, 4), (1000, 3, 7)])
def test_locate_is_repeated_advance_and_drops_less_than_a_global_batch(samples, batch, ranks):
    plan = EpochPlan(samples, batch, 0, ranks, seed=0)
    position = (0, 0)
    for step in range(3 * plan.batches_per_epoch + 2):
        assert plan.locate(0, 0, step) == position
        position = plan.advance(*position)
    assert samples - plan.batches_per_epoch * plan.global_batch < plan.global_batch


def test_eval_reads_every_sample_once_and_ranks_run_the_same_count(prepared_shards):
    shards, _ = split_shards(prepared_shards, "val")
    table = read_table(prepared_shards, shards)
    outputs = [list(EvalBatches(table, spec(), 3, rank, RANKS)()) for rank in range(RANKS)]
    assert len({len(batches) for batches in outputs}) == 1
    rows = [r for batches in outputs for b in batches if b is not None for r in b[2].tolist()]
    assert sorted(rows) == list(range(len(table)))
    assert [list(eval_rows(10, r, 3)) for r in range(3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def _epoch_draws(plans: list[EpochPlan], epoch: int) -> list[tuple[int, int]]:
    """(rank, draw) for every draw of an epoch, over all ranks."""
    order, plan = plans[0].order(epoch), plans[0]
    return [(p.dp_rank, int(d)) for b in range(plan.batches_per_epoch) for p in plans
            for d in p.rows(order, b * plan.global_batch)]


@pytest.mark.parametrize(("ranks", "batch", "repeats"), [(3, 4, 3), (4, 3, 3), (2, 6, 3), (5, 2, 2)])
def test_repeated_augmentation_draws_each_sample_r_times_on_distinct_ranks(ranks, batch, repeats):
    """60 samples: an epoch is still 60 draws (timm's RepeatAugSampler), 60 / r samples each r times, its repeats on
    r different ranks when there are at least r, each repeat a draw of its own."""
    plans = [EpochPlan(60, batch, rank, ranks, seed=3, repeats=repeats) for rank in range(ranks)]
    for epoch in range(2):
        draws = _epoch_draws(plans, epoch)
        assert len(draws) == 60 == len({d for _, d in draws})
        samples = plans[0].sample(np.array([d for _, d in draws]))
        assert np.bincount(samples, minlength=60).tolist().count(repeats) == 60 // repeats
        ranks_of = {}
        for (rank, _), sample in zip(draws, samples, strict=True):
            ranks_of.setdefault(int(sample), []).append(rank)
        assert all(len(set(r)) == min(repeats, ranks) for r in ranks_of.values())
    assert set(_epoch_draws(plans, 0)) != set(_epoch_draws(plans, 1))


def test_repeated_augmentation_resumes_mid_epoch_and_onto_other_ranks():
    plans = [EpochPlan(60, 4, rank, 3, seed=3, repeats=3) for rank in range(3)]
    for plan in plans:
        whole = [(e, r.tolist()) for e, r in itertools.islice(plan.stream(0, 0), 9)]  # across the epoch boundary
        resumed = [(e, r.tolist()) for e, r in itertools.islice(plan.stream(*plan.locate(0, 0, 2)), 7)]
        assert whole[2:] == resumed
    two = [EpochPlan(60, 6, rank, 2, seed=3, repeats=3) for rank in range(2)]  # 2 ranks of 6 after 3 of 4
    order, position = plans[0].order(0), plans[0].locate(0, 0, 2)
    assert sorted(d for p in plans for d in p.rows(order, position[1]).tolist()) == \
        sorted(d for p in two for d in p.rows(order, position[1]).tolist())


def test_without_repeats_the_order_is_the_plain_permutation():
    plan = EpochPlan(50, 5, 1, 2, seed=4)
    assert np.array_equal(plan.order(3), np.random.default_rng([4, 3]).permutation(50))
    assert np.array_equal(plan.sample(plan.order(3)), plan.order(3))


def test_a_samples_repeats_are_augmented_differently(table):
    """Three ranks read one sample's three repeats at the same place of their batches: three different views."""
    plans = [EpochPlan(len(table), 4, rank, 3, seed=5, repeats=3) for rank in range(3)]
    firsts = [next(TrainBatches(table, spec(), plan)(0, 0)) for plan in plans]
    assert len({int(rows[0]) for _, _, rows in firsts}) == 1
    assert not torch.equal(firsts[0][0][0], firsts[1][0][0]) and not torch.equal(firsts[1][0][0], firsts[2][0][0])


# A header that no decoder reads, or a scan cut short. Pillow meets the second only when it decodes; the CPU decoders
# in the training process (nvjpeg's branch's, DALI's, a batch ahead) fail on it too. The GPU decoders (nvjpeg, DALI's
# mixed) decode such a scan as far as it goes, without an error (one H200), as libjpeg does with a warning: `vitctl
# data verify` finds that damage by the shard's sha256.
DAMAGE = {"header": r"not in any format Pillow reads", "scan": r"image file is truncated \(\d+ bytes not processed\)"}


def damage(table: SampleTable, row: int, part: str) -> str:
    """Damages one sample's JPEG in its shard in place; returns the error the loaders must give for it."""
    shard, offset, size = table.paths[table.shard[row]], int(table.offset[row]), int(table.size[row])
    with open(shard, "r+b") as f:
        f.seek(offset)
        data = f.read(size)
        scan = data.index(b"\xff\xda")  # start of scan: everything before it is the header
        start = offset if part == "header" else offset + (scan + size) // 2
        f.seek(start)
        f.write(bytes(16) if part == "header" else b"\xff" * (offset + size - start))
    return (rf"{re.escape(shard)}: the JPEG at offset {offset} does not decode \({DAMAGE[part]}\)"
            r"\nfix: `vitctl data verify")


_GPU_DECODERS = [pytest.param("nvjpeg", "cuda", "header", marks=pytest.mark.gpu),
                 pytest.param("dali", "cuda", "header", marks=[pytest.mark.gpu, pytest.mark.skipif(
                     importlib.util.find_spec("nvidia.dali") is None, reason="needs nvidia-dali")])]


@pytest.mark.parametrize(("kind", "device", "part"), [
    *((kind, "cpu", part) for kind in ("index", "pil-crop", "nvjpeg", "dali") for part in DAMAGE), *_GPU_DECODERS])
def test_a_damaged_train_image_is_named_by_its_shard_and_offset(shards_copy, kind, device, part):
    from vitctl.datasets.errors import DataError

    table = read_table(shards_copy, split_shards(shards_copy, "train")[0])
    error = damage(table, len(table) // 2, part)
    plan = EpochPlan(len(table), BATCH, 0, 1, seed=5)
    with pytest.raises(DataError, match=error):
        list(itertools.islice(loader(kind, table, plan, 0 if kind == "dali" else 1, device)(0, 0),
                              plan.batches_per_epoch))


@pytest.mark.parametrize("part", DAMAGE)
@pytest.mark.parametrize("branch", ["pil", "pil-crop", "nvjpeg"])
def test_a_damaged_eval_image_is_named_by_its_shard_and_offset(shards_copy, branch, part):
    from vitctl.datasets.errors import DataError

    val = read_table(shards_copy, split_shards(shards_copy, "val")[0])
    with pytest.raises(DataError, match=damage(val, len(val) // 2, part)):
        list(EvalBatches(val, spec(0, branch), BATCH, 0, 1)())


def test_a_shard_cut_short_or_gone_since_the_run_started_is_named_as_such(shards_copy):
    """A truncated shard was blamed on its index (`vitctl data index` then said truncated: two detours), and a deleted
    one ended the rank in a bare FileNotFoundError."""
    from vitctl.datasets.errors import DataError
    from vitctl.trainer.data.loader import ShardReader

    table = read_table(shards_copy, split_shards(shards_copy, "train")[0])
    reader = ShardReader(table)
    last = int(np.flatnonzero(table.shard == 0)[-1])  # the last sample of the first shard
    shard = Path(table.paths[0])
    with open(shard, "r+b") as f:
        f.truncate(int(table.offset[last]) + 10)
    for read in (lambda: reader.read(last), lambda: reader._check_member_at(last, shard)):
        with pytest.raises(DataError) as error:
            read()
        assert str(error.value) == (
            f"{shard}: cut short since the run started: the file is {int(table.offset[last]) + 10} bytes, and the "
            f"sample at offset {int(table.offset[last])} needs {int(table.offset[last]) + int(table.size[last])}\n"
            f"fix: `vitctl data verify {shards_copy}` checks every shard against manifest.json and prints the command "
            "that writes the damaged or missing ones again; then --resume")
    gone = int(np.flatnonzero(table.shard == 1)[0])
    Path(table.paths[1]).unlink()
    with pytest.raises(DataError, match="the shard is gone: it was there when the run started"):
        reader.read(gone)
