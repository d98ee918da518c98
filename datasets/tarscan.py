"""Read tar member headers without reading member data, as Python's tarfile (and so webdataset) reads them."""

import re
import shlex
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

from .errors import DataError

BLOCK = 512
_ADLER_MOD = 65521
REGULAR = frozenset(b"0\x007")  # tarfile's regular types, less GNU sparse files (their bytes are not in one run)
DIRECTORY, SPARSE = ord("5"), ord("S")
_NO_DATA = frozenset(b"123456")  # tarfile reads no data after links, devices, folders and FIFOs, whatever their size
_GNU_LONGNAME, _GNU_LONGLINK, _PAX, _PAX_GLOBAL, _SOLARIS_PAX = ord("L"), ord("K"), ord("x"), ord("g"), ord("X")
_EXTENSION_HEADERS = frozenset((_GNU_LONGNAME, _GNU_LONGLINK, _PAX, _PAX_GLOBAL, _SOLARIS_PAX))
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")
TYPE_NAMES = {ord("1"): "hard link", ord("2"): "symbolic link", ord("3"): "character device",
              ord("4"): "block device", DIRECTORY: "directory", ord("6"): "FIFO", SPARSE: "GNU sparse file"}
_CORRUPT_FIX = "check that this is the right file and that it is not damaged"
# What a compressed tar begins with: (magic bytes, compressor, file suffix, the command that decompresses a copy)
_COMPRESSED = [(b"\x1f\x8b", "gzip", ".gz", "gunzip --keep"), (b"BZh", "bzip2", ".bz2", "bunzip2 --keep"),
               (b"\xfd7zXZ\x00", "xz", ".xz", "unxz --keep"), (b"\x28\xb5\x2f\xfd", "zstd", ".zst", "unzstd --keep")]
_ZIP_MAGIC = b"PK\x03\x04"
_CONTROL = re.compile(r"[\x00-\x1f\x7f]").search
NAME_MAX = 255  # bytes in one file name, on ext4, XFS, btrfs and most others
_UNSAFE_FIX = "refusing to extract it; use the original archive"


class TarMember(NamedTuple):  # a NamedTuple: built once per member on the hot path, cheaper than a dataclass
    name: str
    type: int  # the typeflag byte (a V7 regular file whose name ends in '/' is a directory, as in tarfile)
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


def _corrupt(what: str, where: str, pos: int) -> DataError:
    return DataError(f"not a tar archive or corrupt header at byte {pos} ({what})", where, _CORRUPT_FIX)


def _not_a_plain_tar(header: bytes, where: str) -> DataError | None:
    """A compressed tar (`.tar.gz`, `.tar.xz` ...) or a zip archive where an uncompressed tar is read in place."""
    if header.startswith(_ZIP_MAGIC):
        return DataError("the file is a zip archive (it begins with the zip bytes 50 4b 03 04), not a tar", where,
                         "pass the tar archive itself (if this zip holds it, unzip it first): vitctl reads tar "
                         "members in place")
    for magic, name, suffix, command in _COMPRESSED:
        if header.startswith(magic):
            if where.endswith(suffix):
                plain = where[:-len(suffix)]
                how = f"`{command} {shlex.quote(where)}` writes {plain}"
            else:  # without the suffix, gunzip and the others refuse the name ("unknown suffix")
                plain = (where[:-4] if where.endswith(".tar") else where) + "-decompressed.tar"
                how = f"`{name} -dc {shlex.quote(where)} > {shlex.quote(plain)}` writes {plain}"
            return DataError(f"the file is {name}-compressed (it begins with the {name} bytes {magic.hex(' ')}), not "
                             "an uncompressed tar", where,
                             f"decompress it ({how}) and pass {plain}: vitctl reads tar members in place")
    return None


