"""A tiny HTTP/1.1 server for the SDK's unit tests: runs an asyncio loop in a thread, parses
requests (content-length and chunked bodies) into ``httpx.Request`` objects, hands them to a
route function and writes its ``httpx.Response`` back framed by ``content-length``,
``transfer-encoding: chunked`` or the end of the connection (``framing``).

A route may also return one of the actions below to misbehave on purpose."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import httpx


@dataclass
class Drop:
    """Close the connection without answering (after reading the request)."""


@dataclass
class Stall:
    """Answer nothing for ``seconds`` (then close)."""

    seconds: float


@dataclass
class Trickle:
    """Send ``response`` (chunked) in ``pieces`` writes ``pause`` seconds apart."""

    response: httpx.Response
    pieces: int = 3
    pause: float = 0.05


@dataclass
class EarlyAnswer:
    """With ``answer_before_body``: answer ``response`` after reading only the request head,
    then close (like a 413 sent before the upload finished)."""

    response: httpx.Response


class TestServer:
    __test__ = False  # not a pytest test class

    def __init__(self, route: Callable[[httpx.Request], Any], framing: str = "length",
                 answer_before_body: bool = False):
        self.route = route
        self.framing = framing
        #: Call the route with the request head only; an EarlyAnswer is sent before the body is read.
        self.answer_before_body = answer_before_body
        self.connections = 0
        self.open_connections = 0
        self.max_open = 0
        self.requests: List[httpx.Request] = []
        self.disconnects = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: Optional[asyncio.AbstractServer] = None
        self._tasks: set = set()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        self._ready.wait(10)
        assert self._server is not None
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self._ready.set()
        self._loop.run_forever()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` on the server's loop (e.g. to read counters consistently)."""
        return asyncio.run_coroutine_threadsafe(self._call(fn), self._loop).result(10)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def stop(self) -> None:
        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._server.wait_closed()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        self.connections += 1
        self.open_connections += 1
        self.max_open = max(self.max_open, self.open_connections)
        try:
            while await self._one(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self.open_connections -= 1
            self.disconnects += 1
            writer.close()
            self._tasks.discard(task)

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        lines = head[:-4].decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = [tuple(x.strip() for x in line.split(":", 1)) for line in lines[1:]]
        hmap = {k.lower(): v for k, v in headers}
        if self.answer_before_body:
            head_only = httpx.Request(method, f"{self.url}{target}", headers=headers)
            self.requests.append(head_only)
            resp = self.route(head_only)
            if isinstance(resp, EarlyAnswer):
                await self._write(writer, resp.response, close=True)
                return False
        if "chunked" in hmap.get("transfer-encoding", ""):
            parts = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                parts.append(await reader.readexactly(size))
                await reader.readexactly(2)
            body = b"".join(parts)
        else:
            body = await reader.readexactly(int(hmap.get("content-length", "0")))
        req = httpx.Request(method, f"{self.url}{target}", headers=headers, content=body)
        self.requests.append(req)
        resp = self.route(req)
        if isinstance(resp, Drop):
            return False
        if isinstance(resp, Stall):
            await asyncio.sleep(resp.seconds)
            return False
        if isinstance(resp, Trickle):
            await self._trickle(writer, resp)
            return True
        if isinstance(resp, EarlyAnswer):
            resp = resp.response
        return await self._write(writer, resp, close=False)

    async def _write(self, writer: asyncio.StreamWriter, resp: httpx.Response, close: bool) -> bool:
        body = resp.read()
        framing = self.framing
        out = [f"HTTP/1.1 {resp.status_code} {resp.reason_phrase}"]
        for k, v in resp.headers.items():
            if k.lower() not in ("content-length", "transfer-encoding"):
                out.append(f"{k}: {v}")
        no_body = resp.status_code in (204, 304) or (100 <= resp.status_code < 200)
        if close or framing == "eof":
            out.append("connection: close")
        if no_body:
            pass
        elif framing == "chunked":
            out.append("transfer-encoding: chunked")
        elif framing == "length":
            out.append(f"content-length: {len(body)}")
        data = ("\r\n".join(out) + "\r\n\r\n").encode("latin-1")
        if not no_body:
            if framing == "chunked":
                step = 7 if len(body) < 4096 else 65536  # tiny chunks, but not a million of them
                pieces = [body[i:i + step] for i in range(0, len(body), step)]
                data += b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\nx-trailer: 1\r\n\r\n"
            else:
                data += body
        writer.write(data)
        await writer.drain()
        return not (close or framing == "eof")

    async def _trickle(self, writer: asyncio.StreamWriter, t: Trickle) -> None:
        body = t.response.read()
        head = f"HTTP/1.1 {t.response.status_code} OK\r\ntransfer-encoding: chunked\r\n\r\n".encode()
        writer.write(head)
        n = max(1, -(-len(body) // t.pieces))
        for i in range(0, len(body), n):
            piece = body[i:i + n]
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(t.pause)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
