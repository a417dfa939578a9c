//! Folding: merging consecutive layers into one layer with the same visible tree.
//!
//! The layers of a run are applied bottom first onto a staging directory that stays in the
//! overlay layer format, so the folded layer behaves exactly like the run over whatever lies
//! below it:
//!
//! - a whiteout (char 0:0) removes what the staging dir has at that path and stays a
//!   whiteout (it may hide a file in a layer below the run);
//! - a directory merges into a staged directory; an opaque directory (or one replacing a
//!   staged non-directory or whiteout, which hid everything below) empties it and is marked
//!   opaque; the directory's owner, mode, xattrs and mtime are the upper one's;
//! - any other entry replaces what is staged, keeping owner, mode, xattrs, mtime, symlink
//!   targets, device numbers and the layer's hard links.

use std::collections::HashMap;
use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::sys::stat::{self, Mode, SFlag};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid};

use crate::import::set_xattr;

pub(crate) const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// Consecutive runs (start, end exclusive) of at least two layers each smaller than `max`.
pub(crate) fn runs(sizes: &[u64], max: u64) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < sizes.len() {
        if sizes[i] >= max {
            i += 1;
            continue;
        }
        let start = i;
        while i < sizes.len() && sizes[i] < max {
            i += 1;
        }
        if i - start >= 2 {
            out.push((start, i));
        }
    }
    out
}

/// Applies the layer roots `layers` (bottom first, e.g. mounted EROFS layers) onto the empty
/// directory `dst`.
pub(crate) fn merge_layers(layers: &[PathBuf], dst: &Path) -> io::Result<()> {
    for (i, l) in layers.iter().enumerate() {
        let mut links = HashMap::new();
        apply_dir(l, dst, &mut links)
            .map_err(|e| io::Error::new(e.kind(), format!("fold layer {}: {e}", i + 1)))?;
        copy_dir_meta(l, dst, false)?;
    }
    Ok(())
}

fn is_whiteout(m: &fs::Metadata) -> bool {
    m.file_type().is_char_device() && m.rdev() == 0
}

fn apply_dir(src: &Path, dst: &Path, links: &mut HashMap<(u64, u64), PathBuf>) -> io::Result<()> {
    for entry in fs::read_dir(src)? {
        let entry = entry?;
        let name = entry.file_name();
        let s = entry.path();
        let d = dst.join(&name);
        let m = fs::symlink_metadata(&s)?;
        let staged = match fs::symlink_metadata(&d) {
            Ok(x) => Some(x),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        if m.is_dir() {
            let opaque = get_xattr(&s, OPAQUE_XATTR)?.is_some_and(|v| v == b"y");
            let make_opaque = match &staged {
                Some(x) if x.is_dir() => {
                    if opaque {
                        clear_dir(&d)?;
                    }
                    opaque
                }
                Some(_) => {
                    fs::remove_file(&d)?;
                    fs::create_dir(&d)?;
                    true
                }
                None => {
                    fs::create_dir(&d)?;
                    opaque
                }
            };
            apply_dir(&s, &d, links)?;
            copy_dir_meta(&s, &d, make_opaque)?;
            continue;
        }
        match &staged {
            Some(x) if x.is_dir() => fs::remove_dir_all(&d)?,
            Some(_) => fs::remove_file(&d)?,
            None => {}
        }
        if is_whiteout(&m) {
            stat::mknod(&d, SFlag::S_IFCHR, Mode::empty(), 0)?;
            continue;
        }
        let key = (m.dev(), m.ino());
        if m.nlink() > 1 && !m.is_dir() {
            if let Some(first) = links.get(&key) {
                if fs::symlink_metadata(first).is_ok() {
                    fs::hard_link(first, &d)?;
                    continue;
                }
            }
            links.insert(key, d.clone());
        }
        let ft = m.file_type();
        if ft.is_file() {
            fs::copy(&s, &d)?;
        } else if ft.is_symlink() {
            std::os::unix::fs::symlink(fs::read_link(&s)?, &d)?;
        } else {
            let kind = if ft.is_char_device() {
                SFlag::S_IFCHR
            } else if ft.is_block_device() {
                SFlag::S_IFBLK
            } else if ft.is_socket() {
                SFlag::S_IFSOCK
            } else {
                SFlag::S_IFIFO
            };
            stat::mknod(&d, kind, Mode::from_bits_truncate(0o600), m.rdev())?;
        }
        copy_meta(&s, &d, &m)?;
    }
    Ok(())
}

/// Removes everything inside `d`.
fn clear_dir(d: &Path) -> io::Result<()> {
    for e in fs::read_dir(d)? {
        let p = e?.path();
        if fs::symlink_metadata(&p)?.is_dir() {
            fs::remove_dir_all(&p)?;
        } else {
            fs::remove_file(&p)?;
        }
    }
    Ok(())
}

/// A directory's metadata: the upper's owner, mode, xattrs (replacing the staged ones) and
/// mtime; `opaque` sets the overlay opaque marker.
fn copy_dir_meta(s: &Path, d: &Path, opaque: bool) -> io::Result<()> {
    let m = fs::symlink_metadata(s)?;
    for (k, _) in list_xattrs(d)? {
        if !(k == OPAQUE_XATTR && opaque) {
            remove_xattr(d, &k)?;
        }
    }
    copy_meta(s, d, &m)?;
    if opaque {
        set_xattr(d, OPAQUE_XATTR, b"y")?;
    }
    Ok(())
}

/// Owner, then mode (set-id bits survive), then xattrs (except the opaque marker), then
/// times; never follows a symlink at `d`.
fn copy_meta(s: &Path, d: &Path, m: &fs::Metadata) -> io::Result<()> {
    nix::unistd::fchownat(
        None,
        d,
        Some(Uid::from_raw(m.uid())),
        Some(Gid::from_raw(m.gid())),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )?;
    if !m.file_type().is_symlink() {
        fs::set_permissions(d, fs::Permissions::from_mode(m.mode() & 0o7777))?;
    }
    for (k, v) in list_xattrs(s)? {
        if k != OPAQUE_XATTR {
            set_xattr(d, &k, &v)?;
        }
    }
    let t = TimeSpec::new(m.mtime(), m.mtime_nsec());
    stat::utimensat(None, d, &t, &t, stat::UtimensatFlags::NoFollowSymlink)?;
    Ok(())
}

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other)
}

