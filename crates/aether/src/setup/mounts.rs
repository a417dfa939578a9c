//! The container's file system view, built in aether's fresh mount namespace:
//! overlay root, /proc, /sys, a minimal /dev, pivot_root, then masks and read-only paths.

use std::path::{Path, PathBuf};

/// The group whose members see every process in the sandbox's /proc.
///
/// /proc is mounted `hidepid=invisible`: a process sees only the processes it could ptrace.
/// Commands (root without CAP_SYS_PTRACE) therefore see each other but not aether, which is
/// non-dumpable: `/proc/1` does not exist for them, so neither do `/proc/1/fd`, `environ` or
/// `mem`. aether itself must see every process to kill a timed-out command's children, so it
/// alone carries this supplementary group (a gid no image uses).
pub const PROC_GID: u32 = 2_147_480_001;

use nix::mount::MsFlags;

use super::sys::{Kind, Sys};

/// Device nodes created in the container's /dev: (name, major, minor).
pub const DEVICES: &[(&str, u64, u64)] = &[
    ("null", 1, 3),
    ("zero", 1, 5),
    ("full", 1, 7),
    ("random", 1, 8),
    ("urandom", 1, 9),
    ("tty", 5, 0),
];

/// Symlinks in the container's /dev: (name, target).
pub const DEV_LINKS: &[(&str, &str)] = &[
    ("fd", "/proc/self/fd"),
    ("stdin", "/proc/self/fd/0"),
    ("stdout", "/proc/self/fd/1"),
    ("stderr", "/proc/self/fd/2"),
    ("ptmx", "pts/ptmx"),
];

/// A mount step failed; the message names the step and the path.
#[derive(Debug)]
pub struct MountError(pub String);

impl std::fmt::Display for MountError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn ctx<T>(r: std::io::Result<T>, what: impl FnOnce() -> String) -> Result<T, MountError> {
    r.map_err(|e| MountError(format!("{}: {e}", what())))
}

/// What the root is built from (host paths, valid in aether's mount namespace before the pivot).
#[derive(Debug, Clone)]
pub struct RootSpec<'a> {
    pub lowers: &'a [String],
    pub upper: &'a str,
    pub work: &'a str,
    pub rootfs: &'a str,
    pub shm_mb: u64,
    /// Volumes bound into the root just before the pivot.
    pub binds: &'a [dsec_wire::aether::BindSetup],
}

/// The overlay mount options for `spec`.
pub fn overlay_options(spec: &RootSpec<'_>) -> String {
    format!(
        "lowerdir={},upperdir={},workdir={}",
        spec.lowers.join(":"),
        spec.upper,
        spec.work
    )
}

fn mount(
    sys: &mut dyn Sys,
    source: &str,
    target: &Path,
    fstype: &str,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), MountError> {
    ctx(
        sys.mount(Some(source), target, Some(fstype), flags, data),
        || format!("mount {fstype} on {}", target.display()),
    )
}

