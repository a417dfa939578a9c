//! The full-VM substrate: each sandbox is a QEMU PC (`q35`, or `pc`) booting a whole Linux disk
//! image through the firmware (SeaBIOS, then the disk's own boot loader), or by direct kernel
//! boot with the disk as root.
//!
//! Per VM the substrate:
//! 1. creates a copy-on-write overlay `<vm dir>/overlay.qcow2` whose backing file is the image
//!    (`qemu-img create -f qcow2 -b IMAGE -F FMT`), so the image itself is never written;
//! 2. starts QEMU with the overlay as a virtio disk, a virtio-serial port named `dsec.aether`
//!    backed by a unix socket QEMU listens on, a QMP socket and the serial console in a file;
//! 3. connects to the channel socket; aether inside the guest, started by the image's boot
//!    hook (`dsec vm prepare-image` installs `/usr/local/sbin/dsec-init`: `init=` or a systemd
//!    unit), speaks the framed protocol in bare mode and greets with `Ready`.
//!
//! QEMU's life (boot, pause by snapshot + resume from it, kill, death detection) is the
//! microVM substrate's [`crate::qemu::vm::Vm`]: the same machinery for both kinds of VM.
//!
//! An image is a disk file; direct kernel boot is chosen when files with the same stem sit
//! beside it: `<stem>.kernel` (required), `<stem>.initrd`, `<stem>.cmdline` (kernel command
//! line; default `root=/dev/vda1 rw console=ttyS0 init=/usr/local/sbin/dsec-init`).

pub mod qemu;
pub mod substrate;

use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use dsec_wire::aether::Request;
use dsec_wire::api::PauseReport;

use crate::aether_client::AetherClient;
use crate::error::PauseError;
use crate::qemu::vm::{self, Launch, Vm};
use crate::qemu::Accel;
use crate::substrate::{CreateSandboxError, DestroySandboxError, SandboxSpec, Usage};
pub use qemu::{DirectBoot, PcMachine};

/// The kernel command line of a direct kernel boot when the image has no `<stem>.cmdline`.
pub const DEFAULT_CMDLINE: &str =
    "root=/dev/vda1 rw console=ttyS0 panic=-1 quiet loglevel=4 no_timer_check init=/usr/local/sbin/dsec-init";

/// Configuration of the full-VM substrate.
#[derive(Debug, Clone)]
pub struct FullVmConfig {
    pub qemu_binary: PathBuf,
    pub qemu_img: PathBuf,
    pub accel: Accel,
    pub machine: PcMachine,
    /// How long the guest may take from QEMU's start to aether's `Ready` (firmware, boot
    /// loader, kernel, init: tens of seconds under TCG).
    pub boot_timeout: Duration,
}

impl FullVmConfig {
    /// The defaults (the `[edge.vm]` section of the edge config sets them otherwise): TCG
    /// (this project's machines have a `/dev/kvm` that cannot run a stock guest kernel, so KVM
    /// is opt-in on production hosts), `q35`, `qemu-system-x86_64`, `qemu-img`.
    pub fn new() -> Self {
        FullVmConfig {
            qemu_binary: PathBuf::from("qemu-system-x86_64"),
            qemu_img: PathBuf::from("qemu-img"),
            accel: Accel::Tcg,
            machine: PcMachine::Q35,
            boot_timeout: Duration::from_secs(240),
        }
    }
}

impl Default for FullVmConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// A disk image and how to boot it.
#[derive(Debug, Clone, PartialEq)]
pub struct VmImage {
    pub disk: PathBuf,
    pub kernel: Option<PathBuf>,
    pub initrd: Option<PathBuf>,
    pub cmdline: Option<String>,
}

