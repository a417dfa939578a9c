"""E2B's in-sandbox API ("envd", issue 19 part 2) through the REAL e2b Python SDK, sync and async:
commands (foreground, background, wait, kill, list, connect, stdin, callbacks, envs, cwd, users,
exit codes, timeouts), files (text, bytes, streams, many at once, list with depth, exists,
get_info with owners, make_dir, rename, remove, watch_dir), the access check, and the Connect
protocol itself in raw HTTP (binary protobuf codec, streaming envelopes, errors).

The sandbox is an ordinary dsec `debian` sandbox with a user `user` added; the SDK object is built
with the SDK's own constructor for an existing sandbox, pointed at `{apiserver}/e2b` and given a
dsec API key (`X-API-Key`), so these tests need only the envd side. The REST control plane
(`Sandbox.create`) is exercised when present (`test_sdk_create_when_the_rest_api_is_there`)."""

from __future__ import annotations

import asyncio
import io
import struct
import time

import httpx
import pytest

from helpers import make_sandbox, sh, stop_quietly

e2b = pytest.importorskip("e2b", reason="the e2b SDK is not installed (pip install e2b==2.63.0)")
from e2b import AsyncSandbox, CommandExitException, ConnectionConfig, FileType, Sandbox  # noqa: E402
from e2b.exceptions import AuthenticationException, TimeoutException  # noqa: E402
from packaging.version import Version  # noqa: E402

ENVD_VERSION = Version("0.5.7")


def headers_for(sandbox_id: str, key: str) -> dict:
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983", "X-API-Key": key}


def connection(node, sandbox_id: str) -> ConnectionConfig:
    return ConnectionConfig(api_key=node.key, sandbox_url=f"{node.url}/e2b", api_url=f"{node.url}/e2b",
                            extra_sandbox_headers=headers_for(sandbox_id, node.key))


@pytest.fixture(scope="module")
def box(client, debian):
    sb = make_sandbox(client, debian)
    sh(sb, "id user >/dev/null 2>&1 || useradd -m -s /bin/bash user")
    yield sb
    stop_quietly(sb)


@pytest.fixture(scope="module")
def sbx(node, box):
    return Sandbox(sandbox_id=box.id, sandbox_domain=None, envd_version=ENVD_VERSION, envd_access_token=None,
                   connection_config=connection(node, box.id))


def asbx(node, box):
    return AsyncSandbox(sandbox_id=box.id, sandbox_domain=None, envd_version=ENVD_VERSION,
                        envd_access_token=None, connection_config=connection(node, box.id))


# ---------------------------------------------------------------------------------------------
# commands


def test_run_in_the_foreground_stdout_stderr_exit_codes(sbx):
    r = sbx.commands.run("echo out; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo bad >&2; exit 3")
    assert e.value.exit_code == 3 and e.value.stderr == "bad\n"
    # cmd runs under `bash -l -c`: bash syntax and a login shell.
    assert sbx.commands.run("[[ $0 == *bash* ]] && shopt -q login_shell && echo yes").stdout == "yes\n"


def test_envs_cwd_and_users(sbx):
    r = sbx.commands.run('echo "$FOO"; pwd', envs={"FOO": "bar baz"}, cwd="/tmp")
    assert r.stdout == "bar baz\n/tmp\n"
    r = sbx.commands.run("whoami; pwd", user="user")
    assert r.stdout == "user\n/home/user\n"
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"


def test_timeout_raises_timeout_exception(sbx):
    t = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=2)
    assert time.monotonic() - t < 20


def test_background_wait_list_kill_and_connect(sbx):
    sleeper = sbx.commands.run("sleep 120", background=True)
    assert sleeper.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException):
        sleeper.wait()
    assert sleeper.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(sleeper.pid) is False  # gone: False, not an error

    counter = sbx.commands.run("for i in 1 2 3 4; do echo tick$i; sleep 0.5; done", background=True)
    again = sbx.commands.connect(counter.pid)
    r = again.wait()
    assert r.exit_code == 0 and "tick4" in r.stdout


