//! Images any node can start from: a manifest in the blob store, adopted lazily.
//!
//! An image's layers are already in the blob store (data blobs and the authoritative copy of
//! each metadata image); what is node-local is the index entry naming them. [`publish`] puts
//! that entry (the image's [`ImageRecord`]) into the blob store as the object
//! `<sha256 of the name>.image`, so that an edge sharing the blob store (`posix:` or `s3:`)
//! which is asked to start the image and does not have it registers it from the manifest
//! ([`ImageStore::adopt_published`], called by a lease on a name the index lacks); the
//! metadata images are then fetched at first mount, as for any layer not on local disk.
//!
//! An adopted image's layers are marked [`LayerRecord::foreign`] (and stay so in images derived
//! from it here): deleting them deletes this node's copies (local metadata image, mounts) but
//! never the blob store's objects, which the publishing node owns; removing the image there deletes its manifest and the objects no
//! image of that node uses (a sandbox elsewhere that still runs on them keeps its open files).
//!
//! [`publish`]: ImageStore::publish

use dsec_wire::api::ImageInfo;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{meta_key, ImageStore, Inner};
use crate::index::ImageRecord;
#[cfg(doc)]
use crate::index::LayerRecord;
use crate::{name, ImageError};

/// The blob store object holding the manifest of image `name` (canonical).
pub(crate) fn manifest_key(name: &str) -> String {
    format!("{}.image", hex::encode(Sha256::digest(name.as_bytes())))
}

/// What [`ImageStore::publish`] writes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Manifest {
    /// The image's canonical name (checked on adoption: the key is only its hash).
    name: String,
    record: ImageRecord,
}

impl ImageStore {
    /// Whether the blob store is one other nodes can share (anything but the default
    /// node-private directory): only then is publishing an image useful.
    pub fn shares_blobs(&self) -> bool {
        self.inner.shared
    }

    /// Puts image `name`'s index entry into the blob store, so that any node sharing the blob
    /// store can start it (see the module docs). Replaces an earlier manifest of that name.
    pub async fn publish(&self, name: &str) -> Result<(), ImageError> {
        let name = name::canonical(name)?;
        let mut record = {
            let st = self.inner.lock();
            st.index
                .images
                .get(&name)
                .cloned()
                .ok_or_else(|| ImageError::NotFound(name.clone()))?
        };
        for l in &mut record.layers {
            l.foreign = false;
        }
        let manifest = Manifest {
            name: name.clone(),
            record,
        };
        let bytes = serde_json::to_vec(&manifest).map_err(std::io::Error::other)?;
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || {
            let tmp = inner.tmp_path("manifest");
            std::fs::write(&tmp, &bytes)?;
            let key = manifest_key(&manifest.name);
            // Objects are immutable once put: a republished name replaces the old object.
            let res = inner
                .blobs
                .remove(&key)
                .and_then(|()| inner.blobs.put(&key, &tmp));
            let _ = std::fs::remove_file(&tmp);
            res
        })
        .await
        .map_err(|e| std::io::Error::other(format!("publish task: {e}")))??;
        tracing::info!(image = %name, store = %self.inner.blobs.describe(), "image published");
        Ok(())
    }

    /// Registers image `name` from its manifest in the blob store, if it is not in the index
    /// and the blob store holds one; returns the image then, `None` when there is no manifest.
    /// The layers' metadata images must be in the blob store (they are fetched at first mount).
    pub async fn adopt_published(&self, name: &str) -> Result<Option<ImageInfo>, ImageError> {
        let name = name::canonical(name)?;
        if !self.inner.shared {
            return Ok(None);
        }
        if let Ok(info) = self.get(&name) {
            return Ok(Some(info));
        }
        let inner = self.inner.clone();
        let want = name.clone();
        let found = tokio::task::spawn_blocking(move || read_manifest(&inner, &want))
            .await
            .map_err(|e| std::io::Error::other(format!("adopt task: {e}")))??;
        let Some(mut record) = found else {
            return Ok(None);
        };
        for l in &mut record.layers {
            l.foreign = true;
        }
        record.source = Some(format!(
            "adopted from the blob store {} ({})",
            self.inner.blobs.describe(),
            record.source.as_deref().unwrap_or("published")
        ));
        let mut st = self.inner.lock();
        if let Some(rec) = st.index.images.get(&name) {
            // Registered meanwhile (a concurrent create of the same image).
            return Ok(Some(Inner::info_locked(&st, &name, rec)));
        }
        st.index.images.insert(name.clone(), record.clone());
        if let Err(e) = st.index.save(&self.inner.root) {
            st.index.images.remove(&name);
            return Err(e);
        }
        tracing::info!(image = %name, layers = record.layers.len(), "image adopted from the blob store");
        Ok(Some(Inner::info_locked(&st, &name, &record)))
    }
}

/// The manifest of `name`, checked: its name matches, it has layers with well-formed digests
/// and every layer's metadata image is in the blob store.
fn read_manifest(inner: &Inner, name: &str) -> Result<Option<ImageRecord>, ImageError> {
    let key = manifest_key(name);
    let Some(size) = inner.blobs.size(&key)? else {
        return Ok(None);
    };
    let corrupt = |message: String| ImageError::Corrupt {
        path: std::path::PathBuf::from(format!("{}/{key}", inner.blobs.describe())),
        message,
    };
    if size > 16 << 20 {
        return Err(corrupt(format!("manifest of {name} is {size} bytes")));
    }
    let mut buf = vec![0u8; size as usize];
    let n = inner.blobs.read_at(&key, 0, &mut buf)?;
    buf.truncate(n);
    let m: Manifest =
        serde_json::from_slice(&buf).map_err(|e| corrupt(format!("manifest of {name}: {e}")))?;
    if m.name != name {
        return Err(corrupt(format!(
            "manifest names {:?}, expected {name:?}",
            m.name
        )));
    }
    if m.record.layers.is_empty() || m.record.layers.iter().any(|l| !name::is_digest(&l.digest)) {
        return Err(corrupt(format!(
            "manifest of {name} has no or malformed layers"
        )));
    }
    for l in &m.record.layers {
        if inner.blobs.size(&meta_key(&l.digest))?.is_none() {
            return Err(ImageError::Import {
                name: name.to_string(),
                message: format!(
                    "layer {} of the published image is no longer in the blob store {}; the image was removed on the node that published it",
                    l.digest,
                    inner.blobs.describe()
                ),
            });
        }
    }
    Ok(Some(m.record))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_keys_are_blob_keys() {
        let k = manifest_key("snapshot/sb-n0-0000000000000001-7");
        assert!(crate::blobstore::check_key(&k).is_ok(), "{k}");
        assert_ne!(k, manifest_key("snapshot/other"));
    }
}
