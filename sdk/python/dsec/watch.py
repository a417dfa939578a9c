"""File watch: filesystem events inside a sandbox, as they happen.

```python
async with await sandbox.watch("/work") as w:     # returns once the watch is in place
    await sandbox.run_shell("touch /work/a")
    async for ev in w:
        print(ev.kind, ev.path)                      # create /work/a
        break
```

Closing the watcher (leaving the ``with``, ``close()``, or the client going away) ends the watch
inside the sandbox.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator, Mapping, Optional

from . import _http
from .errors import DSecError, TransportError, error_from_body, error_from_parts

#: Read timeout of a watch stream (a quiet directory may see nothing for long).
WATCH_TIMEOUT = 24 * 3600.0


@dataclass
class FsEvent:
    """``kind``: ``create``, ``write``, ``remove``, ``rename`` (``to`` = the new path, ``None``
    when it moved out of the watched tree), ``chmod``, or ``overflow`` (events were lost)."""

    kind: str
    path: str
    to: Optional[str] = None
    is_dir: bool = False

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "FsEvent":
        return cls(kind=str(d.get("kind")), path=str(d.get("path") or ""), to=d.get("to"),
                   is_dir=bool(d.get("is_dir")))


class Watcher:
    """Async iterator of :class:`FsEvent`; made by :meth:`dsec.Sandbox.watch`."""

    def __init__(self, ctx: Any, resp: Any, path: str):
        self._ctx = ctx
        self._resp = resp
        self._lines = resp.aiter_lines()
        self.path = path
        self.closed = False

    async def _ready(self) -> None:
        ev = await self.__anext__()
        if ev.kind != "ready":
            raise DSecError(f"watch {self.path}: expected a ready event first, got {ev.kind}")

    def __aiter__(self) -> "Watcher":
        return self

    async def __anext__(self) -> FsEvent:
        if self.closed:
            raise StopAsyncIteration
        try:
            while True:
                line = await self._lines.__anext__()
                line = line.strip()
                if not line:
                    continue
                try:
                    doc = json.loads(line)
                except ValueError as e:
                    raise DSecError(f"bad watch line from the API server: {line[:200]!r} ({e})") from e
                if doc.get("kind") == "error":
                    err = doc.get("error") if isinstance(doc.get("error"), dict) else {}
                    raise error_from_parts(None, err.get("code"), str(err.get("message") or "watch failed"))
                return FsEvent.from_json(doc)
        except StopAsyncIteration:
            await self.close()
            raise
        except _http.HTTPTimeout as e:
            raise TransportError(f"watch {self.path}: timed out ({e})") from e
        except _http.HTTPError as e:
            raise TransportError(f"watch {self.path}: connection to the API server failed: {e}") from e

    async def close(self) -> None:
        """Ends the watch (the sandbox's watcher stops)."""
        if self.closed:
            return
        self.closed = True
        await self._ctx.__aexit__(None, None, None)

    async def __aenter__(self) -> "Watcher":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class WatchMixin:
    """The watch method of :class:`dsec.Sandbox`."""

    async def watch(self, path: str, recursive: bool = True, timeout: float = WATCH_TIMEOUT) -> Watcher:
        """Watches ``path`` (a directory; with ``recursive`` every directory below it too) and
        returns once the watch is in place, so changes made after this call are all seen."""
        c = self._client  # type: ignore[attr-defined]
        http = await c._client()
        params = {"path": path, "recursive": "true" if recursive else "false"}
        route = self._path("/watch")  # type: ignore[attr-defined]
        ctx = http.stream("GET", route, params=params, timeout=timeout)
        try:
            resp = await ctx.__aenter__()
        except _http.HTTPTimeout as e:
            raise TransportError(f"GET {route}: timed out waiting for the API server ({e})") from e
        except _http.HTTPError as e:
            raise TransportError(f"GET {route}: cannot reach the API server: {e}") from e
        if resp.status_code >= 400:
            body = await resp.aread()
            await ctx.__aexit__(None, None, None)
            raise error_from_body(resp.status_code, body)
        w = Watcher(ctx, resp, path)
        try:
            await w._ready()
        except BaseException:
            await w.close()
            raise
        return w


class SyncWatcher:
    """Synchronous :class:`Watcher` (an iterator; ``with`` closes it)."""

    def __init__(self, loop: Any, inner: Watcher):
        self._loop = loop
        self._inner = inner
        self._pending: Any = None

    def __iter__(self) -> Iterator[FsEvent]:
        return self

    def __next__(self) -> FsEvent:
        ev = self.next(None)
        if ev is None:
            raise StopIteration
        return ev

    def next(self, timeout: Optional[float] = None) -> Optional[FsEvent]:
        """The next event, or ``None`` when none comes within ``timeout`` seconds (the read
        stays pending and the next call picks it up) or the watch ended."""
        import asyncio
        import concurrent.futures

        if self._pending is None:
            self._pending = asyncio.run_coroutine_threadsafe(self._inner.__anext__(), self._loop.loop)
        try:
            ev = self._pending.result(timeout)
        except concurrent.futures.TimeoutError:
            return None
        except StopAsyncIteration:
            self._pending = None
            return None
        self._pending = None
        return ev

    def close(self) -> None:
        self._loop.run(self._inner.close())
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def __enter__(self) -> "SyncWatcher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SyncWatchMixin:
    def watch(self, path: str, recursive: bool = True, timeout: float = WATCH_TIMEOUT) -> SyncWatcher:
        return SyncWatcher(self._client._loop, self._run(self._inner.watch(path, recursive, timeout)))  # type: ignore[attr-defined]
