//! The image store: index, layer files and reference-counted node-wide layer mounts.
//!
//! Locking: one `std::sync::Mutex<State>` guards the index, the lease counts and the per-layer
//! mount state; it is never held across an `.await`. Mounting a layer happens under a
//! per-layer `tokio::sync::Mutex` (so concurrent acquires of a cold layer mount it once) and
//! publishes `mounted = true` under the state lock. Every unmount happens under the state lock
//! and only when the layer's reference count is zero; since acquires raise the count under the
//! same lock before mounting, an unmount can never pull a layer from under a new user.

use std::collections::HashMap;
use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use dsec_wire::api::{ImageInfo, ImageLayerInfo};

use crate::blobstore::{self, BlobStore};
use crate::busybox::{self, BUSYBOX_IMAGE, HOST_BUSYBOX};
use crate::import::{self, BuiltLayer, ImportOptions, TempPath};
use crate::index::{ImageRecord, Index, LayerRecord};
use crate::registry::{ProgressFn, PullOptions, PullProgress};
use crate::{mount, name, time, ImageError};

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
pub struct ImageLease {
    inner: Arc<Inner>,
    /// Leased image names: the base first, then workspace and toolkits.
    images: Vec<String>,
    /// Bottom-most first, as in the index.
    digests: Vec<String>,
    runtime: Option<tokio::runtime::Handle>,
}

impl ImageLease {
    /// Mounted layer roots, top-most first (overlay `lowerdir` order).
    pub fn lowers(&self) -> Vec<PathBuf> {
        self.digests
            .iter()
            .rev()
            .map(|d| self.inner.mnt_path(d))
            .collect()
    }

    /// The (base) image's `name:tag`.
    pub fn image(&self) -> &str {
        self.images.first().map(String::as_str).unwrap_or("")
    }

    /// Every leased image: the base first, then the workspace and toolkits.
    pub fn images(&self) -> &[String] {
        &self.images
    }

    /// The layers' EROFS files, top-most first (for substrates that attach them as disks).
    pub fn layer_files(&self) -> Vec<PathBuf> {
        self.digests
            .iter()
            .rev()
            .map(|d| self.inner.layer_path(d))
            .collect()
    }

    /// Layer digests, top-most first.
    pub fn digests(&self) -> Vec<String> {
        self.digests.iter().rev().cloned().collect()
    }
}

impl fmt::Debug for ImageLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImageLease")
            .field("images", &self.images)
            .field("digests", &self.digests)
            .finish()
    }
}

impl fmt::Debug for ImageStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImageStore")
            .field("root", &self.inner.root)
            .finish()
    }
}

impl Drop for ImageLease {
    fn drop(&mut self) {
        let idle = {
            let mut st = self.inner.lock();
            for image in &self.images {
                if let Some(n) = st.leases.get_mut(image) {
                    *n = n.saturating_sub(1);
                    if *n == 0 {
                        st.leases.remove(image);
                    }
                }
            }
            let mut idle = Vec::new();
            for d in &self.digests {
                if let Some(l) = st.layers.get_mut(d) {
                    l.refs = l.refs.saturating_sub(1);
                    if l.refs == 0 {
                        l.generation += 1;
                        idle.push((d.clone(), l.generation, l.lock.clone()));
                    }
                }
            }
            idle
        };
        if idle.is_empty() {
            return;
        }
        let grace = self.inner.grace();
        let runtime = self
            .runtime
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok());
        let Some(rt) = runtime else {
            // No runtime to run the timer on: the layers stay mounted until `unmount_all`
            // or the next `cleanup_stale_mounts`.
            return;
        };
        for (digest, generation, lock) in idle {
            let inner = self.inner.clone();
            rt.spawn(async move {
                if !grace.is_zero() {
                    tokio::time::sleep(grace).await;
                }
                let _guard = lock.lock().await;
                let d = digest.clone();
                let res =
                    tokio::task::spawn_blocking(move || inner.unmount_if_idle(&d, generation))
                        .await;
                match res {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        tracing::warn!(digest = %digest, error = %e, "unmount idle layer")
                    }
                    Err(e) => {
                        tracing::warn!(digest = %digest, error = %e, "unmount idle layer task")
                    }
                }
            });
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data behind; keep going.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn grace(&self) -> Duration {
        Duration::from_millis(self.grace_ms.load(Ordering::Relaxed))
    }

