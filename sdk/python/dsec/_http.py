"""A small asyncio HTTP/1.1 client for the dsec API (``http://`` only, standard library only).

Why not httpx: its request/response machinery (httpx + httpcore + h11, all pure Python) costs
about 0.4-0.7 ms of client CPU per request, several times the cost of the request itself on
loopback. This client writes the request head in one ``write`` and parses the answer with a few
``bytes`` operations (≈ 0.05-0.1 ms per JSON request).

What it does:

* a keep-alive connection pool per client: at most ``max_connections`` requests in flight (the
  others wait for a slot), at most ``max_idle`` idle connections kept (LIFO, dropped after
  ``idle_expiry`` s); a pooled connection found closed or with unexpected bytes is dropped
  before use;
* one retry on a fresh connection when a *reused* connection ends before any byte of the answer
  was read (the server closed it while idle), only for requests that are safe to resend:
  GET/HEAD/OPTIONS/PUT/DELETE with a replayable body, or a request the caller marks
  ``retry=True`` (e.g. a create carrying an idempotency key). A POST is never resent otherwise;
* request bodies: ``bytes`` (``content-length``) or an async iterator of ``bytes`` (sent
  ``transfer-encoding: chunked``); if the server answers early (e.g. 413) and closes while the
  body is being sent, that answer is returned;
* answers framed by ``content-length``, ``transfer-encoding: chunked`` or the end of the
  connection; 1xx interim answers are skipped;
* :meth:`Pool.request` reads the whole answer under one total deadline (``timeout``; the TCP
  connect has its own ``connect_timeout``); :meth:`Pool.stream` waits for the answer head under
  that deadline, then allows ``timeout`` seconds per body read (like httpx's read timeout), and
  closes the connection if the body was not read to its end (so leaving an NDJSON stream early
  cancels the command on the server).

Errors: :class:`HTTPTimeout` (a deadline passed), :class:`ConnectFailed` (no TCP connection),
:class:`HTTPError` (anything else on the wire). A request cancelled or failing mid-way closes its
connection; it never goes back to the pool.
"""

from __future__ import annotations

import asyncio
import collections
import json as _jsonlib
import os
import socket
import sys
from typing import Any, AsyncIterator, Deque, Dict, List, Mapping, Optional, Set, Tuple
from urllib.parse import urlencode, urlsplit

#: Largest answer head accepted; reading pauses when twice this much is buffered unread.
READ_LIMIT = 256 * 1024
#: Body read size for streamed answers.
READ_CHUNK = 256 * 1024
#: Bodies larger than this are written in a separate ``write`` (no copy) and drained.
_SMALL_BODY = 64 * 1024
#: Methods resent once on a fresh connection when a reused one died before answering.
_IDEMPOTENT = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
_NO_BODY_STATUS = frozenset({204, 304})


class _Nothing:
    def __repr__(self) -> str:
        return "<no body>"


#: "No JSON body" (``None`` is a valid JSON body).
NOTHING: Any = _Nothing()


class HTTPError(Exception):
    """The exchange failed on the wire (connection reset, malformed answer, ...)."""


class ConnectFailed(HTTPError):
    """No TCP connection to the server could be made."""


class HTTPTimeout(HTTPError):
    """The connect timeout or the request's deadline passed."""


class _BodyError(Exception):
    """The request body's async iterator raised ``error`` (re-raised as is to the caller)."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class _NoAnswer(HTTPError):
    """The connection ended before any byte of the answer arrived (maybe safe to resend)."""


if sys.version_info >= (3, 11):

    async def _within(coro: Any, seconds: Optional[float]) -> Any:
        async with asyncio.timeout(seconds):
            return await coro

else:  # pragma: no cover - exercised on Python < 3.11 only

    async def _within(coro: Any, seconds: Optional[float]) -> Any:
        return await asyncio.wait_for(coro, seconds)


class Headers(dict):  # type: ignore[type-arg]
    """Answer headers: names lower-cased, repeated headers joined with ``", "``; lookups are
    case-insensitive."""

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return dict.get(self, key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return dict.__getitem__(self, key.lower())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and dict.__contains__(self, key.lower())


class Response:
    """A complete answer."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status_code: int, headers: Headers, content: bytes):
        self.status_code = status_code
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return _jsonlib.loads(self.content)

    def __repr__(self) -> str:
        return f"<Response [{self.status_code}]>"


