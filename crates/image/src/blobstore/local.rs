//! The default blob store: a directory on the node's local disk.

use std::io;
use std::path::{Path, PathBuf};

use super::{BlobStore, DirObjects};

/// Objects in a local directory; puts hard-link from the store's temporary files when they
/// share a file system (no copy).
#[derive(Debug)]
pub struct LocalStore {
    objects: DirObjects,
}

impl LocalStore {
    pub fn open(dir: &Path) -> io::Result<Self> {
        Ok(LocalStore {
            objects: DirObjects::open(dir)?,
        })
    }
}

impl BlobStore for LocalStore {
    fn describe(&self) -> String {
        format!("local:{}", self.objects.dir().display())
    }
    fn dir(&self) -> Option<&Path> {
        Some(self.objects.dir())
    }
    fn put(&self, key: &str, src: &Path) -> io::Result<()> {
        self.objects.put(key, src, true)
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
