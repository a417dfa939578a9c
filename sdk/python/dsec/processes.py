"""Process handles: processes that outlive the call that started them.

```python
proc = await sandbox.start("python3 -m http.server 8000", tag="web")
async for ev in proc.stream():          # stdout/stderr as they come, until it exits
    print(ev.type, ev.data)
# ... later, from another client process:
proc = await sandbox.connect(pid)       # or connect("web")
async for ev in proc.stream(offset=saved_offset):
    ...
await proc.kill()                       # SIGKILL to its whole process group
```

Output is kept by the sandbox in a bounded ring per process (``buffer_bytes``, 1 MiB by
default); a reader that resumes at an offset whose output was already dropped gets a
``truncated`` event with the range lost.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from . import _http
from .errors import DSecError, TransportError, error_from_body, error_from_parts

#: Seconds one ``wait`` request may block on the server (``wait`` loops over such requests).
WAIT_SLICE = 60.0
#: Read timeout of a following output stream (a quiet process may print nothing for long).
FOLLOW_TIMEOUT = 24 * 3600.0


@dataclass
class ProcessInfo:
    pid: int
    argv: List[str]
    running: bool
    tag: Optional[str] = None
    cwd: Optional[str] = None
    started_ms: int = 0
    exit_code: Optional[int] = None
    signal: Optional[int] = None
    stdin_open: bool = False
    #: Bytes of output produced so far (the offset of the next byte).
    output_bytes: int = 0
    #: First offset still kept by the sandbox; output before it was dropped.
    kept_from: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ProcessInfo":
        return cls(
            pid=int(d.get("pid", 0)),
            argv=list(d.get("argv") or []),
            running=bool(d.get("running")),
            tag=d.get("tag"),
            cwd=d.get("cwd"),
            started_ms=int(d.get("started_ms") or 0),
            exit_code=d.get("exit_code"),
            signal=d.get("signal"),
            stdin_open=bool(d.get("stdin_open")),
            output_bytes=int(d.get("output_bytes") or 0),
            kept_from=int(d.get("kept_from") or 0),
        )


@dataclass
class ProcessEvent:
    """``stdout``/``stderr`` (``data``, ``bytes``, ``offset``), ``truncated`` (``offset`` = first
    byte lost, ``end`` = first byte kept) or ``end`` (``info``; ``offset`` = where to resume)."""

    type: str
    offset: int = 0
    data: str = ""
    bytes: bytes = b""
    end: int = 0
    info: Optional[ProcessInfo] = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ProcessEvent":
        t = str(d.get("type"))
        if t in ("stdout", "stderr"):
            data = d.get("data") or ""
            raw = base64.b64decode(d["data_b64"]) if d.get("data_b64") else data.encode("utf-8")
            return cls(type=t, offset=int(d.get("offset") or 0), data=data, bytes=raw)
        if t == "truncated":
            return cls(type=t, offset=int(d.get("from") or 0), end=int(d.get("to") or 0))
        if t == "end":
            return cls(type=t, offset=int(d.get("offset") or 0), info=ProcessInfo.from_json(d.get("info") or {}))
        return cls(type=t)


@dataclass
class ProcessOutput:
    """What :meth:`ProcessHandle.output` read: the kept output and whether some was lost."""

    stdout: bytes = b""
    stderr: bytes = b""
    truncated: bool = False
    #: Offset ranges ``(from, to)`` that were dropped before they could be read.
    lost: List[tuple] = field(default_factory=list)
    offset: int = 0
    info: Optional[ProcessInfo] = None


def _start_body(
    cmd: Union[str, Sequence[str]],
    cwd: Optional[str],
    env: Optional[Mapping[str, str]],
    user: Optional[str],
    stdin: bool,
    tag: Optional[str],
    buffer_bytes: Optional[int],
) -> Dict[str, Any]:
    body: Dict[str, Any] = {"stdin": bool(stdin)}
    if isinstance(cmd, str):
        body["cmd"] = cmd
    else:
        body["argv"] = [str(a) for a in cmd]
    if cwd is not None:
        body["cwd"] = cwd
    if env:
        body["env"] = dict(env)
    if user is not None:
        body["user"] = user
    if tag is not None:
        body["tag"] = tag
    if buffer_bytes is not None:
        body["buffer_bytes"] = int(buffer_bytes)
    return body


class ProcessHandle:
    """A process started with :meth:`Sandbox.start` (or found again with ``connect``)."""

    def __init__(self, sandbox: Any, info: ProcessInfo):
        self._sandbox = sandbox
        self.info = info
        #: Where the next :meth:`stream` resumes (advanced by every event read).
        self.offset = 0

    @property
    def pid(self) -> int:
        return self.info.pid

    @property
    def tag(self) -> Optional[str]:
        return self.info.tag

    @property
    def exit_code(self) -> Optional[int]:
        return self.info.exit_code

    def __repr__(self) -> str:
        return f"ProcessHandle(pid={self.pid}, tag={self.tag!r}, running={self.info.running})"

    def _path(self, suffix: str = "") -> str:
        return self._sandbox._path(f"/processes/{self.pid}{suffix}")

    async def _post(self, suffix: str, body: Any = None, params: Optional[Mapping[str, str]] = None,
                    timeout: Optional[float] = None) -> ProcessInfo:
        c = self._sandbox._client
        resp = await c._request("POST", self._path(suffix), json_body=body if body is not None else {},
                                params=params, timeout=timeout)
        self.info = ProcessInfo.from_json(c._json(resp))
        return self.info

    async def refresh(self) -> ProcessInfo:
        c = self._sandbox._client
        resp = await c._request("GET", self._path())
        self.info = ProcessInfo.from_json(c._json(resp))
        return self.info

    async def wait(self, timeout: Optional[float] = None) -> ProcessInfo:
        """Waits until the process exits (or ``timeout`` s pass) and returns its state;
        check ``info.running`` after a timeout."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WAIT_SLICE if deadline is None else max(0.0, min(WAIT_SLICE, deadline - time.monotonic()))
            info = await self._post("/wait", params={"timeout": f"{left:.3f}"}, timeout=left + 30.0)
            if not info.running or (deadline is not None and time.monotonic() >= deadline):
                return info

    async def stream(self, offset: Optional[int] = None, follow: bool = True,
                     timeout: float = FOLLOW_TIMEOUT) -> AsyncIterator[ProcessEvent]:
        """Yields output events from ``offset`` (default: where the last stream stopped) until the
        process exits (``follow``) or the kept output is read (not ``follow``); the last event is
        ``end``. Leaving the loop early only ends the read: the process keeps running."""
        start = self.offset if offset is None else int(offset)
        c = self._sandbox._client
        http = await c._client()
        params = {"offset": str(start), "follow": "true" if follow else "false"}
        path = self._path("/output")
        try:
            async with http.stream("GET", path, params=params, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    raise error_from_body(resp.status_code, await resp.aread())
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        doc = json.loads(line)
                    except ValueError as e:
                        raise DSecError(f"bad stream line from the API server: {line[:200]!r} ({e})") from e
                    if doc.get("type") == "error":
                        err = doc.get("error") if isinstance(doc.get("error"), dict) else {}
                        raise error_from_parts(None, err.get("code"), str(err.get("message") or "read failed"))
                    ev = ProcessEvent.from_json(doc)
                    if ev.type in ("stdout", "stderr"):
                        self.offset = ev.offset + len(ev.bytes)
                    elif ev.type == "truncated":
                        self.offset = max(self.offset, ev.end)
                    elif ev.type == "end":
                        self.offset = ev.offset
                        if ev.info is not None:
                            self.info = ev.info
                    yield ev
        except _http.HTTPTimeout as e:
            raise TransportError(f"GET {path}: timed out reading process output ({e})") from e
        except _http.HTTPError as e:
            raise TransportError(f"GET {path}: connection to the API server failed: {e}") from e

    async def output(self, offset: int = 0, follow: bool = False) -> ProcessOutput:
        """Collects the output from ``offset`` (all that is kept by default) into bytes."""
        out, err = bytearray(), bytearray()
        res = ProcessOutput()
        agen = self.stream(offset=offset, follow=follow)
        try:
            async for ev in agen:
                if ev.type == "stdout":
                    out += ev.bytes
                elif ev.type == "stderr":
                    err += ev.bytes
                elif ev.type == "truncated":
                    res.truncated = True
                    res.lost.append((ev.offset, ev.end))
                elif ev.type == "end":
                    res.info = ev.info
                    res.offset = ev.offset
        finally:
            await agen.aclose()
        res.stdout, res.stderr = bytes(out), bytes(err)
        return res

    async def send_stdin(self, data: Union[str, bytes], close: bool = False) -> ProcessInfo:
        if isinstance(data, (bytes, bytearray)):
            body: Dict[str, Any] = {"data_b64": base64.b64encode(bytes(data)).decode("ascii")}
        else:
            body = {"data": data}
        body["close"] = bool(close)
        return await self._post("/stdin", body)

    async def close_stdin(self) -> ProcessInfo:
        return await self._post("/stdin", {"close": True})

    async def signal(self, signal: Union[str, int] = "SIGTERM", group: bool = True) -> ProcessInfo:
        """Sends ``signal`` (a name like ``SIGINT`` or a number) to the process's group
        (only the process itself when ``group`` is False)."""
        return await self._post("/signal", {"signal": str(signal), "group": bool(group)})

    async def kill(self) -> ProcessInfo:
        """SIGKILL to the whole process group (and every process of its session)."""
        return await self._post("/kill")


class ProcessesMixin:
    """The process-handle methods of :class:`dsec.Sandbox`."""

    async def start(
        self,
        cmd: Union[str, Sequence[str]],
        cwd: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        user: Optional[str] = None,
        stdin: bool = True,
        tag: Optional[str] = None,
        buffer_bytes: Optional[int] = None,
    ) -> ProcessHandle:
        """Starts ``cmd`` (a shell command line, or an argv list run without a shell) in the
        background and returns its handle at once; it keeps running after this client is gone."""
        body = _start_body(cmd, cwd, env, user, stdin, tag, buffer_bytes)
        c = self._client  # type: ignore[attr-defined]
        resp = await c._request("POST", self._path("/processes"), json_body=body)  # type: ignore[attr-defined]
        return ProcessHandle(self, ProcessInfo.from_json(c._json(resp)))

    async def processes(self, all: bool = False) -> List[ProcessInfo]:
        """The running processes started with :meth:`start` (``all``: also exited ones still kept)."""
        c = self._client  # type: ignore[attr-defined]
        resp = await c._request("GET", self._path("/processes"),  # type: ignore[attr-defined]
                                params={"all": "true" if all else "false"})
        return [ProcessInfo.from_json(p) for p in c._json(resp).get("processes", []) if isinstance(p, dict)]

    async def connect(self, pid_or_tag: Union[int, str]) -> ProcessHandle:
        """Re-attaches to a process by pid or tag (also from another client process)."""
        from urllib.parse import quote

        c = self._client  # type: ignore[attr-defined]
        resp = await c._request("GET", self._path(f"/processes/{quote(str(pid_or_tag), safe='')}"))  # type: ignore[attr-defined]
        return ProcessHandle(self, ProcessInfo.from_json(c._json(resp)))

    async def rename(self, src: str, dst: str, overwrite: bool = False) -> Any:
        """Moves ``src`` to ``dst`` inside the sandbox (refused if ``dst`` exists unless
        ``overwrite``); returns the :class:`dsec.FileInfo` of ``dst``."""
        from .types import FileInfo

        c = self._client  # type: ignore[attr-defined]
        params = {"src": src, "dst": dst, "overwrite": "true" if overwrite else "false"}
        resp = await c._request("POST", self._path("/files/rename"), params=params)  # type: ignore[attr-defined]
        return FileInfo.from_json(c._json(resp))

    move = rename


class SyncProcessHandle:
    """Synchronous :class:`ProcessHandle`."""

    def __init__(self, run: Any, loop: Any, inner: ProcessHandle):
        self._run = run
        self._loop = loop
        self._inner = inner

    def __repr__(self) -> str:
        return repr(self._inner)

    @property
    def pid(self) -> int:
        return self._inner.pid

    @property
    def tag(self) -> Optional[str]:
        return self._inner.tag

    @property
    def info(self) -> ProcessInfo:
        return self._inner.info

    @property
    def exit_code(self) -> Optional[int]:
        return self._inner.exit_code

    @property
    def offset(self) -> int:
        return self._inner.offset

    @offset.setter
    def offset(self, value: int) -> None:
        self._inner.offset = int(value)

    def refresh(self) -> ProcessInfo:
        return self._run(self._inner.refresh())

    def wait(self, timeout: Optional[float] = None) -> ProcessInfo:
        return self._run(self._inner.wait(timeout))

    def stream(self, offset: Optional[int] = None, follow: bool = True,
               timeout: float = FOLLOW_TIMEOUT) -> Iterator[ProcessEvent]:
        return self._loop.iterate(self._inner.stream(offset, follow, timeout))

    def output(self, offset: int = 0, follow: bool = False) -> ProcessOutput:
        return self._run(self._inner.output(offset, follow))

    def send_stdin(self, data: Union[str, bytes], close: bool = False) -> ProcessInfo:
        return self._run(self._inner.send_stdin(data, close))

    def close_stdin(self) -> ProcessInfo:
        return self._run(self._inner.close_stdin())

    def signal(self, signal: Union[str, int] = "SIGTERM", group: bool = True) -> ProcessInfo:
        return self._run(self._inner.signal(signal, group))

    def kill(self) -> ProcessInfo:
        return self._run(self._inner.kill())


class SyncProcessesMixin:
    """The process-handle methods of :class:`dsec.sync.Sandbox`."""

    def _wrap(self, h: ProcessHandle) -> SyncProcessHandle:
        return SyncProcessHandle(self._run, self._client._loop, h)  # type: ignore[attr-defined]

    def start(self, cmd: Union[str, Sequence[str]], cwd: Optional[str] = None,
              env: Optional[Mapping[str, str]] = None, user: Optional[str] = None, stdin: bool = True,
              tag: Optional[str] = None, buffer_bytes: Optional[int] = None) -> SyncProcessHandle:
        return self._wrap(self._run(self._inner.start(cmd, cwd, env, user, stdin, tag, buffer_bytes)))  # type: ignore[attr-defined]

    def processes(self, all: bool = False) -> List[ProcessInfo]:
        return self._run(self._inner.processes(all))  # type: ignore[attr-defined]

    def connect(self, pid_or_tag: Union[int, str]) -> SyncProcessHandle:
        return self._wrap(self._run(self._inner.connect(pid_or_tag)))  # type: ignore[attr-defined]

    def rename(self, src: str, dst: str, overwrite: bool = False) -> Any:
        return self._run(self._inner.rename(src, dst, overwrite))  # type: ignore[attr-defined]

    move = rename


@dataclass
class MetricsSample:
    """One sample of a sandbox's resource use (see ``GET /v1/sandboxes/{id}/metrics``)."""

    time_ms: int = 0
    cpu_time_s: float = 0.0
    #: Percent of one core since the previous sample (200 = two cores busy).
    cpu_percent: float = 0.0
    cpu_limit_cores: float = 0.0
    memory_bytes: int = 0
    memory_limit_bytes: int = 0
    disk_used_bytes: int = 0
    disk_limit_bytes: int = 0
    net_rx_bytes: int = 0
    net_tx_bytes: int = 0
    pids: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "MetricsSample":
        out = cls()
        for k in cls.__dataclass_fields__:
            if k in d and d[k] is not None:
                setattr(out, k, type(getattr(out, k))(d[k]))
        return out


class MetricsMixin:
    """The metrics method of :class:`dsec.Sandbox`."""

    async def metrics(self) -> List[MetricsSample]:
        """The edge's recent samples of this sandbox, oldest first (one every few seconds)."""
        c = self._client  # type: ignore[attr-defined]
        resp = await c._request("GET", self._path("/metrics"))  # type: ignore[attr-defined]
        return [MetricsSample.from_json(s) for s in c._json(resp).get("samples", []) if isinstance(s, dict)]


class SyncMetricsMixin:
    def metrics(self) -> List[MetricsSample]:
        return self._run(self._inner.metrics())  # type: ignore[attr-defined]
