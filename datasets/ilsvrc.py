"""ILSVRC2012 naming and the devkit: meta.mat synsets and the validation ground truth."""

import csv
import faulthandler
import importlib
import io
import multiprocessing
import re
import shlex
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DataError, listed

WNID = re.compile(r"n\d{8}")
VAL_NAME = "ILSVRC2012_val_{:08d}.JPEG"
VAL_PATTERN = re.compile(r"ILSVRC2012_val_(\d{8})\.JPEG")
META_MAT = "data/meta.mat"
GROUND_TRUTH = "data/ILSVRC2012_validation_ground_truth.txt"
SYNSET_FIELDS = ("ILSVRC2012_ID", "WNID", "words", "gloss", "num_children", "children",
                 "wordnet_height", "num_train_images")
LABEL_CONVENTION = "sorted-wnid-index"  # 0 = n01440764, as torchvision ImageFolder, timm and webdataset
# How the genuine archives are named in messages that ask for them.
TRAIN_ARCHIVE = "ILSVRC2012_img_train.tar (147,897,477,120 bytes, md5 1d675b47d978889d74fa0da5fadfb00e)"
VAL_ARCHIVE = "ILSVRC2012_img_val.tar (6,744,924,160 bytes, md5 29b22e2961454d5413ddabcf34fc5622)"
SOLUTION_CSV = "LOC_val_solution.csv"
DEVKIT_NAME = "ILSVRC2012_devkit_t12.tar.gz"
DEVKIT_DIR = "ILSVRC2012_devkit_t12"  # the folder every member of the devkit lies in
DEVKIT_AGAIN = f"download {DEVKIT_NAME} again (md5 fa75699e90414af021442c21a62c3abf)"
MEMBER_CAP = 16 << 20  # bytes read of meta.mat or the ground truth; the originals are about 0.5 MB and 250 kB
NOT_ORIGINAL = f"the devkit is not the original: {DEVKIT_AGAIN}"
SOLUTION_FIX = (f"pass Kaggle's {SOLUTION_CSV} (a CSV text file with the columns ImageId,PredictionString), or the "
                "devkit with --devkit")


@dataclass(frozen=True)
class Synset:
    ilsvrc_id: int
    wnid: str
    words: str
    num_children: int


def _find(tar: tarfile.TarFile, suffix: str) -> tarfile.TarInfo | None:
    return next((m for m in tar.getmembers() if m.isfile() and m.name.endswith(suffix)), None)


def _not_a_file(path: Path, what: str, fix: str) -> DataError:
    """A path that is missing, or names a pipe (`<(cat ...)`) or a device, which tarfile cannot read (it seeks)."""
    if not path.exists():
        return DataError(f"{what} not found", str(path), fix)
    return DataError(f"{what} is a pipe or a device, not a file: a tar archive is read from a file", str(path),
                     f"save it to a file first, and {fix}")


def _year_hint(tar: tarfile.TarFile) -> str:
    years = sorted({m for m in re.findall(r"ILSVRC(\d{4})", " ".join(tar.getnames()))})
    return f" (it names ILSVRC{', ILSVRC'.join(years)})" if years else ""


def _image_archive(tar: tarfile.TarFile, where: str) -> DataError | None:
    """The val or train image archive given as the devkit: named as such, with where it goes."""
    names = [Path(name).name for name in tar.getnames()[:100]]
    for split, pattern in (("val", VAL_PATTERN), ("train", re.compile(r"n\d{8}\.tar"))):
        if names and all(pattern.fullmatch(name) for name in names):
            archive = f"ILSVRC2012_img_{split}.tar"
            return DataError(f"this is {archive} (the {split} images), not the devkit", where,
                             f"pass it to `vitctl data extract --{split}-tar`, and {DEVKIT_NAME} as --devkit")
    return None


