//! What running QEMU can fail with: starting, adopting, restoring and killing a VM
//! ([`VmError`]) and wiring a VM's NIC into the sandbox's network namespace ([`VmNetError`]).

use std::io;
use std::path::PathBuf;

use super::net::NETNS_RUN_DIR;
use super::qmp::QmpError;

/// Starting, adopting, restoring or killing one QEMU process failed.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// A file or socket step around the process (`what` names it: `open qemu.log`,
    /// `read args.json`, `socketpair`, ...).
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    /// The VM's launch record could not be written or read back.
    #[error("{what}: {source}")]
    Launch {
        what: String,
        source: serde_json::Error,
    },
    #[error("start {}: {source}", binary.display())]
    Spawn { binary: PathBuf, source: io::Error },
    #[error("connect the aether channel: {0}")]
    Channel(io::Error),
    #[error("QEMU did not open the aether channel socket within 30 s")]
    NoChannel,
    /// QEMU ended before it opened the channel (it refused its command line or crashed):
    /// its exit status and the last lines of its log.
    #[error("QEMU exited at start ({status}): {log}")]
    ExitedAtStart { status: String, log: String },
    #[error(transparent)]
    Net(#[from] VmNetError),
    #[error("no snapshot in {}", .0.display())]
    NoSnapshot(PathBuf),
    #[error("no overlay disk in {}", .0.display())]
    NoOverlay(PathBuf),
    #[error("QEMU (pid {0}) did not exit after SIGKILL")]
    KillTimeout(i32),
    #[error("relay task: {0}")]
    RelayTask(#[from] tokio::task::JoinError),
    #[error(transparent)]
    Qmp(#[from] QmpError),
    #[error("restore did not finish in 600 s")]
    RestoreTimeout,
    #[error("restore failed: {0}")]
    RestoreFailed(String),
    #[error("QEMU exited during the restore ({0})")]
    ExitedDuringRestore(String),
    /// A restore failed and QEMU was ended: why, and the last lines of its log.
    #[error("{source}; qemu: {log}")]
    Restore { source: Box<VmError>, log: String },
    #[error("cont after restore: {0}")]
    Cont(QmpError),
}

impl VmError {
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        VmError::Io {
            what: what.into(),
            source,
        }
    }
}

/// Turning the sandbox's network namespace into a switch for a VM's tap (or entering it to
/// start QEMU) failed.
#[derive(Debug, thiserror::Error)]
pub enum VmNetError {
    /// A file step (`what` names it).
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    #[error("the sandbox's network namespace has no name under {NETNS_RUN_DIR}")]
    Unnamed,
    #[error("bad namespace path {}", .0.display())]
    BadPath(PathBuf),
    /// `ip` ran and failed: the namespace, the command and what it said.
    #[error("ip -n {ns} {command}: {stderr}")]
    Ip {
        ns: String,
        command: String,
        stderr: String,
    },
    #[error("parse `{command}`: {source}")]
    Parse {
        command: &'static str,
        source: serde_json::Error,
    },
    #[error("no {0} in the sandbox's namespace")]
    NoLink(&'static str),
    #[error("{0} has no IPv4 address")]
    NoIpv4(&'static str),
    #[error("no default IPv4 route in the sandbox's namespace")]
    NoGateway,
    #[error("{0}: the path contains a NUL byte")]
    Nul(&'static str),
    #[error("the VM's network namespace {0} is gone")]
    Gone(String),
}

impl VmNetError {
    pub(crate) fn io(what: impl Into<String>, source: io::Error) -> Self {
        VmNetError::Io {
            what: what.into(),
            source,
        }
    }
}
