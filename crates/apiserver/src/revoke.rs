//! `DELETE /v1/keys/{id}?stop_sandboxes=true`: the sandboxes of a principal whose key was
//! revoked are stopped with end reason `quota_revoked`, so a trainer masks those rollouts.
//!
//! Sandboxes are found by the `dsec.principal` label the apiserver puts on every create
//! ([`crate::create::LABEL_PRINCIPAL`]); each edge is asked for its list and told to stop the
//! matching ones. Edges that do not answer are skipped (logged): their sandboxes keep running
//! until stopped again.

use dsec_wire::api::{EndReason, SandboxList};

use crate::create::LABEL_PRINCIPAL;
use crate::routes::AppState;

/// Stops every sandbox labelled with `principal` on every edge; answers the ids stopped.
pub async fn stop_sandboxes_of(st: &AppState, principal: &str) -> Vec<String> {
    let http = st.forwarder.http().clone();
    let endpoints = st.forwarder.watcher().endpoints();
    let calls = endpoints.iter().map(|e| {
        let http = http.clone();
        async move {
            let url = format!("{}/edge/v1/sandboxes", e.url);
            let list = match http.get(&url).bearer_auth(&e.token).send().await {
                Ok(r) if r.status().is_success() => r.json::<SandboxList>().await.ok(),
                Ok(r) => {
                    tracing::warn!(%url, status = %r.status(), "list sandboxes to stop for a revoked key");
                    None
                }
                Err(err) => {
                    tracing::warn!(%url, error = %err, "list sandboxes to stop for a revoked key");
                    None
                }
            };
            let mut stopped = Vec::new();
            for sb in list.map(|l| l.sandboxes).unwrap_or_default() {
                if sb.labels.get(LABEL_PRINCIPAL).map(String::as_str) != Some(principal) {
                    continue;
                }
                let url = format!(
                    "{}/edge/v1/sandboxes/{}?end_reason={}",
                    e.url,
                    sb.id,
                    EndReason::QuotaRevoked
                );
                match http.delete(&url).bearer_auth(&e.token).send().await {
                    Ok(r) if r.status().is_success() => stopped.push(sb.id),
                    Ok(r) => {
                        tracing::warn!(sandbox = %sb.id, status = %r.status(), "stop sandbox of a revoked key")
                    }
                    Err(err) => {
                        tracing::warn!(sandbox = %sb.id, error = %err, "stop sandbox of a revoked key")
                    }
                }
            }
            stopped
        }
    });
    let mut all: Vec<String> = futures::future::join_all(calls)
        .await
        .into_iter()
        .flatten()
        .collect();
    for id in &all {
        st.ledger.release_sandbox(id);
    }
    all.sort();
    tracing::info!(
        principal,
        stopped = all.len(),
        "stopped the sandboxes of a revoked key"
    );
    all
}
