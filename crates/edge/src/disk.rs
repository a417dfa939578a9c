//! Disk limit of a sandbox's writable layer: a per-sandbox ext4 file system in a sparse file,
//! loop-mounted at `<sandbox dir>/fs`, with `upper` and `work` inside and `<dir>/upper`,
//! `<dir>/work` as symlinks to them (overlayfs needs both on one file system). Past the limit
//! writes fail with ENOSPC inside that sandbox only. The root file system is ext4 without the
//! `prjquota` mount option, so project quotas are not available; tmpfs would count against
//! memory. Cost: about 60 ms at create (mkfs + mount), measured in BENCHMARKS.md.

use std::path::Path;
use std::process::Command;

/// Why the limited file system could not be made.
#[derive(Debug, thiserror::Error)]
#[error("disk limit: {0}")]
pub struct DiskError(pub String);

fn run(cmd: &str, args: &[&str]) -> Result<(), DiskError> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| DiskError(format!("{cmd}: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(DiskError(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// Makes and mounts the limited file system under `dir` (blocking).
pub fn prepare(dir: &Path, limit_mb: u64) -> Result<(), DiskError> {
    let img = dir.join("disk.img");
    let fs = dir.join("fs");
    let p = |x: &Path| x.to_string_lossy().into_owned();
    let f = std::fs::File::create(&img)
        .map_err(|e| DiskError(format!("create {}: {e}", img.display())))?;
    f.set_len(limit_mb << 20)
        .map_err(|e| DiskError(format!("size {}: {e}", img.display())))?;
    drop(f);
    run(
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
    )?;
    std::fs::create_dir_all(&fs).map_err(|e| DiskError(format!("create {}: {e}", fs.display())))?;
    run("mount", &["-o", "loop,nodev,nosuid", &p(&img), &p(&fs)])?;
    for d in ["upper", "work"] {
        let inner = fs.join(d);
        let link = dir.join(d);
        let made = std::fs::create_dir_all(&inner)
            .and_then(|()| std::os::unix::fs::symlink(&inner, &link));
        if let Err(e) = made {
            release(dir);
            return Err(DiskError(format!("prepare {}: {e}", link.display())));
        }
    }
    Ok(())
}

/// Unmounts the limited file system (if any) and deletes its image. Idempotent.
pub fn release(dir: &Path) {
    let fs = dir.join("fs");
    if is_mountpoint(&fs) {
        if let Err(e) = nix::mount::umount2(&fs, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!(dir = %fs.display(), error = %e, "unmount sandbox disk");
        }
    }
    let _ = std::fs::remove_file(dir.join("disk.img"));
}

fn is_mountpoint(p: &Path) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    match (std::fs::metadata(p), p.parent().map(std::fs::metadata)) {
        (Ok(a), Some(Ok(b))) => a.dev() != b.dev(),
        _ => false,
    }
}

/// The `major:minor` of the block device holding `path` (for blkio throttling).
pub fn device_of(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    let dev = std::fs::metadata(path).ok()?.dev();
    Some(format!("{}:{}", libc::major(dev), libc::minor(dev)))
}

/// Caps the sandbox cgroup's read and write bandwidth on the device under `dir` (cgroup v1
/// `blkio.throttle.*`, v2 `io.max`). Best effort: missing controllers are logged.
pub fn throttle(cgroup_parent: &str, id: &str, dir: &Path, bps: u64) {
    let Some(dev) = device_of(dir) else { return };
    let v1 = Path::new("/sys/fs/cgroup/blkio")
        .join(cgroup_parent)
        .join(id);
    let res = if Path::new("/sys/fs/cgroup/blkio").is_dir() {
        std::fs::create_dir_all(&v1).and_then(|()| {
            std::fs::write(
                v1.join("blkio.throttle.write_bps_device"),
                format!("{dev} {bps}"),
            )?;
            std::fs::write(
                v1.join("blkio.throttle.read_bps_device"),
                format!("{dev} {bps}"),
            )
        })
    } else {
        let v2 = Path::new("/sys/fs/cgroup")
            .join(cgroup_parent)
            .join(id)
            .join("io.max");
        std::fs::write(v2, format!("{dev} rbps={bps} wbps={bps}"))
    };
    if let Err(e) = res {
        tracing::warn!(sandbox = %id, error = %e, "I/O throttle not applied");
    }
}
