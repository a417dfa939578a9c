//! Cluster membership (issue 22): edges that join with a cluster token and heartbeat, node
//! states, cordon and drain (`/v1/nodes/...`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Where a node stands for placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// Answers and takes placements.
    #[default]
    Healthy,
    /// Missed its heartbeats or status polls: no placements; its sandboxes keep their state.
    Suspect,
    /// Silent past `node_lost_after_ms`: its sandboxes are `failed` with end reason
    /// `node_lost` and their quota is released; if it comes back they are stopped.
    Lost,
    /// An admin cordoned it: no new placements, its sandboxes run on.
    Cordoned,
    /// Being drained: no new placements; its sandboxes are being paused or stopped.
    Draining,
    /// Drained: no placements, no running sandboxes (paused ones remain with `pause`).
    Drained,
}

impl NodeState {
    pub const fn as_str(self) -> &'static str {
        match self {
            NodeState::Healthy => "healthy",
            NodeState::Suspect => "suspect",
            NodeState::Lost => "lost",
            NodeState::Cordoned => "cordoned",
            NodeState::Draining => "draining",
            NodeState::Drained => "drained",
        }
    }

    /// True when placement may put new sandboxes on the node.
    pub const fn takes_placements(self) -> bool {
        matches!(self, NodeState::Healthy)
    }
}

impl std::fmt::Display for NodeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The pool a node belongs to (placement overflows to `overflow` above the threshold).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum NodePool {
    #[default]
    Primary,
    Overflow,
}

/// Membership facts the apiserver adds to a node's status in `GET /v1/nodes`.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default)]
pub struct NodeMembership {
    pub state: NodeState,
    pub pool: NodePool,
    /// True for an edge that joined (`dsec edge --join`), false for one of the static
    /// `--edge` list.
    pub joined: bool,
    /// Last heartbeat of a joined edge (ms since the epoch).
    pub last_heartbeat_ms: Option<i64>,
    /// When this apiserver last got an answer from the node (ms since the epoch).
    pub last_seen_ms: Option<i64>,
    /// Why the node is not healthy (poll error, missed heartbeats, lost since ...).
    pub detail: Option<String>,
}

/// `POST /v1/nodes/join` (authorized by a cluster join token, not an API key).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct JoinRequest {
    /// Node id, `[a-z0-9]{1,16}` (the node part of its sandbox ids).
    pub node_id: String,
    /// Base URL the apiservers reach the edge at (`http://host:port`).
    pub url: String,
    /// The edge's bearer token (the apiservers present it to the edge).
    pub token: String,
    /// Most live sandboxes on the node.
    #[serde(default)]
    pub capacity: u64,
    #[serde(default)]
    pub pool: NodePool,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

/// Answer to a join or a heartbeat.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JoinAnswer {
    pub node_id: String,
    /// The node's state as this apiserver sees it (`drained`: it may leave).
    pub state: NodeState,
    /// How often the edge should heartbeat, ms.
    pub heartbeat_period_ms: u64,
}

/// What to do with a drained node's live sandboxes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum DrainPolicy {
    /// Pause them (state and files kept; resumed where they are).
    #[default]
    Pause,
    /// Stop them (end reason `preempted`).
    Stop,
}

/// `POST /v1/nodes/{id}/drain`.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, default)]
pub struct DrainRequest {
    pub policy: DrainPolicy,
}

/// Answer to cordon, uncordon and drain.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default)]
pub struct NodeAction {
    pub node_id: String,
    pub state: NodeState,
    /// Sandboxes paused by a drain.
    pub paused: Vec<String>,
    /// Sandboxes stopped by a drain.
    pub stopped: Vec<String>,
    /// Sandboxes a drain could not pause or stop, with why.
    pub failed: BTreeMap<String, String>,
}

/// A cluster join token (`POST /v1/nodes/tokens`), shown once.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JoinToken {
    pub token: String,
}
