//! Burst queueing: what a queued create reports, and the batch resource (`/v1/batches`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{CreateSandboxRequest, SandboxInfo};

/// How a create with `wait_s` went through the apiserver's queue (the `queue` field of its
/// answer, beside the sandbox's fields).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QueueReport {
    /// Milliseconds from arrival at the apiserver until the create was sent to a node.
    pub waited_ms: f64,
    /// Arrival number of the create within its project on this apiserver (FIFO order).
    pub ticket: u64,
    /// When the queue let the successful attempt go, counted over every project on this
    /// apiserver (grant order: within a project it follows `ticket`).
    pub dispatched: u64,
    /// Attempts it took (an attempt that found no room puts the create back in its place).
    pub attempts: u32,
}

/// The answer of a create with `wait_s`: the sandbox plus its queue report.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QueuedSandboxInfo {
    #[serde(flatten)]
    pub info: SandboxInfo,
    #[serde(default)]
    pub queue: Option<QueueReport>,
}

/// Body of `POST /v1/batches`: `count` sandboxes of one shape, placed as capacity frees.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateBatchRequest {
    /// The create every sandbox of the batch is made from (its `wait_s` is ignored).
    pub request: CreateSandboxRequest,
    /// How many sandboxes (1 ..= 100,000).
    pub count: u64,
    /// Labels added to every sandbox (beside `request.labels`); every sandbox also gets
    /// `dsec.batch=<id>`.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Seconds each sandbox may wait for capacity (default 3600).
    #[serde(default)]
    pub wait_s: Option<f64>,
}

/// State of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum BatchState {
    /// Creates are still queued or in flight.
    Running,
    /// Every create was placed or failed.
    Done,
    /// Cancelled: queued creates were dropped (placed sandboxes keep running).
    Cancelled,
}

/// Progress of a batch (`GET /v1/batches/{id}`; also the answer of create and cancel).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BatchStatus {
    pub id: String,
    pub state: BatchState,
    pub count: u64,
    pub placed: u64,
    pub queued: u64,
    pub failed: u64,
    /// Creates dropped by a cancel.
    #[serde(default)]
    pub cancelled: u64,
    /// Ids of the placed sandboxes, in the order they were placed.
    #[serde(default)]
    pub sandbox_ids: Vec<String>,
    /// Error code → count of the failed creates.
    #[serde(default)]
    pub errors: BTreeMap<String, u64>,
    /// The message of the last failure, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// RFC 3339 UTC.
    pub created_at: String,
}
