//! The microVM substrate: each sandbox is a QEMU guest with its own kernel.
//!
//! The guest's kernel and base initramfs are built by `scripts/vm/build-guest.sh` from Debian
//! packages. Per VM the substrate:
//! 1. resolves the image's layers to files: the EROFS metadata image of each mounted lower and,
//!    for split layers, its data blob — attached as read-only virtio disks (serial `dsec-m<i>` /
//!    `dsec-b<i>`), which the guest's `/init` mounts (`-o device=`) under an overlay with a
//!    tmpfs upper (the writable layer lives in guest memory for now);
//! 2. prepends a small cpio (the static aether binary, env, hostname) to the base initramfs;
//! 3. listens on a unix socket and starts QEMU, whose virtio-serial port `dsec.aether`
//!    connects to it: that stream is the aether channel, and aether (the guest's PID 1 after
//!    `switch_root`, in bare mode) greets with `Ready`;
//! 4. destroy kills QEMU and removes the VM's directory (`<sandbox dir>/vm`).

pub mod cpio;
pub mod qemu;
pub mod qmp;

use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use crate::aether_client::AetherClient;
use crate::substrate::{
    CreateSandboxError, DestroySandboxError, Sandbox, SandboxSpec, Substrate, Usage,
};
pub use qemu::{Accel, GuestLayer, Machine};

/// Configuration of the microVM substrate.
#[derive(Debug, Clone)]
pub struct MicroVmConfig {
    /// Directory with `vmlinuz` and `initrd.img` (from `scripts/vm/build-guest.sh`).
    pub guest_dir: PathBuf,
    /// The static aether binary injected into each guest.
    pub aether_path: PathBuf,
    pub qemu_binary: PathBuf,
    pub accel: Accel,
    pub machine: Machine,
    /// Directories holding split layers' data blobs as `<digest>.blob`.
    pub blob_dirs: Vec<PathBuf>,
    /// How long the guest may take from QEMU's start to aether's `Ready`.
    pub boot_timeout: Duration,
}

impl MicroVmConfig {
    /// Defaults from the environment: `DSEC_MICROVM_ACCEL` (`kvm` | `tcg`, default `tcg`:
    /// this project's CI has no working KVM), `DSEC_MICROVM_MACHINE` (`pc` | `microvm`,
    /// default `pc`), `DSEC_QEMU` (default `qemu-system-x86_64`).
    pub fn from_env(guest_dir: PathBuf, aether_path: PathBuf, blob_dirs: Vec<PathBuf>) -> Self {
        let accel = match std::env::var("DSEC_MICROVM_ACCEL").as_deref() {
            Ok("kvm") => Accel::Kvm,
            _ => Accel::Tcg,
        };
        let machine = match std::env::var("DSEC_MICROVM_MACHINE").as_deref() {
            Ok("microvm") => Machine::Microvm,
            _ => Machine::Pc,
        };
        MicroVmConfig {
            guest_dir,
            aether_path,
            qemu_binary: std::env::var_os("DSEC_QEMU")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("qemu-system-x86_64")),
            accel,
            machine,
            blob_dirs,
            boot_timeout: Duration::from_secs(120),
        }
    }

    /// Whether the guest artefacts exist; the error says how to build them.
    pub fn check_guest(&self) -> Result<(), String> {
        for f in ["vmlinuz", "initrd.img"] {
            if !self.guest_dir.join(f).is_file() {
                return Err(format!(
                    "the microVM guest is not built ({} is missing): run scripts/vm/build-guest.sh",
                    self.guest_dir.join(f).display()
                ));
            }
        }
        Ok(())
    }
}

/// Runs sandboxes as QEMU guests.
#[derive(Debug, Clone)]
pub struct MicroVmSubstrate {
    config: MicroVmConfig,
    /// The aether binary as put into guests (stripped of debug info when `strip` exists: it
    /// is unpacked and copied in every boot), keyed by the source's size and mtime.
    aether_cache: Arc<Mutex<AetherCache>>,
}

type AetherCache = Option<(u64, SystemTime, Arc<Vec<u8>>)>;

/// One running guest.
pub struct MicroVmSandbox {
    id: String,
    vm_dir: PathBuf,
    pid: i32,
    aether: AetherClient,
    /// Becomes true once QEMU exited (and was reaped).
    exited: watch::Receiver<bool>,
}

impl std::fmt::Debug for MicroVmSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MicroVmSandbox")
            .field("id", &self.id)
            .field("pid", &self.pid)
            .finish()
    }
}

impl MicroVmSandbox {
    /// Resolves when QEMU has exited.
    pub async fn exited(&self) {
        let mut rx = self.exited.clone();
        let _ = rx.wait_for(|e| *e).await;
    }

