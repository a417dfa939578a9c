//! The node's image store as the API offers it, and pack_diff.

use std::sync::Arc;

use dsec_image::ImageStore;
use dsec_wire::api::{ImageInfo, ImageList};

use crate::error::EdgeError;

use super::{lock, Manager};

impl Manager {
    pub async fn import_image<R>(&self, name: &str, reader: R) -> Result<ImageInfo, EdgeError>
    where
        R: tokio::io::AsyncRead + Send + Unpin + 'static,
    {
        let name = dsec_image::canonical_name(name).map_err(EdgeError::Image)?;
        self.images
            .import_tar(&name, reader)
            .await
            .map_err(EdgeError::Image)
    }

    /// `pack_diff`: the sandbox's writable layer becomes image `req.name` = its layers + diff.
    pub async fn pack_diff(
        &self,
        id: &str,
        req: dsec_wire::api::PackDiffRequest,
    ) -> Result<ImageInfo, EdgeError> {
        let entry = self.running(id)?;
        let kind = lock(&entry.info).substrate;
        if !self
            .substrates
            .capabilities(kind)
            .is_some_and(|c| c.pack_diff)
        {
            return Err(EdgeError::Unsupported(format!(
                "sandbox {id}: pack_diff is not supported for {} sandboxes (their disk is not a layer of the image store)",
                self.substrates.label(kind)
            )));
        }
        let (parent_images, parent_digests) = lock(&entry.lease)
            .as_ref()
            .map(|l| (l.images().to_vec(), l.digests()))
            .ok_or_else(|| EdgeError::Conflict(format!("sandbox {id} holds no image")))?;
        crate::pack::pack_diff(
            &self.images,
            id,
            &entry.dir,
            entry.sandbox.as_ref(),
            &parent_images,
            &parent_digests,
            &req,
        )
        .await
    }

    /// Snapshots a container's files into an image (see [`crate::snapshot`]).
    pub async fn snapshot(
        &self,
        id: &str,
        req: dsec_wire::api::SnapshotRequest,
    ) -> Result<dsec_wire::api::SnapshotInfo, EdgeError> {
        crate::snapshot::check(&req)?;
        let started = std::time::Instant::now();
        let name = crate::snapshot::name_for(id, &req, dsec_node::now_ms());
        let step = self
            .traj
            .last_step(id)
            .ok()
            .and_then(|l| l.last_completed_step);
        let request = serde_json::to_value(&req).unwrap_or_default();
        let made = match self
            .pack_diff(id, crate::snapshot::pack_request(&name))
            .await
        {
            Ok(image) => {
                let shared = self.images.shares_blobs();
                // Published so that any edge sharing the blob store can start from it; a
                // snapshot that cannot be is removed (no half-made snapshot).
                let published = if shared {
                    self.images.publish(&image.name).await.inspect_err(|_| {
                        let _ = self.images.remove(&image.name);
                    })
                } else {
                    Ok(())
                };
                published.map_err(EdgeError::Image).map(|()| {
                    crate::snapshot::info(id, &self.cfg.node_id, step, image, started, shared)
                })
            }
            Err(e) => Err(e),
        };
        let result = made.as_ref().map(
            |s| serde_json::json!({ "id": s.id, "step": s.step, "snapshot_ms": s.snapshot_ms }),
        );
        self.traj.note(id, "snapshot", request, result);
        made
    }

    /// The node's image store.
    pub fn image_store(&self) -> &Arc<ImageStore> {
        &self.images
    }

    pub fn list_images(&self) -> ImageList {
        ImageList {
            images: self.images.list(),
        }
    }

    pub fn remove_image(&self, name: &str) -> Result<(), EdgeError> {
        let name = dsec_image::canonical_name(name).map_err(EdgeError::Image)?;
        self.images.remove(&name).map_err(EdgeError::Image)?;
        // Layer files may be gone: what substrates keep per layer file (the microVM's
        // virtio-pmem copies) too, in the background — now, and twice more: a copy still named
        // by a VM being torn down (its files not yet removed) survives the first sweep.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            for s in self.substrates.available() {
                let s = s.clone();
                rt.spawn(async move {
                    for delay_s in [0, 3, 10] {
                        tokio::time::sleep(std::time::Duration::from_secs(delay_s)).await;
                        s.images_removed().await;
                    }
                });
            }
        }
        Ok(())
    }
}
