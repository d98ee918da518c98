"""`vitctl plan`'s searched strategy against the uniform ones on this machine's GPUs, in one call: the search from a
profile, then every strategy trained under a per-GPU memory cap, its median step and peak memory beside the
prediction.

    python bench/bench_plan.py --model swin_h --batch 128 --memory-gib 24,40 --profile PROFILE.json

Each strategy runs once, in fresh processes (torchrun over all GPUs), as a plan file through the real trainer
(`Trainer.train_step`: the preset's recipe, bf16 autocast, fused ops, eager as the profile measured the blocks) on
synthetic batches resident on the GPU, capped with `torch.cuda.set_per_process_memory_fraction` at the smallest budget
it is predicted to fit (one predicted to fit none is listed, not run). The figure is rank 0's median step after
`--warmup`, the peak the most any rank allocated in the timed steps. Before the cap, the same process runs uncapped
and records the most the allocator reserved (the least cap under which it need never free its cache and retry) and
how far that reserve lies above the tensors' peak (the room a plan needs beside what it holds).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vitctl.trainer.parallel.strategy import Strategy

PRESET = {"swin": "swin_b_pretrain", "vit": "vit_b16_pretrain"}
OOM_EXIT = 3


def strategies(model: str, batch: int, budgets: list[float], profile: Path, gpus: int) -> list[dict]:
    """Every distinct strategy of the searches at `budgets`, with its predictions and the cap it runs under."""
    from vitctl.workflows.plan import PlanRequest, plan

    runs: dict[str, dict] = {}
    for budget in budgets:
        result = plan(PlanRequest(model, 224, 1, gpus, budget, batch, profile), print).result
        rows = ([("searched", result.best)] if result.best else []) + [(p.name, p) for p in result.uniform]
        for name, planned in rows:
            if planned.prediction is None:
                continue
            key = planned.strategy.to_json(model, gpus)
            run = runs.setdefault(key, dict(plan=key, layout=_layout(planned.strategy, gpus), names={},
                                            step_s=planned.prediction.step_s, peak_gib=planned.prediction.peak_gib,
                                            room_gib=planned.prediction.room_bytes / 2**30,
                                            fits=[], dp=gpus // (planned.strategy.tp * planned.strategy.pp)))
            run["names"].setdefault(budget, []).append(name)  # the searched plan may be a uniform one too
            if planned.fits:
                run["fits"].append(budget)
    for run in runs.values():
        run["cap_gib"] = min(run["fits"], default=None)
    return list(runs.values())


def _layout(strategy: "Strategy", gpus: int) -> str:
    """The mesh layout, and the micro-batches a step runs in where there are several (e.g. pp2·dp2, 8 micro-batches)."""
    more = f", {strategy.microbatches} micro-batches" if strategy.microbatches > 1 else ""
    return strategy.layout(gpus) + more


def worker(run: dict, model: str, batch: int, warmup: int, steps: int, result: str) -> None:
    import torch
    import torch.distributed as dist

    from vitctl.trainer.config import load_config
    from vitctl.trainer.loop import Trainer
    from vitctl.trainer.parallel import expandable_cuda_memory, init_distributed

    expandable_cuda_memory()  # as a training rank does
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    env = init_distributed(True)
    with tempfile.TemporaryDirectory() as out_dir:
        plan_file = Path(out_dir) / "plan.json"
        plan_file.write_text(run["plan"])
        config = load_config(PRESET[model.split("_")[0]], [
            f"model.name={model}", "data.source=synthetic", f"data.batch_size={batch // run['dp']}",
            "train.precision=bf16", "train.fused=all", "train.compile=false", f"parallel.plan={plan_file}",
            f"train.out_dir={out_dir}"])
        try:
            trainer = Trainer(config, env, resume=False)
            batches = trainer.data.train(0, 0)
            needed = _uncapped_reserve(trainer, batches, env.device, warmup)
            total = torch.cuda.get_device_properties(env.device).total_memory
            torch.cuda.set_per_process_memory_fraction(run["cap_gib"] * 2**30 / total, env.device)
            for _ in range(warmup):
                trainer.train_step(batches)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(env.device)
            retries = torch.cuda.memory_stats(env.device)["num_alloc_retries"]
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(steps)]
            for start, end in events:
                start.record()
                trainer.train_step(batches)
                end.record()
            torch.cuda.synchronize()
        except torch.OutOfMemoryError:
            # the other ranks wait in a collective: leave at once, torchrun stops them
            if env.rank == 0:
                Path(result).write_text(json.dumps({"oom": True}))
            os._exit(OOM_EXIT)
    # A cap the allocator meets makes it free its cache and retry (synchronising the device): time the plan did not
    # predict, so each row says how often that happened in the timed steps, and how much the allocator held (reserved)
    # beside what the tensors did (allocated): what fragmentation took of the cap.
    retries = torch.cuda.memory_stats(env.device)["num_alloc_retries"] - retries
    worst = torch.tensor([torch.cuda.max_memory_allocated(env.device), retries,
                          torch.cuda.max_memory_reserved(env.device), *needed], device=env.device,
                         dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if env.rank == 0:
        ms = statistics.median(start.elapsed_time(end) for start, end in events)
        Path(result).write_text(json.dumps({"oom": False, "ms": ms, "peak_gib": worst[0].item() / 2**30,
                                            "retries_per_step": worst[1].item() / steps,
                                            "reserved_gib": worst[2].item() / 2**30,
                                            "uncapped_reserved_gib": worst[3].item() / 2**30,
                                            "room_gib": worst[4].item() / 2**30}))
    dist.destroy_process_group()


def _uncapped_reserve(trainer, batches, device, warmup: int) -> tuple[float, float]:
    """Without a cap, the most the allocator reserves over three steady steps from an emptied cache, and that reserve
    above the tensors' peak (bytes): under a cap below that reserve the same allocations must free the cache and
    retry."""
    import torch

    for _ in range(warmup):
        trainer.train_step(batches)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # what the first steps reserved (e.g. for the optimizer's state) says nothing of the rest
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(3):
        trainer.train_step(batches)
    torch.cuda.synchronize()
    reserved = torch.cuda.max_memory_reserved(device)
    room = reserved - torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    return float(reserved), float(room)


def launch(run: dict, args: argparse.Namespace, gpus: int) -> dict | None:
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
                   __file__, "--worker", json.dumps(run), "--model", args.model, "--batch", str(args.batch),
                   "--warmup", str(args.warmup), "--steps", str(args.steps), "--result", result.name]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
        except subprocess.TimeoutExpired:
            print(f"TIMED OUT after {args.timeout:.0f} s: {run['layout']}", flush=True)
            return None
        text = Path(result.name).read_text()
    if not text:
        print(f"FAILED {run['layout']}: exit {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}", flush=True)
        return None
    return json.loads(text)


def print_row(run: dict, measured: dict | None, batch: int) -> None:
    names = ", ".join(f"{' = '.join(named)} at {budget:g}" for budget, named in run["names"].items())
    predicted = f"{run['step_s']:.3f} | {run['peak_gib']:.1f} + {run['room_gib']:.1f}"
    if measured is None or measured["oom"]:
        outcome = "predicted not to fit: not run" if measured is None else "out of memory"
        print(f"| {names} | {run['layout']} | {run['cap_gib'] or '-'} | {predicted} | {outcome} |" + " |" * 7,
              flush=True)
        return
    s, peak = measured["ms"] / 1000, measured["peak_gib"]
    print(f"| {names} | {run['layout']} | {run['cap_gib']:g} | {predicted} | {s:.3f} | {batch / s:,.0f} | "
          f"{peak:.1f} | {measured['reserved_gib']:.1f} | {measured['retries_per_step']:.1f} | "
          f"{measured['uncapped_reserved_gib']:.1f} | {measured['room_gib']:.2f} | "
          f"{run['step_s'] / s - 1:+.1%} / "
          f"{run['peak_gib'] / peak - 1:+.1%} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="swin_h")
    parser.add_argument("--batch", type=int, default=128, help="global batch")
    parser.add_argument("--memory-gib", default="24,40", help="per-GPU budgets (comma-separated)")
    parser.add_argument("--profile", type=Path, help="[default: the cached or shipped one of this GPU type]")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per strategy")
    parser.add_argument("--worker")
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker), args.model, args.batch, args.warmup, args.steps, args.result)
        return
    import torch

    gpus = torch.cuda.device_count()
    runs = strategies(args.model, args.batch, [float(b) for b in args.memory_gib.split(",")], args.profile, gpus)
    print("| strategy (budget GiB) | layout | cap GiB | predicted s/step | predicted peak + room GiB | s/step | "
          "images/s | peak GiB | reserved GiB | allocator retries/step | uncapped reserved GiB | room GiB | "
          "prediction off by (time / memory) |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for run in runs:
        if run["cap_gib"] is None:
            print_row(run, None, args.batch)
        elif measured := launch(run, args, gpus):
            print_row(run, measured, args.batch)


if __name__ == "__main__":
    main()
