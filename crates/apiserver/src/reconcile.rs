//! Quota reconciliation: usage follows what the edges really run.
//!
//! Every `reconcile_period_ms`, the sandbox lists of the healthy edges are read; allocations
//! of sandboxes an edge no longer has (stopped by TTL, died, stopped through a job) are given
//! back, reservations whose sandbox exists but whose bind was lost (an apiserver died mid-create)
//! are bound by the `dsec.reservation` label, and reservations left unbound for two minutes are
//! released. Edges that do not answer are skipped: their sandboxes stay charged until they rejoin.

use std::time::Duration;

use dsec_wire::api::SandboxList;
use tokio::task::JoinHandle;

use crate::create::LABEL_RESERVATION;
use crate::iam::ledger::{now_ms, EdgeLive, Ledger};
use crate::watcher::Watcher;

/// Allocations younger than this are not judged (their create may still be on its way).
const GRACE_MS: i64 = 5_000;
/// Unbound reservations older than this are released.
const PENDING_MS: i64 = 120_000;

/// One reconciliation pass; returns how many allocations changed.
pub async fn once(watcher: &Watcher, http: &reqwest::Client, ledger: &Ledger) -> u64 {
    let started = now_ms();
    let nodes = watcher.snapshot();
    let calls = nodes.iter().filter(|n| n.healthy).filter_map(|n| {
        let node = n.node_id.clone()?;
        let url = format!("{}/edge/v1/sandboxes", n.endpoint.url);
        let token = n.endpoint.token.clone();
        Some(async move {
            let r = http
                .get(&url)
                .bearer_auth(&token)
                .timeout(Duration::from_secs(30))
                .send()
                .await
                .ok()?;
            if !r.status().is_success() {
                return None;
            }
            let list: SandboxList = r.json().await.ok()?;
            Some(EdgeLive {
                node,
                sandboxes: list
                    .sandboxes
                    .into_iter()
                    .map(|s| {
                        let res = s.labels.get(LABEL_RESERVATION).cloned();
                        (s.id, res)
                    })
                    .collect(),
            })
        })
    });
    let edges: Vec<EdgeLive> = futures::future::join_all(calls)
        .await
        .into_iter()
        .flatten()
        .collect();
    match ledger
        .reconcile(edges, started - GRACE_MS, started - PENDING_MS)
        .await
    {
        Ok(n) => {
            if n > 0 {
                tracing::info!(changed = n, "quota usage reconciled with the edges");
            }
            n
        }
        Err(e) => {
            tracing::warn!(error = %e, "quota reconciliation failed");
            0
        }
    }
}

pub fn spawn(
    watcher: Watcher,
    http: reqwest::Client,
    ledger: Ledger,
    period: Duration,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            tick.tick().await;
            once(&watcher, &http, &ledger).await;
        }
    })
}
