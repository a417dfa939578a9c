"""Process handles (issue 18, item 3) and file rename.

A process started with `sandbox.start` belongs to the sandbox, not to the client: these tests
kill the client that started it, re-attach from another one, resume the output at an offset,
stream stdin, signal the whole process group (checked from inside the sandbox), and check that
output beyond the per-process ring buffer is flagged as truncated with the range lost.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import dsec
from helpers import make_sandbox, sh, stop_quietly

SDK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "sdk", "python")


@pytest.fixture(scope="module")
def box(client):
    """One busybox container shared by the module's tests."""
    sb = make_sandbox(client, "busybox")
    yield sb
    stop_quietly(sb)


def group_members(sb, pgid: int) -> int:
    """How many processes inside the sandbox are in process group `pgid` (seen from inside)."""
    out = sh(sb, f"cat /proc/[0-9]*/stat 2>/dev/null | awk '$5 == {pgid}' | wc -l")
    return int(out.strip())


def test_process_outlives_its_client_and_another_client_resumes_the_output(node, box):
    lines = 40
    cmd = f"i=0; while [ $i -lt {lines} ]; do echo line$i; i=$((i+1)); sleep 0.1; done"
    # The first client is a process of its own: it starts the command, reads a few lines, says
    # what it read and where it stopped, and is then SIGKILLed mid-stream.
    script = textwrap.dedent(
        f"""
        import json, sys, time
        sys.path.insert(0, {SDK!r})
        import dsec.sync
        c = dsec.sync.DSecClient(api_url={node.url!r}, api_key={node.key!r}, timeout=60)
        sb = c.attach({box.id!r})
        p = sb.start({cmd!r}, tag="counter")
        got = b""
        for ev in p.stream():
            if ev.type == "stdout":
                got += ev.bytes
            if got.count(b"\\n") >= 5:
                break
        print(json.dumps({{"pid": p.pid, "offset": p.offset, "got": got.decode()}}), flush=True)
        time.sleep(3600)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = child.stdout.readline()
        assert line, f"the first client said nothing: {child.stderr.read().decode()[-2000:]}"
        first = json.loads(line)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    pid, offset, got = first["pid"], first["offset"], first["got"]
    assert got.startswith("line0\nline1\n") and offset == len(got.encode())

    # The process kept running without its client; a new client finds it by pid and by tag.
    p = box.connect(pid)
    assert p.info.running, "the process ended with the client that started it"
    assert p.info.argv[-1] == cmd and p.tag == "counter"
    assert box.connect("counter").pid == pid
    assert pid in [i.pid for i in box.processes()]

    rest = b""
    end = None
    for ev in p.stream(offset=offset):
        assert ev.type != "truncated", ev
        if ev.type == "stdout":
            assert ev.offset == offset + len(rest), "output came out of order or with a hole"
            rest += ev.bytes
        elif ev.type == "end":
            end = ev
    want = "".join(f"line{i}\n" for i in range(lines))
    assert got + rest.decode() == want
    assert end is not None and not end.info.running and end.info.exit_code == 0
    assert end.offset == len(want) == end.info.output_bytes
    # Exited, it is no longer listed as running but can still be read again from the start.
    assert pid not in [i.pid for i in box.processes()]
    assert pid in [i.pid for i in box.processes(all=True)]
    assert p.output().stdout.decode() == want
    # Its start is in the trajectory log.
    kinds = [r.get("kind") for r in box.trajectory()]
    assert "process_start" in kinds


def test_kill_ends_the_whole_process_group(box):
    p = box.start("sleep 1000 & sleep 1000 & echo started; wait")
    for ev in p.stream():
        if ev.type == "stdout" and "started" in ev.data:
            break
    assert group_members(box, p.pid) == 3, "expected the shell and its two sleeps in the group"
    info = p.kill()
    info = p.wait(timeout=30)
    assert not info.running and info.signal == signal.SIGKILL
    deadline = time.monotonic() + 10
    while group_members(box, p.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert group_members(box, p.pid) == 0, "members of the killed group are still alive"


def test_signal_by_name_and_exit_status(box):
    p = box.start(["sleep", "1000"], tag="sleeper")
    listed = {i.pid: i for i in box.processes()}
    assert listed[p.pid].tag == "sleeper" and listed[p.pid].argv == ["sleep", "1000"]
    p.signal("SIGTERM")
    info = p.wait(timeout=30)
    assert not info.running and info.signal == signal.SIGTERM and info.exit_code == -1
    # A finished process is not signalled again (its pid may be someone else's by now).
    assert not p.signal("SIGKILL").running
    q = box.start("exit 7")
    assert q.wait(timeout=30).exit_code == 7


def test_stdin_round_trip(box):
    p = box.start(["cat"], stdin=True)
    p.send_stdin("hello\n")
    p.send_stdin(b"\x00\xffbin")
    assert p.close_stdin().stdin_open is False
    info = p.wait(timeout=30)
    assert info.exit_code == 0
    assert p.output().stdout == b"hello\n\x00\xffbin"
    # A process started without stdin reads EOF at once and refuses input.
    q = box.start(["cat"], stdin=False)
    assert q.wait(timeout=30).exit_code == 0
    with pytest.raises(dsec.BadRequest, match="stdin"):
        q.send_stdin("late")


def test_ring_buffer_truncation_is_flagged(box):
    total, ring = 300_000, 64 * 1024
    p = box.start(f"head -c {total} /dev/zero | tr '\\000' a; echo END", buffer_bytes=ring)
    info = p.wait(timeout=60)
    assert info.exit_code == 0 and info.output_bytes == total + 4
    assert info.kept_from == total + 4 - ring
    out = p.output()
    assert out.truncated and out.lost == [(0, total + 4 - ring)]
    assert len(out.stdout) == ring and out.stdout.endswith(b"aaaEND\n")
    # Resuming at an offset that is still kept gives exactly the bytes from there.
    tail = p.output(offset=total)
    assert not tail.truncated and tail.stdout == b"END\n"


def test_bad_requests_say_what_to_fix(box):
    with pytest.raises(dsec.NotFound):
        box.connect(999999)
    with pytest.raises(dsec.NotFound):
        box.connect("no-such-tag")
    with pytest.raises(dsec.BadRequest, match="buffer_bytes"):
        box.start("true", buffer_bytes=0)
    with pytest.raises(dsec.NotFound, match="command not found"):
        box.start(["no-such-program-xyz"])
    p = box.start(["sleep", "1000"])
    with pytest.raises(dsec.BadRequest, match="signal"):
        p.signal("SIGNOPE")
    p.kill()


def test_rename_moves_and_refuses_to_overwrite(box):
    box.write_file("/tmp/a.txt", "A")
    box.write_file("/tmp/b.txt", "B")
    info = box.rename("/tmp/a.txt", "/tmp/c.txt")
    assert info.path == "/tmp/c.txt" and info.size == 1
    assert not box.exists("/tmp/a.txt") and box.read_file("/tmp/c.txt") == b"A"
    with pytest.raises(dsec.BadRequest, match="exists"):
        box.rename("/tmp/c.txt", "/tmp/b.txt")
    assert box.read_file("/tmp/b.txt") == b"B"
    box.rename("/tmp/c.txt", "/tmp/b.txt", overwrite=True)
    assert box.read_file("/tmp/b.txt") == b"A"
    sh(box, "mkdir -p /tmp/d1/sub && echo x > /tmp/d1/sub/f")
    box.rename("/tmp/d1", "/tmp/d2")
    assert box.read_file("/tmp/d2/sub/f") == b"x\n"
    with pytest.raises(dsec.FileNotFound):
        box.rename("/tmp/nope", "/tmp/nope2")


def test_handles_end_with_their_sandbox(client):
    sb = make_sandbox(client, "busybox")
    try:
        p = sb.start(["sleep", "1000"])
        assert p.info.running
    finally:
        stop_quietly(sb)
    with pytest.raises((dsec.SandboxDead, dsec.SandboxNotFound)):
        sb.connect(p.pid)


def test_start_wait_output_on_each_substrate(sb):
    p = sb.start("echo out; echo err >&2; exit 3", env={"X": "1"}, cwd="/tmp")
    info = p.wait(timeout=60)
    assert info.exit_code == 3 and info.cwd == "/tmp"
    out = p.output()
    assert out.stdout == b"out\n" and out.stderr == b"err\n" and not out.truncated