impl VmImage {
    /// The image at `disk`, with direct kernel boot when `<stem>.kernel` sits beside it.
    pub fn at(disk: &Path) -> io::Result<VmImage> {
        let side = |ext: &str| disk.with_extension(ext);
        let kernel = side("kernel");
        let (kernel, initrd, cmdline) = if kernel.is_file() {
            let initrd = Some(side("initrd")).filter(|p| p.is_file());
            let cmdline = match std::fs::read_to_string(side("cmdline")) {
                Ok(s) => Some(s.trim().to_string()).filter(|s| !s.is_empty()),
                Err(e) if e.kind() == io::ErrorKind::NotFound => None,
                Err(e) => return Err(e),
            };
            (Some(kernel), initrd, cmdline)
        } else {
            (None, None, None)
        };
        Ok(VmImage {
            disk: disk.to_path_buf(),
            kernel,
            initrd,
            cmdline,
        })
    }
}

/// Runs sandboxes as full VMs.
#[derive(Debug, Clone)]
pub struct FullVmSubstrate {
    config: FullVmConfig,
}

/// One full VM (running, or paused as a snapshot on disk).
pub struct FullVmSandbox {
    id: String,
    vm_dir: PathBuf,
    vm: Vm,
}

impl std::fmt::Debug for FullVmSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FullVmSandbox")
            .field("id", &self.id)
            .field("vm", &self.vm)
            .finish()
    }
}

impl FullVmSandbox {
    /// Resolves when the VM is gone (QEMU died on its own, or it was destroyed).
    pub async fn exited(&self) {
        self.vm.dead().await
    }

    pub fn has_exited(&self) -> bool {
        self.vm.has_died()
    }

    /// Why QEMU died on its own, if it did.
    pub fn death_reason(&self) -> Option<String> {
        self.vm.death_reason()
    }

    /// The VM's directory on the host (overlay, sockets, console log, snapshot).
    pub fn vm_dir(&self) -> &Path {
        &self.vm_dir
    }

    /// Snapshots memory and devices to `<vm dir>/snapshot` and ends QEMU (the overlay disk is
    /// a host file and needs no copy).
    pub async fn pause(&self) -> Result<PauseReport, PauseError> {
        self.vm.pause().await
    }

    /// Starts QEMU again from the snapshot; the guest carries on where it stopped.
    pub async fn resume(&self) -> Result<(), PauseError> {
        self.vm.resume().await
    }

    pub fn is_paused(&self) -> bool {
        self.vm.is_paused()
    }
}

impl vm::VmSandbox for FullVmSandbox {
    fn vm(&self) -> &vm::Vm {
        &self.vm
    }
    fn vm_dir(&self) -> &Path {
        &self.vm_dir
    }
}

impl FullVmSandbox {
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
        let (rss, _, _) = crate::qemu::vm::rss_of(self.vm.pid());
        Usage {
            memory_bytes: rss,
            pids: 1,
            oom_kills: 0,
        }
    }
}

/// The last lines of the guest's console, for error messages.
fn console_tail(vm_dir: &Path) -> String {
    let text = std::fs::read_to_string(vm_dir.join("console.log")).unwrap_or_default();
    let lines: Vec<&str> = text
        .lines()
        .map(|l| l.trim_matches(|c: char| c.is_control() || c == ' '))
        .filter(|l| !l.is_empty())
        .collect();
    lines[lines.len().saturating_sub(8)..].join(" | ")
}

impl FullVmSubstrate {
    pub fn new(config: FullVmConfig) -> Self {
        FullVmSubstrate { config }
    }

    pub fn config(&self) -> &FullVmConfig {
        &self.config
    }

