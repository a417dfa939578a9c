//! The runtime's errors, one enum per operation that can fail, shared by every substrate (a
//! container, a microVM and a full VM pause, resume and re-adopt through the same types).
//! Create and destroy errors are [`crate::substrate::CreateSandboxError`] and
//! [`crate::substrate::DestroySandboxError`].

use std::io;
use std::path::PathBuf;

use crate::cgroup::CgroupError;

/// Pausing or resuming a sandbox failed.
#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    /// A container's cgroup could not be frozen.
    #[error("freeze sandbox {id}: {source}")]
    Freeze { id: String, source: CgroupError },
    /// A container's cgroup could not be thawed.
    #[error("thaw sandbox {id}: {source}")]
    Thaw { id: String, source: CgroupError },
    /// Pause of a sandbox that is paused already.
    #[error("sandbox {id} is already paused")]
    AlreadyPaused { id: String },
    /// The sandbox's VM ended (on its own, or by a failed pause or resume).
    #[error("sandbox {id} is gone")]
    Gone { id: String },
    /// Restoring a VM from its snapshot failed.
    #[error("restore sandbox {id}: {source}")]
    Restore {
        id: String,
        source: crate::qemu::VmError,
    },
    /// Any other step of a pause or resume (snapshot, reclaim, the blocking task).
    #[error("pause task: {0}")]
    Task(String),
}

/// Re-attaching to a sandbox left by an earlier edge failed.
#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("sandbox {id}: its agent (pid {pid}) is gone")]
    Gone { id: String, pid: i32 },
    #[error("sandbox {id}: pid {pid} is not its agent any more (pid reused)")]
    NotOurs { id: String, pid: i32 },
    #[error("sandbox {id}: connect to {path}: {source}")]
    Connect {
        id: String,
        path: PathBuf,
        source: io::Error,
    },
    #[error("sandbox {id}: the agent did not answer the reattach: {reason}")]
    NoReady { id: String, reason: String },
    #[error("sandbox {id}: {what}: {source}")]
    Io {
        id: String,
        what: String,
        source: io::Error,
    },
    /// A paused VM's directory cannot be adopted (its snapshot or launch record is missing or
    /// unreadable).
    #[error("sandbox {id}: adopt the paused VM: {source}")]
    PausedVm {
        id: String,
        source: crate::qemu::VmError,
    },
}
