//! File watch: filesystem events inside a sandbox (`GET /v1/sandboxes/{id}/watch`).

use serde::{Deserialize, Serialize};

/// What happened to a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum FsEventKind {
    /// The watch is in place: changes from now on are reported (always the first event).
    Ready,
    Create,
    Write,
    Remove,
    /// `path` was moved to `to` (`to` is absent when it moved out of the watched tree).
    Rename,
    /// Permissions, owner or timestamps changed.
    Chmod,
    /// The sandbox's kernel dropped events (its queue overflowed): some changes are missing.
    Overflow,
}

/// One line of `GET /v1/sandboxes/{id}/watch?path=P&recursive=B` (NDJSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FsEvent {
    pub kind: FsEventKind,
    /// Absolute path inside the sandbox.
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    #[serde(default)]
    pub is_dir: bool,
}
