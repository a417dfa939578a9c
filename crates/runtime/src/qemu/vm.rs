//! One guest's life: QEMU processes that come and go (pause by snapshot ends the process,
//! resume starts a new one from the snapshot) behind one long-lived aether channel.
//!
//! Pause: the relay stops sending towards QEMU, `sync` in the guest already ran, QMP `stop`,
//! the bytes QEMU had not read yet are set aside, QMP `migrate` to `exec:cat > snapshot`,
//! `query-migrate` until completed, `quit`. The writable disk is a file on the host and needs
//! no copy. Resume: the same command line plus `-S -incoming defer`, the relay attached to the
//! new aether socket (before the guest runs, so it never sees its host side disconnected),
//! `migrate-incoming exec:cat snapshot`, wait, `cont`, remove the snapshot.

use super::error::VmError;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsec_wire::aether::Request;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::watch;

use super::relay::Relay;
use crate::aether_client::AetherClient;
use crate::error::PauseError;

/// File names inside the VM directory.
pub const SNAPSHOT: &str = "snapshot";
pub const ARGS_FILE: &str = "qemu.args";

/// How QEMU is started for this VM (kept to restart it from a snapshot).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Launch {
    pub qemu_binary: PathBuf,
    pub args: Vec<String>,
}

impl Launch {
    /// Guest memory includes file-backed shared regions (virtio-pmem layers): snapshots skip
    /// them (`x-ignore-shared`), the restored QEMU maps the same files.
    pub fn shared_memory(&self) -> bool {
        self.args
            .iter()
            .any(|a| a.starts_with("memory-backend-file,") && a.contains(",share=on"))
    }
}

/// One QEMU process of the VM.
pub(super) struct Proc {
    pub(super) pid: i32,
    pub(super) exited: watch::Receiver<bool>,
    /// Set before the edge ends this process on purpose (pause, destroy).
    pub(super) intentional: Arc<AtomicBool>,
    pub(super) relay: Relay,
}

/// The edge's half of the channel while no QEMU runs (paused).
pub(super) struct Parked {
    pub(super) edge_r: OwnedReadHalf,
    pub(super) edge_w: OwnedWriteHalf,
    /// Bytes for the guest that the last QEMU had not read.
    pub(super) pending: Vec<u8>,
}

pub(super) enum Phase {
    Running(Proc),
    Paused(Parked),
    Gone,
}

/// A guest and its QEMU process of the moment.
pub struct Vm {
    pub id: String,
    pub vm_dir: PathBuf,
    pub(super) launch: Launch,
    pub(super) aether: AetherClient,
    pub(super) phase: tokio::sync::Mutex<Phase>,
    pub(super) pid: AtomicI32,
    pub(super) paused: AtomicBool,
    pub(super) dead_tx: Arc<watch::Sender<bool>>,
    pub(super) dead_rx: watch::Receiver<bool>,
    /// Why the VM died, when it did on its own.
    pub(super) died: Arc<Mutex<Option<String>>>,
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vm")
            .field("id", &self.id)
            .field("pid", &self.pid.load(Ordering::SeqCst))
            .field("paused", &self.paused.load(Ordering::SeqCst))
            .finish()
    }
}

/// What the guest must see once the channel is open for the first time.
pub(super) const SYNC_BYTE: &[u8] = b"S";

pub(super) fn vm_err(what: impl Into<String>) -> PauseError {
    PauseError::Task(what.into())
}

/// Connects to QEMU's listening socket, retrying until it exists.
pub(super) async fn connect_when_listening(path: &Path) -> io::Result<UnixStream> {
    loop {
        match UnixStream::connect(path).await {
            Ok(s) => return Ok(s),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                ) =>
            {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Err(e) => return Err(e),
        }
    }
}