def _octal(field: bytes, where: str, pos: int) -> int:
    if field[:1] == b"\x80":  # GNU base-256, for sizes of 8 GiB and more
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip()
    try:
        return int(digits, 8) if digits else 0
    except ValueError:  # a negative base-256 number (0xff) lands here too: no size or checksum is negative
        raise _corrupt(f"bad number {field!r}", where, pos) from None


def _number(field: bytes, where: str, pos: int) -> int:
    try:  # the common case, inline: octal digits then NUL or space
        return int(field.split(b"\0", 1)[0] or b"0", 8)
    except ValueError:
        return _octal(field, where, pos)


def _checksum_ok(header: bytes, stored: int) -> bool:
    """The byte sum with the checksum field as spaces; old Sun tars summed signed bytes, which tarfile accepts too."""
    # Adler-32's low half is that byte sum (plus one) mod 65521, computed in C: several times faster than sum().
    checksum_field = header[148:156]
    if (stored + sum(checksum_field) - 8 * 32 + 1) % _ADLER_MOD == zlib.adler32(header) & 0xFFFF:
        return True
    rest = header[:148] + header[156:]
    unsigned = 8 * 32 + sum(rest)
    return stored in (unsigned, unsigned - 256 * sum(b >= 0x80 for b in rest))


