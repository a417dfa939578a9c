//! Removing an image and deleting the layers nothing references any more.

use std::fs;

use super::{blob_key, meta_key, ImageStore, Inner, State};
use crate::{name, ImageError};

impl ImageStore {
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
        // This node's manifest (an adopted image's top layer is foreign: not ours to remove).
        let published_here = rec.layers.last().is_some_and(|l| !l.foreign);
        if published_here && self.inner.shared {
            if let Err(e) = self
                .inner
                .blobs
                .remove(&super::publish::manifest_key(&name))
            {
                tracing::warn!(image = %name, error = %e, "remove the image's manifest");
            }
        }
        for l in &rec.layers {
            if let Err(e) = self
                .inner
                .delete_layer_locked(&mut st, &l.digest, l.foreign)
            {
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
}

impl Inner {
    /// Deletes a layer nobody references any more (state lock held): unmount, file, state,
    /// and its blob store objects unless `foreign` (another node's, see `publish`).
    pub(super) fn delete_layer_locked(
        &self,
        st: &mut State,
        digest: &str,
        foreign: bool,
    ) -> std::io::Result<()> {
        if st.index.references(digest, None) {
            return Ok(());
        }
        if st.layers.get(digest).is_some_and(|l| l.refs > 0) {
            if foreign {
                // Deleted when its last user lets go (`unmount_if_idle`): remember whose it is.
                st.foreign.insert(digest.to_string());
            }
            return Ok(());
        }
        st.foreign.remove(digest);
        self.unmount_layer_locked(st, digest)?;
        st.layers.remove(digest);
        match fs::remove_file(self.layer_path(digest)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        if foreign {
            tracing::debug!(
                digest,
                "foreign layer deleted here (its blob store objects stay)"
            );
            return Ok(());
        }
        self.blobs.remove(&blob_key(digest))?;
        self.blobs.remove(&meta_key(digest))?;
        tracing::debug!(digest, "layer deleted");
        Ok(())
    }
}
