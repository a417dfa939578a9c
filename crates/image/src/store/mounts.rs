//! Node-wide layer mounts: mounting a cold layer once, unmounting idle layers after the grace.

use std::fs;
use std::sync::atomic::Ordering;

use super::{Inner, State};
use crate::mount;

impl Inner {
    /// Called by the grace timer: unmounts `digest` if nobody re-acquired it since.
    pub(super) fn unmount_if_idle(&self, digest: &str, generation: u64) -> std::io::Result<()> {
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
            let foreign = st.foreign.contains(digest);
            self.delete_layer_locked(&mut st, digest, foreign)?;
        } else {
            st.layers.remove(digest);
        }
        Ok(())
    }

    /// Unmounts a layer (state lock held, refs must be zero) and removes its mount point.
    pub(super) fn unmount_layer_locked(&self, st: &mut State, digest: &str) -> std::io::Result<()> {
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
}

impl Inner {
    /// Mounts a layer (per-layer lock held by the caller) and records it as mounted. A mount
    /// left at the same place by an earlier process is adopted rather than stacked.
    pub(super) fn mount_layer(&self, digest: &str) -> std::io::Result<()> {
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
