//! The container substrate: our own runtime on namespaces, cgroups and overlayfs.
//!
//! Creating a container (host side, this module):
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
pub mod disk;
pub mod masks;
pub mod mntns;
pub mod netpool;
pub mod pause;
pub mod pidfd;
pub mod qos;
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
    /// [`Substrate::create`] with the scheduling class the container's processes start in
    /// (set by the spawn child before aether execs, inherited by everything it forks).
    pub async fn create_with(
        &self,
        spec: SandboxSpec,
        sched: SchedClass,
    ) -> Result<ContainerSandbox, CreateSandboxError> {
        validate_spec(&spec)?;
        let id = spec.id.clone();
        let limits = Limits {
            memory_bytes: spec.memory_limit_mb.saturating_mul(1 << 20),
            cpu_cores: spec.cpu_cores_limit,
            pids: spec.pids_limit,
        };
        let root = self.cgroup_root.clone();
        let parent = self.config.cgroup_parent.clone();
        let cg_id = id.clone();
        let cgroup =
            tokio::task::spawn_blocking(move || Cgroup::create(&root, &parent, &cg_id, &limits))
                .await
                .map_err(|e| CreateSandboxError::Cgroup {
                    id: id.clone(),
                    source: io::Error::other(e),
                })?
                .map_err(|e| CreateSandboxError::Cgroup {
                    id: id.clone(),
                    source: io::Error::other(e),
                })?;
        // The writable layer's size limit: a file system of its own, capped on its device. It
        // exists before anything is written into the layer: the edge's files come after it.
        let disk = spec.disk_limit_mb.filter(|mb| *mb > 0);
        if disk.is_some() || !spec.layer_files.is_empty() {
            let dir = spec.dir.clone();
            let bps = self.disk_bps;
            let cg = cgroup.clone();
            let files = spec.layer_files.clone();
            let made = tokio::task::spawn_blocking(move || {
                if let Some(mb) = disk {
                    disk::prepare(&dir, mb, bps).map(|()| disk::throttle_v2(&cg, &dir, bps))?;
                }
                write_layer_files(&dir.join("upper"), &files)
            })
            .await;
            let err = match made {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e),
                Err(e) => Some(CreateSandboxError::Spawn(io::Error::other(e))),
            };
            if let Some(error) = err {
                let dir = spec.dir.clone();
                let cg = cgroup.clone();
                // prepare removed what it built; the cgroup is empty.
                let _ = tokio::task::spawn_blocking(move || {
                    if disk.is_some() {
                        disk::release(&dir);
                    }
                    remove_dead_cgroup(&cg)
                })
                .await;
                return Err(error);
            }
        }
        let dirs = SandboxDirs::new(&spec.dir);
        match self.start(&spec, &cgroup, &dirs, sched).await {
            Ok(Started { process, client }) => {
                // The edge logs "sandbox created" (with the pid) at INFO.
                tracing::debug!(sandbox = %id, pid = process.pid, "container started");
                let mnt_ns = mntns::MountNsHold::open(process.pid, &id);
                Ok(ContainerSandbox {
                    id,
                    process,
                    client,
                    cgroup,
                    dirs,
                    mnt_ns: std::sync::Mutex::new(mnt_ns),
                })
            }
            Err((error, process)) => {
                tracing::warn!(sandbox = %id, error = %error, "container create failed, rolling back");
                let mut cleanup = Vec::new();
                if let Some(p) = process {
                    if let Err(e) = p.kill().await {
                        cleanup.push(e.to_string());
                    }
                }
                if let Err(e) = teardown(cgroup, dirs).await {
                    cleanup.push(e.to_string());
                }
                if disk.is_some() {
                    let dir = spec.dir.clone();
                    if let Err(e) = tokio::task::spawn_blocking(move || disk::release(&dir)).await {
                        cleanup.push(format!("release disk limit: {e}"));
                    }
                }
                if cleanup.is_empty() {
                    Err(error)
                } else {
                    Err(CreateSandboxError::WithCleanup {
                        id,
                        error: Box::new(error),
                        cleanup: cleanup.join("; "),
                    })
                }
            }
        }
    }

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

    fn setup_for(
        &self,
        spec: &SandboxSpec,
        dirs: &SandboxDirs,
    ) -> Result<ContainerSetup, CreateSandboxError> {
        let s = |p: &Path| {
            p.to_str().map(str::to_string).ok_or_else(|| {
                CreateSandboxError::InvalidSpec(format!("path is not UTF-8: {}", p.display()))
            })
        };
        Ok(ContainerSetup {
            sandbox_id: spec.id.clone(),
            hostname: spec.hostname.clone(),
            lowers: spec.lowers.iter().map(|p| s(p)).collect::<Result<_, _>>()?,
            upper: s(&dirs.upper)?,
            work: s(&dirs.work)?,
            rootfs: s(&dirs.rootfs)?,
            masked_paths: self.masked_paths.clone(),
            readonly_paths: self.readonly_paths.clone(),
            user: spec.user.clone(),
            env: spec.env.clone(),
            shm_mb: self.config.shm_mb,
            reattach_grace_ms: self.reattach_grace_ms,
            protected_paths: spec.protected_paths.clone(),
        })
    }

    /// Everything after the cgroup exists. On error, returns what must be rolled back.
    async fn start(
        &self,
        spec: &SandboxSpec,
        cgroup: &Cgroup,
        dirs: &SandboxDirs,
        sched: SchedClass,
    ) -> Result<Started, (CreateSandboxError, Option<Process>)> {
        let setup = self.setup_for(spec, dirs).map_err(|e| (e, None))?;
        dirs.create()
            .map_err(|e| (CreateSandboxError::Spawn(e), None))?;
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| (CreateSandboxError::Spawn(e), None))?;
        let listener = if self.reattach_grace_ms > 0 {
            Some(
                adopt::bind_listener(&spec.dir)
                    .map_err(|e| (CreateSandboxError::Spawn(e), None))?,
            )
        } else {
            None
        };
        let aether = self.config.aether_path.clone();
        let procs = cgroup.procs_files();
        let user_procs = cgroup.user_procs_file();
        // A prepared namespace (networking) or a fresh empty one from the pool, else the clone
        // makes one.
        let netns = spec.netns.clone().or_else(|| {
            self.netns_pool
                .as_ref()
                .and_then(|p| p.take())
                .map(Arc::new)
        });
        let spawned = tokio::task::spawn_blocking(move || {
            let r = spawn::spawn_aether(
                &aether,
                &procs,
                theirs.as_fd(),
                listener.as_ref().map(|l| l.as_fd()),
                user_procs.as_deref(),
                netns.as_deref().map(|n| n.as_fd()),
                sched,
            );
            drop(theirs);
            drop(listener);
            r
        })
        .await
        .map_err(|e| (CreateSandboxError::Spawn(io::Error::other(e)), None))?
        .map_err(|e| (CreateSandboxError::Spawn(e), None))?;
        let pidfd = Arc::new(spawned.pidfd);
        // The watcher reaps aether; without it we must reap by hand.
        let exit = match pidfd::watch_exit(&pidfd) {
            Ok(rx) => rx,
            Err(e) => {
                let _ = pidfd::send_signal(pidfd.as_fd(), libc::SIGKILL);
                let _ = pidfd::wait_blocking(pidfd.as_fd());
                return Err((CreateSandboxError::Spawn(e), None));
            }
        };
        let process = Process {
            pid: spawned.pid,
            pidfd,
            exit,
        };
        let stream = ours
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UnixStream::from_std(ours))
            .map_err(|e| (CreateSandboxError::Spawn(e), Some(process.clone())))?;
        let client = AetherClient::new(stream);
        let answer = tokio::time::timeout(
            SETUP_TIMEOUT,
            client.request(Request::Setup(setup), Bytes::new()),
        )
        .await;
        let err = match answer {
            Ok(Ok((Reply::Ready { .. }, _))) => return Ok(Started { process, client }),
            Ok(Ok((other, _))) => format!("unexpected answer to Setup: {other:?}"),
            Ok(Err(ChannelError::Aether(e))) if e.kind == AetherErrorKind::BadRequest => {
                return Err((CreateSandboxError::InvalidSpec(e.message), Some(process)));
            }
            Ok(Err(ChannelError::Aether(e))) => e.message,
            Ok(Err(e)) => match process.exit_status() {
                Some(exit) => format!("{e} (aether ended: {exit:?})"),
                None => e.to_string(),
            },
            Err(_) => format!("no answer to Setup within {} s", SETUP_TIMEOUT.as_secs()),
        };
        Err((CreateSandboxError::Setup(err), Some(process)))
    }
}

