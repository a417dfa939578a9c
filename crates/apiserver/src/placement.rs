//! Placement: which edge gets a new sandbox.
//!
//! Today: filter healthy nodes with room, order by load (least loaded first). The cluster issue
//! replaces the ordering with power-of-k-choices and overflow pools behind this same function.

use dsec_wire::api::CreateSandboxRequest;

use crate::config::EdgeEndpoint;
use crate::watcher::NodeView;

/// Candidate edges for `req`, best first. Nodes never polled yet count as candidates (after
/// the healthy ones) so a create right after start does not fail; the edge has the final say.
pub fn candidates(nodes: &[NodeView], req: &CreateSandboxRequest) -> Vec<EdgeEndpoint> {
    let mut healthy: Vec<(&NodeView, f64)> = nodes
        .iter()
        .filter(|n| n.healthy)
        .filter(|n| match &n.status {
            Some(s) => s.substrates.is_empty() || s.substrates.contains(&req.substrate),
            None => true,
        })
        .map(|n| (n, load(n)))
        .collect();
    healthy.sort_by(|a, b| a.1.partial_cmp(&b.1).unwrap_or(std::cmp::Ordering::Equal));
    let mut out: Vec<EdgeEndpoint> = healthy
        .into_iter()
        .map(|(n, _)| n.endpoint.clone())
        .collect();
    out.extend(
        nodes
            .iter()
            .filter(|n| !n.polled)
            .map(|n| n.endpoint.clone()),
    );
    out
}

/// Fraction of capacity in use (sandboxes and memory, whichever is higher).
fn load(n: &NodeView) -> f64 {
    let Some(s) = &n.status else { return 1.0 };
    let by_count = if s.capacity_sandboxes > 0 {
        (s.sandboxes_running + s.sandboxes_paused) as f64 / s.capacity_sandboxes as f64
    } else {
        0.0
    };
    let by_mem = if s.memory_mb_total > 0 {
        s.memory_mb_allocated as f64 / s.memory_mb_total as f64
    } else {
        0.0
    };
    by_count.max(by_mem)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_wire::api::NodeStatus;

    fn view(i: usize, healthy: bool, running: u64, polled: bool) -> NodeView {
        NodeView {
            index: i,
            endpoint: EdgeEndpoint {
                node_id: Some(format!("n{i}")),
                url: format!("http://127.0.0.1:{}", 9000 + i),
                token: String::new(),
            },
            node_id: Some(format!("n{i}")),
            status: Some(NodeStatus {
                node: format!("n{i}"),
                healthy,
                sandboxes_running: running,
                capacity_sandboxes: 100,
                ..Default::default()
            }),
            healthy,
            last_seen: None,
            last_error: None,
            polled,
        }
    }

    #[test]
    fn least_loaded_healthy_first() {
        let nodes = vec![
            view(0, true, 50, true),
            view(1, false, 0, true),
            view(2, true, 10, true),
        ];
        let c = candidates(&nodes, &CreateSandboxRequest::default());
        let ids: Vec<_> = c.iter().map(|e| e.node_id.clone().unwrap()).collect();
        assert_eq!(ids, vec!["n2", "n0"]);
    }

    #[test]
    fn unpolled_nodes_are_last_resort() {
        let nodes = vec![view(0, false, 0, false)];
        assert_eq!(
            candidates(&nodes, &CreateSandboxRequest::default()).len(),
            1
        );
    }
}