    pub fn has_exited(&self) -> bool {
        *self.exited.borrow()
    }

    /// The VM's directory on the host (sockets, initramfs, console log).
    pub fn vm_dir(&self) -> &Path {
        &self.vm_dir
    }
}

impl Sandbox for MicroVmSandbox {
    fn id(&self) -> &str {
        &self.id
    }
    fn aether(&self) -> &AetherClient {
        &self.aether
    }
    fn pid(&self) -> i32 {
        self.pid
    }
    fn usage(&self) -> Usage {
        // QEMU's resident memory: the guest's RAM as far as it was touched, plus QEMU itself.
        let rss = std::fs::read_to_string(format!("/proc/{}/statm", self.pid))
            .ok()
            .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
            .unwrap_or(0);
        Usage {
            memory_bytes: rss * 4096,
            pids: 1,
            oom_kills: 0,
        }
    }
}

/// Resolves mounted lowers (`<store>/mnt/<digest>`) to the files behind them: the metadata
/// image `<store>/layers/<digest>.erofs` and, when one of `blob_dirs` holds `<digest>.blob`,
/// the data blob.
pub fn resolve_layers(
    lowers: &[PathBuf],
    blob_dirs: &[PathBuf],
) -> Result<Vec<GuestLayer>, String> {
    lowers
        .iter()
        .map(|l| {
            let digest = l
                .file_name()
                .and_then(|d| d.to_str())
                .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_alphanumeric()))
                .ok_or_else(|| format!("layer mount {} is not named by a digest", l.display()))?;
            let store = l.parent().and_then(Path::parent).ok_or_else(|| {
                format!("layer mount {} is not inside an image store", l.display())
            })?;
            let meta = store.join("layers").join(format!("{digest}.erofs"));
            if !meta.is_file() {
                return Err(format!(
                    "layer {digest}: metadata image {} not found",
                    meta.display()
                ));
            }
            let blob = blob_dirs
                .iter()
                .map(|d| d.join(format!("{digest}.blob")))
                .find(|p| p.is_file());
            Ok(GuestLayer { meta, blob })
        })
        .collect()
}

/// What the edge sends once connected; the guest's `/init` waits for it.
const SYNC_BYTE: &[u8] = b"S";

/// Connects to QEMU's listening socket, retrying until it exists.
async fn connect_when_listening(path: &Path) -> io::Result<tokio::net::UnixStream> {
    loop {
        match tokio::net::UnixStream::connect(path).await {
            Ok(s) => return Ok(s),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                ) =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => return Err(e),
        }
    }
}

fn spawn_err(what: &str, e: io::Error) -> CreateSandboxError {
    CreateSandboxError::Spawn(io::Error::new(e.kind(), format!("{what}: {e}")))
}

/// The last lines of the guest's console, for error messages.
fn console_tail(vm_dir: &Path) -> String {
    // Our init's and aether's own lines (not the kernel's `[ time] ...`), then the last ones.
    let text = std::fs::read_to_string(vm_dir.join("console.log")).unwrap_or_default();
    let ours: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('[') && !l.trim().is_empty())
        .collect();
    let all: Vec<&str> = text.lines().collect();
    let mut out = ours[ours.len().saturating_sub(10)..].to_vec();
    out.extend_from_slice(&all[all.len().saturating_sub(3)..]);
    out.join(" | ")
}

impl MicroVmSubstrate {
    pub fn new(config: MicroVmConfig) -> Self {
        MicroVmSubstrate {
            config,
            aether_cache: Arc::new(Mutex::new(None)),
        }
    }

    /// The aether binary for guests: stripped once per build of it (falls back to the binary
    /// as it is when `strip` is missing or fails).
    async fn guest_aether(&self, scratch: &Path) -> io::Result<Arc<Vec<u8>>> {
        let src = &self.config.aether_path;
        let meta = tokio::fs::metadata(src)
            .await
            .map_err(|e| io::Error::new(e.kind(), format!("aether {}: {e}", src.display())))?;
        let key = (meta.len(), meta.modified()?);
        if let Some((len, mtime, bytes)) =
            &*self.aether_cache.lock().unwrap_or_else(|p| p.into_inner())
        {
            if (*len, *mtime) == key {
                return Ok(bytes.clone());
            }
        }
        let stripped = scratch.join("aether.stripped");
        let ok = tokio::process::Command::new("strip")
            .arg("-o")
            .arg(&stripped)
            .arg(src)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await
            .map(|s| s.success())
            .unwrap_or(false);
        let bytes = if ok {
            tokio::fs::read(&stripped).await?
        } else {
            tracing::warn!(aether = %src.display(), "strip failed; guests get the unstripped aether");
            tokio::fs::read(src).await?
        };
        let _ = tokio::fs::remove_file(&stripped).await;
        let bytes = Arc::new(bytes);
        *self.aether_cache.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((key.0, key.1, bytes.clone()));
        Ok(bytes)
    }

