import contextlib
import io
import re
import tarfile
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st
from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_expander

from vitctl.datasets.errors import DataError
from vitctl.datasets.index import shard_samples, split_name
from vitctl.datasets.tarscan import check_safe, scan, scan_path
from vitctl.datasets.tarwrite import UstarWriter


def _tar(fmt: int, members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1.5  # a float mtime makes PAX write an extra header
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


MEMBERS = {
    "short.jpg": b"a" * 700,
    "d" * 90 + "/" + "x" * 60 + ".cls": b"7",  # longer than 100 bytes: GNU long name, PAX path or ustar prefix
    "nonascii_é.json": b"{}",
    "empty.txt": b"",
}


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_scan_finds_every_member_at_its_data_offset(fmt):
    members = dict(MEMBERS)
    if fmt == tarfile.USTAR_FORMAT:  # ustar can only split a long path at a slash into prefix + name
        members.pop("nonascii_é.json")
    raw = _tar(fmt, members)
    found = list(scan(io.BytesIO(raw), len(raw), "t.tar"))
    assert [m.name for m in found] == list(members)
    for m in found:
        assert m.offset % 512 == 0
        assert raw[m.offset:m.offset + m.size] == members[m.name]
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        expected = [(i.name, i.offset_data, i.size) for i in tar.getmembers()]
    assert expected == [(m.name, m.offset, m.size) for m in found]


def test_truncated_archive_is_reported_with_its_size(tmp_path):
    raw = _tar(tarfile.GNU_FORMAT, MEMBERS)
    for cut in (len(raw) - 10240, 1000, 512 + 100):  # before the end blocks, inside data, inside a header
        path = tmp_path / "t.tar"
        path.write_bytes(raw[:cut])
        with pytest.raises(DataError, match="truncated"):
            scan_path(path)


def test_garbage_is_not_a_tar(tmp_path):
    path = tmp_path / "x.tar"
    path.write_bytes(b"hello" * 300)
    with pytest.raises(DataError, match="not a tar archive"):
        scan_path(path)


def test_ustar_writer_output_reads_back_as_plain_ustar(tmp_path):
    buf = io.BytesIO()
    writer = UstarWriter(buf)
    writer.add("k1.cls", b"3")
    writer.add("k1.jpg", b"\xff" * 1000)
    writer.close()
    raw = buf.getvalue()
    assert len(raw) % 512 == 0
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        infos = tar.getmembers()
        assert [i.name for i in infos] == ["k1.cls", "k1.jpg"]
        assert all(not i.pax_headers and isinstance(i.mtime, int) for i in infos)
        assert tar.extractfile("k1.jpg").read() == b"\xff" * 1000
    assert b"ustar\x0000" in raw[:512]


@pytest.mark.parametrize(("name", "kind", "message"), [
    ("/etc/passwd", tarfile.REGTYPE, "unsafe"),
    ("../escape.JPEG", tarfile.REGTYPE, "unsafe"),
    ("sub/dir.JPEG", tarfile.REGTYPE, "unsafe"),
    ("link.JPEG", tarfile.SYMTYPE, "symbolic link"),
    ("hard.JPEG", tarfile.LNKTYPE, "hard link"),
    ("dev.JPEG", tarfile.CHRTYPE, "character device"),
])
def test_unsafe_members_are_rejected(name, kind, message):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, "target" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
        tar.addfile(info, io.BytesIO(b"") if kind == tarfile.REGTYPE else None)
    raw = buf.getvalue()
    (member,) = scan(io.BytesIO(raw), len(raw), "a.tar")
    with pytest.raises(DataError, match=message):
        check_safe(member, "a.tar")


def _pax_member(pax: dict[str, str], data: bytes = b"") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("a.JPEG")
        info.size, info.pax_headers = len(data), pax
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize(("name", "message"), [
    ("n01440764_5\x00x.JPEG", r"'n01440764_5\\x00x.JPEG' \(it holds a control character\)"),
    ("n01440764_5\nx.JPEG", "it holds a control character"),
    ("n01440764_" + "x" * 241 + ".JPEG", "a name of 256 bytes, more than the 255 a file system allows"),
])
def test_member_names_no_file_system_takes_are_rejected(name, message):
    """Before: a NUL ended in `ValueError: embedded null byte`, a long name in "File name too long" mid-way."""
    raw = _pax_member({"path": name})
    (member,) = scan(io.BytesIO(raw), len(raw), "a.tar")
    assert member.name == name
    with pytest.raises(DataError, match=message):
        check_safe(member, "a.tar")


def test_a_name_of_255_bytes_is_accepted():
    raw = _pax_member({"path": "n01440764_" + "x" * 240 + ".JPEG"})
    (member,) = scan(io.BytesIO(raw), len(raw), "a.tar")
    check_safe(member, "a.tar")


def test_a_negative_pax_size_is_refused_as_corrupt():
    """Before: read as a member of 0 bytes, extracted as an empty image."""
    raw = _pax_member({"size": "-5"}, b"abcde")
    with pytest.raises(DataError, match="corrupt header at byte 1024 \\(negative PAX size '-5'\\)"):
        list(scan(io.BytesIO(raw), len(raw), "a.tar"))


# Property-based cross-checks: over generated tars (GNU, PAX and ustar, as Python's tarfile writes them, with base-256
# numbers and signed checksums as old tars wrote them), the scanner reads what tarfile reads, and the index groups
# members into samples as webdataset does.

NAME_PART = st.text(alphabet="ab_.-é ", min_size=1, max_size=6)  # dots, hidden names, spaces, non-ASCII
NAMES = st.one_of(
    st.lists(NAME_PART, min_size=1, max_size=3).map("/".join),
    st.sampled_from(["__key__.jpg", "__meta__", "__m__/a.jpg", "a.__url__", "noext", ".h.jpg", "d/.h.jpg",
                     "./a.jpg", "a.JPG", "a.jpg", "a.cls"]),
    NAME_PART.map(lambda part: "long" * 30 + "/" + part),  # past 100 bytes: GNU long name, PAX path, ustar prefix
    NAME_PART.map(lambda part: "x" * 101 + part),  # past 100 bytes without a slash: no ustar prefix can hold it
)
DATA_TYPES = [tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE]
OTHER_TYPES = [tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE, tarfile.CHRTYPE]
MEMBER_LISTS = st.lists(st.tuples(NAMES, st.sampled_from(DATA_TYPES * 3 + OTHER_TYPES), st.integers(0, 1100),
                             st.sampled_from(["target", "t" * 120])), min_size=1, max_size=12)
TARS = st.tuples(st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT]), MEMBER_LISTS,
                 st.booleans(), st.booleans())


