//! The raw mount operations on layers and a reader of `/proc/self/mountinfo`.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};

/// Mounts the EROFS file `file` read-only at `target` (created if missing). File-backed EROFS
/// mounts take the image file itself as the source. `nosuid,nodev` only affect direct access
/// through this host path; overlays built on top apply their own mount flags.
///
/// With `blob`, `file` is a metadata image whose chunk data lives in `blob` (`-o device=BLOB`):
/// EROFS reads data blocks from that file on demand.
pub fn mount_erofs_with(file: &Path, target: &Path, blob: Option<&Path>) -> io::Result<()> {
    fs::create_dir_all(target)?;
    let data = match blob {
        Some(b) => {
            let s = b.to_str().filter(|s| !s.contains(',')).ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("blob path {} cannot be a mount option", b.display()),
                )
            })?;
            Some(format!("device={s}"))
        }
        None => None,
    };
    nix::mount::mount(
        Some(file),
        target,
        Some("erofs"),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        data.as_deref(),
    )
    .map_err(|e| {
        io::Error::new(
            io::Error::from(e).kind(),
            format!(
                "mount -t erofs {}{} {}: {e}",
                file.display(),
                data.as_deref()
                    .map(|d| format!(" -o {d}"))
                    .unwrap_or_default(),
                target.display()
            ),
        )
    })
}

/// Unmounts `target`; if it is busy, detaches it (lazy unmount) instead. A path that is not a
/// mount point counts as unmounted.
pub fn unmount(target: &Path) -> io::Result<()> {
    match nix::mount::umount2(target, MntFlags::empty()) {
        Ok(()) => Ok(()),
        Err(Errno::EBUSY) => unmount_detach(target),
        Err(Errno::EINVAL) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// `umount2(target, MNT_DETACH)`; a path that is not a mount point counts as unmounted.
pub fn unmount_detach(target: &Path) -> io::Result<()> {
    match nix::mount::umount2(target, MntFlags::MNT_DETACH) {
        Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Mount points listed in `/proc/self/mountinfo` that lie strictly below `dir`
/// (which must be an absolute, canonical path), deepest first, one line per mount (a path
/// mounted twice appears twice).
pub fn mounts_under(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let text = fs::read_to_string("/proc/self/mountinfo")?;
    Ok(mounts_under_in(&text, dir))
}

/// How many mounts are stacked on exactly `path`.
pub fn mount_count(path: &Path) -> io::Result<usize> {
    let text = fs::read_to_string("/proc/self/mountinfo")?;
    Ok(parse_mount_points(&text).filter(|p| p == path).count())
}

fn mounts_under_in(mountinfo: &str, dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = parse_mount_points(mountinfo)
        .filter(|p| p != dir && p.starts_with(dir))
        .collect();
    // Deepest first so nested mounts go before their parents.
    out.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    out
}

/// The mount point (5th field) of every line, with `\NNN` octal escapes decoded.
fn parse_mount_points(mountinfo: &str) -> impl Iterator<Item = PathBuf> + '_ {
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(std::ffi::OsString::from(unescape(field))))
}

fn unescape(s: &str) -> String {
    use std::os::unix::ffi::OsStringExt;
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = (b[i] == b'\\' && i + 3 < b.len())
            .then(|| &b[i + 1..i + 4])
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .map(|d| d.iter().fold(0u32, |acc, c| acc * 8 + u32::from(c - b'0')))
            .and_then(|v| u8::try_from(v).ok());
        if let Some(v) = octal {
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    std::ffi::OsString::from_vec(out)
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 252:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:40 / /data/images/mnt/aaaa ro,nosuid,nodev - erofs /data/images/layers/aaaa.erofs ro
31 22 0:41 / /data/images/mnt/bbbb ro - erofs /data/images/layers/bbbb.erofs ro
32 31 0:42 / /data/images/mnt/bbbb/inner rw - tmpfs tmpfs rw
33 22 0:43 / /data/images/mnt\\040x/cc ro - erofs x ro
34 22 0:44 / /data/images/mntz ro - erofs x ro
";

    #[test]
    fn finds_mounts_below_dir_deepest_first() {
        let got = mounts_under_in(SAMPLE, Path::new("/data/images/mnt"));
        assert_eq!(
            got,
            vec![
                PathBuf::from("/data/images/mnt/bbbb/inner"),
                PathBuf::from("/data/images/mnt/aaaa"),
                PathBuf::from("/data/images/mnt/bbbb"),
            ]
        );
        let got = mounts_under_in(SAMPLE, Path::new("/data/images/mnt x"));
        assert_eq!(got, vec![PathBuf::from("/data/images/mnt x/cc")]);
    }

    #[test]
    fn unescapes_octal() {
        assert_eq!(unescape("a\\040b\\011c\\134d"), "a b\tc\\d");
        assert_eq!(unescape("trailing\\04"), "trailing\\04");
        assert_eq!(unescape("big\\777"), "big\\777");
    }
}
