"""scikit-learn's 8x8 digits as an ILSVRC-style folder, sharded and indexed by vitctl's own data path."""

import io
from pathlib import Path

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits

from vitctl.datasets.index import build_index
from vitctl.datasets.shard import ShardSpec, shard_split

VAL_EVERY = 6  # every 6th image is held out: 300 val, 1497 train


def write_digits(root: Path, size: int = 32) -> None:
    digits = load_digits()
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        split = "val" if i % VAL_EVERY == 0 else "train"
        folder = root / split / f"n{label:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        image = Image.fromarray((pixels * 255 / 16).astype(np.uint8)).resize((size, size), Image.BILINEAR)
        out = io.BytesIO()
        image.convert("RGB").save(out, format="JPEG", quality=95)
        (folder / f"digit_{i:04d}.JPEG").write_bytes(out.getvalue())


def digits_shards(workdir: Path) -> Path:
    write_digits(workdir / "root")
    out = workdir / "shards"
    for split in ("train", "val"):
        shard_split(workdir / "root", out, split, ShardSpec(maxcount=400), 2, lambda n: None, lambda n: None)
    for shard in sorted(out.glob("*.tar")):
        build_index(shard)
    return out
