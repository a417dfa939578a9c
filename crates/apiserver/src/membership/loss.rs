//! Node loss: declaring a silent node lost (its quota released once) and stopping the
//! sandboxes of a lost node that comes back (end reason `node_lost`), so that what the
//! apiservers told callers ("failed, node_lost") stays true and quota usage equals the live
//! set.

use dsec_wire::api::{EndReason, SandboxList};

use super::{registry, Membership};
use crate::config::EdgeEndpoint;
use crate::iam::ledger::{now_ms, EdgeLive};

/// Unbound reservations older than this are released by the same pass (as reconciliation
/// does).
const PENDING_MS: i64 = 120_000;

/// Records node `id` lost at `now` (once across replicas) and releases every quota
/// allocation of its sandboxes: the rows are deleted, so a second release (another replica,
/// a retry, the node's late return) finds nothing to give back.
pub async fn declare(m: &Membership, id: &str, endpoint: &EdgeEndpoint, now: i64) {
    match registry::set_lost(
        m.db(),
        id.to_string(),
        endpoint.url.clone(),
        endpoint.token.clone(),
        now,
    )
    .await
    {
        Ok(true) => {
            tracing::warn!(node = %id, "node lost: its sandboxes count as failed (node_lost)")
        }
        Ok(false) => {}
        Err(e) => {
            tracing::warn!(node = %id, error = %e, "record node loss");
            return;
        }
    }
    let released = m
        .ledger()
        .reconcile(
            vec![EdgeLive {
                node: id.to_string(),
                sandboxes: Vec::new(),
            }],
            now_ms(),
            now_ms() - PENDING_MS,
        )
        .await;
    match released {
        Ok(n) if n > 0 => tracing::info!(node = %id, released = n, "quota of a lost node released"),
        Ok(_) => {}
        Err(e) => tracing::warn!(node = %id, error = %e, "release the quota of a lost node"),
    }
}

/// Stops every live sandbox of lost node `id`, which answers again, with end reason
/// `node_lost`, then clears the loss so the node takes placements again. Left as is (tried
/// again on the next tick) when the edge does not answer the list.
pub async fn evict(m: &Membership, id: &str, e: &EdgeEndpoint) {
    let http = m.http();
    let url = format!("{}/edge/v1/sandboxes", e.url);
    let list = match http.get(&url).bearer_auth(&e.token).send().await {
        Ok(r) if r.status().is_success() => match r.json::<SandboxList>().await {
            Ok(l) => l,
            Err(err) => {
                tracing::warn!(node = %id, error = %err, "list the sandboxes of a returning lost node");
                return;
            }
        },
        Ok(r) => {
            tracing::warn!(node = %id, status = %r.status(), "list the sandboxes of a returning lost node");
            return;
        }
        Err(err) => {
            tracing::warn!(node = %id, error = %err, "list the sandboxes of a returning lost node");
            return;
        }
    };
    let mut failed = 0;
    for sb in &list.sandboxes {
        let url = format!(
            "{}/edge/v1/sandboxes/{}?end_reason={}",
            e.url,
            sb.id,
            EndReason::NodeLost
        );
        match http.delete(&url).bearer_auth(&e.token).send().await {
            Ok(r) if r.status().is_success() || r.status().as_u16() == 404 => {
                // Released when the node was lost; a no-op unless it was placed since.
                m.ledger().release_sandbox(&sb.id);
            }
            Ok(r) => {
                failed += 1;
                tracing::warn!(sandbox = %sb.id, status = %r.status(), "stop a sandbox of a lost node");
            }
            Err(err) => {
                failed += 1;
                tracing::warn!(sandbox = %sb.id, error = %err, "stop a sandbox of a lost node");
            }
        }
    }
    if failed > 0 {
        return;
    }
    tracing::info!(node = %id, stopped = list.sandboxes.len(), "lost node came back: its sandboxes were stopped (node_lost); it takes placements again");
    if let Err(err) = registry::clear_lost(m.db(), id.to_string()).await {
        tracing::warn!(node = %id, error = %err, "clear the loss of a node");
    }
}