class _Conn(asyncio.Protocol):
    """One TCP connection: an asyncio protocol with a read buffer. Unlike ``StreamReader``,
    bytes already received are handed out before a connection error is raised, so an answer
    the server sent just before resetting the connection (a 413 during an upload) is read."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self.transport: Any = None
        self.buf = bytearray()
        self.eof = False
        self.exc: Optional[BaseException] = None
        self._waiter: "Optional[asyncio.Future[None]]" = None
        self._read_paused = False
        self._want = 0
        self._write_paused = False
        self._drain_waiter: "Optional[asyncio.Future[None]]" = None
        self._closed: "asyncio.Future[None]" = loop.create_future()
        self.idle_since = 0.0

    # -- protocol callbacks -----------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > max(2 * READ_LIMIT, self._want) and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # close our side too

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        if exc is not None and not self.eof:
            self._salvage()
        self.eof = True
        if exc is not None and self.exc is None:
            self.exc = exc
        self._wake()
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_result(None)
        if not self._closed.done():
            self._closed.set_result(None)

    def _salvage(self) -> None:
        """A failed send (the server reset the connection after answering early, e.g. 413 to an
        upload) makes asyncio stop reading, though the answer may still sit in the kernel's
        receive queue: read what is there (the socket is still open during connection_lost)."""
        try:
            sock = self.transport.get_extra_info("socket")
            if sock is None:
                return
            fd = os.dup(sock.fileno())
        except (OSError, ValueError):
            return
        dup = socket.socket(fileno=fd)
        try:
            while len(self.buf) < READ_LIMIT:
                data = dup.recv(65536, socket.MSG_DONTWAIT)
                if not data:
                    break
                self.buf += data
        except OSError:
            pass
        finally:
            dup.close()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- reading ----------------------------------------------------------------------------------

    async def _wait(self) -> None:
        if self._read_paused:
            self._read_paused = False
            self.transport.resume_reading()
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _ended(self, partial: bytes, expected: Optional[int]) -> BaseException:
        if self.exc is not None:
            return self.exc
        return asyncio.IncompleteReadError(partial, expected)

    def _take(self, n: int) -> bytes:
        buf = self.buf
        if n == len(buf):
            data = bytes(buf)
            buf.clear()
        else:
            data = bytes(buf[:n])
            del buf[:n]
        return data

    async def readuntil(self, sep: bytes) -> bytes:
        start = 0
        while True:
            i = self.buf.find(sep, start)
            if i >= 0:
                return self._take(i + len(sep))
            if len(self.buf) > READ_LIMIT:
                raise asyncio.LimitOverrunError("separator not found within the limit", len(self.buf))
            if self.eof:
                raise self._ended(bytes(self.buf), None)
            start = max(0, len(self.buf) - len(sep) + 1)
            await self._wait()

    async def readexactly(self, n: int) -> bytes:
        if len(self.buf) < n:
            self._want = n  # a large body: do not pause reading before it is all here
            try:
                while len(self.buf) < n:
                    if self.eof:
                        raise self._ended(bytes(self.buf), n)
                    await self._wait()
            finally:
                self._want = 0
        return self._take(n)

    async def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (``-1``: everything until the end); ``b""`` at a clean end."""
        if n < 0:
            while not self.eof:
                await self._wait()
            if self.exc is not None:
                raise self.exc
            return self._take(len(self.buf))
        while not self.buf:
            if self.eof:
                if self.exc is not None:
                    raise self.exc
                return b""
            await self._wait()
        return self._take(min(n, len(self.buf)))

    def has_buffered(self) -> bool:
        return bool(self.buf)

    # -- writing ----------------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError(f"connection lost: {self.exc!r}" if self.exc else "connection closed")
        self.transport.write(data)

    async def drain(self) -> None:
        if self.transport.is_closing():
            if self.exc is not None:
                raise ConnectionResetError(f"connection lost: {self.exc!r}")
            if self._closed.done():
                raise ConnectionResetError("connection closed")
        if self._write_paused:
            self._drain_waiter = self._loop.create_future()
            try:
                await self._drain_waiter
            finally:
                self._drain_waiter = None
            if self._closed.done():
                raise ConnectionResetError(f"connection lost: {self.exc!r}" if self.exc else "connection closed")

    # -- state ------------------------------------------------------------------------------------

    def reusable(self) -> bool:
        """Still open and silent: an idle connection must have nothing to read."""
        return not (self.eof or self.buf or self.transport is None or self.transport.is_closing())

    def close(self) -> None:
        if self.transport is not None:
            try:
                self.transport.close()
            except RuntimeError:  # its event loop is closed already: nothing can be done
                pass

    async def wait_closed(self) -> None:
        await self._closed


