//! Disk limit of a sandbox's writable layer: a per-sandbox ext4 file system in a sparse file,
//! loop-mounted at `<sandbox dir>/fs`, with `upper` and `work` inside and `<dir>/upper`,
//! `<dir>/work` as symlinks to them (overlayfs needs both on one file system). Past the limit
//! writes fail with ENOSPC inside that sandbox only. The root file system is ext4 without the
//! `prjquota` mount option, so project quotas are not available; tmpfs would count against
//! memory. Cost: about 60 ms at create (mkfs + mount), measured in BENCHMARKS.md.
//!
//! I/O cap (`disk_bps_limit_mb`): the loop device is the sandbox's alone, so on cgroup v1 a
//! per-device cap in the blkio root throttles every bio of that device, including the
//! flusher's writeback of buffered writes (which v1 charges to the root cgroup, so a cap on the
//! sandbox's own blkio cgroup would only catch direct I/O and cache-missing reads). A `yes > f`
//! then dirties page cache only as fast as balance_dirty_pages lets it against that slow device,
//! and the host disk sees at most the cap from it. On v2 the cap is `io.max` on the sandbox's
//! cgroup ([`throttle_v2`]), which covers writeback through cgroup-aware writeback.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cgroup::Cgroup;

/// Why the limited file system could not be made (or capped).
#[derive(Debug, thiserror::Error)]
pub enum DiskLimitError {
    #[error("disk limit: {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("disk limit: run {cmd}: {source}")]
    Spawn { cmd: String, source: std::io::Error },
    #[error("disk limit: {cmd} failed: {stderr}")]
    Command { cmd: String, stderr: String },
    #[error("disk limit: {0} is not on a loop device after mounting")]
    NotMounted(PathBuf),
    #[error("disk limit: {0:?} is not a loop device")]
    NotLoop(String),
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> DiskLimitError {
    let path = path.to_path_buf();
    move |source| DiskLimitError::Io { op, path, source }
}

fn run(cmd: &str, args: &[&str]) -> Result<(), DiskLimitError> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|source| DiskLimitError::Spawn {
            cmd: cmd.to_string(),
            source,
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(DiskLimitError::Command {
            cmd: format!("{cmd} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Makes and mounts the limited file system under `dir` (blocking) and caps its loop device
/// at `bps` bytes per second for reads and writes (0: no cap).
pub fn prepare(dir: &Path, limit_mb: u64, bps: u64) -> Result<(), DiskLimitError> {
    let img = dir.join("disk.img");
    let fs = dir.join("fs");
    let p = |x: &Path| x.to_string_lossy().into_owned();
    let f = std::fs::File::create(&img).map_err(io_err("create", &img))?;
    f.set_len(limit_mb << 20).map_err(io_err("size", &img))?;
    drop(f);
    let made = run(
        "mkfs.ext4",
        &[
            "-q",
            "-F",
            "-m",
            "0",
            "-O",
            "^has_journal,^resize_inode",
            "-E",
            "lazy_itable_init=1,nodiscard",
            &p(&img),
        ],
    )
    .and_then(|()| std::fs::create_dir_all(&fs).map_err(io_err("create", &fs)))
    .and_then(|()| run("mount", &["-o", "loop,nodev,nosuid", &p(&img), &p(&fs)]));
    if let Err(e) = made {
        release(dir);
        return Err(e);
    }
    // The loop device is this sandbox's alone: remember it (release clears its cap, also after
    // a crash) and set its cap before the sandbox can write. Writing the cap also when `bps`
    // is 0 clears whatever an earlier user of the same loop device left.
    let dev = match loop_device_of(&fs) {
        Some(d) => d,
        None => {
            release(dir);
            return Err(DiskLimitError::NotMounted(fs));
        }
    };
    let noted = std::fs::write(dir.join(DEV_FILE), &dev)
        .map_err(io_err("write", &dir.join(DEV_FILE)))
        .and_then(|()| set_device_cap_v1(&dev, bps));
    if let Err(e) = noted {
        release(dir);
        return Err(e);
    }
    for d in ["upper", "work"] {
        let inner = fs.join(d);
        let link = dir.join(d);
        // The sandbox's directory may come with an empty `upper`/`work` already (a fresh or
        // recycled directory): the limited file system's takes its place. Nothing is written
        // into the layer before this (the substrate writes the edge's files after), and
        // `remove_dir` only removes an empty directory, so nothing written is ever lost here.
        let made = std::fs::create_dir_all(&inner)
            .and_then(|()| match std::fs::symlink_metadata(&link) {
                Ok(m) if m.is_dir() => std::fs::remove_dir(&link),
                _ => Ok(()),
            })
            .and_then(|()| std::os::unix::fs::symlink(&inner, &link));
        if let Err(e) = made {
            release(dir);
            return Err(io_err("prepare", &link)(e));
        }
    }
    Ok(())
}

/// `<sandbox dir>/disk.dev`: the `major:minor` of the sandbox's loop device.
const DEV_FILE: &str = "disk.dev";

/// The cgroup v1 blkio root, where a per-device cap applies to every bio of that device,
/// including the flusher's writeback (which v1 accounts to the root cgroup).
const BLKIO_V1: &str = "/sys/fs/cgroup/blkio";

/// Unmounts the limited file system (if any), clears its loop device's cap and deletes its
/// image. Idempotent; also cleans what a crashed edge left.
pub fn release(dir: &Path) {
    if let Ok(dev) = std::fs::read_to_string(dir.join(DEV_FILE)) {
        // Cleared before the unmount: until then the loop device cannot be handed to another
        // sandbox, so this never clears someone else's cap.
        if let Err(e) = set_device_cap_v1(dev.trim(), 0) {
            tracing::warn!(dir = %dir.display(), error = %e, "clear the sandbox disk's I/O cap");
        }
    }
    let fs = dir.join("fs");
    if is_mountpoint(&fs) {
        if let Err(e) = nix::mount::umount2(&fs, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!(dir = %fs.display(), error = %e, "unmount sandbox disk");
        }
    }
    let _ = std::fs::remove_file(dir.join("disk.img"));
    let _ = std::fs::remove_file(dir.join(DEV_FILE));
}

fn is_mountpoint(p: &Path) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    match (std::fs::metadata(p), p.parent().map(std::fs::metadata)) {
        (Ok(a), Some(Ok(b))) => a.dev() != b.dev(),
        _ => false,
    }
}

/// The `major:minor` of the block device holding `path`.
pub fn device_of(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    let dev = std::fs::metadata(path).ok()?.dev();
    Some(format!("{}:{}", libc::major(dev), libc::minor(dev)))
}

/// [`device_of`], only when that device is a loop device.
fn loop_device_of(path: &Path) -> Option<String> {
    let dev = device_of(path)?;
    is_loop_device(&dev).then_some(dev)
}

/// Whether `major:minor` names a loop device (`/sys/dev/block/<dev>/loop` exists).
fn is_loop_device(dev: &str) -> bool {
    valid_dev(dev) && Path::new("/sys/dev/block").join(dev).join("loop").is_dir()
}

fn valid_dev(dev: &str) -> bool {
    let mut parts = dev.split(':');
    let num =
        |p: Option<&str>| p.is_some_and(|x| !x.is_empty() && x.bytes().all(|b| b.is_ascii_digit()));
    num(parts.next()) && num(parts.next()) && parts.next().is_none()
}

/// The lines a blkio throttle file takes for one device (`bps` 0 removes the cap).
fn cap_line(dev: &str, bps: u64) -> String {
    format!("{dev} {bps}")
}

/// The v1 blkio cgroups a cap must be written to. v1 throttling is flat (a cgroup's limit
/// covers only its own bios, not its children's): the root, where the flusher's writeback of
/// buffered writes is accounted, and the edge's own blkio cgroup, which sandbox processes
/// inherit (the runtime does not move them in this hierarchy), for direct I/O and reads.
fn blkio_v1_dirs() -> Vec<PathBuf> {
    let root = PathBuf::from(BLKIO_V1);
    let mut dirs = vec![root.clone()];
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    if let Some(rel) = own_blkio_cgroup(&own) {
        let dir = root.join(rel);
        if dir != root && dir.join("blkio.throttle.write_bps_device").exists() {
            dirs.push(dir);
        }
    }
    dirs
}

/// The relative path of the `blkio` line of a `/proc/<pid>/cgroup` text.
fn own_blkio_cgroup(text: &str) -> Option<&str> {
    text.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let _ = f.next()?;
        let ctrls = f.next()?;
        let path = f.next()?;
        (ctrls.split(',').any(|c| c == "blkio") && !path.contains(".."))
            .then(|| path.trim_start_matches('/'))
    })
}

/// Caps (or with 0 uncaps) reads and writes of the loop device `dev` in the cgroup v1 blkio
/// hierarchy (see [`blkio_v1_dirs`]). Only ever applied to loop devices, which belong to
/// exactly one sandbox; without a v1 blkio hierarchy this does nothing (see [`throttle_v2`]).
fn set_device_cap_v1(dev: &str, bps: u64) -> Result<(), DiskLimitError> {
    if !Path::new(BLKIO_V1)
        .join("blkio.throttle.write_bps_device")
        .exists()
    {
        return Ok(());
    }
    if !is_loop_device(dev) {
        return Err(DiskLimitError::NotLoop(dev.to_string()));
    }
    for dir in blkio_v1_dirs() {
        for file in [
            "blkio.throttle.write_bps_device",
            "blkio.throttle.read_bps_device",
        ] {
            let path = dir.join(file);
            match std::fs::write(&path, cap_line(dev, bps)) {
                Ok(()) => {}
                // Clearing a device without a rule may fail on some kernels: nothing to clear.
                Err(e) if bps == 0 => {
                    tracing::debug!(file = %path.display(), error = %e, "clear loop device cap")
                }
                Err(e) => return Err(io_err("write", &path)(e)),
            }
        }
    }
    Ok(())
}

/// The cap currently set on a device in the v1 blkio root (write bandwidth), if any.
pub fn device_cap_v1(dev: &str) -> Option<u64> {
    let text = std::fs::read_to_string(Path::new(BLKIO_V1).join("blkio.throttle.write_bps_device"))
        .ok()?;
    parse_cap(&text, dev)
}

fn parse_cap(text: &str, dev: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some(dev)).then(|| w.next()?.parse().ok())?
    })
}

