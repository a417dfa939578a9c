"""Unit tests of the fork-server's pure logic: message framing, the scratch wipe, bounded
reads of a call's output. The server itself (fork, cgroups, setuid) is exercised end to end
by tests/test_functions.py."""
import os
import socket
import struct
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forkserver  # noqa: E402


def test_messages_are_length_prefixed_json_and_survive_split_reads():
    a, b = socket.socketpair()
    try:
        forkserver.send_msg(a, {"op": "run", "argv": ["python3", "-c", "print(1)"]})
        raw = b.recv(4)
        (n,) = struct.unpack(">I", raw)
        body = b.recv(n)
        assert len(body) == n
        # Sent again, one byte at a time: recv_msg puts the message back together.
        data = raw + body
        for i in range(len(data)):
            a.send(data[i:i + 1])
        assert forkserver.recv_msg(b) == {"op": "run", "argv": ["python3", "-c", "print(1)"]}
    finally:
        a.close()
        b.close()


def test_a_peer_that_hangs_up_mid_message_is_an_eof():
    a, b = socket.socketpair()
    a.sendall(struct.pack(">I", 10) + b"{}")
    a.close()
    with pytest.raises(EOFError):
        forkserver.recv_msg(b)
    b.close()


def test_wipe_empties_a_tree_without_following_symlinks(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    root = tmp_path / "tmp"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_text("y")
    (root / "g").write_text("z")
    os.symlink(outside, root / "link")
    forkserver.wipe(str(root))
    assert os.listdir(root) == []
    assert (outside / "keep").read_text() == "x", "a symlink's target is not wiped"


def test_wipe_keeps_the_scratch_root_itself_when_asked(tmp_path, monkeypatch):
    scratch_root = tmp_path / "dsec-fn"
    (scratch_root / "call").mkdir(parents=True)
    (scratch_root / "call" / "out").write_text("o")
    (tmp_path / "other").write_text("p")
    monkeypatch.setattr(forkserver, "SCRATCH_ROOT", str(scratch_root))
    forkserver.wipe(str(tmp_path), keep_self=True)
    assert os.listdir(tmp_path) == ["dsec-fn"]
    assert os.listdir(scratch_root) == []


def test_read_fd_is_bounded_and_reports_the_whole_size(tmp_path):
    p = tmp_path / "out"
    p.write_bytes(b"0123456789")
    fd = os.open(p, os.O_RDONLY)
    try:
        assert forkserver.read_fd(fd, 4) == (b"0123", 10)
        assert forkserver.read_fd(fd, 100) == (b"0123456789", 10)
    finally:
        os.close(fd)


def test_call_paths_are_relative_or_under_the_wiped_dirs(tmp_path, monkeypatch):
    monkeypatch.setattr(forkserver, "WIPE", ["/tmp"])
    s = str(tmp_path)
    assert forkserver.call_path("a/b.txt", s) == (s, ["a", "b.txt"])
    assert forkserver.call_path("/tmp/x/y", s) == ("/tmp", ["x", "y"])
    assert forkserver.call_path("/etc/passwd", s) is None
    assert forkserver.call_path("/tmpx/y", s) is None
    assert forkserver.call_path("../up", s) is None


def test_fetch_reads_regular_files_and_skips_links_and_missing(tmp_path):
    s = str(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "r.bin").write_bytes(b"\x00\x01abc")
    (tmp_path / "secret").write_text("no")
    os.symlink(str(tmp_path / "secret"), str(tmp_path / "link"))
    os.symlink(str(tmp_path / "out"), str(tmp_path / "dirlink"))
    got = forkserver.fetch(["out/r.bin", "link", "dirlink/r.bin", "missing", "out"], s)
    import base64
    assert got == {"out/r.bin": base64.b64encode(b"\x00\x01abc").decode()}