    /// `qemu-img`'s name for the format of `disk` (`raw` or `qcow2`).
    async fn disk_format(&self, disk: &Path) -> Result<String, CreateSandboxError> {
        let out = tokio::process::Command::new(&self.config.qemu_img)
            .args(["info", "--output=json", "-U"])
            .arg(disk)
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| spawn_err(&format!("run {}", self.config.qemu_img.display()), e))?;
        if !out.status.success() {
            return Err(CreateSandboxError::InvalidSpec(format!(
                "VM image {}: {}",
                disk.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
            CreateSandboxError::Setup(format!("parse qemu-img info of {}: {e}", disk.display()))
        })?;
        match v.get("format").and_then(|f| f.as_str()) {
            Some(f @ ("raw" | "qcow2")) => Ok(f.to_string()),
            other => Err(CreateSandboxError::InvalidSpec(format!(
                "VM image {}: format {other:?} is not supported (raw or qcow2)",
                disk.display()
            ))),
        }
    }

    /// Creates `overlay` backed by `disk` (read-only for QEMU: the image is never written).
    async fn make_overlay(&self, disk: &Path, overlay: &Path) -> Result<(), CreateSandboxError> {
        let fmt = self.disk_format(disk).await?;
        let out = tokio::process::Command::new(&self.config.qemu_img)
            .args(["create", "-q", "-f", "qcow2", "-F", &fmt, "-b"])
            .arg(disk)
            .arg(overlay)
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| spawn_err("run qemu-img create", e))?;
        if !out.status.success() {
            return Err(CreateSandboxError::Setup(format!(
                "create the overlay on {}: {}",
                disk.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    }

    /// Builds the VM directory and boots; the caller removes the directory on error.
    async fn start(&self, spec: &SandboxSpec, vm_dir: &Path) -> Result<Vm, CreateSandboxError> {
        if spec.user != "root" && spec.user != "0" {
            return Err(CreateSandboxError::InvalidSpec(format!(
                "init_user {:?}: full-VM sandboxes run commands as root only (for now)",
                spec.user
            )));
        }
        if !spec.env.is_empty() {
            return Err(CreateSandboxError::InvalidSpec(
                "env: sandbox-wide environment variables are not supported for full-VM sandboxes yet; pass env per command".into(),
            ));
        }
        let disk = match spec.lowers.as_slice() {
            [d] => d.clone(),
            _ => {
                return Err(CreateSandboxError::InvalidSpec(
                    "a full VM needs exactly one disk image".into(),
                ))
            }
        };
        let image = VmImage::at(&disk)
            .map_err(|e| spawn_err(&format!("read the boot files of {}", disk.display()), e))?;
        tokio::fs::create_dir_all(vm_dir)
            .await
            .map_err(|e| spawn_err("create the VM directory", e))?;
        let overlay = vm_dir.join("overlay.qcow2");
        self.make_overlay(&image.disk, &overlay).await?;
        let cmdline = image
            .cmdline
            .clone()
            .unwrap_or_else(|| DEFAULT_CMDLINE.into());
        let direct = image.kernel.as_deref().map(|k| DirectBoot {
            kernel: k,
            initrd: image.initrd.as_deref(),
            append: &cmdline,
        });
        let args = qemu::command_line(&qemu::FullVmArgs {
            machine: self.config.machine,
            accel: self.config.accel,
            memory_mb: spec.memory_limit_mb.max(128),
            vcpus: spec.cpu_cores_limit.ceil().max(1.0) as u32,
            overlay: &overlay,
            direct,
            console_log: &vm_dir.join("console.log"),
            aether_socket: &vm_dir.join("aether.sock"),
            qmp_socket: &vm_dir.join("qmp.sock"),
            pidfile: &vm_dir.join("qemu.pid"),
        });
        let mut args = args;
        // A NIC on the sandbox's network namespace (microvm/net.rs); config through fw_cfg.
        if let Some(n) = crate::qemu::net::attach(spec.netns.clone(), vm_dir).await? {
            args.extend(qemu::network_args(&n));
        }
        let launch = Launch {
            qemu_binary: self.config.qemu_binary.clone(),
            args,
        };
        tracing::info!(
            sandbox = %spec.id, image = %image.disk.display(), accel = self.config.accel.as_str(),
            machine = self.config.machine.as_str(),
            boot = if image.kernel.is_some() { "direct kernel" } else { "firmware" },
            "full VM starting"
        );
        Vm::boot(&spec.id, vm_dir, launch, self.config.boot_timeout)
            .await
            .map_err(|msg| {
                CreateSandboxError::Setup(format!("{msg}; guest console: {}", console_tail(vm_dir)))
            })
    }
}

/// Setting the guest's hostname failed.
#[derive(Debug, thiserror::Error)]
pub enum HostnameError {
    #[error(transparent)]
    Channel(#[from] crate::aether_client::ChannelError),
    #[error("exit {code}: {stderr}")]
    Exit { code: i32, stderr: String },
}

/// Runs `hostname NAME` in the guest (the name was validated by the edge).
async fn set_hostname(aether: &AetherClient, name: &str) -> Result<(), HostnameError> {
    let out = aether
        .run(
            Request::Exec {
                argv: vec!["hostname".into(), name.into()],
                timeout_ms: 10_000,
                env: Default::default(),
                cwd: None,
                user: None,
                max_output: 4096,
                stream: false,
            },
            Bytes::new(),
        )
        .await?;
    if out.outcome.exit_code != 0 {
        return Err(HostnameError::Exit {
            code: out.outcome.exit_code,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

fn spawn_err(what: &str, e: io::Error) -> CreateSandboxError {
    CreateSandboxError::Spawn(io::Error::new(e.kind(), format!("{what}: {e}")))
}

impl FullVmSubstrate {
    /// Takes over a paused full VM of an earlier edge run: its state is the snapshot and the
    /// qcow2 overlay in `<sandbox dir>/vm`, with the QEMU command line (`qemu.args`) that
    /// restores it. A VM that was running when the edge went away is not adoptable (its
    /// channel is gone); the caller ends its QEMU ([`crate::qemu::vm::kill_leftover_qemu`]).
    pub fn adopt_paused(
        &self,
        id: &str,
        sandbox_dir: &Path,
    ) -> Result<FullVmSandbox, crate::qemu::VmError> {
        let vm_dir = sandbox_dir.join("vm");
        if !vm_dir.join("overlay.qcow2").is_file() {
            return Err(crate::qemu::VmError::NoOverlay(vm_dir));
        }
        let vm = vm::Vm::adopt_paused(id, &vm_dir)?;
        Ok(FullVmSandbox {
            id: id.to_string(),
            vm_dir,
            vm,
        })
    }
}

impl FullVmSubstrate {
    /// Boots a full VM; `spec.lowers` holds exactly one path: the VM's disk image. On error
    /// everything built so far is removed.
    pub async fn create(&self, spec: SandboxSpec) -> Result<FullVmSandbox, CreateSandboxError> {
        let vm_dir = spec.dir.join("vm");
        match self.start(&spec, &vm_dir).await {
            Ok(vm) => {
                let sandbox = FullVmSandbox {
                    id: spec.id.clone(),
                    vm_dir,
                    vm,
                };
                // The sandbox's hostname (the disk image brings its own /etc/hostname).
                if let Err(e) = set_hostname(sandbox.vm.aether(), &spec.hostname).await {
                    let _ = self.destroy(&sandbox).await;
                    return Err(CreateSandboxError::Setup(format!(
                        "set the hostname {:?} in the guest: {e}",
                        spec.hostname
                    )));
                }
                Ok(sandbox)
            }
            // QEMU is gone (killed on the error paths or on drop); remove its files.
            Err(e) => Err(vm::cleanup_failed_create(&spec.id, &vm_dir, e).await),
        }
    }

    /// Kills the VM and removes its directory. Idempotent.
    pub async fn destroy(&self, sandbox: &FullVmSandbox) -> Result<(), DestroySandboxError> {
        vm::destroy_vm(&sandbox.id, &sandbox.vm, &sandbox.vm_dir).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_boot_files_beside_the_disk() {
        let t = tempfile::tempdir().unwrap();
        let disk = t.path().join("deb.qcow2");
        std::fs::write(&disk, b"x").unwrap();
        let i = VmImage::at(&disk).unwrap();
        assert_eq!(i.kernel, None);
        std::fs::write(t.path().join("deb.kernel"), b"k").unwrap();
        std::fs::write(t.path().join("deb.cmdline"), b"root=/dev/vda1 rw\n").unwrap();
        let i = VmImage::at(&disk).unwrap();
        assert_eq!(i.kernel, Some(t.path().join("deb.kernel")));
        assert_eq!(i.initrd, None);
        assert_eq!(i.cmdline.as_deref(), Some("root=/dev/vda1 rw"));
        std::fs::write(t.path().join("deb.initrd"), b"i").unwrap();
        assert_eq!(
            VmImage::at(&disk).unwrap().initrd,
            Some(t.path().join("deb.initrd"))
        );
    }
}
