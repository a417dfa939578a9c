//! Container setup inside aether. See the module docs of [`crate::setup`].
//!
//! Order: mounts (root, /proc, /sys, /dev, pivot_root), masks, read-only paths, hostname,
//! OOM score, fd hygiene, then the restrictions that every command inherits: capabilities,
//! no_new_privs, seccomp, and finally non-dumpable.

use std::os::fd::RawFd;

use dsec_wire::aether::ContainerSetup;

use super::sys::RealSys;
use super::{caps, landlock, mounts, seccomp};

/// Why the sandbox could not be set up; sent to the edge as a `Setup` error, or as a
/// `BadRequest` when the request asked for something the image cannot give
/// ([`SetupError::caller_mistake`]).
#[derive(Debug)]
pub struct SetupError {
    pub message: String,
    /// The create request is wrong (e.g. a protected path the image lacks): a 4xx to its caller.
    pub caller_mistake: bool,
}

impl std::fmt::Display for SetupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for SetupError {}

fn fail(what: &str, e: impl std::fmt::Display) -> SetupError {
    SetupError {
        message: format!("{what}: {e}"),
        caller_mistake: false,
    }
}

/// Every protected path must exist in the sandbox's root (called after pivot_root): a path
/// the image lacks is the caller's mistake, named in the error.
fn check_protected_paths(paths: &[String]) -> Result<(), SetupError> {
    for p in paths {
        if let Err(e) = std::fs::symlink_metadata(p) {
            let why = match e.kind() {
                std::io::ErrorKind::NotFound => "does not exist in the image".to_string(),
                _ => format!("cannot be looked up in the image ({e})"),
            };
            return Err(SetupError {
                message: format!(
                    "protected_paths: {p} {why}; name paths that exist in the image or drop it"
                ),
                caller_mistake: true,
            });
        }
    }
    Ok(())
}

/// The highest fd that survives setup: 3 is the edge channel, 4 an optional listener, 5 the
/// user cgroup's `cgroup.procs` (optional, see `sys::USER_CGROUP_FD`).
pub const KEEP_FDS_UP_TO: RawFd = 5;

/// Checks the message before anything is mounted.
pub fn validate(setup: &ContainerSetup) -> Result<(), SetupError> {
    let bad = |message: String| {
        Err(SetupError {
            message,
            caller_mistake: false,
        })
    };
    let host_path_ok = |p: &str| {
        p.starts_with('/')
            && !p.contains([':', ',', '\\', '\0'])
            && !p.split('/').any(|c| c == "..")
    };
    if setup.lowers.is_empty() {
        return bad("no lower layers".into());
    }
    for p in setup
        .lowers
        .iter()
        .chain([&setup.upper, &setup.work, &setup.rootfs])
    {
        if !host_path_ok(p) {
            return bad(format!("bad layer path {p:?}"));
        }
    }
    for p in setup.masked_paths.iter().chain(&setup.readonly_paths) {
        if !p.starts_with('/') || p.contains('\0') || p.split('/').any(|c| c == "..") {
            return bad(format!("bad masked or read-only path {p:?}"));
        }
    }
    for b in &setup.binds {
        if !host_path_ok(&b.source) {
            return bad(format!("bad volume source {:?}", b.source));
        }
        if let Err(m) = dsec_wire::api::check_volume_path(&b.target) {
            return bad(m);
        }
    }
    let h = &setup.hostname;
    if h.is_empty()
        || h.len() > 64
        || !h
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
    {
        return bad(format!("bad hostname {h:?}"));
    }
    Ok(())
}

