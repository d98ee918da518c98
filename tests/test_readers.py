"""The shards read back with the real readers: webdataset, and DALI with our index files on the CPU."""

import io
import json
import math
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

from conftest import CLASSES, TRAIN_PER_CLASS, VAL_PER_CLASS


def _expected(shards: Path, root: Path) -> list[tuple[bytes, int]]:
    """(jpg bytes, label) of every source image, as the shards should hold them (converted ones read back)."""
    manifest = json.loads((shards / "manifest.json").read_text())
    converted = {c["source"] for info in manifest["splits"].values() for s in info["shards"] for c in s["conversions"]}
    label_of = {wnid: i for i, wnid in enumerate(manifest["classes"])}
    expected = []
    for path in sorted(root.glob("*/*/*.JPEG")):
        source = str(path.relative_to(root))
        if source not in converted:
            expected.append((path.read_bytes(), label_of[path.parent.name]))
    assert len(converted) == 3
    return expected


def test_webdataset_reads_every_sample_with_source_bytes_and_labels(prepared_shards, prepared_root):
    urls = [str(p) for p in sorted(prepared_shards.glob("*.tar"))]
    got = list(wds.WebDataset(urls, shardshuffle=False).to_tuple("jpg", "cls", "json"))
    assert len(got) == CLASSES * (TRAIN_PER_CLASS + VAL_PER_CLASS)
    by_source = {json.loads(meta)["source"]: (jpg, int(cls)) for jpg, cls, meta in got}
    expected = _expected(prepared_shards, prepared_root)
    assert sorted(v for v in by_source.values() if v in set(expected)) == sorted(expected)
    decoded = list(wds.WebDataset(urls, shardshuffle=False).decode("pil").to_tuple("jpg", "cls"))
    assert all(image.mode == "RGB" and 0 <= label < CLASSES for image, label in decoded)


def _dali_read(shards: list[Path], batch: int = 7) -> list[tuple[bytes, int]]:
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(batch_size=batch, num_threads=2, device_id=None)
    def pipeline():
        jpg, cls = fn.readers.webdataset(paths=[str(s) for s in shards],
                                         index_paths=[str(s.with_suffix(".idx")) for s in shards],
                                         ext=["jpg", "cls"], missing_component_behavior="error",
                                         pad_last_batch=True, name="reader")
        image = fn.decoders.image(jpg, device="cpu")
        return jpg, cls, image

    pipe = pipeline()
    pipe.build()
    total = pipe.epoch_size("reader")
    samples = []
    for _ in range(math.ceil(total / batch)):
        jpgs, labels, images = pipe.run()
        for i in range(len(jpgs)):
            image = np.array(images[i])
            assert image.ndim == 3 and image.shape[2] == 3
            samples.append((np.array(jpgs[i]).tobytes(), int(np.array(labels[i]).tobytes())))
    return samples[:total]


def test_dali_reads_every_sample_through_our_index_files(prepared_shards, prepared_root):
    shards = sorted(prepared_shards.glob("*.tar"))
    got = _dali_read(shards)
    assert len(got) == CLASSES * (TRAIN_PER_CLASS + VAL_PER_CLASS)
    expected = _expected(prepared_shards, prepared_root)
    assert len(set(got)) == len(got)
    assert sorted(s for s in got if s in set(expected)) == sorted(expected)
    for jpg, _ in got:
        with Image.open(io.BytesIO(jpg)) as image:
            assert (image.format, image.mode) == ("JPEG", "RGB")
