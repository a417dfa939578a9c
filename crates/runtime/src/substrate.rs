//! The one substrate interface: what every kind of sandbox (container, microVM, full VM)
//! offers the edge.
//!
//! The edge owns records, images, admission and the HTTP API; a substrate only builds, watches,
//! pauses and destroys the isolated environment and hands back an [`AetherClient`] to talk to
//! its agent. The edge holds every substrate as an `Arc<dyn Substrate>` and every sandbox as a
//! `Box<dyn LiveSandbox>`; what differs between substrates (where the root file system comes
//! from, whether `pack_diff` works, how a disk limit is enforced, ...) is a [`Capabilities`]
//! value the edge queries instead of branching on the substrate's kind.
//!
//! Implementations, one file per substrate: [`crate::container::substrate`],
//! [`crate::microvm::substrate`], [`crate::fullvm::substrate`] (the VM half both QEMU
//! substrates share is [`vm`]). Adding a substrate means one such module plus one line in the
//! edge's registry.
//!
//! The traits box their futures (`Send`) so that they are object safe and usable from any
//! tokio task.

pub mod vm;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;

use dsec_wire::api::{CreateSandboxRequest, PauseReport};

use crate::aether_client::AetherClient;
use crate::error::{AdoptError, PauseError};
use crate::fullvm::FullVmConfig;
use crate::microvm::template::TemplateConfig;
use crate::microvm::MicroVmConfig;

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
    /// Files the edge puts into the sandbox's writable layer before it starts (the network's
    /// `etc/resolv.conf`). The substrate writes them once that layer exists, so they land on
    /// the disk limit's file system when there is one; a substrate whose writable layer is
    /// not `<dir>/upper` on the host (a VM's disk) ignores them.
    pub layer_files: Vec<LayerFile>,
    /// Host directories bound into the sandbox (volumes, mounted on the host by the edge);
    /// only given to a substrate whose [`Capabilities::volume_binds`] is true.
    pub binds: Vec<BindMount>,
}

/// One host directory bound into a sandbox ([`SandboxSpec::binds`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindMount {
    /// Absolute host path (a directory on the volume's mounted file system).
    pub source: PathBuf,
    /// Absolute, normalised path inside the sandbox (made if missing, never through a symlink).
    pub target: String,
    pub read_only: bool,
}

/// One file of [`SandboxSpec::layer_files`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerFile {
    /// Relative to the sandbox's root, without `..` (`etc/resolv.conf`).
    pub path: String,
    pub contents: Vec<u8>,
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
    #[error("write {path} into the sandbox's writable layer: {source}")]
    LayerFile {
        path: PathBuf,
        source: std::io::Error,
    },
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

/// A boxed `Send` future: what the object-safe substrate traits return.
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where a substrate's root file system comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageSource {
    /// Layers of the node's image store (`image` + `workspace` + `toolkits`), leased and
    /// mounted by the edge; [`SandboxSpec::lowers`] holds the mounted layer roots.
    Layers,
    /// A disk image the substrate resolves itself ([`Substrate::resolve_disk_image`]);
    /// [`SandboxSpec::lowers`] holds that one file and no layer lease is taken.
    DiskImage,
}

/// How a substrate enforces a sandbox's `disk_limit_mb`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskLimit {
    /// The edge puts the sandbox's writable layer on a size-limited file system of its own on
    /// the host before the create.
    HostFileSystem,
    /// The substrate sizes the sandbox's own writable disk from [`SandboxSpec::disk_limit_mb`].
    OwnDisk,
    /// Not supported ([`Substrate::check_request`] refuses a request that sets one).
    Unsupported,
}

