"""A minimal writer of plain ustar archives: integer mtime, no PAX headers, reproducible bytes."""

from typing import BinaryIO

from .errors import DataError
from .tarscan import BLOCK, padded

MTIME = 0  # a fixed mtime makes shards byte-for-byte reproducible
_END = bytes(2 * BLOCK)


def ustar_header(name: str, size: int) -> bytes:
    """The 512-byte ustar header of a regular file `name` holding `size` bytes."""
    raw = name.encode()
    if len(raw) > 100:
        raise DataError(f"member name {name!r} is longer than 100 bytes", fix="use shorter sample keys")
    header = bytearray(BLOCK)
    header[0:len(raw)] = raw
    header[100:108] = b"0000444\0"
    header[108:116] = b"0000000\0"
    header[116:124] = b"0000000\0"
    header[124:136] = b"%011o\0" % size
    header[136:148] = b"%011o\0" % MTIME
    header[148:156] = b" " * 8
    header[156] = ord("0")
    header[257:265] = b"ustar\x0000"
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


class UstarWriter:
    """Appends regular files to a binary stream; `close` writes the end-of-archive blocks."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    def add(self, name: str, data: bytes) -> None:
        self.stream.write(ustar_header(name, len(data)))
        self.stream.write(data)
        pad = padded(len(data)) - len(data)
        if pad:
            self.stream.write(bytes(pad))

    def close(self) -> None:
        self.stream.write(_END)
