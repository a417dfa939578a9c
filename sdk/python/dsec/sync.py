"""Synchronous dsec client: the same methods as :class:`dsec.DSecClient`, without ``await``.

It runs the asynchronous client on an event loop in a private daemon thread, so it works the same
from plain scripts, threads and programs that already run their own event loop.

```python
from dsec.sync import DSecClient
from dsec import DSecContainerRunArgs

with DSecClient() as client:
    with client.run_container(DSecContainerRunArgs(container_image="busybox")) as sandbox:
        print(sandbox.run_shell("echo hi").stdout)
```
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Awaitable, Dict, Iterator, List, Mapping, Optional, Sequence, TypeVar, Union

from . import client as _async
from .errors import SandboxNotFound
from .functions import SyncFunctionsMixin
from .nodes import SyncNodesMixin
from .processes import SyncMetricsMixin, SyncProcessesMixin
from .watch import SyncWatchMixin
from .volumes import SyncVolumesMixin
from .types import DSecContainerRunArgs, DSecVMRunArgs, FileInfo, ImageInfo, SandboxInfo, ShellResult, StreamEvent

T = TypeVar("T")


class _LoopThread:
    """An asyncio event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name="dsec-sync-loop", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Awaitable[T]) -> T:
        if not self.loop.is_running() and self.loop.is_closed():
            raise RuntimeError("the dsec sync client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()  # type: ignore[arg-type]

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        try:
            while True:
                try:
                    item = self.run(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield item
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None and not self.loop.is_closed():
                self.run(aclose())

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class DSecClient(SyncFunctionsMixin, SyncNodesMixin, SyncVolumesMixin):
    """Synchronous dsec client (see :class:`dsec.DSecClient` for the arguments)."""

    def __init__(
        self,
        api_url: Optional[str] = None,
        api_key: Optional[str] = None,
        timeout: float = 60.0,
        **kwargs: Any,
    ):
        self._aclient = _async.DSecClient(api_url, api_key, timeout, **kwargs)
        self._loop = _LoopThread()
        self.api_url = self._aclient.api_url
        self.api_key = self._aclient.api_key

    def open(self) -> "DSecClient":
        self._loop.run(self._aclient.open())
        return self

    def close(self) -> None:
        if self._loop.loop.is_closed():
            return
        try:
            self._loop.run(self._aclient.close())
        finally:
            self._loop.stop()

    def __enter__(self) -> "DSecClient":
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _run(self, coro: Awaitable[T]) -> T:
        return self._loop.run(coro)

    def run_container(self, args: Union[DSecContainerRunArgs, Mapping[str, Any]], timeout: float = 120.0) -> "Sandbox":
        return Sandbox(self, self._run(self._aclient.run_container(args, timeout=timeout)))

    create_sandbox = run_container

    def create(self, args: Union[DSecContainerRunArgs, Mapping[str, Any], None] = None, *,
               from_snapshot: Optional[str] = None, timeout: float = 120.0, **fields: Any) -> "Sandbox":
        return Sandbox(self, self._run(self._aclient.create(args, from_snapshot=from_snapshot, timeout=timeout, **fields)))

    def run_microvm(self, args: Union[DSecContainerRunArgs, Mapping[str, Any]], timeout: float = 300.0) -> "Sandbox":
        return Sandbox(self, self._run(self._aclient.run_microvm(args, timeout=timeout)))

    def run_vm(self, args: Union[DSecVMRunArgs, Mapping[str, Any]], timeout: float = 600.0) -> "Sandbox":
        return Sandbox(self, self._run(self._aclient.run_vm(args, timeout=timeout)))

    def get_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return self._run(self._aclient.get_sandbox(sandbox_id))

    def list_sandboxes(self, *, ended: bool = False, end_reason: Optional[str] = None) -> List[SandboxInfo]:
        return self._run(self._aclient.list_sandboxes(ended=ended, end_reason=end_reason))

    def attach(self, sandbox_id: str) -> "Sandbox":
        return Sandbox(self, self._run(self._aclient.attach(sandbox_id)))

    def stop_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return self._run(self._aclient.stop_sandbox(sandbox_id))

    def pause_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return self._run(self._aclient.pause_sandbox(sandbox_id))

    def resume_sandbox(self, sandbox_id: str) -> SandboxInfo:
        return self._run(self._aclient.resume_sandbox(sandbox_id))

    def pause(self, labels: Mapping[str, str], timeout: float = 600.0) -> Any:
        """Pauses every sandbox whose labels include ``labels`` (a :class:`dsec.JobOpResult`)."""
        return self._run(self._aclient.pause(labels, timeout=timeout))

    def resume(self, labels: Mapping[str, str], timeout: float = 600.0) -> Any:
        return self._run(self._aclient.resume(labels, timeout=timeout))

    def stop(self, labels: Mapping[str, str], timeout: float = 600.0) -> Any:
        return self._run(self._aclient.stop(labels, timeout=timeout))

    def list_images(self) -> List[ImageInfo]:
        return self._run(self._aclient.list_images())

    def import_image(self, name: str, tar: Any, timeout: float = 3600.0, format: Optional[str] = None) -> ImageInfo:
        return self._run(self._aclient.import_image(name, tar, timeout=timeout, format=format))

    def pull_image(self, name: str, reference: str, insecure: bool = False, username: Optional[str] = None,
                   password: Optional[str] = None, timeout: float = 3600.0,
                   ca_pem: Optional[str] = None) -> ImageInfo:
        return self._run(self._aclient.pull_image(name, reference, insecure=insecure, username=username,
                                                  password=password, timeout=timeout, ca_pem=ca_pem))

    def fold_image(self, name: str, max_layer_bytes: Optional[int] = None, into: Optional[str] = None,
                   timeout: float = 3600.0) -> ImageInfo:
        return self._run(self._aclient.fold_image(name, max_layer_bytes=max_layer_bytes, into=into, timeout=timeout))

    def remove_image(self, name: str) -> None:
        self._run(self._aclient.remove_image(name))

    def list_nodes(self) -> List[Dict[str, Any]]:
        return self._run(self._aclient.list_nodes())


class Sandbox(SyncProcessesMixin, SyncWatchMixin, SyncMetricsMixin):
    """Synchronous handle on one sandbox. ``with sandbox:`` stops it on exit."""

    def __init__(self, client: DSecClient, inner: _async.Sandbox):
        self._client = client
        self._inner = inner

    @property
    def id(self) -> str:
        return self._inner.id

    @property
    def info(self) -> SandboxInfo:
        return self._inner.info

    def __repr__(self) -> str:
        return repr(self._inner)

    def _run(self, coro: Awaitable[T]) -> T:
        return self._client._run(coro)

    def refresh(self) -> SandboxInfo:
        return self._run(self._inner.refresh())

    def stop(self) -> SandboxInfo:
        return self._run(self._inner.stop())

    def pause(self) -> SandboxInfo:
        return self._run(self._inner.pause())

    def resume(self) -> SandboxInfo:
        return self._run(self._inner.resume())

    def network(self) -> Dict[str, Any]:
        return self._run(self._inner.network())

    def set_network_rules(
        self,
        rules: Optional[List[Mapping[str, Any]]] = None,
        groups: Optional[Mapping[str, bool]] = None,
        mode: Optional[str] = None,
    ) -> Dict[str, Any]:
        return self._run(self._inner.set_network_rules(rules, groups=groups, mode=mode))

    def get_url(self, port: int, public: bool = False, expires_in: Optional[int] = 3600) -> str:
        return self._run(self._inner.get_url(port, public=public, expires_in=expires_in))

    def port_url(self, port: int, expires_in: Optional[int] = 3600) -> Dict[str, Any]:
        return self._run(self._inner.port_url(port, expires_in=expires_in))

    def pack_diff(self, name: str, exclude: Optional[List[str]] = None, timeout: float = 3600.0) -> ImageInfo:
        return self._run(self._inner.pack_diff(name, exclude=exclude, timeout=timeout))

    def snapshot(self, name: Optional[str] = None, memory: bool = False, timeout: float = 3600.0) -> Dict[str, Any]:
        return self._run(self._inner.snapshot(name=name, memory=memory, timeout=timeout))

    def fork(self, n: int, labels: Optional[Mapping[str, str]] = None, snapshot_name: Optional[str] = None,
             timeout: float = 3600.0) -> List["Sandbox"]:
        from .errors import ForkFailed

        try:
            inner = self._run(self._inner.fork(n, labels=labels, snapshot_name=snapshot_name, timeout=timeout))
        except ForkFailed as e:
            e.children = [Sandbox(self._client, c) for c in e.children]
            raise
        return [Sandbox(self._client, c) for c in inner]

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.stop()
        except SandboxNotFound:
            pass

    def run_shell(self, cmd: str, session: str = "default", timeout: Optional[float] = None, **kwargs: Any) -> ShellResult:
        local = self._inner.local_shell(cmd, session, timeout, **kwargs)
        if local is not None and not (kwargs.get("raise_on_timeout") and local.timed_out):
            return local
        return self._run(self._inner.run_shell(cmd, session, timeout, **kwargs))

    def exec(self, argv: Sequence[str], timeout: Optional[float] = None, **kwargs: Any) -> ShellResult:
        local = self._inner.local_exec(argv, timeout, **kwargs)
        if local is not None and not (kwargs.get("raise_on_timeout") and local.timed_out):
            return local
        return self._run(self._inner.exec(argv, timeout, **kwargs))

    def stream_shell(self, cmd: str, session: str = "default", timeout: Optional[float] = None, **kwargs: Any) -> Iterator[StreamEvent]:
        return self._client._loop.iterate(self._inner.stream_shell(cmd, session, timeout, **kwargs))

    def stream_exec(self, argv: Sequence[str], timeout: Optional[float] = None, **kwargs: Any) -> Iterator[StreamEvent]:
        return self._client._loop.iterate(self._inner.stream_exec(argv, timeout, **kwargs))

    def close_session(self, session: str) -> None:
        self._run(self._inner.close_session(session))

    @property
    def last_completed_step(self) -> Optional[int]:
        return self._inner.last_completed_step

    @property
    def auto_step(self) -> bool:
        return self._inner.auto_step

    @auto_step.setter
    def auto_step(self, value: bool) -> None:
        self._inner.auto_step = value

    def last_step(self) -> Dict[str, Any]:
        return self._run(self._inner.last_step())

    def trajectory(self, **kwargs: Any) -> List[Dict[str, Any]]:
        """See :meth:`dsec.client.Sandbox.trajectory`."""
        return self._run(self._inner.trajectory(**kwargs))

    def fast_forward(self) -> Optional[int]:
        return self._run(self._inner.fast_forward())

    def write_file(self, path: str, data: Union[bytes, str], mode: int = 0o644, **kwargs: Any) -> FileInfo:
        return self._run(self._inner.write_file(path, data, mode, **kwargs))

    def read_file(self, path: str, **kwargs: Any) -> bytes:
        return self._run(self._inner.read_file(path, **kwargs))

    def upload(self, local_path: Any, remote_path: str, mode: Optional[int] = None, timeout: float = 3600.0) -> FileInfo:
        return self._run(self._inner.upload(local_path, remote_path, mode, timeout))

    def download(self, remote_path: str, local_path: Any, timeout: float = 3600.0) -> int:
        return self._run(self._inner.download(remote_path, local_path, timeout))

    def list_files(self, path: str, **kwargs: Any) -> List[FileInfo]:
        return self._run(self._inner.list_files(path, **kwargs))

    def stat(self, path: str, **kwargs: Any) -> FileInfo:
        return self._run(self._inner.stat(path, **kwargs))

    def exists(self, path: str, **kwargs: Any) -> bool:
        return self._run(self._inner.exists(path, **kwargs))

    def remove(self, path: str, recursive: bool = False, **kwargs: Any) -> None:
        self._run(self._inner.remove(path, recursive, **kwargs))

    def mkdir(self, path: str, parents: bool = True, mode: int = 0o755, **kwargs: Any) -> FileInfo:
        return self._run(self._inner.mkdir(path, parents, mode, **kwargs))