/// Resident memory of a process: (total, anonymous, file + shmem) in bytes.
pub fn rss_of(pid: i32) -> (u64, u64, u64) {
    if pid <= 0 {
        return (0, 0, 0);
    }
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb = |key: &str| -> u64 {
        s.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (
        kb("VmRSS:"),
        kb("RssAnon:"),
        kb("RssFile:") + kb("RssShmem:"),
    )
}

/// A started QEMU process before its channel is attached.
pub(super) struct Started {
    pub(super) child: tokio::process::Child,
    pub(super) pid: i32,
    pub(super) stream: UnixStream,
    /// Length of `qemu.log` before this process started: what it wrote begins there.
    pub(super) log_start: u64,
}

/// Why a cold boot failed.
#[derive(Debug, Clone)]
pub struct BootError {
    pub msg: String,
    /// QEMU exited before aether's `Ready` (it refused its command line, crashed, or the
    /// guest's kernel panicked). A guest that reached aether, an aether that refused to start
    /// and a boot timeout do not count.
    pub qemu_exited: bool,
    /// The guest's /init printed nothing for a long time (the kernel hangs early on this
    /// machine); QEMU was ended.
    pub init_silent: bool,
}

impl std::fmt::Display for BootError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

impl From<VmError> for BootError {
    fn from(e: VmError) -> Self {
        BootError {
            qemu_exited: matches!(e, VmError::ExitedAtStart { .. }),
            init_silent: false,
            msg: e.to_string(),
        }
    }
}

impl From<String> for BootError {
    fn from(msg: String) -> Self {
        BootError {
            msg,
            qemu_exited: false,
            init_silent: false,
        }
    }
}

/// What QEMU wrote to `qemu.log` (its stdout and stderr) from byte `from` on: the last few
/// lines, joined with ` | ` (empty when it wrote nothing).
pub fn qemu_log_since(vm_dir: &Path, from: u64) -> String {
    let raw = std::fs::read(vm_dir.join("qemu.log")).unwrap_or_default();
    let start = usize::try_from(from).unwrap_or(usize::MAX).min(raw.len());
    let text = String::from_utf8_lossy(&raw[start..]);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines[lines.len().saturating_sub(5)..].join(" | ")
}

pub(super) async fn start_qemu(
    launch: &Launch,
    vm_dir: &Path,
    extra: &[&str],
) -> Result<Started, VmError> {
    let sock = vm_dir.join("aether.sock");
    let _ = std::fs::remove_file(&sock);
    let _ = std::fs::remove_file(vm_dir.join("qmp.sock"));
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(vm_dir.join("qemu.log"))
        .map_err(|e| VmError::io("open qemu.log", e))?;
    let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
    let log2 = log
        .try_clone()
        .map_err(|e| VmError::io("dup qemu.log", e))?;
    let mut cmd = tokio::process::Command::new(&launch.qemu_binary);
    // A VM with a NIC runs QEMU in the sandbox's network namespace (net.rs).
    super::net::enter_netns(&mut cmd, vm_dir)?;
    let mut child = cmd
        .args(&launch.args)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| VmError::Spawn {
            binary: launch.qemu_binary.clone(),
            source,
        })?;
    let pid = child.id().map(|p| p as i32).unwrap_or(0);
    let stream = tokio::select! {
        r = tokio::time::timeout(Duration::from_secs(30), connect_when_listening(&sock)) => match r {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(VmError::Channel(e)),
            Err(_) => return Err(VmError::NoChannel),
        },
        st = child.wait() => {
            return Err(VmError::ExitedAtStart {
                status: format!("{st:?}"),
                log: qemu_log_since(vm_dir, log_start),
            });
        }
    };
    Ok(Started {
        child,
        pid,
        stream,
        log_start,
    })
}

/// Reaps `child` in the background: `exited` becomes true, and `dead` too (with a reason) when
/// the exit was not asked for.
pub(super) fn spawn_waiter(
    mut child: tokio::process::Child,
    intentional: Arc<AtomicBool>,
    dead_tx: Arc<watch::Sender<bool>>,
    died: Arc<Mutex<Option<String>>>,
) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let st = child.wait().await;
        let _ = tx.send(true);
        if !intentional.load(Ordering::SeqCst) {
            *died.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(format!("QEMU exited on its own ({st:?})"));
            let _ = dead_tx.send(true);
        }
    });
    rx
}

