//! The microVM substrate: each sandbox is a QEMU guest with its own kernel.
//!
//! The guest's kernel and base initramfs are built by `scripts/vm/build-guest.sh` from Debian
//! packages. Per VM the substrate:
//! 1. resolves the image's layers to files: the EROFS metadata image of each mounted lower and,
//!    for split layers, its data blob — attached as read-only virtio disks (serial `dsec-m<i>` /
//!    `dsec-b<i>`), which the guest's `/init` mounts (`-o device=`) under an overlay whose
//!    upper and work directories live on a per-VM writable disk: a sparse raw ext4 image
//!    (`<vm dir>/upper.img`, no journal, serial `dsec-upper`) — a disk limit, and writable
//!    state that stays on the host across a pause and that `pack` can read;
//! 2. prepends a small cpio (the static aether binary, env, hostname) to the base initramfs;
//! 3. listens on a unix socket and starts QEMU, whose virtio-serial port `dsec.aether`
//!    connects to it: that stream is the aether channel, and aether (the guest's PID 1 after
//!    `switch_root`, in bare mode) greets with `Ready`;
//! 4. pause snapshots the guest to disk and ends QEMU; resume restores it ([`vm`]);
//! 5. destroy kills QEMU and removes the VM's directory (`<sandbox dir>/vm`).
//!
//! With templates on ([`template`]), a create whose shape has a template restores the
//! template's snapshot instead of steps 2–3 (and gives the guest its own identity); the first
//! create of a shape boots cold and has a template built in the background.

pub mod cpio;
pub mod net;
pub mod pmem;
pub mod qemu;
pub mod qmp;
pub mod relay;
pub mod substrate;
pub mod template;
pub mod vm;

use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use crate::aether_client::AetherClient;
use crate::substrate::{CreateSandboxError, DestroySandboxError, SandboxSpec, Usage};
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
    /// Size of the per-VM writable disk (sparse) in MiB.
    pub disk_mb: u64,
    /// virtio-balloon with free page reporting.
    pub balloon: bool,
    /// Map read-only layers as virtio-pmem regions mounted with DAX (guests share the host's
    /// page cache of them) instead of virtio-blk disks.
    pub pmem: bool,
    /// Where the 2 MiB-padded copies of layer files for virtio-pmem are kept (by digest).
    pub pmem_dir: PathBuf,
}

impl MicroVmConfig {
    /// Defaults from the environment: `DSEC_MICROVM_ACCEL` (`kvm` | `tcg`, default `tcg`:
    /// this project's CI has no working KVM), `DSEC_MICROVM_MACHINE` (`microvm` | `pc`,
    /// default `microvm`; a microvm boot that fails for the machine's reasons falls back to
    /// `pc`), `DSEC_QEMU` (default `qemu-system-x86_64`), `DSEC_MICROVM_DISK_MB`
    /// (writable disk size, default 4096), `DSEC_MICROVM_BALLOON` (`0` turns virtio-balloon
    /// free page reporting off), `DSEC_MICROVM_PMEM` (`0` attaches layers as virtio-blk disks
    /// instead of virtio-pmem + DAX).
    pub fn from_env(guest_dir: PathBuf, aether_path: PathBuf, blob_dirs: Vec<PathBuf>) -> Self {
        let accel = match std::env::var("DSEC_MICROVM_ACCEL").as_deref() {
            Ok("kvm") => Accel::Kvm,
            _ => Accel::Tcg,
        };
        let machine = std::env::var("DSEC_MICROVM_MACHINE")
            .ok()
            .and_then(|m| Machine::parse(m.trim()))
            .unwrap_or(Machine::Microvm);
        MicroVmConfig {
            aether_path,
            qemu_binary: std::env::var_os("DSEC_QEMU")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("qemu-system-x86_64")),
            accel,
            machine,
            blob_dirs,
            boot_timeout: Duration::from_secs(120),
            disk_mb: std::env::var("DSEC_MICROVM_DISK_MB")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|&v: &u64| v >= 16)
                .unwrap_or(4096),
            balloon: std::env::var("DSEC_MICROVM_BALLOON").as_deref() != Ok("0"),
            pmem: std::env::var("DSEC_MICROVM_PMEM").as_deref() != Ok("0"),
            pmem_dir: guest_dir
                .parent()
                .unwrap_or(Path::new("/var/cache/dsec"))
                .join("pmem-layers"),
            guest_dir,
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
    /// Restore-from-template boots (None: off).
    templates: Option<Arc<template::Templates>>,
    /// The aether binary as put into guests (stripped of debug info when `strip` exists: it
    /// is unpacked and copied in every boot), keyed by the source's size and mtime.
    aether_cache: Arc<Mutex<AetherCache>>,
    /// Set once a `microvm` boot failed for the machine's reasons and the same guest then
    /// booted on `pc`: later VMs use `pc` directly.
    pc_fallback: Arc<std::sync::atomic::AtomicBool>,
}

