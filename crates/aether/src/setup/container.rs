//! Container setup inside aether. See the module docs of [`crate::setup`].
//!
//! Order: mounts (root, /proc, /sys, /dev, pivot_root), masks, read-only paths, hostname,
//! OOM score, fd hygiene, then the restrictions that every command inherits: capabilities,
//! no_new_privs, seccomp, and finally non-dumpable.

use std::os::fd::RawFd;

use dsec_wire::aether::ContainerSetup;

use super::sys::RealSys;
use super::{caps, mounts, seccomp};

/// Why the sandbox could not be set up; sent to the edge as a `Setup` error.
#[derive(Debug)]
pub struct SetupError(pub String);

impl std::fmt::Display for SetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SetupError {}

fn fail(what: &str, e: impl std::fmt::Display) -> SetupError {
    SetupError(format!("{what}: {e}"))
}

/// The highest fd that survives setup: 3 is the edge channel, 4 an optional listener.
pub const KEEP_FDS_UP_TO: RawFd = 4;

/// Checks the message before anything is mounted.
pub fn validate(setup: &ContainerSetup) -> Result<(), SetupError> {
    let bad = |m: String| Err(SetupError(m));
    let host_path_ok = |p: &str| p.starts_with('/') && !p.contains([':', ',', '\\', '\0']) && !p.split('/').any(|c| c == "..");
    if setup.lowers.is_empty() {
        return bad("no lower layers".into());
    }
    for p in setup.lowers.iter().chain([&setup.upper, &setup.work, &setup.rootfs]) {
        if !host_path_ok(p) {
            return bad(format!("bad layer path {p:?}"));
        }
    }
    for p in setup.masked_paths.iter().chain(&setup.readonly_paths) {
        if !p.starts_with('/') || p.contains('\0') || p.split('/').any(|c| c == "..") {
            return bad(format!("bad masked or read-only path {p:?}"));
        }
    }
    let h = &setup.hostname;
    if h.is_empty() || h.len() > 64 || !h.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.') {
        return bad(format!("bad hostname {h:?}"));
    }
    Ok(())
}

/// Builds the sandbox's root and restrictions. Called once, as PID 1, before serving.
///
/// Closes every fd above [`KEEP_FDS_UP_TO`] and points 0–2 at /dev/null: open nothing the
/// server needs before calling it. Processes forked afterwards inherit `oom_score_adj` -1000
/// and must raise it back to 0 before exec (`/proc/self/oom_score_adj`), so that the OOM
/// killer picks user processes and never aether.
pub fn apply(setup: &ContainerSetup) -> Result<(), SetupError> {
    validate(setup)?;
    let mut sys = RealSys;
    let spec = mounts::RootSpec {
        lowers: &setup.lowers,
        upper: &setup.upper,
        work: &setup.work,
        rootfs: &setup.rootfs,
        shm_mb: setup.shm_mb,
    };
    mounts::build_root(&mut sys, &spec).map_err(|e| fail("build root", e))?;
    mounts::mask(&mut sys, &setup.masked_paths).map_err(|e| fail("mask paths", e))?;
    mounts::make_readonly(&mut sys, &setup.readonly_paths).map_err(|e| fail("read-only paths", e))?;
    nix::unistd::sethostname(&setup.hostname).map_err(|e| fail("sethostname", e))?;
    std::fs::write("/proc/self/oom_score_adj", "-1000").map_err(|e| fail("set oom_score_adj", e))?;
    fd_hygiene().map_err(|e| fail("close inherited fds", e))?;
    caps::restrict().map_err(|e| fail("drop capabilities", e))?;
    caps::set_no_new_privs().map_err(|e| fail("set no_new_privs", e))?;
    seccomp::install().map_err(|e| fail("seccomp", e))?;
    caps::set_non_dumpable().map_err(|e| fail("set non-dumpable", e))?;
    Ok(())
}

/// Closes every fd above [`KEEP_FDS_UP_TO`] and reopens 0, 1, 2 on /dev/null (the edge's
/// stdio must not leak into the sandbox).
fn fd_hygiene() -> std::io::Result<()> {
    close_range_from(KEEP_FDS_UP_TO + 1)?;
    let null = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null")?;
    for fd in 0..=2 {
        dup2(std::os::fd::AsRawFd::as_raw_fd(&null), fd)?;
    }
    Ok(())
}

/// `close_range(first, ~0, 0)`.
fn close_range_from(first: RawFd) -> std::io::Result<()> {
    // SAFETY: closes fds we do not reference anywhere afterwards (nothing above 4 is held by
    // this process at this point of setup).
    let rc = unsafe { libc::syscall(libc::SYS_close_range, first as libc::c_uint, libc::c_uint::MAX, 0 as libc::c_uint) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `dup2(old, new)`.
fn dup2(old: RawFd, new: RawFd) -> std::io::Result<()> {
    // SAFETY: dup2 on integer fds; `new` is one of 0..=2 which we deliberately replace.
    if unsafe { libc::dup2(old, new) } < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok_setup() -> ContainerSetup {
        ContainerSetup {
            sandbox_id: "sb-n0-0000000000000001".into(),
            hostname: "box".into(),
            lowers: vec!["/l/a".into()],
            upper: "/s/upper".into(),
            work: "/s/work".into(),
            rootfs: "/s/rootfs".into(),
            masked_paths: vec!["/proc/kcore".into()],
            ..Default::default()
        }
    }

    #[test]
    fn validation() {
        assert!(validate(&ok_setup()).is_ok());
        let mut s = ok_setup();
        s.lowers = vec!["/a:/b".into()];
        assert!(validate(&s).is_err());
        let mut s = ok_setup();
        s.lowers.clear();
        assert!(validate(&s).is_err());
        let mut s = ok_setup();
        s.upper = "rel".into();
        assert!(validate(&s).is_err());
        let mut s = ok_setup();
        s.masked_paths.push("/proc/../etc".into());
        assert!(validate(&s).is_err());
        let mut s = ok_setup();
        s.hostname = "a;b".into();
        assert!(validate(&s).is_err());
    }
}
