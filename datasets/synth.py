"""A small dataset in the real ILSVRC2012 archive formats, with learnable class-dependent images."""

import gzip
import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.io
from PIL import Image

from .atomic import partial_open, partial_path, publish, write_json_atomic
from .errors import DataError
from .extract import LEDGER, split_folder_around
from .ilsvrc import DEVKIT_DIR, GROUND_TRUTH, META_MAT, SYNSET_FIELDS, VAL_NAME
from .manifest import MANIFEST, file_sha256
from .oserrors import make_folder, os_errors_explained

TRAIN_TAR, VAL_TAR, DEVKIT = "ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar", "ILSVRC2012_devkit_t12.tar.gz"
MARKER = ".vitctl-synth.json"  # name -> [[bytes, sha256], ...] of the archives synth wrote here: its own to replace
MIN_CLASSES = 3  # the PNG, CMYK and grayscale images each take a class
MAX_TRAIN_NUMBER = 39_999  # a class's images are numbered from 1 to this, each number once
MAX_VAL_IMAGES = 99_999_999  # ILSVRC2012_val_<8 digits>.JPEG

# Real ImageNet-1k leaf WNIDs. IDs are given in this order, which (like the real devkit, where ID 1 is
# kit fox) is not sorted-WNID order, so code that confuses the two conventions fails on this data.
LEAVES = [
    ("n02119789", "kit fox"), ("n02100735", "English setter"), ("n02110185", "Siberian husky"),
    ("n02096294", "Australian terrier"), ("n02102040", "English springer"), ("n02066245", "grey whale"),
    ("n02509815", "lesser panda"), ("n02124075", "Egyptian cat"), ("n02417914", "ibex"),
    ("n02123394", "Persian cat"), ("n01440764", "tench"), ("n01443537", "goldfish"),
    ("n01484850", "great white shark"), ("n01491361", "tiger shark"), ("n01494475", "hammerhead"),
    ("n01496331", "electric ray"), ("n01498041", "stingray"), ("n01514668", "cock"), ("n01514859", "hen"),
    ("n01518878", "ostrich"), ("n01530575", "brambling"), ("n01531178", "goldfinch"),
    ("n01532829", "house finch"), ("n01534433", "junco"), ("n01537544", "indigo bunting"),
    ("n01558993", "robin"), ("n01560419", "bulbul"), ("n01580077", "jay"), ("n01582220", "magpie"),
    ("n01592084", "chickadee"), ("n02105855", "Shetland sheepdog"), ("n01739381", "vine snake"),
    ("n02077923", "sea lion"), ("n03018349", "china cabinet"), ("n04596742", "wok"), ("n13037406", "gyromitra"),
]
# Real internal (non-leaf) synsets; each synthetic dataset hangs its leaves under them.
INTERNAL = [("n00001740", "entity"), ("n01861778", "mammal"), ("n02075296", "carnivore")]


@dataclass(frozen=True)
class SynthSpec:
    classes: int = 10
    train_per_class: int = 20
    val_per_class: int = 5
    seed: int = 0

    def validate(self) -> None:
        if not MIN_CLASSES <= self.classes <= len(LEAVES):
            raise DataError(f"--classes must be between {MIN_CLASSES} (for the PNG, CMYK and grayscale images) and "
                            f"{len(LEAVES)} (the real WNIDs synth knows), got {self.classes}",
                            fix=f"pass --classes from {MIN_CLASSES} to {len(LEAVES)}")
        if self.train_per_class < 1 or self.val_per_class < 1:
            raise DataError("--train-per-class and --val-per-class must be at least 1")
        if self.train_per_class > MAX_TRAIN_NUMBER:
            raise DataError(f"--train-per-class must be at most {MAX_TRAIN_NUMBER:,} (a class's images are "
                            f"numbered from 1 to {MAX_TRAIN_NUMBER:,}), got {self.train_per_class:,}",
                            fix=f"pass --train-per-class from 1 to {MAX_TRAIN_NUMBER:,}")
        if self.classes * self.val_per_class > MAX_VAL_IMAGES:
            raise DataError(f"--classes x --val-per-class must be at most {MAX_VAL_IMAGES:,} (val images are numbered "
                            f"with 8 digits), got {self.classes * self.val_per_class:,}",
                            fix=f"pass --val-per-class from 1 to {MAX_VAL_IMAGES // self.classes:,}")


