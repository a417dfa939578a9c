"""Cluster membership (issue 22, admin): cordon, uncordon and drain nodes, issue join tokens.

```python
async with DSecClient() as client:
    token = await client.create_join_token()   # for `dsec edge --join URL --token TOKEN`
    for n in await client.list_nodes():
        print(n["node"], n["membership"]["state"])   # healthy, suspect, lost, cordoned, ...
    await client.cordon_node("n2")                   # no new placements on n2
    r = await client.drain_node("n2", policy="stop") # then stop (or pause) its sandboxes
    print(r["stopped"], r["state"])                  # [...] drained
```
"""

from __future__ import annotations

from typing import Any, Dict
from urllib.parse import quote

DRAIN_POLICIES = ("pause", "stop")


def _node(node_id: str) -> str:
    return quote(node_id, safe="")


class NodesMixin:
    """Membership methods of :class:`dsec.DSecClient` (admin keys)."""

    async def cordon_node(self, node_id: str) -> Dict[str, Any]:
        """No new placements on the node; its sandboxes run on."""
        resp = await self._request("POST", f"/v1/nodes/{_node(node_id)}/cordon")  # type: ignore[attr-defined]
        return self._json(resp)  # type: ignore[attr-defined]

    async def uncordon_node(self, node_id: str) -> Dict[str, Any]:
        """Placements again (also after a drain)."""
        resp = await self._request("POST", f"/v1/nodes/{_node(node_id)}/uncordon")  # type: ignore[attr-defined]
        return self._json(resp)  # type: ignore[attr-defined]

    async def drain_node(self, node_id: str, policy: str = "pause", timeout: float = 600.0) -> Dict[str, Any]:
        """No new placements, then every live sandbox paused (``pause``) or stopped (``stop``);
        the answer lists them (``paused``, ``stopped``, ``failed``) and the node's ``state``."""
        if policy not in DRAIN_POLICIES:
            raise ValueError(f"policy must be one of {DRAIN_POLICIES}, not {policy!r}")
        resp = await self._request(  # type: ignore[attr-defined]
            "POST", f"/v1/nodes/{_node(node_id)}/drain", json_body={"policy": policy}, timeout=timeout
        )
        return self._json(resp)  # type: ignore[attr-defined]

    async def create_join_token(self) -> str:
        """A cluster join token for ``dsec edge --join URL --token TOKEN`` (shown once)."""
        resp = await self._request("POST", "/v1/nodes/tokens")  # type: ignore[attr-defined]
        return self._json(resp)["token"]  # type: ignore[attr-defined]


class SyncNodesMixin:
    """The same methods for :class:`dsec.sync.DSecClient`."""

    def cordon_node(self, node_id: str) -> Dict[str, Any]:
        return self._run(self._aclient.cordon_node(node_id))  # type: ignore[attr-defined]

    def uncordon_node(self, node_id: str) -> Dict[str, Any]:
        return self._run(self._aclient.uncordon_node(node_id))  # type: ignore[attr-defined]

    def drain_node(self, node_id: str, policy: str = "pause", timeout: float = 600.0) -> Dict[str, Any]:
        return self._run(self._aclient.drain_node(node_id, policy, timeout))  # type: ignore[attr-defined]

    def create_join_token(self) -> str:
        return self._run(self._aclient.create_join_token())  # type: ignore[attr-defined]
