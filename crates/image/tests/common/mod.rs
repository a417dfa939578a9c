//! Helpers for the root integration tests: skip checks, a store that cleans up its mounts even
//! on panic, and a tree snapshot for comparing file systems.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use dsec_image::ImageStore;

/// Returns a reason to skip if the test cannot run here (not root, no mkfs.erofs, no EROFS).
pub fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (mounts EROFS layers)".into());
    }
    let have_mkfs = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("mkfs.erofs").exists()))
        .unwrap_or(false);
    if !have_mkfs {
        return Some("mkfs.erofs not installed (apt-get install erofs-utils)".into());
    }
    let fs_list = fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !fs_list.contains("erofs") {
        // The module may still load on demand; try it.
        let _ = std::process::Command::new("modprobe").arg("erofs").status();
        let fs_list = fs::read_to_string("/proc/filesystems").unwrap_or_default();
        if !fs_list.contains("erofs") {
            return Some("kernel has no EROFS support".into());
        }
    }
    None
}

#[macro_export]
macro_rules! skip_unless_capable {
    () => {
        if let Some(reason) = common::skip_reason() {
            println!("SKIPPED: {reason}");
            return;
        }
    };
}

/// A store in a temporary directory; unmounts everything under it when dropped.
pub struct TestStore {
    pub store: ImageStore,
    pub dir: tempfile::TempDir,
}

impl TestStore {
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("dsec-image-test")
            .tempdir_in("/var/tmp")
            .expect("tempdir");
        let store = ImageStore::open(dir.path().join("store")).expect("open store");
        TestStore { store, dir }
    }

    pub fn root(&self) -> PathBuf {
        self.store.root().to_path_buf()
    }
}

impl Drop for TestStore {
    fn drop(&mut self) {
        let _ = self.store.unmount_all();
        // Catch anything else (leaked on purpose, or by a failed assertion).
        if let Ok(info) = fs::read_to_string("/proc/self/mountinfo") {
            let root = self.dir.path().canonicalize().unwrap_or_default();
            let mut points: Vec<PathBuf> = info
                .lines()
                .filter_map(|l| l.split(' ').nth(4))
                .map(PathBuf::from)
                .filter(|p| p.starts_with(&root))
                .collect();
            points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
            for p in points {
                let _ = nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }
}

/// Number of mounts stacked exactly on `path`.
pub fn mount_count(path: &Path) -> usize {
    fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| Path::new(p) == path)
        .count()
}

/// Everything we compare about one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub kind: &'static str,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: i64,
    pub size: u64,
    pub rdev: u64,
    pub nlink: u64,
    pub link: Option<PathBuf>,
    pub sha: Option<Vec<u8>>,
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

/// Recursively describes the tree at `root`, keyed by relative path ("" is the root).
pub fn snapshot(root: &Path) -> BTreeMap<PathBuf, Node> {
    let mut out = BTreeMap::new();
    walk(root, Path::new(""), &mut out);
    out
}

fn walk(root: &Path, rel: &Path, out: &mut BTreeMap<PathBuf, Node>) {
    let p = root.join(rel);
    let m = fs::symlink_metadata(&p).unwrap();
    let ft = m.file_type();
    let kind = if ft.is_dir() {
        "dir"
    } else if ft.is_symlink() {
        "symlink"
    } else if ft.is_file() {
        "file"
    } else if ft.is_fifo() {
        "fifo"
    } else if ft.is_char_device() {
        "chr"
    } else if ft.is_block_device() {
        "blk"
    } else {
        "socket"
    };
    let sha = ft.is_file().then(|| {
        use sha2::Digest;
        sha2::Sha256::digest(fs::read(&p).unwrap()).to_vec()
    });
    let node = Node {
        kind,
        mode: m.mode(),
        uid: m.uid(),
        gid: m.gid(),
        mtime: m.mtime(),
        size: if ft.is_dir() { 0 } else { m.size() },
        rdev: m.rdev(),
        nlink: if ft.is_dir() { 0 } else { m.nlink() },
        link: ft.is_symlink().then(|| fs::read_link(&p).unwrap()),
        sha,
        xattrs: xattrs(&p),
    };
    out.insert(rel.to_path_buf(), node);
    if ft.is_dir() {
        let mut names: Vec<_> = fs::read_dir(&p)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        for n in names {
            walk(root, &rel.join(n), out);
        }
    }
}

/// All xattrs of `p` (not following symlinks).
pub fn xattrs(p: &Path) -> BTreeMap<String, Vec<u8>> {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    let mut names = vec![0u8; 4096];
    // SAFETY: `c` is a valid C string and `names` a writable buffer of the given length.
    let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    let mut out = BTreeMap::new();
    if n <= 0 {
        return out;
    }
    for name in names[..n as usize]
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
    {
        let key = String::from_utf8_lossy(name).into_owned();
        if let Some(v) = get_xattr(p, &key) {
            out.insert(key, v);
        }
    }
    out
}

pub fn get_xattr(p: &Path, name: &str) -> Option<Vec<u8>> {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    let k = CString::new(name).unwrap();
    let mut buf = vec![0u8; 65536];
    // SAFETY: valid C strings; `buf` is writable for its full length.
    let n = unsafe { libc::lgetxattr(c.as_ptr(), k.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (n >= 0).then(|| buf[..n as usize].to_vec())
}

pub fn set_xattr(p: &Path, name: &str, value: &[u8]) {
    let c = CString::new(p.as_os_str().as_bytes()).unwrap();
    let k = CString::new(name).unwrap();
    // SAFETY: valid C strings; `value` is readable for its full length.
    let rc = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            k.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(
        rc,
        0,
        "setxattr {name} on {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
}

/// Runs `cmd` chrooted into `root` and returns stdout; panics with stderr on failure.
pub fn chroot_run(root: &Path, script: &str) -> String {
    let out = std::process::Command::new("chroot")
        .arg(root)
        .args(["/bin/sh", "-c", script])
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
        .output()
        .expect("run chroot");
    eprintln!("chroot stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "chroot {} {script:?} failed: {}",
        root.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
