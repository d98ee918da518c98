import io
import tarfile

import pytest

from vitctl.datasets.errors import DataError
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
