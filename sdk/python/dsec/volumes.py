"""Named persistent volumes (issue 18): an ext4 file system of a fixed size kept on one node,
owned by a project, mounted into sandboxes at create.

```python
async with DSecClient() as client:
    await client.create_volume("cache", size_mb=512)
    sb = await client.create(container_image="debian", volumes={"/data": "cache"})
    ro = await client.create(container_image="debian",
                             volumes={"/data": {"name": "cache", "read_only": True}})
    await client.delete_volume("cache")      # VolumeInUse (409) while a sandbox mounts it
```

Writes past ``size_mb`` fail with ENOSPC inside the sandbox; a read-only mount with EROFS.
A sandbox using a volume is placed on the volume's node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional
from urllib.parse import quote


@dataclass
class VolumeInfo:
    id: str
    name: str
    project: str
    node: str
    size_mb: int
    created_at: str = ""
    #: Live sandboxes that have it mounted (filled by :meth:`get_volume`).
    used_by: List[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "VolumeInfo":
        return cls(
            id=str(d.get("id", "")),
            name=str(d.get("name", "")),
            project=str(d.get("project", "")),
            node=str(d.get("node", "")),
            size_mb=int(d.get("size_mb", 0)),
            created_at=str(d.get("created_at", "")),
            used_by=list(d.get("used_by") or []),
        )


def _params(project: Optional[str]) -> Optional[Dict[str, str]]:
    return {"project": project} if project is not None else None


class VolumesMixin:
    """Volume methods of :class:`dsec.DSecClient`."""

    async def create_volume(self, name: str, size_mb: int, *, project: Optional[str] = None,
                            node: Optional[str] = None, timeout: float = 120.0) -> VolumeInfo:
        body: Dict[str, Any] = {"name": name, "size_mb": size_mb}
        if project is not None:
            body["project"] = project
        if node is not None:
            body["node"] = node
        resp = await self._request("POST", "/v1/volumes", json_body=body, timeout=timeout)  # type: ignore[attr-defined]
        return VolumeInfo.from_json(self._json(resp))  # type: ignore[attr-defined]

    async def list_volumes(self, *, project: Optional[str] = None) -> List[VolumeInfo]:
        resp = await self._request("GET", "/v1/volumes", params=_params(project))  # type: ignore[attr-defined]
        doc = self._json(resp)  # type: ignore[attr-defined]
        return [VolumeInfo.from_json(v) for v in doc.get("volumes", []) if isinstance(v, dict)]

    async def get_volume(self, name: str, *, project: Optional[str] = None) -> VolumeInfo:
        resp = await self._request("GET", f"/v1/volumes/{quote(name, safe='')}",  # type: ignore[attr-defined]
                                   params=_params(project))
        return VolumeInfo.from_json(self._json(resp))  # type: ignore[attr-defined]

    async def delete_volume(self, name: str, *, project: Optional[str] = None, timeout: float = 120.0) -> None:
        """Deletes the volume and its data; :class:`dsec.Conflict` (409, naming the sandboxes)
        while a sandbox has it mounted."""
        await self._request("DELETE", f"/v1/volumes/{quote(name, safe='')}",  # type: ignore[attr-defined]
                            params=_params(project), timeout=timeout)


class SyncVolumesMixin:
    """The same methods for :class:`dsec.sync.DSecClient`."""

    def create_volume(self, name: str, size_mb: int, **kw: Any) -> VolumeInfo:
        return self._run(self._aclient.create_volume(name, size_mb, **kw))  # type: ignore[attr-defined]

    def list_volumes(self, **kw: Any) -> List[VolumeInfo]:
        return self._run(self._aclient.list_volumes(**kw))  # type: ignore[attr-defined]

    def get_volume(self, name: str, **kw: Any) -> VolumeInfo:
        return self._run(self._aclient.get_volume(name, **kw))  # type: ignore[attr-defined]

    def delete_volume(self, name: str, **kw: Any) -> None:
        return self._run(self._aclient.delete_volume(name, **kw))  # type: ignore[attr-defined]
