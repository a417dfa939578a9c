"""The SDK's own HTTP/1.1 client (dsec/_http.py) against an in-process server: keep-alive,
bounded pool, the one-time resend rules, timeouts, early answers, streams, clean close."""

from __future__ import annotations

import asyncio
import gc
import json
import time
import warnings

import httpx
import pytest

import dsec
import dsec.sync
from dsec import DSecClient, DSecContainerRunArgs, NodeUnavailable, PayloadTooLarge
from dsec import _http
from httpserver import Drop, EarlyAnswer, Stall, TestServer, Trickle

SB = "sb-n0-3f9a2c01d4e5b6a7"
INFO = {"id": SB, "node": "n0", "state": "running", "substrate": "container", "image": "busybox"}


@pytest.fixture
def servers():
    made = []

    def make(route, **kw):
        s = TestServer(route, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


def ok(req):
    return httpx.Response(200, json=INFO)


def run(coro):
    return asyncio.run(coro)


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_keep_alive_one_connection_and_closed_on_exit(servers):
    srv = servers(ok)

    async def main():
        async with DSecClient(srv.url, "k") as c:
            for _ in range(20):
                assert (await c.get_sandbox(SB)).id == SB
            pool = c._http
            assert pool.open_connections == 1
        assert pool.open_connections == 0 and c._http is None

    run(main())
    assert srv.connections == 1 and len(srv.requests) == 20
    assert srv.requests[0].headers["authorization"] == "Bearer k"
    assert wait_for(lambda: srv.call(lambda: srv.open_connections) == 0), "close() must close the connection"


def test_pool_bounds_requests_in_flight(servers):
    srv = servers(lambda req: Trickle(httpx.Response(200, json=INFO), pieces=2, pause=0.05))

    async def main():
        async with DSecClient(srv.url, "k", max_connections=2) as c:
            infos = await asyncio.gather(*(c.get_sandbox(SB) for _ in range(8)))
            assert all(i.id == SB for i in infos)

    run(main())
    assert srv.max_open <= 2 and srv.connections <= 2


def test_dead_pooled_connection_resends_get_once(servers):
    calls = {"n": 0}

    def route(req):
        calls["n"] += 1
        return Drop() if calls["n"] == 2 else ok(req)

    srv = servers(route)

    async def main():
        async with DSecClient(srv.url, "k") as c:
            await c.get_sandbox(SB)
            assert (await c.get_sandbox(SB)).id == SB  # dropped on the reused connection, resent

    run(main())
    assert calls["n"] == 3 and srv.connections == 2


def test_post_is_never_resent(servers):
    calls = {"n": 0}

    def route(req):
        calls["n"] += 1
        if req.method == "POST":
            return Drop()
        return ok(req)

    srv = servers(route)

    async def main():
        async with DSecClient(srv.url, "k") as c:
            await c.get_sandbox(SB)
            sb = dsec.Sandbox(c, dsec.SandboxInfo(id=SB))
            with pytest.raises(NodeUnavailable, match="without answering"):
                await sb.run_shell("echo once")
            with pytest.raises(NodeUnavailable):
                await c.run_container(DSecContainerRunArgs(container_image="busybox"))

    run(main())
    posts = [r for r in srv.requests if r.method == "POST"]
    assert len(posts) == 2, "a POST that may have reached the server must not be sent twice"


def test_create_with_idempotency_key_is_resent(servers):
    calls = {"posts": 0}

    def route(req):
        if req.method == "POST":
            calls["posts"] += 1
            if calls["posts"] == 1:
                return Drop()
            return httpx.Response(201, json=INFO)
        return ok(req)

    srv = servers(route)

    async def main():
        async with DSecClient(srv.url, "k") as c:
            await c.get_sandbox(SB)  # makes the next request use a pooled connection
            sb = await c.run_container(DSecContainerRunArgs(container_image="busybox", idempotency_key="job-1"))
            assert sb.id == SB

    run(main())
    assert calls["posts"] == 2


def test_fresh_connection_dropped_is_not_resent(servers):
    srv = servers(lambda req: Drop())

    async def main():
        async with DSecClient(srv.url, "k") as c:
            await c.get_sandbox(SB)

    with pytest.raises(NodeUnavailable, match="cannot reach"):
        run(main())
    assert len(srv.requests) == 1


def test_total_timeout_maps_to_transport_error_and_drops_connection(servers):
    srv = servers(lambda req: Stall(5.0))

    async def main():
        async with DSecClient(srv.url, "k", timeout=0.3) as c:
            t0 = time.monotonic()
            with pytest.raises(dsec.TransportError, match="timed out") as info:
                await c.get_sandbox(SB)
            assert time.monotonic() - t0 < 2.0
            assert isinstance(info.value, NodeUnavailable)
            assert c._http.open_connections == 0

    run(main())


def test_connect_refused_is_node_unavailable():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()

    async def main():
        async with DSecClient(f"http://127.0.0.1:{port}", "k") as c:
            await c.list_sandboxes()

    with pytest.raises(NodeUnavailable, match="cannot reach"):
        run(main())


def test_early_413_during_upload_is_reported(servers, tmp_path):
    def route(req):
        return EarlyAnswer(httpx.Response(413, json={"error": {"code": "payload_too_large", "message": "too big"}}))

    srv = servers(route, answer_before_body=True)
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (32 << 20))

    async def main():
        async with DSecClient(srv.url, "k") as c:
            sb = dsec.Sandbox(c, dsec.SandboxInfo(id=SB))
            with pytest.raises(PayloadTooLarge, match="too big"):
                await sb.upload(big, "/tmp/big.bin")
            with pytest.raises(PayloadTooLarge, match="too big"):
                await sb.write_file("/tmp/big.bin", b"\1" * (8 << 20))

    run(main())


