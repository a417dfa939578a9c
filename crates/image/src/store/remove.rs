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
}

impl Inner {
    /// Deletes a layer nobody references any more (state lock held): unmount, file, state.
    pub(super) fn delete_layer_locked(&self, st: &mut State, digest: &str) -> std::io::Result<()> {
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
}