struct Started {
    process: Process,
    client: AetherClient,
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

/// Renames a sandbox's directory to `to`, making `to`'s parent when it is missing.
fn move_dir(from: &Path, to: &Path) -> io::Result<()> {
    match std::fs::rename(from, to) {
        Err(e) if e.kind() == io::ErrorKind::NotFound && from.exists() => {
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::rename(from, to)
        }
        other => other,
    }
}

/// Writes [`SandboxSpec::layer_files`] into the writable layer's upper directory (blocking).
fn write_layer_files(upper: &Path, files: &[LayerFile]) -> Result<(), CreateSandboxError> {
    for f in files {
        let rel = Path::new(&f.path);
        if rel.is_absolute()
            || rel
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(CreateSandboxError::InvalidSpec(format!(
                "layer file {:?} must be a relative path without `..`",
                f.path
            )));
        }
        let path = upper.join(rel);
        let written = match path.parent() {
            Some(parent) => std::fs::create_dir_all(parent),
            None => Ok(()),
        }
        .and_then(|()| std::fs::write(&path, &f.contents));
        written.map_err(|source| CreateSandboxError::LayerFile { path, source })?;
    }
    Ok(())
}

/// Checks a spec before anything is built.
pub fn validate_spec(spec: &SandboxSpec) -> Result<(), CreateSandboxError> {
    let bad = |m: String| Err(CreateSandboxError::InvalidSpec(m));
    if !dsec_wire::id::is_valid_sandbox_id(&spec.id) {
        return bad(format!("malformed sandbox id {:?}", spec.id));
    }
    let h = &spec.hostname;
    if h.is_empty()
        || h.len() > 64
        || !h
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
    {
        return bad(format!(
            "hostname {h:?} must be 1-64 characters of letters, digits, '-' and '.'"
        ));
    }
    if spec.lowers.is_empty() {
        return bad("at least one lower layer is required".into());
    }
    for l in &spec.lowers {
        let s = l.to_string_lossy();
        if !l.is_absolute() || s.contains([':', ',', '\\']) || s.contains('\0') {
            return bad(format!(
                "lower layer path {s:?} must be absolute and free of ':' ',' '\\'"
            ));
        }
        if !l.is_dir() {
            return bad(format!("lower layer {s:?} is not a directory"));
        }
    }
    if !spec.dir.is_absolute() {
        return bad(format!(
            "sandbox dir {} must be absolute",
            spec.dir.display()
        ));
    }
    let ds = spec.dir.to_string_lossy();
    if ds.contains([':', ',', '\\']) {
        return bad(format!("sandbox dir {ds:?} must not contain ':' ',' '\\'"));
    }
    if !(spec.cpu_cores_limit.is_finite() && spec.cpu_cores_limit >= 0.0) {
        return bad(format!(
            "cpu_cores_limit {} must be a non-negative number",
            spec.cpu_cores_limit
        ));
    }
    if spec.memory_limit_mb > (1 << 40) {
        return bad(format!(
            "memory_limit_mb {} is too large",
            spec.memory_limit_mb
        ));
    }
    if spec.user.contains('\0') {
        return bad("user contains a NUL byte".into());
    }
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains(['=', '\0']) || v.contains('\0') {
            return bad(format!("bad environment variable name or value: {k:?}"));
        }
    }
    Ok(())
}

