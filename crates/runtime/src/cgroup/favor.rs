//! `favordynmods`: make `cgroup.procs` moves cheap on this node.
//!
//! Every move of a task between cgroups (a container's first process joining its cgroups,
//! aether moving each command into the user cgroup) write-locks the kernel's global
//! `cgroup_threadgroup_rwsem`. By default that percpu rwsem is optimised for readers (fork,
//! exit), so each writer waits for an RCU grace period: ≈ 5 ms median, up to 17 ms, on an idle
//! 2-core host. A hierarchy mounted with `favordynmods` switches the rwsem to its
//! writer-friendly mode for as long as such a hierarchy exists (and, on Linux ≥ 6.18, moves use
//! a per-thread-group rwsem from then on) — moves then take ≈ 0.1 ms, at the price of slightly
//! slower fork and exit.
//!
//! How the edge turns it on ([`ensure`], once per process, held until the process exits):
//! * **cgroup v1** (and hybrid hosts): a named, controller-less v1 hierarchy
//!   `name=`[`HIERARCHY_NAME`] with `favordynmods`, created with the new mount API
//!   (`fsopen`/`fsconfig`/`fsmount`) and kept as a *detached* mount: the edge holds the mount's
//!   fd and never attaches it to a path. Nothing is visible in the host's mount table, and when
//!   the edge exits — even by SIGKILL — the fd closes and the hierarchy goes away with it: no
//!   mount can leak. Several edges on one host share the hierarchy (same name and options).
//! * **cgroup v2**: the unified root is remounted with its current super options plus
//!   `favordynmods` (a fresh mount would reset the root's other flags such as `nsdelegate`).
//!   This is a persistent node setting: it is not undone when the edge exits.
//!
//! [`status`] reports what happened (node capability `cgroup_favordynmods`).

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::OnceLock;

use super::{CgroupRoot, CgroupVersion};

/// Name of the controller-less v1 hierarchy that carries the option.
pub const HIERARCHY_NAME: &str = "dsec_favordynmods";

const FSOPEN_CLOEXEC: libc::c_uint = 1;
const FSMOUNT_CLOEXEC: libc::c_uint = 1;
const FSCONFIG_SET_FLAG: libc::c_uint = 0;
const FSCONFIG_SET_STRING: libc::c_uint = 1;
const FSCONFIG_CMD_CREATE: libc::c_uint = 6;

/// Whether moves are cheap on this node, and how that was achieved (or why not).
#[derive(Debug)]
pub struct FavorDynmods {
    on: bool,
    detail: String,
    /// The detached mount of the v1 hierarchy; closing it (process exit) ends the setting.
    _mount: Option<OwnedFd>,
}

impl FavorDynmods {
    pub fn is_on(&self) -> bool {
        self.on
    }

    /// What was done or seen (`detached v1 hierarchy name=...`, `EINVAL`, ...).
    pub fn detail(&self) -> &str {
        &self.detail
    }
}

static STATE: OnceLock<FavorDynmods> = OnceLock::new();

/// Turns `favordynmods` on for `root`'s host (first call in the process; later calls return the
/// first result). Never fails: a kernel without the option is reported, not fatal.
pub fn ensure(root: &CgroupRoot) -> &'static FavorDynmods {
    STATE.get_or_init(|| {
        let r = match root.version {
            CgroupVersion::V1 => hold_v1_hierarchy().map(|fd| {
                (
                    Some(fd),
                    format!("detached v1 hierarchy name={HIERARCHY_NAME},favordynmods held by the edge"),
                )
            }),
            CgroupVersion::V2 => remount_v2(&root.path).map(|d| (None, d)),
        };
        let s = match r {
            Ok((mount, detail)) => FavorDynmods {
                on: true,
                detail,
                _mount: mount,
            },
            Err(e) => FavorDynmods {
                on: false,
                detail: e.to_string(),
                _mount: None,
            },
        };
        if s.on {
            tracing::info!(detail = %s.detail, "cgroup favordynmods on");
        } else {
            tracing::warn!(detail = %s.detail, "cgroup favordynmods unavailable: cgroup moves wait for RCU grace periods");
        }
        s
    })
}