type AetherCache = Option<(u64, SystemTime, Arc<Vec<u8>>)>;

/// One guest (running, or paused as a snapshot on disk).
pub struct MicroVmSandbox {
    id: String,
    vm_dir: PathBuf,
    vm: vm::Vm,
    boot: template::BootKind,
}

impl std::fmt::Debug for MicroVmSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MicroVmSandbox")
            .field("id", &self.id)
            .field("vm", &self.vm)
            .finish()
    }
}

impl MicroVmSandbox {
    /// Whether the guest booted cold or was restored from a template.
    pub fn boot_kind(&self) -> template::BootKind {
        self.boot
    }

    /// Resolves when the VM is gone (QEMU died on its own, or the VM was destroyed); a pause
    /// ending QEMU does not count.
    pub async fn exited(&self) {
        self.vm.dead().await
    }

    pub fn has_exited(&self) -> bool {
        self.vm.has_died()
    }

    /// The VM's directory on the host (sockets, initramfs, console log, disk, snapshot).
    pub fn vm_dir(&self) -> &Path {
        &self.vm_dir
    }

    /// The per-VM writable disk image.
    pub fn upper_disk(&self) -> PathBuf {
        self.vm_dir.join(UPPER_DISK)
    }

    /// Snapshots the guest to disk and ends QEMU.
    pub async fn pause(
        &self,
    ) -> Result<dsec_wire::api::PauseReport, crate::container::pause::PauseError> {
        self.vm.pause().await
    }

    /// Restores the guest from its snapshot.
    pub async fn resume(&self) -> Result<(), crate::container::pause::PauseError> {
        self.vm.resume().await
    }

    pub fn is_paused(&self) -> bool {
        self.vm.is_paused()
    }

    /// Stops (QMP `stop`) or continues (`cont`) the guest's vCPUs without a snapshot, e.g. to
    /// read its disk consistently. Fails while paused by snapshot.
    pub async fn freeze_vcpus(&self, freeze: bool) -> Result<(), String> {
        if self.vm.pid() <= 0 {
            return Err("the VM is not running".into());
        }
        let mut q = qmp::Qmp::connect_retry(&self.vm_dir.join("qmp.sock"), Duration::from_secs(5))
            .await
            .map_err(|e| e.to_string())?;
        if freeze {
            q.stop().await
        } else {
            q.cont().await
        }
        .map_err(|e| e.to_string())
    }
}

/// The writable disk mounted read-only on the host (for `pack`); [`UpperMount::release`]
/// unmounts it and lets the guest run again.
#[derive(Debug)]
pub struct UpperMount {
    /// The overlay upper directory inside the mount.
    pub upper: PathBuf,
    mnt: PathBuf,
    qmp: PathBuf,
    continue_guest: bool,
}