def test_upload_is_chunked_and_streamed(servers, tmp_path):
    got = {}

    def route(req):
        got["te"] = req.headers.get("transfer-encoding")
        got["body"] = req.content
        return httpx.Response(200, json={"path": "/x", "name": "x", "kind": "file", "size": len(req.content),
                                         "mode": 0o644, "uid": 0, "gid": 0, "mtime": 1})

    srv = servers(route)
    local = tmp_path / "f"
    local.write_bytes(bytes(range(256)) * 9000)

    async def main():
        async with DSecClient(srv.url, "k") as c:
            sb = dsec.Sandbox(c, dsec.SandboxInfo(id=SB))
            info = await sb.upload(local, "/x")
            assert info.size == local.stat().st_size

    run(main())
    assert got["te"] == "chunked" and got["body"] == local.read_bytes()


def test_stream_arrives_in_pieces_and_early_exit_closes_connection(servers):
    lines = [{"type": "stdout", "data": f"line {i}\n"} for i in range(6)]
    lines.append({"type": "exit", "result": {"exit_code": 0}})
    payload = "".join(json.dumps(x) + "\n" for x in lines).encode()
    srv = servers(lambda req: Trickle(httpx.Response(200, content=payload), pieces=5, pause=0.02))

    async def main():
        async with DSecClient(srv.url, "k") as c:
            sb = dsec.Sandbox(c, dsec.SandboxInfo(id=SB))
            events = [e async for e in sb.stream_shell("x")]
            assert [e.text for e in events[:-1]] == [f"line {i}\n" for i in range(6)]
            assert events[-1].type == "exit"
            assert c._http.open_connections == 1  # read to the end: kept
            gen = sb.stream_shell("y")
            first = await gen.__anext__()
            assert first.type == "stdout"
            await gen.aclose()  # leaving early closes the connection (cancels the command)
            assert c._http.open_connections == 0

    run(main())
    assert wait_for(lambda: srv.call(lambda: srv.disconnects) >= 1)