/// What a substrate can do, for the edge to decide by instead of by the substrate's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    pub image_source: ImageSource,
    /// `pack_diff` can turn a sandbox's writable layer into a layer of the image store (the
    /// upper dir at `<sandbox dir>/upper`, or what [`LiveSandbox::writable_layer`] exposes).
    pub pack_diff: bool,
    pub disk_limit: DiskLimit,
    /// [`CreateOptions::sched_idle`] is honoured: the agent starts SCHED_IDLE, so any process
    /// of a best-effort sandbox found not idle afterwards is worth a warning.
    pub sched_idle_at_spawn: bool,
    /// Pause ends the sandbox's process (a snapshot on disk keeps its state): a paused
    /// sandbox has no pid and is re-adopted from its directory after an edge restart.
    pub pause_ends_process: bool,
    /// The sandbox's directory may leave the sandboxes dir before the destroy (what is mounted
    /// from it lives in the sandbox's own mount namespace, held by reference), and may be
    /// recycled as a spare directory afterwards (see [`LiveSandbox::wait_released`]); a
    /// sandbox directory is recycled at create only on such a substrate.
    pub early_teardown: bool,
    /// The sandbox's memory is a cgroup of the edge's that the reclaim policy may reclaim
    /// from and pause under memory pressure.
    pub cgroup_reclaim: bool,
    /// A TCP port inside the sandbox is reached by a socket made in the network namespace of
    /// the sandbox's pid (exposed ports): true where the sandbox's processes are the host's.
    pub ports_in_netns: bool,
    /// Host directories can be bound into the sandbox ([`SandboxSpec::binds`]): the sandbox
    /// shares the host's kernel and mount tree. A VM would need the volume's image as a disk.
    pub volume_binds: bool,
}

/// What a create asks of the substrate beyond the [`SandboxSpec`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CreateOptions {
    /// Start the sandbox's agent SCHED_IDLE with RLIMIT_NICE 0/0 (best-effort QoS), so that
    /// it and everything it forks inherit both from the first instruction on. Substrates that
    /// cannot do this ignore it ([`Capabilities::sched_idle_at_spawn`] is false); the edge's
    /// QoS pass after the create covers them.
    pub sched_idle: bool,
}

/// A create request the substrate cannot serve as asked; the message says what to change.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InvalidRequest(pub String);

/// Why a disk image name did not resolve to a file ([`Substrate::resolve_disk_image`]).
#[derive(Debug, thiserror::Error)]
pub enum ResolveImageError {
    /// The name is malformed (the message says what is allowed).
    #[error("{0}")]
    InvalidName(String),
    /// No such image (the message says where it looked and how to add one).
    #[error("{0}")]
    NotFound(String),
}

/// Why a node cannot run a substrate (its binaries or guest artefacts are missing); the
/// message says how to fix it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct Unavailable(pub String);

/// Why a sandbox's writable layer could not be exposed on the host (or released again).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct WritableLayerError(pub String);

/// What the substrates need from the edge to start.
#[derive(Debug, Clone)]
pub struct OpenContext {
    /// The aether binary (a container's init; put into a VM guest).
    pub aether_path: PathBuf,
    /// The cgroup, below each controller's root, that holds the sandboxes' cgroups.
    pub cgroup_parent: String,
    /// Size of a container's `/dev/shm` in MiB.
    pub shm_mb: u64,
    /// How long a container's aether waits for a restarted edge to reconnect (ms).
    pub reattach_grace_ms: u64,
    /// The edge's own directory (`<data_dir>/edge`): sandboxes, templates live below it.
    pub edge_dir: PathBuf,
    /// The node's data directory (registered VM disk images live below it).
    pub data_dir: PathBuf,
    /// The node's cache directory (`${DSEC_CACHE:-/var/cache/dsec}`): built VM disk images.
    pub cache_dir: PathBuf,
    /// Bytes per second a container's writable layer may be read or written (0: unlimited).
    pub disk_bps_limit: u64,
    /// The microVM substrate's configuration and its templates' (from the edge config's
    /// `[edge.microvm]`), or why there is none.
    pub microvm: Result<(MicroVmConfig, TemplateConfig), Unavailable>,
    /// The full-VM substrate's configuration (`[edge.vm]`), or why there is none.
    pub vm: Result<FullVmConfig, Unavailable>,
}

