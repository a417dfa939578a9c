//! Where layer data blobs (and the authoritative copy of each layer's metadata image) live.
//!
//! A layer is a small EROFS metadata image plus a data blob (`mkfs.erofs --blobdev`). The
//! metadata image is copied to the node's local disk at first use; the data blob stays in the
//! blob store and the kernel reads only the blocks a sandbox touches, through the node's page
//! cache, because the layer is mounted with `-o device=<path the store gives>`.
//!
//! Stores (one file each):
//! - [`local::LocalStore`] — a directory on the node's disk (default);
//! - [`posix::PosixStore`] — a directory on a mounted distributed file system (3FS, CephFS,
//!   JuiceFS, NFS, sshfs): reads go over the network on demand.
//!
//! - [`s3::S3Store`] — an S3-compatible object store (`s3://bucket/prefix`): `put` uploads with
//!   multipart, `fetch`/`read_at`/`size` are GET, ranged GET and HEAD, and `mount_source`
//!   returns a file of the node's chunk cache shown through FUSE ([`crate::chunkcache`]).

mod local;
mod posix;
pub mod s3;

use std::fmt;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

pub use local::LocalStore;
pub use posix::PosixStore;

/// A content store of immutable objects addressed by key (`<digest>.blob`, `<digest>.meta`).
/// All methods block; call them from the blocking pool.
pub trait BlobStore: Send + Sync + fmt::Debug {
    /// `kind:location`, for listings and logs (`local:/var/lib/...`, `posix:/mnt/blobs`).
    fn describe(&self) -> String;
    /// The directory holding the objects as `<key>` files, when the store is a directory
    /// (a local one, or a mounted distributed file system); VMs attach blobs from it.
    fn dir(&self) -> Option<&Path>;
    /// Stores the file `src` under `key` atomically (readers never see a partial object).
    /// An existing object with that key is kept (objects are content-addressed).
    fn put(&self, key: &str, src: &Path) -> io::Result<()>;
    /// A path the kernel can read the object from on demand (EROFS `device=`).
    fn mount_source(&self, key: &str) -> io::Result<PathBuf>;
    /// The object's size, `None` if it does not exist.
    fn size(&self, key: &str) -> io::Result<Option<u64>>;
    /// Reads up to `buf.len()` bytes at `offset` (ranged read).
    fn read_at(&self, key: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize>;
    /// Copies the whole object to `dst` (a local file); returns its size.
    fn fetch(&self, key: &str, dst: &Path) -> io::Result<u64>;
    /// Removes the object; a missing object is not an error.
    fn remove(&self, key: &str) -> io::Result<()>;
    /// Every key in the store (for garbage collection).
    fn keys(&self) -> io::Result<Vec<String>>;
    /// The node-local chunk cache's counters, for a store that reads through one.
    fn cache_stats(&self) -> Option<s3::StoreCacheStats> {
        None
    }
    /// Releases node resources the store holds (the chunk cache's FUSE mount) at shutdown.
    fn shutdown(&self) {}
}

/// Opens a store from its spec: `local` (the directory `default_dir`), `local:/dir` or
/// `posix:/mounted/dir`.
pub fn from_spec(spec: &str, default_dir: &Path) -> io::Result<Box<dyn BlobStore>> {
    from_spec_with(spec, default_dir, &s3::S3Config::default())
}

/// [`from_spec`], also taking `s3://bucket/prefix` (configured by `s3`; its chunk cache and
/// FUSE mount live beside `default_dir`).
pub fn from_spec_with(
    spec: &str,
    default_dir: &Path,
    s3: &s3::S3Config,
) -> io::Result<Box<dyn BlobStore>> {
    if let Some(loc) = spec.strip_prefix("s3:") {
        let root = default_dir.parent().unwrap_or(default_dir);
        return Ok(Box::new(s3::S3Store::open(loc, root, s3)?));
    }
    let (kind, loc) = match spec.split_once(':') {
        Some((k, l)) => (k, Some(PathBuf::from(l))),
        None => (spec, None),
    };
    match (kind, loc) {
        ("local", None) | ("", None) => Ok(Box::new(LocalStore::open(default_dir)?)),
        ("local", Some(dir)) => Ok(Box::new(LocalStore::open(&dir)?)),
        ("posix", Some(dir)) => Ok(Box::new(PosixStore::open(&dir)?)),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad blob store {spec:?}: use `local`, `local:/dir`, `posix:/mounted/dir` or `s3://bucket/prefix`"),
        )),
    }
}

/// Keys are `<64 hex>.<ext>`; anything else could name a path outside the store.
pub(crate) fn check_key(key: &str) -> io::Result<()> {
    let ok = key.split_once('.').is_some_and(|(d, ext)| {
        crate::name::is_digest(d) && !ext.is_empty() && ext.bytes().all(|c| c.is_ascii_lowercase())
    });
    if ok {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad blob key {key:?}"),
        ))
    }
}

