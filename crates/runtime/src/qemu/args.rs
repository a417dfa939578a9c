//! The parts of a QEMU command line every VM of ours shares (microVMs and full VMs): the
//! accelerator, path quoting, and the control arguments (aether channel, QMP, pidfile).

use std::path::Path;

/// Which accelerator QEMU uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    /// The names [`Accel::parse`] accepts, for error messages.
    pub const ALLOWED: &'static str = "\"kvm\" or \"tcg\"";

    /// `kvm` | `tcg`.
    pub fn parse(s: &str) -> Option<Accel> {
        match s {
            "kvm" => Some(Accel::Kvm),
            "tcg" => Some(Accel::Tcg),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }

    /// The guest CPU model. It must offer RDRAND: a guest kernel without a trusted CPU RNG
    /// initialises its CRNG from interrupt jitter, and the first `getrandom` (aether's first
    /// command, anything hashing with a random seed) blocks until then — ≈ 1.5 s after boot
    /// under TCG. `qemu64` (QEMU's default) lacks RDRAND; TCG emulates it with `+rdrand`.
    pub fn cpu_model(self) -> &'static str {
        match self {
            Accel::Kvm => "host",
            Accel::Tcg => "qemu64,+rdrand",
        }
    }
}

/// The default size of TCG's translation cache in MiB (`[edge.microvm] tcg_tb_mb`; `0`:
/// QEMU's own default). QEMU 7.2 reserves 1 GiB by default and fills it before it
/// flushes, so each guest's cache only grows (≈ 100 MB resident after a boot and a Python
/// task, anonymous and private to the VM). A smaller cache is flushed and refilled more often
/// — code that runs again is translated again — which costs CPU time, not memory.
/// Only TCG has one (KVM runs guest code natively).
pub const DEFAULT_TCG_TB_MB: u64 = 64;

/// The translation cache size to ask QEMU for (None: QEMU's default) from the configured
/// size in MiB (`0`: QEMU's default).
pub fn tcg_tb_mb(configured: u64) -> Option<u64> {
    (configured != 0).then_some(configured)
}

/// The `-accel` option value: the accelerator and, under TCG, its translation cache size.
pub(crate) fn accel_option(accel: Accel, tb_mb: Option<u64>) -> String {
    match (accel, tb_mb) {
        (Accel::Tcg, Some(n)) => format!("tcg,tb-size={n}"),
        _ => accel.as_str().to_string(),
    }
}

/// A path as a QEMU option value: a literal `,` is written twice (`,` separates options).
/// Shared by the microVM and full-VM command lines.
pub(crate) fn esc(p: &Path) -> String {
    p.display().to_string().replace(',', ",,")
}

/// The arguments every VM of ours ends with: the aether channel (virtio-serial port
/// `dsec.aether` on a unix socket the edge connects to, through `serial_device`), the QMP
/// socket and the pidfile.
pub(crate) fn control_args(
    serial_device: &str,
    aether_socket: &Path,
    qmp_socket: &Path,
    pidfile: &Path,
) -> Vec<String> {
    vec![
        "-device".into(),
        serial_device.into(),
        "-chardev".into(),
        format!(
            "socket,id=aether,path={},server=on,wait=off",
            esc(aether_socket)
        ),
        "-device".into(),
        "virtserialport,chardev=aether,name=dsec.aether".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", esc(qmp_socket)),
        "-pidfile".into(),
        esc(pidfile),
    ]
}

/// Quotes a value for a POSIX shell (`'...'`, with embedded quotes escaped).
pub fn shell_quote(v: &str) -> String {
    format!("'{}'", v.replace('\'', "'\\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commas_in_paths_are_doubled() {
        assert_eq!(esc(Path::new("/a,b/c")), "/a,,b/c");
        let v = control_args(
            "virtio-serial-device",
            Path::new("/d/a.sock"),
            Path::new("/d/q,mp.sock"),
            Path::new("/d/pid"),
        );
        assert!(
            v.contains(&"unix:/d/q,,mp.sock,server=on,wait=off".to_string()),
            "{v:?}"
        );
        assert_eq!(v.last().map(String::as_str), Some("/d/pid"));
    }
}
