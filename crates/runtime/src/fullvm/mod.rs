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
//! QEMU's life (boot, pause by snapshot + resume from it, kill, death detection) is
//! [`crate::qemu::vm::Vm`], shared with the microVM substrate.
//!
//! One file per lifecycle verb: [`create`], [`destroy`], [`pause`] (pause and resume),
//! [`adopt`] (a paused VM after an edge restart); [`qemu`] is the command line, [`substrate`]
//! puts it all behind the one substrate interface.
//!
//! An image is a disk file; direct kernel boot is chosen when files with the same stem sit
//! beside it: `<stem>.kernel` (required), `<stem>.initrd`, `<stem>.cmdline` (kernel command
//! line; default `root=/dev/vda1 rw console=ttyS0 init=/usr/local/sbin/dsec-init`).

pub mod adopt;
pub mod create;
pub mod destroy;
pub mod pause;
pub mod qemu;
pub mod substrate;

use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use bytes::Bytes;
use dsec_wire::aether::Request;

use crate::aether_client::AetherClient;
use crate::qemu::vm::{self, Launch, Vm};
use crate::qemu::Accel;
use crate::substrate::{CreateSandboxError, DestroySandboxError, SandboxSpec};
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

impl vm::VmSandbox for FullVmSandbox {
    fn vm(&self) -> &vm::Vm {
        &self.vm
    }
    fn vm_dir(&self) -> &Path {
        &self.vm_dir
    }
}

impl FullVmSubstrate {
    pub fn new(config: FullVmConfig) -> Self {
        FullVmSubstrate { config }
    }

    pub fn config(&self) -> &FullVmConfig {
        &self.config
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