def _cstr(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax_records(data: bytes, where: str, pos: int) -> dict[str, str]:
    """`<length> <key>=<value>\\n` records, parsed as tarfile does."""
    records, at = {}, 0
    while match := _PAX_RECORD.match(data, at):
        length = int(match[1])
        if length == 0:
            raise _corrupt("PAX record of length 0", where, pos)
        value = data[match.end(2) + 1:match.start(1) + length - 1]
        records[match[2].decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        at += length
    return records


def _apply_pax(records: dict[str, str], name: str, size: int, where: str, pos: int) -> tuple[str, int]:
    if "path" in records:
        name = records["path"].rstrip("/")
    name = records.get("GNU.sparse.name", name)
    if "size" in records:
        try:
            size = int(records["size"])
        except ValueError:
            raise _corrupt(f"PAX size {records['size']!r}", where, pos) from None
        if size < 0:  # tarfile takes it, and reads the member as empty
            raise _corrupt(f"negative PAX size {records['size']!r}", where, pos)
    return name, size


def _skip_sparse_map(f: BinaryIO, header: bytes, data_at: int) -> int:
    """Where an old-GNU sparse file's data starts: after its extension blocks of sparse map entries."""
    extended = header[482]
    while extended:
        f.seek(data_at)
        extended = f.read(BLOCK)[504:505] not in (b"", b"\0")
        data_at += BLOCK
    return data_at


def scan(f: BinaryIO, file_size: int, where: str) -> Iterator[TarMember]:
    """Yield the members of the tar open as `f`, checking each lies inside its `file_size` bytes.

    Names, types, data offsets and sizes are tarfile's, including GNU long names, PAX and PAX global headers
    and ustar prefixes. Raises DataError for a truncated archive or a corrupt header, which tarfile may pass over.
    """
    pos = 0
    extensions: list[tuple[int, object]] = []  # (type, long name or PAX records) before the next member
    global_pax: dict[str, str] = {}
    zero = bytes(BLOCK)
    while True:
        f.seek(pos)
        header = f.read(BLOCK)
        if len(header) < BLOCK:
            raise DataError(f"truncated: ends at byte {file_size} inside or before a tar header "
                            "(no end-of-archive marker)", where, "the file is incomplete; copy or download it again")
        if pos == 0 and (error := _not_a_plain_tar(header, where)):
            raise error
        if header == zero:
            if extensions:
                raise _corrupt("an extended header is followed by no member", where, pos)
            return
        if not _checksum_ok(header, _number(header[148:156], where, pos)):
            raise _corrupt("checksum mismatch", where, pos)
        size = _number(header[124:136], where, pos)
        kind = header[156]
        data_at = pos + BLOCK
        if kind in _EXTENSION_HEADERS:
            pos = _check_inside(data_at, size, file_size, where, pos)
            f.seek(data_at)
            data = f.read(size)
            if kind == _GNU_LONGNAME:
                extensions.append((kind, _cstr(data)))
            elif kind == _PAX_GLOBAL:
                global_pax.update(_pax_records(data, where, data_at - BLOCK))
            elif kind != _GNU_LONGLINK:  # a link's target: nothing this module reports
                extensions.append((_PAX, {**global_pax, **_pax_records(data, where, data_at - BLOCK)}))
            continue
        name = _cstr(header[0:100])
        if kind == 0 and name.endswith("/"):  # a V7 directory
            kind = DIRECTORY
        if kind == SPARSE:
            data_at = _skip_sparse_map(f, header, data_at)
        elif header[345]:
            name = f"{_cstr(header[345:500])}/{name}"
        if kind == DIRECTORY:
            name = name.rstrip("/")
        if global_pax or extensions:
            name, kind, size, data_size = _extended(name, kind, size, global_pax, extensions, where, pos)
            extensions = []
        else:
            data_size = size
        pos = data_at if kind in _NO_DATA else _check_inside(data_at, data_size, file_size, where, pos)
        yield TarMember(name, kind, data_at, size)


def _extended(name: str, kind: int, size: int, global_pax: dict[str, str], extensions: list[tuple[int, object]],
              where: str, pos: int) -> tuple[str, int, int, int]:
    """(name, type, size, bytes of data that follow) once the extended headers apply, innermost first, as tarfile."""
    data_size = size
    name, size = _apply_pax(global_pax, name, size, where, pos)
    if kind == DIRECTORY:
        name = name.rstrip("/")
    for ext_kind, value in reversed(extensions):
        if ext_kind == _GNU_LONGNAME:
            name = value.removesuffix("/") if kind == DIRECTORY else value
            continue
        name, size = _apply_pax(value, name, size, where, pos)
        if "size" in value:
            data_size = size
        if any(key.startswith("GNU.sparse.") for key in value):  # a PAX-format sparse file
            kind = SPARSE
    return name, kind, size, data_size


def _check_inside(data_at: int, size: int, file_size: int, where: str, pos: int) -> int:
    """Where the next header starts, once the member's `size` bytes of data are known to lie inside the file."""
    if data_at + size > file_size:
        raise DataError(f"truncated: member at byte {pos} needs {size} bytes but the file ends at byte "
                        f"{file_size}", where, "the file is incomplete; copy or download it again")
    return data_at + padded(size)


def scan_path(path: Path) -> list[TarMember]:
    """All members of the tar file at `path`."""
    with open(path, "rb", buffering=0) as f:
        return list(scan(f, path.stat().st_size, str(path)))


def check_safe(member: TarMember, archive: str, flat: bool = True) -> None:
    """Reject links, devices, absolute paths, `..`, control characters and names too long for a file system; with
    `flat`, any path with a folder."""
    if not member.is_file:
        raise DataError(f"member {member.name!r} is a {member.type_name}; only regular files are accepted",
                        archive, "this is not a genuine ILSVRC2012 archive, or it was repacked; use the original")
    parts = member.name.split("/")
    if member.name.startswith("/") or ".." in parts or (flat and len(parts) > 1):
        raise DataError(f"unsafe member path {member.name!r} (absolute, '..' or nested)", archive, _UNSAFE_FIX)
    if _CONTROL(member.name):  # NUL no file name can hold; a newline no shard member name may
        raise DataError(f"unsafe member path {member.name!r} (it holds a control character)", archive, _UNSAFE_FIX)
    if (longest := max(len(part.encode("utf-8", "surrogateescape")) for part in parts)) > NAME_MAX:
        raise DataError(f"unsafe member path {member.name[:40]!r}... (a name of {longest} bytes, more than the "
                        f"{NAME_MAX} a file system allows)", archive, _UNSAFE_FIX)
