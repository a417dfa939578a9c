//! How images enter the store: tar/OCI/dir imports, registry pulls, folds and registration of layers.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use dsec_wire::api::ImageInfo;

use super::{blob_key, import_err, meta_key, ImageStore, Inner, LayerPart};
use crate::import::{self, BuiltLayer, ImportOptions, TempPath};
use crate::index::{ImageRecord, LayerRecord};
use crate::registry::{ProgressFn, PullOptions, PullProgress};
use crate::{name, time, ImageError};

impl ImageStore {
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
            return Err(import_err(name, "the image has no layers"));
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
                    foreign: false,
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
                let _ = self
                    .inner
                    .delete_layer_locked(&mut st, &l.digest, l.foreign);
            }
            return Err(e);
        }
        if let Some(old) = old {
            for l in &old.layers {
                if let Err(e) = self
                    .inner
                    .delete_layer_locked(&mut st, &l.digest, l.foreign)
                {
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