/// `llistxattr` + `lgetxattr`: every xattr of `p` (not following a symlink).
pub(crate) fn list_xattrs(p: &Path) -> io::Result<Vec<(String, Vec<u8>)>> {
    let c = cpath(p)?;
    let mut names = vec![0u8; 4096];
    let n = loop {
        // SAFETY: `c` is a valid C string; `names` is a writable buffer of `names.len()` bytes.
        let rc = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
        if rc >= 0 {
            break rc as usize;
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ERANGE) if names.len() < (1 << 20) => names.resize(names.len() * 4, 0),
            Some(libc::ENOTSUP) => return Ok(Vec::new()),
            _ => return Err(e),
        }
    };
    let mut out = Vec::new();
    for name in names[..n].split(|&b| b == 0).filter(|s| !s.is_empty()) {
        let key = String::from_utf8_lossy(name).into_owned();
        if let Some(v) = get_xattr(p, &key)? {
            out.push((key, v));
        }
    }
    Ok(out)
}

/// `lgetxattr`; `None` when the attribute is absent.
pub(crate) fn get_xattr(p: &Path, name: &str) -> io::Result<Option<Vec<u8>>> {
    let c = cpath(p)?;
    let cname = CString::new(name).map_err(io::Error::other)?;
    let mut buf = vec![0u8; 256];
    loop {
        // SAFETY: both strings are valid C strings; `buf` is writable for `buf.len()` bytes.
        let rc = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                cname.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if rc >= 0 {
            buf.truncate(rc as usize);
            return Ok(Some(buf));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENODATA) | Some(libc::ENOTSUP) => return Ok(None),
            Some(libc::ERANGE) if buf.len() < (1 << 20) => buf.resize(buf.len() * 16, 0),
            _ => return Err(e),
        }
    }
}

/// Removes every extended attribute of `p` (not following a symlink).
pub fn clear_xattrs(p: &Path) -> io::Result<()> {
    for (k, _) in list_xattrs(p)? {
        remove_xattr(p, &k)?;
    }
    Ok(())
}

