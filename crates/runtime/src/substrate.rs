//! The substrate trait: what every kind of sandbox (container, microVM, VM) offers the edge.
//!
//! The edge owns records, images and the HTTP API; a substrate only builds, watches and
//! destroys the isolated environment and hands back an [`AetherClient`] to talk to its agent.

use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::aether_client::AetherClient;

/// Everything a substrate needs to build one sandbox.
#[derive(Debug, Clone, Default)]
pub struct SandboxSpec {
    pub id: String,
    pub hostname: String,
    /// Mounted read-only layer roots on the host, top-most first.
    pub lowers: Vec<PathBuf>,
    /// The sandbox's own directory on the host (upper, work, rootfs and records live below it).
    pub dir: PathBuf,
    pub memory_limit_mb: u64,
    pub cpu_cores_limit: f64,
    pub pids_limit: u64,
    pub user: String,
    pub env: BTreeMap<String, String>,
    /// A network namespace prepared by the edge (veth, addresses) that the sandbox joins instead
    /// of getting an empty one with only loopback.
    pub netns: Option<std::sync::Arc<std::os::fd::OwnedFd>>,
    /// Paths inside the sandbox kept read-only even to root (Landlock).
    pub protected_paths: Vec<String>,
    /// Size limit of the sandbox's writable layer in MiB when the request set one (or the
    /// edge has a default). A container gets a loop-mounted file system of that size
    /// ([`crate::container::disk`]); a microVM sizes its writable disk (`upper.img`) with it.
    pub disk_limit_mb: Option<u64>,
}

/// Resource usage of a running sandbox.
#[derive(Debug, Clone, Default)]
pub struct Usage {
    pub memory_bytes: u64,
    pub pids: u64,
    /// How many times the memory limit OOM-killed a process in this sandbox.
    pub oom_kills: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CreateSandboxError {
    #[error("invalid sandbox spec: {0}")]
    InvalidSpec(String),
    #[error("create cgroup for {id}: {source}")]
    Cgroup { id: String, source: std::io::Error },
    #[error("start the sandbox's agent: {0}")]
    Spawn(std::io::Error),
    #[error("sandbox setup failed inside: {0}")]
    Setup(String),
    #[error(transparent)]
    DiskLimit(#[from] crate::container::disk::DiskLimitError),
    #[error("sandbox {id}: {error}; cleanup also failed: {cleanup}")]
    WithCleanup {
        id: String,
        error: Box<CreateSandboxError>,
        cleanup: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum DestroySandboxError {
    #[error("destroy {id}: {what}: {source}")]
    Io {
        id: String,
        what: String,
        source: std::io::Error,
    },
}

/// A live sandbox as the substrate sees it.
pub trait Sandbox: Send + Sync {
    fn id(&self) -> &str;
    /// The channel to the sandbox's aether.
    fn aether(&self) -> &AetherClient;
    /// Host pid of the sandbox's init (aether or the VM process).
    fn pid(&self) -> i32;
    fn usage(&self) -> Usage;
}

/// A kind of sandbox.
#[allow(async_fn_in_trait)]
pub trait Substrate: Send + Sync {
    type Sandbox: Sandbox;

    fn name(&self) -> &'static str;

    /// Builds and starts a sandbox; on error everything built so far is removed.
    async fn create(&self, spec: SandboxSpec) -> Result<Self::Sandbox, CreateSandboxError>;

    /// Kills everything in the sandbox and removes every kernel object and directory the
    /// substrate created for it. Idempotent.
    async fn destroy(&self, sandbox: &Self::Sandbox) -> Result<(), DestroySandboxError>;

    /// Removes leftovers of sandboxes this substrate created in an earlier run of the edge
    /// (after a crash): processes, cgroups, directories. Returns the ids it cleaned.
    async fn reap_orphans(&self, known_live: &[String]) -> Vec<String>;
}
