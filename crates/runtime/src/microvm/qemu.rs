//! The QEMU command line of one guest.

use std::path::{Path, PathBuf};

/// Which accelerator QEMU uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// The machine type. `microvm` (virtio-mmio) needs working guest timers from ACPI, which QEMU
/// 7.2 under TCG does not give the Debian cloud kernel (it hangs in timer calibration); `pc`
/// with virtio-pci devices and direct kernel boot works everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Machine {
    Microvm,
    Pc,
}

impl Machine {
    pub fn as_str(self) -> &'static str {
        match self {
            Machine::Microvm => "microvm",
            Machine::Pc => "pc",
        }
    }
    fn dev(self, kind: &str) -> String {
        match self {
            Machine::Microvm => format!("{kind}-device"),
            Machine::Pc => format!("{kind}-pci"),
        }
    }
}

/// One image layer as the guest sees it: the EROFS metadata image and, for a split layer, its
/// data blob (mounted with `device=`).
#[derive(Debug, Clone, PartialEq)]
pub struct GuestLayer {
    pub meta: PathBuf,
    pub blob: Option<PathBuf>,
}

/// Everything the command line depends on.
#[derive(Debug, Clone)]
pub struct QemuArgs<'a> {
    pub machine: Machine,
    pub accel: Accel,
    pub memory_mb: u64,
    pub vcpus: u32,
    pub kernel: &'a Path,
    pub initrd: &'a Path,
    pub console_log: &'a Path,
    /// Unix socket QEMU listens on for the aether channel; the edge connects to it. (QEMU must
    /// be the server: a socket chardev connected before the port's frontend attaches never
    /// reports "host connected" to the guest.)
    pub aether_socket: &'a Path,
    pub qmp_socket: &'a Path,
    pub pidfile: &'a Path,
    /// Top-most first.
    pub layers: &'a [GuestLayer],
    /// The per-VM writable disk (raw ext4 image), attached read-write with serial `dsec-upper`.
    pub upper: Option<&'a Path>,
    /// virtio-balloon with free page reporting: pages the guest frees go back to the host.
    pub balloon: bool,
}

fn esc(p: &Path) -> String {
    // QEMU option values separate with ','; a literal comma is written twice.
    p.display().to_string().replace(',', ",,")
}

/// The argument vector after the binary name.
pub fn command_line(a: &QemuArgs<'_>) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    let mut push = |s: &[&str]| v.extend(s.iter().map(|x| x.to_string()));
    let machine = match a.machine {
        Machine::Microvm => "microvm,pit=on,pic=on,rtc=on".to_string(),
        Machine::Pc => "pc".to_string(),
    };
    let mem = format!("{}M", a.memory_mb);
    let smp = a.vcpus.max(1).to_string();
    push(&[
        "-M",
        &machine,
        "-accel",
        a.accel.as_str(),
        "-m",
        &mem,
        "-smp",
        &smp,
    ]);
    push(&["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"]);
    let append = format!(
        "console=ttyS0 panic=-1 quiet loglevel=4 dsec.nlayers={}",
        a.layers.len()
    );
    push(&[
        "-kernel",
        &esc(a.kernel),
        "-initrd",
        &esc(a.initrd),
        "-append",
        &append,
    ]);
    let log = format!("file,id=log,path={}", esc(a.console_log));
    push(&["-chardev", &log, "-serial", "chardev:log"]);
    for (i, l) in a.layers.iter().enumerate() {
        let mut disk = |id: String, path: &Path| {
            let drive = format!("id={id},file={},format=raw,if=none,readonly=on", esc(path));
            let dev = format!(
                "{},drive={id},serial=dsec-{id}",
                a.machine.dev("virtio-blk")
            );
            push(&["-drive", &drive, "-device", &dev]);
        };
        disk(format!("m{i}"), &l.meta);
        if let Some(b) = &l.blob {
            disk(format!("b{i}"), b);
        }
    }
    if let Some(u) = a.upper {
        let drive = format!(
            "id=upper,file={},format=raw,if=none,cache=writeback,discard=unmap",
            esc(u)
        );
        let dev = format!(
            "{},drive=upper,serial=dsec-upper",
            a.machine.dev("virtio-blk")
        );
        push(&["-drive", &drive, "-device", &dev]);
    }
    if a.balloon {
        let dev = format!(
            "{},id=balloon0,free-page-reporting=on",
            a.machine.dev("virtio-balloon")
        );
        push(&["-device", &dev]);
    }
    let serial = a.machine.dev("virtio-serial");
    let chan = format!(
        "socket,id=aether,path={},server=on,wait=off",
        esc(a.aether_socket)
    );
    push(&[
        "-device",
        &serial,
        "-chardev",
        &chan,
        "-device",
        "virtserialport,chardev=aether,name=dsec.aether",
    ]);
    let qmp = format!("unix:{},server=on,wait=off", esc(a.qmp_socket));
    push(&["-qmp", &qmp, "-pidfile", &esc(a.pidfile)]);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_become_serial_numbered_read_only_disks() {
        let layers = vec![
            GuestLayer {
                meta: "/l/a.erofs".into(),
                blob: Some("/b/a.blob".into()),
            },
            GuestLayer {
                meta: "/l/b,c.erofs".into(),
                blob: None,
            },
        ];
        let p = Path::new("/x");
        let v = command_line(&QemuArgs {
            machine: Machine::Pc,
            accel: Accel::Tcg,
            memory_mb: 256,
            vcpus: 2,
            kernel: p,
            initrd: p,
            console_log: p,
            aether_socket: Path::new("/d/aether.sock"),
            qmp_socket: p,
            pidfile: p,
            layers: &layers,
            upper: Some(Path::new("/d/upper.img")),
            balloon: true,
        });
        let s = v.join(" ");
        assert!(s.contains("-accel tcg -m 256M -smp 2"));
        assert!(s.contains("dsec.nlayers=2"));
        assert!(s.contains("id=m0,file=/l/a.erofs,format=raw,if=none,readonly=on"));
        assert!(s.contains("virtio-blk-pci,drive=b0,serial=dsec-b0"));
        assert!(s.contains("file=/l/b,,c.erofs"));
        assert!(!s.contains("serial=dsec-b1"));
        assert!(s.contains("socket,id=aether,path=/d/aether.sock,server=on,wait=off"));
        assert!(s.contains("id=upper,file=/d/upper.img,format=raw"));
        assert!(s.contains("virtio-blk-pci,drive=upper,serial=dsec-upper"));
        assert!(s.contains("virtio-balloon-pci,id=balloon0,free-page-reporting=on"));
    }
}
