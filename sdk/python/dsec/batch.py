"""Burst queueing: the queue report of a create with ``wait_s`` and batches (``create_many``).

A create with ``wait_s=N`` waits up to N seconds in the apiserver's queue (FIFO per project,
projects served in turn) for a node with room instead of failing with ``node_full``; its sandbox's
:attr:`Sandbox.queue` says how long it waited. :meth:`DSecClient.create_many` submits a batch of
creates of one shape that are placed as capacity frees; :class:`Batch` reads its progress and
cancels it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Union

from .errors import DSecError
from .types import DSecContainerRunArgs

if TYPE_CHECKING:  # pragma: no cover
    from .client import DSecClient


@dataclass
class QueueReport:
    """How a create with ``wait_s`` went through the apiserver's queue."""

    #: Milliseconds from arrival at the apiserver until the create was sent to a node.
    waited_ms: float = 0.0
    #: Arrival number of the create within its project (FIFO order).
    ticket: int = 0
    #: Order in which the queue let the successful attempt go (over every project).
    dispatched: int = 0
    #: Attempts it took (an attempt that found no room puts the create back in its place).
    attempts: int = 0

    @classmethod
    def from_json(cls, doc: Optional[Mapping[str, Any]]) -> Optional["QueueReport"]:
        if not isinstance(doc, Mapping):
            return None
        return cls(
            waited_ms=float(doc.get("waited_ms", 0.0)),
            ticket=int(doc.get("ticket", 0)),
            dispatched=int(doc.get("dispatched", 0)),
            attempts=int(doc.get("attempts", 0)),
        )


@dataclass
class BatchStatus:
    """Progress of a batch (``GET /v1/batches/{id}``)."""

    id: str
    #: ``running``, ``done`` or ``cancelled``.
    state: str
    count: int
    placed: int = 0
    queued: int = 0
    failed: int = 0
    cancelled: int = 0
    #: Ids of the placed sandboxes, in the order they were placed.
    sandbox_ids: List[str] = field(default_factory=list)
    #: Error code -> count of the failed creates.
    errors: Dict[str, int] = field(default_factory=dict)
    last_error: Optional[str] = None
    created_at: str = ""

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "BatchStatus":
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in doc.items() if k in names and v is not None})


class Batch:
    """A submitted batch: :meth:`refresh` reads its progress, :meth:`wait` until it is done,
    :meth:`cancel` drops its creates still queued (placed sandboxes keep running)."""

    def __init__(self, client: "DSecClient", status: BatchStatus):
        self._client = client
        self.status = status

    @property
    def id(self) -> str:
        return self.status.id

    async def refresh(self) -> BatchStatus:
        resp = await self._client._request("GET", f"/v1/batches/{self.id}")
        self.status = BatchStatus.from_json(self._client._json(resp))
        return self.status

    async def wait(self, timeout: float = 3600.0, poll: float = 0.5) -> BatchStatus:
        """Polls until no create of the batch is queued any more (``timeout`` s at most)."""
        deadline = time.monotonic() + timeout
        while True:
            st = await self.refresh()
            if st.state != "running":
                return st
            if time.monotonic() > deadline:
                raise DSecError(
                    f"batch {self.id} still running after {timeout:g} s "
                    f"({st.placed} placed, {st.queued} queued, {st.failed} failed)",
                    code="timeout",
                )
            await asyncio.sleep(poll)

    async def cancel(self) -> BatchStatus:
        resp = await self._client._request("DELETE", f"/v1/batches/{self.id}")
        self.status = BatchStatus.from_json(self._client._json(resp))
        return self.status


def batch_body(
    args: Union[DSecContainerRunArgs, Mapping[str, Any]],
    n: int,
    labels: Optional[Mapping[str, str]],
    wait_s: Optional[float],
) -> Dict[str, Any]:
    """The body of ``POST /v1/batches``."""
    req = args.to_json() if isinstance(args, DSecContainerRunArgs) else dict(args)
    if "container_image" in req and "image" not in req:
        req["image"] = req.pop("container_image")
    req.pop("wait_s", None)
    body: Dict[str, Any] = {"request": req, "count": int(n)}
    if labels:
        body["labels"] = dict(labels)
    if wait_s is not None:
        body["wait_s"] = float(wait_s)
    return body
