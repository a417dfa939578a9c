//! `pack_diff`: a running sandbox's writable layer becomes a new image layer.
//!
//! The sandbox is frozen (cgroup freezer, without memory reclaim) only while `mkfs.erofs`
//! reads its upper dir, then thawed; a sandbox that was already paused stays paused. The upper
//! dir is taken as it is: overlayfs whiteouts (char 0:0) and opaque-dir xattrs are exactly the
//! layer format the image store stacks, and `mkfs.erofs` keeps modes, owners, xattrs,
//! symlinks and hard links. Excluded paths (with everything below them) are left out of the
//! diff. The new image is the sandbox's layers (toolkits, workspace, base) + the diff, so
//! diffs of diffs chain.

use std::path::{Component, Path};
use std::time::Instant;

use dsec_image::ImageStore;
use dsec_wire::api::{ImageInfo, PackDiffRequest};

use crate::error::EdgeError;
use dsec_runtime::substrate::LiveSandbox;

/// Most paths one request may exclude.
pub const MAX_EXCLUDES: usize = 256;

/// Turns `/a/b/` into `a/b`; refuses relative paths, `..`, the root and NUL bytes.
pub fn exclude_rel(p: &str) -> Result<String, EdgeError> {
    let bad = |why: &str| {
        EdgeError::BadRequest(format!(
            "exclude path {p:?} {why}: give absolute paths inside the sandbox such as /root/.cache"
        ))
    };
    if p.contains('\0') || p.len() > 4096 {
        return Err(bad("is malformed"));
    }
    let path = Path::new(p);
    if !path.is_absolute() {
        return Err(bad("is not absolute"));
    }
    let mut parts = Vec::new();
    for c in path.components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(n) => parts.push(n.to_string_lossy().into_owned()),
            _ => return Err(bad("contains `..`")),
        }
    }
    if parts.is_empty() {
        return Err(bad("is the root"));
    }
    Ok(parts.join("/"))
}

/// Packs `sandbox`'s upper dir (`<dir>/upper`) into image `req.name` = `parent_digests`
/// (top-most first) + the diff.
pub async fn pack_diff(
    images: &ImageStore,
    id: &str,
    dir: &Path,
    sandbox: &dyn LiveSandbox,
    parent_images: &[String],
    parent_digests: &[String],
    req: &PackDiffRequest,
) -> Result<ImageInfo, EdgeError> {
    let name = dsec_image::canonical_name(&req.name).map_err(EdgeError::Image)?;
    if req.exclude.len() > MAX_EXCLUDES {
        return Err(EdgeError::BadRequest(format!(
            "at most {MAX_EXCLUDES} exclude paths"
        )));
    }
    let exclude = req
        .exclude
        .iter()
        .map(|p| exclude_rel(p))
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    // A VM's writable layer is a disk image: the substrate exposes it (read-only, guest held).
    if let Some(layer) =
        sandbox
            .writable_layer()
            .await
            .map_err(|source| EdgeError::WritableLayer {
                context: "expose the writable layer",
                sandbox: id.to_string(),
                source,
            })?
    {
        let built = images.build_layer(&name, &layer.upper, &exclude).await;
        if let Err(e) = (layer.release)().await {
            tracing::error!(sandbox = %id, error = %e, "release the writable layer after pack_diff");
            return Err(EdgeError::WritableLayer {
                context: "release after pack_diff the writable layer",
                sandbox: id.to_string(),
                source: e,
            });
        }
        let built = built.map_err(EdgeError::Image)?;
        let parent = parent_images.first().cloned();
        let source = format!("pack_diff {id} of {}", parent_images.join("+"));
        let info = images
            .register_derived(&name, parent_digests, built, parent, source)
            .await
            .map_err(EdgeError::Image)?;
        tracing::info!(sandbox = %id, image = %info.name, held_ms = started.elapsed().as_secs_f64() * 1000.0, "pack_diff (disk image)");
        return Ok(info);
    }
    let upper = dir.join("upper");
    let was_paused = sandbox.is_paused();
    if !was_paused {
        sandbox
            .pause(false)
            .await
            .map_err(|source| EdgeError::Pause {
                op: "freeze sandbox for pack_diff",
                source,
            })?;
    }
    let built = images.build_layer(&name, &upper, &exclude).await;
    if !was_paused {
        if let Err(e) = sandbox.resume().await {
            tracing::error!(sandbox = %id, error = %e, "thaw after pack_diff");
            return Err(EdgeError::Pause {
                op: "thaw sandbox after pack_diff",
                source: e,
            });
        }
    }
    let frozen_ms = started.elapsed().as_secs_f64() * 1000.0;
    let built = built.map_err(EdgeError::Image)?;
    let parent = parent_images.first().cloned();
    let source = format!("pack_diff {id} of {}", parent_images.join("+"));
    let info = images
        .register_derived(&name, parent_digests, built, parent, source)
        .await
        .map_err(EdgeError::Image)?;
    tracing::info!(sandbox = %id, image = %info.name, frozen_ms, layers = info.layers.len(), "pack_diff");
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exclude_paths() {
        assert_eq!(exclude_rel("/root/.cache/").unwrap(), "root/.cache");
        assert_eq!(exclude_rel("/a/./b").unwrap(), "a/b");
        for bad in ["relative", "/", "/a/../b", "", "/a\0b"] {
            assert!(exclude_rel(bad).is_err(), "{bad:?}");
        }
    }
}
