//! Leases: acquiring an image (or a composition) mounts its layers and holds them until dropped.

use std::fmt;
use std::fs;
use std::path::PathBuf;
use std::sync::Arc;

use super::{ImageStore, Inner, Layer};
use crate::{mount, name, ImageError};

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

impl ImageStore {
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
        // An image another node published in the shared blob store is registered here first.
        for n in &names {
            if self.inner.shared && !self.inner.lock().index.images.contains_key(n) {
                self.adopt_published(n).await?;
            }
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
        drop(st);
        self.inner.blobs.shutdown();
        match first_err {
            Some(e) => Err(e.into()),
            None => Ok(()),
        }
    }
}