/// Ends a process the pause could not bring back to a sane state: the VM is lost.
pub(super) fn fail_dead(proc: Proc, msg: &str) -> (Option<Proc>, PauseError) {
    proc.intentional.store(true, Ordering::SeqCst);
    if !*proc.exited.borrow() {
        // SAFETY: kill(2) on QEMU's pid, not reaped yet (its waiter has not reported the exit).
        unsafe { libc::kill(proc.pid, libc::SIGKILL) };
    }
    (None, vm_err(format!("{msg}; the VM was ended")))
}

impl Vm {
    /// Starts a fresh guest (cold boot) and waits for aether's `Ready`.
    pub async fn boot(
        id: &str,
        vm_dir: &Path,
        launch: Launch,
        boot_timeout: Duration,
    ) -> Result<Vm, BootError> {
        let args_json = serde_json::to_vec(&launch).map_err(|e| format!("encode args: {e}"))?;
        std::fs::write(vm_dir.join(ARGS_FILE), args_json)
            .map_err(|e| format!("write {ARGS_FILE}: {e}"))?;
        let Started {
            mut child,
            pid,
            mut stream,
            log_start,
        } = start_qemu(&launch, vm_dir, &[])
            .await
            .map_err(|e| BootError {
                qemu_exited: matches!(e, VmError::ExitedAtStart { .. }),
                init_silent: false,
                msg: e.to_string(),
            })?;
        // The guest's /init waits for this byte before starting aether: a read of a
        // virtio-serial port whose host side is not yet open returns EOF.
        if let Err(e) = tokio::io::AsyncWriteExt::write_all(&mut stream, SYNC_BYTE).await {
            let _ = child.start_kill();
            let st = child.wait().await;
            return Err(BootError {
                msg: format!(
                    "send the sync byte: {e} (QEMU {st:?}: {})",
                    qemu_log_since(vm_dir, log_start)
                ),
                qemu_exited: true,
                init_silent: false,
            });
        }
        let (client_end, edge_end) = UnixStream::pair().map_err(|e| format!("socketpair: {e}"))?;
        let aether = AetherClient::new(client_end);
        let (edge_r, edge_w) = edge_end.into_split();
        let intentional = Arc::new(AtomicBool::new(false));
        let relay = Relay::start(edge_r, edge_w, stream, Vec::new(), intentional.clone());
        let ready = tokio::select! {
            r = tokio::time::timeout(boot_timeout, aether.wait_ready()) => match r {
                // aether reports a setup problem (e.g. an unknown init_user) instead of Ready.
                Ok(Ok(dsec_wire::aether::Reply::Error(e))) => {
                    Err(format!("the guest's aether refused to start: {}", e.message))
                }
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("the guest's channel closed before Ready: {e}")),
                Err(_) => Err(format!("the guest sent no Ready within {boot_timeout:?}")),
            },
            st = child.wait() => Err(format!("QEMU exited during boot ({st:?})")),
        };
        if let Err(mut msg) = ready {
            intentional.store(true, Ordering::SeqCst);
            // Whether QEMU ended on its own (a closed channel usually means it did: give it a
            // moment to be reaped) or is killed here.
            let exited = tokio::time::timeout(Duration::from_millis(500), child.wait())
                .await
                .is_ok();
            let _ = child.start_kill();
            let _ = child.wait().await;
            let log = qemu_log_since(vm_dir, log_start);
            if !log.is_empty() {
                // QEMU's own words (e.g. a device the machine type does not have).
                msg.push_str(&format!("; QEMU: {log}"));
            }
            return Err(BootError {
                msg,
                qemu_exited: exited,
                init_silent: false,
            });
        }
        Ok(Vm::running(
            id,
            vm_dir,
            launch,
            aether,
            child,
            pid,
            intentional,
            relay,
        ))
    }

    /// A VM whose QEMU (`child`, `pid`) runs and whose aether channel is relayed; a waiter task
    /// reports the QEMU's end. Shared by the cold boot and the restore from a template.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn running(
        id: &str,
        vm_dir: &Path,
        launch: Launch,
        aether: AetherClient,
        child: tokio::process::Child,
        pid: i32,
        intentional: Arc<AtomicBool>,
        relay: Relay,
    ) -> Vm {
        let (dead_tx, dead_rx) = watch::channel(false);
        let dead_tx = Arc::new(dead_tx);
        let died = Arc::new(Mutex::new(None));
        let exited = spawn_waiter(child, intentional.clone(), dead_tx.clone(), died.clone());
        Vm {
            id: id.to_string(),
            vm_dir: vm_dir.to_path_buf(),
            launch,
            aether,
            phase: tokio::sync::Mutex::new(Phase::Running(Proc {
                pid,
                exited,
                intentional,
                relay,
            })),
            pid: AtomicI32::new(pid),
            paused: AtomicBool::new(false),
            dead_tx,
            dead_rx,
            died,
        }
    }

    /// Takes over a paused VM of an earlier edge run: its directory holds the command line and
    /// the snapshot. The guest's channel is a fresh stream; aether in the guest keeps its
    /// sessions.
    pub fn adopt_paused(id: &str, vm_dir: &Path) -> Result<Vm, VmError> {
        if !vm_dir.join(SNAPSHOT).is_file() {
            return Err(VmError::NoSnapshot(vm_dir.to_path_buf()));
        }
        let raw = std::fs::read(vm_dir.join(ARGS_FILE))
            .map_err(|e| VmError::io(format!("read {ARGS_FILE}"), e))?;
        let launch: Launch = serde_json::from_slice(&raw).map_err(|source| VmError::Launch {
            what: format!("parse {ARGS_FILE}"),
            source,
        })?;
        let (client_end, edge_end) =
            std::os::unix::net::UnixStream::pair().map_err(|e| VmError::io("socketpair", e))?;
        let conv = |s: std::os::unix::net::UnixStream| -> Result<UnixStream, VmError> {
            s.set_nonblocking(true)
                .map_err(|e| VmError::io("nonblocking", e))?;
            UnixStream::from_std(s).map_err(|e| VmError::io("register socket", e))
        };
        let aether = AetherClient::new(conv(client_end)?);
        let (edge_r, edge_w) = conv(edge_end)?.into_split();
        let (dead_tx, dead_rx) = watch::channel(false);
        Ok(Vm {
            id: id.to_string(),
            vm_dir: vm_dir.to_path_buf(),
            launch,
            aether,
            phase: tokio::sync::Mutex::new(Phase::Paused(Parked {
                edge_r,
                edge_w,
                pending: Vec::new(),
            })),
            pid: AtomicI32::new(0),
            paused: AtomicBool::new(true),
            dead_tx: Arc::new(dead_tx),
            dead_rx,
            died: Arc::new(Mutex::new(None)),
        })
    }

    pub fn aether(&self) -> &AetherClient {
        &self.aether
    }

    /// QEMU's pid, 0 while paused.
    pub fn pid(&self) -> i32 {
        self.pid.load(Ordering::SeqCst)
    }

    pub fn is_paused(&self) -> bool {
        self.paused.load(Ordering::SeqCst)
    }

    pub fn has_died(&self) -> bool {
        *self.dead_rx.borrow()
    }

    /// Why the VM died on its own, if it did.
    pub fn death_reason(&self) -> Option<String> {
        self.died.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Resolves when the VM is gone: QEMU exited without being asked, or it was destroyed.
    pub async fn dead(&self) {
        let mut rx = self.dead_rx.clone();
        let _ = rx.wait_for(|d| *d).await;
    }

    /// Runs `sync` in the guest (best effort, bounded): the writable disk's file on the host
    /// then holds everything written so far (it has no journal to replay).
    pub async fn sync_guest(&self) {
        let sync = Request::Exec {
            argv: vec!["/bin/sync".into()],
            timeout_ms: 30_000,
            env: Default::default(),
            cwd: None,
            user: None,
            max_output: 4096,
            stream: false,
        };
        match tokio::time::timeout(
            Duration::from_secs(30),
            self.aether.run(sync, bytes::Bytes::new()),
        )
        .await
        {
            Ok(Ok(out)) if out.outcome.exit_code == 0 => {}
            other => {
                tracing::warn!(vm = %self.id, result = ?other.map(|r| r.map(|o| o.outcome.exit_code)), "sync in the guest failed")
            }
        }
    }

    /// Ends QEMU (if it runs) and closes the channel. Idempotent.
    pub async fn kill(&self) -> Result<(), VmError> {
        let mut phase = self.phase.lock().await;
        let result = match std::mem::replace(&mut *phase, Phase::Gone) {
            Phase::Running(p) => {
                p.intentional.store(true, Ordering::SeqCst);
                let mut exited = p.exited.clone();
                if !*exited.borrow() {
                    // SAFETY: kill(2) on QEMU's pid, not reaped yet (its waiter has not
                    // reported the exit).
                    unsafe { libc::kill(p.pid, libc::SIGKILL) };
                }
                let r =
                    tokio::time::timeout(Duration::from_secs(10), exited.wait_for(|e| *e)).await;
                // Dropping the relay's halves closes the client's channel.
                drop(p.relay);
                if r.is_err() {
                    Err(VmError::KillTimeout(p.pid))
                } else {
                    Ok(())
                }
            }
            Phase::Paused(parked) => {
                drop(parked);
                Ok(())
            }
            Phase::Gone => Ok(()),
        };
        self.pid.store(0, Ordering::SeqCst);
        let _ = self.dead_tx.send(true);
        result
    }
}

