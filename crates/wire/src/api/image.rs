//! Images: layers, image info, image actions (build, fold, pack-diff) and their events.

use serde::{Deserialize, Serialize};

use super::ErrorDetail;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImageLayerInfo {
    pub digest: String,
    pub size_bytes: u64,
    /// Size of the layer's EROFS metadata image (kept on the node's local disk).
    #[serde(default)]
    pub meta_bytes: u64,
    /// Size of the layer's data blob (kept in the blob store, read on demand).
    #[serde(default)]
    pub blob_bytes: u64,
    /// Sandboxes on this node whose root uses this layer.
    #[serde(default)]
    pub users: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImageInfo {
    /// `name:tag`.
    pub name: String,
    pub layers: Vec<ImageLayerInfo>,
    pub size_bytes: u64,
    pub created_at: String,
    /// Sandboxes on this node currently using the image.
    #[serde(default)]
    pub in_use: u64,
    /// The image this one was derived from (`pack_diff`: parent layers + diff).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Where the image came from (`dir`, `tar`, `docker-archive`, `oci`, `registry REF`,
    /// `pack_diff SANDBOX`, `fold`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// Body of `POST /v1/sandboxes/{id}/pack_diff`: turn the sandbox's writable layer into a new
/// layer and register `name` = the sandbox's layers + that diff.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PackDiffRequest {
    /// Name of the new image (`name` or `name:tag`).
    pub name: String,
    /// Paths (absolute, inside the sandbox) left out of the diff, with everything below them.
    #[serde(default)]
    pub exclude: Vec<String>,
}

/// Body of `POST /v1/images/{name}`: an operation on the image store.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "action", rename_all = "snake_case", deny_unknown_fields)]
pub enum ImageActionRequest {
    /// Merge consecutive layers of the image smaller than `max_layer_bytes` into one layer.
    Fold {
        #[serde(default)]
        max_layer_bytes: Option<u64>,
        /// Register the folded image under this name instead of replacing `name`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        into: Option<String>,
    },
    /// Register `name` as a second name for the layers of the image `target` (an alias; E2B
    /// template names map onto dsec images this way).
    Alias { target: String },
    /// Pull `reference` (`host[:port]/repo[:tag]`) from an OCI registry into the image `name`.
    Pull {
        reference: String,
        /// Use plain HTTP instead of HTTPS.
        #[serde(default)]
        insecure: bool,
        #[serde(default)]
        username: Option<String>,
        #[serde(default)]
        password: Option<String>,
        /// PEM CA certificate(s) to trust for the registry's TLS, besides the system's roots
        /// (the CLI's `--ca-file`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ca_pem: Option<String>,
    },
}

/// One line of the `application/x-ndjson` answer to `POST /v1/images/{name}` when the
/// request says `accept: application/x-ndjson` (progress of a pull); the last line is `done`
/// or `error`. Without that header the answer is a plain 201 [`ImageInfo`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ImageActionEvent {
    /// The manifest was resolved.
    Manifest {
        digest: String,
        layers: u64,
        bytes: u64,
    },
    /// Bytes of layer `layer` (1-based) downloaded so far.
    Download {
        layer: u64,
        digest: String,
        done: u64,
        total: u64,
    },
    /// Layer `layer` is being unpacked and built.
    Build {
        layer: u64,
    },
    Done {
        image: ImageInfo,
    },
    Error {
        error: ErrorDetail,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImageList {
    pub images: Vec<ImageInfo>,
}
