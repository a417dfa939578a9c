//! The FUSE file system that shows each registered blob as a read-only file
//! (`<mountpoint>/<digest>.blob`), served from the [`ChunkCache`](super::ChunkCache); EROFS
//! mounts a layer with `device=<that file>`, so the kernel's reads of data blocks arrive here.
//!
//! The session thread only dispatches: every read is answered from a blocking thread of the
//! store's runtime (several at once — the kernel sends reads asynchronously), so a cold chunk
//! file on disk or a slow or unreachable store never holds up other reads (another
//! sandbox's, or another part of the same blob). Requests are up to 1 MiB (`max_pages`) and
//! the kernel reads ahead up to [`READ_AHEAD_KB`], set on the mount's backing device.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use fuser::{
    FileAttr, FileType, Filesystem, MountOption, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry,
    ReplyOpen, Request,
};

use super::{CachedBlob, ChunkCache};

const TTL: Duration = Duration::from_secs(3600);
/// Largest read request the kernel sends (it derives `max_pages` from it).
const MAX_REQUEST: u32 = 1 << 20;
/// Read-ahead of the FUSE file, set through its backing device after the mount (the
/// kernel offers only its 128 KiB default in the FUSE handshake).
const READ_AHEAD_KB: u32 = 4096;
/// Reads the kernel keeps in flight to the file system.
const MAX_BACKGROUND: u16 = 64;
const ROOT: u64 = 1;

/// Blobs the file system shows; inode = index + 2.
#[derive(Debug, Default)]
pub struct BlobTable {
    inner: RwLock<Table>,
}

#[derive(Debug, Default)]
struct Table {
    files: Vec<Option<(Arc<str>, Arc<CachedBlob>)>>,
    by_name: HashMap<String, u64>,
}

impl BlobTable {
    /// Registers (or finds) a blob; returns its inode.
    pub fn register(&self, digest: &str, blob: CachedBlob) -> u64 {
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        if let Some(&ino) = t.by_name.get(&blob.name) {
            return ino;
        }
        let ino = t.files.len() as u64 + 2;
        t.by_name.insert(blob.name.clone(), ino);
        t.files.push(Some((Arc::from(digest), Arc::new(blob))));
        ino
    }

    /// Hides the blob's file (its layer was deleted).
    pub fn unregister(&self, name: &str) {
        let mut t = self.inner.write().unwrap_or_else(|p| p.into_inner());
        if let Some(ino) = t.by_name.remove(name) {
            if let Some(slot) = t.files.get_mut((ino - 2) as usize) {
                *slot = None;
            }
        }
    }

    fn get(&self, ino: u64) -> Option<(Arc<str>, Arc<CachedBlob>)> {
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        t.files.get(ino.checked_sub(2)? as usize)?.clone()
    }

    fn lookup(&self, name: &str) -> Option<(u64, Arc<CachedBlob>)> {
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        let ino = *t.by_name.get(name)?;
        let (_, b) = t.files.get((ino - 2) as usize)?.clone()?;
        Some((ino, b))
    }

    fn names(&self) -> Vec<(u64, String)> {
        let t = self.inner.read().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> = t.by_name.iter().map(|(n, &i)| (i, n.clone())).collect();
        v.sort();
        v
    }
}