impl UpperMount {
    pub async fn release(self) -> Result<(), String> {
        let mut problems = Vec::new();
        if let Err(e) = run_tool("umount", &[self.mnt.as_os_str()]).await {
            problems.push(e);
        } else if let Err(e) = tokio::fs::remove_dir(&self.mnt).await {
            problems.push(format!("rmdir {}: {e}", self.mnt.display()));
        }
        if self.continue_guest {
            let r = async {
                let mut q = qmp::Qmp::connect_retry(&self.qmp, Duration::from_secs(5)).await?;
                q.cont().await
            }
            .await;
            if let Err(e) = r {
                problems.push(format!("continue the guest: {e}"));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

async fn run_tool(tool: &str, args: &[&std::ffi::OsStr]) -> Result<(), String> {
    let out = tokio::process::Command::new(tool)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| format!("run {tool}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{tool} {:?}: {}",
            args,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl MicroVmSandbox {
    /// Makes the writable disk readable on the host, consistently: `sync` in the guest, its
    /// vCPUs stopped (a paused VM is already still), then a read-only loop mount of the image
    /// (no journal: nothing to replay).
    pub async fn expose_upper(&self) -> Result<UpperMount, String> {
        let running = self.vm.pid() > 0;
        let qmp = self.vm_dir.join("qmp.sock");
        if running {
            self.vm.sync_guest().await;
            self.freeze_vcpus(true).await?;
        }
        let mnt = self.vm_dir.join("pack.mnt");
        let mounted = async {
            tokio::fs::create_dir_all(&mnt)
                .await
                .map_err(|e| format!("mkdir {}: {e}", mnt.display()))?;
            let img = self.upper_disk();
            run_tool(
                "mount",
                &[
                    "-t".as_ref(),
                    "ext4".as_ref(),
                    "-o".as_ref(),
                    "ro,loop,noload".as_ref(),
                    img.as_os_str(),
                    mnt.as_os_str(),
                ],
            )
            .await
        }
        .await;
        if let Err(e) = mounted {
            let _ = tokio::fs::remove_dir(&mnt).await;
            if running {
                let _ = self.freeze_vcpus(false).await;
            }
            return Err(e);
        }
        Ok(UpperMount {
            upper: mnt.join("upper"),
            mnt,
            qmp,
            continue_guest: running,
        })
    }
}

/// The writable disk's file name inside the VM directory.
pub const UPPER_DISK: &str = "upper.img";

impl vm::VmSandbox for MicroVmSandbox {
    fn vm(&self) -> &vm::Vm {
        &self.vm
    }
    fn vm_dir(&self) -> &Path {
        &self.vm_dir
    }
}

impl MicroVmSandbox {
    pub fn id(&self) -> &str {
        &self.id
    }
    /// The channel to the guest's aether.
    pub fn aether(&self) -> &AetherClient {
        self.vm.aether()
    }
    /// Host pid of the VM's QEMU (0 while paused).
    pub fn pid(&self) -> i32 {
        self.vm.pid()
    }
    pub fn usage(&self) -> Usage {
        // QEMU's resident memory: the guest's RAM as far as it was touched, plus QEMU itself
        // (0 while paused: the snapshot is on disk).
        Usage {
            memory_bytes: vm::rss_of(self.vm.pid()).0,
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
            Ok(GuestLayer {
                meta,
                blob,
                meta_pmem: None,
                blob_pmem: None,
            })
        })
        .collect()
}

fn spawn_err(what: &str, e: io::Error) -> CreateSandboxError {
    CreateSandboxError::Spawn(io::Error::new(e.kind(), format!("{what}: {e}")))
}

/// Whether a failed cold boot is the machine type's fault: QEMU exited before the guest's
/// /init handed over to aether (QEMU refused its command line, or the guest's kernel or /init
/// failed on the machine's devices), or the kernel hung before /init said anything. A guest
/// that reached aether failed for other reasons.
fn machine_failure(e: &vm::BootError, vm_dir: &Path) -> bool {
    let console = std::fs::read_to_string(vm_dir.join("console.log")).unwrap_or_default();
    (e.qemu_exited || e.init_silent) && !console.contains("root ready, starting aether")
}

/// How long a `microvm` guest may boot without a line from its /init before the boot counts
/// as hung on the machine (a boot prints its first line after ≈ 1 s of guest time; minutes
/// would mean a kernel stuck in early boot, e.g. in timer calibration).
const MICROVM_INIT_SILENCE: Duration = Duration::from_secs(30);

/// Resolves once `console` went `limit` without a line from the guest's /init; never if
/// one came.
async fn init_silent(console: &Path, limit: Duration) {
    let start = std::time::Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let text = tokio::fs::read(console).await.unwrap_or_default();
        if text.windows(10).any(|w| w == b"dsec-init:") {
            return std::future::pending().await;
        }
        if start.elapsed() >= limit {
            return;
        }
    }
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
            templates: None,
            aether_cache: Arc::new(Mutex::new(None)),
            pc_fallback: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        }
    }

    /// The machine type new VMs get: the configured one, or `pc` after a fallback, or `pc`
    /// when a `microvm` guest under TCG could not be told the TSC frequency (it would hang in
    /// TSC calibration: [`qemu::host_tsc_khz`]).
    pub fn machine(&self) -> Machine {
        if self.pc_fallback.load(std::sync::atomic::Ordering::Relaxed) {
            return Machine::Pc;
        }
        if self.config.machine == Machine::Microvm
            && self.config.accel == Accel::Tcg
            && qemu::host_tsc_khz().is_none()
        {
            static LOGGED: std::sync::Once = std::sync::Once::new();
            LOGGED.call_once(|| {
                tracing::warn!("microVM: no invariant TSC frequency for microvm guests under TCG; using the pc machine");
            });
            return Machine::Pc;
        }
        self.config.machine
    }

    /// Turns restore-from-template boots on (when `config.enabled`), templates kept in
    /// `config.dir`.
    pub fn with_templates(mut self, config: template::TemplateConfig) -> Self {
        if config.enabled {
            self.templates = Some(Arc::new(template::Templates::open(config)));
        }
        self
    }

    /// The template store, when templates are on.
    pub fn templates(&self) -> Option<&Arc<template::Templates>> {
        self.templates.as_ref()
    }

    /// Removes the virtio-pmem layer copies nothing needs any more ([`pmem::sweep`]; `protect`:
    /// the edge's sandboxes directory) and logs what the copies take.
    pub fn sweep_pmem(&self, protect: &[PathBuf]) -> io::Result<pmem::PmemSweep> {
        // Copies of unknown source (made before sidecars): a day for a create to claim them.
        let grace = std::env::var("DSEC_PMEM_LEGACY_GRACE_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(Duration::from_secs(86_400), Duration::from_secs);
        let s = pmem::sweep(&self.config.pmem_dir, protect, grace)?;
        tracing::info!(
            dir = %self.config.pmem_dir.display(), copies = s.kept, bytes = s.kept_bytes,
            in_use = s.in_use, without_sources = s.unknown, removed = s.removed.len(),
            removed_bytes = s.removed_bytes, "virtio-pmem layer copies"
        );
        Ok(s)
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
        // aether's --env-file (KEY=VALUE, NUL-ended) and --user (empty: root).
        let mut environ = Vec::new();
        for (k, v) in &spec.env {
            environ.extend_from_slice(format!("{k}={v}").as_bytes());
            environ.push(0);
        }
        let user = match spec.user.as_str() {
            "root" | "0" => "",
            u => u,
        };
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
            cpio::Entry {
                name: "dsec-environ",
                mode: 0o600,
                data: &environ,
            },
            cpio::Entry {
                name: "dsec-user",
                mode: 0o644,
                data: user.as_bytes(),
            },
        ]);
        out.extend_from_slice(&base);
        let path = vm_dir.join("initrd.img");
        tokio::fs::write(&path, out).await?;
        Ok(path)
    }

    /// The guest's layers as files (and their virtio-pmem copies when pmem is on and the
    /// machine has virtio-pmem).
    async fn guest_layers(
        &self,
        spec: &SandboxSpec,
        machine: Machine,
    ) -> Result<Vec<GuestLayer>, CreateSandboxError> {
        self.config
            .check_guest()
            .map_err(CreateSandboxError::InvalidSpec)?;
        let mut layers = resolve_layers(&spec.lowers, &self.config.blob_dirs)
            .map_err(CreateSandboxError::InvalidSpec)?;
        if layers.is_empty() {
            return Err(CreateSandboxError::InvalidSpec(
                "the image has no layers".into(),
            ));
        }
        if self.config.pmem && machine.supports_pmem() {
            for l in layers.iter_mut() {
                l.meta_pmem = pmem_copy(&self.config.pmem_dir, &l.meta).await;
                if let Some(b) = &l.blob {
                    l.blob_pmem = pmem_copy(&self.config.pmem_dir, b).await;
                }
            }
        }
        Ok(layers)
    }

    /// The request's disk limit, else the node's default size (sparse either way).
    fn disk_mb(&self, spec: &SandboxSpec) -> u64 {
        spec.disk_limit_mb.unwrap_or(self.config.disk_mb).max(16)
    }

    /// How QEMU is started for a guest of `spec` in `vm_dir`. Everything but the file paths is
    /// the guest's shape: a template snapshot restores only into the same shape.
    fn launch_for(
        &self,
        spec: &SandboxSpec,
        vm_dir: &Path,
        initrd: &Path,
        layers: &[GuestLayer],
        machine: Machine,
    ) -> vm::Launch {
        let mut args = qemu::command_line(&qemu::QemuArgs {
            machine,
            accel: self.config.accel,
            memory_mb: spec.memory_limit_mb.max(128),
            vcpus: spec.cpu_cores_limit.ceil().max(1.0) as u32,
            kernel: &self.config.guest_dir.join("vmlinuz"),
            initrd,
            console_log: &vm_dir.join("console.log"),
            aether_socket: &vm_dir.join("aether.sock"),
            qmp_socket: &vm_dir.join("qmp.sock"),
            pidfile: &vm_dir.join("qemu.pid"),
            layers,
            upper: Some(&vm_dir.join(UPPER_DISK)),
            balloon: self.config.balloon,
            // Under KVM the guest has kvmclock; under TCG its TSC is the host's.
            tsc_khz: (self.config.accel == Accel::Tcg && machine == Machine::Microvm)
                .then(qemu::host_tsc_khz)
                .flatten(),
        });
        if self.templates.is_some() && machine == Machine::Pc {
            // A VM generation id (ACPI): a guest kernel with the vmgenid driver reseeds its
            // RNG when a restore changes it (`guid=auto`: a new id per start and restore).
            args.extend(["-device".to_string(), "vmgenid,guid=auto".to_string()]);
        }
        vm::Launch {
            qemu_binary: self.config.qemu_binary.clone(),
            args,
        }
    }

    /// The template key of a create, or None when it cannot have one (templates off, a
    /// networked VM).
    async fn template_key(
        &self,
        spec: &SandboxSpec,
        layers: &[GuestLayer],
        machine: Machine,
    ) -> Option<(String, String)> {
        let t = self.templates.as_ref()?;
        if !t.enabled() || spec.netns.is_some() {
            return None;
        }
        let digest = |p: PathBuf| async move { t.file_digest(&p).await };
        let r = async {
            let kernel = digest(self.config.guest_dir.join("vmlinuz")).await?;
            let initrd = digest(self.config.guest_dir.join("initrd.img")).await?;
            let aether = digest(self.config.aether_path.clone()).await?;
            io::Result::Ok((kernel, initrd, aether))
        }
        .await;
        let (kernel, initrd, aether) = match r {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(error = %e, "no microVM template key (digest of a guest artefact)");
                return None;
            }
        };
        let name = |p: &Path| {
            p.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        let layers: Vec<String> = layers
            .iter()
            .map(|l| {
                format!(
                    "{}{}+{}{}",
                    name(&l.meta),
                    if l.meta_pmem.is_some() { "@pmem" } else { "" },
                    l.blob.as_deref().map(name).unwrap_or_default(),
                    if l.blob_pmem.is_some() { "@pmem" } else { "" },
                )
            })
            .collect();
        let shape = format!(
            "kernel={kernel} initrd={initrd} aether={aether} qemu={} machine={} accel={} \
             mem={} vcpus={} disk_mb={} balloon={} layers={} user={:?} env={:?}",
            self.config.qemu_binary.display(),
            machine.as_str(),
            self.config.accel.as_str(),
            spec.memory_limit_mb.max(128),
            spec.cpu_cores_limit.ceil().max(1.0) as u32,
            self.disk_mb(spec),
            self.config.balloon,
            layers.join(","),
            spec.user,
            spec.env,
        );
        Some((template::key_of(&shape), shape))
    }

    async fn start(
        &self,
        spec: &SandboxSpec,
        vm_dir: &Path,
    ) -> Result<MicroVmSandbox, CreateSandboxError> {
        let mut machine = self.machine();
        let mut layers = self.guest_layers(spec, machine).await?;
        let mut key = self.template_key(spec, &layers, machine).await;
        let mut boot = template::BootKind::Cold;
        if let (Some((key, _)), Some(t)) = (&key, &self.templates) {
            if let Some(tpl) = t.lookup(key) {
                match self
                    .start_from_template(spec, vm_dir, &tpl, &layers, machine)
                    .await
                {
                    Ok(vm) => {
                        t.stats
                            .templated
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::info!(sandbox = %spec.id, pid = vm.pid(), template = %key, boot = "template", "microVM ready");
                        return Ok(MicroVmSandbox {
                            id: spec.id.clone(),
                            vm_dir: vm_dir.to_path_buf(),
                            vm,
                            boot: template::BootKind::Template,
                        });
                    }
                    Err(e) => {
                        t.stats
                            .fallbacks
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::warn!(sandbox = %spec.id, template = %key, error = %e, "microVM template failed to restore: dropped, booting cold");
                        t.drop_template(key);
                        let _ = tokio::fs::remove_dir_all(vm_dir).await;
                        boot = template::BootKind::ColdFallback;
                    }
                }
            }
        }
        tokio::fs::create_dir_all(vm_dir)
            .await
            .map_err(|e| spawn_err("create the VM directory", e))?;
        // A NIC on the sandbox's network namespace (net.rs): bridge + tap there, QEMU in it.
        // Prepared once: a fallback boot reuses it.
        let nic = net::attach(spec.netns.clone(), vm_dir).await?;
        let vm = match self
            .boot_cold(spec, vm_dir, &layers, machine, nic.as_ref())
            .await
        {
            Ok(vm) => vm,
            Err(e) if machine == Machine::Microvm && machine_failure(&e, vm_dir) => {
                tracing::warn!(
                    sandbox = %spec.id, error = %e.msg,
                    "microVM: the microvm machine failed to boot the guest; retrying on pc"
                );
                // The failed attempt's logs stay for a look: console-microvm.log, qemu.log.
                let _ = std::fs::rename(
                    vm_dir.join("console.log"),
                    vm_dir.join("console-microvm.log"),
                );
                machine = Machine::Pc;
                layers = self.guest_layers(spec, machine).await?;
                key = self.template_key(spec, &layers, machine).await;
                let vm = self
                    .boot_cold(spec, vm_dir, &layers, machine, nic.as_ref())
                    .await
                    .map_err(|e2| {
                        CreateSandboxError::Setup(format!(
                            "{e2}; guest console: {} (booted on pc after microvm failed: {e})",
                            console_tail(vm_dir)
                        ))
                    })?;
                if !self
                    .pc_fallback
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::warn!(
                        "microVM: the microvm machine fails here and pc works: new VMs use pc"
                    );
                }
                vm
            }
            Err(e) => {
                return Err(CreateSandboxError::Setup(format!(
                    "{e}; guest console: {}",
                    console_tail(vm_dir)
                )))
            }
        };
        if let Some(t) = &self.templates {
            t.stats
                .cold
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        tracing::info!(sandbox = %spec.id, pid = vm.pid(), boot = boot.as_str(), machine = machine.as_str(), "microVM ready");
        if let Some((key, shape)) = key {
            self.spawn_template_build(spec, key, shape, machine);
        }
        Ok(MicroVmSandbox {
            id: spec.id.clone(),
            vm_dir: vm_dir.to_path_buf(),
            vm,
            boot,
        })
    }

    /// Boots the guest's kernel (init_user and env reach aether through the initramfs:
    /// /dsec-user, /dsec-environ, which the guest's /init passes as --user / --env-file).
    /// `vm_dir` exists; `nic` is the guest's NIC ([`net::attach`]) if it has one.
    async fn boot_cold(
        &self,
        spec: &SandboxSpec,
        vm_dir: &Path,
        layers: &[GuestLayer],
        machine: Machine,
        nic: Option<&net::VmNet>,
    ) -> Result<vm::Vm, vm::BootError> {
        let initrd = self
            .write_initrd(spec, vm_dir)
            .await
            .map_err(|e| format!("write the initramfs: {e}"))?;
        make_upper_disk(&vm_dir.join(UPPER_DISK), self.disk_mb(spec))
            .await
            .map_err(|e| format!("create the writable disk: {e}"))?;
        let mut launch = self.launch_for(spec, vm_dir, &initrd, layers, machine);
        if let Some(n) = nic {
            net::add_to_microvm(&mut launch.args, n, machine);
        }
        tracing::info!(
            sandbox = %spec.id, accel = self.config.accel.as_str(),
            machine = machine.as_str(), layers = layers.len(), "microVM starting"
        );
        let boot = vm::Vm::boot(&spec.id, vm_dir, launch, self.config.boot_timeout);
        if machine != Machine::Microvm {
            return boot.await;
        }
        let console = vm_dir.join("console.log");
        tokio::select! {
            r = boot => r,
            // Dropping the boot ends QEMU (kill on drop).
            _ = init_silent(&console, MICROVM_INIT_SILENCE) => Err(vm::BootError {
                msg: format!(
                    "the guest's /init printed nothing within {MICROVM_INIT_SILENCE:?} (the \
                     kernel hangs early on the {} machine?)",
                    machine.as_str()
                ),
                qemu_exited: false,
                init_silent: true,
            }),
        }
    }

    /// A clone of `tpl`: its disk copied, its snapshot restored, then the guest's own identity
    /// (hostname, wall clock, fresh randomness) set over the aether channel.
    async fn start_from_template(
        &self,
        spec: &SandboxSpec,
        vm_dir: &Path,
        tpl: &template::Template,
        layers: &[GuestLayer],
        machine: Machine,
    ) -> Result<vm::Vm, String> {
        tokio::fs::create_dir_all(vm_dir)
            .await
            .map_err(|e| format!("create the VM directory: {e}"))?;
        // The clone's own initramfs file (a resume after the template is gone still needs
        // one): a hard link, or a copy across file systems.
        let initrd = vm_dir.join("initrd.img");
        if std::fs::hard_link(tpl.initrd(), &initrd).is_err() {
            tokio::fs::copy(tpl.initrd(), &initrd)
                .await
                .map_err(|e| format!("copy the template's initramfs: {e}"))?;
        }
        template::copy_disk(&tpl.disk(), &vm_dir.join(UPPER_DISK)).await?;
        let launch = self.launch_for(spec, vm_dir, &initrd, layers, machine);
        tracing::info!(sandbox = %spec.id, template = %tpl.key, "microVM restoring from its template");
        let vm = vm::Vm::restore_clone(&spec.id, vm_dir, launch, &tpl.snapshot()).await?;
        let seed = template::host_seed().map_err(|e| format!("host randomness: {e}"))?;
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let req = dsec_wire::aether::Request::SetIdentity {
            hostname: spec.hostname.clone(),
            unix_secs: now.as_secs() as i64,
            unix_nanos: now.subsec_nanos(),
        };
        let r = tokio::time::timeout(
            Duration::from_secs(30),
            vm.aether().request(req, bytes::Bytes::from(seed)),
        )
        .await;
        let err = match r {
            Ok(Ok((dsec_wire::aether::Reply::Done, _))) => return Ok(vm),
            Ok(Ok((other, _))) => format!("set the guest's identity: unexpected reply {other:?}"),
            Ok(Err(e)) => format!("set the guest's identity: {e}"),
            Err(_) => "set the guest's identity: no answer within 30 s".to_string(),
        };
        let _ = vm.kill().await;
        Err(err)
    }

    /// Builds the template of a shape in the background (unless it exists or is being built).
    fn spawn_template_build(
        &self,
        spec: &SandboxSpec,
        key: String,
        shape: String,
        machine: Machine,
    ) {
        let Some(t) = self.templates.clone() else {
            return;
        };
        let Some(dir) = t.claim_build(&key) else {
            return;
        };
        let this = self.clone();
        let spec = SandboxSpec {
            id: format!("template-{}", &key[..12]),
            hostname: "dsec-template".into(),
            dir: dir.clone(),
            ..spec.clone()
        };
        let t2 = t.clone();
        let h = tokio::spawn(async move {
            let r = tokio::select! {
                r = this.build_template(&spec, &key, shape, &dir, machine) => r,
                _ = t2.closing() => Err("the edge is stopping".to_string()),
            };
            t2.finish_build(&key, &dir, r);
        });
        t.track(h);
    }

    /// Boots one VM of the shape to `Ready`, snapshots it (which syncs its disk and ends QEMU)
    /// and leaves snapshot, disk and initramfs in `dir`.
    async fn build_template(
        &self,
        spec: &SandboxSpec,
        key: &str,
        shape: String,
        dir: &Path,
        machine: Machine,
    ) -> Result<template::TemplateMeta, String> {
        let started = std::time::Instant::now();
        let layers = self
            .guest_layers(spec, machine)
            .await
            .map_err(|e| e.to_string())?;
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|e| format!("create {}: {e}", dir.display()))?;
        let vm = self
            .boot_cold(spec, dir, &layers, machine, None)
            .await
            .map_err(|e| format!("{e}; guest console: {}", console_tail(dir)))?;
        // A guard: the VM ends if this future is dropped (edge stopping) mid-snapshot.
        struct KillOnDrop(Option<vm::Vm>);
        impl Drop for KillOnDrop {
            fn drop(&mut self) {
                if let Some(vm) = self.0.take() {
                    let pid = vm.pid();
                    if pid > 0 {
                        // SAFETY: kill(2) on the template VM's QEMU, a child of ours that the
                        // VM's waiter task has not reaped (pid > 0 while it runs).
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                }
            }
        }
        let mut guard = KillOnDrop(Some(vm));
        let paused = match &guard.0 {
            Some(vm) => vm.pause().await,
            None => unreachable!(),
        };
        let vm = guard.0.take();
        if let Err(e) = paused {
            if let Some(vm) = vm {
                let _ = vm.kill().await;
            }
            return Err(format!("snapshot the template VM: {e}"));
        }
        drop(vm);
        for f in ["aether.sock", "qmp.sock", "qemu.pid", vm::ARGS_FILE] {
            let _ = std::fs::remove_file(dir.join(f));
        }
        tracing::info!(template = %key, ms = started.elapsed().as_millis() as u64, "microVM template built");
        Ok(template::TemplateMeta {
            key: key.to_string(),
            shape,
            created: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        })
    }

    /// Takes over a paused microVM of an earlier edge run (its snapshot is on disk). A VM that
    /// was running when the edge went away is gone: its channel closed and the guest ended.
    pub fn adopt_paused(&self, id: &str, sandbox_dir: &Path) -> Result<MicroVmSandbox, String> {
        let vm_dir = sandbox_dir.join("vm");
        let vm = vm::Vm::adopt_paused(id, &vm_dir)?;
        Ok(MicroVmSandbox {
            id: id.to_string(),
            vm_dir,
            vm,
            boot: template::BootKind::Cold,
        })
    }
}

/// The copy of a layer file padded with zeros to [`qemu::PMEM_ALIGN`] for virtio-pmem, made
/// once per file (layer files are named by digest and never change). `None` (the layer is then
/// a virtio-blk disk) when it cannot be made.
async fn pmem_copy(dir: &Path, src: &Path) -> Option<PathBuf> {
    let name = src.file_name()?.to_str()?;
    let dst = dir.join(format!("{name}{}", pmem::COPY_SUFFIX));
    // Which layer files a copy serves, for its garbage collection (pmem.rs).
    let record = |dst: &Path| {
        if let Err(e) = pmem::record_source(dst, src) {
            tracing::warn!(copy = %dst.display(), error = %e, "record the source of a virtio-pmem copy");
        }
    };
    if dst.is_file() {
        record(&dst);
        return Some(dst);
    }
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.{}.{seq}.tmp", std::process::id()));
    let tmp_cleanup = tmp.clone();
    let (dir2, src2, dst2) = (dir.to_path_buf(), src.to_path_buf(), dst.clone());
    let made = tokio::task::spawn_blocking(move || -> io::Result<()> {
        std::fs::create_dir_all(&dir2)?;
        std::fs::copy(&src2, &tmp)?;
        let len = std::fs::metadata(&tmp)?.len();
        let padded = len.div_ceil(qemu::PMEM_ALIGN).max(1) * qemu::PMEM_ALIGN;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&tmp)?
            .set_len(padded)?;
        std::fs::rename(&tmp, &dst2)
    })
    .await;
    match made {
        Ok(Ok(())) => {
            record(&dst);
            Some(dst)
        }
        Ok(Err(e)) => {
            let _ = std::fs::remove_file(&tmp_cleanup);
            tracing::warn!(layer = %src.display(), error = %e, "no virtio-pmem copy of the layer; it is attached as a disk");
            None
        }
        Err(_) => None,
    }
}

/// Creates the sparse writable disk: a raw ext4 image without a journal (the host reads it
/// read-only for `pack` after a `sync` in the guest, which then sees everything in place).
async fn make_upper_disk(path: &Path, size_mb: u64) -> io::Result<()> {
    let f = std::fs::File::create(path)?;
    f.set_len(size_mb * 1024 * 1024)?;
    drop(f);
    let out = tokio::process::Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-O",
            "^has_journal",
            "-E",
            "root_owner=0:0,lazy_itable_init=1",
            "-m",
            "0",
        ])
        .arg(path)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| io::Error::new(e.kind(), format!("run mkfs.ext4: {e}")))?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "mkfs.ext4 {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

