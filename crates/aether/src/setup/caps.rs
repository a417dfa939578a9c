//! Capabilities of aether (and so of every command it starts as root): Docker's default set
//! minus `CAP_MKNOD`. Everything else leaves the bounding set, so nothing can regain it.

use std::io;

/// Capability numbers from `linux/capability.h`.
pub const CAP_CHOWN: u32 = 0;
pub const CAP_DAC_OVERRIDE: u32 = 1;
pub const CAP_FOWNER: u32 = 3;
pub const CAP_FSETID: u32 = 4;
pub const CAP_KILL: u32 = 5;
pub const CAP_SETGID: u32 = 6;
pub const CAP_SETUID: u32 = 7;
pub const CAP_SETPCAP: u32 = 8;
pub const CAP_NET_BIND_SERVICE: u32 = 10;
pub const CAP_NET_RAW: u32 = 13;
pub const CAP_SYS_CHROOT: u32 = 18;
pub const CAP_AUDIT_WRITE: u32 = 29;
pub const CAP_SETFCAP: u32 = 31;

/// The capabilities root inside a container keeps.
pub const KEEP: &[u32] = &[
    CAP_CHOWN,
    CAP_DAC_OVERRIDE,
    CAP_FSETID,
    CAP_FOWNER,
    CAP_NET_RAW,
    CAP_SETGID,
    CAP_SETUID,
    CAP_SETFCAP,
    CAP_SETPCAP,
    CAP_NET_BIND_SERVICE,
    CAP_SYS_CHROOT,
    CAP_KILL,
    CAP_AUDIT_WRITE,
];

/// The kept set as the two 32-bit words `capset` takes.
pub fn keep_mask() -> [u32; 2] {
    let mut m = [0u32; 2];
    for &c in KEEP {
        m[(c / 32) as usize] |= 1 << (c % 32);
    }
    m
}

/// The highest capability number the kernel knows.
pub fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(63)
}

/// `prctl(option, arg2, 0, 0, 0)`.
fn prctl(option: libc::c_int, arg2: libc::c_ulong) -> io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    let rc = unsafe {
        libc::prctl(
            option,
            arg2,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;

/// `capset(2)` for the calling thread, the same mask for effective, permitted, inheritable.
fn capset(mask: [u32; 2]) -> io::Result<()> {
    let header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let data = [
        CapData {
            effective: mask[0],
            permitted: mask[0],
            inheritable: mask[0],
        },
        CapData {
            effective: mask[1],
            permitted: mask[1],
            inheritable: mask[1],
        },
    ];
    // SAFETY: a version-3 header and an array of two data structs, as the kernel expects.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header as *const CapHeader, data.as_ptr()) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Drops every capability not in [`KEEP`] from the bounding set, clears the ambient set and
/// sets effective/permitted/inheritable to [`KEEP`].
pub fn restrict() -> io::Result<()> {
    restrict_upto(last_cap())
}

/// [`restrict`] with the kernel's highest capability number given (allocation-free on success,
/// usable between fork and exec).
pub fn restrict_upto(last_cap: u32) -> io::Result<()> {
    for cap in 0..=last_cap {
        if !KEEP.contains(&cap) {
            prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong).map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("drop capability {cap} from the bounding set: {e}"),
                )
            })?;
        }
    }
    prctl(
        libc::PR_CAP_AMBIENT,
        libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong,
    )
    .map_err(|e| io::Error::new(e.kind(), format!("clear ambient capabilities: {e}")))?;
    capset(keep_mask()).map_err(|e| io::Error::new(e.kind(), format!("capset: {e}")))
}

/// `PR_SET_NO_NEW_PRIVS`: execve never grants privileges again (setuid bits, file caps).
pub fn set_no_new_privs() -> io::Result<()> {
    prctl(libc::PR_SET_NO_NEW_PRIVS, 1)
}

/// `PR_SET_DUMPABLE 0`: /proc/1/{environ,fd,mem,...} become unreadable for root inside.
pub fn set_non_dumpable() -> io::Result<()> {
    prctl(libc::PR_SET_DUMPABLE, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mask_is_docker_minus_mknod() {
        let m = keep_mask();
        // CAP_MKNOD is 27: not kept. CAP_SYS_ADMIN 21, CAP_SYS_PTRACE 19, CAP_SYS_MODULE 16: not kept.
        for dropped in [27u32, 21, 19, 16, 12, 2, 24, 25] {
            assert_eq!(m[0] & (1 << dropped), 0, "cap {dropped}");
        }
        assert_eq!(m[1], 0);
        assert_eq!(m[0].count_ones() as usize, KEEP.len());
        assert_ne!(m[0] & (1 << CAP_SETUID), 0);
    }
}
