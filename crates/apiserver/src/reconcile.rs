//! Quota reconciliation: usage follows what the edges really run.
//!
//! Every `reconcile_period_ms`, the sandbox lists of the healthy edges are read; allocations
//! of sandboxes an edge no longer has (stopped by TTL, died, stopped through a job) are given
//! back, reservations whose sandbox exists but whose bind was lost (an apiserver died mid-create)
//! are bound by the `dsec.reservation` label, and reservations left unbound for two minutes are
//! released. Edges that do not answer are skipped: their sandboxes stay charged until they rejoin.

use std::time::Duration;

use tokio::task::JoinHandle;

use crate::iam::ledger::{now_ms, EdgeLive, Ledger};
use crate::watcher::Watcher;

/// Allocations younger than this are not judged (their create may still be on its way).
const GRACE_MS: i64 = 5_000;
/// Unbound reservations older than this are released.
const PENDING_MS: i64 = 120_000;

/// The part of an edge's `SandboxList` reconciliation reads: with 380,000 live sandboxes a
/// pass reads them all, so the other fields (image, limits, user labels, ...) are skipped
/// rather than decoded into a full `SandboxInfo` each.
#[derive(serde::Deserialize)]
struct LiveList {
    sandboxes: Vec<LiveSandbox>,
}

#[derive(serde::Deserialize)]
struct LiveSandbox {
    id: String,
    #[serde(default)]
    labels: LiveLabels,
}

#[derive(serde::Deserialize, Default)]
struct LiveLabels {
    #[serde(rename = "dsec.reservation", default)]
    reservation: Option<String>,
}

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
            let body = r.bytes().await.ok()?;
            let list: LiveList = serde_json::from_slice(&body).ok()?;
            Some(EdgeLive {
                node,
                sandboxes: list
                    .sandboxes
                    .into_iter()
                    .map(|s| (s.id, s.labels.reservation))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::create::LABEL_RESERVATION;
    use dsec_wire::api::{SandboxInfo, SandboxList};

    #[test]
    fn reads_ids_and_reservations_from_a_full_list() {
        let mut a = SandboxInfo {
            id: "sb-n1-0000000000000001".into(),
            image: "busybox".into(),
            ..Default::default()
        };
        a.labels.insert(LABEL_RESERVATION.into(), "r1".into());
        a.labels.insert("team".into(), "x".into());
        let b = SandboxInfo {
            id: "sb-n1-0000000000000002".into(),
            ..Default::default()
        };
        let body = serde_json::to_vec(&SandboxList {
            sandboxes: vec![a, b],
        })
        .unwrap();
        let list: LiveList = serde_json::from_slice(&body).unwrap();
        let got: Vec<(String, Option<String>)> = list
            .sandboxes
            .into_iter()
            .map(|s| (s.id, s.labels.reservation))
            .collect();
        assert_eq!(
            got,
            vec![
                ("sb-n1-0000000000000001".into(), Some("r1".into())),
                ("sb-n1-0000000000000002".into(), None),
            ]
        );
    }
}