    pub fn config(&self) -> &MicroVmConfig {
        &self.config
    }

    /// Writes `<vm_dir>/initrd.img`: a cpio with aether, env and hostname, then the base one.
    async fn write_initrd(&self, spec: &SandboxSpec, vm_dir: &Path) -> io::Result<PathBuf> {
        let aether = self.guest_aether(vm_dir).await?;
        let base = tokio::fs::read(self.config.guest_dir.join("initrd.img")).await?;
        let mut env = String::new();
        for (k, v) in &spec.env {
            env.push_str(&format!("export {k}={}\n", cpio::shell_quote(v)));
        }
        let hostname = format!("{}\n", spec.hostname);
        let mut out = cpio::archive(&[
            cpio::Entry {
                name: "dsec-aether",
                mode: 0o755,
                data: &aether,
            },
            cpio::Entry {
                name: "dsec-env",
                mode: 0o644,
                data: env.as_bytes(),
            },
            cpio::Entry {
                name: "dsec-hostname",
                mode: 0o644,
                data: hostname.as_bytes(),
            },
        ]);
        out.extend_from_slice(&base);
        let path = vm_dir.join("initrd.img");
        tokio::fs::write(&path, out).await?;
        Ok(path)
    }

    async fn start(
        &self,
        spec: &SandboxSpec,
        vm_dir: &Path,
    ) -> Result<MicroVmSandbox, CreateSandboxError> {
        if spec.user != "root" && spec.user != "0" {
            return Err(CreateSandboxError::InvalidSpec(format!(
                "init_user {:?}: microVM sandboxes run commands as root only (for now)",
                spec.user
            )));
        }
        if !spec.env.is_empty() {
            // aether in bare mode starts commands with an empty base environment; the guest's
            // /init exports /dsec-env, but aether does not pass it on yet.
            return Err(CreateSandboxError::InvalidSpec(
                "env: sandbox-wide environment variables are not supported for microVM sandboxes yet; pass env per command".into(),
            ));
        }
        self.config
            .check_guest()
            .map_err(CreateSandboxError::InvalidSpec)?;
        let layers = resolve_layers(&spec.lowers, &self.config.blob_dirs)
            .map_err(CreateSandboxError::InvalidSpec)?;
        if layers.is_empty() {
            return Err(CreateSandboxError::InvalidSpec(
                "the image has no layers".into(),
            ));
        }
        tokio::fs::create_dir_all(vm_dir)
            .await
            .map_err(|e| spawn_err("create the VM directory", e))?;
        let initrd = self
            .write_initrd(spec, vm_dir)
            .await
            .map_err(|e| spawn_err("write the initramfs", e))?;
        let sock = vm_dir.join("aether.sock");
        let kernel = self.config.guest_dir.join("vmlinuz");
        let console = vm_dir.join("console.log");
        let qmp = vm_dir.join("qmp.sock");
        let pidfile = vm_dir.join("qemu.pid");
        let args = qemu::command_line(&qemu::QemuArgs {
            machine: self.config.machine,
            accel: self.config.accel,
            memory_mb: spec.memory_limit_mb.max(128),
            vcpus: spec.cpu_cores_limit.ceil().max(1.0) as u32,
            kernel: &kernel,
            initrd: &initrd,
            console_log: &console,
            aether_socket: &sock,
            qmp_socket: &qmp,
            pidfile: &pidfile,
            layers: &layers,
        });
        let log = std::fs::File::create(vm_dir.join("qemu.log"))
            .map_err(|e| spawn_err("create qemu.log", e))?;
        let log2 = log.try_clone().map_err(|e| spawn_err("dup qemu.log", e))?;
        let mut child = tokio::process::Command::new(&self.config.qemu_binary)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| spawn_err(&format!("start {}", self.config.qemu_binary.display()), e))?;
        let pid = child.id().map(|p| p as i32).unwrap_or(0);
        tracing::info!(
            sandbox = %spec.id, pid, accel = self.config.accel.as_str(),
            machine = self.config.machine.as_str(), layers = layers.len(), "microVM started"
        );
        // QEMU listens on the channel socket once it has started; it may also die first.
        let stream = tokio::select! {
            r = tokio::time::timeout(Duration::from_secs(30), connect_when_listening(&sock)) => match r {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return Err(spawn_err("connect the aether channel", e)),
                Err(_) => return Err(CreateSandboxError::Setup("QEMU did not open the aether channel socket within 30 s".into())),
            },
            st = child.wait() => {
                let log = std::fs::read_to_string(vm_dir.join("qemu.log")).unwrap_or_default();
                return Err(CreateSandboxError::Setup(format!("QEMU exited at start ({st:?}): {}", log.trim())));
            }
        };
        let mut stream = stream;
        // The guest's /init waits for this byte before starting aether: a read of a
        // virtio-serial port whose host side is not yet open returns EOF.
        tokio::io::AsyncWriteExt::write_all(&mut stream, SYNC_BYTE)
            .await
            .map_err(|e| spawn_err("send the sync byte", e))?;
        let aether = AetherClient::new(stream);
        let (tx, rx) = watch::channel(false);
        let ready = tokio::select! {
            r = tokio::time::timeout(self.config.boot_timeout, aether.wait_ready()) => match r {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("the guest's channel closed before Ready: {e}")),
                Err(_) => Err(format!("the guest sent no Ready within {:?}", self.config.boot_timeout)),
            },
            st = child.wait() => Err(format!("QEMU exited during boot ({st:?})")),
        };
        if let Err(msg) = ready {
            let _ = child.start_kill();
            let _ = child.wait().await;
            return Err(CreateSandboxError::Setup(format!(
                "{msg}; guest console: {}",
                console_tail(vm_dir)
            )));
        }
        tokio::spawn(async move {
            let _ = child.wait().await;
            let _ = tx.send(true);
        });
        Ok(MicroVmSandbox {
            id: spec.id.clone(),
            vm_dir: vm_dir.to_path_buf(),
            pid,
            aether,
            exited: rx,
        })
    }
}