impl Default for OpenContext {
    fn default() -> Self {
        Self {
            aether_path: PathBuf::new(),
            cgroup_parent: String::new(),
            shm_mb: 0,
            reattach_grace_ms: 0,
            edge_dir: PathBuf::new(),
            data_dir: PathBuf::new(),
            cache_dir: PathBuf::new(),
            disk_bps_limit: 0,
            microvm: Err(Unavailable(
                "no [edge.microvm] configuration was given".into(),
            )),
            vm: Err(Unavailable("no [edge.vm] configuration was given".into())),
        }
    }
}

/// A kind of sandbox, as the edge uses it.
pub trait Substrate: Send + Sync + 'static {
    /// The API's name for this substrate.
    fn kind(&self) -> dsec_wire::api::Substrate;

    /// What this substrate can do.
    fn capabilities(&self) -> Capabilities;

    /// Refuses the parts of a create request this substrate cannot serve (checked before
    /// admission, with a message saying what to change).
    fn check_request(&self, _req: &CreateSandboxRequest) -> Result<(), InvalidRequest> {
        Ok(())
    }

    /// For [`ImageSource::DiskImage`]: the disk image file a request's `image` names.
    fn resolve_disk_image(&self, name: &str) -> Result<PathBuf, ResolveImageError> {
        Err(ResolveImageError::NotFound(format!(
            "{:?} sandboxes start from layers of the image store, not from disk image {name:?}",
            self.kind()
        )))
    }

    /// Builds and starts a sandbox; on error the substrate removed everything it built.
    fn create(
        &self,
        spec: SandboxSpec,
        opts: CreateOptions,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, CreateSandboxError>>;

    /// Takes over a sandbox an earlier run of the edge started (after a crash): `dir` is its
    /// directory, `pid` the host pid recorded for it. A paused sandbox stays paused. A
    /// sandbox that cannot be taken over is ended and [`AdoptError::Gone`] returned.
    fn adopt(
        &self,
        id: String,
        _dir: PathBuf,
        pid: i32,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, AdoptError>> {
        Box::pin(async move { Err(AdoptError::Gone { id, pid }) })
    }

    /// Removes leftovers of sandboxes this substrate created in an earlier run of the edge
    /// (processes, cgroups, directories) that are not in `known_live`; returns the ids cleaned.
    fn reap_orphans(&self, _known_live: Vec<String>) -> BoxFut<'_, Vec<String>> {
        Box::pin(async { Vec::new() })
    }

    /// The edge is stopping (after every sandbox was stopped): remove what the substrate keeps
    /// besides sandboxes (e.g. microVM templates).
    fn shutdown(&self) -> BoxFut<'_, ()> {
        Box::pin(async {})
    }

    /// What the substrate keeps to start sandboxes faster (microVM templates), as JSON;
    /// `None` when it keeps nothing of the kind (or has it turned off).
    fn templates(&self) -> Option<serde_json::Value> {
        None
    }

    /// Removes those; how many, `None` when the substrate has none.
    fn remove_templates(&self) -> Option<usize> {
        None
    }

    /// Images were removed from the store: drop what the substrate keeps per layer file and
    /// no longer needs (the microVM substrate's virtio-pmem copies).
    fn images_removed(&self) -> BoxFut<'_, ()> {
        Box::pin(async {})
    }
}