def read_devkit(path: Path) -> tuple[list[Synset], list[int]]:
    """Synsets from meta.mat and the ILSVRC2012_ID of each validation image, in filename order."""
    where = str(path)
    if path.is_dir():
        raise DataError("is a folder: --devkit takes the archive itself, not its unpacked files", where,
                        f"pass the path of {DEVKIT_NAME}")
    if not path.is_file():
        raise _not_a_file(path, "devkit", f"pass the path of {DEVKIT_NAME}")
    try:
        with tarfile.open(path, "r:*") as tar:
            meta, truth = _find(tar, META_MAT), _find(tar, GROUND_TRUTH)
            if meta is None or truth is None:
                if wrong := _image_archive(tar, where):
                    raise wrong
                missing = META_MAT if meta is None else GROUND_TRUTH
                raise DataError(f"not an ILSVRC2012 devkit: no {missing}{_year_hint(tar)}", where,
                                "use ILSVRC2012_devkit_t12.tar.gz (md5 fa75699e90414af021442c21a62c3abf)")
            mat_bytes, truth_bytes = _read_capped(tar, meta, where), _read_capped(tar, truth, where)
    except (tarfile.TarError, EOFError, OSError) as e:
        if _is_solution_csv(path):
            raise DataError(f"this is Kaggle's {SOLUTION_CSV}, not the devkit", where,
                            f"pass it with --solution {shlex.quote(str(path))} instead of --devkit") from None
        # tarfile lists why each of its methods (gz, bz2, xz, tar) failed: none of them read it
        said = "not a tar archive, plain or compressed" if str(e).startswith("file could not be opened") else str(e)
        raise DataError(f"cannot read the devkit archive ({said})", where,
                        f"the file is damaged or truncated, or not the devkit; download {DEVKIT_NAME} again") from None
    try:
        truth_text = truth_bytes.decode()
    except UnicodeDecodeError as e:
        raise DataError(f"member {truth.name} is damaged: not text ({e})", where, DEVKIT_AGAIN) from None
    return parse_meta(mat_bytes, where, meta.name), parse_ground_truth(truth_text, where)


def _read_capped(tar: tarfile.TarFile, member: tarfile.TarInfo, where: str) -> bytes:
    """The bytes of `member`, refused unread when it declares more than MEMBER_CAP (a gzip of a few MB can hold a
    member of GiBs, which would be read whole into memory)."""
    if member.size > MEMBER_CAP:
        raise DataError(f"member {member.name} is {member.size:,} bytes, where the original's is under 1 MB (vitctl "
                        f"reads at most {MEMBER_CAP:,})", where, NOT_ORIGINAL)
    return tar.extractfile(member).read()


