//! The QEMU machine types a VM can run on: shared by both VM substrates and the NIC code.

/// The machine type.
///
/// `microvm` (the default): no PCI, no firmware beyond qboot, devices on virtio-mmio that the
/// guest finds through the machine's ACPI tables (LNRO0005; the guest's /init loads
/// virtio_mmio when they are there). Under TCG it boots this guest about twice as fast as `pc`
/// (no SeaBIOS, no PCI enumeration, fewer modules). It has no virtio-pmem in QEMU 7.2
/// (virtio-pmem-pci needs a PCI bus, and with `pcie=on` the machine still assigns the region
/// no guest-physical address: the guest's nd_pmem fails with "could not reserve region
/// [mem 0x0-...]"), so its layers are always virtio-blk disks.
///
/// `pc`: virtio-pci devices, SeaBIOS and direct kernel boot; virtio-pmem (DAX) layers.
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

    /// `microvm` | `pc`.
    /// The names [`Machine::parse`] accepts, for error messages.
    pub const ALLOWED: &'static str = "\"microvm\" or \"pc\"";

    pub fn parse(s: &str) -> Option<Machine> {
        match s {
            "microvm" => Some(Machine::Microvm),
            "pc" => Some(Machine::Pc),
            _ => None,
        }
    }

    /// Whether read-only layers can be virtio-pmem regions (DAX) on this machine.
    pub fn supports_pmem(self) -> bool {
        matches!(self, Machine::Pc)
    }

    /// The QEMU device name of a virtio `kind` on this machine (`virtio-blk-device`, ...).
    pub fn dev(self, kind: &str) -> String {
        match self {
            Machine::Microvm => format!("{kind}-device"),
            Machine::Pc => format!("{kind}-pci"),
        }
    }
}
