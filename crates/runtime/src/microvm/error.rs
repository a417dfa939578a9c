//! What the microVM substrate's own steps fail with (QEMU's are [`crate::qemu::VmError`]).

use std::io;
use std::path::PathBuf;

use crate::qemu::qmp::QmpError;
use crate::qemu::VmError;

/// The guest artefacts (kernel, initramfs) are not built.
#[derive(Debug, Clone, thiserror::Error)]
#[error("the microVM guest is not built ({} is missing): run scripts/vm/build-guest.sh", .0.display())]
pub struct GuestNotBuilt(pub PathBuf);

/// A mounted image layer that cannot be handed to a guest as files.
#[derive(Debug, thiserror::Error)]
pub enum GuestLayerError {
    #[error("layer mount {} is not named by a digest", .0.display())]
    NotADigest(PathBuf),
    #[error("layer mount {} is not inside an image store", .0.display())]
    NotInStore(PathBuf),
    #[error("layer {digest}: metadata image {} not found", meta.display())]
    NoMetadata { digest: String, meta: PathBuf },
}

/// A host tool (`cp`, `mount`, `umount`) run by the substrate failed.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("run {tool}: {source}")]
    Run { tool: String, source: io::Error },
    /// It ran and failed: the command and what it said.
    #[error("{command}: {stderr}")]
    Failed { command: String, stderr: String },
}

/// Starting a microVM from its shape's template, or building that template, failed.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// A file step (`what` names it).
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    #[error(transparent)]
    Copy(#[from] ToolError),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error("host randomness: {0}")]
    Seed(io::Error),
    #[error("set the guest's identity: {0}")]
    Identity(String),
    #[error("{0}")]
    Layers(String),
    /// The template VM's cold boot failed: why, and the tail of its console.
    #[error("{reason}; guest console: {console}")]
    Boot { reason: String, console: String },
    #[error("snapshot the template VM: {0}")]
    Snapshot(crate::error::PauseError),
    #[error("the edge is stopping")]
    Stopping,
    #[error("encode the template's metadata: {0}")]
    Meta(serde_json::Error),
}

impl TemplateError {
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        TemplateError::Io {
            what: what.into(),
            source,
        }
    }
}

/// Stopping or continuing a running guest's vCPUs, or mounting its writable disk on the host,
/// failed.
#[derive(Debug, thiserror::Error)]
pub enum UpperError {
    #[error("the VM is not running")]
    NotRunning,
    #[error(transparent)]
    Qmp(#[from] QmpError),
    #[error(transparent)]
    Tool(#[from] ToolError),
    #[error("{what} {}: {source}", path.display())]
    Dir {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("continue the guest: {0}")]
    Continue(QmpError),
    /// Several steps of a release failed.
    #[error("{}", .0.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))]
    Several(Vec<UpperError>),
}
