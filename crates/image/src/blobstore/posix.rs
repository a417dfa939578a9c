//! A blob store on a mounted distributed file system (3FS, CephFS, JuiceFS, NFS, sshfs).
//!
//! Layers are mounted with `device=<path on the mount>`, so EROFS reads data blocks on demand
//! through that file system and the node's page cache; nothing is copied at create time except
//! the small metadata image. Puts always copy (the mount is another file system) to a
//! temporary name, fsync, and rename, which POSIX-ish network file systems make atomic.

use std::io;
use std::path::{Path, PathBuf};

use super::{BlobStore, DirObjects};

#[derive(Debug)]
pub struct PosixStore {
    objects: DirObjects,
    fs_type: String,
}

impl PosixStore {
    /// Opens `dir`, which must exist (it is a mount the operator set up).
    pub fn open(dir: &Path) -> io::Result<Self> {
        if !dir.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "posix blob store {} is not a directory; mount the shared file system first",
                    dir.display()
                ),
            ));
        }
        let objects = DirObjects::open(dir)?;
        let fs_type = fs_type_of(objects.dir()).unwrap_or_else(|| "unknown".into());
        Ok(PosixStore { objects, fs_type })
    }

    /// The file system type of the store's mount (`fuse.sshfs`, `nfs4`, `ceph`, ...).
    pub fn fs_type(&self) -> &str {
        &self.fs_type
    }
}

/// The type of the mount containing `dir`, from `/proc/self/mountinfo` (longest prefix).
fn fs_type_of(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut best: Option<(usize, String)> = None;
    for line in text.lines() {
        let mut halves = line.splitn(2, " - ");
        let left = halves.next()?;
        let right = halves.next().unwrap_or("");
        let Some(mp) = left.split(' ').nth(4) else {
            continue;
        };
        let mp = Path::new(mp);
        if dir.starts_with(mp) {
            let len = mp.as_os_str().len();
            let ty = right.split(' ').next().unwrap_or("").to_string();
            if best.as_ref().is_none_or(|(l, _)| len >= *l) {
                best = Some((len, ty));
            }
        }
    }
    best.map(|(_, t)| t)
}

impl BlobStore for PosixStore {
    fn describe(&self) -> String {
        format!("posix:{} ({})", self.objects.dir().display(), self.fs_type)
    }
    fn dir(&self) -> Option<&Path> {
        Some(self.objects.dir())
    }
    fn put(&self, key: &str, src: &Path) -> io::Result<()> {
        self.objects.put(key, src, false)
    }
    fn mount_source(&self, key: &str) -> io::Result<PathBuf> {
        self.objects.path(key)
    }
    fn size(&self, key: &str) -> io::Result<Option<u64>> {
        self.objects.size(key)
    }
    fn read_at(&self, key: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.objects.read_at(key, offset, buf)
    }
    fn fetch(&self, key: &str, dst: &Path) -> io::Result<u64> {
        self.objects.fetch(key, dst)
    }
    fn remove(&self, key: &str) -> io::Result<()> {
        self.objects.remove(key)
    }
    fn keys(&self) -> io::Result<Vec<String>> {
        self.objects.keys()
    }
}