/// On a cgroup v2 host: caps the sandbox's cgroup on its loop device with `io.max` (v2
/// attributes buffered writeback to the writer's cgroup, so this covers `yes > f`), enabling
/// the `io` controller down the path first. Called once the cgroup exists, before the sandbox
/// runs; best effort (logged). Does nothing on v1, where [`prepare`] capped the device.
pub fn throttle_v2(cgroup: &Cgroup, dir: &Path, bps: u64) {
    let Cgroup::V2(cg) = cgroup else {
        return;
    };
    let cgroup_dir = cg.dir();
    if bps == 0
        || Path::new(BLKIO_V1)
            .join("blkio.throttle.write_bps_device")
            .exists()
    {
        return;
    }
    let Ok(dev) = std::fs::read_to_string(dir.join(DEV_FILE)) else {
        return;
    };
    let dev = dev.trim();
    if !valid_dev(dev) {
        return;
    }
    // Enable `io` in every ancestor's subtree_control, from the top down.
    let mut ancestors: Vec<&Path> = cgroup_dir.ancestors().skip(1).collect();
    ancestors.reverse();
    for a in ancestors {
        if !a.join("cgroup.subtree_control").exists() {
            continue;
        }
        let _ = std::fs::write(a.join("cgroup.subtree_control"), "+io");
    }
    let res = std::fs::write(
        cgroup_dir.join("io.max"),
        format!("{dev} rbps={bps} wbps={bps}"),
    );
    if let Err(e) = res {
        tracing::warn!(cgroup = %cgroup_dir.display(), error = %e, "I/O cap (io.max) not applied");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_strings() {
        assert!(valid_dev("7:12"));
        assert!(!valid_dev("7:"));
        assert!(!valid_dev("7:1:2"));
        assert!(!valid_dev("a:1"));
        assert!(!is_loop_device("../../x:1"));
        assert_eq!(cap_line("7:3", 1048576), "7:3 1048576");
        let text = "7:0 10485760\n254:0 5\n";
        assert_eq!(parse_cap(text, "7:0"), Some(10_485_760));
        assert_eq!(parse_cap(text, "254:0"), Some(5));
        assert_eq!(parse_cap(text, "7:1"), None);
        let own = "12:pids:/x\n7:blkio:/edge/slice\n0::/\n";
        assert_eq!(own_blkio_cgroup(own), Some("edge/slice"));
        assert_eq!(own_blkio_cgroup("7:blkio:/\n"), Some(""));
        assert_eq!(own_blkio_cgroup("7:blkio:/../x\n"), None);
    }

    /// A real loop-mounted limit: ENOSPC past it, the loop device capped in the blkio root,
    /// everything gone after release.
    #[test]
    fn limited_fs_and_cap() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skip: needs root (loop mount)");
            return;
        }
        if !Path::new("/sbin/mkfs.ext4").exists() && !Path::new("/usr/sbin/mkfs.ext4").exists() {
            eprintln!("skip: no mkfs.ext4");
            return;
        }
        let base = Path::new("/var/tmp");
        let d = tempfile::tempdir_in(base).expect("tempdir");
        prepare(d.path(), 16, 64 << 20).expect("prepare");
        let dev = std::fs::read_to_string(d.path().join(DEV_FILE)).expect("dev file");
        assert!(is_loop_device(dev.trim()));
        if Path::new(BLKIO_V1)
            .join("blkio.throttle.write_bps_device")
            .exists()
        {
            assert_eq!(device_cap_v1(dev.trim()), Some(64 << 20));
        }
        let big = vec![0u8; 32 << 20];
        let err = std::fs::write(d.path().join("upper").join("big"), &big).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
        release(d.path());
        assert!(!is_mountpoint(&d.path().join("fs")));
        assert!(!d.path().join("disk.img").exists());
        assert_eq!(device_cap_v1(dev.trim()), None);
    }
}
