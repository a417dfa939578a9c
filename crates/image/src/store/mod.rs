//! The image store: index, layer files and reference-counted node-wide layer mounts.
//!
//! Locking: one `std::sync::Mutex<State>` guards the index, the lease counts and the per-layer
//! mount state; it is never held across an `.await`. Mounting a layer happens under a
//! per-layer `tokio::sync::Mutex` (so concurrent acquires of a cold layer mount it once) and
//! publishes `mounted = true` under the state lock. Every unmount happens under the state lock
//! and only when the layer's reference count is zero; since acquires raise the count under the
//! same lock before mounting, an unmount can never pull a layer from under a new user.

pub mod alias;
mod ingest;
mod lease;
mod mounts;
mod publish;
mod remove;
mod verify;

use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use dsec_wire::api::{ImageInfo, ImageLayerInfo};

use crate::blobstore::{self, BlobStore};
use crate::busybox::{self, BUSYBOX_IMAGE, HOST_BUSYBOX};
use crate::import::{BuiltLayer, ImportOptions, TempPath};
use crate::index::{ImageRecord, Index, LayerRecord};
use crate::{mount, name, ImageError};

/// How long an unused layer stays mounted before it is unmounted.
pub const DEFAULT_UNMOUNT_GRACE: Duration = Duration::from_secs(30);

/// The node's image store. Cheap to clone (shared state); safe to use from many tasks.
#[derive(Clone)]
pub struct ImageStore {
    inner: Arc<Inner>,
}

struct Inner {
    root: PathBuf,
    blobs: Box<dyn BlobStore>,
    /// The blob store is not the default node-private directory (other nodes may share it).
    shared: bool,
    state: Mutex<State>,
    grace_ms: AtomicU64,
    busybox_lock: tokio::sync::Mutex<()>,
    busybox_path: Mutex<PathBuf>,
    stats: Counters,
}

/// Lock-free counters of the store's expensive operations.
#[derive(Default)]
struct Counters {
    layer_mounts: AtomicU64,
    meta_fetches: AtomicU64,
    meta_fetch_bytes: AtomicU64,
    blob_verifications: AtomicU64,
}

/// A snapshot of the store's counters (for metrics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StoreStats {
    /// EROFS layer mounts made by this store since it was opened.
    pub layer_mounts: u64,
    /// Metadata images copied from the blob store to local disk.
    pub meta_fetches: u64,
    pub meta_fetch_bytes: u64,
    /// Data blobs checked (size + first/last 64 KiB) before a first mount.
    pub blob_verifications: u64,
    /// Layers mounted right now.
    pub layers_mounted: u64,
}

struct State {
    index: Index,
    /// Image name → live leases.
    leases: HashMap<String, u64>,
    /// Layer digest → mount state. Entries exist while a layer is referenced or mounted.
    layers: HashMap<String, Layer>,
    /// Foreign layers (see `publish`) whose image went while they were in use.
    foreign: std::collections::HashSet<String>,
}

struct Layer {
    refs: u64,
    mounted: bool,
    /// Bumped whenever `refs` changes to or from zero; a pending unmount only proceeds if the
    /// generation it was scheduled at is still current.
    generation: u64,
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl Layer {
    fn new() -> Self {
        Layer {
            refs: 0,
            mounted: false,
            generation: 0,
            lock: Arc::new(tokio::sync::Mutex::new(())),
        }
    }
}

/// A hold on an image's mounted layers (or on a composition of images: base, workspace,
/// toolkits); dropping it releases the references.
pub use lease::ImageLease;

impl fmt::Debug for ImageStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImageStore")
            .field("root", &self.inner.root)
            .finish()
    }
}

impl Inner {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn grace(&self) -> Duration {
        Duration::from_millis(self.grace_ms.load(Ordering::Relaxed))
    }

    pub(super) fn layer_path(&self, digest: &str) -> PathBuf {
        self.root.join("layers").join(format!("{digest}.erofs"))
    }

    pub(super) fn mnt_dir(&self) -> PathBuf {
        self.root.join("mnt")
    }

    pub(super) fn mnt_path(&self, digest: &str) -> PathBuf {
        self.mnt_dir().join(digest)
    }

    pub(super) fn tmp_path(&self, what: &str) -> PathBuf {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        self.root
            .join("tmp")
            .join(format!("{what}-{}-{n}-{nanos:x}", std::process::id()))
    }