/// A directory of objects: the common core of the local and POSIX stores. Objects are
/// written to `<dir>/.tmp-*` (copy + fsync) and renamed into place.
#[derive(Debug)]
pub(crate) struct DirObjects {
    dir: PathBuf,
}

impl DirObjects {
    pub(crate) fn open(dir: &Path) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        let dir = dir.canonicalize()?;
        // Leftovers of interrupted puts.
        for e in fs::read_dir(&dir)? {
            let e = e?;
            if e.file_name().to_string_lossy().starts_with(".tmp-") {
                let _ = fs::remove_file(e.path());
            }
        }
        Ok(DirObjects { dir })
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    pub(crate) fn path(&self, key: &str) -> io::Result<PathBuf> {
        check_key(key)?;
        Ok(self.dir.join(key))
    }

    /// Stores `src` under `key`: rename when `try_rename` and on the same file system,
    /// otherwise copy + fsync + rename.
    pub(crate) fn put(&self, key: &str, src: &Path, try_rename: bool) -> io::Result<()> {
        let dst = self.path(key)?;
        if dst.exists() {
            return Ok(());
        }
        let tmp = self.dir.join(format!(".tmp-{key}-{}", std::process::id()));
        let copied = (|| {
            if try_rename {
                match fs::hard_link(src, &tmp) {
                    Ok(()) => return Ok(()),
                    Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {}
                    Err(e) => return Err(e),
                }
            }
            let mut from = fs::File::open(src)?;
            let mut to = fs::File::create(&tmp)?;
            io::copy(&mut from, &mut to)?;
            to.flush()?;
            to.sync_all()
        })();
        if let Err(e) = copied {
            let _ = fs::remove_file(&tmp);
            return Err(io::Error::new(
                e.kind(),
                format!("store {} in {}: {e}", key, self.dir.display()),
            ));
        }
        fs::rename(&tmp, &dst)?;
        fs::File::open(&self.dir)?.sync_all()
    }

    pub(crate) fn size(&self, key: &str) -> io::Result<Option<u64>> {
        match fs::metadata(self.path(key)?) {
            Ok(m) => Ok(Some(m.len())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub(crate) fn read_at(&self, key: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let f = fs::File::open(self.path(key)?)?;
        let mut done = 0;
        while done < buf.len() {
            let n = f.read_at(&mut buf[done..], offset + done as u64)?;
            if n == 0 {
                break;
            }
            done += n;
        }
        Ok(done)
    }

    pub(crate) fn fetch(&self, key: &str, dst: &Path) -> io::Result<u64> {
        let mut from = fs::File::open(self.path(key)?)?;
        let mut to = fs::File::create(dst)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            let n = from.read(&mut buf)?;
            if n == 0 {
                break;
            }
            to.write_all(&buf[..n])?;
            total += n as u64;
        }
        to.sync_all()?;
        Ok(total)
    }

    pub(crate) fn remove(&self, key: &str) -> io::Result<()> {
        match fs::remove_file(self.path(key)?) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    pub(crate) fn keys(&self) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for e in fs::read_dir(&self.dir)? {
            let name = e?.file_name().to_string_lossy().into_owned();
            if check_key(&name).is_ok() {
                out.push(name);
            }
        }
        out.sort();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked() {
        assert!(check_key(&format!("{}.blob", "a".repeat(64))).is_ok());
        for bad in [
            "../x.blob",
            "x.blob",
            &"a".repeat(64),
            &format!("{}./", "a".repeat(64)),
        ] {
            assert!(check_key(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn specs() {
        let d = tempfile::tempdir().unwrap();
        let s = from_spec("local", d.path()).unwrap();
        assert!(s.describe().starts_with("local:"));
        assert!(s.dir().is_some_and(|p| p.starts_with(d.path())));
        let s = from_spec(&format!("posix:{}", d.path().display()), d.path()).unwrap();
        assert!(s.describe().starts_with("posix:"));
        assert!(s.dir().is_some_and(|p| p.starts_with(d.path())));
        assert!(from_spec("s4:/x", d.path()).is_err());
        assert!(from_spec("posix", d.path()).is_err());
    }

    #[test]
    fn put_fetch_read_remove() {
        let d = tempfile::tempdir().unwrap();
        let s = from_spec("local", &d.path().join("store")).unwrap();
        let src = d.path().join("src");
        fs::write(&src, b"hello world").unwrap();
        let key = format!("{}.blob", "b".repeat(64));
        s.put(&key, &src).unwrap();
        s.put(&key, &src).unwrap();
        assert_eq!(s.size(&key).unwrap(), Some(11));
        let mut buf = [0u8; 5];
        assert_eq!(s.read_at(&key, 6, &mut buf).unwrap(), 5);
        assert_eq!(&buf, b"world");
        let dst = d.path().join("dst");
        assert_eq!(s.fetch(&key, &dst).unwrap(), 11);
        assert_eq!(s.keys().unwrap(), vec![key.clone()]);
        s.remove(&key).unwrap();
        s.remove(&key).unwrap();
        assert_eq!(s.size(&key).unwrap(), None);
    }
}