def test_stream_read_timeout(servers):
    srv = servers(lambda req: Trickle(httpx.Response(200, content=b'{"type":"stdout","data":"a"}\n' * 2), pieces=2, pause=2.0))

    # the per-read timeout of a stream is its request timeout (the SDK passes the command's
    # timeout + grace), so drive the pool directly with a short one
    async def direct():
        pool = _http.Pool(srv.url, {}, 0.5)
        try:
            async with pool.stream("POST", "/v1/x", json={}) as resp:
                with pytest.raises(_http.HTTPTimeout):
                    async for _ in resp.aiter_lines():
                        pass
        finally:
            await pool.aclose()

    run(direct())


def test_no_unclosed_warnings(servers):
    srv = servers(ok)

    async def main():
        c = DSecClient(srv.url, "k")
        await asyncio.gather(*(c.get_sandbox(SB) for _ in range(5)))
        await c.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(main())
        with dsec.sync.DSecClient(srv.url, "k") as sc:
            assert sc.get_sandbox(SB).id == SB
        gc.collect()
    bad = [w for w in caught if "nclosed" in str(w.message) or issubclass(w.category, ResourceWarning)]
    assert not bad, [str(w.message) for w in bad]
    assert wait_for(lambda: srv.call(lambda: srv.open_connections) == 0)


def test_query_params_and_prefix(servers):
    seen = []

    def route(req):
        seen.append(req.url)
        return httpx.Response(200, content=b"data")

    srv = servers(route)

    async def main():
        async with DSecClient(srv.url + "/api/", "k") as c:
            sb = dsec.Sandbox(c, dsec.SandboxInfo(id=SB))
            assert await sb.read_file("/tmp/a b+c&d=é") == b"data"

    run(main())
    assert seen[0].path == f"/api/v1/sandboxes/{SB}/files"
    assert seen[0].params["path"] == "/tmp/a b+c&d=é" and seen[0].params["step"] == "1"


def test_https_and_transport_use_httpx():
    c = DSecClient("https://api.example.test", "k")
    run(c.open())
    assert isinstance(c._http, _http.HttpxPool)
    run(c.close())
    c = DSecClient("http://api.example.test", "k")
    run(c.open())
    assert isinstance(c._http, _http.Pool)
    run(c.close())


def test_headers_case_insensitive_and_bad_answers():
    status, headers, keep = _http._parse_head(b"HTTP/1.1 200 OK\r\nX-Dsec-Mode: 0644\r\nSet: a\r\nset: b\r\nConnection: close")
    assert status == 200 and not keep
    assert headers.get("x-dsec-mode") == "0644" and headers["X-DSEC-MODE"] == "0644" and "X-Dsec-Mode" in headers
    assert headers["set"] == "a, b"
    _, _, keep = _http._parse_head(b"HTTP/1.0 200 OK\r\nconnection: keep-alive")
    assert keep
    with pytest.raises(_http.HTTPError):
        _http._parse_head(b"SSH-2.0-OpenSSH\r\n")
    with pytest.raises(ValueError):
        _http.Pool("http://h", {"x-evil": "a\r\nb: c"}, 1.0)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_client_reused_across_event_loops(servers):
    """Misuse that must still work: the first asyncio.run leaves an idle connection behind on a
    loop that is then closed (asyncio cannot close it any more: the warning is expected)."""
    srv = servers(ok)
    c = DSecClient(srv.url, "k")
    run(c.get_sandbox(SB))
    assert run(c.get_sandbox(SB)).id == SB
    run(c.close())
    assert srv.connections == 2
    gc.collect()


def test_retry_after_from_429(servers):
    srv = servers(lambda req: httpx.Response(
        429, json={"error": {"code": "quota_exceeded", "message": "queue full"}, "retry_after_s": 3},
        headers={"retry-after": "3"}))

    async def main():
        async with DSecClient(srv.url, "k") as c:
            await c.call_function("python", "print(1)")

    with pytest.raises(dsec.QuotaExceeded) as info:
        run(main())
    assert info.value.retry_after_s == 3.0


