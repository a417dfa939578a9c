"""Data types of the dsec API (mirrors ``crates/wire/src/api.rs``)."""

from __future__ import annotations

import base64
import binascii
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Dict, FrozenSet, List, Optional


def _b64(value: Any) -> Optional[bytes]:
    if not isinstance(value, str):
        return None
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None


_FIELD_NAMES: Dict[type, FrozenSet[str]] = {}


def _field_names(cls: type) -> FrozenSet[str]:
    """The dataclass's field names (cached: ``fields()`` is slow enough to matter per request)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = frozenset(f.name for f in fields(cls))
    return names


@dataclass
class DSecContainerRunArgs:
    """Arguments of :meth:`dsec.DSecClient.run_container` (body of ``POST /v1/sandboxes``).

    ``None`` fields are left out so that the node's defaults apply.
    """

    container_image: str
    memory_limit_mb: Optional[int] = None
    cpu_cores_limit: Optional[float] = None
    pids_limit: Optional[int] = None
    ttl_running_stop: Optional[int] = None
    ttl_total: Optional[int] = None
    #: What ``ttl_running_stop`` does when it fires: ``"stop"`` (default) or ``"pause"``.
    ttl_action: Optional[str] = None
    network_rules: Optional[Dict[str, bool]] = None
    init_user: Optional[str] = None
    hostname: Optional[str] = None
    env: Optional[Dict[str, str]] = None
    labels: Optional[Dict[str, str]] = None
    workspace: Optional[str] = None
    toolkits: Optional[List[str]] = None
    idempotency_key: Optional[str] = None
    #: ``{"mode": "allowlist"|"open"|"none", "rules": [{"cidr": ..., "ports": ..., "protocol": ...}]}``
    network: Optional[Dict[str, Any]] = None
    #: Paths kept read-only even to root inside (Landlock), e.g. ``["/tests", "/bin/bash"]``.
    protected_paths: Optional[List[str]] = None
    #: Size limit of the writable layer in MiB (ENOSPC past it).
    disk_limit_mb: Optional[int] = None
    #: Keep a trajectory log (default: the node's setting, on); ``False`` turns off logging and
    #: fast-forward for this sandbox.
    trajectory: Optional[bool] = None
    #: ``"container"`` (default), ``"microvm"`` (a QEMU guest with its own kernel) or ``"vm"``
    #: (a full VM; ``container_image`` then names a VM disk image, see :class:`DSecVMRunArgs`).
    substrate: Optional[str] = None
    #: QoS class: ``"latency_sensitive"`` (protected: normal CPU weight, never reclaimed or paused
    #: under memory pressure) or ``"best_effort"`` (SCHED_IDLE, lowest CPU weight, reclaimed
    #: first); default: the node's ``qos.default_class``.
    qos: Optional[str] = None
    #: TCP ports reachable through the apiserver without the API key or a signed URL
    #: (``sandbox.get_url(port, public=True)``); other ports need one of them.
    public_ports: Optional[List[int]] = None
    #: Seconds to wait in the apiserver's queue for a node with room instead of failing with
    #: ``node_full`` (the sandbox's ``queue`` then says how long it waited).
    wait_s: Optional[float] = None

    #: Volumes to mount: ``{"/data": "vol1"}`` (read-write) or
    #: ``{"/data": {"name": "vol1", "read_only": True}}`` (see :meth:`dsec.DSecClient.create_volume`).
    volumes: Optional[Dict[str, Any]] = None

    def to_json(self) -> Dict[str, Any]:
        """The JSON body of the create call (``container_image`` becomes ``image``)."""
        body: Dict[str, Any] = {"image": self.container_image}
        for f in fields(self):
            if f.name == "container_image":
                continue
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, dict):
                value = dict(value)
            elif isinstance(value, (list, tuple)):
                value = list(value)
            body[f.name] = value
        return body


@dataclass
class DSecMicroVMRunArgs(DSecContainerRunArgs):
    """Arguments of :meth:`dsec.DSecClient.run_microvm`: the same as a container's, run in a
    microVM (own kernel; the image's layers are the guest's root). ``memory_limit_mb`` is the
    guest's RAM, ``cpu_cores_limit`` rounded up its vCPUs."""

    substrate: Optional[str] = "microvm"


