//! The container substrate: our own runtime on namespaces, cgroups and overlayfs.
//!
//! One file per lifecycle verb: [`create`], [`destroy`], [`pause`] (freeze and thaw, memory
//! reclaim), [`adopt`] (re-attach after an edge restart), [`reap`] (cgroups an earlier edge
//! left); [`substrate`] puts them behind the one substrate interface.
//!
//! Creating a container (host side, [`create`]):
//! 1. create the sandbox's cgroups and apply limits ([`crate::cgroup`]);
//! 2. make `upper/`, `work/`, `rootfs/` under the sandbox dir;
//! 3. clone (vfork-style, sharing no page tables) a child into new mount, pid, ipc, uts
//!    namespaces and a new network namespace (a ready one from [`netpool`] when there is one)
//!    with a pidfd; the child joins the cgroups, unshares its cgroup namespace, puts the channel
//!    socket on fd 3 and execs the static aether binary — nothing else runs between clone and
//!    exec ([`spawn`]);
//! 4. send `Setup` over the channel; aether (now PID 1) mounts the overlay, pivots, masks,
//!    drops privileges and answers `Ready`.
//!
//! The overlay and every other mount live only in the sandbox's mount namespace, so they vanish
//! with its last process; the host keeps nothing mounted for a container.

pub mod adopt;
pub mod create;
pub mod destroy;
pub mod disk;
pub mod masks;
pub mod mntns;
pub mod netpool;
pub mod pause;
pub mod pidfd;
pub mod qos;
pub mod reap;
pub mod spawn;
pub mod substrate;

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dsec_wire::aether::{AetherErrorKind, ContainerSetup, Reply, Request};
use tokio::sync::watch;

use crate::aether_client::{AetherClient, ChannelError};
use crate::cgroup::{Cgroup, CgroupRoot, Limits};
use crate::substrate::{CreateSandboxError, DestroySandboxError, LayerFile, SandboxSpec, Usage};

pub use create::validate_spec;
pub use destroy::TeardownError;
use destroy::{remove_dead_cgroup, teardown};
pub use pidfd::AetherExit;
pub use spawn::SchedClass;

/// How long aether may take to answer `Setup`.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long aether gets to exit after `Shutdown` before it is killed.
pub const SHUTDOWN_GRACE: Duration = Duration::from_millis(100);
/// How long to wait for a killed aether to be reaped.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// Configuration of the container substrate.
#[derive(Debug, Clone)]
pub struct ContainerConfig {
    /// Path of the static aether binary on the host.
    pub aether_path: PathBuf,
    /// cgroup path below each controller's root, e.g. `dsec/n0`.
    pub cgroup_parent: String,
    /// Size of the sandbox's /dev/shm in MiB.
    pub shm_mb: u64,
}

/// Runs sandboxes as containers.
#[derive(Debug, Clone)]
pub struct ContainerSubstrate {
    config: ContainerConfig,
    cgroup_root: CgroupRoot,
    masked_paths: Vec<String>,
    readonly_paths: Vec<String>,
    /// How long aether waits for a restarted edge to reattach (0: it exits with its channel).
    reattach_grace_ms: u64,
    /// Ready network namespaces for containers without networking (see [`netpool`]).
    netns_pool: Option<Arc<netpool::NetnsPool>>,
    /// Read and write cap of a disk-limited sandbox's loop device, bytes/s (0: none).
    disk_bps: u64,
}

impl ContainerSubstrate {
    /// A substrate using the host's cgroup hierarchy at `/sys/fs/cgroup` and the default masks.
    /// Turns the node's `favordynmods` setting on (once per process, see
    /// [`crate::cgroup::favor`]): cgroup moves of every create then skip an RCU grace period.
    pub fn new(config: ContainerConfig) -> Self {
        let root = CgroupRoot::detect();
        crate::cgroup::favor::ensure(&root);
        let mut s = Self::with_cgroup_root(config, root);
        s.netns_pool = Some(netpool::NetnsPool::start());
        s
    }

    pub fn with_cgroup_root(config: ContainerConfig, cgroup_root: CgroupRoot) -> Self {
        ContainerSubstrate {
            config,
            cgroup_root,
            masked_paths: masks::MASKED_PATHS.iter().map(|s| s.to_string()).collect(),
            readonly_paths: masks::READONLY_PATHS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            reattach_grace_ms: 0,
            netns_pool: None,
            disk_bps: 0,
        }
    }

    /// Caps the reads and writes of each disk-limited sandbox at `bps` bytes per second (see
    /// [`disk`]; 0: no cap).
    pub fn with_disk_bps_limit(mut self, bps: u64) -> Self {
        self.disk_bps = bps;
        self
    }

    /// Lets sandboxes outlive a crash of the edge for `ms`: aether listens on
    /// `<sandbox dir>/aether.sock` (a host path, unreachable from inside) for the restarted
    /// edge ([`ContainerSubstrate::adopt`]).
    pub fn with_reattach_grace(mut self, ms: u64) -> Self {
        self.reattach_grace_ms = ms;
        self
    }