def test_upload_source_error_is_raised_as_is(servers, tmp_path):
    srv = servers(ok)

    async def chunks():
        yield b"abc"
        raise PermissionError("cannot read the local file")

    async def main():
        async with DSecClient(srv.url, "k") as c:
            with pytest.raises(PermissionError, match="local file"):
                await c._request("PUT", "/v1/x", content=chunks())
            assert c._http.open_connections == 0
            assert (await c.get_sandbox(SB)).id == SB

    run(main())


def test_waiting_for_a_slot_counts_against_the_timeout(servers):
    srv = servers(lambda req: Stall(3.0))

    async def main():
        async with DSecClient(srv.url, "k", timeout=0.5, max_connections=1) as c:
            t0 = time.monotonic()
            res = await asyncio.gather(c.get_sandbox(SB), c.get_sandbox(SB), return_exceptions=True)
            assert all(isinstance(r, dsec.TransportError) for r in res), res
            assert time.monotonic() - t0 < 2.0

    run(main())


def test_many_concurrent_requests_share_a_bounded_pool(servers):
    """300 requests at once through a pool of 16: all answered with their own data; now and
    then the server drops a kept-alive connection instead of answering (GETs are resent)."""
    state = {"n": 0}

    def route(req):
        state["n"] += 1
        if state["n"] % 37 == 0 and req.method == "GET":
            return Drop()
        return httpx.Response(200, content=req.url.params["path"].encode())

    srv = servers(route, framing="chunked")

    async def main():
        async with DSecClient(srv.url, "k", max_connections=16, max_idle=4) as c:
            sb = dsec.Sandbox(c, dsec.SandboxInfo(id=SB))
            sb.auto_step = False
            for _ in range(3):  # warm some kept-alive connections so drops hit reused ones
                await sb.read_file("/warm")
            results = await asyncio.gather(*(sb.read_file(f"/f{i}") for i in range(300)), return_exceptions=True)
            failed = [r for r in results if isinstance(r, Exception)]
            # a drop on a fresh connection is not resent: allowed to fail, but only as TransportError
            assert all(isinstance(r, dsec.TransportError) for r in failed), failed
            ok = [(i, r) for i, r in enumerate(results) if not isinstance(r, Exception)]
            assert all(r == f"/f{i}".encode() for i, r in ok)
            assert len(ok) >= 280
            assert c._http.open_connections <= 16

    run(main())
    assert srv.max_open <= 16


@pytest.mark.parametrize("framing", ["length", "chunked", "eof"])
def test_large_bodies(servers, tmp_path, framing):
    blob = bytes(range(256)) * (6 * 4096)  # 6 MiB
    srv = servers(lambda req: httpx.Response(200, content=blob, headers={"x-dsec-mode": "0600"}), framing=framing)

    async def main():
        async with DSecClient(srv.url, "k") as c:
            sb = dsec.Sandbox(c, dsec.SandboxInfo(id=SB))
            assert await sb.read_file("/big") == blob
            assert await sb.download("/big", tmp_path / "big") == len(blob)
            assert await sb.read_file("/big") == blob

    run(main())
    assert (tmp_path / "big").read_bytes() == blob
    assert (tmp_path / "big").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 3, 4\r\n\r\nabcd",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-5\r\nabc\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0x3\r\nabc\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc",  # then closed: truncated
    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab",  # truncated chunk
    b"NOT HTTP\r\n\r\n",
])
def test_malformed_answers_are_transport_errors(answer):
    async def main():
        async def handle(r, w):
            await r.readuntil(b"\r\n\r\n")
            w.write(answer)
            await w.drain()
            w.close()

        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        try:
            async with DSecClient(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", "k") as c:
                with pytest.raises(dsec.TransportError):
                    await c._request("GET", "/v1/x")
                assert c._http.open_connections == 0
        finally:
            srv.close()
            await srv.wait_closed()

    run(main())
