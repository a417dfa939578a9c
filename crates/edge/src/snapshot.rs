//! Container snapshots: `POST /edge/v1/sandboxes/{id}/snapshot`.
//!
//! A snapshot is a [`crate::pack`] diff under a generated name: the sandbox is frozen while
//! its writable layer is packed into an EROFS layer, the image `<snapshot id>` = the sandbox's
//! layers + that layer is registered in the image store (whose reference counting keeps every
//! layer a snapshot or a sandbox uses; the layer's data blob goes to the node's blob store),
//! and the sandbox is thawed and goes on. With a blob store the nodes share (`posix:`, `s3:`)
//! the image is then published there (`dsec_image` `store::publish`), so that any edge can start
//! from it (`shared` in the answer). The answer names the trajectory step the snapshot was
//! taken at; the sandbox's trajectory gets a `snapshot` record.

use std::time::Instant;

use dsec_wire::api::{ImageInfo, PackDiffRequest, SnapshotInfo, SnapshotRequest};

use crate::error::EdgeError;

/// The snapshot's image name: `req.name`, else `snapshot/<sandbox id>-<epoch ms>`.
pub fn name_for(id: &str, req: &SnapshotRequest, now_ms: u64) -> String {
    req.name
        .clone()
        .unwrap_or_else(|| format!("snapshot/{id}-{now_ms}"))
}

/// Refuses what a container snapshot cannot do.
pub fn check(req: &SnapshotRequest) -> Result<(), EdgeError> {
    if req.memory {
        return Err(EdgeError::Unsupported(
            "memory snapshots (memory=true) are not available yet; a snapshot holds the \
             sandbox's files (memory=false)"
                .into(),
        ));
    }
    Ok(())
}

/// What the pack request for a snapshot is.
pub fn pack_request(name: &str) -> PackDiffRequest {
    PackDiffRequest {
        name: name.to_string(),
        exclude: Vec::new(),
    }
}

/// The answer, from what the pack made.
pub fn info(
    id: &str,
    node: &str,
    step: Option<u64>,
    image: ImageInfo,
    started: Instant,
    shared: bool,
) -> SnapshotInfo {
    SnapshotInfo {
        id: image.name.clone(),
        sandbox: id.to_string(),
        node: node.to_string(),
        step,
        image,
        snapshot_ms: started.elapsed().as_secs_f64() * 1000.0,
        shared,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_memory() {
        let r = SnapshotRequest::default();
        assert_eq!(
            name_for("sb-n0-0000000000000001", &r, 7),
            "snapshot/sb-n0-0000000000000001-7"
        );
        assert!(dsec_image::canonical_name(&name_for("sb-n0-0000000000000001", &r, 7)).is_ok());
        let named = SnapshotRequest {
            name: Some("mine:v1".into()),
            memory: false,
        };
        assert_eq!(name_for("x", &named, 1), "mine:v1");
        assert!(check(&named).is_ok());
        assert!(matches!(
            check(&SnapshotRequest {
                name: None,
                memory: true
            }),
            Err(EdgeError::Unsupported(_))
        ));
    }
}