/// Builds the root and pivots into it. On return, "/" is the sandbox's overlay and no host
/// path is reachable.
pub fn build_root(sys: &mut dyn Sys, spec: &RootSpec<'_>) -> Result<(), MountError> {
    // Nothing we mount may propagate back to the host, and host changes may still flow in.
    ctx(
        sys.mount(
            None,
            Path::new("/"),
            None,
            MsFlags::MS_SLAVE | MsFlags::MS_REC,
            None,
        ),
        || "make / a recursive slave".into(),
    )?;

    let root = PathBuf::from(spec.rootfs);
    mount(
        sys,
        "overlay",
        &root,
        "overlay",
        MsFlags::empty(),
        Some(&overlay_options(spec)),
    )?;
    for d in ["proc", "sys", "dev"] {
        let p = root.join(d);
        ctx(sys.mkdir_all(&p, 0o755), || {
            format!("create mount point {}", p.display())
        })?;
    }

    let nosuid_nodev_noexec = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(
        sys,
        "proc",
        &root.join("proc"),
        "proc",
        nosuid_nodev_noexec,
        Some(&format!("hidepid=invisible,gid={PROC_GID}")),
    )?;
    mount(
        sys,
        "sysfs",
        &root.join("sys"),
        "sysfs",
        nosuid_nodev_noexec | MsFlags::MS_RDONLY,
        None,
    )?;

    let dev = root.join("dev");
    mount(
        sys,
        "tmpfs",
        &dev,
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_STRICTATIME,
        Some("mode=755,size=65536k"),
    )?;
    for (name, major, minor) in DEVICES {
        let p = dev.join(name);
        ctx(sys.mknod_char(&p, 0o666, *major, *minor), || {
            format!("create device {}", p.display())
        })?;
    }
    for (name, target) in DEV_LINKS {
        let p = dev.join(name);
        ctx(sys.symlink(target, &p), || {
            format!("create symlink {}", p.display())
        })?;
    }

    let pts = dev.join("pts");
    ctx(sys.mkdir_all(&pts, 0o755), || {
        format!("create {}", pts.display())
    })?;
    let mut pts_opts = String::from("newinstance,ptmxmode=0666,mode=620");
    if has_group_gid(sys, &root.join("etc/group"), 5) {
        pts_opts.push_str(",gid=5");
    }
    mount(
        sys,
        "devpts",
        &pts,
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some(&pts_opts),
    )?;

    let shm = dev.join("shm");
    ctx(sys.mkdir_all(&shm, 0o1777), || {
        format!("create {}", shm.display())
    })?;
    let shm_opts = format!("mode=1777,size={}m", spec.shm_mb.max(1));
    mount(
        sys,
        "shm",
        &shm,
        "tmpfs",
        nosuid_nodev_noexec,
        Some(&shm_opts),
    )?;

    // POSIX message queues are optional: a kernel without mqueue still gets a sandbox.
    let mq = dev.join("mqueue");
    if sys.mkdir_all(&mq, 0o755).is_ok() {
        let _ = sys.mount(
            Some("mqueue"),
            &mq,
            Some("mqueue"),
            nosuid_nodev_noexec,
            None,
        );
    }

    super::binds::bind_all(sys, &root, spec.binds)?;

    ctx(sys.pivot_into(&root), || {
        format!("pivot_root into {}", root.display())
    })
}

/// True when the image's /etc/group has a group with this gid.
fn has_group_gid(sys: &mut dyn Sys, group_file: &Path, gid: u32) -> bool {
    let Ok(text) = sys.read_to_string(group_file) else {
        return false;
    };
    text.lines().any(|l| {
        l.split(':')
            .nth(2)
            .and_then(|g| g.trim().parse::<u32>().ok())
            == Some(gid)
    })
}

/// Makes each path unreadable: `/dev/null` over files, an empty read-only tmpfs over dirs.
/// Paths that do not exist are skipped. Runs after the pivot.
pub fn mask(sys: &mut dyn Sys, paths: &[String]) -> Result<(), MountError> {
    for p in paths {
        let path = Path::new(p);
        match ctx(sys.kind(path), || format!("inspect {p}"))? {
            None => continue,
            Some(Kind::Dir) => mount(
                sys,
                "tmpfs",
                path,
                "tmpfs",
                MsFlags::MS_RDONLY,
                Some("mode=555,size=4k"),
            )?,
            Some(Kind::Other) => ctx(
                sys.mount(Some("/dev/null"), path, None, MsFlags::MS_BIND, None),
                || format!("mask {p}"),
            )?,
        }
    }
    Ok(())
}

