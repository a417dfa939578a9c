"""File API: binary round trips, large streamed transfers, modes, directory operations, errors.

Every test runs on both substrates (`sb` in conftest.py): a busybox container and a microVM
booted from the `debian` layers (issue 9), asserting the same behaviour.
"""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

import dsec
from helpers import sh


def test_binary_round_trip_few_mb(sb):
    data = os.urandom(3 * 1024 * 1024 + 17)
    info = sb.write_file("/tmp/rand.bin", data)
    assert info.size == len(data)
    assert sb.read_file("/tmp/rand.bin") == data
    # the shell sees the same bytes
    assert sh(sb, "sha256sum /tmp/rand.bin").split()[0] == hashlib.sha256(data).hexdigest()
    # and bytes written by the shell come back exactly
    sh(sb, "printf '\\000\\377\\001' > /tmp/small.bin")
    assert sb.read_file("/tmp/small.bin") == b"\x00\xff\x01"
    # empty file
    sb.write_file("/tmp/empty", b"")
    assert sb.read_file("/tmp/empty") == b""


def test_large_streamed_upload_download(sb, tmp_path):
    size = 200 * 1024 * 1024
    src = tmp_path / "big.bin"
    h = hashlib.sha256()
    block = os.urandom(1024 * 1024)
    with open(src, "wb") as f:
        for i in range(size // len(block)):
            chunk = block[:-8] + i.to_bytes(8, "little")
            h.update(chunk)
            f.write(chunk)
    want = h.hexdigest()
    info = sb.upload(src, "/tmp/big.bin")
    assert info.size == size
    assert sh(sb, "sha256sum /tmp/big.bin", timeout=120).split()[0] == want
    dst = tmp_path / "big.back"
    assert sb.download("/tmp/big.bin", dst) == size
    h2 = hashlib.sha256()
    with open(dst, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h2.update(chunk)
    assert h2.hexdigest() == want


def test_modes_kept(sb, tmp_path):
    sb.write_file("/tmp/script.sh", "#!/bin/sh\necho ran\n", mode=0o755)
    assert sb.stat("/tmp/script.sh").mode & 0o7777 == 0o755
    assert sh(sb, "stat -c %a /tmp/script.sh").strip() == "755"
    assert sh(sb, "/tmp/script.sh") == "ran\n"
    sb.write_file("/tmp/secret", b"s", mode=0o600)
    assert sh(sb, "stat -c %a /tmp/secret").strip() == "600"
    # upload keeps the local mode
    local = tmp_path / "tool"
    local.write_bytes(b"#!/bin/sh\necho tool\n")
    os.chmod(local, 0o750)
    sb.upload(local, "/tmp/tool")
    assert sh(sb, "stat -c %a /tmp/tool").strip() == "750"
    # download keeps the remote mode
    sh(sb, "echo x > /tmp/ro && chmod 0640 /tmp/ro")
    back = tmp_path / "ro"
    sb.download("/tmp/ro", back)
    assert stat.S_IMODE(back.stat().st_mode) == 0o640
    assert back.read_bytes() == b"x\n"


def test_list_stat_remove_mkdir(sb):
    d = sb.mkdir("/work/a/b/c")
    assert d.kind == "dir"
    assert sh(sb, "test -d /work/a/b/c && echo yes") == "yes\n"
    sb.write_file("/work/a/b/f1.txt", b"12345")
    sb.write_file("/work/a/b/f2.bin", b"\x00" * 10)
    sh(sb, "ln -s /etc/passwd /work/a/b/link")
    entries = {e.name: e for e in sb.list_files("/work/a/b")}
    assert set(entries) == {"c", "f1.txt", "f2.bin", "link"}
    assert entries["c"].kind == "dir"
    assert entries["f1.txt"].kind == "file" and entries["f1.txt"].size == 5
    assert entries["link"].kind == "symlink" and entries["link"].link_target == "/etc/passwd"
    st = sb.stat("/work/a/b/f2.bin")
    assert (st.kind, st.size, st.uid, st.gid) == ("file", 10, 0, 0)
    assert st.mtime > 0
    sb.remove("/work/a/b/f1.txt")
    with pytest.raises(dsec.FileNotFound):
        sb.stat("/work/a/b/f1.txt")
    with pytest.raises(dsec.DSecError):
        sb.remove("/work/a")  # not empty, not recursive
    assert sb.stat("/work/a").kind == "dir"
    sb.remove("/work/a", recursive=True)
    assert sh(sb, "test -e /work/a || echo gone") == "gone\n"
    with pytest.raises(dsec.DSecError):
        sb.mkdir("/work/x/y", parents=False)


def test_missing_file_is_file_not_found(sb, tmp_path):
    with pytest.raises(dsec.FileNotFound) as e:
        sb.read_file("/no/such/file")
    assert e.value.status == 404
    with pytest.raises(dsec.FileNotFound):
        sb.stat("/no/such/file")
    with pytest.raises(dsec.FileNotFound):
        sb.list_files("/no/such/dir")
    with pytest.raises(dsec.FileNotFound):
        sb.download("/no/such/file", tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(dsec.FileNotFound):
        sb.remove("/no/such/file")


def test_write_creates_parent_or_reports(sb):
    # writing into a missing directory either creates it or says the file/dir was not found
    try:
        sb.write_file("/new/dir/file", b"x")
    except dsec.DSecError as e:
        assert e.status in (400, 404), e
    else:
        assert sb.read_file("/new/dir/file") == b"x"