fn remove_xattr(p: &Path, name: &str) -> io::Result<()> {
    let c = cpath(p)?;
    let cname = CString::new(name).map_err(io::Error::other)?;
    // SAFETY: both strings are valid NUL-terminated C strings that outlive the call.
    let rc = unsafe { libc::lremovexattr(c.as_ptr(), cname.as_ptr()) };
    if rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::ENODATA) {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fold_runs() {
        assert_eq!(runs(&[10, 1, 1, 1, 10, 1, 1], 5), vec![(1, 4), (5, 7)]);
        assert_eq!(runs(&[1, 10, 1], 5), Vec::<(usize, usize)>::new());
        assert_eq!(runs(&[1, 1], 5), vec![(0, 2)]);
        assert_eq!(runs(&[], 5), Vec::<(usize, usize)>::new());
    }

    use crate::store::LayerPart;
    use crate::ImageStore;
    use std::collections::BTreeMap;

    /// Root, mkfs.erofs and overlayfs, or the reason to skip.
    pub(crate) fn skip_reason() -> Option<String> {
        if !nix::unistd::geteuid().is_root() {
            return Some("needs root".into());
        }
        if std::process::Command::new("mkfs.erofs")
            .arg("--help")
            .output()
            .is_err()
        {
            return Some("mkfs.erofs missing".into());
        }
        let fs = fs::read_to_string("/proc/filesystems").unwrap_or_default();
        if !fs.contains("erofs") || !fs.contains("overlay") {
            return Some("kernel lacks erofs or overlay".into());
        }
        None
    }

    fn write(p: &Path, data: &[u8], mode: u32) {
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, data).unwrap();
        fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
    }

    fn whiteout(p: &Path) {
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        stat::mknod(p, SFlag::S_IFCHR, Mode::empty(), 0).unwrap();
    }

    fn opaque(p: &Path) {
        fs::create_dir_all(p).unwrap();
        set_xattr(p, OPAQUE_XATTR, b"y").unwrap();
    }

    /// Every visible entry below `root`: type, mode, owner, size, content hash or link
    /// target, device number, link count and xattrs (the overlay's own excluded).
    fn snapshot(root: &Path) -> BTreeMap<String, String> {
        use sha2::{Digest, Sha256};
        let mut out = BTreeMap::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for e in fs::read_dir(&dir).unwrap() {
                let p = e.unwrap().path();
                let m = fs::symlink_metadata(&p).unwrap();
                let rel = p.strip_prefix(root).unwrap().display().to_string();
                let ft = m.file_type();
                let what = if ft.is_dir() {
                    stack.push(p.clone());
                    "dir".to_string()
                } else if ft.is_symlink() {
                    format!("link->{}", fs::read_link(&p).unwrap().display())
                } else if ft.is_file() {
                    format!("file {:x}", Sha256::digest(fs::read(&p).unwrap()))
                } else {
                    format!("special {:o} rdev {}", m.mode() & 0o170000, m.rdev())
                };
                let xattrs: Vec<_> = list_xattrs(&p)
                    .unwrap()
                    .into_iter()
                    .filter(|(k, _)| !k.starts_with("trusted.overlay."))
                    .collect();
                let nlink = if ft.is_dir() { 0 } else { m.nlink() };
                out.insert(
                    rel,
                    format!(
                        "{what} mode {:o} {}:{} size {} nlink {nlink} mtime {} xattrs {xattrs:?}",
                        m.mode(),
                        m.uid(),
                        m.gid(),
                        if ft.is_dir() { 0 } else { m.len() },
                        if ft.is_dir() { 0 } else { m.mtime() },
                    ),
                );
            }
        }
        out
    }

    fn overlay(lowers: &[PathBuf], target: &Path) {
        fs::create_dir_all(target).unwrap();
        let lower = lowers
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(":");
        nix::mount::mount(
            Some("overlay"),
            target,
            Some("overlay"),
            nix::mount::MsFlags::MS_RDONLY,
            Some(format!("lowerdir={lower}").as_str()),
        )
        .unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fold_keeps_the_visible_tree() {
        if let Some(why) = skip_reason() {
            eprintln!("skipped: {why}");
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let store = ImageStore::open(t.path().join("store")).unwrap();
        store.set_unmount_grace(std::time::Duration::ZERO);
        let src = t.path().join("src");
        let (base, l1, l2, l3) = (
            src.join("base"),
            src.join("l1"),
            src.join("l2"),
            src.join("l3"),
        );
        // The base is big, so it stays its own layer.
        write(&base.join("big"), &vec![7u8; 300_000], 0o644);
        write(&base.join("a/f1"), b"base f1\n", 0o644);
        write(&base.join("a/f2"), b"base f2\n", 0o644);
        write(&base.join("b/x"), b"base x\n", 0o644);
        write(&base.join("c"), b"base file c\n", 0o644);
        write(&base.join("d/old"), b"old\n", 0o644);
        write(&base.join("e/deep/file"), b"deep\n", 0o644);
        write(&base.join("gone"), b"gone\n", 0o644);
        // l1: modified file (mode, owner, xattr), whiteouts, an opaque dir, a symlink, hard
        // links, a fifo.
        write(&l1.join("a/f1"), b"l1 f1\n", 0o4750);
        // chown clears set-id bits: owner first, then the mode again.
        nix::unistd::chown(
            &l1.join("a/f1"),
            Some(Uid::from_raw(1234)),
            Some(Gid::from_raw(5678)),
        )
        .unwrap();
        fs::set_permissions(l1.join("a/f1"), fs::Permissions::from_mode(0o4750)).unwrap();
        set_xattr(&l1.join("a/f1"), "user.note", b"kept").unwrap();
        whiteout(&l1.join("b/x"));
        whiteout(&l1.join("gone"));
        opaque(&l1.join("d"));
        write(&l1.join("d/new"), b"new\n", 0o600);
        std::os::unix::fs::symlink("a/f1", l1.join("s")).unwrap();
        write(&l1.join("h1"), b"hard\n", 0o640);
        fs::hard_link(l1.join("h1"), l1.join("h2")).unwrap();
        stat::mknod(
            &l1.join("p"),
            SFlag::S_IFIFO,
            Mode::from_bits_truncate(0o644),
            0,
        )
        .unwrap();
        // l2: a whole directory whited out, a file replaced by a dir, an xattr on a dir.
        whiteout(&l2.join("e"));
        write(&l2.join("c/inside"), b"c is a dir now\n", 0o644);
        fs::create_dir_all(l2.join("a")).unwrap();
        set_xattr(&l2.join("a"), "user.dir", b"old").unwrap();
        set_xattr(&l2.join("a"), "user.only_l2", b"x").unwrap();
        write(&l2.join("a/f3"), b"l2 f3\n", 0o644);
        // l3: a dir over the whiteout (must not show base's e/deep), a re-created file,
        // a deleted file of the base, a re-pointed symlink.
        write(&l3.join("e/new"), b"e again\n", 0o644);
        write(&l3.join("b/x"), b"x again\n", 0o644);
        fs::create_dir_all(l3.join("a")).unwrap();
        whiteout(&l3.join("a/f2"));
        // The upper directory's xattrs are the visible ones.
        set_xattr(&l3.join("a"), "user.dir", b"1").unwrap();
        std::os::unix::fs::symlink("a/f3", l3.join("s")).unwrap();
        let mut built = Vec::new();
        for (i, d) in [&base, &l1, &l2, &l3].into_iter().enumerate() {
            let out = t.path().join(format!("layer{i}.erofs"));
            built.push(LayerPart::Built(
                crate::import::build_layer("t", d, out, &Default::default())
                    .await
                    .unwrap(),
            ));
        }
        store
            .register_parts("t:v1", built, None, Some("test".into()))
            .await
            .unwrap();
        let before = store.get("t:v1").unwrap();
        assert_eq!(before.layers.len(), 4);
        let folded = store.fold("t:v1", 100_000, Some("t:folded")).await.unwrap();
        assert_eq!(folded.layers.len(), 2, "{folded:?}");
        assert_eq!(folded.layers[0].digest, before.layers[0].digest);
        assert_eq!(folded.parent.as_deref(), Some("t:v1"));
        // Folding again changes nothing.
        assert_eq!(
            store
                .fold("t:folded", 100_000, None)
                .await
                .unwrap()
                .layers
                .len(),
            2
        );

        let a = store.acquire("t:v1").await.unwrap();
        let b = store.acquire("t:folded").await.unwrap();
        let (ma, mb) = (t.path().join("ma"), t.path().join("mb"));
        overlay(&a.lowers(), &ma);
        overlay(&b.lowers(), &mb);
        let (sa, sb) = (snapshot(&ma), snapshot(&mb));
        let check = || {
            assert_eq!(sa, sb);
            assert!(!sa.contains_key("gone") && !sa.contains_key("a/f2"));
            assert!(!sa.contains_key("e/deep") && sa.contains_key("e/new"));
            assert!(!sa.contains_key("d/old") && sa.contains_key("d/new"));
            assert!(sa.contains_key("c/inside"));
            assert_eq!(fs::read(mb.join("b/x")).unwrap(), b"x again\n");
            assert_eq!(fs::read_link(mb.join("s")).unwrap(), Path::new("a/f3"));
            assert!(
                sa["a/f1"].contains("mode 104750 1234:5678"),
                "{}",
                sa["a/f1"]
            );
            assert!(sa["a/f1"].contains("user.note"), "{}", sa["a/f1"]);
            assert!(sa["a"].contains(r#"("user.dir", [49])"#), "{}", sa["a"]);
            assert!(!sa["a"].contains("only_l2"), "{}", sa["a"]);
            assert!(sa["h1"].contains("nlink 2"), "{}", sa["h1"]);
            assert_eq!(
                fs::metadata(mb.join("h1")).unwrap().ino(),
                fs::metadata(mb.join("h2")).unwrap().ino()
            );
            assert!(sa["p"].starts_with("special 10000"), "{}", sa["p"]);
        };
        let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(check));
        for m in [&ma, &mb] {
            let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
        }
        drop((a, b));
        store.unmount_all().unwrap();
        if let Err(p) = res {
            std::panic::resume_unwind(p);
        }
        eprintln!(
            "{} visible entries identical after folding 3 layers into 1",
            sa.len()
        );
    }
}