/// Binds each path onto itself read-only. Paths that do not exist are skipped.
pub fn make_readonly(sys: &mut dyn Sys, paths: &[String]) -> Result<(), MountError> {
    for p in paths {
        let path = Path::new(p);
        if ctx(sys.kind(path), || format!("inspect {p}"))?.is_none() {
            continue;
        }
        ctx(
            sys.mount(
                Some(p),
                path,
                None,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None,
            ),
            || format!("bind {p}"),
        )?;
        let flags = MsFlags::MS_BIND
            | MsFlags::MS_REMOUNT
            | MsFlags::MS_RDONLY
            | MsFlags::MS_NOSUID
            | MsFlags::MS_NODEV
            | MsFlags::MS_NOEXEC;
        ctx(sys.mount(Some(p), path, None, flags, None), || {
            format!("remount {p} read-only")
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::sys::fake::FakeSys;
    use super::*;

    fn spec<'a>(lowers: &'a [String]) -> RootSpec<'a> {
        RootSpec {
            lowers,
            upper: "/sb/upper",
            work: "/sb/work",
            rootfs: "/sb/rootfs",
            shm_mb: 64,
            binds: &[],
        }
    }

    #[test]
    fn root_is_built_in_the_proven_order() {
        let lowers = vec!["/layers/tool".to_string(), "/layers/base".to_string()];
        let mut sys = FakeSys::default();
        sys.files.insert(
            "/sb/rootfs/etc/group".into(),
            "root:x:0:\ntty:x:5:\n".into(),
        );
        build_root(&mut sys, &spec(&lowers)).unwrap();
        let c = &sys.calls;
        assert!(
            c[0].starts_with("mount - / - MS_REC | MS_SLAVE"),
            "{}",
            c[0]
        );
        assert_eq!(
            c[1],
            "mount overlay /sb/rootfs overlay (empty) lowerdir=/layers/tool:/layers/base,upperdir=/sb/upper,workdir=/sb/work"
        );
        let pos = |needle: &str| {
            c.iter()
                .position(|l| l.contains(needle))
                .unwrap_or_else(|| panic!("{needle}: {c:#?}"))
        };
        assert!(pos("mkdir /sb/rootfs/proc") < pos("mount proc /sb/rootfs/proc proc"));
        assert!(c[pos("mount sysfs")].contains("MS_RDONLY"));
        assert!(pos("mount tmpfs /sb/rootfs/dev tmpfs") < pos("mknod /sb/rootfs/dev/null 666 1:3"));
        assert!(pos("symlink /sb/rootfs/dev/ptmx -> pts/ptmx") > 0);
        assert!(c[pos("mount devpts")].ends_with("newinstance,ptmxmode=0666,mode=620,gid=5"));
        assert!(c[pos("mount shm /sb/rootfs/dev/shm tmpfs")].ends_with("mode=1777,size=64m"));
        assert_eq!(c.last().unwrap(), "pivot /sb/rootfs");
    }

    #[test]
    fn devpts_without_tty_group() {
        let lowers = vec!["/l".to_string()];
        let mut sys = FakeSys::default();
        build_root(&mut sys, &spec(&lowers)).unwrap();
        assert!(sys
            .calls
            .iter()
            .any(|l| l.starts_with("mount devpts") && l.ends_with("mode=620")));
    }

    #[test]
    fn masks_files_and_dirs_and_skips_missing() {
        let mut sys = FakeSys::default();
        sys.kinds.insert("/proc/kcore".into(), Kind::Other);
        sys.kinds.insert("/sys/firmware".into(), Kind::Dir);
        sys.kinds.insert("/proc/sys".into(), Kind::Dir);
        mask(
            &mut sys,
            &[
                "/proc/kcore".into(),
                "/sys/firmware".into(),
                "/proc/missing".into(),
            ],
        )
        .unwrap();
        make_readonly(&mut sys, &["/proc/sys".into(), "/proc/nothing".into()]).unwrap();
        assert_eq!(sys.calls.len(), 4, "{:#?}", sys.calls);
        assert_eq!(sys.calls[0], "mount /dev/null /proc/kcore - MS_BIND -");
        assert!(sys.calls[1].starts_with("mount tmpfs /sys/firmware tmpfs MS_RDONLY"));
        assert!(sys.calls[2].starts_with("mount /proc/sys /proc/sys - MS_BIND | MS_REC"));
        assert!(sys.calls[3].contains("MS_RDONLY") && sys.calls[3].contains("MS_REMOUNT"));
    }
}