/// One running (or paused) sandbox.
pub trait LiveSandbox: Send + Sync + 'static {
    fn id(&self) -> &str;
    /// The channel to the sandbox's aether.
    fn aether(&self) -> &AetherClient;
    /// Host pid of the sandbox's init (aether or the VM process).
    fn pid(&self) -> i32;
    fn usage(&self) -> Usage;
    /// How many times the memory limit OOM-killed a process in this sandbox: what each command
    /// needs to flag `oom_killed`. Substrates that can read the counter alone override this
    /// (a container reads one cgroup file instead of [`LiveSandbox::usage`]'s several).
    fn oom_kills(&self) -> u64 {
        self.usage().oom_kills
    }
    /// Kills everything and removes the substrate's kernel objects and directories. Idempotent.
    fn destroy(&self) -> BoxFut<'_, Result<(), DestroySandboxError>>;
    /// [`LiveSandbox::destroy`] that also moves the sandbox's directory to `to` in the order
    /// the substrate needs, and releases what it keeps under the directory where it then is.
    /// Answers whether the directory is at `to` now, with the destroy's result. A substrate
    /// with [`Capabilities::early_teardown`] moves first (the stop then waits for no unlink)
    /// and releases at `to`; the default destroys in place and does not move (the caller
    /// retires the directory afterwards).
    fn destroy_moving_dir<'a>(
        &'a self,
        to: &'a std::path::Path,
    ) -> BoxFut<'a, (bool, Result<(), DestroySandboxError>)> {
        let _ = to;
        Box::pin(async move { (false, self.destroy().await) })
    }
    /// Resolves when the sandbox is gone on its own: its init exited or its channel closed.
    fn exited(&self) -> BoxFut<'_, ()>;
    /// Stops the sandbox from running and gives its memory back, keeping its state: a
    /// container freezes its cgroup and reclaims; a VM snapshots its memory to disk and ends
    /// its process.
    fn pause(&self, reclaim_memory: bool) -> BoxFut<'_, Result<PauseReport, PauseError>>;
    /// Undoes [`LiveSandbox::pause`] (thaw, or restore the snapshot).
    fn resume(&self) -> BoxFut<'_, Result<(), PauseError>>;
    /// Whether the substrate holds the sandbox paused right now.
    fn is_paused(&self) -> bool;
    /// For `pack_diff`: when the writable layer is not `<sandbox dir>/upper` on the host (a VM's
    /// disk image), makes it readable on the host in a consistent state and says where;
    /// [`WritableLayer::release`] undoes that. `None`: the default `<dir>/upper` path applies.
    fn writable_layer(&self) -> BoxFut<'_, Result<Option<WritableLayer>, WritableLayerError>> {
        Box::pin(async { Ok(None) })
    }
    /// How the sandbox started, for substrates with template boots (`cold`, `template`,
    /// `cold-fallback`); `None` when the substrate has no such choice.
    fn boot_kind(&self) -> Option<&'static str> {
        None
    }
    /// After [`LiveSandbox::destroy`] of a substrate with [`Capabilities::early_teardown`]:
    /// blocks (at most `limit`) until nothing holds the sandbox's old directory any more, so
    /// that it may be recycled; false when that did not happen in time.
    fn wait_released(&self, _limit: std::time::Duration) -> bool {
        true
    }
    /// The host cgroup the sandbox's processes and memory are charged to, for the node's
    /// usage sampling and reclaim; `None` (the default) when it has none of its own (a VM).
    fn cgroup(&self) -> Option<&crate::cgroup::Cgroup> {
        None
    }
    /// Applies a QoS class before the sandbox is handed out. The default covers a sandbox
    /// that is one host process (a VM): the scheduler part on [`LiveSandbox::pid`] only.
    fn apply_qos(
        &self,
        settings: &crate::qos::QosSettings,
    ) -> Result<crate::qos::QosApplied, crate::qos::ApplyQosError> {
        crate::qos::apply(self.pid(), None, settings)
    }
}

/// A sandbox's writable layer, exposed on the host for `pack_diff` (see
/// [`LiveSandbox::writable_layer`]).
pub struct WritableLayer {
    /// The overlay upper directory (whiteouts and opaque xattrs as overlayfs wrote them).
    pub upper: PathBuf,
    /// Undoes the exposure (unmount, let the sandbox run again).
    pub release: Box<dyn FnOnce() -> BoxFut<'static, Result<(), WritableLayerError>> + Send>,
}
