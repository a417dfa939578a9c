//! Cluster membership (issue 22): joins, heartbeats, cordon, drain, join tokens.

#![allow(dead_code)]

use dsec_wire::api::{DrainRequest, ErrorBody, JoinAnswer, JoinRequest, JoinToken, NodeAction};
use utoipa::IntoParams;

use super::paths::ERRORS;

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct NodePath {
    /// Node id (`[a-z0-9]{1,16}`).
    #[param(pattern = r"^[a-z0-9]{1,16}$")]
    id: String,
}

/// An edge joins the cluster (`dsec edge --join URL --token T`): authorized by a cluster join
/// token (`Authorization: Bearer <join token>`: the apiserver's `join_token` or one from
/// `POST /v1/nodes/tokens`), not an API key; 401 for any other. Every apiserver sharing the
/// database sees the node within `membership_sync_ms`. A re-join (new URL after a restart)
/// keeps the node's cordon and a pending loss.
#[utoipa::path(post, path = "/v1/nodes/join", tag = "cluster", operation_id = "joinNode",
    security(()),
    request_body = JoinRequest,
    responses(
        (status = 200, description = "Joined; heartbeat every `heartbeat_period_ms`", body = JoinAnswer),
        (status = 401, description = "`unauthorized`: no valid join token", body = ErrorBody),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn join_node() {}

/// A joined edge's heartbeat (join token as for the join); the answer carries the node's
/// state (`drained`: it may leave). 404 when the node has not joined: join again.
#[utoipa::path(post, path = "/v1/nodes/{id}/heartbeat", tag = "cluster", operation_id = "nodeHeartbeat",
    security(()),
    params(NodePath),
    responses(
        (status = 200, description = "The node's state", body = JoinAnswer),
        (status = 401, description = "`unauthorized`: no valid join token", body = ErrorBody),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn node_heartbeat() {}

/// Cordon a node: no new placements; its sandboxes run on (admin).
#[utoipa::path(post, path = "/v1/nodes/{id}/cordon", tag = "cluster", operation_id = "cordonNode",
    params(NodePath),
    responses(
        (status = 200, description = "The node's state", body = NodeAction),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn cordon_node() {}

/// Uncordon a node (also after a drain): it takes placements again when healthy (admin).
#[utoipa::path(post, path = "/v1/nodes/{id}/uncordon", tag = "cluster", operation_id = "uncordonNode",
    params(NodePath),
    responses(
        (status = 200, description = "The node's state", body = NodeAction),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn uncordon_node() {}

/// Drain a node: no new placements, then every live sandbox paused (`policy: pause`, the
/// default) or stopped (`stop`, end reason `preempted`); the node is then `drained` (admin).
#[utoipa::path(post, path = "/v1/nodes/{id}/drain", tag = "cluster", operation_id = "drainNode",
    params(NodePath),
    request_body(content = DrainRequest, description = "Optional; an empty body means `pause`"),
    responses(
        (status = 200, description = "What was paused, stopped or failed", body = NodeAction),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn drain_node() {}

/// Issue a cluster join token for `dsec edge --join`; shown once (admin).
#[utoipa::path(post, path = "/v1/nodes/tokens", tag = "cluster", operation_id = "createJoinToken",
    responses(
        (status = 201, description = "Created", body = JoinToken),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn create_join_token() {}