impl ContainerSubstrate {
    /// Builds and starts a container; on error everything built so far is removed.
    pub async fn create(&self, spec: SandboxSpec) -> Result<ContainerSandbox, CreateSandboxError> {
        self.create_with(spec, SchedClass::Inherit).await
    }

    /// Kills everything in the container and removes its cgroup and directories. Idempotent.
    pub async fn destroy(&self, sb: &ContainerSandbox) -> Result<(), DestroySandboxError> {
        self.destroy_in(sb, sb.dirs.base.clone()).await
    }

    /// [`ContainerSubstrate::destroy`] after moving the sandbox's directory to `to` first (its
    /// mounts live only in its own mount namespace, which holds them by reference); the disk
    /// limit's file system, which moved with it, is released there. The directory's contents
    /// are left for the caller (removed or recycled in the background). Answers whether the
    /// directory is at `to` now.
    pub async fn destroy_moving_dir(
        &self,
        sb: &ContainerSandbox,
        to: &Path,
    ) -> (bool, Result<(), DestroySandboxError>) {
        let moved = match move_dir(&sb.dirs.base, to) {
            Ok(()) => true,
            Err(e) => {
                if sb.dirs.base.exists() {
                    tracing::warn!(sandbox = %sb.id, to = %to.display(), error = %e, "move sandbox dir before destroy");
                }
                false
            }
        };
        let base = if moved {
            to.to_path_buf()
        } else {
            sb.dirs.base.clone()
        };
        (moved, self.destroy_in(sb, base).await)
    }