    pub(super) fn info_locked(st: &State, image: &str, rec: &ImageRecord) -> ImageInfo {
        ImageInfo {
            name: image.to_string(),
            layers: rec
                .layers
                .iter()
                .map(|l| ImageLayerInfo {
                    digest: l.digest.clone(),
                    size_bytes: l.size_bytes,
                    meta_bytes: if l.meta_bytes == 0 {
                        l.size_bytes
                    } else {
                        l.meta_bytes
                    },
                    blob_bytes: l.blob_bytes,
                    users: st.layers.get(&l.digest).map(|x| x.refs).unwrap_or(0),
                })
                .collect(),
            size_bytes: rec.size_bytes(),
            created_at: rec.created_at.clone(),
            in_use: st.leases.get(image).copied().unwrap_or(0),
            parent: rec.parent.clone(),
            source: rec.source.clone(),
        }
    }
}

impl ImageStore {
    /// Opens (creating if needed) the store at `root` with the default blob store (the
    /// directory `<root>/blobs`): loads the index and wipes `tmp/`.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, ImageError> {
        Self::open_with(root, "local")
    }

    /// [`ImageStore::open`] with a blob store spec: `local`, `local:/dir` or
    /// `posix:/mounted/dir` (see [`crate::blobstore::from_spec`]).
    pub fn open_with(root: impl Into<PathBuf>, blob_store: &str) -> Result<Self, ImageError> {
        Self::open_with_s3(root, blob_store, &blobstore::s3::S3Config::default())
    }

    /// [`ImageStore::open_with`], also taking `s3://bucket/prefix` blob stores configured by
    /// `s3`.
    pub fn open_with_s3(
        root: impl Into<PathBuf>,
        blob_store: &str,
        s3: &blobstore::s3::S3Config,
    ) -> Result<Self, ImageError> {
        let root: PathBuf = root.into();
        fs::create_dir_all(&root)?;
        let root = root.canonicalize()?;
        for sub in ["layers", "mnt"] {
            fs::create_dir_all(root.join(sub))?;
        }
        let tmp = root.join("tmp");
        if tmp.exists() {
            fs::remove_dir_all(&tmp)?;
        }
        fs::create_dir_all(&tmp)?;
        let _ = fs::remove_file(root.join(format!("{}.tmp", crate::index::INDEX_FILE)));
        let index = Index::load(&root)?;
        let blobs = blobstore::from_spec_with(blob_store, &root.join("blobs"), s3)?;
        tracing::info!(store = %blobs.describe(), "image blob store");
        Ok(ImageStore {
            inner: Arc::new(Inner {
                root,
                blobs,
                shared: !matches!(blob_store, "" | "local"),
                state: Mutex::new(State {
                    index,
                    leases: HashMap::new(),
                    layers: HashMap::new(),
                    foreign: Default::default(),
                }),
                grace_ms: AtomicU64::new(DEFAULT_UNMOUNT_GRACE.as_millis() as u64),
                busybox_lock: tokio::sync::Mutex::new(()),
                busybox_path: Mutex::new(PathBuf::from(HOST_BUSYBOX)),
                stats: Counters::default(),
            }),
        })
    }

    /// The store's (canonical) root directory.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// Counters of mounts and blob-store reads since the store was opened.
    pub fn stats(&self) -> StoreStats {
        let c = &self.inner.stats;
        let mounted = self
            .inner
            .lock()
            .layers
            .values()
            .filter(|l| l.mounted)
            .count() as u64;
        StoreStats {
            layer_mounts: c.layer_mounts.load(Ordering::Relaxed),
            meta_fetches: c.meta_fetches.load(Ordering::Relaxed),
            meta_fetch_bytes: c.meta_fetch_bytes.load(Ordering::Relaxed),
            blob_verifications: c.blob_verifications.load(Ordering::Relaxed),
            layers_mounted: mounted,
        }
    }

    /// The counters of the blob store's node-local chunk cache (object stores only).
    pub fn cache_stats(&self) -> Option<blobstore::s3::StoreCacheStats> {
        self.inner.blobs.cache_stats()
    }

    /// The blob store's `kind:location`.
    pub fn blob_store(&self) -> String {
        self.inner.blobs.describe()
    }

    /// The directory holding the layers' data blobs as `<digest>.blob` (None: the store is
    /// not a directory).
    pub fn blob_dir(&self) -> Option<PathBuf> {
        self.inner.blobs.dir().map(Path::to_path_buf)
    }

    /// How long an unused layer stays mounted (default 30 s). Applies to releases from now on.
    pub fn set_unmount_grace(&self, grace: Duration) {
        let ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
        self.inner.grace_ms.store(ms, Ordering::Relaxed);
    }

    /// Uses another static busybox binary for [`ImageStore::ensure_busybox`] (default
    /// `/bin/busybox`).
    pub fn set_busybox_binary(&self, path: impl Into<PathBuf>) {
        *self
            .inner
            .busybox_path
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = path.into();
    }

    /// After a crash: unmounts (detached) every mount below `<root>/mnt/` that this store
    /// does not currently hold, and removes empty mount-point directories.
    pub fn cleanup_stale_mounts(&self) -> Result<(), ImageError> {
        let mnt = self.inner.mnt_dir();
        let st = self.inner.lock();
        let ours = |p: &Path| {
            p.parent() == Some(mnt.as_path())
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|d| st.layers.get(d))
                    .is_some_and(|l| l.mounted)
        };
        let mut first_err = None;
        for p in mount::mounts_under(&mnt)? {
            if ours(&p) {
                continue;
            }
            match mount::unmount_detach(&p) {
                Ok(()) => tracing::info!(path = %p.display(), "unmounted stale layer mount"),
                Err(e) => {
                    tracing::warn!(path = %p.display(), error = %e, "unmount stale layer mount");
                    first_err.get_or_insert(e);
                }
            }
        }
        for entry in fs::read_dir(&mnt)? {
            let p = entry?.path();
            if !ours(&p) && p.is_dir() {
                // Only empty directories go; anything else is left for an operator to see.
                let _ = fs::remove_dir(&p);
            }
        }
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Imports the built-in `busybox:latest` image from the host's static busybox, unless
    /// it exists already.
    pub async fn ensure_busybox(&self) -> Result<(), ImageError> {
        let _guard = self.inner.busybox_lock.lock().await;
        if self.get(BUSYBOX_IMAGE).is_ok() {
            return Ok(());
        }
        let work = TempPath::new(self.inner.tmp_path("busybox"));
        let root = work.path().join("root");
        let bin = self
            .inner
            .busybox_path
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let dir = work.path().to_path_buf();
        let built = tokio::task::spawn_blocking(move || {
            fs::create_dir(&dir).map_err(|source| busybox::BusyboxError::WorkDir {
                path: dir.clone(),
                source,
            })?;
            busybox::build_root(&bin, &root)
        })
        .await
        .map_err(|e| std::io::Error::other(format!("busybox build task: {e}")))?;
        if let Err(message) = built {
            work.cleanup().await;
            return Err(import_err(BUSYBOX_IMAGE, message));
        }
        let res = self
            .import_dir_with(
                BUSYBOX_IMAGE,
                &work.path().join("root"),
                &ImportOptions::default(),
            )
            .await;
        work.cleanup().await;
        res.map(|_| ())
    }

    /// The image `name` (`name` or `name:tag`).
    pub fn get(&self, name: &str) -> Result<ImageInfo, ImageError> {
        let name = name::canonical(name)?;
        let st = self.inner.lock();
        let rec = st
            .index
            .images
            .get(&name)
            .ok_or_else(|| ImageError::NotFound(name.clone()))?;
        Ok(Inner::info_locked(&st, &name, rec))
    }

    /// All images, sorted by name.
    pub fn list(&self) -> Vec<ImageInfo> {
        let st = self.inner.lock();
        st.index
            .images
            .iter()
            .map(|(n, r)| Inner::info_locked(&st, n, r))
            .collect()
    }
}

/// Positioned reads of a store object, for [`import::sample_digest`].
struct StoreReader<'a> {
    store: &'a dyn BlobStore,
    key: &'a str,
}

impl std::os::unix::fs::FileExt for StoreReader<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        self.store.read_at(self.key, offset, buf)
    }
    fn write_at(&self, _buf: &[u8], _offset: u64) -> std::io::Result<usize> {
        Err(std::io::Error::other("read-only"))
    }
}

/// One layer of an image being registered: already stored, or freshly built.
pub(crate) enum LayerPart {
    Existing(LayerRecord),
    Built(BuiltLayer),
}

pub(crate) fn blob_key(digest: &str) -> String {
    format!("{digest}.blob")
}

pub(crate) fn meta_key(digest: &str) -> String {
    format!("{digest}.meta")
}

fn import_err(name: &str, message: impl std::fmt::Display) -> ImageError {
    ImageError::Import {
        name: name.to_string(),
        message: message.to_string(),
    }
}