/// The state [`ensure`] left, if it ran in this process.
pub fn status() -> Option<&'static FavorDynmods> {
    STATE.get()
}

fn cstr(s: &str) -> std::ffi::CString {
    // Only called with literals free of NUL.
    std::ffi::CString::new(s).unwrap_or_default()
}

/// Why `favordynmods` could not be turned on (reported, never fatal).
#[derive(Debug, thiserror::Error)]
pub enum FavorError {
    /// A system call failed: what was called, and the error.
    #[error("{call}: {source}")]
    Sys { call: String, source: io::Error },
    /// `fsconfig` refused a key (`EINVAL` is named: an old kernel without the option).
    #[error("fsconfig {key}: {reason}")]
    Config { key: String, reason: String },
    #[error("no cgroup2 mount at {}", .0.display())]
    NoMount(std::path::PathBuf),
    #[error("NUL in {0}")]
    Nul(&'static str),
}

fn last_err(call: &str) -> FavorError {
    FavorError::Sys {
        call: call.to_string(),
        source: io::Error::last_os_error(),
    }
}

/// `fsopen("cgroup")`, `none`, `name=`, `favordynmods`, create, `fsmount`: the mount fd.
fn hold_v1_hierarchy() -> Result<OwnedFd, FavorError> {
    let fstype = cstr("cgroup");
    // SAFETY: fsopen reads a NUL-terminated string we own and returns a new fd or -1.
    let fs = unsafe { libc::syscall(libc::SYS_fsopen, fstype.as_ptr(), FSOPEN_CLOEXEC) };
    if fs < 0 {
        return Err(last_err("fsopen cgroup"));
    }
    // SAFETY: fsopen returned a fresh fd that nobody else owns.
    let fs = unsafe { OwnedFd::from_raw_fd(fs as RawFd) };
    let fsfd = std::os::fd::AsRawFd::as_raw_fd(&fs);
    let set = |cmd: libc::c_uint, key: &str, value: Option<&str>| -> Result<(), FavorError> {
        let k = cstr(key);
        let v = value.map(cstr);
        let vp = v.as_ref().map_or(std::ptr::null(), |v| v.as_ptr());
        // SAFETY: fsconfig reads the NUL-terminated key/value strings, which outlive the call.
        let rc = unsafe { libc::syscall(libc::SYS_fsconfig, fsfd, cmd, k.as_ptr(), vp, 0) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            let errno = e.raw_os_error().unwrap_or(0);
            let name = if errno == libc::EINVAL {
                "EINVAL".to_string()
            } else {
                e.to_string()
            };
            return Err(FavorError::Config {
                key: key.to_string(),
                reason: name,
            });
        }
        Ok(())
    };
    set(FSCONFIG_SET_FLAG, "none", None)?;
    set(FSCONFIG_SET_STRING, "name", Some(HIERARCHY_NAME))?;
    set(FSCONFIG_SET_FLAG, "favordynmods", None)?;
    // SAFETY: FSCONFIG_CMD_CREATE takes no key or value.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_fsconfig,
            fsfd,
            FSCONFIG_CMD_CREATE,
            std::ptr::null::<libc::c_char>(),
            std::ptr::null::<libc::c_char>(),
            0,
        )
    };
    if rc != 0 {
        return Err(last_err("fsconfig create"));
    }
    // SAFETY: fsmount turns the configured context into a detached mount fd (or -1).
    let m = unsafe { libc::syscall(libc::SYS_fsmount, fsfd, FSMOUNT_CLOEXEC, 0) };
    if m < 0 {
        return Err(last_err("fsmount"));
    }
    // SAFETY: fsmount returned a fresh fd that nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(m as RawFd) })
}

