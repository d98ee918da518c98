"""Checks on image bytes, and conversion of what is not an RGB JPEG into one."""

import io
from collections.abc import Iterator
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from .errors import DataError

_SOF_MARKERS = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
# Baseline, extended and progressive Huffman frames: what every decoder reads (nvJPEG and DALI too), so kept unopened.
# Lossless, hierarchical and arithmetic frames go the slow way: Pillow decodes or refuses them.
_COMMON_SOF = frozenset({0xC0, 0xC1, 0xC2})
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
JPEG_QUALITY = 95
# What Pillow raises for image bytes it cannot decode: OSError (UnidentifiedImageError, truncated or broken data),
# SyntaxError (some plugins' bad headers), DecompressionBombError (more pixels than Image.MAX_IMAGE_PIXELS allows).
PIL_ERRORS = (OSError, SyntaxError, Image.DecompressionBombError)


def _segments(data: bytes) -> Iterator[tuple[int, int, int]]:
    """(marker, offset, length field) of each marker segment of a JPEG after its SOI, in order, until a byte where a
    marker should begin is none (entropy-coded data, damage) or the data ends."""
    pos, end = 2, len(data)
    while pos + 4 <= end and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF or marker in _STANDALONE:  # a fill byte; a marker without a length
            pos += 1 if marker == 0xFF else 2
            continue
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        yield marker, pos, length
        pos += 2 + length


def jpeg_frame(data: bytes) -> tuple[int, int, int] | None:
    """(colour components, width, height) of a JPEG from its frame header (components: 1 gray, 3 YCbCr/RGB, 4 CMYK);
    None if not JPEG."""
    if data[:3] != b"\xff\xd8\xff":
        return None
    for marker, pos, _ in _segments(data):
        if marker in _SOF_MARKERS:  # FF Cn, length (2), precision (1), height (2), width (2), components (1)
            if pos + 9 >= len(data):
                return None
            height, width = int.from_bytes(data[pos + 5:pos + 7], "big"), int.from_bytes(data[pos + 7:pos + 9], "big")
            return data[pos + 9], width, height
        if marker == 0xDA:  # start of scan before any frame header
            return None
    return None


def jpeg_components(data: bytes) -> int | None:
    """Colour components of a JPEG read from its frame header (1 gray, 3 YCbCr/RGB, 4 CMYK); None if not JPEG."""
    frame = jpeg_frame(data)
    return None if frame is None else frame[0]


def _pillow_refuses(width: int, height: int) -> bool:
    """Whether Image.open refuses an image of this size as a possible decompression bomb (more than twice
    Image.MAX_IMAGE_PIXELS; None disables the guard)."""
    limit = Image.MAX_IMAGE_PIXELS
    return limit is not None and width * height > 2 * limit


def _headers_sound(data: bytes) -> bool:
    """Whether a JPEG's segments up to its first scan are what every decoder reads: an 8-bit baseline, extended or
    progressive frame, then a scan header of the length its component count gives. The others (12-bit, lossless,
    a damaged scan header) take the slow way, where Pillow refuses them, rather than failing where trained on."""
    frame = False
    for marker, pos, length in _segments(data):
        if length < 2 or pos + 2 + length > len(data):
            return False
        if marker in _SOF_MARKERS:
            frame = marker in _COMMON_SOF and data[pos + 4] == 8
        if marker == 0xDA:
            components = data[pos + 4]
            return frame and 1 <= components <= 4 and length == 6 + 2 * components
    return False


def has_jpeg_end(data: bytes) -> bool:
    """A complete JPEG has its EOI marker near the end; a truncated one has none.

    Entropy-coded data never holds FF D9 (FF is byte-stuffed), so only a real EOI matches; some cameras
    append a few bytes after it, hence the search in the tail rather than at the very end.
    """
    return b"\xff\xd9" in data[-1024:]


def to_rgb_jpeg(data: bytes, source: str) -> tuple[bytes, str | None]:
    """Return RGB JPEG bytes for `data` and the conversion done (None when the original bytes are kept).

    Raises DataError for an image that cannot be read (corrupt or truncated).
    """
    if not data:
        raise DataError("empty file (0 bytes)", source)
    frame = jpeg_frame(data)
    # a JPEG Pillow would refuse to open goes the slow way, to be refused here rather than where it is trained on
    if frame is not None and frame[0] == 3 and not _pillow_refuses(*frame[1:]):
        if not has_jpeg_end(data):
            raise DataError("truncated JPEG (no end-of-image marker)", source)
        if _headers_sound(data):
            return data, None
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            kind = f"{(image.format or 'unknown').lower()} {image.mode} -> RGB JPEG"
            out = io.BytesIO()
            image.convert("RGB").save(out, format="JPEG", quality=JPEG_QUALITY)
    except UnidentifiedImageError:  # its message holds the repr of the BytesIO, a different address each run
        suffix = Path(source).suffix.lower()
        if suffix and suffix not in Image.registered_extensions():  # notes.txt: no image at all
            raise DataError(f"not an image (a {suffix} file, in no format Pillow reads)", source) from None
        raise DataError("unreadable image (not in any format Pillow reads)", source) from None
    except (*PIL_ERRORS, ValueError) as e:
        raise DataError(f"unreadable image ({e})", source) from None
    return out.getvalue(), kind
