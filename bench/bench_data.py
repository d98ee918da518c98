"""Benchmark vitctl's data preparation against the usual tools, side by side on the same input.

Shard writing: vitctl's `shard_split` (1 and 2 workers) vs webdataset's `ShardWriter`.
Index building: vitctl's `build_index` (1 and 2 workers) vs DALI's `wds2idx` (CLI and in-process).
Run `python bench/bench_data.py --help` for the options; `make bench` runs it with the defaults.
"""

import argparse
import difflib
import io
import json
import os
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vitctl.datasets.index import build_index, index_path
from vitctl.datasets.parallel import run_tasks
from vitctl.datasets.shard import ShardSpec, shard_split
from vitctl.datasets.tarwrite import UstarWriter

# The first ten ImageNet-1k classes (sorted WNIDs).
WNIDS = ["n01440764", "n01443537", "n01484850", "n01491361", "n01494475",
         "n01496331", "n01498041", "n01514668", "n01514859", "n01518878"]
IMAGE_SIZE = (500, 375)  # width, height: a typical ImageNet photo
JPEG_QUALITY = 90  # with the noise below this gives ~110 KB per image, ImageNet's average
SEED = 0
MB = 1e6

# ----------------------------------------------------------------------------------------------------------------
# Machine and input


def machine_line() -> str:
    """CPU model, CPU count, Python, webdataset, DALI and tar versions, as one line."""
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    tar = "none"
    if shutil.which("tar"):
        tar = subprocess.run(["tar", "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    return (f"{cpu}, os.cpu_count()={os.cpu_count()}, Python {platform.python_version()}, "
            f"webdataset {_version('webdataset')}, DALI {_version('nvidia-dali-cuda130')} (wds2idx), {tar}")


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def make_jpeg(rng: np.random.Generator) -> bytes:
    """A photo-sized RGB JPEG: a two-colour gradient plus Gaussian noise, ~110 KB."""
    width, height = IMAGE_SIZE
    y = np.linspace(0, 1, height)[:, None, None]
    x = np.linspace(0, 1, width)[None, :, None]
    a, b = rng.uniform(0, 255, size=(2, 3))
    noise = rng.normal(0, rng.uniform(22, 34), size=(height, width, 3))
    pixels = np.clip(a * (1 - x) * (1 - y) + b * x * y + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=JPEG_QUALITY)
    return out.getvalue()


def _write_class(task: tuple[Path, int, int]) -> None:
    """Write the images of class number `label` (run in a pool)."""
    root, label, count = task
    wnid = WNIDS[label]
    folder = root / "train" / wnid
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([SEED, label])
    for k in range(count):
        (folder / f"{wnid}_{k}.JPEG").write_bytes(make_jpeg(rng))


def ensure_images(root: Path, images: int) -> list[Path]:
    """Generate `images` JPEGs under ROOT/train/<wnid>/ unless a previous run left exactly these; return them."""
    marker = root / "complete.json"
    wanted = {"images": images, "size": list(IMAGE_SIZE), "quality": JPEG_QUALITY, "seed": SEED}  # as JSON reads it
    if not (marker.is_file() and json.loads(marker.read_text()) == wanted):
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        counts = [images // len(WNIDS) + (i < images % len(WNIDS)) for i in range(len(WNIDS))]
        print(f"generating {images} JPEGs under {root} (not timed) ...", flush=True)
        with Pool(os.cpu_count()) as pool:
            pool.map(_write_class, [(root, i, n) for i, n in enumerate(counts)])
        marker.write_text(json.dumps(wanted))
    return sorted((root / "train").glob("*/*.JPEG"))


def warm_cache(paths: list[Path]) -> int:
    """Read every file once (untimed) so that all runs find them in the page cache; returns total bytes."""
    return sum(len(p.read_bytes()) for p in paths)


def fresh_dir(path: Path) -> Path:
    """An empty folder at `path` (shard_split resumes from whatever it finds otherwise)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def settle() -> None:
    """Flush dirty pages (untimed) so one run's write-back does not land in the next run's time."""
    os.sync()


# ----------------------------------------------------------------------------------------------------------------
# Shard writing


def run_ours_shard(root: Path, out: Path, workers: int, maxcount: int) -> float:
    """vitctl's shard_split into an empty folder; returns seconds."""
    spec = ShardSpec(maxsize=1 << 30, maxcount=maxcount, seed=SEED)
    start = time.perf_counter()
    shard_split(root, out, "train", spec, workers, progress=lambda n: None, on_total=lambda n: None)
    return time.perf_counter() - start


def run_wds_shard(root: Path, out: Path, maxcount: int, fsync: bool = False) -> float:
    """webdataset's ShardWriter over the same files in the same seeded order; returns seconds.

    Listing, shuffling and reading the files is timed, as a user's script would do it.
    """
    import webdataset as wds

    def sync_file(fname: str) -> None:
        with open(fname, "rb") as f:
            os.fsync(f.fileno())

    start = time.perf_counter()
    files = sorted((root / "train").glob("*/*.JPEG"))
    labels = {wnid: i for i, wnid in enumerate(sorted({p.parent.name for p in files}))}
    random.Random(SEED).shuffle(files)
    pattern = str(out / "imagenet-train-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=maxcount, verbose=0, post=sync_file if fsync else None) as sink:
        for path in files:
            wnid = path.parent.name
            sink.write({"__key__": path.stem, "jpg": path.read_bytes(), "cls": labels[wnid],
                        "json": {"wnid": wnid, "source": f"train/{wnid}/{path.name}"}})
    return time.perf_counter() - start


def folder_bytes(folder: Path, suffix: str = ".tar") -> int:
    return sum(p.stat().st_size for p in folder.glob(f"*{suffix}"))


def bench_shards(root: Path, work: Path, images: int, repeats: int) -> dict[str, list[float]]:
    """Alternate ours-1, ours-2, ShardWriter, ShardWriter+fsync for `repeats` rounds; returns seconds per tool."""
    maxcount = max(1, images // 8)
    runs: dict[str, Callable[[Path], float]] = {
        "vitctl shard_split, 1 worker": lambda out: run_ours_shard(root, out, 1, maxcount),
        "vitctl shard_split, 2 workers": lambda out: run_ours_shard(root, out, 2, maxcount),
        "webdataset ShardWriter": lambda out: run_wds_shard(root, out, maxcount),
        "ShardWriter + fsync per shard": lambda out: run_wds_shard(root, out, maxcount, fsync=True),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    sizes: dict[str, int] = {}
    for round_ in range(repeats):
        for i, (name, run) in enumerate(runs.items()):
            out = fresh_dir(work / f"shards-{i}")
            settle()
            times[name].append(run(out))
            sizes[name] = folder_bytes(out)
            shutil.rmtree(out)
        print(f"  round {round_ + 1}/{repeats}: " + ", ".join(f"{t[-1]:.3f}s" for t in times.values()), flush=True)
    settle()
    print("  output bytes: " + ", ".join(f"{name}: {size / MB:.1f} MB" for name, size in sizes.items()))
    return times


# ----------------------------------------------------------------------------------------------------------------
# Memory (a child process of this script, so its peak RSS is its own)


def status_kib(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def only_shard(args: argparse.Namespace) -> None:
    """The `--only` entry point: one shard run, then its memory figures as a JSON line.

    ru_maxrss of RUSAGE_SELF also counts the launching process's peak (Linux carries it across exec), so
    the main process's own peak is read from VmHWM, reset after the imports; workers' from RUSAGE_CHILDREN.
    """
    if args.only == "wds-shard":
        import webdataset  # noqa: F401  (imported before the baseline: it pulls in torch)
    imports_kib = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    if args.only == "ours-shard":
        seconds = run_ours_shard(args.root, fresh_dir(args.out), args.workers, args.maxcount)
    else:
        seconds = run_wds_shard(args.root, fresh_dir(args.out), args.maxcount)
    print(json.dumps({"seconds": seconds, "imports_kib": imports_kib, "peak_kib": status_kib("VmHWM"),
                      "ru_self_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "ru_children_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))


def measure_memory(root: Path, work: Path, images: int) -> dict[str, dict[str, Any]]:
    """Peak RSS of each shard writer, each run once in a fresh interpreter."""
    results = {}
    cases = {"vitctl shard_split, 1 worker": ["--only", "ours-shard", "--workers", "1"],
             "vitctl shard_split, 2 workers": ["--only", "ours-shard", "--workers", "2"],
             "webdataset ShardWriter": ["--only", "wds-shard"]}
    for name, extra in cases.items():
        out = work / "shards-mem"
        cmd = [sys.executable, __file__, *extra, "--root", str(root), "--out", str(out),
               "--maxcount", str(max(1, images // 8))]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  {name}: " + ", ".join(f"{k} {v / 1024:.0f} MiB" if k.endswith("kib") else f"{k} {v:.3f}"
                                        for k, v in results[name].items()), flush=True)
        shutil.rmtree(out)
    return results


# ----------------------------------------------------------------------------------------------------------------
# Index building


def ensure_index_shards(folder: Path, shards: int, samples: int, payload: int) -> list[Path]:
    """Write `shards` tars of `samples` cls/jpg/json samples (jpg ~`payload` bytes) unless already there."""
    marker = folder / "complete.json"
    wanted = {"shards": shards, "samples": samples, "payload": payload, "seed": SEED}
    paths = [folder / f"imagenet-train-{i:06d}.tar" for i in range(shards)]
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return paths
    fresh_dir(folder)
    print(f"writing {shards} index-test shards of {samples} samples under {folder} (not timed) ...", flush=True)
    rng = random.Random(SEED)
    blob = os.urandom(2 * payload)
    for i, path in enumerate(paths):
        with open(path, "wb", buffering=1 << 20) as f:
            tar = UstarWriter(f)
            for k in range(samples):
                label = rng.randrange(len(WNIDS))
                wnid, key = WNIDS[label], f"{WNIDS[label]}_{i * samples + k}"
                tar.add(f"{key}.cls", str(label).encode())
                tar.add(f"{key}.jpg", blob[:rng.randint(payload * 6 // 10, payload * 14 // 10)])
                tar.add(f"{key}.json", json.dumps({"wnid": wnid, "source": f"train/{wnid}/{key}.JPEG"}).encode())
            tar.close()
    marker.write_text(json.dumps(wanted))
    return paths


def run_ours_index(paths: list[Path], workers: int) -> float:
    """vitctl's build_index over all shards (inline for 1 worker, else run_tasks); returns seconds."""
    start = time.perf_counter()
    if workers == 1:
        for path in paths:
            build_index(path)
    else:
        list(run_tasks(build_index, [(p,) for p in paths], workers))
    return time.perf_counter() - start


def dali_index(idx_dir: Path, shard: Path) -> Path:
    return idx_dir / f"{shard.stem}.idx"


def run_wds2idx_cli(paths: list[Path], idx_dir: Path) -> float:
    """`wds2idx <archive> <index>` as users run it: one process per shard, one after another; returns seconds."""
    cli = shutil.which("wds2idx", path=str(Path(sys.executable).parent)) or "wds2idx"
    start = time.perf_counter()
    for path in paths:
        subprocess.run([cli, str(path), str(dali_index(idx_dir, path))], check=True, capture_output=True)
    return time.perf_counter() - start


def run_wds2idx_inproc(paths: list[Path], idx_dir: Path) -> float:
    """wds2idx's IndexCreator called in this process (it still runs `tar --list` twice per shard)."""
    from wds2idx import IndexCreator

    start = time.perf_counter()
    for path in paths:
        with IndexCreator(str(path), str(dali_index(idx_dir, path)), verbose=False) as creator:
            creator.create_index()
    return time.perf_counter() - start


def bench_index(paths: list[Path], idx_dir: Path, repeats: int) -> dict[str, list[float]]:
    """Alternate ours-1, ours-2, wds2idx CLI, wds2idx in-process for `repeats` rounds; returns seconds per tool."""
    fresh_dir(idx_dir)
    runs: dict[str, Callable[[], float]] = {
        "vitctl build_index, 1 worker": lambda: run_ours_index(paths, 1),
        "vitctl build_index, 2 workers": lambda: run_ours_index(paths, 2),
        "DALI wds2idx CLI (1 process per shard)": lambda: run_wds2idx_cli(paths, idx_dir),
        "DALI wds2idx IndexCreator in-process": lambda: run_wds2idx_inproc(paths, idx_dir),
    }
    for path in paths:  # untimed warm-up: headers into the page cache, tar binary loaded
        path.read_bytes()
    run_wds2idx_inproc(paths, idx_dir)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(repeats):
        for name, run in runs.items():
            settle()
            times[name].append(run())
        print(f"  round {round_ + 1}/{repeats}: " + ", ".join(f"{t[-1]:.3f}s" for t in times.values()), flush=True)
    return times


def check_indexes(paths: list[Path], idx_dir: Path) -> str:
    """Compare our index text with wds2idx's for each shard; returns a one-line verdict (diffs printed)."""
    exact = normalised = 0
    for path in paths:
        ours, theirs = index_path(path).read_text(), dali_index(idx_dir, path).read_text()
        if ours == theirs:
            exact += 1
            continue
        a = [line.rstrip() for line in ours.rstrip().splitlines()]
        b = [line.rstrip() for line in theirs.rstrip().splitlines()]
        if a == b:
            normalised += 1
            continue
        diff = list(difflib.unified_diff(a, b, "vitctl", "wds2idx", n=0, lineterm=""))
        changed = sum(1 for d in diff if d[:1] in "+-" and d[:3] not in ("+++", "---"))
        print(f"  {path.name}: {changed} differing lines; first ones:")
        print("\n".join("    " + d for d in diff[:8]))
    verdict = f"{exact}/{len(paths)} byte-identical"
    if normalised:
        verdict += f", {normalised} equal after stripping trailing whitespace"
    return verdict


# ----------------------------------------------------------------------------------------------------------------
# Report


def median_row(name: str, seconds: list[float], count: int, nbytes: int, baseline: float | None) -> str:
    """One markdown table row: median seconds, items/s, MB/s, spread and speed relative to the baseline."""
    med = statistics.median(seconds)
    ratio = f"{baseline / med:.2f}x" if baseline else "1.00x (baseline)"
    spread = f"{min(seconds):.3f}-{max(seconds):.3f}"
    return f"| {name} | {med:.3f} | {spread} | {count / med:,.0f} | {nbytes / MB / med:,.0f} | {ratio} |"


def table(times: dict[str, list[float]], baseline: str, count: int, nbytes: int, unit: str) -> list[str]:
    """A markdown table of `times`, with speed relative to the `baseline` tool (>1x: faster than it)."""
    base = statistics.median(times[baseline])
    lines = [f"| Tool | Median s | Min-max s | {unit}/s | MB/s | Speed vs {baseline} |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, seconds in times.items():
        lines.append(median_row(name, seconds, count, nbytes, None if name == baseline else base))
    return lines


def memory_lines(memory: dict[str, dict[str, Any]], input_bytes: int) -> list[str]:
    """A markdown table of peak RSS per shard writer, in MiB."""
    lines = ["| Tool | Main process: RSS after imports | Main process: peak RSS during the run (VmHWM) | "
             "Largest worker: peak RSS (ru_maxrss, RUSAGE_CHILDREN) | Input |", "|---|---:|---:|---:|---:|"]
    for name, m in memory.items():
        children = f"{m['ru_children_kib'] / 1024:.0f}" if m["ru_children_kib"] else "- (no workers)"
        lines.append(f"| {name} | {m['imports_kib'] / 1024:.0f} | {m['peak_kib'] / 1024:.0f} | {children} | "
                     f"{input_bytes / 2**20:.0f} |")
    return lines


# ----------------------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=3000, help="JPEGs to shard (~110 KB each; default 3000)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per tool; medians are reported (default 5)")
    p.add_argument("--workdir", type=Path, help="keep generated inputs here and reuse them (default: a temp folder)")
    p.add_argument("--index-samples", type=int, default=8700, help="samples per index-test shard (default 8700)")
    p.add_argument("--index-shards", type=int, default=4, help="index-test shards (default 4)")
    p.add_argument("--index-payload", type=int, default=115_000,
                   help="mean jpg bytes per index-test sample (default 115000: ~1 GB shards of 8700 samples)")
    p.add_argument("--skip-index", action="store_true", help="only benchmark shard writing")
    # Internal: one shard run in a child process, for its peak RSS.
    p.add_argument("--only", choices=["ours-shard", "wds-shard"], help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--maxcount", type=int, default=1000, help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.only:
        only_shard(args)
        return
    temp = None if args.workdir else tempfile.TemporaryDirectory(prefix="vitctl-bench-")
    work = args.workdir.resolve() if args.workdir else Path(temp.name)
    try:
        run(args, work)
    finally:
        if temp is not None:
            temp.cleanup()


def run(args: argparse.Namespace, work: Path) -> None:
    """All benchmarks in order, then the markdown report."""
    machine = machine_line()
    print(f"machine: {machine}\nworkdir: {work}\n")
    report = [] if args.skip_index else bench_index_section(args, work)
    root = work / "imagenet"
    files = ensure_images(root, args.images)
    input_bytes = warm_cache(files)
    print(f"input: {len(files)} JPEGs, {input_bytes / MB:.1f} MB, mean {input_bytes / len(files) / 1e3:.1f} KB; "
          f"maxcount {max(1, args.images // 8)}\n\n[2/3] shard writing, {args.repeats} rounds "
          "(vitctl-1, vitctl-2, ShardWriter, ShardWriter+fsync):", flush=True)
    shard_times = bench_shards(root, work, len(files), args.repeats)
    print("\n[3/3] peak RSS of shard writing (one run each, fresh interpreter) ...", flush=True)
    memory = measure_memory(root, work, len(files))
    report = ["### Shard writing", "",
              f"{len(files)} JPEGs ({input_bytes / MB:.0f} MB, mean {input_bytes / len(files) / 1e3:.0f} KB), "
              f"maxcount {max(1, args.images // 8)}, median of {args.repeats} alternating runs, warm page cache.", "",
              *table(shard_times, "webdataset ShardWriter", len(files), input_bytes, "images"), "",
              "### Peak memory of shard writing", "", *memory_lines(memory, input_bytes), "",
              "MiB; one run each in a fresh interpreter. ru_maxrss of RUSAGE_SELF read "
              + ", ".join(sorted({f"{m['ru_self_kib'] / 1024:.0f}" for m in memory.values()}))
              + " MiB in these children: Linux carries the launching process's peak across exec, "
              "so the main process's figure is VmHWM, reset after the imports.", "", *report]
    print("\n" + "-" * 100 + f"\n\nMachine: {machine}\n\n" + "\n".join(report))


def bench_index_section(args: argparse.Namespace, work: Path) -> list[str]:
    """Index building, run first: once webdataset (and with it torch) is imported, every fork costs more."""
    folder = work / f"index-shards-{args.index_shards}x{args.index_samples}"
    paths = ensure_index_shards(folder, args.index_shards, args.index_samples, args.index_payload)
    shard_bytes = sum(p.stat().st_size for p in paths)
    print(f"[1/3] index building over {len(paths)} shards ({shard_bytes / MB:,.0f} MB, "
          f"{args.index_samples * len(paths)} samples, {3 * args.index_samples * len(paths)} members), "
          f"{args.repeats} rounds:", flush=True)
    index_times = bench_index(paths, work / "idx-dali", args.repeats)
    verdict = check_indexes(paths, work / "idx-dali")
    print(f"  vitctl index files vs wds2idx output: {verdict}\n")
    return ["### Index building", "",
            f"{len(paths)} shards x {args.index_samples} samples (cls/jpg/json; {shard_bytes / MB:,.0f} MB "
            f"in all), median of {args.repeats} alternating runs, warm page cache. "
            f"Index files: {verdict} with wds2idx's.", "",
            *table(index_times, "DALI wds2idx CLI (1 process per shard)", args.index_samples * len(paths),
                   shard_bytes, "samples")]


if __name__ == "__main__":
    main()