impl MicroVmSubstrate {
    /// Boots a microVM (cold or from a template); on error everything built so far is removed.
    pub async fn create(&self, spec: SandboxSpec) -> Result<MicroVmSandbox, CreateSandboxError> {
        let vm_dir = spec.dir.join("vm");
        match self.start(&spec, &vm_dir).await {
            Ok(s) => Ok(s),
            // QEMU is gone (killed on the error paths or on drop); remove its files.
            Err(e) => Err(vm::cleanup_failed_create(&spec.id, &vm_dir, e).await),
        }
    }

    /// Kills the VM and removes its directory. Idempotent.
    pub async fn destroy(&self, sandbox: &MicroVmSandbox) -> Result<(), DestroySandboxError> {
        vm::destroy_vm(&sandbox.id, &sandbox.vm, &sandbox.vm_dir).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_failures_before_aether_are_the_machines() {
        let t = tempfile::tempdir().unwrap();
        let exited = vm::BootError {
            msg: "the guest's channel closed before Ready".into(),
            qemu_exited: true,
            init_silent: false,
        };
        // QEMU refused its command line: no console at all.
        assert!(machine_failure(&exited, t.path()));
        // The guest's /init failed before aether.
        std::fs::write(
            t.path().join("console.log"),
            "dsec-init: no disk or pmem region for layer file m0\ndsec-init: FAILED\n",
        )
        .unwrap();
        assert!(machine_failure(&exited, t.path()));
        // aether was started: whatever happened next is not the machine's.
        std::fs::write(
            t.path().join("console.log"),
            "dsec-init: 1.2 root ready, starting aether on /dev/vport1p1\n",
        )
        .unwrap();
        assert!(!machine_failure(&exited, t.path()));
        // A timeout or aether's refusal: QEMU was still running.
        std::fs::remove_file(t.path().join("console.log")).unwrap();
        let running = vm::BootError {
            msg: "the guest sent no Ready within 120s".into(),
            qemu_exited: false,
            init_silent: false,
        };
        assert!(!machine_failure(&running, t.path()));
        // A kernel that hung before /init said anything.
        let hung = vm::BootError {
            msg: "the guest's /init printed nothing within 30s".into(),
            qemu_exited: false,
            init_silent: true,
        };
        assert!(machine_failure(&hung, t.path()));
    }

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
