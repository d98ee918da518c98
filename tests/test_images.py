import io

import pytest
from PIL import Image

from vitctl.datasets.errors import DataError
from vitctl.datasets.images import jpeg_components, to_rgb_jpeg


def _encode(mode: str, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    Image.new(mode, (40, 30), 128 if mode == "L" else None).save(out, format=fmt, **kw)
    return out.getvalue()


def test_rgb_jpeg_is_kept_byte_for_byte():
    data = _encode("RGB", "JPEG", progressive=True)
    assert jpeg_components(data) == 3
    assert to_rgb_jpeg(data, "x") == (data, None)


@pytest.mark.parametrize(("mode", "fmt", "components", "kind"), [
    ("CMYK", "JPEG", 4, "jpeg CMYK -> RGB JPEG"),
    ("L", "JPEG", 1, "jpeg L -> RGB JPEG"),
    ("RGB", "PNG", None, "png RGB -> RGB JPEG"),
    ("RGBA", "PNG", None, "png RGBA -> RGB JPEG"),
])
def test_other_images_are_converted_to_rgb_jpeg(mode, fmt, components, kind):
    data = _encode(mode, fmt)
    assert jpeg_components(data) == components
    out, conversion = to_rgb_jpeg(data, "x")
    assert conversion == kind
    with Image.open(io.BytesIO(out)) as image:
        assert (image.format, image.mode, image.size) == ("JPEG", "RGB", (40, 30))


def test_truncated_jpeg_is_rejected_with_its_source():
    data = _encode("RGB", "JPEG")
    with pytest.raises(DataError, match="train/n0/a.JPEG: truncated JPEG"):
        to_rgb_jpeg(data[: len(data) * 2 // 3], "train/n0/a.JPEG")


def test_garbage_is_rejected():
    with pytest.raises(DataError, match="unreadable image"):
        to_rgb_jpeg(b"\x00" * 500, "x")


@pytest.mark.parametrize(("damage", "says"), [
    (lambda d: d.__setitem__(d.find(b"\xff\xc0") + 4, 12), "not in any format Pillow reads"),  # a 12-bit frame
    (lambda d: d.__setitem__(d.find(b"\xff\xda") + 3, d[d.find(b"\xff\xda") + 3] + 1), "broken data stream"),
])
def test_a_colour_jpeg_with_unsound_headers_is_refused_not_kept(damage, says):
    """Before: kept as it was (an end marker was all the fast path checked), and found only by training on it."""
    data = bytearray(_encode("RGB", "JPEG"))
    damage(data)
    with pytest.raises(DataError, match=f"x: unreadable image \\(.*{says}"):
        to_rgb_jpeg(bytes(data), "x")


def _with_frame(sof: int) -> bytes:
    """A colour JPEG whose SOF0 marker is made `sof`: a frame of another coding process over the same bytes."""
    data = bytearray(_encode("RGB", "JPEG"))
    data[data.find(b"\xff\xc0") + 1] = sof
    return bytes(data)


@pytest.mark.parametrize("sof", [0xC3, 0xC5, 0xC7, 0xCA, 0xCB, 0xCD, 0xCF])
def test_a_colour_jpeg_of_a_frame_pillow_cannot_decode_is_refused_not_kept(sof):
    """Before: a lossless, hierarchical or arithmetic frame passed the header check and was kept unopened, though
    Pillow (and DALI) cannot decode it."""
    with pytest.raises(DataError, match="x: unreadable image"):
        to_rgb_jpeg(_with_frame(sof), "x")


def test_an_arithmetic_colour_jpeg_pillow_decodes_is_converted_not_kept():
    """Pillow's libjpeg decodes a sequential arithmetic frame (SOF9); nvJPEG, which DALI uses, does not."""
    assert to_rgb_jpeg(_with_frame(0xC9), "x")[1] == "jpeg RGB -> RGB JPEG"


@pytest.mark.parametrize("progressive", [False, True])
def test_a_baseline_or_progressive_colour_jpeg_is_kept_unopened(progressive):
    data = _encode("RGB", "JPEG", progressive=progressive)
    assert to_rgb_jpeg(data, "x") == (data, None)