def _parse_head(head: bytes) -> Tuple[int, Headers, bool]:
    """Status, headers and whether the connection may be kept (from version + ``connection``)."""
    lines = head.split(b"\r\n")
    status_line = lines[0]
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise HTTPError(f"malformed status line from the server: {status_line[:100]!r}")
    try:
        status = int(parts[1])
    except ValueError:
        raise HTTPError(f"malformed status line from the server: {status_line[:100]!r}") from None
    headers = Headers()
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(b":")
        if not sep:
            raise HTTPError(f"malformed header line from the server: {line[:100]!r}")
        key = name.strip().lower().decode("latin-1")
        text = value.strip().decode("latin-1")
        if dict.__contains__(headers, key):
            dict.__setitem__(headers, key, dict.__getitem__(headers, key) + ", " + text)
        else:
            dict.__setitem__(headers, key, text)
    conn_tokens = dict.get(headers, "connection", "").lower()
    if parts[0] == b"HTTP/1.0":
        keep = "keep-alive" in conn_tokens
    else:
        keep = "close" not in conn_tokens
    return status, headers, keep


class _Body:
    """Reads one answer body off a connection according to its framing."""

    __slots__ = ("reader", "mode", "remaining", "done")

    def __init__(self, reader: _Conn, method: str, status: int, headers: Headers):
        self.reader = reader
        self.done = False
        self.remaining = 0
        te = dict.get(headers, "transfer-encoding")
        cl = dict.get(headers, "content-length")
        if method == "HEAD" or status in _NO_BODY_STATUS or status < 200:
            self.mode = "none"
            self.done = True
        elif te is not None and "chunked" in te.lower():
            self.mode = "chunked"
        elif cl is not None:
            values = {v.strip() for v in cl.split(",")}  # repeated identical values are allowed
            if len(values) != 1 or not next(iter(values)).isdigit():
                raise HTTPError(f"bad content-length from the server: {cl!r}")
            self.remaining = int(next(iter(values)))
            self.mode = "length"
            self.done = self.remaining == 0
        else:
            self.mode = "eof"

    async def read_all(self) -> bytes:
        if self.done:
            return b""
        if self.mode == "length":
            try:
                data = await self.reader.readexactly(self.remaining)
            except asyncio.IncompleteReadError as e:
                raise HTTPError(
                    f"the server closed the connection after {len(e.partial)} of {self.remaining} body bytes"
                ) from None
            self.remaining = 0
            self.done = True
            return data
        if self.mode == "eof":
            data = await self.reader.read()
            self.done = True
            return data
        parts: List[bytes] = []
        while True:
            chunk = await self.read_chunk(1 << 62)
            if not chunk:
                return b"".join(parts)
            parts.append(chunk)

    async def read_chunk(self, limit: int = READ_CHUNK) -> bytes:
        """The next piece of the body (at most ``limit`` bytes); ``b""`` at its end."""
        if self.done:
            return b""
        reader = self.reader
        if self.mode == "length":
            data = await reader.read(min(self.remaining, limit))
            if not data:
                raise HTTPError(f"the server closed the connection with {self.remaining} body bytes missing")
            self.remaining -= len(data)
            self.done = self.remaining == 0
            return data
        if self.mode == "eof":
            data = await reader.read(limit)
            if not data:
                self.done = True
            return data
        try:
            if self.remaining == 0:
                line = await reader.readuntil(b"\r\n")
                size_text = line.split(b";", 1)[0].strip()
                if not size_text or size_text.strip(b"0123456789abcdefABCDEF"):
                    raise HTTPError(f"bad chunk size from the server: {line[:40]!r}")
                size = int(size_text, 16)
                if size == 0:
                    while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                        pass
                    self.done = True
                    return b""
                self.remaining = size
            data = await reader.read(min(self.remaining, limit))
            if not data:
                raise HTTPError("the server closed the connection inside a chunk")
            self.remaining -= len(data)
            if self.remaining == 0 and (await reader.readexactly(2)) != b"\r\n":
                raise HTTPError("chunk not followed by CRLF")
            return data
        except asyncio.IncompleteReadError:
            raise HTTPError("the server closed the connection inside a chunked body") from None
        except asyncio.LimitOverrunError:
            raise HTTPError("chunk header too long") from None


