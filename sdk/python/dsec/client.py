"""Asynchronous client of the dsec HTTP API (``/v1``, see ``crates/wire/src/api.rs``)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import time
from typing import (
    Any,
    AsyncIterator,
    Dict,
    List,
    Mapping,
    Optional,
    Sequence,
    TYPE_CHECKING,
    Union,
)
from urllib.parse import quote

from . import _http
from .nodes import NodesMixin
from .functions import FunctionsMixin
from .processes import MetricsMixin, ProcessesMixin
from .watch import WatchMixin
from .volumes import VolumesMixin
from .errors import (
    CommandTimeout,
    DSecError,
    ForkFailed,
    SandboxDead,
    SandboxEnded,
    SandboxNotFound,
    TransportError,
    error_from_body,
    error_from_parts,
)
from .batch import Batch, BatchStatus, QueueReport, batch_body
from .trajectory import FastForward, StepCounter, content_of, exec_key, shell_key, write_key
from .types import (
    DSecContainerRunArgs,
    DSecVMRunArgs,
    FileInfo,
    ImageInfo,
    JobOpResult,
    SandboxInfo,
    ShellResult,
    StreamEvent,
)

#: Where ``dsec up`` writes ``DSEC_API_URL=``/``DSEC_API_KEY=`` lines (used when nothing else is set).
DEFAULT_ENV_FILE = "/var/lib/dsec/env"
#: Default command timeout of the server, in seconds (``limits::DEFAULT_TIMEOUT_S``).
DEFAULT_COMMAND_TIMEOUT = 60.0
#: Extra seconds the HTTP call may take beyond a command's own timeout.
HTTP_GRACE = 30.0
#: Size of the chunks read from local files for uploads.
UPLOAD_CHUNK = 1024 * 1024

_UNSET: Any = object()
#: ``/v1/sandboxes/{id}`` and what follows it, in a request path.
_SANDBOX_PATH = re.compile(r"^/v1/sandboxes/(sb-[a-z0-9]{1,16}-[0-9a-f]{16})(/.*)?$")

if TYPE_CHECKING:  # pragma: no cover
    import httpx

PathLike = Union[str, "os.PathLike[str]"]


def _read_env_file(path: str) -> Dict[str, str]:
    values: Dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                key, sep, value = line.strip().partition("=")
                if sep:
                    values[key.strip()] = value.strip()
    except OSError:
        pass
    return values


def _seg(value: str) -> str:
    """One URL path segment (ids and image names may not smuggle ``/`` or ``..``)."""
    return quote(value, safe="")


def _mode_text(mode: int) -> str:
    return format(mode & 0o7777, "04o")


def parse_mode_header(value: Optional[str]) -> Optional[int]:
    """Parses the ``x-dsec-mode`` header: octal text (``0644``, ``644`` or ``0o644``)."""
    if value is None:
        return None
    text = value.strip().lower()
    if text.startswith("0o"):
        text = text[2:]
    try:
        return int(text, 8) & 0o7777
    except ValueError:
        return None


def _http_timeout(command_timeout: Optional[float]) -> float:
    return (command_timeout if command_timeout is not None else DEFAULT_COMMAND_TIMEOUT) + HTTP_GRACE


class DSecClient(FunctionsMixin, NodesMixin, VolumesMixin):
    """Asynchronous dsec client.

    ``api_url`` and ``api_key`` default to the ``DSEC_API_URL`` and ``DSEC_API_KEY`` environment
    variables (then to ``/var/lib/dsec/env``, written by ``dsec up``). ``timeout`` (seconds) applies
    to plain API calls; command calls wait for the command's own timeout plus a grace period.

    Use ``await client.open()`` / ``await client.close()`` or ``async with DSecClient() as client``.

    ``http://`` URLs go through the SDK's own keep-alive HTTP/1.1 client (:mod:`dsec._http`);
    ``https://`` URLs, and any custom httpx ``transport``, go through ``httpx.AsyncClient``.
    ``max_connections`` bounds the requests in flight (others wait), ``max_idle`` the idle
    connections kept.
    """

    def __init__(
        self,
        api_url: Optional[str] = None,
        api_key: Optional[str] = None,
        timeout: float = 60.0,
        *,
        transport: "Optional[httpx.AsyncBaseTransport]" = None,
        max_connections: int = 1000,
        max_idle: int = 100,
    ):
        file_values: Optional[Dict[str, str]] = None
        if api_url is None:
            api_url = os.environ.get("DSEC_API_URL")
        if api_key is None:
            api_key = os.environ.get("DSEC_API_KEY")
        if api_url is None or api_key is None:
            file_values = _read_env_file(DEFAULT_ENV_FILE)
            api_url = api_url or file_values.get("DSEC_API_URL")
            api_key = api_key or file_values.get("DSEC_API_KEY")
        if not api_url:
            raise DSecError("no API URL: pass api_url= or set DSEC_API_URL (printed by `dsec up`)")
        self.api_url = api_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self._transport = transport
        self.max_connections = max_connections
        self.max_idle = max_idle
        self._http: Any = None

    # -- connection ---------------------------------------------------------------------------

    async def open(self) -> "DSecClient":
        """Opens the connection pool (calls also open it on first use)."""
        if self._http is None:
            headers = {"user-agent": "dsec-python/0.1"}
            if self.api_key:
                headers["authorization"] = f"Bearer {self.api_key}"
            if self._transport is None and self.api_url.lower().startswith("http://"):
                self._http = _http.Pool(
                    self.api_url, headers, self.timeout, connect_timeout=10.0,
                    max_connections=self.max_connections, max_idle=self.max_idle,
                )
            else:
                self._http = _http.HttpxPool(
                    self.api_url, headers, self.timeout, connect_timeout=10.0, transport=self._transport,
                    max_connections=self.max_connections, max_idle=self.max_idle,
                )
        return self

    async def close(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.aclose()

    async def __aenter__(self) -> "DSecClient":
        return await self.open()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _client(self) -> Any:
        if self._http is None:
            await self.open()
        return self._http

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = _UNSET,
        params: Optional[Mapping[str, str]] = None,
        content: Any = None,
        headers: Optional[Mapping[str, str]] = None,
        timeout: Optional[float] = None,
        retry: Optional[bool] = None,
    ) -> _http.Response:
        """One request; ``timeout`` (s, default the client's) bounds the whole exchange.
        ``retry``: may the request be resent on a fresh connection if a pooled one turns out
        dead before answering (default: only idempotent methods)."""
        http = self._http if self._http is not None else await self._client()
        try:
            resp = await http.request(
                method, path, params=params, content=content,
                json=_http.NOTHING if json_body is _UNSET else json_body,
                headers=headers, timeout=timeout, retry=retry,
            )
        except _http.HTTPTimeout as e:
            raise TransportError(f"{method} {path}: timed out waiting for the API server ({e})") from e
        except _http.HTTPError as e:
            raise TransportError(f"{method} {path}: cannot reach the API server at {self.api_url}: {e}") from e
        if resp.status_code >= 400:
            err = error_from_body(resp.status_code, resp.content)
            if resp.status_code == 410:
                err = await self._ended(method, path, err)
            raise err
        return resp

    async def _ended(self, method: str, path: str, err: DSecError) -> DSecError:
        """A ``sandbox_dead`` answer of a call to a sandbox becomes :class:`SandboxEnded`
        carrying the end reason its info gives (one GET); anything else stays as it is."""
        if not isinstance(err, SandboxDead) or isinstance(err, SandboxEnded):
            return err
        m = _SANDBOX_PATH.match(path)
        if not m or (method == "GET" and not m.group(2)):
            return err
        try:
            info = await self.get_sandbox(m.group(1))
        except Exception:  # best effort: the call's own error is raised either way
            return err
        if not info.end_reason:
            return err
        return SandboxEnded(
            err.message,
            sandbox_id=info.id,
            reason=info.end_reason,
            detail=info.end_detail or info.reason,
            status=err.status,
            code=err.code,
        )

    @staticmethod
    def _json(resp: _http.Response) -> Any:
        try:
            return resp.json()
        except ValueError as e:
            raise DSecError(f"the API server sent invalid JSON ({e})", status=resp.status_code) from e

    async def _stream_lines(
        self, path: str, body: Dict[str, Any], timeout: float
    ) -> AsyncIterator[Dict[str, Any]]:
        """POSTs ``body`` and yields the NDJSON objects of the answer."""
        http = await self._client()
        try:
            async with http.stream("POST", path, json=body, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    raise await self._ended("POST", path, error_from_body(resp.status_code, await resp.aread()))
                async for line in resp.aiter_lines():
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        doc = json.loads(line)
                    except ValueError as e:
                        raise DSecError(f"bad stream line from the API server: {line[:200]!r} ({e})") from e
                    if isinstance(doc, dict):
                        yield doc
        except _http.HTTPTimeout as e:
            raise TransportError(f"POST {path}: timed out waiting for the API server ({e})") from e
        except _http.HTTPError as e:
            raise TransportError(f"POST {path}: connection to the API server failed: {e}") from e

    # -- sandboxes ----------------------------------------------------------------------------

    async def run_container(
        self, args: Union[DSecContainerRunArgs, Mapping[str, Any]], timeout: float = 120.0
    ) -> "Sandbox":
        """Creates a container sandbox and waits (up to ``timeout`` s) until it runs."""
        body = args.to_json() if isinstance(args, DSecContainerRunArgs) else dict(args)
        if "container_image" in body and "image" not in body:
            body["image"] = body.pop("container_image")
        # A create with wait_s may wait that long in the apiserver's queue before it starts.
        timeout += float(body.get("wait_s") or 0.0)
        deadline = time.monotonic() + timeout
        # A create carrying an idempotency key may be resent; one without never is.
        resp = await self._request(
            "POST", "/v1/sandboxes", json_body=body, timeout=timeout, retry=bool(body.get("idempotency_key"))
        )
        info = SandboxInfo.from_json(self._json(resp))
        queue = QueueReport.from_json(info.raw.get("queue"))
        while info.state == "creating":
            if time.monotonic() > deadline:
                raise DSecError(f"sandbox {info.id} still creating after {timeout:g} s", code="timeout")
            await asyncio.sleep(0.2)
            info = await self.get_sandbox(info.id)
        if info.state in ("failed", "stopped", "stopping"):
            raise DSecError(
                f"sandbox {info.id} is {info.state} right after creation: {info.reason or 'no reason given'}",
                code="sandbox_dead",
            )
        sb = Sandbox(self, info)
        sb.queue = queue
        return sb

    async def run_microvm(
        self, args: Union[DSecContainerRunArgs, Mapping[str, Any]], timeout: float = 300.0
    ) -> "Sandbox":
        """Creates a microVM sandbox (``substrate="microvm"``): same calls as a container."""
        body = args.to_json() if isinstance(args, DSecContainerRunArgs) else dict(args)
        body["substrate"] = "microvm"
        return await self.run_container(body, timeout=timeout)

    async def run_vm(self, args: Union[DSecVMRunArgs, Mapping[str, Any]], timeout: float = 600.0) -> "Sandbox":
        """Creates a full-VM sandbox (``substrate="vm"``) booting a VM disk image through the
        firmware: same calls as a container. Under software emulation boot takes tens of seconds."""
        body = args.to_json() if isinstance(args, DSecVMRunArgs) else dict(args)
        body["substrate"] = "vm"
        return await self.run_container(body, timeout=timeout)

    async def create_sandbox(
        self, args: Union[DSecContainerRunArgs, Mapping[str, Any]], timeout: float = 120.0
    ) -> "Sandbox":
        """Alias of :meth:`run_container`."""
        return await self.run_container(args, timeout=timeout)

    async def create(
        self, args: Union[DSecContainerRunArgs, Mapping[str, Any], None] = None, *,
        from_snapshot: Optional[str] = None, timeout: float = 120.0, wait_s: Optional[float] = None,
        **fields: Any,
    ) -> "Sandbox":
        """Creates a sandbox from ``args`` (or keyword fields); ``from_snapshot`` starts it from
        a snapshot (:meth:`Sandbox.snapshot`'s ``id``) instead of an image. ``wait_s``: wait up
        to that long in the apiserver's queue for a node with room instead of failing with
        ``node_full`` (:attr:`Sandbox.queue` then says how long it waited)."""
        if args is None:
            body: Dict[str, Any] = dict(fields)
        elif isinstance(args, DSecContainerRunArgs):
            body = args.to_json()
        else:
            body = dict(args)
        if wait_s is not None:
            body["wait_s"] = float(wait_s)
        if from_snapshot is not None:
            body.pop("container_image", None)
            body["image"] = from_snapshot
        return await self.run_container(body, timeout=timeout)

    async def create_many(
        self, args: Union[DSecContainerRunArgs, Mapping[str, Any]], n: int, *,
        labels: Optional[Mapping[str, str]] = None, wait_s: Optional[float] = None,
    ) -> Batch:
        """Submits ``n`` creates of one shape as a batch placed as capacity frees (each waits
        up to ``wait_s``, default an hour); every sandbox is labelled ``dsec.batch=<id>``
        and ``labels``. :meth:`Batch.refresh` reads placed/queued/failed while it runs."""
        resp = await self._request("POST", "/v1/batches", json_body=batch_body(args, n, labels, wait_s))
        return Batch(self, BatchStatus.from_json(self._json(resp)))

    async def get_batch(self, batch_id: str) -> Batch:
        """A handle on a batch submitted through this apiserver."""
        resp = await self._request("GET", f"/v1/batches/{_seg(batch_id)}")
        return Batch(self, BatchStatus.from_json(self._json(resp)))

    async def get_sandbox(self, sandbox_id: str) -> SandboxInfo:
        resp = await self._request("GET", f"/v1/sandboxes/{_seg(sandbox_id)}")
        return SandboxInfo.from_json(self._json(resp))

    async def list_sandboxes(self, *, ended: bool = False, end_reason: Optional[str] = None) -> List[SandboxInfo]:
        """The live sandboxes; with ``ended`` also the ended ones the nodes remember, with
        ``end_reason`` only those that ended for that reason (see ``SandboxInfo.end_reason``)."""
        params: Dict[str, str] = {}
        if ended:
            params["ended"] = "true"
        if end_reason:
            params["end_reason"] = end_reason
        resp = await self._request("GET", "/v1/sandboxes", params=params or None)
        doc = self._json(resp)
        return [SandboxInfo.from_json(d) for d in doc.get("sandboxes", []) if isinstance(d, dict)]

    async def attach(self, sandbox_id: str) -> "Sandbox":
        """A :class:`Sandbox` handle for an existing sandbox (e.g. after a trainer restart).

        Its step numbering restarts at 1 and ``last_completed_step`` tells how far the sandbox
        got: replaying the same script fast-forwards through the completed steps (recorded
        results, nothing runs twice) and continues from there."""
        sb = Sandbox(self, await self.get_sandbox(sandbox_id))
        await sb.fast_forward()
        return sb

    async def stop_sandbox(self, sandbox_id: str) -> SandboxInfo:
        resp = await self._request("DELETE", f"/v1/sandboxes/{_seg(sandbox_id)}")
        return SandboxInfo.from_json(self._json(resp))

    async def pause_sandbox(self, sandbox_id: str) -> SandboxInfo:
        resp = await self._request("POST", f"/v1/sandboxes/{_seg(sandbox_id)}/pause")
        return SandboxInfo.from_json(self._json(resp))

    async def resume_sandbox(self, sandbox_id: str) -> SandboxInfo:
        resp = await self._request("POST", f"/v1/sandboxes/{_seg(sandbox_id)}/resume")
        return SandboxInfo.from_json(self._json(resp))

    async def _job(self, op: str, labels: Mapping[str, str], timeout: float) -> JobOpResult:
        if not labels:
            raise ValueError("labels must name at least one label")
        resp = await self._request(
            "POST",
            f"/v1/jobs/{op}",
            json_body={"labels": dict(labels)},
            timeout=timeout,
        )
        return JobOpResult.from_json(self._json(resp))

    async def pause(self, labels: Mapping[str, str], timeout: float = 600.0) -> JobOpResult:
        """Pauses every sandbox (on every node) whose labels include all of ``labels``:
        the trainer's preemption hook. Returns counts and failures."""
        return await self._job("pause", labels, timeout)

    async def resume(self, labels: Mapping[str, str], timeout: float = 600.0) -> JobOpResult:
        """Resumes every paused sandbox whose labels include all of ``labels``."""
        return await self._job("resume", labels, timeout)

    async def stop(self, labels: Mapping[str, str], timeout: float = 600.0) -> JobOpResult:
        """Stops every sandbox whose labels include all of ``labels``."""
        return await self._job("stop", labels, timeout)

    # -- images and nodes ---------------------------------------------------------------------

    async def list_images(self) -> List[ImageInfo]:
        resp = await self._request("GET", "/v1/images")
        doc = self._json(resp)
        return [ImageInfo.from_json(d) for d in doc.get("images", []) if isinstance(d, dict)]

    async def import_image(
        self, name: str, tar: Union[PathLike, bytes], timeout: float = 3600.0, format: Optional[str] = None
    ) -> ImageInfo:
        """Imports an image from a tar(.gz) file path or bytes.

        ``format``: ``tar`` (a root file system, default), ``docker-archive`` (``docker save``
        output) or ``oci`` (a tar of an OCI image layout); multi-layer formats keep their layers.
        """
        if isinstance(tar, (bytes, bytearray)):
            content: Any = bytes(tar)
        else:
            content = _file_chunks(os.fspath(tar))
        resp = await self._request(
            "PUT",
            f"/v1/images/{_seg(name)}",
            params={"format": format} if format else None,
            content=content,
            headers={"content-type": "application/x-tar"},
            timeout=timeout,
        )
        return ImageInfo.from_json(self._json(resp))

    async def pull_image(
        self,
        name: str,
        reference: str,
        insecure: bool = False,
        username: Optional[str] = None,
        password: Optional[str] = None,
        timeout: float = 3600.0,
        ca_pem: Optional[str] = None,
    ) -> ImageInfo:
        """Pulls ``reference`` (``[https://|http://]host[:port]/repo[:tag|@sha256:...]``) from an
        OCI registry into the image ``name`` on the node. Without a scheme a loopback registry
        is reached over plain HTTP and any other over TLS (plain HTTP with ``insecure``).
        ``ca_pem`` (PEM text) is trusted for the registry's TLS besides the system's roots."""
        body: Dict[str, Any] = {"action": "pull", "reference": reference, "insecure": insecure}
        if ca_pem is not None:
            body["ca_pem"] = ca_pem
        if username is not None:
            body["username"] = username
        if password is not None:
            body["password"] = password
        resp = await self._request(
            "POST", f"/v1/images/{_seg(name)}", json_body=body, timeout=timeout
        )
        return ImageInfo.from_json(self._json(resp))

    async def fold_image(
        self, name: str, max_layer_bytes: Optional[int] = None, into: Optional[str] = None, timeout: float = 3600.0
    ) -> ImageInfo:
        """Merges consecutive layers of ``name`` smaller than ``max_layer_bytes`` (default 64 MiB)
        into one layer with the same visible tree; registers the result as ``into`` (default:
        replaces ``name``)."""
        body: Dict[str, Any] = {"action": "fold"}
        if max_layer_bytes is not None:
            body["max_layer_bytes"] = max_layer_bytes
        if into is not None:
            body["into"] = into
        resp = await self._request(
            "POST", f"/v1/images/{_seg(name)}", json_body=body, timeout=timeout
        )
        return ImageInfo.from_json(self._json(resp))

    async def remove_image(self, name: str) -> None:
        await self._request("DELETE", f"/v1/images/{_seg(name)}")

    async def list_nodes(self) -> List[Dict[str, Any]]:
        resp = await self._request("GET", "/v1/nodes")
        doc = self._json(resp)
        return [d for d in doc.get("nodes", []) if isinstance(d, dict)]


class _aclosing:
    """``contextlib.aclosing`` (Python ≥ 3.10): closes an async generator on exit, so leaving a
    stream loop early closes the HTTP connection at once (not when the generator is collected)."""

    def __init__(self, agen: Any):
        self.agen = agen

    async def __aenter__(self) -> Any:
        return self.agen

    async def __aexit__(self, *exc: Any) -> None:
        await self.agen.aclose()


async def _file_chunks(path: str) -> AsyncIterator[bytes]:
    with open(path, "rb") as f:
        while True:
            chunk = f.read(UPLOAD_CHUNK)
            if not chunk:
                return
            yield chunk


def _shell_body(
    cmd: str,
    session: str,
    timeout: Optional[float],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    stdin: Union[str, bytes, None],
    max_output_bytes: Optional[int],
    step: Optional[int],
) -> Dict[str, Any]:
    body: Dict[str, Any] = {"cmd": cmd, "session": session}
    if timeout is not None:
        body["timeout"] = float(timeout)
    if env:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if stdin is not None:
        if isinstance(stdin, (bytes, bytearray)):
            try:
                stdin = bytes(stdin).decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError("run_shell stdin must be UTF-8 text; use exec(stdin=bytes) for binary input") from e
        body["stdin"] = stdin
    if max_output_bytes is not None:
        body["max_output_bytes"] = int(max_output_bytes)
    if step is not None:
        body["step"] = int(step)
    return body


def _exec_body(
    argv: Sequence[str],
    timeout: Optional[float],
    env: Optional[Mapping[str, str]],
    cwd: Optional[str],
    stdin: Union[str, bytes, None],
    user: Optional[str],
    max_output_bytes: Optional[int],
    step: Optional[int],
) -> Dict[str, Any]:
    if isinstance(argv, str):
        raise TypeError("exec takes an argv list, e.g. ['ls', '-l']; use run_shell for a command line")
    body: Dict[str, Any] = {"argv": [str(a) for a in argv]}
    if timeout is not None:
        body["timeout"] = float(timeout)
    if env:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if isinstance(stdin, (bytes, bytearray)):
        body["stdin_b64"] = base64.b64encode(bytes(stdin)).decode("ascii")
    elif stdin is not None:
        body["stdin"] = stdin
    if user is not None:
        body["user"] = user
    if max_output_bytes is not None:
        body["max_output_bytes"] = int(max_output_bytes)
    if step is not None:
        body["step"] = int(step)
    return body


def _check_timeout(result: ShellResult, what: str, timeout: Optional[float], raise_on_timeout: bool) -> ShellResult:
    if raise_on_timeout and result.timed_out:
        limit = timeout if timeout is not None else DEFAULT_COMMAND_TIMEOUT
        raise CommandTimeout(f"{what} timed out after {limit:g} s", result)
    return result


class Sandbox(ProcessesMixin, WatchMixin, MetricsMixin):
    """A handle on one sandbox. ``async with sandbox:`` stops it on exit."""

    def __init__(self, client: DSecClient, info: SandboxInfo):
        self._client = client
        self.info = info
        #: Number every call (1, 2, 3, ...) for trajectory fast-forward; False sends no step ids.
        self.auto_step = True
        self._steps = StepCounter()
        self._ff: Optional[FastForward] = None
        #: Highest completed step when the handle was attached (``None``: none).
        self.last_completed_step: Optional[int] = None
        #: How the create waited in the apiserver's queue (creates with ``wait_s`` only).
        self.queue: Optional[QueueReport] = None

    def _step(self, step: Optional[int]) -> Optional[int]:
        return self._steps.next(step) if (self.auto_step or step is not None) else None

    def _local(self, step: Optional[int], kind: str, key: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        return self._ff.lookup(step, kind, key) if self._ff is not None else None

    def _peek_local(self, step: Optional[int], kind: str, key: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """The prefetched record answering the next call without any I/O (its step is then
        used up), or ``None`` (the call goes the normal way and numbers itself)."""
        if self._ff is None or not (self.auto_step or step is not None):
            return None
        rec = self._ff.lookup(self._steps.last + 1 if step is None else int(step), kind, key)
        if rec is not None:
            self._steps.next(step)
        return rec

    def local_shell(self, cmd: str, session: str = "default", timeout: Optional[float] = None, env=None, cwd=None,
                    stdin=None, step: Optional[int] = None, **_: Any) -> Optional[ShellResult]:
        """A completed step's result from the prefetched log, or ``None`` (used by the sync client
        to fast-forward without a hop to its event loop)."""
        rec = self._peek_local(step, "shell", shell_key(cmd, session, cwd, env, stdin))
        if rec is None:
            return None
        result = ShellResult.from_json(rec.get("result") or {})
        result.replayed = True
        return result

    def local_exec(self, argv: Sequence[str], timeout: Optional[float] = None, env=None, cwd=None, stdin=None,
                   user: Optional[str] = None, step: Optional[int] = None, **_: Any) -> Optional[ShellResult]:
        if isinstance(argv, str):
            return None
        rec = self._peek_local(step, "exec", exec_key(argv, cwd, env, stdin, user))
        if rec is None:
            return None
        result = ShellResult.from_json(rec.get("result") or {})
        result.replayed = True
        return result

    # -- trajectory ---------------------------------------------------------------------------

    async def last_step(self) -> Dict[str, Any]:
        """``{"last_completed_step", "running_steps", "records", "enabled"}`` from the edge."""
        resp = await self._client._request("GET", self._path("/trajectory/last_step"))
        return self._client._json(resp)

    async def trajectory(
        self,
        from_step: Optional[int] = None,
        to_step: Optional[int] = None,
        kind: Union[str, Sequence[str], None] = None,
        since: Optional[float] = None,
        until: Optional[float] = None,
        path: Optional[str] = None,
    ) -> List[Dict[str, Any]]:
        """The sandbox's trajectory log as records (dicts), oldest first. ``since``/``until`` are
        Unix times; ``path`` answers which call last wrote that file."""
        params: Dict[str, str] = {}
        if from_step is not None:
            params["from"] = str(int(from_step))
        if to_step is not None:
            params["to"] = str(int(to_step))
        if kind:
            params["kind"] = kind if isinstance(kind, str) else ",".join(kind)
        if since is not None:
            params["since"] = repr(float(since))
        if until is not None:
            params["until"] = repr(float(until))
        if path is not None:
            params["path"] = path
        resp = await self._client._request("GET", self._path("/trajectory"), params=params, timeout=600.0)
        out = []
        for line in resp.text.splitlines():
            if line.strip():
                out.append(json.loads(line))
        return out

    async def fast_forward(self) -> Optional[int]:
        """Restarts step numbering at 1 and fetches the completed steps (one request) so that
        replayed calls are answered locally. Returns ``last_completed_step``."""
        self._steps = StepCounter()
        info = await self.last_step()
        self.last_completed_step = info.get("last_completed_step")
        if info.get("enabled") and self.last_completed_step is not None:
            self._ff = FastForward(await self.trajectory(from_step=1, to_step=self.last_completed_step))
        else:
            self._ff = None
        return self.last_completed_step

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r}, image={self.info.image!r}, state={self.info.state!r})"

    def _path(self, suffix: str = "") -> str:
        return f"/v1/sandboxes/{_seg(self.id)}{suffix}"

    async def refresh(self) -> SandboxInfo:
        self.info = await self._client.get_sandbox(self.id)
        return self.info

    async def stop(self) -> SandboxInfo:
        self.info = await self._client.stop_sandbox(self.id)
        return self.info

    async def pause(self) -> SandboxInfo:
        """Freezes the sandbox and gives its memory back; ``info.last_pause`` reports memory
        before and after. Any later request resumes it transparently."""
        self.info = await self._client.pause_sandbox(self.id)
        return self.info

    async def resume(self) -> SandboxInfo:
        self.info = await self._client.resume_sandbox(self.id)
        return self.info

    async def network(self) -> Dict[str, Any]:
        """The sandbox's network mode, rules, addresses and denied counters."""
        resp = await self._client._request("GET", self._path("/network"))
        return resp.json()

    async def set_network_rules(
        self,
        rules: Optional[List[Mapping[str, Any]]] = None,
        groups: Optional[Mapping[str, bool]] = None,
        mode: Optional[str] = None,
    ) -> Dict[str, Any]:
        """Replaces the allow rules (``[{"cidr": "192.0.2.0/24", "ports": "443", "protocol": "tcp"}]``)
        and, when given, the domain groups (``{"pypi": True}``); effective for new connections at once."""
        body: Dict[str, Any] = {"rules": list(rules or [])}
        if groups is not None:
            body["groups"] = dict(groups)
        if mode is not None:
            body["mode"] = mode
        resp = await self._client._request("PUT", self._path("/network"), json_body=body)
        return resp.json()

    # -- exposed ports ------------------------------------------------------------------------

    async def get_url(self, port: int, public: bool = False, expires_in: Optional[int] = 3600) -> str:
        """The URL of TCP ``port`` inside this sandbox, through the apiserver (HTTP/1.1,
        streamed bodies, WebSocket). ``public=False`` (default): a signed URL, valid for
        ``expires_in`` seconds, that works without the API key. ``public=True``: the plain URL,
        which needs the API key (``Authorization: Bearer``) unless the port was created public
        (``public_ports=[...]``)."""
        base = f"{self._client.api_url}{self._path(f'/ports/{int(port)}/')}"
        if public:
            return base
        info = await self.port_url(port, expires_in=expires_in)
        return f"{self._client.api_url}{info['path']}"

    async def port_url(self, port: int, expires_in: Optional[int] = 3600) -> Dict[str, Any]:
        """Signs a URL for ``port``: ``{"path", "token", "expires_at", "host"}`` (``host`` is
        ``{port}-{id}.{sandbox_domain}`` when the apiserver has a ``sandbox_domain``)."""
        body: Dict[str, Any] = {"port": int(port)}
        if expires_in is not None:
            body["expires_in"] = int(expires_in)
        resp = await self._client._request("POST", self._path("/port_urls"), json_body=body)
        return self._client._json(resp)

    async def pack_diff(self, name: str, exclude: Optional[List[str]] = None, timeout: float = 3600.0) -> ImageInfo:
        """Turns this sandbox's writable layer into a new layer and registers image ``name`` =
        this sandbox's layers + the diff. ``exclude``: absolute paths left out (with everything
        below them), e.g. the build user's home or caches. The sandbox is frozen briefly."""
        resp = await self._client._request(
            "POST",
            self._path("/pack_diff"),
            json_body={"name": name, "exclude": list(exclude or [])},
            timeout=timeout,
        )
        return ImageInfo.from_json(self._client._json(resp))

    async def snapshot(self, name: Optional[str] = None, memory: bool = False, timeout: float = 3600.0) -> Dict[str, Any]:
        """Snapshots this sandbox's files: its writable layer, taken while it is frozen, becomes
        a layer on top of its layers, registered as an image. Answers the snapshot (``id``: the
        image name to create from, ``step``: the last completed step, ``image``,
        ``snapshot_ms``, ``shared``: published in the blob store the nodes share, so any node
        can start from it). The sandbox goes on; a sandbox created from the snapshot starts new
        processes on those files (``memory=True``, processes too, is for microVMs: not yet)."""
        body: Dict[str, Any] = {"memory": memory}
        if name is not None:
            body["name"] = name
        resp = await self._client._request("POST", self._path("/snapshot"), json_body=body, timeout=timeout)
        return dict(self._client._json(resp))

    async def fork(
        self, n: int, labels: Optional[Mapping[str, str]] = None, snapshot_name: Optional[str] = None,
        timeout: float = 3600.0,
    ) -> List["Sandbox"]:
        """``n`` (1..100) new sandboxes from one snapshot of this one, placed like any create,
        each with its own id, writable layer, network and trajectory (labelled
        ``dsec.fork_of``/``dsec.fork_step``). Raises :class:`ForkFailed` (with the children
        that exist) when some could not be made; nothing of a failed child is left."""
        body: Dict[str, Any] = {"n": n, "labels": dict(labels or {})}
        if snapshot_name is not None:
            body["snapshot_name"] = snapshot_name
        resp = await self._client._request("POST", self._path("/fork"), json_body=body, timeout=timeout)
        doc = self._client._json(resp)
        children = [Sandbox(self._client, SandboxInfo.from_json(d)) for d in doc.get("children", [])]
        failed = list(doc.get("failed") or [])
        if failed:
            raise ForkFailed(
                f"fork of {self.id}: {len(failed)} of {n} children failed: "
                + "; ".join(f"#{f.get('index')}: {(f.get('error') or {}).get('message')}" for f in failed[:5]),
                children=children, failed=failed, snapshot=doc.get("snapshot"),
            )
        return children

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.stop()
        except SandboxNotFound:
            pass

    # -- commands -----------------------------------------------------------------------------

    async def run_shell(
        self,
        cmd: str,
        session: str = "default",
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        stdin: Union[str, bytes, None] = None,
        max_output_bytes: Optional[int] = None,
        *,
        raise_on_timeout: bool = False,
        step: Optional[int] = None,
    ) -> ShellResult:
        """Runs ``cmd`` in the persistent shell ``session`` (cwd, env, functions and background
        jobs persist between calls). A command that runs past ``timeout`` seconds (server default
        60) is killed and comes back with ``timed_out=True``, or raises :class:`CommandTimeout`
        when ``raise_on_timeout`` is set."""
        step = self._step(step)
        rec = self._local(step, "shell", shell_key(cmd, session, cwd, env, stdin))
        if rec is not None:
            result = ShellResult.from_json(rec.get("result") or {})
            result.replayed = True
            return _check_timeout(result, f"command {cmd[:80]!r}", timeout, raise_on_timeout)
        body = _shell_body(cmd, session, timeout, env, cwd, stdin, max_output_bytes, step)
        resp = await self._client._request("POST", self._path("/shell"), json_body=body, timeout=_http_timeout(timeout))
        result = ShellResult.from_json(self._client._json(resp))
        result.replayed = resp.headers.get("x-dsec-replayed") == "true"
        return _check_timeout(result, f"command {cmd[:80]!r}", timeout, raise_on_timeout)

    async def exec(
        self,
        argv: Sequence[str],
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        stdin: Union[str, bytes, None] = None,
        user: Optional[str] = None,
        max_output_bytes: Optional[int] = None,
        *,
        raise_on_timeout: bool = False,
        step: Optional[int] = None,
    ) -> ShellResult:
        """Runs ``argv`` directly (no shell). ``stdin`` may be text or bytes."""
        step = self._step(step)
        if isinstance(argv, str):
            raise TypeError("exec takes an argv list, e.g. ['ls', '-l']; use run_shell for a command line")
        rec = self._local(step, "exec", exec_key(argv, cwd, env, stdin, user))
        if rec is not None:
            result = ShellResult.from_json(rec.get("result") or {})
            result.replayed = True
            return _check_timeout(result, f"exec {list(argv)[:4]!r}", timeout, raise_on_timeout)
        body = _exec_body(argv, timeout, env, cwd, stdin, user, max_output_bytes, step)
        resp = await self._client._request("POST", self._path("/exec"), json_body=body, timeout=_http_timeout(timeout))
        result = ShellResult.from_json(self._client._json(resp))
        result.replayed = resp.headers.get("x-dsec-replayed") == "true"
        return _check_timeout(result, f"exec {list(argv)[:4]!r}", timeout, raise_on_timeout)

    async def stream_shell(
        self,
        cmd: str,
        session: str = "default",
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        stdin: Union[str, bytes, None] = None,
        max_output_bytes: Optional[int] = None,
        *,
        step: Optional[int] = None,
    ) -> AsyncIterator[StreamEvent]:
        """Runs ``cmd`` like :meth:`run_shell` and yields :class:`StreamEvent`s as output arrives
        (``stdout``/``stderr`` chunks, then one ``exit`` with the result). Leaving the loop early
        closes the connection, which cancels the command."""
        body = _shell_body(cmd, session, timeout, env, cwd, stdin, max_output_bytes, step)
        body["stream"] = True
        async with _aclosing(self._events(self._path("/shell"), body, timeout)) as events:
            async for event in events:
                yield event

    async def stream_exec(
        self,
        argv: Sequence[str],
        timeout: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        stdin: Union[str, bytes, None] = None,
        user: Optional[str] = None,
        max_output_bytes: Optional[int] = None,
        *,
        step: Optional[int] = None,
    ) -> AsyncIterator[StreamEvent]:
        """Like :meth:`exec`, streaming :class:`StreamEvent`s."""
        body = _exec_body(argv, timeout, env, cwd, stdin, user, max_output_bytes, step)
        body["stream"] = True
        async with _aclosing(self._events(self._path("/exec"), body, timeout)) as events:
            async for event in events:
                yield event

    async def _events(self, path: str, body: Dict[str, Any], timeout: Optional[float]) -> AsyncIterator[StreamEvent]:
        saw_exit = False
        async with _aclosing(self._client._stream_lines(path, body, _http_timeout(timeout))) as docs:
            async for doc in docs:
                if doc.get("type") == "error":
                    err = doc.get("error") if isinstance(doc.get("error"), dict) else {}
                    raised = error_from_parts(None, err.get("code"), str(err.get("message") or "command failed"))
                    raise await self._client._ended("POST", path, raised)
                event = StreamEvent.from_json(doc)
                if event.type == "exit":
                    saw_exit = True
                yield event
        if not saw_exit:
            raise TransportError("the command stream ended without an exit event")

    async def close_session(self, session: str) -> None:
        """Ends a named shell session (its processes are killed)."""
        await self._client._request("DELETE", self._path(f"/sessions/{_seg(session)}"))

    # -- files --------------------------------------------------------------------------------

    async def write_file(
        self, path: str, data: Union[bytes, str], mode: int = 0o644, *, step: Optional[int] = None
    ) -> FileInfo:
        """Writes ``data`` (bytes, or text as UTF-8) to ``path`` with permission bits ``mode``."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        data = bytes(data)
        step = self._step(step)
        rec = self._local(step, "write_file", write_key(path, mode, data))
        if rec is not None:
            return FileInfo.from_json(rec.get("result") or {})
        params = {"path": path, "mode": _mode_text(mode)}
        if step is not None:
            params["step"] = str(step)
        resp = await self._client._request(
            "PUT",
            self._path("/files"),
            params=params,
            content=data,
            headers={"content-type": "application/octet-stream"},
        )
        return FileInfo.from_json(self._client._json(resp))

    async def read_file(self, path: str, *, step: Optional[int] = None) -> bytes:
        step = self._step(step)
        rec = self._local(step, "read_file", {"path": path})
        if rec is not None:
            content = content_of(rec)
            if content is not None:
                return content
        resp = await self._client._request("GET", self._path("/files"), params=self._step_params({"path": path}, step))
        return resp.content

    @staticmethod
    def _step_params(params: Dict[str, str], step: Optional[int]) -> Dict[str, str]:
        if step is not None:
            params["step"] = str(step)
        return params

    async def upload(
        self, local_path: PathLike, remote_path: str, mode: Optional[int] = None, timeout: float = 3600.0
    ) -> FileInfo:
        """Streams a local file into the sandbox, keeping its permission bits (or ``mode``)."""
        local = os.fspath(local_path)
        if mode is None:
            mode = os.stat(local).st_mode & 0o7777
        resp = await self._client._request(
            "PUT",
            self._path("/files"),
            params={"path": remote_path, "mode": _mode_text(mode)},
            content=_file_chunks(local),
            headers={"content-type": "application/octet-stream"},
            timeout=timeout,
        )
        return FileInfo.from_json(self._client._json(resp))

    async def download(self, remote_path: str, local_path: PathLike, timeout: float = 3600.0) -> int:
        """Streams a sandbox file to ``local_path`` (mode from ``x-dsec-mode``); returns its size."""
        local = os.fspath(local_path)
        http = await self._client._client()
        path = self._path("/files")
        written = 0
        try:
            async with http.stream("GET", path, params={"path": remote_path}, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    raise await self._client._ended("GET", path, error_from_body(resp.status_code, await resp.aread()))
                mode = parse_mode_header(resp.headers.get("x-dsec-mode"))
                tmp = f"{local}.dsec-part"
                try:
                    with open(tmp, "wb") as f:
                        async for chunk in resp.aiter_bytes():
                            f.write(chunk)
                            written += len(chunk)
                    if mode is not None:
                        os.chmod(tmp, mode)
                    os.replace(tmp, local)
                except BaseException:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass
                    raise
        except _http.HTTPTimeout as e:
            raise TransportError(f"GET {path}: timed out ({e})") from e
        except _http.HTTPError as e:
            raise TransportError(f"GET {path}: connection to the API server failed: {e}") from e
        return written

    async def list_files(self, path: str, *, step: Optional[int] = None) -> List[FileInfo]:
        step = self._step(step)
        rec = self._local(step, "list_files", {"path": path})
        if rec is not None:
            doc = rec.get("result") or {}
        else:
            resp = await self._client._request(
                "GET", self._path("/files/list"), params=self._step_params({"path": path}, step)
            )
            doc = self._client._json(resp)
        return [FileInfo.from_json(d) for d in doc.get("entries", []) if isinstance(d, dict)]

    async def stat(self, path: str, *, step: Optional[int] = None) -> FileInfo:
        step = self._step(step)
        rec = self._local(step, "stat", {"path": path})
        if rec is not None:
            return FileInfo.from_json(rec.get("result") or {})
        resp = await self._client._request("GET", self._path("/files/stat"), params=self._step_params({"path": path}, step))
        return FileInfo.from_json(self._client._json(resp))

    async def exists(self, path: str, *, step: Optional[int] = None) -> bool:
        from .errors import FileNotFound

        try:
            await self.stat(path, step=step)
            return True
        except FileNotFound:
            return False

    async def remove(self, path: str, recursive: bool = False, *, step: Optional[int] = None) -> None:
        step = self._step(step)
        if self._local(step, "remove", {"path": path, "recursive": bool(recursive)}) is not None:
            return
        params = {"path": path, "recursive": "true" if recursive else "false"}
        await self._client._request("DELETE", self._path("/files"), params=self._step_params(params, step))

    async def mkdir(self, path: str, parents: bool = True, mode: int = 0o755, *, step: Optional[int] = None) -> FileInfo:
        step = self._step(step)
        rec = self._local(step, "mkdir", {"path": path, "mode": mode & 0o7777, "parents": bool(parents)})
        if rec is not None:
            return FileInfo.from_json(rec.get("result") or {})
        params = {"path": path, "mode": _mode_text(mode), "parents": "true" if parents else "false"}
        resp = await self._client._request("POST", self._path("/files/mkdir"), params=self._step_params(params, step))
        return FileInfo.from_json(self._client._json(resp))
