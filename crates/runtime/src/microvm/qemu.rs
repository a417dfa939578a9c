//! The QEMU command line of one microVM guest (the parts every VM shares are in
//! [`crate::qemu::args`]).

use std::path::{Path, PathBuf};

use crate::qemu::args::{accel_option, control_args, esc};
pub use crate::qemu::args::{tcg_tb_mb, Accel, DEFAULT_TCG_TB_MB};
pub use crate::qemu::machine::Machine;

/// One image layer as the guest sees it: the EROFS metadata image and, for a split layer, its
/// data blob (mounted with `device=`).
#[derive(Debug, Clone, PartialEq)]
pub struct GuestLayer {
    pub meta: PathBuf,
    pub blob: Option<PathBuf>,
    /// The metadata image padded to [`PMEM_ALIGN`], to map as virtio-pmem (DAX) instead of a
    /// virtio-blk disk.
    pub meta_pmem: Option<PathBuf>,
    /// The same for the data blob.
    pub blob_pmem: Option<PathBuf>,
}

/// virtio-pmem regions are mapped in 2 MiB units: a backing file's size must be a multiple.
pub const PMEM_ALIGN: u64 = 2 << 20;

/// PCI slots for virtio-pmem devices (the guest finds a layer's region by its slot); other
/// devices take the lowest free slots.
const PMEM_SLOTS: std::ops::RangeInclusive<u32> = 0x18..=0x1f;

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
    /// The guest's TSC frequency, given to the kernel on `microvm` ([`host_tsc_khz`]).
    pub tsc_khz: Option<u64>,
    /// TCG's translation cache in MiB (None: QEMU's default; see [`DEFAULT_TCG_TB_MB`]).
    pub tcg_tb_mb: Option<u64>,
}

/// The host's TSC frequency in kHz, measured once against `CLOCK_MONOTONIC` (None when the
/// host has no invariant TSC, or the measurement failed).
///
/// Under TCG the guest's TSC is the host's (QEMU reads it for the guest's `rdtsc`). The
/// `microvm` machine has neither HPET nor an ACPI PM timer, so the guest kernel calibrates its
/// TSC against the PIT alone, and under TCG on a loaded host that calibration fails ("tsc:
/// Unable to calibrate against PIT ... No reference (HPET/PMTIMER) available"): the kernel
/// marks the TSC unstable and the boot hangs before /init (5 of 6 boots at load 4 on 2 cores
/// here). Handing the kernel the frequency (`tsc_early_khz=`, `tsc=reliable`) skips the
/// calibration: 6 of 6 boots.
pub fn host_tsc_khz() -> Option<u64> {
    static KHZ: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *KHZ.get_or_init(measure_tsc_khz)
}

#[cfg(target_arch = "x86_64")]
fn measure_tsc_khz() -> Option<u64> {
    use std::time::{Duration, Instant};
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let invariant = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .is_some_and(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.contains(&"constant_tsc") && f.contains(&"nonstop_tsc")
        });
    if !invariant {
        return None;
    }
    // A (monotonic time, TSC) pair read close together; None if preempted in between.
    let pair = |origin: Instant| -> Option<(f64, u64)> {
        let a = origin.elapsed();
        // SAFETY: RDTSC has no memory effects; every x86_64 CPU has it.
        let t = unsafe { std::arch::x86_64::_rdtsc() };
        let b = origin.elapsed();
        ((b - a) < Duration::from_micros(20))
            .then(|| ((a.as_nanos() + b.as_nanos()) as f64 / 2.0, t))
    };
    let origin = Instant::now();
    let mut rates = Vec::new();
    for _ in 0..20 {
        let Some(p0) = pair(origin) else { continue };
        std::thread::sleep(Duration::from_millis(10));
        let Some(p1) = pair(origin) else { continue };
        let ns = p1.0 - p0.0;
        if ns > 0.0 && p1.1 > p0.1 {
            rates.push((p1.1 - p0.1) as f64 / ns * 1e6);
        }
        if rates.len() == 3 {
            break;
        }
    }
    if rates.len() < 3 {
        return None;
    }
    rates.sort_by(|a, b| a.total_cmp(b));
    let khz = rates[1].round() as u64;
    // Agreement within 0.1 %: else something disturbed the clocks.
    ((rates[2] - rates[0]) / rates[1] < 1e-3 && khz > 100_000).then_some(khz)
}

#[cfg(not(target_arch = "x86_64"))]
fn measure_tsc_khz() -> Option<u64> {
    None
}