class StreamResponse:
    """An answer whose body is read on demand (inside :meth:`Pool.stream`)."""

    def __init__(self, status_code: int, headers: Headers, body: _Body, read_timeout: Optional[float]):
        self.status_code = status_code
        self.headers = headers
        self._body = body
        self._read_timeout = read_timeout

    async def _next(self, limit: int = READ_CHUNK) -> bytes:
        try:
            return await _within(self._body.read_chunk(limit), self._read_timeout)
        except asyncio.TimeoutError:
            raise HTTPTimeout(f"no data from the server for {self._read_timeout:g} s") from None
        except (OSError, EOFError) as e:
            raise HTTPError(f"connection to the server broke: {e!r}") from None

    async def aread(self) -> bytes:
        parts: List[bytes] = []
        async for chunk in self.aiter_bytes():
            parts.append(chunk)
        return b"".join(parts)

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        while True:
            chunk = await self._next()
            if not chunk:
                return
            yield chunk

    async def aiter_lines(self) -> AsyncIterator[str]:
        """Lines of the body as text, without their ``\\n`` / ``\\r\\n``."""
        pending = b""
        async for chunk in self.aiter_bytes():
            pending += chunk
            if b"\n" not in chunk:
                continue
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r").decode("utf-8", errors="replace")
        if pending:
            yield pending.rstrip(b"\r").decode("utf-8", errors="replace")

    @property
    def complete(self) -> bool:
        return self._body.done


