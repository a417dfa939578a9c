//! The QEMU command line of one full VM.

use std::path::Path;

use crate::qemu::args::{control_args, esc};
use crate::qemu::Accel;

/// The PC machine type: `q35` (PCIe, the default) or `pc` (i440FX).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PcMachine {
    Q35,
    Pc,
}

impl PcMachine {
    /// The names [`PcMachine::parse`] accepts, for error messages.
    pub const ALLOWED: &'static str = "\"q35\" or \"pc\"";

    /// `q35` | `pc`.
    pub fn parse(s: &str) -> Option<PcMachine> {
        match s {
            "q35" => Some(PcMachine::Q35),
            "pc" => Some(PcMachine::Pc),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            PcMachine::Q35 => "q35",
            PcMachine::Pc => "pc",
        }
    }
}

/// Direct kernel boot: QEMU loads the kernel and initramfs itself (no firmware boot loader);
/// the disk is still the root file system (`root=` in `append`).
#[derive(Debug, Clone, PartialEq)]
pub struct DirectBoot<'a> {
    pub kernel: &'a Path,
    pub initrd: Option<&'a Path>,
    pub append: &'a str,
}

/// Everything the command line depends on.
#[derive(Debug, Clone)]
pub struct FullVmArgs<'a> {
    pub machine: PcMachine,
    pub accel: Accel,
    pub memory_mb: u64,
    pub vcpus: u32,
    /// The VM's copy-on-write overlay (qcow2 whose backing file is the image).
    pub overlay: &'a Path,
    /// `None`: boot through the firmware (SeaBIOS) from the disk's boot loader.
    pub direct: Option<DirectBoot<'a>>,
    pub console_log: &'a Path,
    /// Unix socket QEMU listens on for the aether channel (virtio-serial port `dsec.aether`).
    pub aether_socket: &'a Path,
    pub qmp_socket: &'a Path,
    pub pidfile: &'a Path,
}

/// The argument vector after the binary name.
pub fn command_line(a: &FullVmArgs<'_>) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    let mut push = |s: &[&str]| v.extend(s.iter().map(|x| x.to_string()));
    let mem = format!("{}M", a.memory_mb);
    let smp = a.vcpus.max(1).to_string();
    push(&[
        "-M",
        a.machine.as_str(),
        "-accel",
        a.accel.as_str(),
        "-m",
        &mem,
        "-smp",
        &smp,
        "-cpu",
        a.accel.cpu_model(),
    ]);
    push(&["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"]);
    if let Some(d) = &a.direct {
        push(&["-kernel", &esc(d.kernel), "-append", d.append]);
        if let Some(i) = d.initrd {
            push(&["-initrd", &esc(i)]);
        }
    }
    // The firmware (SeaBIOS) and the boot loader print on the serial port too.
    let log = format!("file,id=log,path={}", esc(a.console_log));
    push(&["-chardev", &log, "-serial", "chardev:log"]);
    let drive = format!(
        "id=disk0,file={},format=qcow2,if=none,cache=writeback,discard=unmap",
        esc(a.overlay)
    );
    // The firmware boots from this disk; with -kernel, QEMU's linuxboot ROM holds bootindex 0.
    let dev = if a.direct.is_some() {
        "virtio-blk-pci,drive=disk0"
    } else {
        "virtio-blk-pci,drive=disk0,bootindex=0"
    };
    push(&["-drive", &drive, "-device", dev]);
    v.extend(control_args(
        "virtio-serial-pci",
        a.aether_socket,
        a.qmp_socket,
        a.pidfile,
    ));
    v
}

/// fw_cfg item holding a networked VM's configuration (read by the disk's initramfs).
pub const NET_FW_CFG: &str = "opt/dsec/net";

/// The NIC of a networked full VM: the tap and virtio-net device of [`crate::qemu::net`],
/// and its configuration (`IPV4,GATEWAY,IPV6|-,MTU,MAC`, as a microVM's `dsec.net=`) as the
/// fw_cfg item [`NET_FW_CFG`]: a firmware-booted guest's kernel command line belongs to its
/// boot loader, so the configuration cannot travel there.
pub fn network_args(net: &crate::qemu::net::VmNet) -> Vec<String> {
    let cfg = crate::qemu::net::kernel_arg(net);
    let value = cfg.strip_prefix("dsec.net=").unwrap_or(&cfg);
    let mut v = vec![
        "-fw_cfg".to_string(),
        format!("name={NET_FW_CFG},string={}", value.replace(',', ",,")),
    ];
    v.extend(crate::qemu::net::qemu_args(net, "virtio-net-pci"));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn network_through_fw_cfg() {
        let ip = std::net::Ipv4Addr::new(10, 201, 0, 9);
        let net = crate::qemu::net::VmNet {
            netns: "/run/netns/x".into(),
            ipv4: ip,
            gateway: std::net::Ipv4Addr::new(10, 201, 0, 1),
            ipv6: Some("fd00::9".parse().unwrap()),
            mtu: 1500,
            mac: crate::qemu::net::mac_for(ip),
        };
        let s = network_args(&net).join(" ");
        assert!(s.starts_with(
            "-fw_cfg name=opt/dsec/net,string=10.201.0.9,,10.201.0.1,,fd00::9,,1500,,02:d5:0a:c9:00:09 "
        ), "{s}");
        assert!(
            s.contains("-device virtio-net-pci,netdev=net0,mac=02:d5:0a:c9:00:09,host_mtu=1500")
        );
    }

    fn args<'a>(direct: Option<DirectBoot<'a>>) -> FullVmArgs<'a> {
        let p = Path::new("/x");
        FullVmArgs {
            machine: PcMachine::Q35,
            accel: Accel::Tcg,
            memory_mb: 512,
            vcpus: 2,
            overlay: Path::new("/vm/overlay,1.qcow2"),
            direct,
            console_log: p,
            aether_socket: Path::new("/vm/aether.sock"),
            qmp_socket: p,
            pidfile: p,
        }
    }

    #[test]
    fn firmware_boot_from_the_overlay() {
        let s = command_line(&args(None)).join(" ");
        assert!(s.starts_with("-M q35 -accel tcg -m 512M -smp 2"));
        assert!(s.contains("file=/vm/overlay,,1.qcow2,format=qcow2,if=none"));
        assert!(s.contains("virtio-blk-pci,drive=disk0,bootindex=0"));
        assert!(!s.contains("-kernel"));
        assert!(s.contains("socket,id=aether,path=/vm/aether.sock,server=on,wait=off"));
        assert!(s.contains("virtserialport,chardev=aether,name=dsec.aether"));
    }

    #[test]
    fn direct_kernel_boot() {
        let k = Path::new("/k/vmlinuz");
        let v = command_line(&args(Some(DirectBoot {
            kernel: k,
            initrd: Some(Path::new("/k/initrd.img")),
            append: "root=/dev/vda1 console=ttyS0",
        })));
        let s = v.join(" ");
        assert!(s.contains("-kernel /k/vmlinuz -append root=/dev/vda1 console=ttyS0"));
        assert!(s.contains("-initrd /k/initrd.img"));
        assert!(!s.contains("bootindex"));
        // The append string stays one argument.
        assert!(v.iter().any(|a| a == "root=/dev/vda1 console=ttyS0"));
    }
}