def _is_solution_csv(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(40).lstrip(b"\xef\xbb\xbf").startswith(b"ImageId,")


def parse_meta(mat_bytes: bytes, where: str, member: str = META_MAT) -> list[Synset]:
    # scipy (0.5 s to import) loads here, not with this module, which every rank imports; before the fork, so that
    # each child has it
    importlib.import_module("scipy.io")
    verdict = _in_child(_read_synsets, mat_bytes)
    if verdict is None:
        raise DataError(f"member {member} is damaged (reading it crashed scipy's loadmat)", where, DEVKIT_AGAIN)
    kind, found = verdict
    if kind == "damaged":
        raise DataError(f"member {member} is damaged ({found})", where, DEVKIT_AGAIN)
    if kind == "no synsets":
        raise DataError(f"meta.mat has no readable 'synsets' struct ({found})", where, DEVKIT_AGAIN)
    if kind == "other ids":
        raise DataError(f"meta.mat is not from ILSVRC2012 (its synsets have {found})", where,
                        "use ILSVRC2012_devkit_t12.tar.gz")
    synsets = [Synset(*row) for row in found]
    _check_unique(synsets, where)
    return synsets


def _check_unique(synsets: list[Synset], where: str) -> None:
    """Refuse a meta.mat that gives two synsets the same ILSVRC2012_ID or WNID: valprep would merge their classes."""
    for field in ("ilsvrc_id", "wnid"):
        seen, repeated = set(), set()
        for s in synsets:
            value = getattr(s, field)
            (repeated if value in seen else seen).add(value)
        if repeated:
            name = "ILSVRC2012_ID" if field == "ilsvrc_id" else "WNID"
            raise DataError(f"meta.mat gives more than one synset the same {name}: "
                            f"{listed({str(v) for v in repeated})}", where, NOT_ORIGINAL)


def _read_synsets(mat_bytes: bytes) -> tuple[str, Any]:
    """loadmat's synsets as plain rows, or what is wrong: (kind, rows or message)."""
    import scipy.io  # loaded by parse_meta before the fork
    from scipy.io.matlab import MatReadError

    try:
        synsets = scipy.io.loadmat(io.BytesIO(mat_bytes), squeeze_me=True)["synsets"]
    # a meta.mat cut short raises OSError ("could not read bytes") or MatReadError, or IndexError at some lengths
    except (OSError, MatReadError, IndexError, NotImplementedError) as e:
        return "damaged", str(e)
    except (ValueError, KeyError, TypeError) as e:
        return "no synsets", str(e)
    fields = synsets.dtype.names or ()
    if "ILSVRC2012_ID" not in fields:
        return "other ids", [f for f in fields if f.endswith("_ID")] or list(fields)
    try:
        return "ok", [(int(s["ILSVRC2012_ID"]), str(s["WNID"]), str(s["words"]), int(s["num_children"]))
                      for s in np.atleast_1d(synsets)]
    except (ValueError, TypeError, IndexError) as e:
        return "damaged", str(e)


def _in_child(function: Callable[[bytes], Any], data: bytes) -> Any:
    """`function(data)` in a forked process; None if it died. Some damaged .mat files crash scipy's loadmat outright
    (a segfault), which no `except` would catch."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_send_result, args=(send, function, data))
    child.start()
    send.close()
    try:
        return receive.recv()
    except EOFError:
        return None
    finally:
        child.join()
        receive.close()


def _send_result(send: Connection, function: Callable[[bytes], Any], data: bytes) -> None:
    faulthandler.disable()  # a crash here is an answer, reported by the parent: no dump of this child's stack
    send.send(function(data))


def parse_ground_truth(text: str, where: str) -> list[int]:
    try:
        return [int(line) for line in text.split()]
    except ValueError as e:
        raise DataError(f"{GROUND_TRUTH} holds a non-integer line ({e})", where, DEVKIT_AGAIN) from None


def leaf_wnids(synsets: list[Synset]) -> dict[int, str]:
    """ILSVRC2012_ID -> WNID for the leaf classes (the ones images are labelled with)."""
    return {s.ilsvrc_id: s.wnid for s in synsets if s.num_children == 0}


def val_labels_from_devkit(path: Path) -> dict[str, str]:
    """Validation file name -> WNID, from the devkit."""
    synsets, truth = read_devkit(path)
    by_id = leaf_wnids(synsets)
    unknown = sorted({i for i in truth if i not in by_id})
    if unknown:
        raise DataError(f"ground truth names ILSVRC2012_IDs that are not leaf synsets in meta.mat: {unknown[:5]}",
                        str(path), "the devkit is damaged; download it again")
    return {VAL_NAME.format(i + 1): by_id[label] for i, label in enumerate(truth)}


def val_labels_from_solution(path: Path) -> dict[str, str]:
    """Validation file name -> WNID, from Kaggle's LOC_val_solution.csv (first WNID of each row)."""
    if not path.exists() or path.is_dir():  # a pipe (`<(zcat ...)`) is read once, as a file is
        raise DataError("solution file not found" if not path.exists() else "is a folder, not the solution file",
                        str(path), "pass the path of LOC_val_solution.csv")
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # a BOM, as Excel writes, is no part of the header
            return _solution_labels(csv.DictReader(f), str(path))
    except (UnicodeDecodeError, csv.Error) as e:  # a binary file: an archive, an image
        raise DataError(f"not a CSV text file ({e})", str(path), SOLUTION_FIX) from None


def _solution_labels(rows: csv.DictReader, where: str) -> dict[str, str]:
    header = rows.fieldnames or []
    if not {"ImageId", "PredictionString"} <= set(header):
        raise DataError(f"expected the columns ImageId,PredictionString, the header is {','.join(header)!r}", where,
                        SOLUTION_FIX)
    labels, row_of = {}, {}
    for row_number, row in enumerate(rows, start=2):
        image_id, prediction = row["ImageId"], row["PredictionString"] or ""  # None: the row ends early
        wnid = prediction.split()[0] if prediction.strip() else ""
        if not WNID.fullmatch(wnid):
            raise DataError(f"row {row_number}: no WNID in {prediction!r}", where,
                            f"begin row {row_number}'s PredictionString with the image's WNID (n and 8 digits), "
                            f"or pass the original {SOLUTION_CSV}")
        if image_id in row_of:  # which of the two is right cannot be told: the later one would silently win
            raise DataError(f"image {image_id} has two rows: row {row_of[image_id]} ({labels[image_id + '.JPEG']}) "
                            f"and row {row_number} ({wnid})", where,
                            f"keep the row of {image_id} with its right WNID and delete the other, or pass the "
                            f"original {SOLUTION_CSV}; nothing was moved")
        labels[f"{image_id}.JPEG"], row_of[image_id] = wnid, row_number
    return labels