fn attr(ino: u64, size: u64, dir: bool) -> FileAttr {
    FileAttr {
        ino,
        size,
        blocks: size.div_ceil(512),
        atime: SystemTime::UNIX_EPOCH,
        mtime: SystemTime::UNIX_EPOCH,
        ctime: SystemTime::UNIX_EPOCH,
        crtime: SystemTime::UNIX_EPOCH,
        kind: if dir {
            FileType::Directory
        } else {
            FileType::RegularFile
        },
        perm: if dir { 0o555 } else { 0o444 },
        nlink: if dir { 2 } else { 1 },
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

struct BlobFs {
    table: Arc<BlobTable>,
    cache: Arc<ChunkCache>,
    rt: tokio::runtime::Handle,
}

impl Filesystem for BlobFs {
    fn init(
        &mut self,
        _req: &Request<'_>,
        config: &mut fuser::KernelConfig,
    ) -> Result<(), libc::c_int> {
        // Each setter answers the nearest accepted value when the kernel refuses ours.
        if let Err(nearest) = config.set_max_write(MAX_REQUEST) {
            let _ = config.set_max_write(nearest);
        }
        if let Err(nearest) = config.set_max_readahead(MAX_REQUEST) {
            let _ = config.set_max_readahead(nearest);
        }
        let _ = config.set_max_background(MAX_BACKGROUND);
        Ok(())
    }

    fn lookup(&mut self, _req: &Request<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        match (parent, name.to_str().and_then(|n| self.table.lookup(n))) {
            (ROOT, Some((ino, b))) => reply.entry(&TTL, &attr(ino, b.manifest.blob_size, false), 0),
            _ => reply.error(libc::ENOENT),
        }
    }

    fn getattr(&mut self, _req: &Request<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        if ino == ROOT {
            return reply.attr(&TTL, &attr(ROOT, 0, true));
        }
        match self.table.get(ino) {
            Some((_, b)) => reply.attr(&TTL, &attr(ino, b.manifest.blob_size, false)),
            None => reply.error(libc::ENOENT),
        }
    }

    fn open(&mut self, _req: &Request<'_>, ino: u64, flags: i32, reply: ReplyOpen) {
        if flags & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(libc::EROFS);
        }
        match self.table.get(ino) {
            // The content never changes: keep the kernel's page cache across opens.
            Some(_) => reply.opened(0, fuser::consts::FOPEN_KEEP_CACHE),
            None => reply.error(libc::ENOENT),
        }
    }

    fn read(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        let Some((digest, blob)) = self.table.get(ino) else {
            return reply.error(libc::ENOENT);
        };
        let off = offset.max(0) as u64;
        let end = (off + u64::from(size)).min(blob.manifest.blob_size);
        if off >= end {
            return reply.data(&[]);
        }
        let cache = self.cache.clone();
        let rt = self.rt.clone();
        self.rt.spawn_blocking(move || {
            let data = match cache.read_cached(&blob, &digest, off, end - off) {
                Some(data) => Ok(data),
                None => rt.block_on(cache.read(&blob, &digest, off, end - off)),
            };
            match data {
                Ok(data) => reply.data(&data),
                Err(e) => {
                    tracing::warn!(error = %e, "blob cache: read fails with EIO");
                    reply.error(libc::EIO)
                }
            }
        });
    }

    fn readdir(
        &mut self,
        _req: &Request<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        if ino != ROOT {
            return reply.error(libc::ENOTDIR);
        }
        let mut entries = vec![
            (ROOT, FileType::Directory, ".".to_string()),
            (ROOT, FileType::Directory, "..".to_string()),
        ];
        entries.extend(
            self.table
                .names()
                .into_iter()
                .map(|(i, n)| (i, FileType::RegularFile, n)),
        );
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset.max(0) as usize) {
            if reply.add(ino, (i + 1) as i64, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// The mounted file system; dropping it unmounts.
pub struct BlobMount {
    mountpoint: PathBuf,
    session: Option<fuser::BackgroundSession>,
}

impl std::fmt::Debug for BlobMount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobMount")
            .field("mountpoint", &self.mountpoint)
            .finish()
    }
}

impl BlobMount {
    /// Mounts the file system at `mountpoint` (created if needed; a mount left there by a
    /// crashed run is detached first).
    pub fn mount(
        mountpoint: &Path,
        table: Arc<BlobTable>,
        cache: Arc<ChunkCache>,
        rt: tokio::runtime::Handle,
    ) -> std::io::Result<Self> {
        detach_stale(mountpoint);
        std::fs::create_dir_all(mountpoint)?;
        let fs = BlobFs { table, cache, rt };
        let session = fuser::spawn_mount2(
            fs,
            mountpoint,
            &[
                MountOption::RO,
                MountOption::FSName("dsec-blobcache".into()),
                MountOption::Subtype("dsec-blobcache".into()),
                MountOption::AllowOther,
                MountOption::NoDev,
                MountOption::NoSuid,
            ],
        )?;
        if let Err(e) = raise_read_ahead(mountpoint) {
            tracing::warn!(mountpoint = %mountpoint.display(), error = %e, "blob cache: cannot raise the FUSE read-ahead (reads stay at the kernel's default)");
        }
        tracing::info!(mountpoint = %mountpoint.display(), "blob cache: FUSE file system mounted");
        Ok(BlobMount {
            mountpoint: mountpoint.to_path_buf(),
            session: Some(session),
        })
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmounts now (also done on drop).
    pub fn unmount(&mut self) {
        if let Some(s) = self.session.take() {
            drop(s);
            detach_stale(&self.mountpoint);
            tracing::info!(mountpoint = %self.mountpoint.display(), "blob cache: FUSE file system unmounted");
        }
    }
}

impl Drop for BlobMount {
    fn drop(&mut self) {
        self.unmount();
    }
}

/// Sets the read-ahead of the FUSE mount's backing device (`/sys/class/bdi/MAJ:MIN`) to
/// [`READ_AHEAD_KB`]: sequential reads of a blob then arrive as 1 MiB requests, several in
/// flight, instead of one 128 KiB request at a time.
fn raise_read_ahead(mountpoint: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    // The session answers the kernel's handshake on its own thread; the mount is usable (and
    // has its device number) once the root's attributes come back.
    let dev = std::fs::metadata(mountpoint)?.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    std::fs::write(
        format!("/sys/class/bdi/{major}:{minor}/read_ahead_kb"),
        READ_AHEAD_KB.to_string(),
    )
}

/// Detaches whatever is mounted at `mountpoint` (a crashed run's FUSE mount answers ENOTCONN).
pub fn detach_stale(mountpoint: &Path) {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
        return;
    };
    let target = mountpoint.to_string_lossy();
    if mounts
        .lines()
        .any(|l| l.split(' ').nth(1) == Some(target.as_ref()))
    {
        match nix::mount::umount2(mountpoint, nix::mount::MntFlags::MNT_DETACH) {
            Ok(()) => {
                tracing::info!(mountpoint = %target, "blob cache: detached a stale FUSE mount")
            }
            Err(e) => {
                tracing::warn!(mountpoint = %target, error = %e, "blob cache: detach stale FUSE mount")
            }
        }
    }
}