/// A sandbox running on a [`Vm`]: a microVM or a full VM. Both substrates share the VM's life
/// (boot, pause by snapshot, resume, kill); the edge drives them through this.
pub trait VmSandbox: Send + Sync {
    fn vm(&self) -> &Vm;
    /// The VM's directory on the host (disks, sockets, console log, snapshot).
    fn vm_dir(&self) -> &Path;
}

/// The destroy of both VM substrates: kills QEMU (or forgets the snapshot of a paused VM) and
/// removes the VM's directory (disks, sockets, snapshot). Idempotent.
pub async fn destroy_vm(
    id: &str,
    vm: &Vm,
    vm_dir: &Path,
) -> Result<(), crate::substrate::DestroySandboxError> {
    use crate::substrate::DestroySandboxError;
    vm.kill().await.map_err(|e| DestroySandboxError::Io {
        id: id.to_string(),
        what: e.to_string(),
        source: io::Error::from(io::ErrorKind::TimedOut),
    })?;
    match tokio::fs::remove_dir_all(vm_dir).await {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(DestroySandboxError::Io {
            id: id.to_string(),
            what: format!("remove {}", vm_dir.display()),
            source,
        }),
    }
}

/// After a failed create of either VM substrate (QEMU already gone: killed on the error paths
/// or on drop): removes the VM's directory and returns the error to report (with the cleanup's
/// failure, if any).
pub async fn cleanup_failed_create(
    id: &str,
    vm_dir: &Path,
    e: crate::substrate::CreateSandboxError,
) -> crate::substrate::CreateSandboxError {
    match tokio::fs::remove_dir_all(vm_dir).await {
        Err(c) if c.kind() != io::ErrorKind::NotFound => {
            crate::substrate::CreateSandboxError::WithCleanup {
                id: id.to_string(),
                error: Box::new(e),
                cleanup: format!("remove {}: {c}", vm_dir.display()),
            }
        }
        _ => e,
    }
}

/// Ends the QEMU of a VM (microVM or full VM) an earlier edge run left running (found by its
/// pidfile `<vm dir>/qemu.pid`, and only if that pid is a QEMU process whose command line names
/// this VM directory: a recycled pid may be another VM's QEMU); whether one was killed.
pub fn kill_leftover_qemu(vm_dir: &Path) -> bool {
    let pid = std::fs::read_to_string(vm_dir.join("qemu.pid"))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
        .filter(|p| *p > 1);
    let Some(pid) = pid else { return false };
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    if !comm.starts_with("qemu-system") {
        return false;
    }
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let needle = vm_dir.as_os_str().as_encoded_bytes();
    if needle.is_empty() || !cmdline.windows(needle.len()).any(|w| w == needle) {
        return false;
    }
    // SAFETY: kill(2) with a pid read from the VM's pidfile whose process is this VM's QEMU
    // (checked just above via /proc/<pid>/comm and its command line); no memory is touched.
    unsafe { libc::kill(pid, libc::SIGKILL) == 0 }
}