def _base256_itn(n, digits=8, format=tarfile.DEFAULT_FORMAT):
    """GNU tar's base-256 numbers, which it writes for sizes of 8 GiB and more, here for every size and mtime."""
    if format == tarfile.GNU_FORMAT and digits == 12:
        return bytes([0x80]) + int(n).to_bytes(digits - 1, "big")
    return _ITN(n, digits, format)


_ITN, _CALC_CHKSUMS = tarfile.itn, tarfile.calc_chksums


def _signed_checksum_first(buf):
    """Old Sun tars summed header bytes as signed chars; tarfile writes the first of the two sums."""
    unsigned, signed = _CALC_CHKSUMS(buf)
    return signed, unsigned


def _member_bytes(i: int, size: int) -> bytes:
    return (f"<{i}>".encode() * size)[:size]


def _generated_tar(fmt: int, members: list, base256: bool, signed: bool) -> bytes:
    buf = io.BytesIO()
    with contextlib.ExitStack() as stack:
        if base256:
            stack.enter_context(mock.patch.object(tarfile, "itn", _base256_itn))
        if signed:
            stack.enter_context(mock.patch.object(tarfile, "calc_chksums", _signed_checksum_first))
        pax = {"comment": "a global header"} if fmt == tarfile.PAX_FORMAT else None
        with tarfile.open(fileobj=buf, mode="w", format=fmt, pax_headers=pax) as tar:
            for i, (name, kind, size, link) in enumerate(members):
                info = tarfile.TarInfo(name)
                info.type, info.mtime = kind, 1.5  # a float mtime gives every PAX member an extended header
                data = _member_bytes(i, size) if kind in DATA_TYPES else b""
                info.size, info.linkname = len(data), link if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
                try:
                    tar.addfile(info, io.BytesIO(data))
                except ValueError:  # ustar holds no name or link past 100 bytes that a slash cannot split
                    reject()
    return buf.getvalue()


