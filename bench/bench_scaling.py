"""Data-parallel scaling on one host, in one call: our trainer on 1 GPU and on N GPUs (one all-reduce after the
backward, ZeRO-1, DDP, FSDP2), timm + DDP beside it; synthetic data resident on the GPU, and our DALI path on
real-size JPEGs.

    python bench/bench_scaling.py --models swin_b,vit_b16 --gpus 2 --timm swin_b
    python bench/bench_scaling.py --models vit_b16 --gpus 2,4 --timm ""      # 1, 2 and 4 GPUs on a 4-GPU machine
    python bench/bench_scaling.py --strategies "1 GPU,DDP" --nccl NCCL_MAX_CTAS=4   # DDP rows with an NCCL setting
    python bench/bench_scaling.py --models swin_b --timm "" --data synthetic,dali   # each row on both
    python bench/bench_scaling.py --strategies "1 GPU,ZeRO-1" --singles-after   # the 1-GPU runs again at the end

Every configuration runs in fresh processes (torchrun): a 1-GPU one on every GPU at once, and multi-GPU ones side by
side on disjoint GPUs where they fit (two 2-GPU runs on a 4-GPU machine), so that every GPU is busy in every wave and
each row is compared with the 1-GPU figures of its own GPUs. Ours is the real
trainer (`Trainer.train_step`: the preset's recipe with mixup, drop path and clipping, bf16-pure, compile, fused
all); timm runs its model with the same recipe under its strongest setting (bf16 autocast, compile, fused
attention). Each rank times `--steps` steps back to back after `--warmup` with CUDA events: images/s is rank 0's
over the span from the first step's start to the last one's end, so that the GPU's waits for data count; ms/step is
its median step. With `--data dali` each rank reads its data-parallel share of bench_loaders.py's generated JPEGs
(500x375, ~110 KB) through the DALI path with the preset's full recipe, and each row's efficiency is against the
1-GPU rows of the same data. Rows print as they finish, each with the Python garbage collections during its timed
steps and its steps over 1.1x the median; with `--profile` each rank of a multi-GPU row also prints its own kernel
times, NCCL's by kernel (where it waits for the others).
"""

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

PRESET = {"swin_b": ("swin_b_pretrain", 128), "vit_b16": ("vit_b16_pretrain", 256)}
TIMED = ("gc_ms_per_step", "gc_longest_ms", "gc_full", "slow_steps")
PROFILED = ("allreduce_344MB_ms", "nccl_ms_per_step", "nccl_beside_ms_per_step", "kernels_ms_per_step",
            "idle_ms_per_step", "host_ms_per_step", "syncs_per_step")


STRATEGIES = {"1 GPU": None, "all-reduce after backward": "after_backward", "ZeRO-1": "zero1", "DDP": "overlap",
              "FSDP2": None}


def configurations(models: list[str], counts: list[int], timm: list[str], strategies: list[str], nccl: list[str],
                   profile: bool, data: dict[str, dict]) -> list[dict]:
    """Every configuration to run, on each of `data` (timm's on synthetic data only); `counts` are the multi-GPU
    sizes, and the 1-GPU ones run on each of max(counts)."""
    runs = _configurations(models, counts, timm, strategies, nccl, profile)
    return [dict(run, data=name, **source) for name, source in data.items() for run in runs
            if name == "synthetic" or run["impl"] == "vitctl"]


def _configurations(models: list[str], counts: list[int], timm: list[str], strategies: list[str], nccl: list[str],
                    profile: bool) -> list[dict]:
    runs, gpus = [], max(counts)
    for model in models:
        runs += [dict(model=model, impl="vitctl", strategy="1 GPU", gpus=1, mode=mode, gpu=gpu)
                 for mode in ("reduce-overhead", "default") for gpu in range(gpus)]
        for n in counts:
            runs += [dict(model=model, impl="vitctl", strategy="all-reduce after backward", gpus=n,
                          mode="reduce-overhead"),
                     dict(model=model, impl="vitctl", strategy="ZeRO-1", gpus=n, mode="reduce-overhead"),
                     dict(model=model, impl="vitctl", strategy="DDP", gpus=n, mode="reduce-overhead"),
                     dict(model=model, impl="vitctl", strategy="FSDP2", gpus=n, mode="default")]
            runs += [dict(model=model, impl="vitctl", strategy=strategy, gpus=n, mode="reduce-overhead", env=setting)
                     for setting in nccl for strategy in ("all-reduce after backward", "ZeRO-1", "DDP")]
        if model in timm:
            runs += [dict(model=model, impl="timm", strategy="1 GPU", gpus=1, mode="default", gpu=gpu)
                     for gpu in range(gpus)]
            runs += [dict(model=model, impl="timm", strategy="DDP", gpus=n, mode="default") for n in counts]
    runs = [run for run in runs if run["strategy"] in strategies or run["impl"] == "timm"]
    # 1-GPU baselines in the compile modes that the multi-GPU rows use, and ours' best (CUDA graphs)
    modes = {(r["model"], r["impl"], r["mode"]) for r in runs if r["gpus"] > 1}
    return [dict(run, profile=profile) for run in runs if run["gpus"] > 1 or (run["model"], run["impl"], run["mode"])
            in modes or (run["impl"], run["mode"]) == ("vitctl", "reduce-overhead")]


