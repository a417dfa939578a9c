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
//! 4. pause snapshots the guest to disk and ends QEMU; resume restores it ([`pause`]);
//! 5. destroy kills QEMU and removes the VM's directory (`<sandbox dir>/vm`).
//!
//! With templates on ([`template`]), a create whose shape has a template restores the
//! template's snapshot instead of steps 2–3 (and gives the guest its own identity); the first
//! create of a shape boots cold and has a template built in the background.
//!
//! One file per lifecycle verb: [`create`] (cold boot or restore from a template),
//! [`destroy`], [`pause`] (pause and resume, vCPU freeze), [`adopt`] (a paused VM after an edge
//! restart), [`upper`] (the writable layer on the host for `pack`); [`qemu`] is the command
//! line, [`template`] the templates, [`substrate`] the one substrate interface. QEMU itself
//! (process, snapshot, QMP, relay, NIC) is [`crate::qemu`], shared with the full VM.

pub mod adopt;
pub mod cpio;
pub mod create;
pub mod destroy;
pub mod error;
pub mod pause;
pub mod pmem;
pub mod qemu;
pub mod substrate;
pub mod template;
pub mod upper;

// The QEMU machinery moved to [`crate::qemu`] (shared with the full VM); the old paths stay.
pub use crate::qemu::{net, qmp, relay, vm};

use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use crate::substrate::{CreateSandboxError, DestroySandboxError, SandboxSpec};
use create::pmem_copy;
pub use error::{GuestLayerError, GuestNotBuilt, TemplateError, ToolError, UpperError};
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
    /// How long a virtio-pmem copy of unknown source (made before sidecars) is kept for a
    /// create to claim it.
    pub pmem_legacy_grace: Duration,
    /// TCG's translation cache in MiB (None: QEMU's own default).
    pub tcg_tb_mb: Option<u64>,
}

impl MicroVmConfig {
    /// The defaults (the `[edge.microvm]` section of the edge config sets them otherwise):
    /// TCG (this project's CI has no working KVM), the `microvm` machine (a microvm boot that
    /// fails for the machine's reasons falls back to `pc`), `qemu-system-x86_64`, a 4096 MiB
    /// writable disk, virtio-balloon free page reporting and virtio-pmem + DAX layers on, a
    /// [`qemu::DEFAULT_TCG_TB_MB`] translation cache.
    pub fn new(guest_dir: PathBuf, aether_path: PathBuf, blob_dirs: Vec<PathBuf>) -> Self {
        MicroVmConfig {
            aether_path,
            qemu_binary: PathBuf::from("qemu-system-x86_64"),
            accel: Accel::Tcg,
            machine: Machine::Microvm,
            blob_dirs,
            boot_timeout: Duration::from_secs(120),
            disk_mb: 4096,
            balloon: true,
            pmem: true,
            pmem_dir: guest_dir
                .parent()
                .unwrap_or(Path::new("/var/cache/dsec"))
                .join("pmem-layers"),
            pmem_legacy_grace: Duration::from_secs(86_400),
            tcg_tb_mb: Some(qemu::DEFAULT_TCG_TB_MB),
            guest_dir,
        }
    }

    /// Whether the guest artefacts exist; the error says how to build them.
    pub fn check_guest(&self) -> Result<(), GuestNotBuilt> {
        for f in ["vmlinuz", "initrd.img"] {
            if !self.guest_dir.join(f).is_file() {
                return Err(GuestNotBuilt(self.guest_dir.join(f)));
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

    /// The per-VM writable disk image.
    pub fn upper_disk(&self) -> PathBuf {
        self.vm_dir.join(UPPER_DISK)
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

/// Resolves mounted lowers (`<store>/mnt/<digest>`) to the files behind them: the metadata
/// image `<store>/layers/<digest>.erofs` and, when one of `blob_dirs` holds `<digest>.blob`,
/// the data blob.
pub fn resolve_layers(
    lowers: &[PathBuf],
    blob_dirs: &[PathBuf],
) -> Result<Vec<GuestLayer>, GuestLayerError> {
    lowers
        .iter()
        .map(|l| {
            let digest = l
                .file_name()
                .and_then(|d| d.to_str())
                .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_alphanumeric()))
                .ok_or_else(|| GuestLayerError::NotADigest(l.clone()))?;
            let store = l
                .parent()
                .and_then(Path::parent)
                .ok_or_else(|| GuestLayerError::NotInStore(l.clone()))?;
            let meta = store.join("layers").join(format!("{digest}.erofs"));
            if !meta.is_file() {
                return Err(GuestLayerError::NoMetadata {
                    digest: digest.to_string(),
                    meta,
                });
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
        let grace = self.config.pmem_legacy_grace;
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
            .map_err(|e| CreateSandboxError::InvalidSpec(e.to_string()))?;
        let mut layers = resolve_layers(&spec.lowers, &self.config.blob_dirs)
            .map_err(|e| CreateSandboxError::InvalidSpec(e.to_string()))?;
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
            tcg_tb_mb: self.config.tcg_tb_mb,
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
}

#[cfg(test)]
mod tests {
    use super::create::machine_failure;
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