@settings(max_examples=200, deadline=None)
@given(TARS)
def test_scan_reads_every_generated_tar_as_tarfile_does(tar_spec):
    raw = _generated_tar(*tar_spec)
    found = list(scan(io.BytesIO(raw), len(raw), "t.tar"))
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
        infos = tar.getmembers()
        assert [(m.name, m.offset, m.size, m.is_file) for m in found] == [
            (i.name, i.offset_data, i.size, i.isreg()) for i in infos]
        for m, info in zip(found, infos, strict=True):
            if m.is_file:
                assert raw[m.offset:m.offset + m.size] == tar.extractfile(info).read()


def _webdataset_samples(path: Path) -> tuple[list[tuple[str, dict[str, bytes]]] | None, list[str]]:
    """webdataset's samples of the tar at `path` (None if it refuses the tar), and the names that form them."""
    with open(path, "rb") as stream:
        files = list(tar_file_expander([{"url": str(path), "stream": stream}]))
    grouped = [f["fname"] for f in files if f and base_plus_ext(f["fname"])[0] is not None]
    try:
        samples = list(group_by_keys(iter(files)))
    except ValueError:  # a repeated extension in one sample
        return None, grouped
    return [(s.pop("__key__"), {ext: data for ext, data in s.items() if ext != "__url__"}) for s in samples], grouped


@settings(max_examples=200, deadline=None)
@given(TARS)
def test_index_groups_samples_as_webdataset_does(tar_spec):
    raw = _generated_tar(*tar_spec)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.tar"
        path.write_bytes(raw)
        theirs, grouped = _webdataset_samples(path)
        keys = [key for key, _ in theirs or []]
        if theirs is None or len(set(keys)) < len(keys) or any(re.search(r"\s", name) for name in grouped):
            with pytest.raises(DataError):  # webdataset refuses it, splits a sample, or DALI cannot index a name
                shard_samples(path)
            return
        ours = [(split_name(sample[0][3])[0], {ext.lower(): raw[offset:offset + size]
                                                for ext, offset, size, _ in sample})
                for sample in shard_samples(path)]
    assert ours == theirs


def test_number_fields_in_base_256_are_read_and_negative_ones_refused():
    raw = bytearray(_tar(tarfile.GNU_FORMAT, {"a.jpg": b"x" * 600}))
    raw[124:136] = bytes([0x80]) + (600).to_bytes(11, "big")
    raw[148:156] = b"%06o\0 " % (sum(raw[:148]) + 256 + sum(raw[156:512]))
    (member,) = scan(io.BytesIO(bytes(raw)), len(raw), "t.tar")
    assert (member.name, member.size) == ("a.jpg", 600)
    raw[124:136] = bytes([0xFF]) * 12  # -1 in base 256
    raw[148:156] = b"%06o\0 " % (sum(raw[:148]) + 256 + sum(raw[156:512]))
    with pytest.raises(DataError, match="corrupt header at byte 0"):
        list(scan(io.BytesIO(bytes(raw)), len(raw), "t.tar"))


def test_links_and_folders_carry_no_data_whatever_their_size_field_says():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("link.jpg")
        info.type, info.linkname, info.size = tarfile.SYMTYPE, "target", 5000  # past the end of the file
        tar.addfile(info)
        info = tarfile.TarInfo("a.jpg")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    raw = buf.getvalue()
    found = list(scan(io.BytesIO(raw), len(raw), "t.tar"))
    assert [(m.name, m.type_name, m.offset) for m in found] == [("link.jpg", "symbolic link", 512),
                                                                 ("a.jpg", "regular file", 1024)]