@dataclass
class DSecVMRunArgs:
    """Arguments of :meth:`dsec.DSecClient.run_vm`: a full VM booting the disk image ``image``
    (a name registered with ``dsec vm image import``, e.g. ``"debian"`` built by
    ``scripts/vm/build-disk.sh``) through the firmware, on a copy-on-write overlay.
    ``memory_limit_mb`` is the guest's RAM, ``cpu_cores_limit`` rounded up its vCPUs. The
    sandbox answers the same calls as a container (run_shell, exec, files, TTY, pause/resume,
    stop, trajectory) and takes the same ``network`` / ``network_rules`` (enforced on the host
    side of the VM's tap); layers (workspace, toolkits) and pack_diff are refused."""

    image: str
    memory_limit_mb: Optional[int] = None
    cpu_cores_limit: Optional[float] = None
    ttl_running_stop: Optional[int] = None
    ttl_total: Optional[int] = None
    ttl_action: Optional[str] = None
    hostname: Optional[str] = None
    labels: Optional[Dict[str, str]] = None
    idempotency_key: Optional[str] = None
    trajectory: Optional[bool] = None
    qos: Optional[str] = None
    #: Named domain groups of the edge's config to enable (``True``) or keep blocked (``False``).
    network_rules: Optional[Dict[str, bool]] = None
    #: ``{"mode": "allowlist"|"open"|"none", "rules": [...]}`` as for a container.
    network: Optional[Dict[str, Any]] = None

    def to_json(self) -> Dict[str, Any]:
        """The JSON body of the create call (with ``substrate: "vm"``)."""
        body: Dict[str, Any] = {"substrate": "vm"}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            body[f.name] = dict(value) if isinstance(value, dict) else value
        return body


#: Every end reason a sandbox can carry (``SandboxInfo.end_reason``).
END_REASONS = (
    "stopped_by_user",
    "ttl_idle",
    "ttl_total",
    "oom_killed_pid1",
    "node_lost",
    "edge_restart_not_adopted",
    "preempted",
    "memory_pressure",
    "quota_revoked",
    "internal_error",
)

#: The end reasons that mean the platform ended the sandbox, not the agent or its trainer.
INFRASTRUCTURE_END_REASONS = frozenset(
    ("node_lost", "edge_restart_not_adopted", "preempted", "memory_pressure", "quota_revoked", "internal_error")
)


@dataclass
class SandboxInfo:
    """What the platform knows about one sandbox."""

    id: str
    node: str = ""
    state: str = ""
    substrate: str = "container"
    image: str = ""
    memory_limit_mb: int = 0
    cpu_cores_limit: float = 0.0
    pids_limit: int = 0
    init_user: str = ""
    hostname: str = ""
    ttl_running_stop: Optional[int] = None
    ttl_total: Optional[int] = None
    network_rules: Dict[str, bool] = field(default_factory=dict)
    labels: Dict[str, str] = field(default_factory=dict)
    created_at: str = ""
    create_ms: Optional[float] = None
    reason: Optional[str] = None
    ttl_action: str = "stop"
    #: RFC 3339 time of the last request (the idle clock).
    last_request_at: Optional[str] = None
    #: RFC 3339 time the sandbox was paused (while paused).
    paused_at: Optional[str] = None
    #: Memory report of the last pause: ``memory_before_bytes``, ``memory_after_bytes``,
    #: ``page_cache_before_bytes``, ``page_cache_after_bytes``, ``anon_before_bytes``,
    #: ``anon_after_bytes``, ``method``, ``pause_ms``, ``snapshot_bytes`` (VMs: size of the
    #: memory + device snapshot on disk; ``None`` for containers).
    last_pause: Optional[Dict[str, Any]] = None
    #: QoS class the sandbox runs in (``latency_sensitive`` or ``best_effort``).
    qos: str = "latency_sensitive"
    #: How a microVM started: ``cold``, ``template`` (restored from a template snapshot of its
    #: shape) or ``cold-fallback``; ``None`` for containers and full VMs.
    boot: Optional[str] = None
    #: Why the sandbox ended (``stopped``/``failed`` only): one of :data:`END_REASONS`.
    end_reason: Optional[str] = None
    #: What exactly happened (e.g. an internal error's cause).
    end_detail: Optional[str] = None
    #: Ports open through the apiserver without credentials (``public_ports`` at create).
    public_ports: List[int] = field(default_factory=list)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ended_by_infrastructure(self) -> bool:
        """True when the platform, not the agent or its trainer, ended the sandbox (a rollout
        to mask): see :data:`INFRASTRUCTURE_END_REASONS`."""
        return self.end_reason in INFRASTRUCTURE_END_REASONS

    @classmethod
    def from_json(cls, doc: Dict[str, Any]) -> "SandboxInfo":
        known = _field_names(cls) - {"raw"}
        kwargs = {k: v for k, v in doc.items() if k in known and v is not None}
        for key in ("network_rules", "labels"):
            if key in kwargs and not isinstance(kwargs[key], dict):
                kwargs.pop(key)
        info = cls(**kwargs)
        info.raw = dict(doc)
        return info