class Pool:
    """Keep-alive HTTP/1.1 connections to one ``http://host:port[/prefix]`` server."""

    def __init__(
        self,
        base_url: str,
        headers: Mapping[str, str],
        timeout: float,
        *,
        connect_timeout: float = 10.0,
        max_connections: int = 1000,
        max_idle: int = 100,
        idle_expiry: float = 60.0,
    ):
        url = urlsplit(base_url)
        if url.scheme != "http":
            raise ValueError(f"dsec._http speaks http:// only, not {base_url!r}")
        host = url.hostname or ""
        if not host:
            raise ValueError(f"no host in {base_url!r}")
        self.host = host
        self.port = url.port or 80
        self.prefix = url.path.rstrip("/")
        host_header = f"[{host}]" if ":" in host else host
        if url.port:
            host_header += f":{url.port}"
        static = {"host": host_header}
        static.update({k.lower(): v for k, v in headers.items()})
        for k, v in static.items():
            _check_header(k, v)
        self._static = "".join(f"{k}: {v}\r\n" for k, v in static.items())
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_connections = max_connections
        self.max_idle = max_idle
        self.idle_expiry = idle_expiry
        self._idle: List[_Conn] = []
        self._all: Set[_Conn] = set()
        self._active = 0
        self._waiters: Deque["asyncio.Future[None]"] = collections.deque()
        self._closed = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        #: Connections opened so far (for tests and diagnostics).
        self.connections_opened = 0

    # -- slots and connections ------------------------------------------------------------------

    async def _take_slot(self) -> None:
        if self._active < self.max_connections and not self._waiters:
            self._active += 1
            return
        fut: "asyncio.Future[None]" = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._give_slot()  # it was handed to us just as we were cancelled
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def _give_slot(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes on; _active unchanged
                return
        self._active -= 1

    async def _connect(self) -> _Conn:
        if self._closed:
            raise HTTPError("the client is closed")
        loop = asyncio.get_running_loop()
        try:
            _, conn = await _within(
                loop.create_connection(lambda: _Conn(loop), self.host, self.port), self.connect_timeout
            )
        except asyncio.TimeoutError:
            raise HTTPTimeout(f"connecting to {self.host}:{self.port} timed out after {self.connect_timeout:g} s") from None
        except OSError as e:
            raise ConnectFailed(f"cannot connect to {self.host}:{self.port}: {e.strerror or e}") from None
        if self._closed:  # closed while we were connecting
            conn.close()
            raise HTTPError("the client is closed")
        self._all.add(conn)
        self.connections_opened += 1
        return conn

    def _pooled(self) -> Optional[_Conn]:
        idle = self._idle
        if not idle:
            return None
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # used from another event loop than the one the connections belong to (e.g. a
            # second asyncio.run): those connections cannot be used here
            self._abandon(idle)
            self._loop = loop
            return None
        now = loop.time()
        while idle:
            conn = idle.pop()
            if conn.reusable() and now - conn.idle_since < self.idle_expiry:
                return conn
            self._discard(conn)
        return None

    def _abandon(self, conns: List[_Conn]) -> None:
        for conn in conns:
            self._all.discard(conn)
            conn.close()
        conns.clear()

    def _discard(self, conn: _Conn) -> None:
        self._all.discard(conn)
        conn.close()

    def _put_back(self, conn: _Conn) -> None:
        if self._closed or len(self._idle) >= self.max_idle or not conn.reusable():
            self._discard(conn)
            return
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._abandon(self._idle)
            self._loop = loop
        conn.idle_since = loop.time()
        self._idle.append(conn)

    # -- requests -------------------------------------------------------------------------------

    def _target(self, path: str, params: Optional[Mapping[str, Any]]) -> str:
        target = self.prefix + path
        if params:
            target += ("&" if "?" in target else "?") + urlencode(params)
        return target

    def _head(
        self, method: str, target: str, headers: Optional[Mapping[str, str]], framing: str
    ) -> bytes:
        extra = ""
        if headers:
            for k, v in headers.items():
                _check_header(k, v)
                extra += f"{k}: {v}\r\n"
        return f"{method} {target} HTTP/1.1\r\n{self._static}{extra}{framing}\r\n".encode("latin-1")

    async def _send(self, conn: _Conn, head: bytes, content: Any) -> bool:
        """Writes the request; ``False`` if the server answered (or closed) before the body was
        all sent, which stops the upload (the answer is then read, the connection not reused)."""
        writer = conn
        if content is None:
            writer.write(head)
        elif isinstance(content, bytes):
            if len(content) <= _SMALL_BODY:
                writer.write(head + content)
            else:
                writer.write(head)
                writer.write(content)
                await writer.drain()
        else:
            writer.write(head)
            chunks = content.__aiter__()
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as e:  # the body's own error (a local file), not the wire's
                    raise _BodyError(e) from e
                if chunk:
                    writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    await writer.drain()
                    await asyncio.sleep(0)  # let an early answer (413, 404, ...) be read
                    if conn.buf or conn.eof:
                        return False
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        return True

    async def _answer_head(self, conn: _Conn) -> Tuple[int, Headers, bool]:
        reader = conn
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as e:
                if not e.partial:
                    raise _NoAnswer("the server closed the connection without answering") from None
                raise HTTPError("the server closed the connection inside the answer head") from None
            except asyncio.LimitOverrunError:
                raise HTTPError(f"answer head larger than {READ_LIMIT} bytes") from None
            except OSError as e:
                if reader.has_buffered():
                    raise HTTPError(f"connection to the server broke: {e!r}") from None
                raise _NoAnswer(f"connection to the server broke before it answered: {e!r}") from None
            status, headers, keep = _parse_head(head)
            if 100 <= status < 200 and status != 101:
                continue  # interim answer (100 Continue, 103 Early Hints)
            return status, headers, keep

    async def _exchange(self, conn: _Conn, method: str, head: bytes, content: Any) -> Tuple[int, Headers, bool]:
        """Sends the request and reads the answer head. A failure while sending the body still
        tries to read an early answer (a 413 sent before the body was read, say)."""
        try:
            if not await self._send(conn, head, content):
                status, headers, _ = await self._answer_head(conn)
                return status, headers, False
        except OSError as send_error:
            try:
                status, headers, _ = await self._answer_head(conn)
            except _NoAnswer:
                raise _NoAnswer(f"connection to the server broke while sending: {send_error!r}") from None
            return status, headers, False
        return await self._answer_head(conn)

    def _framing(self, content: Any, json_body: Any) -> Tuple[Any, str]:
        if json_body is not NOTHING:
            content = _jsonlib.dumps(json_body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
            return content, f"content-type: application/json\r\ncontent-length: {len(content)}\r\n"
        if content is None:
            return None, ""
        if isinstance(content, (bytes, bytearray, memoryview)):
            content = bytes(content)
            return content, f"content-length: {len(content)}\r\n"
        if isinstance(content, str):
            content = content.encode("utf-8")
            return content, f"content-length: {len(content)}\r\n"
        if hasattr(content, "__aiter__"):
            return content, "transfer-encoding: chunked\r\n"
        raise TypeError(f"unsupported request body type {type(content).__name__}")

    async def _open_exchange(
        self,
        method: str,
        path: str,
        params: Optional[Mapping[str, Any]],
        content: Any,
        json_body: Any,
        headers: Optional[Mapping[str, str]],
        retry: Optional[bool],
    ) -> Tuple[_Conn, int, Headers, bool]:
        """Gets a connection, sends, reads the answer head; resends once on a fresh connection
        when a reused one turned out dead before answering and the request is safe to resend."""
        content, framing = self._framing(content, json_body)
        head = self._head(method, self._target(path, params), headers, framing)
        replayable = content is None or isinstance(content, bytes)
        may_resend = replayable and (method in _IDEMPOTENT if retry is None else retry)
        conn = self._pooled()
        reused = conn is not None
        while True:
            if conn is None:
                conn = await self._connect()
            try:
                status, resp_headers, keep = await self._exchange(conn, method, head, content)
                return conn, status, resp_headers, keep
            except _NoAnswer as e:
                self._discard(conn)
                if not (reused and may_resend):
                    raise HTTPError(str(e)) from None
                conn, reused = None, False  # once, on a fresh connection
            except _BodyError as e:
                self._discard(conn)
                raise e.error from e.error.__cause__
            except BaseException:
                self._discard(conn)
                raise

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Optional[Mapping[str, Any]] = None,
        content: Any = None,
        json: Any = NOTHING,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
        retry: Optional[bool] = None,
    ) -> Response:
        """Sends one request and reads the whole answer within ``timeout`` s (default: the
        pool's). ``json`` (any JSON value, ``None`` included) is sent as the body if given;
        ``retry`` overrides whether the request may be resent (default: idempotent methods)."""
        if self._closed:
            raise HTTPError("the client is closed")
        total = self.timeout if timeout is None else timeout
        try:
            return await _within(self._slotted(method, path, params, content, json, headers, retry), total)
        except asyncio.TimeoutError:
            raise HTTPTimeout(f"no complete answer within {total:g} s") from None

    async def _slotted(self, *args: Any) -> Response:
        await self._take_slot()  # waiting for a slot counts against the request's timeout
        try:
            return await self._request(*args)
        finally:
            self._give_slot()

    async def _request(
        self,
        method: str,
        path: str,
        params: Optional[Mapping[str, Any]],
        content: Any,
        json_body: Any,
        headers: Optional[Mapping[str, str]],
        retry: Optional[bool],
    ) -> Response:
        conn, status, resp_headers, keep = await self._open_exchange(
            method, path, params, content, json_body, headers, retry
        )
        try:
            body = _Body(conn, method, status, resp_headers)
            data = await body.read_all()
        except BaseException as e:
            self._discard(conn)
            if isinstance(e, OSError):
                raise HTTPError(f"connection to the server broke: {e!r}") from None
            raise
        if keep and body.mode != "eof":
            self._put_back(conn)
        else:
            self._discard(conn)
        return Response(status, resp_headers, data)

    def stream(
        self,
        method: str,
        path: str,
        *,
        params: Optional[Mapping[str, Any]] = None,
        content: Any = None,
        json: Any = NOTHING,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> "_StreamContext":
        """``async with pool.stream(...) as resp:`` then ``resp.aiter_lines()`` etc. The answer
        head must come within ``timeout`` s; each body read then gets ``timeout`` s."""
        total = self.timeout if timeout is None else timeout
        return _StreamContext(self, method, path, params, content, json, headers, total)

    async def aclose(self) -> None:
        """Closes every connection (idle and in use); later requests fail."""
        self._closed = True
        conns = list(self._all)
        self._all.clear()
        self._idle.clear()
        for conn in conns:
            conn.close()
        loop = asyncio.get_running_loop()
        waits = [c.wait_closed() for c in conns if c._loop is loop]
        if waits:
            try:
                await _within(asyncio.gather(*waits, return_exceptions=True), 5.0)
            except asyncio.TimeoutError:
                pass

    @property
    def open_connections(self) -> int:
        return len(self._all)


class _StreamContext:
    def __init__(self, pool: Pool, method: str, path: str, params: Any, content: Any, json_body: Any,
                 headers: Any, timeout: float):
        self.pool = pool
        self.args = (method, path, params, content, json_body, headers, None)
        self.timeout = timeout
        self.conn: Optional[_Conn] = None
        self.keep = False
        self.resp: Optional[StreamResponse] = None

    async def __aenter__(self) -> StreamResponse:
        pool = self.pool
        if pool._closed:
            raise HTTPError("the client is closed")
        try:
            conn, status, headers, keep, body = await _within(self._enter(), self.timeout)
        except asyncio.TimeoutError:
            raise HTTPTimeout(f"no answer within {self.timeout:g} s") from None
        self.conn, self.keep = conn, keep and body.mode != "eof"
        self.resp = StreamResponse(status, headers, body, self.timeout)
        return self.resp

    async def _enter(self) -> Tuple[_Conn, int, Headers, bool, _Body]:
        pool = self.pool
        await pool._take_slot()
        try:
            conn, status, headers, keep = await pool._open_exchange(*self.args)
        except BaseException:
            pool._give_slot()
            raise
        try:
            return conn, status, headers, keep, _Body(conn, self.args[0], status, headers)
        except BaseException:
            pool._discard(conn)
            pool._give_slot()
            raise

    async def __aexit__(self, *exc: Any) -> None:
        conn, self.conn = self.conn, None
        if conn is None:
            return
        try:
            if self.keep and exc[0] is None and self.resp is not None and self.resp.complete:
                self.pool._put_back(conn)
            else:
                self.pool._discard(conn)  # unread body or error: the connection cannot be reused
        finally:
            self.pool._give_slot()


def _check_header(name: str, value: str) -> None:
    if any(c in name for c in "\r\n:") or "\r" in value or "\n" in value:
        raise ValueError(f"invalid HTTP header {name!r}")


class HttpxPool:
    """The same interface on top of ``httpx.AsyncClient``: used for ``https://`` URLs and when a
    custom httpx ``transport`` is given. httpx errors are mapped to this module's errors."""

    def __init__(self, base_url: str, headers: Mapping[str, str], timeout: float, *,
                 connect_timeout: float = 10.0, transport: Any = None, max_connections: int = 1000,
                 max_idle: int = 100):
        import httpx

        self._httpx = httpx
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._client = httpx.AsyncClient(
            base_url=base_url,
            headers=dict(headers),
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            transport=transport,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_idle),
        )

    def _timeout(self, timeout: Optional[float]) -> Any:
        if timeout is None:
            return self._httpx.USE_CLIENT_DEFAULT
        return self._httpx.Timeout(timeout, connect=min(self.connect_timeout, timeout))

    def _kwargs(self, params: Any, content: Any, json: Any, headers: Any, timeout: Optional[float]) -> Dict[str, Any]:
        kw: Dict[str, Any] = {"timeout": self._timeout(timeout)}
        if json is not NOTHING:
            kw["json"] = json
        if content is not None:
            kw["content"] = content
        if params:
            kw["params"] = params
        if headers:
            kw["headers"] = headers
        return kw

    def _map(self, e: Exception) -> HTTPError:
        httpx = self._httpx
        if isinstance(e, httpx.TimeoutException):
            return HTTPTimeout(str(e) or type(e).__name__)
        if isinstance(e, httpx.ConnectError):
            return ConnectFailed(str(e) or type(e).__name__)
        return HTTPError(str(e) or type(e).__name__)

    async def request(self, method: str, path: str, *, params: Optional[Mapping[str, Any]] = None,
                      content: Any = None, json: Any = NOTHING, headers: Optional[Mapping[str, str]] = None,
                      timeout: Optional[float] = None, retry: Optional[bool] = None) -> Response:
        try:
            resp = await self._client.request(method, path, **self._kwargs(params, content, json, headers, timeout))
        except self._httpx.TransportError as e:
            raise self._map(e) from e
        return Response(resp.status_code, Headers({k.lower(): v for k, v in resp.headers.items()}), resp.content)

    def stream(self, method: str, path: str, *, params: Optional[Mapping[str, Any]] = None, content: Any = None,
               json: Any = NOTHING, headers: Optional[Mapping[str, str]] = None,
               timeout: Optional[float] = None) -> "_HttpxStream":
        return _HttpxStream(self, self._client.stream(method, path, **self._kwargs(params, content, json, headers, timeout)))

    async def aclose(self) -> None:
        await self._client.aclose()


class _HttpxStream:
    def __init__(self, pool: HttpxPool, ctx: Any):
        self.pool = pool
        self.ctx = ctx

    async def __aenter__(self) -> "_HttpxStreamResponse":
        try:
            resp = await self.ctx.__aenter__()
        except self.pool._httpx.TransportError as e:
            raise self.pool._map(e) from e
        return _HttpxStreamResponse(self.pool, resp)

    async def __aexit__(self, *exc: Any) -> None:
        await self.ctx.__aexit__(*exc)


class _HttpxStreamResponse:
    def __init__(self, pool: HttpxPool, resp: Any):
        self.pool = pool
        self.status_code = resp.status_code
        self.headers = Headers({k.lower(): v for k, v in resp.headers.items()})
        self._resp = resp

    async def aread(self) -> bytes:
        try:
            return bytes(await self._resp.aread())
        except self.pool._httpx.TransportError as e:
            raise self.pool._map(e) from e

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.aiter_bytes():
                yield chunk
        except self.pool._httpx.TransportError as e:
            raise self.pool._map(e) from e

    async def aiter_lines(self) -> AsyncIterator[str]:
        try:
            async for line in self._resp.aiter_lines():
                yield line
        except self.pool._httpx.TransportError as e:
            raise self.pool._map(e) from e
