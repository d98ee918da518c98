"""Read tar member headers without reading member data: ustar, GNU long names and PAX headers."""

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

from .errors import DataError

BLOCK = 512
_ADLER_MOD = 65521
REGULAR = frozenset(b"0\0")
_GNU_LONGNAME, _GNU_LONGLINK, _PAX, _PAX_GLOBAL = ord("L"), ord("K"), ord("x"), ord("g")
_EXTENSION_HEADERS = frozenset((_GNU_LONGNAME, _GNU_LONGLINK, _PAX, _PAX_GLOBAL))
TYPE_NAMES = {ord("1"): "hard link", ord("2"): "symbolic link", ord("3"): "character device",
              ord("4"): "block device", ord("5"): "directory", ord("6"): "FIFO"}


class TarMember(NamedTuple):  # a NamedTuple: built once per member on the hot path, cheaper than a dataclass
    name: str
    type: int  # the typeflag byte
    offset: int  # offset of the data (after all headers), a multiple of 512
    size: int

    @property
    def is_file(self) -> bool:
        return self.type in REGULAR

    @property
    def type_name(self) -> str:
        return "regular file" if self.is_file else TYPE_NAMES.get(self.type, f"type {chr(self.type)!r}")


def padded(size: int) -> int:
    return (size + BLOCK - 1) // BLOCK * BLOCK


def _octal(field: bytes, where: str, pos: int) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for sizes of 8 GiB and more
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise DataError(f"not a tar archive or corrupt header at byte {pos} (bad number {digits!r})", where,
                        "check that this is the right file and that it is not damaged") from None


def _cstr(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax_records(data: bytes, where: str) -> dict[str, str]:
    records, pos = {}, 0
    while pos < len(data) and data[pos:pos + 1] != b"\0":
        length_text, _, _ = data[pos:pos + 20].partition(b" ")
        try:
            length = int(length_text)
        except ValueError:
            raise DataError("corrupt PAX header", where) from None
        key, _, value = data[pos + len(length_text) + 1:pos + length - 1].partition(b"=")
        records[key.decode()] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def _number(field: bytes, where: str, pos: int) -> int:
    try:  # the common case, inline: octal digits then NUL or space
        return int(field.split(b"\0", 1)[0] or b"0", 8)
    except ValueError:
        return _octal(field, where, pos)


def scan(f: BinaryIO, file_size: int, where: str) -> Iterator[TarMember]:
    """Yield the members of the tar open as `f`, checking each lies inside its `file_size` bytes.

    Raises DataError for a truncated archive (data past the end, or no end-of-archive block).
    """
    pos = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    zero = bytes(BLOCK)
    while True:
        f.seek(pos)
        header = f.read(BLOCK)
        if len(header) < BLOCK:
            raise DataError(f"truncated: ends at byte {file_size} inside or before a tar header "
                            "(no end-of-archive marker)", where, "the file is incomplete; copy or download it again")
        if header == zero:
            return
        checksum_field = header[148:156]
        # The tar checksum is the byte sum with its own field as spaces. Adler-32's low half is that byte sum
        # (plus one) mod 65521, computed in C: several times faster than sum() on the hot path.
        expected = _number(checksum_field, where, pos) + sum(checksum_field) - 8 * 32 + 1
        if expected % _ADLER_MOD != zlib.adler32(header) & 0xFFFF:
            raise DataError(f"not a tar archive or corrupt header at byte {pos} (checksum mismatch)", where,
                            "check that this is the right file and that it is not damaged")
        size = _number(header[124:136], where, pos)
        kind = header[156]
        data_at = pos + BLOCK
        if data_at + size > file_size:
            raise DataError(f"truncated: member at byte {pos} needs {size} bytes but the file ends at byte "
                            f"{file_size}", where, "the file is incomplete; copy or download it again")
        pos = data_at + padded(size)
        if kind in _EXTENSION_HEADERS:
            f.seek(data_at)
            data = f.read(size)
            if kind == _GNU_LONGNAME:
                long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif kind == _PAX:
                pax = _pax_records(data, where)
            continue
        name = pax.get("path") or long_name
        if name is None:
            name = _cstr(header[0:100])
            if header[345] and header[257:262] == b"ustar":
                name = f"{_cstr(header[345:500])}/{name}"
        if "size" in pax:
            size = int(pax["size"])
            pos = data_at + padded(size)
        yield TarMember(name, kind, data_at, size)
        if long_name is not None or pax:
            long_name, pax = None, {}


def scan_path(path: Path) -> list[TarMember]:
    """All members of the tar file at `path`."""
    with open(path, "rb", buffering=0) as f:
        return list(scan(f, path.stat().st_size, str(path)))


def check_safe(member: TarMember, archive: str, flat: bool = True) -> None:
    """Reject links, devices, absolute paths and `..`; with `flat`, any path with a folder."""
    if not member.is_file:
        raise DataError(f"member {member.name!r} is a {member.type_name}; only regular files are accepted",
                        archive, "this is not a genuine ILSVRC2012 archive, or it was repacked; use the original")
    parts = member.name.split("/")
    if member.name.startswith("/") or ".." in parts or (flat and len(parts) > 1):
        raise DataError(f"unsafe member path {member.name!r} (absolute, '..' or nested)", archive,
                        "refusing to extract it; use the original archive")
