//! Trajectory records as the API returns them (`GET /v1/sandboxes/{id}/trajectory`, `last_step`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::ErrorDetail;

/// One entry of a sandbox's trajectory log (`GET /v1/sandboxes/{id}/trajectory`, one per line).
///
/// Calls that carry a client `step` are fast-forwarded: repeating a completed step answers its
/// recorded result (response header `x-dsec-replayed: true`) without running it again.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TrajectoryRecord {
    /// Position in the sandbox's log, from 1, without gaps.
    pub seq: u64,
    /// The client's step id, when the call carried one.
    #[serde(default)]
    pub step: Option<u64>,
    /// `create`, `shell`, `exec`, `write_file`, `read_file`, `list_files`, `stat`, `remove`,
    /// `mkdir`, `close_session`, `stop`, `died`, and state changes such as `pause`, `resume`,
    /// `network_rules`, `ttl`.
    pub kind: String,
    /// The request as the edge understood it (defaults applied).
    #[serde(default)]
    pub request: serde_json::Value,
    /// What makes two calls "the same" for fast-forward: a step repeated with another key is
    /// refused with `conflict`.
    #[serde(default)]
    pub key: serde_json::Value,
    /// Unix time in milliseconds.
    pub start_ms: f64,
    pub end_ms: f64,
    pub ok: bool,
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// The answer (e.g. a [`CommandResult`], a [`FileInfo`]); outputs above the edge's inline
    /// limit are left empty here and kept by digest in `blobs`.
    #[serde(default)]
    pub result: serde_json::Value,
    #[serde(default)]
    pub error: Option<ErrorDetail>,
    /// Output kept out of line: field name (`stdout`, `stderr`, `content`) → sha256 hex.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub blobs: BTreeMap<String, String>,
    /// Files this call wrote (through the file API), with their content digests.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files_written: Vec<FileDigest>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileDigest {
    pub path: String,
    pub sha256: String,
    pub size: u64,
}

/// `GET /v1/sandboxes/{id}/trajectory/last_step`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LastStep {
    pub sandbox: String,
    /// Highest step id whose call completed (`null` when none).
    #[serde(default)]
    pub last_completed_step: Option<u64>,
    /// Step ids still running.
    #[serde(default)]
    pub running_steps: Vec<u64>,
    /// Records in the log.
    pub records: u64,
    /// False when the sandbox was created with `trajectory: false`.
    pub enabled: bool,
}
