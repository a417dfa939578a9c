//! `dsec edge --join URL`: the edge registers with the cluster and heartbeats (issue 22).
//!
//! The first join happens before the edge reports itself up: a refused token (401) or a
//! refused request (4xx) ends the edge with the apiserver's message. After that the edge
//! heartbeats every `heartbeat_period_ms` the apiserver names; when the apiserver no longer
//! knows it (404) it joins again, and failures are logged (once per run of failures) while it
//! keeps trying.

use std::time::Duration;

use anyhow::Context;
use dsec_client::{Client, ClientError};
use dsec_wire::api::{JoinRequest, NodeState};
use tokio::task::JoinHandle;

/// Joins at `api_url` with `token`, retrying while the apiserver cannot be reached (up to
/// `give_up`), then heartbeats in the background.
pub async fn join(
    api_url: &str,
    token: &str,
    req: JoinRequest,
    give_up: Duration,
) -> anyhow::Result<JoinHandle<()>> {
    let client = Client::new(api_url, token).context("join: the apiserver URL")?;
    let deadline = std::time::Instant::now() + give_up;
    let answer = loop {
        match client.join(&req).await {
            Ok(a) => break a,
            Err(e @ ClientError::Api { .. }) => {
                return Err(anyhow::anyhow!(e)).with_context(|| {
                    format!("join the cluster at {api_url} as node {}", req.node_id)
                })
            }
            Err(e) if std::time::Instant::now() > deadline => {
                return Err(anyhow::anyhow!(e)).with_context(|| {
                    format!("join the cluster at {api_url} (gave up after {give_up:?})")
                })
            }
            Err(e) => {
                tracing::warn!(error = %e, "join: apiserver not reachable yet; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    tracing::info!(node = %req.node_id, api = %api_url, state = %answer.state, "joined the cluster");
    let period = Duration::from_millis(answer.heartbeat_period_ms.clamp(100, 60_000));
    Ok(tokio::spawn(heartbeat_loop(client, req, period)))
}

async fn heartbeat_loop(client: Client, req: JoinRequest, mut period: Duration) {
    let mut failing = false;
    let mut last_state = NodeState::Healthy;
    loop {
        tokio::time::sleep(period).await;
        let r = match client.heartbeat(&req.node_id).await {
            Err(ClientError::Api { status: 404, .. }) => {
                tracing::warn!(node = %req.node_id, "the apiserver does not know this node; joining again");
                client.join(&req).await
            }
            other => other,
        };
        match r {
            Ok(a) => {
                if failing {
                    tracing::info!(node = %req.node_id, "heartbeats answered again");
                    failing = false;
                }
                if a.state != last_state {
                    tracing::info!(node = %req.node_id, state = %a.state, "node state changed");
                    if a.state == NodeState::Drained {
                        tracing::info!(node = %req.node_id, "drained: no placements come here; the edge may be stopped");
                    }
                    last_state = a.state;
                }
                period = Duration::from_millis(a.heartbeat_period_ms.clamp(100, 60_000));
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(node = %req.node_id, error = %e, "heartbeat failed; retrying");
                    failing = true;
                }
            }
        }
    }
}
