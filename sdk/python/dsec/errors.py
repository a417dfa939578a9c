"""Exceptions raised by the dsec SDK.

Every error answer of the API is ``{"error": {"code": ..., "message": ...}}`` with a 4xx or 5xx
status; :func:`error_from_response` turns it into the matching exception class.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Dict, Optional, Type

if TYPE_CHECKING:  # pragma: no cover
    from .types import ShellResult


class DSecError(Exception):
    """Base class of every SDK error.

    ``status`` is the HTTP status (``None`` for transport errors), ``code`` the API's stable
    machine-readable error code and ``message`` its human-readable explanation.
    """

    def __init__(self, message: str, *, status: Optional[int] = None, code: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        #: Seconds the server asks to wait before retrying (a full function queue's 429), or ``None``.
        self.retry_after_s: Optional[float] = None

    def __str__(self) -> str:
        parts = []
        if self.status is not None:
            parts.append(str(self.status))
        if self.code:
            parts.append(self.code)
        prefix = " ".join(parts)
        return f"{prefix}: {self.message}" if prefix else self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status!r}, code={self.code!r}, message={self.message!r})"


class BadRequest(DSecError):
    """The request was malformed (400)."""


class PayloadTooLarge(BadRequest):
    """The request body or command was larger than the server accepts (413)."""


class Unauthorized(DSecError):
    """Missing or unknown API key (401)."""


class Forbidden(DSecError):
    """The key may not do this (403)."""


class NotFound(DSecError):
    """Something was not found (404)."""


class SandboxNotFound(NotFound):
    """No sandbox with that id (404 ``sandbox_not_found``)."""


class ImageNotFound(NotFound):
    """No image with that name on the node (404 ``image_not_found``)."""


class FileNotFound(NotFound):
    """No such file inside the sandbox (404 ``file_not_found``)."""


class Conflict(DSecError):
    """The resource is in a state that forbids the call (409), e.g. an image in use."""


class SandboxDead(DSecError):
    """The sandbox died (410 ``sandbox_dead``)."""


class SandboxEnded(SandboxDead):
    """A call reached a sandbox that has ended; ``reason`` says why (one of
    ``dsec.types.END_REASONS``), ``detail`` what exactly happened and ``infrastructure``
    whether the platform ended it (mask that rollout) rather than the agent or its trainer.

    A subclass of :class:`SandboxDead`, so code catching that keeps working."""

    def __init__(
        self,
        message: str,
        *,
        sandbox_id: str,
        reason: str,
        detail: Optional[str] = None,
        status: Optional[int] = 410,
        code: Optional[str] = "sandbox_dead",
    ):
        super().__init__(message, status=status, code=code)
        self.sandbox_id = sandbox_id
        self.reason = reason
        self.detail = detail

    @property
    def infrastructure(self) -> bool:
        from .types import INFRASTRUCTURE_END_REASONS

        return self.reason in INFRASTRUCTURE_END_REASONS


class ForkFailed(DSecError):
    """Some children of a fork could not be made. ``children`` holds the :class:`Sandbox`
    handles of those that exist (stop them or use them), ``failed`` the failures
    (``{"index": i, "error": {"code", "message"}}``), ``snapshot`` the snapshot taken."""

    def __init__(self, message: str, *, children: Any, failed: Any, snapshot: Any = None):
        super().__init__(message, status=207, code="fork_failed")
        self.children = children
        self.failed = failed
        self.snapshot = snapshot


class SandboxBusy(DSecError):
    """The sandbox is at its process limit and its agent cannot take the request right now
    (503 ``sandbox_busy``): kill processes in it, or retry."""


class QuotaExceeded(DSecError):
    """The project's quota is used up (429)."""


class Unsupported(DSecError):
    """The server does not implement this (501), e.g. a substrate not available."""


class NodeUnavailable(DSecError):
    """No node can take the request or the sandbox's node cannot be reached (503)."""


class NodeFull(NodeUnavailable):
    """The node has no room for another sandbox (503 ``node_full``)."""


class TransportError(NodeUnavailable):
    """The API server could not be reached or the connection broke."""


class PortUnreachable(DSecError):
    """Nothing answers on that TCP port inside the sandbox (502 ``port_unreachable``): start
    the server first, or check the port number."""


class CommandTimeout(DSecError):
    """A command ran past its timeout (raised only with ``raise_on_timeout=True``).

    ``result`` holds the partial :class:`~dsec.types.ShellResult`.
    """

    def __init__(self, message: str, result: "ShellResult"):
        super().__init__(message, code="command_timeout")
        self.result = result


_BY_CODE: Dict[str, Type[DSecError]] = {
    "bad_request": BadRequest,
    "payload_too_large": PayloadTooLarge,
    "unauthorized": Unauthorized,
    "forbidden": Forbidden,
    "not_found": NotFound,
    "sandbox_not_found": SandboxNotFound,
    "image_not_found": ImageNotFound,
    "file_not_found": FileNotFound,
    "conflict": Conflict,
    "sandbox_dead": SandboxDead,
    "sandbox_busy": SandboxBusy,
    "quota_exceeded": QuotaExceeded,
    "unsupported": Unsupported,
    "node_unavailable": NodeUnavailable,
    "node_full": NodeFull,
    "port_unreachable": PortUnreachable,
}

_BY_STATUS: Dict[int, Type[DSecError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: SandboxDead,
    413: PayloadTooLarge,
    422: BadRequest,
    429: QuotaExceeded,
    501: Unsupported,
    # 502 is not mapped: a bare 502 usually comes from a proxy in between, and only a
    # body with the code ``port_unreachable`` means nothing listens in the sandbox.
    503: NodeUnavailable,
}


def error_from_parts(status: Optional[int], code: Optional[str], message: str) -> DSecError:
    """Builds the exception for an error code (preferred) or, failing that, an HTTP status."""
    cls: Type[DSecError] = DSecError
    if code and code in _BY_CODE:
        cls = _BY_CODE[code]
    elif status is not None and status in _BY_STATUS:
        cls = _BY_STATUS[status]
    return cls(message, status=status, code=code)


def error_from_body(status: Optional[int], body: bytes) -> DSecError:
    """Maps an HTTP error answer (status + raw body) to an exception."""
    code: Optional[str] = None
    message = ""
    try:
        doc: Any = json.loads(body.decode("utf-8")) if body else None
    except (UnicodeDecodeError, ValueError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        err = doc["error"]
        if isinstance(err.get("code"), str):
            code = err["code"]
        if isinstance(err.get("message"), str):
            message = err["message"]
    if not message:
        text = body.decode("utf-8", errors="replace").strip() if body else ""
        message = text[:2000] if text else f"HTTP {status}"
    err = error_from_parts(status, code, message)
    if isinstance(doc, dict) and isinstance(doc.get("retry_after_s"), (int, float)):
        err.retry_after_s = float(doc["retry_after_s"])
    return err
