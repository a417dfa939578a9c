//! Snapshots and fork (issue 17).
//!
//! A container snapshot is the sandbox's filesystem at one moment: its writable layer, taken
//! while the sandbox is frozen (so it is consistent), becomes an EROFS layer on top of the
//! sandbox's layers and is registered in the image store under the snapshot id, an image name
//! (`snapshot/<sandbox id>-<ms>` unless named). It is listed, deleted and garbage-collected with
//! the images, and a create names it as its image. A sandbox started from it starts new
//! processes on those files: processes, shells and memory are not part of a container snapshot.
//! Fork is a snapshot taken once and N creates from it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{ErrorDetail, ImageInfo, SandboxInfo};

/// Body of `POST /v1/sandboxes/{id}/snapshot`.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    /// Image name for the snapshot (default `snapshot/<sandbox id>-<epoch ms>`).
    #[serde(default)]
    pub name: Option<String>,
    /// Also guest memory and device state (microVMs only; not available yet: 501).
    #[serde(default)]
    pub memory: bool,
}

/// Answer of `POST /v1/sandboxes/{id}/snapshot`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SnapshotInfo {
    /// The snapshot id: an image name a create can start from.
    pub id: String,
    /// The sandbox it was taken of.
    pub sandbox: String,
    pub node: String,
    /// The highest completed trajectory step of the sandbox when it was taken.
    #[serde(default)]
    pub step: Option<u64>,
    /// The image registered for it (the sandbox's layers + the diff).
    pub image: ImageInfo,
    /// Wall time of the snapshot (freeze, pack, register, thaw), ms.
    pub snapshot_ms: f64,
    /// Published in a blob store the nodes share (`posix:`, `s3:`): any node can start from it,
    /// so a fork's children are placed across nodes. False: only `node` can.
    #[serde(default)]
    pub shared: bool,
}

/// Most children one fork makes.
pub const MAX_FORK: u32 = 100;

/// Body of `POST /v1/sandboxes/{id}/fork`.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// How many children (1..=100).
    pub n: u32,
    /// Labels of every child (besides `dsec.fork_of` and `dsec.fork_step`, set by the platform).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Name of the snapshot taken for the fork (default as for a snapshot).
    #[serde(default)]
    pub snapshot_name: Option<String>,
}

/// One child a fork could not make (nothing of it is left behind).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ForkFailure {
    /// Which child (0-based).
    pub index: u32,
    pub error: ErrorDetail,
}

/// Answer of `POST /v1/sandboxes/{id}/fork`: 201 when every child exists, 207 when some do.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ForkResult {
    pub snapshot: SnapshotInfo,
    /// The children that exist, by index order.
    pub children: Vec<SandboxInfo>,
    /// The children that could not be made.
    #[serde(default)]
    pub failed: Vec<ForkFailure>,
    pub duration_ms: f64,
}
