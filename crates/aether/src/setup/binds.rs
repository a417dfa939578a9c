//! Volumes: host directories (each on a volume's file system, mounted on the host by the edge)
//! bound into the new root before the pivot, read-write or read-only, always nosuid and nodev.
//!
//! The mount point is made inside the new root one component at a time, refusing any
//! component that is a symlink: before the pivot an absolute symlink in the image (which an
//! agent may have written into a snapshot) would resolve against the host's root.

use std::io;
use std::path::{Path, PathBuf};

use dsec_wire::aether::BindSetup;
use nix::mount::MsFlags;

use super::mounts::MountError;
use super::sys::Sys;

/// Makes `root` + `target` as a directory without following symlinks; answers the full path.
fn make_mount_point(root: &Path, target: &str) -> Result<PathBuf, MountError> {
    let mut cur = root.to_path_buf();
    for c in target.split('/').filter(|c| !c.is_empty()) {
        if c == "." || c == ".." {
            return Err(MountError(format!(
                "volume mount path {target:?} is not normalised"
            )));
        }
        cur.push(c);
        match std::fs::symlink_metadata(&cur) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(MountError(format!(
                    "volume mount path {target:?}: {} is a symlink in the image; mount the volume elsewhere",
                    cur.strip_prefix(root).unwrap_or(&cur).display()
                )))
            }
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(MountError(format!(
                    "volume mount path {target:?}: {} is a file in the image; mount the volume elsewhere",
                    cur.strip_prefix(root).unwrap_or(&cur).display()
                )))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                use std::os::unix::fs::DirBuilderExt as _;
                std::fs::DirBuilder::new()
                    .mode(0o755)
                    .create(&cur)
                    .or_else(|e| {
                        if e.kind() == io::ErrorKind::AlreadyExists {
                            Ok(())
                        } else {
                            Err(e)
                        }
                    })
                    .map_err(|e| MountError(format!("create {}: {e}", cur.display())))?;
            }
            Err(e) => return Err(MountError(format!("look up {}: {e}", cur.display()))),
        }
    }
    Ok(cur)
}

/// Binds every volume under `root` (called before the pivot, after the overlay is mounted).
pub fn bind_all(sys: &mut dyn Sys, root: &Path, binds: &[BindSetup]) -> Result<(), MountError> {
    for b in binds {
        let at = make_mount_point(root, &b.target)?;
        sys.mount(Some(&b.source), &at, None, MsFlags::MS_BIND, None)
            .map_err(|e| MountError(format!("bind volume {} on {}: {e}", b.source, b.target)))?;
        let mut flags =
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if b.read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        sys.mount(None, &at, None, flags, None).map_err(|e| {
            MountError(format!(
                "make volume mount {} nosuid/nodev/ro: {e}",
                b.target
            ))
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_made_and_symlinks_refused() {
        let base = std::env::temp_dir().join(format!("dsec-binds-test-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        struct Dir(PathBuf);
        impl Dir {
            fn path(&self) -> &Path {
                &self.0
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
        let d = Dir(base);
        let p = make_mount_point(d.path(), "/mnt/data").unwrap();
        assert!(p.is_dir());
        std::os::unix::fs::symlink("/", d.path().join("evil")).unwrap();
        let e = make_mount_point(d.path(), "/evil/data").unwrap_err();
        assert!(e.0.contains("symlink"), "{}", e.0);
        std::fs::write(d.path().join("f"), b"x").unwrap();
        assert!(make_mount_point(d.path(), "/f")
            .unwrap_err()
            .0
            .contains("file"));
        assert!(make_mount_point(d.path(), "/a/../b").is_err());
    }
}
