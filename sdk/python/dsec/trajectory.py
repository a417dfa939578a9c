"""Client side of the trajectory log: step numbering and fast-forward after ``client.attach``.

Every call on a :class:`~dsec.client.Sandbox` handle carries a step id (1, 2, 3, ... per handle
unless given). The edge answers a step it has already completed with the recorded result
(header ``x-dsec-replayed: true``) instead of running it again, waits for a step that is still
running, and refuses (``conflict``) a step id reused for a different call.

``client.attach(sandbox_id)`` gives a handle whose numbering starts at 1 again and which
prefetches the completed steps in one request, so a restarted trainer replaying its script
fast-forwards through them locally; anything not answerable locally goes to the edge.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union


def shell_key(cmd: str, session: str, cwd: Optional[str], env: Optional[Mapping[str, str]], stdin: Any) -> Dict[str, Any]:
    if isinstance(stdin, (bytes, bytearray)):
        stdin = bytes(stdin).decode("utf-8")
    return {"cmd": cmd, "session": session, "cwd": cwd, "env": dict(env or {}), "stdin": stdin}


def exec_key(
    argv: Sequence[str], cwd: Optional[str], env: Optional[Mapping[str, str]], stdin: Union[str, bytes, None], user: Optional[str]
) -> Dict[str, Any]:
    data = stdin.encode("utf-8") if isinstance(stdin, str) else (bytes(stdin) if stdin else b"")
    return {
        "argv": [str(a) for a in argv],
        "cwd": cwd,
        "env": dict(env or {}),
        "stdin_b64": base64.b64encode(data).decode("ascii") if data else None,
        "user": user,
    }


def write_key(path: str, mode: int, data: bytes) -> Dict[str, Any]:
    return {"path": path, "mode": mode & 0o7777, "sha256": hashlib.sha256(data).hexdigest()}


def _completes(rec: Dict[str, Any]) -> bool:
    err = rec.get("error")
    if not err:
        return True
    code = err.get("code", "") if isinstance(err, dict) else ""
    return code not in ("internal", "node_full", "node_unavailable", "sandbox_busy", "unsupported")


class FastForward:
    """Completed steps of a sandbox, fetched once; answers only exact, fully recorded matches."""

    def __init__(self, records: List[Dict[str, Any]]):
        self.steps: Dict[int, Dict[str, Any]] = {}
        for rec in records:
            step = rec.get("step")
            if isinstance(step, int) and _completes(rec):
                self.steps[step] = rec

    def lookup(self, step: Optional[int], kind: str, key: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """The record answering this call locally, or ``None`` (ask the edge: it also detects
        conflicts and waits for running steps)."""
        if step is None:
            return None
        rec = self.steps.get(step)
        if rec is None or rec.get("kind") != kind or rec.get("key") != key:
            return None
        if not rec.get("ok") or rec.get("blobs"):
            return None
        return rec


class StepCounter:
    """Numbers a handle's calls 1, 2, 3, ...; an explicit step moves the counter past it."""

    def __init__(self) -> None:
        self.last = 0

    def next(self, step: Optional[int]) -> int:
        if step is None:
            self.last += 1
            return self.last
        step = int(step)
        self.last = max(self.last, step)
        return step


def content_of(rec: Dict[str, Any]) -> Optional[bytes]:
    result = rec.get("result") or {}
    b64 = result.get("content_b64")
    if isinstance(b64, str):
        return base64.b64decode(b64)
    if result.get("size") == 0:
        return b""
    return None