def class_image(rng: np.random.Generator, label: int, classes: int) -> Image.Image:
    """An RGB image whose colour and stripe direction identify the class, with noise and random size."""
    h, w = int(rng.integers(64, 97)), int(rng.integers(64, 97))
    hue = label / classes
    base = np.array([np.sin(2 * np.pi * (hue + k / 3)) * 0.5 + 0.5 for k in range(3)]) * 200 + 25
    angle = np.pi * label / classes
    yy, xx = np.mgrid[0:h, 0:w]
    stripes = np.sin((xx * np.cos(angle) + yy * np.sin(angle)) * 0.5 + rng.uniform(0, 2 * np.pi))
    pixels = base[None, None, :] * (0.75 + 0.25 * stripes[..., None]) + rng.normal(0, 12, (h, w, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def encode(image: Image.Image, gotcha: str | None) -> bytes:
    out = io.BytesIO()
    if gotcha == "png":
        image.save(out, format="PNG")
    else:
        mode = {"cmyk": "CMYK", "gray": "L"}.get(gotcha or "", "RGB")
        image.convert(mode).save(out, format="JPEG", quality=90)
    return out.getvalue()


# A MAT 5 file's 116 bytes of descriptive text, which savemat fills with its "Created on" time
MAT_HEADER = b"MATLAB 5.0 MAT-file, Platform: posix, Created by: vitctl data synth".ljust(116)

def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 1330000000, 0o644
    tar.addfile(info, io.BytesIO(data))


def _inner_tar(rng: np.random.Generator, wnid: str, label: int, spec: SynthSpec, gotcha: str | None) -> bytes:
    # Real member numbers are neither fixed-width nor consecutive.
    numbers = np.sort(rng.choice(np.arange(1, MAX_TRAIN_NUMBER + 1), size=spec.train_per_class, replace=False))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for i, k in enumerate(numbers):
            image = class_image(rng, label, spec.classes)
            _add(tar, f"{wnid}_{k}.JPEG", encode(image, gotcha if i == 0 else None))
    return buf.getvalue()


def synset_struct(leaves: list[tuple[str, str]]) -> np.ndarray:
    """meta.mat's `synsets` struct array: leaves with IDs 1..K, then internal synsets above them."""
    k = len(leaves)
    rows = [(i + 1, wnid, words, "", 0, np.zeros(0, np.uint16), 0, 1300) for i, (wnid, words) in enumerate(leaves)]
    child_ids = [[k + 2], [k + 3], list(range(1, k + 1))]  # entity -> mammal -> carnivore -> leaves
    for j, (wnid, words) in enumerate(INTERNAL):
        children = np.array(child_ids[j], np.uint16)
        rows.append((k + 1 + j, wnid, words, "", len(children), children, len(INTERNAL) - j, 0))
    struct = np.zeros((len(rows), 1), dtype=[(f, "O") for f in SYNSET_FIELDS])
    for i, row in enumerate(rows):
        for field, value in zip(SYNSET_FIELDS, row, strict=True):
            struct[i, 0][field] = value
    return struct


def devkit_bytes(leaves: list[tuple[str, str]], ground_truth: list[int]) -> bytes:
    """The devkit archive, the same bytes for the same classes: no clock time in it (savemat's header and gzip's
    both hold one), so that a rerun of synth writes what a fresh one does."""
    mat = io.BytesIO()
    scipy.io.savemat(mat, {"synsets": synset_struct(leaves)}, format="5")
    mat_bytes = MAT_HEADER + mat.getvalue()[len(MAT_HEADER):]
    truth = "".join(f"{i}\n" for i in ground_truth).encode()
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, f"{DEVKIT_DIR}/{META_MAT}", mat_bytes)
        _add(tar, f"{DEVKIT_DIR}/{GROUND_TRUTH}", truth)
    return buf.getvalue()


def write_synthetic(out: Path, spec: SynthSpec) -> dict[str, Path]:
    """Write the three archives into `out`; each appears only when complete. Returns their paths.

    Refuses to replace a file of those names that synth did not write (a real archive, downloaded there).
    """
    spec.validate()
    with os_errors_explained(out):
        paths = {"train": out / TRAIN_TAR, "val": out / VAL_TAR, "devkit": out / DEVKIT}
        marker = _load_marker(out)
        existing = [path for path in paths.values() if os.path.lexists(path)]
        foreign = [path.name for path in existing if not _written_by_synth(path, marker.get(path.name, []))]
        if foreign:
            raise DataError(f"holds {', '.join(foreign)}, which `vitctl data synth` did not write: writing would "
                            "replace them", str(out), "choose another OUT, or move those files out of it (synth "
                            "replaces only archives it wrote itself)")
        if kind := _other_kind(out):
            raise DataError(f"is {kind}: the archives would lie among its files", str(out),
                            f"choose a folder of their own, e.g. {out.parent / 'archives'}")
        if split := split_folder_around(out):  # shard would read the archives as images, or their folder as a class
            raise DataError(f"lies in {split}, a split folder of the dataset root {split.parent}", str(out),
                            f"choose a folder of their own, e.g. {split.parent.parent / 'archives'}")
        make_folder(out, "OUT")
        _write_archives(paths, spec, _Recorder(out, marker, {path.name: _digest(path) for path in existing}))
        return paths


def _other_kind(out: Path) -> str | None:
    """What vitctl wrote `out` as, where it is a folder another command writes into (shards, a dataset root, a run)."""
    if (out / MANIFEST).is_file():
        return "a shard folder (`vitctl data shard` wrote it)"
    if (out / LEDGER).is_file():
        return "a dataset root (`vitctl data extract` wrote it)"
    if (out / "checkpoints").is_dir() or (out / "metrics.jsonl").is_file():
        return "a run folder (`vitctl train` wrote it)"
    return None


def _digest(path: Path) -> list:
    return [path.stat().st_size, file_sha256(path)]


def _written_by_synth(path: Path, recorded: list[list]) -> bool:
    """Whether the marker records this very file; one of another size (a real archive) is not even read."""
    return path.is_file() and path.stat().st_size in [size for size, _ in recorded] and _digest(path) in recorded


def _load_marker(out: Path) -> dict[str, list[list]]:
    """The marker's records; none (or a damaged marker) makes no file here synth's."""
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(marker, dict):
        return {}
    return {name: [d for d in digests if isinstance(d, list) and len(d) == 2]
            for name, digests in marker.items() if isinstance(digests, list)}


class _Recorder:
    """Records each archive in the marker before it takes its name, so that the marker never misses one of ours."""

    def __init__(self, out: Path, marker: dict[str, list], current: dict[str, list]) -> None:
        self.out, self.marker, self.current = out, marker, current

    def publish(self, path: Path) -> None:
        # The file now under the name stays recorded too, in case the rename below never happens.
        new = _digest(partial_path(path))
        self.marker[path.name] = [d for d in (self.current.get(path.name), new) if d is not None]
        write_json_atomic(self.out / MARKER, self.marker)
        publish(path)
        self.current[path.name] = new


def _write_archives(paths: dict[str, Path], spec: SynthSpec, recorder: _Recorder) -> None:
    rng = np.random.default_rng(spec.seed)
    leaves = LEAVES[:spec.classes]
    gotchas = {0: "png", 1: "cmyk", 2: "gray"}
    with partial_open(paths["train"]) as f, tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT) as outer:
        for label, (wnid, _) in enumerate(leaves):
            _add(outer, f"{wnid}.tar", _inner_tar(rng, wnid, label, spec, gotchas.get(label)))
    recorder.publish(paths["train"])
    labels = rng.permutation(np.repeat(np.arange(spec.classes), spec.val_per_class))
    with partial_open(paths["val"]) as f, tarfile.open(fileobj=f, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for i, label in enumerate(labels):
            _add(tar, VAL_NAME.format(i + 1), encode(class_image(rng, int(label), spec.classes), None))
    recorder.publish(paths["val"])
    with partial_open(paths["devkit"]) as f:
        f.write(devkit_bytes(leaves, [int(label) + 1 for label in labels]))
    recorder.publish(paths["devkit"])
