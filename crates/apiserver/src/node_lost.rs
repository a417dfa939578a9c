//! `node_lost`: a sandbox whose node has not answered for `node_lost_after_ms` counts as
//! ended. `GET /v1/sandboxes/{id}` answers it `failed` with end reason `node_lost`, a stop
//! answers the same, and every other call 410 `sandbox_dead`.
//!
//! While the node stays silent this is the apiserver's own view; once membership recorded the
//! node lost (`crate::membership::loss`, shared through the database) it is final: the
//! node's sandboxes are stopped with end reason `node_lost` when it comes back.

use dsec_wire::api::{EndReason, SandboxInfo, SandboxState};

use crate::error::ApiError;
use crate::routes::AppState;

/// The ended view of sandbox `id` when its node counts as lost.
pub fn lost(st: &AppState, id: &str) -> Option<SandboxInfo> {
    let node = dsec_wire::id::node_of(id)?;
    if st.membership.is_lost(node) {
        // Recorded lost (by any replica): final, even once it answers again (its sandboxes
        // are then stopped, see `crate::membership::loss`).
        let detail = format!(
            "node {node} stopped answering for longer than node_lost_after_ms = {} ms; its \
             sandboxes are counted as lost",
            st.config.node_lost_after_ms
        );
        return Some(ended(id, node, detail));
    }
    let silent = st.forwarder.watcher().silent_for(node)?;
    if silent.as_millis() < u128::from(st.config.node_lost_after_ms) {
        return None;
    }
    let detail = format!(
        "node {node} has not answered for {} s (node_lost_after_ms = {}); its sandboxes are \
         counted as lost",
        silent.as_secs(),
        st.config.node_lost_after_ms
    );
    Some(ended(id, node, detail))
}

fn ended(id: &str, node: &str, detail: String) -> SandboxInfo {
    SandboxInfo {
        id: id.to_string(),
        node: node.to_string(),
        state: SandboxState::Failed,
        reason: Some(detail.clone()),
        end_reason: Some(EndReason::NodeLost),
        end_detail: Some(detail),
        ..Default::default()
    }
}

/// The 410 every call other than get and stop answers for a sandbox of a lost node.
pub fn dead(info: &SandboxInfo) -> ApiError {
    ApiError::SandboxDead(format!(
        "sandbox {} is failed (node_lost): {}",
        info.id,
        info.end_detail.as_deref().unwrap_or("its node was lost")
    ))
}