# ---------------------------------------------------------------- one configuration, in each rank


def ours(run: dict, out_dir: str) -> tuple[Callable[[], float], str]:
    from vitctl.trainer.config import load_config
    from vitctl.trainer.loop import Trainer
    from vitctl.trainer.parallel import init_distributed

    preset, batch = PRESET[run["model"]]
    data = [f"data.source={run['data']}"] + ([f"data.path={run['shards']}"] if "shards" in run else [])
    data += [f"data.workers={run['workers']}"] if run.get("workers") else []
    data += [f"model.num_classes={run['classes']}"] if "classes" in run else []
    config = load_config(preset, [
        *data, f"data.batch_size={batch}", "train.precision=bf16-pure", "train.fused=all",
        "train.compile=true", f"train.compile_mode={run['mode']}", f"parallel.fsdp={run['strategy'] == 'FSDP2'}",
        f"parallel.grad_reduce={STRATEGIES[run['strategy']] or 'auto'}", f"train.out_dir={out_dir}"])
    trainer = Trainer(config, init_distributed(True), resume=False)
    batches = trainer.data.train(0, 0)
    return (lambda: trainer.train_step(batches)[2]), trainer.ops.describe()


class Pauses:
    """Python's garbage collections while installed: (generation, ms) each."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []
        self.started = 0.0
        gc.callbacks.append(self.track)

    def track(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.seen.append((info["generation"], (time.perf_counter() - self.started) * 1000))

    def summary(self, steps: int) -> dict:
        gc.callbacks.remove(self.track)
        return {"gc_ms_per_step": sum(ms for _, ms in self.seen) / steps,
                "gc_longest_ms": max((ms for _, ms in self.seen), default=0.0),
                "gc_full": sum(generation == 2 for generation, _ in self.seen)}


def timm_ddp(run: dict) -> tuple[Callable[[], None], str]:
    """timm's model and its strongest setting, the same recipe as our preset, DDP over the ranks."""
    import torch
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy
    from torch.nn.parallel import DistributedDataParallel

    from vitctl.trainer.bench import timm_model
    from vitctl.trainer.config import load_config
    from vitctl.trainer.parallel import init_distributed

    env = init_distributed(True)
    preset, batch = PRESET[run["model"]]
    c = load_config(preset, ["data.source=synthetic"])
    model = timm_model(run["model"], 224, fused_attn=True, drop_path=c.model.drop_path).to(env.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=True)
    wrapped = DistributedDataParallel(model, device_ids=[env.device.index]) if env.world_size > 1 else model
    forward = torch.compile(wrapped, mode=run["mode"])
    mixup = Mixup(mixup_alpha=c.augment.mixup, cutmix_alpha=c.augment.cutmix, label_smoothing=0.1, num_classes=1000)
    loss_fn = SoftTargetCrossEntropy()
    images = torch.randn(batch, 3, 224, 224, device=env.device)
    labels = torch.randint(0, 1000, (batch,), device=env.device)

    def step() -> None:
        x, y = mixup(images, labels)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(forward(x).float(), y)
        loss.backward()
        if c.optim.clip_grad:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.optim.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, "timm, bf16 autocast + compile + fused attention (TIMM_FUSED_ATTN=2), fused AdamW"


