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