/// Super options of the cgroup2 mount at `path` from a `mountinfo` text.
pub fn cgroup2_super_options(mountinfo: &str, path: &Path) -> Option<Vec<String>> {
    let want = path.to_str()?;
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mount_point = left.split(' ').nth(4)?;
        let mut r = right.split(' ');
        let fstype = r.next()?;
        let _source = r.next()?;
        let opts = r.next()?;
        (mount_point == want && fstype == "cgroup2").then(|| {
            opts.split(',')
                .filter(|o| !o.is_empty() && *o != "rw" && *o != "ro")
                .map(str::to_string)
                .collect()
        })
    })
}

/// Remounts the cgroup2 root at `path` with its own options plus `favordynmods`.
fn remount_v2(path: &Path) -> Result<String, FavorError> {
    let info =
        std::fs::read_to_string("/proc/self/mountinfo").map_err(|source| FavorError::Sys {
            call: "read /proc/self/mountinfo".into(),
            source,
        })?;
    let mut opts = cgroup2_super_options(&info, path)
        .ok_or_else(|| FavorError::NoMount(path.to_path_buf()))?;
    if opts.iter().any(|o| o == "favordynmods") {
        return Ok(format!(
            "{} already mounted with favordynmods",
            path.display()
        ));
    }
    opts.push("favordynmods".into());
    let data = opts.join(",");
    let target = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| FavorError::Nul("cgroup path"))?;
    let cdata = std::ffi::CString::new(data.clone()).map_err(|_| FavorError::Nul("options"))?;
    // SAFETY: mount(2) reads the NUL-terminated strings we own; a remount changes only the
    // superblock options given.
    let rc = unsafe {
        libc::mount(
            std::ptr::null(),
            target.as_ptr(),
            std::ptr::null(),
            libc::MS_REMOUNT,
            cdata.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(last_err(&format!("remount {} {data}", path.display())));
    }
    Ok(format!("{} remounted {data}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cgroup2_super_options() {
        let info = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
                    40 31 0:37 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n";
        assert_eq!(
            cgroup2_super_options(info, Path::new("/sys/fs/cgroup/unified")).unwrap(),
            vec!["nsdelegate", "memory_recursiveprot"]
        );
        assert!(cgroup2_super_options(info, Path::new("/sys/fs/cgroup")).is_none());
    }

    #[test]
    fn v1_hierarchy_carries_the_option() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            println!("skipped: needs root");
            return;
        }
        let fd = match hold_v1_hierarchy() {
            Ok(fd) => fd,
            Err(e) => {
                println!("skipped: kernel refuses the hierarchy: {e}");
                return;
            }
        };
        // A second mount of the same named hierarchy shows the superblock's options.
        assert!(held_hierarchy_has_option(), "favordynmods not seen");
        drop(fd);
    }

    /// Mounts the named hierarchy at a temporary dir without asking for the option, reads back the
    /// options the kernel shows (those of the existing hierarchy, if one is held), unmounts. For
    /// tests and diagnostics.
    fn held_hierarchy_has_option() -> bool {
        let Ok(dir) = tempfile::tempdir() else {
            return false;
        };
        let Ok(target) = std::ffi::CString::new(dir.path().as_os_str().as_encoded_bytes()) else {
            return false;
        };
        let src = cstr("cgroup");
        let data = cstr(&format!("none,name={HIERARCHY_NAME}"));
        // SAFETY: mount(2) reads NUL-terminated strings we own.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                src.as_ptr(),
                0,
                data.as_ptr().cast(),
            )
        };
        if rc != 0 {
            return false;
        }
        let want = dir.path().to_string_lossy().into_owned();
        let seen = std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .any(|l| l.split(' ').nth(4) == Some(&want) && l.contains("favordynmods"));
        // SAFETY: unmounting the mount made above.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        seen
    }
}
