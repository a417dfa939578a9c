//! Cordon, uncordon and drain: an admin takes a node out of placement, and a drain pauses
//! or stops its live sandboxes (policy `pause` or `stop`), after which the node is
//! `drained` (an edge that joined hears it in its heartbeat answers and may leave).

use dsec_wire::api::{DrainPolicy, EndReason, NodeAction, NodeState, SandboxList, SandboxState};

use super::registry::{self, AdminState};
use super::Membership;
use crate::error::ApiError;

/// The endpoint of node `id`, or 404 naming the known nodes.
fn endpoint(m: &Membership, id: &str) -> Result<crate::config::EdgeEndpoint, ApiError> {
    if let Some((e, _, _)) = m.watcher().endpoint_for(id) {
        return Ok(e);
    }
    let known: Vec<String> = m
        .watcher()
        .snapshot()
        .into_iter()
        .filter_map(|n| n.node_id)
        .collect();
    Err(ApiError::NotFound(format!(
        "node {id:?} is not known to this apiserver (known: {}); see GET /v1/nodes",
        known.join(", ")
    )))
}

/// Sets the admin state of node `id` and re-judges membership at once.
pub async fn set(m: &Membership, id: &str, state: AdminState) -> Result<NodeAction, ApiError> {
    let e = endpoint(m, id)?;
    registry::set_admin(m.db(), id.to_string(), e.url, e.token, state).await?;
    m.refresh().await;
    Ok(NodeAction {
        node_id: id.to_string(),
        state: m.state(id).map_or(NodeState::Suspect, |s| s.0),
        ..Default::default()
    })
}

/// Drains node `id`: no new placements, then every live sandbox paused or stopped.
pub async fn drain(m: &Membership, id: &str, policy: DrainPolicy) -> Result<NodeAction, ApiError> {
    let e = endpoint(m, id)?;
    set(m, id, AdminState::Draining).await?;
    let http = m.http();
    let list: SandboxList = http
        .get(format!("{}/edge/v1/sandboxes", e.url))
        .bearer_auth(&e.token)
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .map_err(|err| {
            ApiError::NodeUnavailable(format!(
                "node {id} did not answer the list of its sandboxes: {err}; it stays draining \
                 (no placements): drain it again once it answers"
            ))
        })?
        .json()
        .await
        .map_err(|err| ApiError::NodeUnavailable(format!("node {id}: sandbox list: {err}")))?;
    let mut out = NodeAction {
        node_id: id.to_string(),
        ..Default::default()
    };
    for sb in list.sandboxes {
        let (req, done) = match policy {
            DrainPolicy::Pause if sb.state == SandboxState::Paused => continue,
            DrainPolicy::Pause => (
                http.post(format!("{}/edge/v1/sandboxes/{}/pause", e.url, sb.id)),
                &mut out.paused,
            ),
            DrainPolicy::Stop => (
                http.delete(format!(
                    "{}/edge/v1/sandboxes/{}?end_reason={}",
                    e.url,
                    sb.id,
                    EndReason::Preempted
                )),
                &mut out.stopped,
            ),
        };
        match req.bearer_auth(&e.token).send().await {
            Ok(r) if r.status().is_success() => {
                if policy == DrainPolicy::Stop {
                    m.ledger().release_sandbox(&sb.id);
                }
                done.push(sb.id);
            }
            Ok(r) => {
                let status = r.status();
                let body = r.text().await.unwrap_or_default();
                out.failed.insert(sb.id, format!("{status}: {body}"));
            }
            Err(err) => {
                out.failed.insert(sb.id, err.to_string());
            }
        }
    }
    if out.failed.is_empty() {
        set(m, id, AdminState::Drained).await?;
    }
    out.state = m.state(id).map_or(NodeState::Suspect, |s| s.0);
    tracing::info!(node = %id, paused = out.paused.len(), stopped = out.stopped.len(), failed = out.failed.len(), "node drained");
    Ok(out)
}