/// The argument vector after the binary name.
pub fn command_line(a: &QemuArgs<'_>) -> Vec<String> {
    let mut v: Vec<String> = Vec::new();
    let mut push = |s: &[&str]| v.extend(s.iter().map(|x| x.to_string()));
    // microvm's defaults: ACPI on (it describes the virtio-mmio devices), PIT, PIC and RTC on
    // under TCG (the guest calibrates its TSC with the PIT).
    let machine = a.machine.as_str();
    // virtio-pmem regions: (id, file, size), each on its own PCI slot.
    let mut pmem: Vec<(String, &Path, u64, u32)> = Vec::new();
    let mut slots = PMEM_SLOTS;
    let pmem_layers = if a.machine.supports_pmem() {
        a.layers
    } else {
        &[]
    };
    for (i, l) in pmem_layers.iter().enumerate() {
        for (id, p) in [
            (format!("m{i}"), &l.meta_pmem),
            (format!("b{i}"), &l.blob_pmem),
        ] {
            if let Some(p) = p {
                let size = std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
                if size == 0 || size % PMEM_ALIGN != 0 {
                    continue;
                }
                if let Some(slot) = slots.next() {
                    pmem.push((id, p.as_path(), size, slot));
                }
            }
        }
    }
    let pmem_total_mb: u64 = pmem.iter().map(|(_, _, s, _)| s >> 20).sum();
    let mem = if pmem.is_empty() {
        format!("{}M", a.memory_mb)
    } else {
        format!(
            "{}M,slots=1,maxmem={}M",
            a.memory_mb,
            a.memory_mb + pmem_total_mb + 2
        )
    };
    let smp = a.vcpus.max(1).to_string();
    let accel = accel_option(a.accel, a.tcg_tb_mb);
    push(&[
        "-M",
        machine,
        "-accel",
        &accel,
        "-m",
        &mem,
        "-smp",
        &smp,
        "-cpu",
        a.accel.cpu_model(),
    ]);
    push(&["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"]);
    let mut append = format!(
        "console=ttyS0 panic=-1 quiet loglevel=4 random.trust_cpu=on no_timer_check dsec.nlayers={}",
        a.layers.len()
    );
    if a.balloon {
        // The guest's /init loads the balloon driver only when there is a balloon.
        append.push_str(" dsec.balloon=1");
    }
    if let (Machine::Microvm, Some(khz)) = (a.machine, a.tsc_khz) {
        append.push_str(&format!(" tsc_early_khz={khz} tsc=reliable"));
    }
    if !pmem.is_empty() {
        let map: Vec<String> = pmem
            .iter()
            .map(|(id, _, _, slot)| format!("{id}@{slot:02x}"))
            .collect();
        append.push_str(&format!(" dsec.pmem={}", map.join(",")));
        // The pmem regions sit above 4 GiB, which makes the guest kernel set up a 64 MiB
        // swiotlb bounce buffer (and touch all of it): host memory for nothing, as virtio
        // devices here use guest-physical addresses directly. Only while RAM stays below 3 GiB
        // (the pc machine's RAM below the PCI hole).
        if a.memory_mb < 3072 {
            append.push_str(" swiotlb=noforce");
        }
    }
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
        let mapped = |id: &str| pmem.iter().any(|(p, _, _, _)| p == id);
        if !mapped(&format!("m{i}")) {
            disk(format!("m{i}"), &l.meta);
        }
        if let Some(b) = &l.blob {
            if !mapped(&format!("b{i}")) {
                disk(format!("b{i}"), b);
            }
        }
    }
    for (id, path, size, slot) in &pmem {
        // share=on: the guest's DAX mappings are the host's page cache of the file, shared by
        // every VM that maps it; readonly: the guest cannot write the layer.
        let obj = format!(
            "memory-backend-file,id=pm{id},share=on,readonly=on,mem-path={},size={size}",
            esc(path)
        );
        let dev = format!("virtio-pmem-pci,memdev=pm{id},id=vpm{id},addr=0x{slot:02x}");
        push(&["-object", &obj, "-device", &dev]);
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
    v.extend(control_args(
        &a.machine.dev("virtio-serial"),
        a.aether_socket,
        a.qmp_socket,
        a.pidfile,
    ));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_layers_become_pmem_regions() {
        let t = tempfile::tempdir().unwrap();
        let padded = t.path().join("a.erofs.pmem");
        std::fs::File::create(&padded)
            .unwrap()
            .set_len(2 * PMEM_ALIGN)
            .unwrap();
        let odd = t.path().join("b.blob.pmem");
        std::fs::write(&odd, b"not aligned").unwrap();
        let layers = vec![GuestLayer {
            meta: "/l/a.erofs".into(),
            blob: Some("/b/a.blob".into()),
            meta_pmem: Some(padded.clone()),
            blob_pmem: Some(odd),
        }];
        let p = Path::new("/x");
        let s = command_line(&QemuArgs {
            machine: Machine::Pc,
            accel: Accel::Tcg,
            memory_mb: 256,
            vcpus: 1,
            kernel: p,
            initrd: p,
            console_log: p,
            aether_socket: p,
            qmp_socket: p,
            pidfile: p,
            layers: &layers,
            upper: None,
            balloon: false,
            tsc_khz: None,
            tcg_tb_mb: None,
        })
        .join(" ");
        assert!(s.contains("-m 256M,slots=1,maxmem=262M"), "{s}");
        assert!(s.contains("dsec.pmem=m0@18 swiotlb=noforce"), "{s}");
        assert!(s.contains(&format!(
            "memory-backend-file,id=pmm0,share=on,readonly=on,mem-path={},size={}",
            padded.display(),
            2 * PMEM_ALIGN
        )));
        assert!(s.contains("virtio-pmem-pci,memdev=pmm0,id=vpmm0,addr=0x18"));
        // The metadata is mapped, not a disk; the unaligned blob falls back to a disk.
        assert!(!s.contains("serial=dsec-m0"));
        assert!(s.contains("serial=dsec-b0"));
    }

    #[test]
    fn microvm_has_mmio_devices_and_no_pmem() {
        let t = tempfile::tempdir().unwrap();
        let padded = t.path().join("a.erofs.pmem");
        std::fs::File::create(&padded)
            .unwrap()
            .set_len(PMEM_ALIGN)
            .unwrap();
        let layers = vec![GuestLayer {
            meta: "/l/a.erofs".into(),
            blob: None,
            meta_pmem: Some(padded),
            blob_pmem: None,
        }];
        let p = Path::new("/x");
        let s = command_line(&QemuArgs {
            machine: Machine::Microvm,
            accel: Accel::Tcg,
            memory_mb: 256,
            vcpus: 1,
            kernel: p,
            initrd: p,
            console_log: p,
            aether_socket: p,
            qmp_socket: p,
            pidfile: p,
            layers: &layers,
            upper: Some(Path::new("/d/upper.img")),
            balloon: true,
            tsc_khz: Some(2_596_120),
            tcg_tb_mb: Some(DEFAULT_TCG_TB_MB),
        })
        .join(" ");
        assert!(s.starts_with("-M microvm -accel tcg"), "{s}");
        assert!(s.contains(" -m 256M -smp 1 "), "{s}");
        assert!(!s.contains("pmem"), "{s}");
        assert!(!s.contains("-pci"), "{s}");
        assert!(s.contains("virtio-blk-device,drive=m0,serial=dsec-m0"));
        assert!(s.contains("virtio-blk-device,drive=upper,serial=dsec-upper"));
        assert!(s.contains("virtio-balloon-device,id=balloon0,free-page-reporting=on"));
        assert!(s.contains("-device virtio-serial-device -chardev socket,id=aether"));
        assert!(s.contains(" tsc_early_khz=2596120 tsc=reliable"), "{s}");
        assert_eq!(Machine::parse("microvm"), Some(Machine::Microvm));
        assert_eq!(Machine::parse("pc"), Some(Machine::Pc));
        assert_eq!(Machine::parse("q35"), None);
    }

    #[test]
    fn layers_become_serial_numbered_read_only_disks() {
        let layers = vec![
            GuestLayer {
                meta: "/l/a.erofs".into(),
                blob: Some("/b/a.blob".into()),
                meta_pmem: None,
                blob_pmem: None,
            },
            GuestLayer {
                meta: "/l/b,c.erofs".into(),
                blob: None,
                meta_pmem: None,
                blob_pmem: None,
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
            tsc_khz: Some(2_596_120),
            tcg_tb_mb: Some(DEFAULT_TCG_TB_MB),
        });
        let s = v.join(" ");
        assert!(s.contains(" -m 256M -smp 2 "), "{s}");
        assert!(s.contains("dsec.nlayers=2"));
        assert!(s.contains("id=m0,file=/l/a.erofs,format=raw,if=none,readonly=on"));
        assert!(s.contains("virtio-blk-pci,drive=b0,serial=dsec-b0"));
        assert!(s.contains("file=/l/b,,c.erofs"));
        assert!(!s.contains("serial=dsec-b1"));
        assert!(s.contains("socket,id=aether,path=/d/aether.sock,server=on,wait=off"));
        assert!(s.contains("id=upper,file=/d/upper.img,format=raw"));
        assert!(s.contains("virtio-blk-pci,drive=upper,serial=dsec-upper"));
        assert!(s.contains("virtio-balloon-pci,id=balloon0,free-page-reporting=on"));
        assert!(s.contains(" dsec.balloon=1"));
        // Only microvm needs the TSC frequency (pc has HPET and the ACPI PM timer).
        assert!(!s.contains("tsc_early_khz"));
    }

    #[test]
    fn tcg_translation_cache_is_bounded() {
        assert_eq!(tcg_tb_mb(DEFAULT_TCG_TB_MB), Some(DEFAULT_TCG_TB_MB));
        assert_eq!(tcg_tb_mb(32), Some(32));
        assert_eq!(tcg_tb_mb(0), None);
        assert_eq!(accel_option(Accel::Tcg, Some(64)), "tcg,tb-size=64");
        assert_eq!(accel_option(Accel::Tcg, None), "tcg");
        // KVM has no translation cache: the size is never passed.
        assert_eq!(accel_option(Accel::Kvm, Some(64)), "kvm");
    }

    #[test]
    fn host_tsc_frequency_is_measured() {
        let Some(khz) = host_tsc_khz() else {
            println!("skipped: no invariant TSC on this host (or a disturbed measurement)");
            return;
        };
        assert!((100_000..10_000_000).contains(&khz), "{khz}");
        assert_eq!(host_tsc_khz(), Some(khz));
    }
}
