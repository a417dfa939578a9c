"""The dsec CLI against the running node."""

from __future__ import annotations

import json
import os
import re
import stat

import pytest

import dsec

ID_RE = re.compile(r"sb-[a-z0-9]{1,16}-[0-9a-f]{16}")


def sandboxes_of(doc):
    if isinstance(doc, dict):
        doc = doc.get("sandboxes", [])
    return doc


@pytest.fixture
def cli_sandbox(node, client):
    out = node.cli("run", "busybox").stdout.decode().strip()
    assert ID_RE.fullmatch(out), f"`dsec run busybox` printed {out!r}, want just the id"
    yield out
    try:
        client.stop_sandbox(out)
    except dsec.SandboxNotFound:
        pass


def test_run_exec_ps_stop(node, client, cli_sandbox):
    sid = cli_sandbox
    p = node.cli("exec", sid, "--", "echo", "hi")
    assert p.stdout == b"hi\n"
    p = node.cli("exec", sid, "--", "sh", "-c", "echo err >&2; exit 3", check=False)
    assert p.returncode == 3
    assert b"err" in p.stderr
    p = node.cli("exec", sid, "--session", "s1", "--", "cd", "/tmp", "&&", "export", "V=1")
    p = node.cli("exec", sid, "--session", "s1", "--", "pwd;", "echo", "$V")
    assert p.stdout == b"/tmp\n1\n"
    doc = json.loads(node.cli("ps", "--json").stdout)
    ids = [s["id"] for s in sandboxes_of(doc)]
    assert sid in ids
    table = node.cli("ps").stdout.decode()
    assert sid in table
    node.cli("stop", sid)
    try:
        assert client.get_sandbox(sid).state in ("stopped", "failed")
    except dsec.SandboxNotFound:
        pass
    doc = json.loads(node.cli("ps", "--json").stdout)
    assert not [s for s in sandboxes_of(doc) if s["id"] == sid and s.get("state") == "running"]


def test_cp_both_ways(node, cli_sandbox, tmp_path):
    sid = cli_sandbox
    src = tmp_path / "in.bin"
    data = os.urandom(3 * 1024 * 1024)
    src.write_bytes(data)
    os.chmod(src, 0o751)
    node.cli("cp", str(src), f"{sid}:/tmp/in.bin")
    p = node.cli("exec", sid, "--", "stat", "-c", "%a %s", "/tmp/in.bin")
    assert p.stdout.decode().split() == ["751", str(len(data))]
    node.cli("exec", sid, "--", "chmod", "0604", "/tmp/in.bin")
    dst = tmp_path / "out.bin"
    node.cli("cp", f"{sid}:/tmp/in.bin", str(dst))
    assert dst.read_bytes() == data
    assert stat.S_IMODE(dst.stat().st_mode) == 0o604
    p = node.cli("cp", f"{sid}:/no/such/file", str(tmp_path / "x"), check=False)
    assert p.returncode == 1 and p.stderr.strip(), "copying a missing file must fail with a message"


def test_image_ls(node):
    table = node.cli("image", "ls").stdout.decode()
    assert "busybox" in table
    doc = json.loads(node.cli("image", "ls", "--json").stdout)
    images = doc.get("images", doc) if isinstance(doc, dict) else doc
    assert any(i["name"].startswith("busybox") for i in images)


def test_cli_errors(node):
    p = node.cli("exec", "sb-e2e-0123456789abcdef", "--", "true", check=False)
    assert p.returncode == 1 and p.stderr.strip()
    p = node.cli("run", "no-such-image-e2e", check=False)
    assert p.returncode == 1 and b"no-such-image-e2e" in p.stderr