impl Substrate for MicroVmSubstrate {
    type Sandbox = MicroVmSandbox;

    fn name(&self) -> &'static str {
        "microvm"
    }

    async fn create(&self, spec: SandboxSpec) -> Result<MicroVmSandbox, CreateSandboxError> {
        let vm_dir = spec.dir.join("vm");
        match self.start(&spec, &vm_dir).await {
            Ok(s) => Ok(s),
            Err(e) => {
                // QEMU is gone (killed on the error paths or on drop); remove its files.
                if let Err(c) = tokio::fs::remove_dir_all(&vm_dir).await {
                    if c.kind() != io::ErrorKind::NotFound {
                        return Err(CreateSandboxError::WithCleanup {
                            id: spec.id.clone(),
                            error: Box::new(e),
                            cleanup: format!("remove {}: {c}", vm_dir.display()),
                        });
                    }
                }
                Err(e)
            }
        }
    }

    async fn destroy(&self, sandbox: &MicroVmSandbox) -> Result<(), DestroySandboxError> {
        if !sandbox.has_exited() {
            // SAFETY: kill(2) with a pid and a signal; the pid is QEMU's, still unreaped (the
            // waiter task reaps it only after it exits, and `exited` is not yet set).
            unsafe { libc::kill(sandbox.pid, libc::SIGKILL) };
            if tokio::time::timeout(Duration::from_secs(10), sandbox.exited())
                .await
                .is_err()
            {
                return Err(DestroySandboxError::Io {
                    id: sandbox.id.clone(),
                    what: format!("QEMU (pid {}) did not exit after SIGKILL", sandbox.pid),
                    source: io::Error::from(io::ErrorKind::TimedOut),
                });
            }
        }
        match tokio::fs::remove_dir_all(&sandbox.vm_dir).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(DestroySandboxError::Io {
                id: sandbox.id.clone(),
                what: format!("remove {}", sandbox.vm_dir.display()),
                source,
            }),
        }
    }

    async fn reap_orphans(&self, _known_live: &[String]) -> Vec<String> {
        // QEMU processes are children of the edge (killed on drop); a crashed edge's guests die
        // with their channel (aether exits, the kernel panics, -no-reboot ends QEMU).
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_resolve_to_meta_and_blob() {
        let t = tempfile::tempdir().unwrap();
        let store = t.path();
        std::fs::create_dir_all(store.join("layers")).unwrap();
        std::fs::create_dir_all(store.join("blobs")).unwrap();
        std::fs::write(store.join("layers/abc.erofs"), b"m").unwrap();
        std::fs::write(store.join("layers/def.erofs"), b"m").unwrap();
        std::fs::write(store.join("blobs/abc.blob"), b"b").unwrap();
        let lowers = vec![store.join("mnt/abc"), store.join("mnt/def")];
        let l = resolve_layers(&lowers, &[store.join("blobs")]).unwrap();
        assert_eq!(l[0].meta, store.join("layers/abc.erofs"));
        assert_eq!(l[0].blob, Some(store.join("blobs/abc.blob")));
        assert_eq!(l[1].blob, None);
        assert!(resolve_layers(&[store.join("mnt/zzz")], &[]).is_err());
        assert!(resolve_layers(&[store.join("mnt/../x")], &[]).is_err());
    }
}