/// Builds the sandbox's root and restrictions. Called once, as PID 1, before serving.
///
/// Closes every fd above [`KEEP_FDS_UP_TO`] (except duplicates of fds 3 to 5) and points 0–2
/// at /dev/null: open nothing else the server needs before calling it. Sets the
/// `oom_score_adj` that commands take before exec (`sys::set_child_oom_score_adj`): 0 when
/// aether got -1000, else 1000, so that the OOM killer picks user processes, never aether.
pub fn apply(setup: &ContainerSetup) -> Result<(), SetupError> {
    validate(setup)?;
    let mut sys = RealSys;
    let spec = mounts::RootSpec {
        lowers: &setup.lowers,
        upper: &setup.upper,
        work: &setup.work,
        rootfs: &setup.rootfs,
        shm_mb: setup.shm_mb,
        binds: &setup.binds,
    };
    mounts::build_root(&mut sys, &spec).map_err(|e| fail("build root", e))?;
    mounts::mask(&mut sys, &setup.masked_paths).map_err(|e| fail("mask paths", e))?;
    mounts::make_readonly(&mut sys, &setup.readonly_paths)
        .map_err(|e| fail("read-only paths", e))?;
    nix::unistd::sethostname(&setup.hostname).map_err(|e| fail("sethostname", e))?;
    check_protected_paths(&setup.protected_paths)?;
    protect_from_oom()?;
    fd_hygiene().map_err(|e| fail("close inherited fds", e))?;
    // Only members of PROC_GID see every /proc/<pid> (see `mounts::PROC_GID`); aether is one,
    // the commands it starts are not (they get their own user's groups).
    nix::unistd::setgroups(&[nix::unistd::Gid::from_raw(mounts::PROC_GID)])
        .map_err(|e| fail("join the /proc viewer group", std::io::Error::from(e)))?;
    caps::restrict().map_err(|e| fail("drop capabilities", e))?;
    caps::set_no_new_privs().map_err(|e| fail("set no_new_privs", e))?;
    landlock::apply(&setup.protected_paths).map_err(|e| fail("landlock", e))?;
    seccomp::install().map_err(|e| fail("seccomp", e))?;
    caps::set_non_dumpable().map_err(|e| fail("set non-dumpable", e))?;
    Ok(())
}

/// Closes every fd above [`KEEP_FDS_UP_TO`] that is not a duplicate of fds 3 to 5 (aether's
/// writer may hold a dup of the channel), and reopens 0, 1, 2 on /dev/null (the edge's stdio
/// must not leak into the sandbox).
fn fd_hygiene() -> std::io::Result<()> {
    let keep: Vec<(u64, u64)> = (3..=KEEP_FDS_UP_TO).filter_map(fd_identity).collect();
    let mut open = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd")? {
        if let Some(fd) = entry?
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<RawFd>().ok())
        {
            open.push(fd);
        }
    }
    for fd in open {
        if fd > KEEP_FDS_UP_TO && !fd_identity(fd).is_some_and(|id| keep.contains(&id)) {
            close(fd);
        }
    }
    let null = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")?;
    for fd in 0..=2 {
        dup2(std::os::fd::AsRawFd::as_raw_fd(&null), fd)?;
    }
    Ok(())
}

/// (device, inode) of what `fd` refers to, if it is open.
fn fd_identity(fd: RawFd) -> Option<(u64, u64)> {
    // SAFETY: fstat writes into a stat buffer we own; an unopened fd just fails with EBADF.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        (libc::fstat(fd, &mut st) == 0).then_some((st.st_dev, st.st_ino))
    }
}

/// `close(fd)`, ignoring errors (the fd list came from /proc and may include the dir's own fd).
fn close(fd: RawFd) {
    // SAFETY: closes an fd this process does not use after setup (not 0-4, not a channel dup).
    unsafe { libc::close(fd) };
}