    /// Destroys with the sandbox's directory at `base` (where the disk limit's file system is
    /// released).
    async fn destroy_in(
        &self,
        sb: &ContainerSandbox,
        base: PathBuf,
    ) -> Result<(), DestroySandboxError> {
        let p = &sb.process;
        let t0 = std::time::Instant::now();
        if sb.is_frozen() {
            // A frozen (paused) task does not die of SIGKILL under the v1 freezer.
            let _ = sb.resume().await;
        }
        // No polite `Shutdown` round trip: SIGKILL of aether, the pid namespace's init, makes
        // the kernel kill every process of the sandbox, and aether keeps nothing to flush.
        let io_err =
            |what: &str, e: Box<dyn std::error::Error + Send + Sync>| DestroySandboxError::Io {
                id: sb.id.clone(),
                what: what.to_string(),
                source: io::Error::other(e),
            };
        let exited = t0.elapsed();
        p.kill()
            .await
            .map_err(|e| io_err("kill aether", e.into()))?;
        let killed = t0.elapsed();
        // Every process of the sandbox is dead (aether, its pid namespace's init, is reaped
        // after all of them): its mounts go away on a blocking thread (see `mntns`).
        let held = sb.mnt_ns.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = held {
            h.release_in_background();
        }
        teardown(sb.cgroup.clone(), sb.dirs.clone())
            .await
            .map_err(|e| io_err("remove cgroup and dirs", e.into()))?;
        // The disk limit's file system (if any) is unmounted once nothing runs on it.
        tokio::task::spawn_blocking(move || disk::release(&base))
            .await
            .map_err(|e| io_err("release disk limit", e.into()))?;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        // The edge logs "sandbox ended" (with the whole destroy's time) at INFO.
        tracing::debug!(
            sandbox = %sb.id,
            exit_ms = ms(exited),
            kill_ms = ms(killed - exited),
            teardown_ms = ms(t0.elapsed() - killed),
            "container destroyed"
        );
        Ok(())
    }

    /// Removes the cgroups of sandboxes an earlier run of the edge left (after a crash) that
    /// are not in `known_live`; returns the ids cleaned.
    pub async fn reap_orphans(&self, known_live: &[String]) -> Vec<String> {
        let root = self.cgroup_root.clone();
        let parent = self.config.cgroup_parent.clone();
        let live: Vec<String> = known_live.to_vec();
        let reaped = tokio::task::spawn_blocking(move || {
            let names = match Cgroup::list(&root, &parent) {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(error = %e, "list sandbox cgroups");
                    return Vec::new();
                }
            };
            let mut reaped = Vec::new();
            for name in names {
                if live.contains(&name) || !dsec_wire::id::is_valid_sandbox_id(&name) {
                    continue;
                }
                match Cgroup::open(&root, &parent, &name).and_then(|cg| cg.destroy()) {
                    Ok(()) => reaped.push(name),
                    Err(e) => {
                        tracing::warn!(sandbox = %name, error = %e, "reap orphaned sandbox cgroup")
                    }
                }
            }
            reaped
        })
        .await;
        reaped.unwrap_or_default()
    }
}

/// Removes the cgroup of a container whose aether was reaped. Its processes are all gone
/// (aether is the init of their pid namespace), so an empty cgroup is removed with plain
/// rmdirs; [`Cgroup::destroy`] freezes and thaws before it kills, and on v1 each freeze of a
/// cgroup turns the kernel's `freezer_active` static key on and each thaw off again: code
/// patching with IPIs to every CPU, twice per stop (`perf`: `arch_jump_label_transform_apply`
/// under `freezer_write`, ≈ 0.12 ms of CPU per sandbox at 100 stops/s). Anything left (a
/// process, or a directory still busy) goes through the full destroy.
fn remove_dead_cgroup(cgroup: &Cgroup) -> Result<(), crate::cgroup::CgroupError> {
    if !cgroup.procs().is_ok_and(|p| p.is_empty()) {
        return cgroup.destroy();
    }
    let dirs = match cgroup {
        Cgroup::V1(c) => c.removal_order(),
        Cgroup::V2(c) => c.removal_order(),
    };
    for d in &dirs {
        match std::fs::remove_dir(d) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(_) => return cgroup.destroy(),
        }
    }
    Ok(())
}