    fn layer_path(&self, digest: &str) -> PathBuf {
        self.root.join("layers").join(format!("{digest}.erofs"))
    }

    fn mnt_dir(&self) -> PathBuf {
        self.root.join("mnt")
    }

    fn mnt_path(&self, digest: &str) -> PathBuf {
        self.mnt_dir().join(digest)
    }

    fn tmp_path(&self, what: &str) -> PathBuf {
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

    /// Called by the grace timer: unmounts `digest` if nobody re-acquired it since.
    fn unmount_if_idle(&self, digest: &str, generation: u64) -> std::io::Result<()> {
        let mut st = self.lock();
        let Some(l) = st.layers.get(digest) else {
            return Ok(());
        };
        if l.refs != 0 || l.generation != generation {
            return Ok(());
        }
        self.unmount_layer_locked(&mut st, digest)?;
        if !st.index.references(digest, None) {
            // The image using it was replaced or removed while the layer was in use.
            self.delete_layer_locked(&mut st, digest)?;
        } else {
            st.layers.remove(digest);
        }
        Ok(())
    }

    /// Unmounts a layer (state lock held, refs must be zero) and removes its mount point.
    fn unmount_layer_locked(&self, st: &mut State, digest: &str) -> std::io::Result<()> {
        let Some(l) = st.layers.get_mut(digest) else {
            return Ok(());
        };
        if l.mounted {
            let target = self.mnt_path(digest);
            mount::unmount(&target)?;
            l.mounted = false;
            let _ = fs::remove_dir(&target);
            tracing::debug!(digest, "layer unmounted");
        }
        Ok(())
    }

    /// Deletes a layer nobody references any more (state lock held): unmount, file, state.
    fn delete_layer_locked(&self, st: &mut State, digest: &str) -> std::io::Result<()> {
        if st.layers.get(digest).is_some_and(|l| l.refs > 0) || st.index.references(digest, None) {
            return Ok(());
        }
        self.unmount_layer_locked(st, digest)?;
        st.layers.remove(digest);
        match fs::remove_file(self.layer_path(digest)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        self.blobs.remove(&blob_key(digest))?;
        self.blobs.remove(&meta_key(digest))?;
        tracing::debug!(digest, "layer deleted");
        Ok(())
    }

    fn info_locked(st: &State, image: &str, rec: &ImageRecord) -> ImageInfo {
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
        let blobs = blobstore::from_spec(blob_store, &root.join("blobs"))?;
        tracing::info!(store = %blobs.describe(), "image blob store");
        Ok(ImageStore {
            inner: Arc::new(Inner {
                root,
                blobs,
                state: Mutex::new(State {
                    index,
                    leases: HashMap::new(),
                    layers: HashMap::new(),
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
            fs::create_dir(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
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

    /// Imports a tar or gzip'd tar stream as a single-layer image `name`, replacing any image
    /// of the same name.
    pub async fn import_tar<R>(&self, name: &str, reader: R) -> Result<ImageInfo, ImageError>
    where
        R: tokio::io::AsyncRead + Send + Unpin + 'static,
    {
        self.import_tar_with(name, reader, &ImportOptions::default())
            .await
    }

    /// [`ImageStore::import_tar`] with options.
    pub async fn import_tar_with<R>(
        &self,
        name: &str,
        reader: R,
        opts: &ImportOptions,
    ) -> Result<ImageInfo, ImageError>
    where
        R: tokio::io::AsyncRead + Send + Unpin + 'static,
    {
        let name = name::canonical(name)?;
        let work = TempPath::new(self.inner.tmp_path("unpack"));
        let root = work.path().join("root");
        let res = self.unpack_into(&name, reader, work.path(), &root).await;
        let res = match res {
            Ok(()) => {
                let mut opts = opts.clone();
                opts.source.get_or_insert_with(|| "tar".into());
                self.import_dir_with(&name, &root, &opts).await
            }
            Err(e) => Err(e),
        };
        work.cleanup().await;
        res
    }

    async fn unpack_into<R>(
        &self,
        name: &str,
        mut reader: R,
        work: &Path,
        root: &Path,
    ) -> Result<(), ImageError>
    where
        R: tokio::io::AsyncRead + Send + Unpin + 'static,
    {
        use tokio::io::AsyncReadExt;

        fs::create_dir(work)?;
        fs::create_dir(root)?;
        // The async reader is pumped by this future into a channel that the blocking unpack
        // reads. If this future is dropped, the pump (and the reader) go with it, the unpack
        // sees the end of its input plus the cancel flag, stops, and removes what it wrote
        // (the TempPath guard may have run before it finished).
        let cancelled = Arc::new(AtomicBool::new(false));
        let _cancel_on_drop = CancelOnDrop(cancelled.clone());
        let (tx, rx) = tokio::sync::mpsc::channel::<std::io::Result<Vec<u8>>>(16);
        let pump = async move {
            let mut buf = vec![0u8; 1 << 16];
            loop {
                match reader.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => {
                        if tx.send(Ok(buf[..n].to_vec())).await.is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        break;
                    }
                }
            }
        };
        let chan = ChannelReader {
            rx,
            chunk: Vec::new(),
            pos: 0,
            cancelled: cancelled.clone(),
        };
        let (dir, wdir) = (root.to_path_buf(), work.to_path_buf());
        let mut unpack = tokio::task::spawn_blocking(move || {
            let r = import::unpack_tar(chan, &dir);
            if cancelled.load(Ordering::SeqCst) {
                let _ = fs::remove_dir_all(&wdir);
            }
            r
        });
        tokio::pin!(pump);
        let joined = tokio::select! {
            // The unpack finished (or failed) before the input ended: stop reading.
            r = &mut unpack => r,
            // All input handed over: wait for the unpack.
            () = &mut pump => unpack.await,
        };
        joined
            .map_err(|e| std::io::Error::other(format!("unpack task: {e}")))?
            .map_err(|m| import_err(name, m))
    }

    /// Imports an archive of `format`: a plain tar (one layer), a `docker save` archive or a
    /// tar of an OCI image layout (one layer per image layer, bottom first, whiteouts
    /// converted). Replaces any image of the same name.
    pub async fn import_archive<R>(
        &self,
        name: &str,
        mut reader: R,
        format: crate::ArchiveFormat,
    ) -> Result<ImageInfo, ImageError>
    where
        R: tokio::io::AsyncRead + Send + Unpin + 'static,
    {
        if format == crate::ArchiveFormat::Tar {
            return self.import_tar(name, reader).await;
        }
        let name = name::canonical(name)?;
        let work = TempPath::new(self.inner.tmp_path("archive"));
        fs::create_dir(work.path())?;
        let file = work.path().join("archive.tar");
        {
            let mut f = tokio::fs::File::create(&file).await?;
            tokio::io::copy(&mut reader, &mut f).await?;
        }
        let outer = work.path().join("outer");
        let (f2, o2, n2) = (file.clone(), outer.clone(), name.clone());
        let layers = tokio::task::spawn_blocking(move || -> Result<Vec<PathBuf>, ImageError> {
            fs::create_dir(&o2)?;
            let f = fs::File::open(&f2)?;
            crate::oci::unpack_outer(f, &o2).map_err(|m| import_err(&n2, m))?;
            let _ = fs::remove_file(&f2);
            crate::oci::layer_files(&o2, format).map_err(|m| import_err(&n2, m))
        })
        .await
        .map_err(|e| std::io::Error::other(format!("unpack archive: {e}")))??;
        let res = self
            .import_layer_files(
                &name,
                work.path(),
                layers,
                format.as_str().to_string(),
                None,
            )
            .await;
        work.cleanup().await;
        res
    }

    /// Imports an OCI image layout directory (as `skopeo copy ... oci:DIR` writes it).
    pub async fn import_oci_dir(&self, name: &str, dir: &Path) -> Result<ImageInfo, ImageError> {
        let name = name::canonical(name)?;
        let (d, n) = (dir.to_path_buf(), name.clone());
        let layers = tokio::task::spawn_blocking(move || {
            crate::oci::layer_files(&d, crate::ArchiveFormat::Oci).map_err(|m| import_err(&n, m))
        })
        .await
        .map_err(|e| std::io::Error::other(format!("read OCI layout: {e}")))??;
        let work = TempPath::new(self.inner.tmp_path("oci"));
        fs::create_dir(work.path())?;
        let res = self
            .import_layer_files(&name, work.path(), layers, "oci".into(), None)
            .await;
        work.cleanup().await;
        res
    }

    /// Pulls `reference` (`host[:port]/repo[:tag|@sha256:..]`) from an OCI registry into the
    /// image `name` (one layer per image layer, whiteouts converted), reporting progress.
    pub async fn pull(
        &self,
        name: &str,
        reference: &str,
        opts: &PullOptions,
        progress: &ProgressFn,
    ) -> Result<ImageInfo, ImageError> {
        let name = name::canonical(name)?;
        let r = crate::registry::Reference::parse(reference).map_err(|m| import_err(&name, m))?;
        let work = TempPath::new(self.inner.tmp_path("pull"));
        fs::create_dir(work.path())?;
        let res = match crate::registry::download(&r, opts, work.path(), progress).await {
            Ok((files, digest)) => {
                let source = format!("registry {}/{}@{digest}", r.host, r.repo);
                self.import_layer_files(&name, work.path(), files, source, Some(progress))
                    .await
            }
            Err(m) => Err(import_err(&name, format!("pull {reference}: {m}"))),
        };
        work.cleanup().await;
        res
    }

    /// Folds every run of at least two consecutive layers smaller than `max_layer_bytes` into
    /// one layer with the same visible tree, and registers the result as `into` (default:
    /// `name` itself, whose old layers go once no image or sandbox uses them). An image with
    /// no such run is left as it is.
    pub async fn fold(
        &self,
        name: &str,
        max_layer_bytes: u64,
        into: Option<&str>,
    ) -> Result<ImageInfo, ImageError> {
        let name = name::canonical(name)?;
        let into = match into {
            Some(i) => name::canonical(i)?,
            None => name.clone(),
        };
        let rec = {
            let st = self.inner.lock();
            st.index
                .images
                .get(&name)
                .cloned()
                .ok_or_else(|| ImageError::NotFound(name.clone()))?
        };
        let sizes: Vec<u64> = rec.layers.iter().map(|l| l.size_bytes).collect();
        let runs = crate::fold::runs(&sizes, max_layer_bytes);
        if runs.is_empty() {
            if into != name {
                return self
                    .register(
                        &into,
                        rec.layers,
                        Vec::new(),
                        Some(name),
                        Some("fold".into()),
                    )
                    .await;
            }
            return self.get(&name);
        }
        // Mount the image's layers (a lease keeps them mounted while we read them).
        let lease = self.acquire(&name).await?;
        let mut parts = Vec::new();
        let mut next = 0;
        for (start, end) in runs {
            parts.extend(
                rec.layers[next..start]
                    .iter()
                    .cloned()
                    .map(LayerPart::Existing),
            );
            let work = TempPath::new(self.inner.tmp_path("fold"));
            let roots: Vec<PathBuf> = rec.layers[start..end]
                .iter()
                .map(|l| self.inner.mnt_path(&l.digest))
                .collect();
            let dst = work.path().to_path_buf();
            let n2 = into.clone();
            tokio::task::spawn_blocking(move || -> Result<(), ImageError> {
                fs::create_dir(&dst)?;
                crate::fold::merge_layers(&roots, &dst).map_err(|e| import_err(&n2, e.to_string()))
            })
            .await
            .map_err(|e| std::io::Error::other(format!("fold task: {e}")))??;
            let out = self.inner.tmp_path("layer").with_extension("erofs");
            let built =
                import::build_layer(&into, work.path(), out, &ImportOptions::default()).await;
            work.cleanup().await;
            let built = built?;
            tracing::info!(image = %name, from = start, to = end, digest = %built.digest, "layers folded");
            parts.push(LayerPart::Built(built));
            next = end;
        }
        parts.extend(rec.layers[next..].iter().cloned().map(LayerPart::Existing));
        drop(lease);
        let parent = if into == name {
            rec.parent.clone()
        } else {
            Some(name.clone())
        };
        let source = match &rec.source {
            Some(s) => format!("fold of {s}"),
            None => "fold".into(),
        };
        self.register_parts(&into, parts, parent, Some(source))
            .await
    }

    /// Unpacks each layer tar (bottom first) into its own directory, builds one EROFS layer
    /// per tar, and registers them as `name`.
    pub(crate) async fn import_layer_files(
        &self,
        name: &str,
        work: &Path,
        layers: Vec<PathBuf>,
        source: String,
        progress: Option<&ProgressFn>,
    ) -> Result<ImageInfo, ImageError> {
        if layers.is_empty() {
            return Err(import_err(name, "the image has no layers".into()));
        }
        let mut built = Vec::with_capacity(layers.len());
        for (i, tarfile) in layers.into_iter().enumerate() {
            if let Some(p) = progress {
                p(PullProgress::Build { layer: i + 1 });
            }
            let root = work.join(format!("layer-{i}"));
            let (r2, n2) = (root.clone(), name.to_string());
            tokio::task::spawn_blocking(move || -> Result<(), ImageError> {
                fs::create_dir(&r2)?;
                let f = fs::File::open(&tarfile)
                    .map_err(|e| import_err(&n2, format!("layer {}: {e}", tarfile.display())))?;
                import::unpack_tar(f, &r2)
                    .map_err(|m| import_err(&n2, format!("layer {}: {m}", i + 1)))
            })
            .await
            .map_err(|e| std::io::Error::other(format!("unpack layer: {e}")))??;
            let out = self.inner.tmp_path("layer").with_extension("erofs");
            let b = import::build_layer(name, &root, out, &ImportOptions::default()).await?;
            tracing::info!(image = name, layer = i + 1, digest = %b.digest, "layer built");
            built.push(b);
            let r3 = root.clone();
            let _ = tokio::task::spawn_blocking(move || fs::remove_dir_all(r3)).await;
        }
        self.register(name, Vec::new(), built, None, Some(source))
            .await
    }

    /// Imports the directory `dir` as a single-layer image `name`, replacing any image of the
    /// same name.
    pub async fn import_dir(&self, name: &str, dir: &Path) -> Result<ImageInfo, ImageError> {
        self.import_dir_with(name, dir, &ImportOptions::default())
            .await
    }

    /// [`ImageStore::import_dir`] with options.
    pub async fn import_dir_with(
        &self,
        name: &str,
        dir: &Path,
        opts: &ImportOptions,
    ) -> Result<ImageInfo, ImageError> {
        let name = name::canonical(name)?;
        match fs::metadata(dir) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(import_err(
                    &name,
                    format!("{} is not a directory", dir.display()),
                ))
            }
            Err(e) => return Err(import_err(&name, format!("{}: {e}", dir.display()))),
        }
        let out = self.inner.tmp_path("layer").with_extension("erofs");
        let built = import::build_layer(&name, dir, out, opts).await?;
        let source = opts.source.clone().unwrap_or_else(|| "dir".into());
        self.register(&name, Vec::new(), vec![built], None, Some(source))
            .await
    }

    /// Stores built layers (metadata image in `layers/` and in the blob store, data blob in
    /// the blob store) and points `name` at `base` + them (bottom first).
    pub(crate) async fn register(
        &self,
        name: &str,
        base: Vec<LayerRecord>,
        built: Vec<BuiltLayer>,
        parent: Option<String>,
        source: Option<String>,
    ) -> Result<ImageInfo, ImageError> {
        let mut parts: Vec<LayerPart> = base.into_iter().map(LayerPart::Existing).collect();
        parts.extend(built.into_iter().map(LayerPart::Built));
        self.register_parts(name, parts, parent, source).await
    }

    /// Stores the built parts and points `name` at `parts` (bottom first).
    pub(crate) async fn register_parts(
        &self,
        name: &str,
        parts: Vec<LayerPart>,
        parent: Option<String>,
        source: Option<String>,
    ) -> Result<ImageInfo, ImageError> {
        // Uploads first, off the executor and without the state lock (they may be slow on a
        // network store). Objects are content-addressed, so a concurrent import of the same
        // layer writes the same bytes.
        let inner = self.inner.clone();
        let (built, records) = tokio::task::spawn_blocking(move || {
            let mut records = Vec::with_capacity(parts.len());
            let mut built = Vec::new();
            for part in parts {
                let b = match part {
                    LayerPart::Existing(r) => {
                        records.push(r);
                        continue;
                    }
                    LayerPart::Built(b) => b,
                };
                if let Some(blob) = &b.blob {
                    inner.blobs.put(&blob_key(&b.digest), blob.path())?;
                }
                inner.blobs.put(&meta_key(&b.digest), b.file.path())?;
                records.push(LayerRecord {
                    digest: b.digest.clone(),
                    size_bytes: b.meta_bytes + b.blob_bytes,
                    meta_sha256: Some(b.meta_sha256.clone()),
                    meta_bytes: b.meta_bytes,
                    blob_bytes: b.blob_bytes,
                    blob_sample: b.blob_sample.clone(),
                });
                built.push(b);
            }
            Ok::<_, std::io::Error>((built, records))
        })
        .await
        .map_err(|e| std::io::Error::other(format!("store layers: {e}")))??;
        let mut st = self.inner.lock();
        for b in built {
            let dst = self.inner.layer_path(&b.digest);
            if dst.exists() {
                // Same content already stored; the temp files are dropped (and removed).
                tracing::debug!(digest = %b.digest, "layer already stored");
            } else {
                fs::rename(b.file.path(), &dst)?;
                b.file.keep();
            }
        }
        fs::File::open(self.inner.root.join("layers"))?.sync_all()?;
        let rec = ImageRecord {
            layers: records,
            created_at: time::now_rfc3339(),
            parent,
            source,
        };
        let old = st.index.images.insert(name.to_string(), rec.clone());
        if let Err(e) = st.index.save(&self.inner.root) {
            match old {
                Some(o) => st.index.images.insert(name.to_string(), o),
                None => st.index.images.remove(name),
            };
            for l in &rec.layers {
                let _ = self.inner.delete_layer_locked(&mut st, &l.digest);
            }
            return Err(e);
        }
        if let Some(old) = old {
            for l in &old.layers {
                if let Err(e) = self.inner.delete_layer_locked(&mut st, &l.digest) {
                    tracing::warn!(digest = %l.digest, error = %e, "delete replaced layer");
                }
            }
        }
        tracing::info!(
            image = name,
            layers = rec.layers.len(),
            bytes = rec.size_bytes(),
            "image imported"
        );
        Ok(Inner::info_locked(&st, name, &rec))
    }

    /// Builds a layer from `dir` (e.g. a sandbox's overlay upper dir, whose whiteouts and
    /// opaque-dir xattrs are already the layer format), leaving out `exclude` (paths relative
    /// to `dir`). Register it with [`ImageStore::register_derived`].
    pub async fn build_layer(
        &self,
        name: &str,
        dir: &Path,
        exclude: &[String],
    ) -> Result<BuiltLayer, ImageError> {
        let name = name::canonical(name)?;
        let out = self.inner.tmp_path("layer").with_extension("erofs");
        import::build_layer_excluding(&name, dir, out, &ImportOptions::default(), exclude).await
    }

    /// Registers `name` = the layers `parent_digests` (top-most first, as
    /// [`ImageLease::digests`] gives them) + `diff` on top.
    pub async fn register_derived(
        &self,
        name: &str,
        parent_digests: &[String],
        diff: BuiltLayer,
        parent: Option<String>,
        source: String,
    ) -> Result<ImageInfo, ImageError> {
        let name = name::canonical(name)?;
        let base = {
            let st = self.inner.lock();
            parent_digests
                .iter()
                .rev()
                .map(|d| {
                    st.index.layer(d).cloned().ok_or_else(|| ImageError::Import {
                        name: name.clone(),
                        message: format!(
                            "parent layer {d} is no longer registered (its image was replaced or removed)"
                        ),
                    })
                })
                .collect::<Result<Vec<_>, _>>()?
        };
        self.register(&name, base, vec![diff], parent, Some(source))
            .await
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

    /// Removes the image and every layer file no other image uses. Refuses while the image
    /// is leased.
    pub fn remove(&self, name: &str) -> Result<(), ImageError> {
        let name = name::canonical(name)?;
        let mut st = self.inner.lock();
        if let Some(&users) = st.leases.get(&name) {
            if users > 0 {
                return Err(ImageError::InUse { name, users });
            }
        }
        let rec = st
            .index
            .images
            .remove(&name)
            .ok_or_else(|| ImageError::NotFound(name.clone()))?;
        if let Err(e) = st.index.save(&self.inner.root) {
            st.index.images.insert(name, rec);
            return Err(e);
        }
        let mut first_err = None;
        for l in &rec.layers {
            if let Err(e) = self.inner.delete_layer_locked(&mut st, &l.digest) {
                tracing::warn!(digest = %l.digest, error = %e, "delete layer of removed image");
                first_err.get_or_insert(e);
            }
        }
        tracing::info!(image = %name, "image removed");
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }

    /// Takes a lease on the image, mounting any of its layers not mounted yet.
    pub async fn acquire(&self, name: &str) -> Result<ImageLease, ImageError> {
        self.acquire_composed(name, None, &[]).await
    }

    /// Takes a lease on a composition: the layers of `base`, then of `workspace`, then of each
    /// toolkit in order (each image's layers bottom first), so that the overlay lowers are
    /// `toolkits (last first) : workspace : base`. A layer present in several parts is used
    /// once, at its top-most position.
    pub async fn acquire_composed(
        &self,
        base: &str,
        workspace: Option<&str>,
        toolkits: &[String],
    ) -> Result<ImageLease, ImageError> {
        let mut names = vec![name::canonical(base)?];
        if let Some(w) = workspace {
            names.push(name::canonical(w)?);
        }
        for t in toolkits {
            names.push(name::canonical(t)?);
        }
        let (digests, locks) = {
            let mut st = self.inner.lock();
            let mut all: Vec<String> = Vec::new();
            for n in &names {
                let rec = st
                    .index
                    .images
                    .get(n)
                    .ok_or_else(|| ImageError::NotFound(n.clone()))?;
                all.extend(rec.layers.iter().map(|l| l.digest.clone()));
            }
            // Keep the top-most occurrence of each layer.
            let mut seen = std::collections::HashSet::new();
            let mut digests: Vec<String> = all
                .into_iter()
                .rev()
                .filter(|d| seen.insert(d.clone()))
                .collect();
            digests.reverse();
            for n in &names {
                *st.leases.entry(n.clone()).or_insert(0) += 1;
            }
            let mut locks = Vec::with_capacity(digests.len());
            for d in &digests {
                let l = st.layers.entry(d.clone()).or_insert_with(Layer::new);
                if l.refs == 0 {
                    // Cancels a pending grace-period unmount.
                    l.generation += 1;
                }
                l.refs += 1;
                locks.push(l.lock.clone());
            }
            (digests, locks)
        };
        // From here on, dropping the lease (error or cancellation) gives the references back.
        let lease = ImageLease {
            inner: self.inner.clone(),
            images: names,
            digests: digests.clone(),
            runtime: tokio::runtime::Handle::try_current().ok(),
        };
        for (d, lock) in digests.into_iter().zip(locks) {
            let _guard = lock.lock().await;
            let mounted = self.inner.lock().layers.get(&d).is_some_and(|l| l.mounted);
            if mounted {
                continue;
            }
            let inner = self.inner.clone();
            let digest = d.clone();
            tokio::task::spawn_blocking(move || inner.mount_layer(&digest))
                .await
                .map_err(|e| ImageError::Mount {
                    digest: d.clone(),
                    source: std::io::Error::other(e.to_string()),
                })?
                .map_err(|source| ImageError::Mount { digest: d, source })?;
        }
        Ok(lease)
    }

    /// Unmounts every layer this store mounted (detached, so busy mounts go too). For
    /// shutdown; leases still alive keep working until their overlays are gone.
    pub fn unmount_all(&self) -> Result<(), ImageError> {
        let mut st = self.inner.lock();
        let mut first_err = None;
        for (digest, l) in st.layers.iter_mut() {
            if !l.mounted {
                continue;
            }
            let target = self.inner.mnt_path(digest);
            match mount::unmount_detach(&target) {
                Ok(()) => {
                    l.mounted = false;
                    let _ = fs::remove_dir(&target);
                }
                Err(e) => {
                    tracing::warn!(digest = %digest, error = %e, "unmount layer");
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}

impl Inner {
    /// Mounts a layer (per-layer lock held by the caller) and records it as mounted. A mount
    /// left at the same place by an earlier process is adopted rather than stacked.
    fn mount_layer(&self, digest: &str) -> std::io::Result<()> {
        let file = self.layer_path(digest);
        let target = self.mnt_path(digest);
        let rec = self.lock().index.layer(digest).cloned();
        if mount::mount_count(&target)? == 0 {
            let device = match &rec {
                Some(rec) => self.verify_layer(rec)?,
                None => None,
            };
            if !file.exists() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!(
                        "layer file {} is missing; re-import the image",
                        file.display()
                    ),
                ));
            }
            mount::mount_erofs_with(&file, &target, device.as_deref())?;
            self.stats.layer_mounts.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(digest, blob = ?device, "layer mounted");
        }
        let mut st = self.lock();
        match st.layers.get_mut(digest) {
            Some(l) => l.mounted = true,
            None => {
                // Cannot happen (our lease holds a reference), but never leak a mount.
                drop(st);
                mount::unmount(&target)?;
            }
        }
        Ok(())
    }
}

impl Inner {
    /// Before the first mount of a layer on this node: fetches its metadata image from the
    /// blob store if it is not on local disk, checks the metadata image's sha256, and checks
    /// the data blob's size and the digest of its first and last 64 KiB. Returns the blob's
    /// path for `device=`. A layer that fails is reported, never mounted: a truncated or
    /// replaced blob cannot leave a sandbox hanging on reads of missing blocks.
    fn verify_layer(&self, rec: &LayerRecord) -> std::io::Result<Option<PathBuf>> {
        use std::io::{Error, ErrorKind};
        let digest = &rec.digest;
        let file = self.layer_path(digest);
        if !file.exists() {
            let tmp = self.tmp_path("meta");
            match self.blobs.fetch(&meta_key(digest), &tmp) {
                Ok(n) => {
                    self.stats.meta_fetches.fetch_add(1, Ordering::Relaxed);
                    self.stats.meta_fetch_bytes.fetch_add(n, Ordering::Relaxed);
                    fs::rename(&tmp, &file)?
                }
                Err(e) => {
                    let _ = fs::remove_file(&tmp);
                    return Err(Error::new(
                        e.kind(),
                        format!(
                            "layer {digest}: metadata image is neither on local disk nor in the blob store {} ({e}); re-import the image",
                            self.blobs.describe()
                        ),
                    ));
                }
            }
        }
        if let Some(want) = &rec.meta_sha256 {
            let (got, _) = import::sha256_file(&file)?;
            if &got != want {
                return Err(Error::new(
                    ErrorKind::InvalidData,
                    format!(
                        "layer {digest}: metadata image {} is corrupt (sha256 {got}, expected {want}); remove and re-import the image",
                        file.display()
                    ),
                ));
            }
        }
        if rec.blob_bytes == 0 {
            return Ok(None);
        }
        let key = blob_key(digest);
        let corrupt = |what: String| {
            Error::new(
                ErrorKind::InvalidData,
                format!(
                    "layer {digest}: data blob {key} in {} is {what}; restore it or re-import the image",
                    self.blobs.describe()
                ),
            )
        };
        match self.blobs.size(&key)? {
            None => return Err(corrupt("missing".into())),
            Some(n) if n != rec.blob_bytes => {
                return Err(corrupt(format!(
                    "truncated or wrong ({n} bytes, expected {})",
                    rec.blob_bytes
                )))
            }
            Some(_) => {}
        }
        self.stats
            .blob_verifications
            .fetch_add(1, Ordering::Relaxed);
        if let Some(want) = &rec.blob_sample {
            let mut reader = StoreReader {
                store: self.blobs.as_ref(),
                key: &key,
            };
            let got = import::sample_digest(&mut reader, rec.blob_bytes)?;
            if &got != want {
                return Err(corrupt(
                    "corrupt (its first/last 64 KiB do not match)".into(),
                ));
            }
        }
        Ok(Some(self.blobs.mount_source(&key)?))
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

fn import_err(name: &str, message: String) -> ImageError {
    ImageError::Import {
        name: name.to_string(),
        message,
    }
}

struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// The blocking side of the import pump: reads chunks from the channel.
struct ChannelReader {
    rx: tokio::sync::mpsc::Receiver<std::io::Result<Vec<u8>>>,
    chunk: Vec<u8>,
    pos: usize,
    cancelled: Arc<AtomicBool>,
}

impl std::io::Read for ChannelReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.pos >= self.chunk.len() {
            if self.cancelled.load(Ordering::SeqCst) {
                return Err(std::io::Error::other("import cancelled"));
            }
            match self.rx.blocking_recv() {
                Some(Ok(c)) => {
                    self.chunk = c;
                    self.pos = 0;
                }
                Some(Err(e)) => return Err(e),
                None if self.cancelled.load(Ordering::SeqCst) => {
                    return Err(std::io::Error::other("import cancelled"))
                }
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.chunk.len() - self.pos);
        buf[..n].copy_from_slice(&self.chunk[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}