/// Sets aether's `oom_score_adj` to -1000. Lowering it needs CAP_SYS_RESOURCE; on a host that
/// withholds it from the edge aether keeps the edge's score and commands raise theirs to 1000
/// instead (aether may hold tens of MiB of captured output: next to a fork bomb's small
/// processes it would be the largest, and the OOM killer's choice, at equal scores).
fn protect_from_oom() -> Result<(), SetupError> {
    let protected = match std::fs::write("/proc/self/oom_score_adj", "-1000") {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            eprintln!(
                "dsec-aether: cannot lower oom_score_adj (no CAP_SYS_RESOURCE): {e}; commands run with oom_score_adj 1000"
            );
            false
        }
        Err(e) => return Err(fail("set oom_score_adj", e)),
    };
    crate::sys::set_child_oom_score_adj(crate::sys::child_oom_score_adj(protected));
    Ok(())
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
    use std::os::unix::process::CommandExt;
    use std::process::Command;

    #[test]
    fn a_protected_path_missing_from_the_image_is_the_callers_mistake() {
        let there = std::env::temp_dir().to_string_lossy().to_string();
        assert!(check_protected_paths(&[there.clone(), "/".into()]).is_ok());
        let missing = format!(
            "{there}/dsec-aether-test-{}/no/such/dir",
            std::process::id()
        );
        let e = check_protected_paths(&[there, missing.clone()]).unwrap_err();
        assert!(e.caller_mistake);
        assert!(
            e.message.contains(&missing) && e.message.contains("does not exist in the image"),
            "{e}"
        );
        assert!(!fail("mount", "EPERM").caller_mistake);
    }

    /// Runs `sh -c script` under busybox with aether's capability set, no_new_privs and
    /// seccomp filter applied between fork and exec; returns (exit code, stdout+stderr).
    fn restricted(script: &str) -> (i32, String) {
        let filters = seccomp::Filters::build().unwrap();
        let last = caps::last_cap();
        let mut cmd = Command::new("/bin/busybox");
        cmd.args(["sh", "-c", script]);
        // SAFETY: the closure only makes prctl/capset/seccomp system calls on data prepared
        // before the fork; it allocates only on the error path.
        unsafe {
            cmd.pre_exec(move || {
                caps::restrict_upto(last)?;
                caps::set_no_new_privs()?;
                filters.install().map_err(|e| std::io::Error::other(e.0))?;
                Ok(())
            });
        }
        let out = cmd.output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code().unwrap_or(-1), text)
    }

    fn can_run() -> bool {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping: needs root");
            return false;
        }
        if !std::path::Path::new("/bin/busybox").exists() {
            eprintln!("skipping: /bin/busybox (busybox-static) not installed");
            return false;
        }
        true
    }

    #[test]
    fn restrictions_hold_for_root() {
        if !can_run() {
            return;
        }
        let path = std::env::temp_dir().join(format!("dsec-setup-test-{}", std::process::id()));
        std::fs::create_dir_all(&path).unwrap();
        let d = path.display();
        // Normal work still runs: fork (clone3 falls back to clone), pipes, files, chown, kill.
        let (code, out) = restricted(&format!(
            "echo hi | cat > {d}/f && chown 1000:1000 {d}/f && chmod 600 {d}/f && cat {d}/f; sleep 5 & kill $! ; wait; mkfifo {d}/p && echo fifo-ok"
        ));
        assert_eq!(code, 0, "{out}");
        assert!(out.contains("hi") && out.contains("fifo-ok"), "{out}");
        // Privileged operations fail.
        for script in [
            format!("mount -t tmpfs none {d}"),
            "unshare -m true".to_string(),
            "unshare -n true".to_string(),
            format!("mknod {d}/b b 8 0"),
            format!("mknod {d}/c c 1 3"),
            "hostname evil".to_string(),
            // busybox date exits 0 even when it cannot set the clock.
            "date -s 2001-01-01 2>&1 | grep -q 'not permitted' && exit 1; exit 0".to_string(),
            "insmod /nonexistent.ko".to_string(),
            "nsenter -t 1 -m true".to_string(),
            "cat /proc/1/environ".to_string(),
        ] {
            let (code, out) = restricted(&script);
            assert_ne!(code, 0, "{script} succeeded: {out}");
        }
        let (_, status) =
            restricted("grep -E '^Cap(Bnd|Eff|Prm)|^NoNewPrivs|^Seccomp:' /proc/self/status");
        let mask = format!("{:08x}{:08x}", caps::keep_mask()[1], caps::keep_mask()[0]);
        assert!(status.contains(&format!("CapBnd:\t{mask}")), "{status}");
        assert!(status.contains(&format!("CapEff:\t{mask}")), "{status}");
        assert!(status.contains("NoNewPrivs:\t1"), "{status}");
        assert!(status.contains("Seccomp:\t2"), "{status}");
    }

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