/// Ending a container's processes or removing what it left (cgroup, directories) failed.
#[derive(Debug, thiserror::Error)]
pub enum TeardownError {
    #[error("kill aether (pid {pid}): {source}")]
    Kill { pid: i32, source: io::Error },
    #[error("aether (pid {0}) did not exit after SIGKILL")]
    KillTimeout(i32),
    #[error("destroy cgroup: {0}")]
    Cgroup(crate::cgroup::CgroupError),
    #[error("remove {}: {source}", path.display())]
    RemoveDir { path: PathBuf, source: io::Error },
    #[error("teardown task: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// Both the cgroup and the directories failed.
    #[error("{0}; {1}")]
    Both(Box<TeardownError>, Box<TeardownError>),
}

/// Destroys the cgroup (killing stragglers) and removes the sandbox's dirs.
async fn teardown(cgroup: Cgroup, dirs: SandboxDirs) -> Result<(), TeardownError> {
    tokio::task::spawn_blocking(move || {
        let cg = remove_dead_cgroup(&cgroup).map_err(TeardownError::Cgroup);
        let d = dirs
            .remove()
            .map_err(|(path, source)| TeardownError::RemoveDir { path, source });
        match (cg, d) {
            (Ok(()), Ok(())) => Ok(()),
            (Err(e), Ok(())) | (Ok(()), Err(e)) => Err(e),
            (Err(a), Err(b)) => Err(TeardownError::Both(Box::new(a), Box::new(b))),
        }
    })
    .await?
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn spec(dir: &Path) -> SandboxSpec {
        SandboxSpec {
            id: "sb-t0-0123456789abcdef".into(),
            hostname: "box-1".into(),
            lowers: vec![PathBuf::from("/")],
            dir: dir.to_path_buf(),
            memory_limit_mb: 256,
            cpu_cores_limit: 1.0,
            pids_limit: 100,
            user: "root".into(),
            env: BTreeMap::new(),
            ..Default::default()
        }
    }

    #[test]
    fn validates_specs() {
        let d = tempfile::tempdir().unwrap();
        assert!(validate_spec(&spec(d.path())).is_ok());
        type Mutation = Box<dyn Fn(&mut SandboxSpec)>;
        let cases: Vec<Mutation> = vec![
            Box::new(|s| s.id = "../etc".into()),
            Box::new(|s| s.hostname = "a b".into()),
            Box::new(|s| s.hostname = String::new()),
            Box::new(|s| s.lowers.clear()),
            Box::new(|s| s.lowers = vec![PathBuf::from("/a:b")]),
            Box::new(|s| s.lowers = vec![PathBuf::from("relative")]),
            Box::new(|s| s.lowers = vec![PathBuf::from("/definitely/missing/layer")]),
            Box::new(|s| s.dir = PathBuf::from("rel")),
            Box::new(|s| s.cpu_cores_limit = f64::NAN),
            Box::new(|s| s.cpu_cores_limit = -1.0),
            Box::new(|s| {
                s.env.insert("A=B".into(), "x".into());
            }),
        ];
        for (i, f) in cases.iter().enumerate() {
            let mut s = spec(d.path());
            f(&mut s);
            assert!(
                matches!(validate_spec(&s), Err(CreateSandboxError::InvalidSpec(_))),
                "case {i}"
            );
        }
    }

    #[test]
    fn setup_message_from_spec() {
        let d = tempfile::tempdir().unwrap();
        let sub = ContainerSubstrate::with_cgroup_root(
            ContainerConfig {
                aether_path: "/x/aether".into(),
                cgroup_parent: "dsec/t".into(),
                shm_mb: 64,
            },
            CgroupRoot {
                version: crate::cgroup::CgroupVersion::V2,
                path: d.path().into(),
            },
        );
        let mut sp = spec(d.path());
        sp.env.insert("FOO".into(), "bar".into());
        let setup = sub.setup_for(&sp, &SandboxDirs::new(d.path())).unwrap();
        assert_eq!(setup.lowers, vec!["/".to_string()]);
        assert_eq!(PathBuf::from(&setup.upper), d.path().join("upper"));
        assert_eq!(PathBuf::from(&setup.rootfs), d.path().join("rootfs"));
        assert_eq!(setup.shm_mb, 64);
        assert_eq!(setup.env.get("FOO").map(String::as_str), Some("bar"));
        assert!(setup.masked_paths.iter().any(|p| p == "/proc/kpagecgroup"));
        assert!(setup.readonly_paths.iter().any(|p| p == "/proc/sys"));
    }
}