def test_stdin_and_output_callbacks(sbx):
    out, err = [], []
    r = sbx.commands.run("echo a; echo b >&2", on_stdout=out.append, on_stderr=err.append)
    assert ("".join(out), "".join(err), r.stdout) == ("a\n", "b\n", "a\n")
    h = sbx.commands.run("cat; echo done >&2", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello\n")
    sbx.commands.send_stdin(h.pid, b"bytes\n")
    sbx.commands.close_stdin(h.pid)
    out, err = [], []
    r = h.wait(on_stdout=out.append, on_stderr=err.append)
    assert r.exit_code == 0 and r.stdout == "hello\nbytes\n" and "".join(out) == r.stdout
    assert "".join(err) == "done\n"


def test_pty_is_refused_clearly(sbx):
    from e2b import PtySize

    t = time.monotonic()
    with pytest.raises(Exception) as e:
        sbx.pty.create(PtySize(rows=24, cols=80))
    assert "PTY" in str(e.value) and time.monotonic() - t < 20


# ---------------------------------------------------------------------------------------------
# files


def test_write_read_text_bytes_streams_and_many(sbx):
    info = sbx.files.write("/tmp/e2b/t.txt", "héllo\n")
    assert (info.path, info.name) == ("/tmp/e2b/t.txt", "t.txt")
    assert sbx.files.read("/tmp/e2b/t.txt") == "héllo\n"
    blob = bytes(range(256)) * 1000
    sbx.files.write("/tmp/e2b/b.bin", blob)
    assert bytes(sbx.files.read("/tmp/e2b/b.bin", format="bytes")) == blob
    sbx.files.write("/tmp/e2b/s.bin", io.BytesIO(blob))  # a stream: the octet-stream upload
    assert b"".join(sbx.files.read("/tmp/e2b/s.bin", format="stream")) == blob
    sbx.files.write("/tmp/e2b/g.txt", "zipped " * 1000, gzip=True)
    assert sbx.files.read("/tmp/e2b/g.txt", gzip=True) == "zipped " * 1000
    many = sbx.files.write_files([{"path": f"/tmp/e2b/m/{i}.txt", "data": f"n{i}"} for i in range(5)])
    assert sorted(w.path for w in many) == [f"/tmp/e2b/m/{i}.txt" for i in range(5)]
    assert sbx.commands.run("cat /tmp/e2b/m/3.txt").stdout == "n3"
    with pytest.raises(e2b.NotFoundException):
        sbx.files.read("/tmp/e2b/none")


def test_list_exists_info_mkdir_rename_remove_and_owners(sbx):
    sbx.commands.run("rm -rf /tmp/tree && mkdir -p /tmp/tree/a/b && echo x > /tmp/tree/a/b/f && echo y > /tmp/tree/top")
    assert sorted(e.name for e in sbx.files.list("/tmp/tree")) == ["a", "top"]
    deep = {e.path: e.type for e in sbx.files.list("/tmp/tree", depth=3)}
    assert deep == {"/tmp/tree/a": FileType.DIR, "/tmp/tree/top": FileType.FILE,
                    "/tmp/tree/a/b": FileType.DIR, "/tmp/tree/a/b/f": FileType.FILE}
    assert sbx.files.exists("/tmp/tree/top") and not sbx.files.exists("/tmp/tree/nope")
    i = sbx.files.get_info("/tmp/tree/top")
    assert (i.type, i.size, i.owner, i.permissions) == (FileType.FILE, 2, "root", "-rw-r--r--")
    assert sbx.files.make_dir("/tmp/tree/new/deeper") is True
    assert sbx.files.make_dir("/tmp/tree/new/deeper") is False
    moved = sbx.files.rename("/tmp/tree/top", "/tmp/tree/new/top2")
    assert moved.path == "/tmp/tree/new/top2"
    assert sbx.files.read("/tmp/tree/new/top2") == "y\n"
    sbx.files.remove("/tmp/tree/a")
    assert not sbx.files.exists("/tmp/tree/a")
    # As `user`: relative paths are in its home, and what it writes or makes is its own.
    sbx.files.write("mine.txt", "m", user="user")
    assert sbx.files.get_info("/home/user/mine.txt").owner == "user"
    assert sbx.commands.run("stat -c %U /home/user/mine.txt").stdout == "user\n"
    sbx.files.make_dir("made", user="user")
    assert sbx.files.get_info("/home/user/made").owner == "user"


def test_watch_dir_polled(sbx):
    sbx.commands.run("rm -rf /tmp/wd && mkdir -p /tmp/wd")
    w = sbx.files.watch_dir("/tmp/wd")
    try:
        sbx.commands.run("echo 1 > /tmp/wd/a.txt && mv /tmp/wd/a.txt /tmp/wd/b.txt && rm /tmp/wd/b.txt")
        seen = []
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not any(e.name == "b.txt" and e.type.name == "REMOVE" for e in seen):
            seen += w.get_new_events()
            time.sleep(0.2)
        kinds = [(e.name, e.type.name) for e in seen]
        assert ("a.txt", "CREATE") in kinds and ("a.txt", "RENAME") in kinds and ("b.txt", "REMOVE") in kinds, kinds
    finally:
        w.stop()
    with pytest.raises(Exception):
        w.get_new_events()  # removed


# ---------------------------------------------------------------------------------------------
# async SDK


def test_async_sdk_commands_files_and_streamed_watch(node, box):
    async def go():
        s = asbx(node, box)
        r = await s.commands.run("echo async; echo e >&2")
        assert (r.stdout, r.stderr) == ("async\n", "e\n")
        h = await s.commands.run("sleep 60", background=True)
        assert await s.commands.kill(h.pid)
        await s.files.write("/tmp/async.txt", "a")
        assert await s.files.read("/tmp/async.txt") == "a"
        await s.commands.run("rm -rf /tmp/awd && mkdir -p /tmp/awd")
        events = []
        w = await s.files.watch_dir("/tmp/awd", on_event=events.append)
        await s.commands.run("touch /tmp/awd/x")
        for _ in range(100):
            if any(e.name == "x" for e in events):
                break
            await asyncio.sleep(0.1)
        await w.stop()
        assert any(e.name == "x" and e.type.name == "CREATE" for e in events), events
        with pytest.raises(CommandExitException):
            await s.commands.run("exit 5")
    asyncio.run(go())


# ---------------------------------------------------------------------------------------------
# access and the raw protocol


def envelope(payload: bytes, flags: int = 0) -> bytes:
    return struct.pack(">BI", flags, len(payload)) + payload


def frames(body: bytes):
    out, i = [], 0
    while i < len(body):
        flags, n = struct.unpack(">BI", body[i:i + 5])
        out.append((flags, body[i + 5:i + 5 + n]))
        i += 5 + n
    return out


def test_access_needs_a_token_or_a_key_of_the_sandboxs_project(node, box, sbx):
    url = f"{node.url}/e2b/process.Process/List"
    base = {"E2b-Sandbox-Id": box.id, "Content-Type": "application/json"}
    r = httpx.post(url, headers=base, content=b"{}", timeout=30)
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
    r = httpx.post(url, headers={**base, "X-Access-Token": "0" * 64}, content=b"{}", timeout=30)
    assert r.status_code == 401, r.text
    r = httpx.post(url, headers={**base, "X-API-Key": "dsk_" + "0" * 32}, content=b"{}", timeout=30)
    assert r.status_code == 401, r.text
    r = httpx.post(url, headers={**base, "X-API-Key": node.key}, content=b"{}", timeout=30)
    assert r.status_code == 200, r.text
    bad = Sandbox(sandbox_id=box.id, sandbox_domain=None, envd_version=ENVD_VERSION, envd_access_token=None,
                  connection_config=ConnectionConfig(api_key=node.key, sandbox_url=f"{node.url}/e2b",
                                                     extra_sandbox_headers={"E2b-Sandbox-Id": box.id,
                                                                            "X-Access-Token": "f" * 64}))
    with pytest.raises(AuthenticationException):
        bad.commands.run("true")


def test_binary_protobuf_and_streaming_envelopes(node, box, sbx):
    from e2b.envd.process import process_pb
    from protobuf import Oneof

    h = {**headers_for(box.id, node.key)}
    # Unary, binary protobuf.
    r = httpx.post(f"{node.url}/e2b/process.Process/List", content=process_pb.ListRequest().to_binary(),
                   headers={**h, "Content-Type": "application/proto"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "application/proto"
    process_pb.ListResponse.from_binary(r.content)
    # Server streaming, binary protobuf: start, data, end, then the end-of-stream message.
    req = process_pb.StartRequest(process=process_pb.ProcessConfig(cmd="/bin/echo", args=["raw"]))
    r = httpx.post(f"{node.url}/e2b/process.Process/Start", content=envelope(req.to_binary()),
                   headers={**h, "Content-Type": "application/connect+proto"}, timeout=60)
    assert r.status_code == 200
    fs = frames(r.content)
    events = [process_pb.StartResponse.from_binary(p).event.event for f, p in fs if f == 0]
    assert events[0].field == "start" and events[0].value.pid > 0
    out = [e.value.output for e in events if e.field == "data"]
    assert b"".join(o.value for o in out if o.field == "stdout") == b"raw\n"
    assert events[-1].field == "end" and events[-1].value.exited and events[-1].value.exit_code == 0
    assert fs[-1] == (2, b"{}")
    # A streaming call's error is in the end-of-stream message.
    req = process_pb.ConnectRequest(process=process_pb.ProcessSelector(selector=Oneof("pid", 999999)))
    r = httpx.post(f"{node.url}/e2b/process.Process/Connect", content=envelope(req.to_binary()),
                   headers={**h, "Content-Type": "application/connect+proto"}, timeout=60)
    (flags, payload), = frames(r.content)
    assert r.status_code == 200 and flags == 2 and b'"not_found"' in payload, r.content
    # Not a Connect content type, an unknown method, a malformed message: 4xx naming the problem.
    r = httpx.post(f"{node.url}/e2b/process.Process/List", content=b"x", headers={**h, "Content-Type": "text/plain"})
    assert r.status_code == 415
    r = httpx.post(f"{node.url}/e2b/process.Process/Nope", content=b"{}", headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 501 and r.json()["code"] == "unimplemented"
    r = httpx.post(f"{node.url}/e2b/filesystem.Filesystem/Stat", content=b"{\"path\": 3}",
                   headers={**h, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument", r.text
    # The plain endpoints.
    assert httpx.get(f"{node.url}/e2b/health", headers={"E2b-Sandbox-Id": box.id}).status_code == 204
    envs = httpx.get(f"{node.url}/e2b/envs", headers=h, timeout=30).json()
    assert "PATH" in envs


def test_sdk_create_when_the_rest_api_is_there(node, debian):
    """Sandbox.create through the REST side (engineer e2bapi's part): envdAccessToken then
    authorizes the envd calls."""
    r = httpx.get(f"{node.url}/e2b/sandboxes", headers={"X-API-Key": node.key}, timeout=30)
    if r.status_code in (404, 501):
        pytest.skip(f"the E2B REST control plane is not in this build (GET /e2b/sandboxes answered {r.status_code})")
    s = Sandbox.create(template=debian, api_key=node.key, api_url=f"{node.url}/e2b", sandbox_url=f"{node.url}/e2b")
    try:
        assert s.commands.run("echo hi").stdout == "hi\n"
        s.files.write("/tmp/x", "y")
        assert s.files.read("/tmp/x") == "y"
    finally:
        s.kill()


def test_js_sdk_commands_and_files_when_the_rest_api_is_there(node, debian):
    """The e2b JavaScript SDK (tests/e2b_js, installed with npm ci) runs a command and writes and
    reads a file through envd."""
    import json
    import os
    import shutil
    import subprocess
    from pathlib import Path

    js = Path(__file__).parent / "e2b_js"
    if shutil.which("node") is None or not (js / "node_modules" / "e2b").is_dir():
        pytest.skip("node or tests/e2b_js/node_modules is absent (npm ci in tests/e2b_js)")
    r = httpx.get(f"{node.url}/e2b/sandboxes", headers={"X-API-Key": node.key}, timeout=30)
    if r.status_code in (404, 501):
        pytest.skip(f"the E2B REST control plane is not in this build (GET /e2b/sandboxes answered {r.status_code})")
    env = {**os.environ, "E2B_API_URL": f"{node.url}/e2b", "E2B_SANDBOX_URL": f"{node.url}/e2b",
           "E2B_API_KEY": node.key}
    p = subprocess.run(["node", str(js / "envd.mjs"), debian], cwd=js, env=env, capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    out = json.loads(p.stdout.decode().strip().splitlines()[-1])
    assert (out["stdout"], out["stderr"], out["exitCode"]) == ("js-out\n", "js-err\n", 0), out
    assert out["nonZero"] == 4 and out["read"] == "from js" and out["killed"] is True, out