    /// Adds paths masked inside every container (on top of the defaults).
    pub fn mask_more(mut self, paths: impl IntoIterator<Item = String>) -> Self {
        self.masked_paths.extend(paths);
        self
    }

    pub fn config(&self) -> &ContainerConfig {
        &self.config
    }

    pub fn cgroup_root(&self) -> &CgroupRoot {
        &self.cgroup_root
    }

    /// The cgroup a sandbox with this id has (or had) on this host.
    pub fn cgroup_of(&self, id: &str) -> Result<Cgroup, crate::cgroup::CgroupError> {
        Cgroup::open(&self.cgroup_root, &self.config.cgroup_parent, id)
    }
}

/// The sandbox's init process as the host sees it.
#[derive(Clone)]
struct Process {
    pid: i32,
    pidfd: Arc<OwnedFd>,
    exit: watch::Receiver<Option<AetherExit>>,
}

impl Process {
    fn exit_status(&self) -> Option<AetherExit> {
        *self.exit.borrow()
    }

    async fn wait(&self, limit: Duration) -> Option<AetherExit> {
        let mut rx = self.exit.clone();
        let waited = tokio::time::timeout(limit, async {
            rx.wait_for(|e| e.is_some()).await.map(|v| *v)
        })
        .await;
        match waited {
            Ok(Ok(v)) => v,
            _ => self.exit_status(),
        }
    }

    /// SIGKILLs the process (and so its whole pid namespace) and waits until it is reaped.
    async fn kill(&self) -> Result<AetherExit, TeardownError> {
        pidfd::send_signal(self.pidfd.as_fd(), libc::SIGKILL).map_err(|source| {
            TeardownError::Kill {
                pid: self.pid,
                source,
            }
        })?;
        self.wait(KILL_WAIT)
            .await
            .ok_or(TeardownError::KillTimeout(self.pid))
    }
}

/// The per-sandbox directories this substrate owns (below the edge's sandbox dir).
#[derive(Debug, Clone)]
struct SandboxDirs {
    /// The sandbox's own directory (the three below, the disk limit's files).
    base: PathBuf,
    upper: PathBuf,
    work: PathBuf,
    rootfs: PathBuf,
}

impl SandboxDirs {
    fn new(dir: &Path) -> Self {
        SandboxDirs {
            base: dir.to_path_buf(),
            upper: dir.join("upper"),
            work: dir.join("work"),
            rootfs: dir.join("rootfs"),
        }
    }

    fn all(&self) -> [&Path; 3] {
        [&self.upper, &self.work, &self.rootfs]
    }

    fn create(&self) -> io::Result<()> {
        for d in self.all() {
            std::fs::create_dir_all(d)
                .map_err(|e| io::Error::new(e.kind(), format!("create {}: {e}", d.display())))?;
        }
        Ok(())
    }

    /// Removes the three dirs; missing ones are fine.
    fn remove(&self) -> Result<(), (PathBuf, io::Error)> {
        for d in self.all() {
            match std::fs::remove_dir_all(d) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err((d.to_path_buf(), e)),
            }
        }
        Ok(())
    }
}

/// A running container.
pub struct ContainerSandbox {
    id: String,
    process: Process,
    client: AetherClient,
    cgroup: Cgroup,
    dirs: SandboxDirs,
    /// The sandbox's mount namespace, released once its processes are dead (see `mntns`).
    mnt_ns: std::sync::Mutex<Option<mntns::MountNsHold>>,
}

impl ContainerSandbox {
    /// Resolves when aether has exited (and was reaped), with how it ended.
    pub fn exited(&self) -> impl std::future::Future<Output = AetherExit> + Send + 'static {
        let mut rx = self.process.exit.clone();
        async move {
            match rx.wait_for(|e| e.is_some()).await {
                Ok(v) => v.unwrap_or(AetherExit::Signal(0)),
                // The watcher is gone without a status (runtime shut down).
                Err(_) => AetherExit::Signal(0),
            }
        }
    }

    /// How aether ended, if it has.
    pub fn exit_status(&self) -> Option<AetherExit> {
        self.process.exit_status()
    }

    /// The sandbox's cgroup (freeze/thaw for pause, counters).
    pub fn cgroup(&self) -> &Cgroup {
        &self.cgroup
    }

    /// Host path of the sandbox's writable layer.
    pub fn upper_dir(&self) -> &Path {
        &self.dirs.upper
    }
}

impl ContainerSandbox {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The channel to the container's aether.
    pub fn aether(&self) -> &AetherClient {
        &self.client
    }

    /// Host pid of the container's aether.
    pub fn pid(&self) -> i32 {
        self.process.pid
    }

    pub fn usage(&self) -> Usage {
        Usage {
            memory_bytes: self.cgroup.memory_usage().unwrap_or(0),
            pids: self.cgroup.pids_current().unwrap_or(0),
            oom_kills: self.cgroup.oom_kills().unwrap_or(0),
        }
    }
}