@dataclass
class ShellResult:
    """Result of a shell command or exec.

    ``stdout``/``stderr`` are text (invalid UTF-8 replaced); :attr:`stdout_bytes` and
    :attr:`stderr_bytes` give the exact bytes.
    """

    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0
    signal: Optional[int] = None
    duration_ms: float = 0.0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False
    oom_killed: bool = False
    session_restarted: bool = False
    stdout_total_bytes: int = 0
    stderr_total_bytes: int = 0
    stdout_b64: Optional[str] = field(default=None, repr=False)
    stderr_b64: Optional[str] = field(default=None, repr=False)
    #: Answered from the trajectory log: this step had already run (nothing ran again).
    replayed: bool = False

    @classmethod
    def from_json(cls, doc: Dict[str, Any]) -> "ShellResult":
        known = _field_names(cls)
        return cls(**{k: v for k, v in doc.items() if k in known and v is not None})

    @property
    def stdout_bytes(self) -> bytes:
        exact = _b64(self.stdout_b64)
        return exact if exact is not None else self.stdout.encode("utf-8")

    @property
    def stderr_bytes(self) -> bytes:
        exact = _b64(self.stderr_b64)
        return exact if exact is not None else self.stderr.encode("utf-8")

    @property
    def ok(self) -> bool:
        """True when the command exited 0 and was not killed or timed out."""
        return self.exit_code == 0 and not self.timed_out and self.signal is None

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def __repr__(self) -> str:
        def cut(text: str) -> str:
            return repr(text) if len(text) <= 200 else f"{text[:200]!r}...(+{len(text) - 200} chars)"

        flags = [n for n in ("timed_out", "oom_killed", "stdout_truncated", "stderr_truncated", "session_restarted")
                 if getattr(self, n)]
        return (
            f"ShellResult(exit_code={self.exit_code}, signal={self.signal}, stdout={cut(self.stdout)}, "
            f"stderr={cut(self.stderr)}, duration_ms={self.duration_ms:.1f}, flags={flags})"
        )


@dataclass
class StreamEvent:
    """One event of a streamed command.

    ``type`` is ``"stdout"``, ``"stderr"`` or ``"exit"``. Output events carry ``data`` (exact
    bytes) and ``text`` (UTF-8, invalid sequences replaced); the ``exit`` event carries ``result``
    (whose stdout/stderr are empty: the output came in the earlier events).
    """

    type: str
    data: bytes = b""
    text: str = ""
    result: Optional[ShellResult] = None

    @classmethod
    def from_json(cls, doc: Dict[str, Any]) -> "StreamEvent":
        kind = doc.get("type")
        if kind in ("stdout", "stderr"):
            text = doc.get("data") if isinstance(doc.get("data"), str) else ""
            exact = _b64(doc.get("data_b64"))
            return cls(type=kind, data=exact if exact is not None else text.encode("utf-8"), text=text)
        if kind == "exit":
            result = doc.get("result") if isinstance(doc.get("result"), dict) else {}
            return cls(type="exit", result=ShellResult.from_json(result))
        return cls(type=str(kind))


@dataclass
class FileInfo:
    """A file's metadata inside a sandbox. ``kind`` is file, dir, symlink or other."""

    path: str
    name: str = ""
    kind: str = "file"
    size: int = 0
    mode: int = 0
    uid: int = 0
    gid: int = 0
    mtime: int = 0
    link_target: Optional[str] = None

    @classmethod
    def from_json(cls, doc: Dict[str, Any]) -> "FileInfo":
        known = _field_names(cls)
        return cls(**{k: v for k, v in doc.items() if k in known and v is not None})

    @property
    def is_dir(self) -> bool:
        return self.kind == "dir"

    @property
    def is_file(self) -> bool:
        return self.kind == "file"


@dataclass
class ImageInfo:
    """An image on a node."""

    name: str
    layers: List[Dict[str, Any]] = field(default_factory=list)
    size_bytes: int = 0
    created_at: str = ""
    in_use: int = 0
    parent: Optional[str] = None
    source: Optional[str] = None

    @classmethod
    def from_json(cls, doc: Dict[str, Any]) -> "ImageInfo":
        known = _field_names(cls)
        return cls(**{k: v for k, v in doc.items() if k in known and v is not None})


@dataclass
class JobOpResult:
    """Answer of a job-level operation (:meth:`dsec.DSecClient.pause` and friends)."""

    matched: int = 0
    succeeded: int = 0
    #: ``[{"id": ..., "error": {"code": ..., "message": ...}}, ...]``
    failed: List[Dict[str, Any]] = field(default_factory=list)
    sandboxes: List[str] = field(default_factory=list)
    unreachable_nodes: List[str] = field(default_factory=list)
    duration_ms: float = 0.0

    @classmethod
    def from_json(cls, doc: Dict[str, Any]) -> "JobOpResult":
        known = _field_names(cls)
        return cls(**{k: v for k, v in doc.items() if k in known and v is not None})