def worker(run: dict, warmup: int, steps: int, result: str) -> None:
    import torch

    from vitctl.trainer.parallel import expandable_cuda_memory, own_stream, widen_cuda_queues

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if run["impl"] == "vitctl":
        widen_cuda_queues()  # as a training rank does, on its stream: DALI fed Swin-B 0.85x synthetic without both
        expandable_cuda_memory()
    stream = own_stream(device) if run["impl"] == "vitctl" else contextlib.nullcontext()
    torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as out_dir, stream:
        step, setting = ours(run, out_dir) if run["impl"] == "vitctl" else timm_ddp(run)
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        pauses, launched, waited = Pauses(), time.perf_counter(), 0.0
        for start, end in events:
            start.record()
            waited += step() or 0.0  # ours returns its seconds waiting for data
            end.record()
        launched = time.perf_counter() - launched
        collections = pauses.summary(steps)
        torch.cuda.synchronize()
        extra = {**profile(step), "host_ms_per_step": launched * 1000 / steps} if run["profile"] else {}
    times = [start.elapsed_time(end) for start, end in events]
    median = statistics.median(times)
    if extra and "RANK" in os.environ:  # each rank's own, where it waits for the others
        print(f"profile of rank {os.environ['RANK']}: {json.dumps(extra | {'ms': median})}", flush=True)
    if int(os.environ.get("RANK", 0)) == 0:
        batch = PRESET[run["model"]][1]
        span = events[0][0].elapsed_time(events[-1][1])
        extra |= collections | {"slow_steps": sum(t > 1.1 * median for t in times)}
        Path(result).write_text(json.dumps({**run, **extra, "setting": setting, "ms": median,
                                            "batch": batch, "images_per_s": run["gpus"] * batch * steps * 1000 / span,
                                            "longest_ms": max(times), "wait_ms": waited * 1000 / steps,
                                            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def profile(step: Callable[[], None]) -> dict:
    """GPU ms per step in NCCL kernels (which run, and hold their SMs, while they wait for the peer) and in all other
    kernels, and the time of one fp32 all-reduce of ViT-B's size over the ranks."""
    import torch.distributed as dist

    return {**kernel_ms_per_step(step), **host_syncs(step), **(allreduce_probe() if dist.is_initialized() else {})}


def host_syncs(step: Callable[[], None], steps: int = 3) -> dict:
    """Operations in a step that make the host wait for the GPU (CUDA's sync debug mode), printed once each."""
    import warnings

    import torch

    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            step()
    torch.cuda.set_sync_debug_mode(0)
    for message in sorted({str(w.message)[:300] for w in caught}):
        print(f"sync in the step: {message}", flush=True)
    return {"syncs_per_step": len(caught) / steps}


def kernel_ms_per_step(step: Callable[[], None], steps: int = 5) -> dict:
    """Summed kernel times (NCCL, the others), the NCCL time during which other kernels also ran (an overlap that
    hides the reduction, or takes SMs from the compute), and the time no kernel ran, over `steps` back to back."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step()  # the profiled span starts with a step in flight, so its first kernel is not waiting for the host
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl_kernels = [e for e in kernels if "nccl" in e.name.lower()]
    nccl = [(e.time_range.start, e.time_range.end) for e in nccl_kernels]
    by_kernel: dict[str, float] = {}  # the collectives apart: all-to-all (SendRecv), all-gather, all-reduce
    for e in nccl_kernels:
        by_kernel[e.name[:40]] = by_kernel.get(e.name[:40], 0.0) + e.time_range.end - e.time_range.start
    other = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
    busy = union(nccl + other)
    span = busy[-1][1] - busy[0][0] if busy else 0
    per_step = lambda us: us / steps / 1000  # noqa: E731
    return {"nccl_ms_per_step": per_step(length(nccl)), "kernels_ms_per_step": per_step(length(other)),
            "nccl_beside_ms_per_step": per_step(length(intersection(union(nccl), union(other)))),
            "idle_ms_per_step": per_step(span - length(busy)),
            "nccl_by_kernel": {name: round(per_step(us), 3) for name, us in by_kernel.items()}}


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering `intervals`."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Where two sorted, disjoint interval lists overlap."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        i, j = (i + 1, j) if a[i][1] < b[j][1] else (i, j + 1)
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def allreduce_probe(repeats: int = 5) -> dict:
    import torch
    import torch.distributed as dist

    flat = torch.ones(86_000_000, device="cuda")  # 344 MB: ViT-B's gradients in fp32
    for _ in range(3):
        dist.all_reduce(flat)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dist.all_reduce(flat)
    end.record()
    torch.cuda.synchronize()
    return {"allreduce_344MB_ms": start.elapsed_time(end) / repeats}


# ---------------------------------------------------------------- the driver


class Launched:
    """One configuration's processes: a single one on a chosen GPU, or torchrun over all of them."""

    def __init__(self, run: dict, warmup: int, steps: int) -> None:
        self.run = run
        self.result = tempfile.NamedTemporaryFile(suffix=".json")  # noqa: SIM115  (closed in finish)
        args = [__file__, "--worker", json.dumps(run), "--warmup", str(warmup), "--steps", str(steps),
                "--result", self.result.name]
        env = dict(os.environ, TIMM_FUSED_ATTN="2", PYTHONUNBUFFERED="1")
        if run.get("env"):
            key, _, value = run["env"].partition("=")
            env[key] = value
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, run["on"]))
        if run["gpus"] == 1:
            command = [sys.executable, *args]
        else:  # --standalone: a free rendezvous port, so that runs side by side do not meet
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={run['gpus']}", *args]
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(self, timeout: float) -> dict | None:
        try:
            output, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            output, _ = self.process.communicate()
            print(f"TIMED OUT after {timeout:.0f} s: {self.run}", flush=True)
            return None
        finally:
            text = Path(self.result.name).read_text()
            self.result.close()
        if self.process.returncode or not text:
            print(f"FAILED {self.run}: exit {self.process.returncode}\n{output[-3000:]}", flush=True)
            return None
        seen = set()
        # Where CUDA graphs were skipped (with TORCH_LOGS=perf_hints), and Dynamo's recompile limit (blocks compiled
        # one by one past it run eager)
        warned = ("skipping cudagraphs", "hit config.recompile_limit")
        for line in output.splitlines():
            passed = line.startswith(("sync in the step", "profile of rank"))
            if passed or (any(w in line for w in warned) and line not in seen):
                print(f"{self.run['model']} {self.run['strategy']}: {line}", flush=True)
                seen.add(line)
        return json.loads(text)


def waves(runs: list[dict], gpus: int) -> list[list[dict]]:
    """Groups of configurations that run side by side, each on its own GPUs (`on`): the 1-GPU ones `gpus` at a time,
    one on each GPU, first; each multi-GPU one joins the first later group with GPUs to spare."""
    single = [dict(r, on=[r["gpu"]]) for r in runs if r["gpus"] == 1]
    multi: list[list[dict]] = []
    for run in (r for r in runs if r["gpus"] > 1):
        wave = next((w for w in multi if sum(r["gpus"] for r in w) + run["gpus"] <= gpus), None)
        if wave is None:
            multi.append(wave := [])
        used = sum(r["gpus"] for r in wave)
        wave.append(dict(run, on=list(range(used, used + run["gpus"]))))
    return [single[i:i + gpus] for i in range(0, len(single), gpus)] + multi


def print_row(row: dict, results: list[dict]) -> None:
    """Efficiency: the N-GPU images/s over the sum of its own GPUs' 1-GPU images/s (of the same compile mode, and
    of the faster mode), and over N times the slowest of them (same mode): a synchronous step runs at the slowest
    GPU's pace, so the second leaves out how far apart the GPUs themselves are. A GPU's 1-GPU figure is the mean of
    its runs (with --singles-after, those before and after the multi-GPU ones)."""
    runs: dict[tuple[str, int], list[float]] = {}
    for r in results:
        if (r["impl"], r["model"], r["data"], r["gpus"]) == (row["impl"], row["model"], row["data"], 1) \
                and r["gpu"] in row["on"]:
            runs.setdefault((r["mode"], r["gpu"]), []).append(r["images_per_s"])
    singles = {key: statistics.mean(figures) for key, figures in runs.items()}
    modes = {mode: sum(v for (m, _), v in singles.items() if m == mode) for mode, _ in singles}
    slowest = min((v for (mode, _), v in singles.items() if mode == row["mode"]), default=None)

    def scale(ideal: float | None) -> str:
        return f"{row['images_per_s'] / ideal:.3f}" if ideal and row["gpus"] > 1 else "-"

    strategy = row["strategy"] + (f" ({row['env']})" if row.get("env") else "")
    strategy += f" (GPU {row['gpu']})" if row["gpus"] == 1 else f" (GPUs {','.join(map(str, row['on']))})"
    print(f"| {row['model']} | {row['impl']} | {row['data']} | {strategy} | {row['mode']} | {row['gpus']} | "
          f"{row['images_per_s']:,.0f} | {row['ms']:.2f} | {row['longest_ms']:.1f} | {row['wait_ms']:.1f} | "
          f"{scale(modes.get(row['mode']))} | {scale(max(modes.values(), default=None))} | "
          f"{scale(slowest and row['gpus'] * slowest)} | {row['peak_gib']:.1f} |"
          + "".join(f" {key}={row[key]:.2f}" for key in TIMED + PROFILED if key in row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="swin_b,vit_b16")
    parser.add_argument("--gpus", default="2", help="multi-GPU sizes (comma-separated); 1-GPU runs use max of them")
    parser.add_argument("--timm", default="swin_b", help="models to run timm + DDP for (comma-separated)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"of ours (comma-separated): {STRATEGIES}")
    parser.add_argument("--nccl", default="",
                        help="extra rows of each strategy but FSDP2, each with one NCCL setting (NCCL_MAX_CTAS=4)")
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=480, help="seconds per configuration")
    parser.add_argument("--profile", action="store_true",
                        help="also, GPU ms per step: in NCCL kernels, of them beside other kernels, in all others, "
                        "with no kernel running; and an all-reduce probe")
    parser.add_argument("--singles-after", action="store_true",
                        help="run the 1-GPU configurations again after the multi-GPU ones, and print each multi-GPU "
                        "row's efficiency against both (what the GPUs drift by in a call)")
    parser.add_argument("--data", default="synthetic", help="synthetic and/or dali (comma-separated)")
    parser.add_argument("--images", type=int, default=4000, help="generated JPEGs for --data dali")
    parser.add_argument("--workers", type=int, default=0,
                        help="DALI workers (and as many DALI threads) per rank [default: the preset's]")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_loaders"), help="where the JPEGs and shards go")
    parser.add_argument("--worker")
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.warmup, args.steps, args.result)
        return
    counts = sorted(int(n) for n in args.gpus.split(","))
    data = {name: data_source(name, args) for name in args.data.split(",")}
    if len(data) > 1:  # the generated JPEGs' classes in every row, so that each row has a twin of the same work
        classes = next(source["classes"] for source in data.values() if "classes" in source)
        data = {name: dict(source, classes=classes) for name, source in data.items()}
    print("| model | impl | data | strategy | compile mode | GPUs | images/s | ms/step | longest ms | data wait ms | "
          "efficiency, same setting | efficiency vs best 1 GPU | vs N x the slowest GPU | peak GiB |\n"
          "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    results: list[dict] = []
    runs = configurations(args.models.split(","), counts, args.timm.split(",") if args.timm else [],
                          args.strategies.split(","), [s for s in args.nccl.split(",") if s], args.profile, data)
    planned = waves(runs, max(counts))
    planned += [wave for wave in planned if args.singles_after and wave[0]["gpus"] == 1]
    for wave in planned:
        launched = [Launched(run, args.warmup, args.steps) for run in wave]
        for row in filter(None, (job.finish(args.timeout) for job in launched)):
            results.append(row)
            print_row(row, results)
    if args.singles_after:
        print("Against the 1-GPU runs before and after:", flush=True)
        for row in (r for r in results if r["gpus"] > 1):
            print_row(row, results)
    against_synthetic(results)
    for row in results:
        print(f"{row['model']} {row['impl']} {row['strategy']} {row['mode']}: {row['setting']}", flush=True)


def data_source(name: str, args: argparse.Namespace) -> dict:
    """What a configuration needs to read `name`: nothing for synthetic data; for DALI, shards made once and the
    workers."""
    if name == "synthetic":
        return {}
    if name != "dali":
        raise SystemExit(f"--data: {name!r} is neither synthetic nor dali")
    from bench_data import WNIDS
    from bench_loaders import prepare

    _, shards = prepare(args.work, args.images)
    return {"shards": str(shards), "workers": args.workers, "classes": len(WNIDS)}


def against_synthetic(results: list[dict]) -> None:
    """Each real-data row's images/s over its synthetic twin's (same model, strategy, mode and GPUs: with --data
    synthetic,dali both with the generated JPEGs' classes)."""
    key = lambda r: (r["model"], r["impl"], r["strategy"], r["mode"], tuple(r["on"]))  # noqa: E731
    synthetic = {key(r): r for r in results if r["data"] == "synthetic"}
    for row in results:
        twin = synthetic.get(key(row))
        if row["data"] != "synthetic" and twin:
            print(f"{row['model']} {row['strategy']} on GPUs {row['on']} {row['mode']}: {row['data']} "
                  f"{row['images_per_s']:,.0f} img/s = {row['images_per_s'] / twin['images_per_s']:.3f}x synthetic "
                  f"({twin['images_per_s']:,.0f})", flush=True)


if __name__ == "__main__":
    main()
