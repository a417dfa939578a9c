"""Unit tests of the SDK without a dsec server: JSON mapping, error mapping, files, streams.

Every test runs against ``tests/httpserver.py`` (an in-process HTTP/1.1 server, so the SDK's own
HTTP client in ``dsec/_http.py`` is what is tested) with answers framed by content-length,
chunked transfer encoding and end-of-connection, and once more through ``httpx.MockTransport``
(the ``transport=`` path, which uses httpx)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import stat

import httpx
import pytest

from httpserver import TestServer

import dsec
from dsec import (
    BadRequest,
    CommandTimeout,
    DSecClient,
    DSecContainerRunArgs,
    DSecError,
    FileNotFound,
    ImageNotFound,
    NodeUnavailable,
    PayloadTooLarge,
    QuotaExceeded,
    SandboxNotFound,
    Unauthorized,
)
from dsec.client import parse_mode_header
from dsec.errors import error_from_body
import dsec.sync

SB = "sb-n0-3f9a2c01d4e5b6a7"


def info_json(**over):
    doc = {
        "id": SB,
        "node": "n0",
        "state": "running",
        "substrate": "container",
        "image": "debian:latest",
        "memory_limit_mb": 1024,
        "cpu_cores_limit": 1.0,
        "pids_limit": 1024,
        "init_user": "root",
        "hostname": "sb-3f9a",
        "created_at": "2025-01-01T00:00:00Z",
        "create_ms": 42.5,
        "some_future_field": 1,
    }
    doc.update(over)
    return doc


def result_json(**over):
    doc = {
        "exit_code": 0,
        "signal": None,
        "stdout": "hello world\n",
        "stderr": "",
        "stdout_truncated": False,
        "stderr_truncated": False,
        "stdout_total_bytes": 12,
        "stderr_total_bytes": 0,
        "timed_out": False,
        "oom_killed": False,
        "duration_ms": 3.5,
        "session_restarted": False,
    }
    doc.update(over)
    return doc


FRAMINGS = ["length", "chunked", "eof", "httpx-mock"]
_framing = {"value": "length"}
_servers = []


@pytest.fixture(autouse=True, params=FRAMINGS)
def framing(request):
    """Runs each test once per answer framing of the test server (and once through httpx)."""
    _framing["value"] = request.param
    yield request.param
    while _servers:
        _servers.pop().stop()


def serve(route, **kw):
    server = TestServer(route, **kw)
    _servers.append(server)
    return server


def transport_kwargs(handler):
    """``api_url``/``transport`` arguments of a client answered by ``handler``."""
    if _framing["value"] == "httpx-mock":
        return {"api_url": "http://api.example.test:7480", "transport": httpx.MockTransport(handler)}
    return {"api_url": serve(handler, framing=_framing["value"]).url}


class Recorder:
    """A route handler that records requests and answers from a routing function."""

    def __init__(self, route):
        self.route = route
        self.requests = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        self.requests.append((request, body))
        return self.route(request, body)


def make_client(route, **kw):
    rec = Recorder(route)
    client = DSecClient(api_key="dsk_test", **transport_kwargs(rec), **kw)
    _clients.append(client)
    return client, rec


_clients = []


def run(coro):
    """Runs a test coroutine, then closes the clients it made (tests need not close them)."""

    async def wrapper():
        try:
            return await coro
        finally:
            while _clients:
                await _clients.pop().close()

    return asyncio.run(wrapper())


def test_run_args_json_omits_none_and_renames_image():
    args = DSecContainerRunArgs(
        container_image="swe/sphinx-9658:official",
        memory_limit_mb=4096,
        cpu_cores_limit=4,
        ttl_running_stop=300,
        network_rules={"npm": False, "pypi": True},
        init_user="root",
    )
    assert args.to_json() == {
        "image": "swe/sphinx-9658:official",
        "memory_limit_mb": 4096,
        "cpu_cores_limit": 4,
        "ttl_running_stop": 300,
        "network_rules": {"npm": False, "pypi": True},
        "init_user": "root",
    }
    full = DSecContainerRunArgs(container_image="busybox", toolkits=["t1"], labels={"job": "j"}, idempotency_key="k")
    assert full.to_json() == {"image": "busybox", "toolkits": ["t1"], "labels": {"job": "j"}, "idempotency_key": "k"}


def test_env_defaults(monkeypatch):
    monkeypatch.setenv("DSEC_API_URL", "http://env.example.test:1/")
    monkeypatch.setenv("DSEC_API_KEY", "dsk_env")
    c = DSecClient()
    assert c.api_url == "http://env.example.test:1"
    assert c.api_key == "dsk_env"
    c2 = DSecClient(api_url="http://x.example.test", api_key="k")
    assert c2.api_url == "http://x.example.test" and c2.api_key == "k"


def test_missing_url_is_clear(monkeypatch, tmp_path):
    monkeypatch.delenv("DSEC_API_URL", raising=False)
    monkeypatch.delenv("DSEC_API_KEY", raising=False)
    monkeypatch.setattr(dsec.client, "DEFAULT_ENV_FILE", str(tmp_path / "nope"))
    with pytest.raises(DSecError, match="DSEC_API_URL"):
        DSecClient()


def test_env_file_fallback(monkeypatch, tmp_path):
    monkeypatch.delenv("DSEC_API_URL", raising=False)
    monkeypatch.delenv("DSEC_API_KEY", raising=False)
    env = tmp_path / "env"
    env.write_text("DSEC_API_URL=http://file.example.test:7480\nDSEC_API_KEY=dsk_file\n")
    monkeypatch.setattr(dsec.client, "DEFAULT_ENV_FILE", str(env))
    c = DSecClient()
    assert (c.api_url, c.api_key) == ("http://file.example.test:7480", "dsk_file")


def test_create_and_shell_round_trip():
    def route(req, body):
        if req.method == "POST" and req.url.path == "/v1/sandboxes":
            return httpx.Response(201, json=info_json())
        if req.method == "POST" and req.url.path == f"/v1/sandboxes/{SB}/shell":
            return httpx.Response(200, json=result_json())
        if req.method == "DELETE" and req.url.path == f"/v1/sandboxes/{SB}":
            return httpx.Response(200, json=info_json(state="stopped"))
        return httpx.Response(500)

    async def main():
        client, rec = make_client(route)
        await client.open()
        sandbox = await client.run_container(
            DSecContainerRunArgs(container_image="debian", memory_limit_mb=256, init_user="root"), timeout=120
        )
        assert sandbox.id == SB
        assert sandbox.info.state == "running"
        assert sandbox.info.create_ms == 42.5
        assert sandbox.info.raw["some_future_field"] == 1
        result = await sandbox.run_shell("echo hello world", env={"A": "1"}, cwd="/tmp", stdin="in", timeout=5)
        assert result.stdout == "hello world\n"
        assert result.exit_code == 0 and result.ok
        assert result.stdout_bytes == b"hello world\n"
        stopped = await sandbox.stop()
        assert stopped.state == "stopped"
        await client.close()
        return rec

    rec = run(main())
    create_req, create_body = rec.requests[0]
    assert create_req.headers["authorization"] == "Bearer dsk_test"
    assert json.loads(create_body) == {"image": "debian", "memory_limit_mb": 256, "init_user": "root"}
    _, shell_body = rec.requests[1]
    shell_json = json.loads(shell_body)
    assert shell_json.pop("step") == 1, "calls on a handle are numbered for fast-forward"
    assert shell_json == {
        "cmd": "echo hello world",
        "session": "default",
        "timeout": 5.0,
        "env": {"A": "1"},
        "cwd": "/tmp",
        "stdin": "in",
    }


def test_creating_state_is_polled_until_running():
    states = iter(["creating", "running"])

    def route(req, body):
        if req.method == "POST":
            return httpx.Response(201, json=info_json(state="creating"))
        return httpx.Response(200, json=info_json(state=next(states)))

    async def main():
        client, rec = make_client(route)
        async with client:
            sb = await client.run_container(DSecContainerRunArgs(container_image="busybox"))
        return sb, rec

    sb, rec = run(main())
    assert sb.info.state == "running"
    assert len(rec.requests) == 3


def test_failed_create_state_raises():
    def route(req, body):
        return httpx.Response(201, json=info_json(state="failed", reason="aether exited"))

    async def main():
        client, _ = make_client(route)
        async with client:
            await client.run_container(DSecContainerRunArgs(container_image="busybox"))

    with pytest.raises(DSecError, match="aether exited"):
        run(main())


def test_binary_output_uses_b64():
    raw = b"\xff\xfe\x00abc\x80"

    def route(req, body):
        return httpx.Response(
            200,
            json=result_json(
                stdout=raw.decode("utf-8", "replace"),
                stdout_b64=base64.b64encode(raw).decode(),
                stderr="warn\n",
            ),
        )

    async def main():
        client, _ = make_client(route)
        sb = dsec.Sandbox(client, dsec.SandboxInfo(id=SB))
        return await sb.run_shell("printf ...")

    res = run(main())
    assert res.stdout_bytes == raw
    assert res.stderr_bytes == b"warn\n"


@pytest.mark.parametrize(
    "status,code,cls",
    [
        (400, "bad_request", BadRequest),
        (401, "unauthorized", Unauthorized),
        (404, "sandbox_not_found", SandboxNotFound),
        (404, "image_not_found", ImageNotFound),
        (404, "file_not_found", FileNotFound),
        (413, "payload_too_large", PayloadTooLarge),
        (429, "quota_exceeded", QuotaExceeded),
        (503, "node_unavailable", NodeUnavailable),
        (503, "node_full", NodeUnavailable),
        (500, "internal", DSecError),
    ],
)
def test_error_mapping(status, code, cls):
    def route(req, body):
        return httpx.Response(status, json={"error": {"code": code, "message": f"the {code} message"}})

    async def main():
        client, _ = make_client(route)
        async with client:
            await client.get_sandbox(SB)

    with pytest.raises(cls) as info:
        run(main())
    err = info.value
    assert isinstance(err, DSecError)
    assert err.status == status
    assert err.code == code
    assert err.message == f"the {code} message"
    assert code in str(err)


def test_error_mapping_falls_back_to_status_for_non_json():
    err = error_from_body(401, b"nope")
    assert isinstance(err, Unauthorized) and err.message == "nope" and err.code is None
    err = error_from_body(413, b"")
    assert isinstance(err, PayloadTooLarge) and isinstance(err, BadRequest) and "413" in err.message
    err = error_from_body(502, b"<html>bad gateway</html>")
    assert type(err) is DSecError and err.status == 502


def test_transport_error_is_node_unavailable(framing):
    def route(req):
        raise httpx.ConnectError("connection refused", request=req)

    async def main():
        if framing == "httpx-mock":
            client = DSecClient(api_url="http://api.example.test", api_key="k", transport=httpx.MockTransport(route))
        else:
            client = DSecClient(api_url=f"http://127.0.0.1:{closed_port()}", api_key="k")
        async with client:
            await client.list_sandboxes()

    with pytest.raises(NodeUnavailable, match="cannot reach"):
        run(main())


def closed_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_timeout_result_and_raise_on_timeout():
    def route(req, body):
        return httpx.Response(200, json=result_json(stdout="partial", exit_code=-1, signal=9, timed_out=True))

    async def main(raise_):
        client, _ = make_client(route)
        sb = dsec.Sandbox(client, dsec.SandboxInfo(id=SB))
        return await sb.run_shell("sleep 100", timeout=1, raise_on_timeout=raise_)

    res = run(main(False))
    assert res.timed_out and not res.ok and res.signal == 9
    with pytest.raises(CommandTimeout) as info:
        run(main(True))
    assert info.value.result.stdout == "partial"


def test_exec_body_binary_stdin_and_user():
    def route(req, body):
        return httpx.Response(200, json=result_json())

    async def main():
        client, rec = make_client(route)
        sb = dsec.Sandbox(client, dsec.SandboxInfo(id=SB))
        await sb.exec(["cat"], stdin=b"\x00\xff", user="user", max_output_bytes=10)
        with pytest.raises(TypeError):
            await sb.exec("ls -l")
        return rec

    rec = run(main())
    req, body = rec.requests[0]
    assert req.url.path == f"/v1/sandboxes/{SB}/exec"
    exec_json = json.loads(body)
    assert exec_json.pop("step") == 1
    assert exec_json == {"argv": ["cat"], "stdin_b64": "AP8=", "user": "user", "max_output_bytes": 10}


def test_stream_events():
    lines = [
        {"type": "stdout", "data": "a\n"},
        {"type": "stderr", "data": "\ufffd", "data_b64": base64.b64encode(b"\xff").decode()},
        {"type": "exit", "result": result_json(stdout="", exit_code=3)},
    ]

    def route(req, body):
        assert json.loads(body)["stream"] is True
        payload = "".join(json.dumps(line) + "\n" for line in lines)
        return httpx.Response(200, content=payload.encode(), headers={"content-type": "application/x-ndjson"})

    async def main():
        client, _ = make_client(route)
        sb = dsec.Sandbox(client, dsec.SandboxInfo(id=SB))
        return [e async for e in sb.stream_shell("x")], [e async for e in sb.stream_exec(["x"])]

    shell_events, exec_events = run(main())
    for events in (shell_events, exec_events):
        assert [e.type for e in events] == ["stdout", "stderr", "exit"]
        assert events[0].data == b"a\n" and events[0].text == "a\n"
        assert events[1].data == b"\xff"
        assert events[2].result.exit_code == 3


def test_stream_error_event_raises():
    def route(req, body):
        return httpx.Response(200, content=json.dumps({"type": "error", "error": {"code": "sandbox_dead", "message": "gone"}}).encode())

    async def main():
        client, _ = make_client(route)
        sb = dsec.Sandbox(client, dsec.SandboxInfo(id=SB))
        async for _ in sb.stream_shell("x"):
            pass

    with pytest.raises(dsec.SandboxDead, match="gone"):
        run(main())


def test_stream_http_error_raises_mapped():
    def route(req, body):
        return httpx.Response(404, json={"error": {"code": "sandbox_not_found", "message": "no sandbox"}})

    async def main():
        client, _ = make_client(route)
        sb = dsec.Sandbox(client, dsec.SandboxInfo(id=SB))
        async for _ in sb.stream_shell("x"):
            pass

    with pytest.raises(SandboxNotFound):
        run(main())


def test_files_requests(tmp_path):
    store = {}

    def route(req, body):
        p = req.url.params.get("path")
        path = req.url.path
        if path.endswith("/files") and req.method == "PUT":
            store[p] = (body, int(req.url.params["mode"], 8))
            return httpx.Response(200, json={"path": p, "name": os.path.basename(p), "kind": "file", "size": len(body),
                                             "mode": store[p][1], "uid": 0, "gid": 0, "mtime": 1})
        if path.endswith("/files") and req.method == "GET":
            if p not in store:
                return httpx.Response(404, json={"error": {"code": "file_not_found", "message": f"{p}: no such file"}})
            data, mode = store[p]
            return httpx.Response(200, content=data, headers={"x-dsec-mode": format(mode, "04o")})
        if path.endswith("/files") and req.method == "DELETE":
            assert req.url.params["recursive"] in ("true", "false")
            store.pop(p, None)
            return httpx.Response(204)
        if path.endswith("/files/list"):
            return httpx.Response(200, json={"path": p, "entries": [
                {"path": k, "name": os.path.basename(k), "kind": "file", "size": len(v[0]), "mode": v[1], "uid": 0, "gid": 0, "mtime": 1}
                for k, v in store.items()]})
        if path.endswith("/files/stat"):
            return httpx.Response(200, json={"path": p, "name": "x", "kind": "dir", "size": 0, "mode": 0o755, "uid": 0, "gid": 0, "mtime": 1})
        if path.endswith("/files/mkdir"):
            assert req.url.params["parents"] == "true" and req.url.params["mode"] == "0700"
            return httpx.Response(200, json={"path": p, "name": "d", "kind": "dir", "size": 0, "mode": 0o700, "uid": 0, "gid": 0, "mtime": 1})
        return httpx.Response(500)

    local = tmp_path / "script.sh"
    local.write_bytes(b"#!/bin/sh\necho hi\n" * 1000)
    os.chmod(local, 0o750)

    async def main():
        client, _ = make_client(route)
        sb = dsec.Sandbox(client, dsec.SandboxInfo(id=SB))
        info = await sb.write_file("/tmp/a.bin", b"\x00\x01\xff", mode=0o600)
        assert info.mode == 0o600 and info.size == 3
        await sb.write_file("/tmp/t.txt", "héllo")
        assert await sb.read_file("/tmp/a.bin") == b"\x00\x01\xff"
        assert await sb.read_file("/tmp/t.txt") == "héllo".encode()
        await sb.upload(local, "/work/script.sh")
        n = await sb.download("/work/script.sh", tmp_path / "back.sh")
        assert n == local.stat().st_size
        entries = await sb.list_files("/")
        assert {e.path for e in entries} == {"/tmp/a.bin", "/tmp/t.txt", "/work/script.sh"}
        assert (await sb.stat("/tmp")).is_dir
        assert (await sb.mkdir("/a/b", mode=0o700)).mode == 0o700
        await sb.remove("/tmp/a.bin")
        with pytest.raises(FileNotFound):
            await sb.read_file("/tmp/a.bin")

    run(main())
    assert store["/tmp/t.txt"] == ("héllo".encode(), 0o644)
    assert store["/work/script.sh"] == (local.read_bytes(), 0o750)
    back = tmp_path / "back.sh"
    assert back.read_bytes() == local.read_bytes()
    assert stat.S_IMODE(back.stat().st_mode) == 0o750


def test_parse_mode_header():
    assert parse_mode_header("0644") == 0o644
    assert parse_mode_header("755") == 0o755
    assert parse_mode_header("0o4755") == 0o4755
    assert parse_mode_header(None) is None
    assert parse_mode_header("garbage") is None


def test_sandbox_ids_are_path_quoted():
    def route(req, body):
        return httpx.Response(404, json={"error": {"code": "sandbox_not_found", "message": "x"}})

    async def main():
        client, rec = make_client(route)
        with pytest.raises(SandboxNotFound):
            await client.get_sandbox("../images")
        return rec

    rec = run(main())
    assert rec.requests[0][0].url.raw_path == b"/v1/sandboxes/..%2Fimages"


def test_sync_client_mirrors_async():
    def route(req, body):
        if req.method == "POST" and req.url.path == "/v1/sandboxes":
            return httpx.Response(201, json=info_json())
        if req.url.path.endswith("/shell"):
            if json.loads(body).get("stream"):
                return httpx.Response(200, content=b'{"type":"stdout","data":"x"}\n{"type":"exit","result":' + json.dumps(result_json(stdout="")).encode() + b"}\n")
            return httpx.Response(200, json=result_json())
        if req.method == "DELETE":
            return httpx.Response(200, json=info_json(state="stopped"))
        if req.url.path == "/v1/images":
            return httpx.Response(200, json={"images": [{"name": "busybox:latest", "layers": [], "size_bytes": 1, "created_at": "t"}]})
        if req.url.path == "/v1/sandboxes":
            return httpx.Response(200, json={"sandboxes": [info_json()]})
        return httpx.Response(404, json={"error": {"code": "sandbox_not_found", "message": "no"}})

    with dsec.sync.DSecClient(api_key="k", **transport_kwargs(Recorder(route))) as client:
        with client.run_container(DSecContainerRunArgs(container_image="debian")) as sb:
            assert sb.run_shell("echo hello world").stdout == "hello world\n"
            assert [e.type for e in sb.stream_shell("x")] == ["stdout", "exit"]
        assert sb.info.state == "stopped"
        assert [i.name for i in client.list_images()] == ["busybox:latest"]
        assert [s.id for s in client.list_sandboxes()] == [SB]
        with pytest.raises(SandboxNotFound):
            client.attach("sb-n0-0000000000000000")


def test_call_to_an_ended_sandbox_raises_sandbox_ended_with_its_reason():
    def route(req, body):
        if req.method == "GET" and req.url.path == f"/v1/sandboxes/{SB}":
            return httpx.Response(200, json={"id": SB, "state": "stopped", "end_reason": "node_lost",
                                             "end_detail": "node n0 silent", "reason": "node n0 silent"})
        return httpx.Response(410, json={"error": {"code": "sandbox_dead", "message": "gone"}})

    async def main():
        client, _ = make_client(route)
        sb = dsec.Sandbox(client, dsec.SandboxInfo(id=SB))
        await sb.run_shell("x")

    with pytest.raises(dsec.SandboxEnded) as ei:
        run(main())
    e = ei.value
    assert isinstance(e, dsec.SandboxDead) and e.code == "sandbox_dead" and e.status == 410
    assert e.reason == "node_lost" and e.detail == "node n0 silent" and e.infrastructure
    assert e.sandbox_id == SB


def test_a_410_without_an_end_reason_stays_sandbox_dead():
    def route(req, body):
        if req.method == "GET":
            return httpx.Response(200, json={"id": SB, "state": "failed"})
        return httpx.Response(410, json={"error": {"code": "sandbox_dead", "message": "gone"}})

    async def main():
        client, _ = make_client(route)
        await dsec.Sandbox(client, dsec.SandboxInfo(id=SB)).run_shell("x")

    with pytest.raises(dsec.SandboxDead) as ei:
        run(main())
    assert not isinstance(ei.value, dsec.SandboxEnded)
