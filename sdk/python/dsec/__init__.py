"""Python SDK of dsec, an elastic sandbox platform for agentic RL.

```python
from dsec import DSecClient, DSecContainerRunArgs

client = DSecClient()            # DSEC_API_URL / DSEC_API_KEY
await client.open()
sandbox = await client.run_container(DSecContainerRunArgs(container_image="debian"), timeout=120)
result = await sandbox.run_shell("echo hello world")
await sandbox.stop()
```

A synchronous client with the same methods is in :mod:`dsec.sync`.
"""

from .batch import Batch, BatchStatus, QueueReport
from .client import DSecClient, Sandbox
from .errors import (
    BadRequest,
    CommandTimeout,
    Conflict,
    DSecError,
    FileNotFound,
    Forbidden,
    ImageNotFound,
    NodeFull,
    NodeUnavailable,
    NotFound,
    PortUnreachable,
    PayloadTooLarge,
    QuotaExceeded,
    SandboxBusy,
    ForkFailed,
    SandboxDead,
    SandboxEnded,
    SandboxNotFound,
    TransportError,
    Unauthorized,
    Unsupported,
)
from .functions import FunctionResult, RunResult
from .processes import MetricsSample, ProcessEvent, ProcessHandle, ProcessInfo, ProcessOutput
from .watch import FsEvent, Watcher
from .volumes import VolumeInfo
from .types import DSecContainerRunArgs, DSecMicroVMRunArgs, DSecVMRunArgs, FileInfo, ImageInfo, JobOpResult, SandboxInfo, ShellResult, StreamEvent

__version__ = "0.1.0"

__all__ = [
    "BadRequest",
    "Batch",
    "BatchStatus",
    "CommandTimeout",
    "Conflict",
    "DSecClient",
    "DSecContainerRunArgs",
    "DSecMicroVMRunArgs",
    "DSecVMRunArgs",
    "DSecError",
    "FileInfo",
    "FileNotFound",
    "FsEvent",
    "FunctionResult",
    "Forbidden",
    "ImageInfo",
    "ImageNotFound",
    "JobOpResult",
    "MetricsSample",
    "NodeFull",
    "NodeUnavailable",
    "NotFound",
    "PortUnreachable",
    "PayloadTooLarge",
    "ProcessEvent",
    "ProcessHandle",
    "ProcessInfo",
    "ProcessOutput",
    "QueueReport",
    "QuotaExceeded",
    "RunResult",
    "Sandbox",
    "SandboxBusy",
    "ForkFailed",
    "SandboxDead",
    "SandboxEnded",
    "SandboxInfo",
    "SandboxNotFound",
    "ShellResult",
    "StreamEvent",
    "TransportError",
    "Unauthorized",
    "Unsupported",
    "VolumeInfo",
    "Watcher",
]
