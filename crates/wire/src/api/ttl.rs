//! `PUT /v1/sandboxes/{id}/ttl`: change a running sandbox's TTLs (the E2B `timeout`).

use serde::{Deserialize, Serialize};

/// Body of `PUT /v1/sandboxes/{id}/ttl`. Absent fields stay as they are; the call itself
/// resets the idle clock. Answer: the sandbox's [`super::SandboxInfo`].
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TtlUpdate {
    /// New idle TTL in seconds (`0` removes it).
    #[serde(default)]
    pub ttl_running_stop: Option<u64>,
    /// New hard lifetime in seconds from the sandbox's creation (`0` removes it).
    #[serde(default)]
    pub ttl_total: Option<u64>,
    /// What the idle TTL does when it fires.
    #[serde(default)]
    pub ttl_action: Option<super::TtlAction>,
}
