//! The watcher: polls every edge's `GET /edge/v1/status` and keeps the latest view in memory.
//!
//! No database: after a restart the view is rebuilt by polling again.

use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use dsec_wire::api::NodeStatus;
use tokio::task::JoinHandle;

use crate::config::EdgeEndpoint;

/// What the watcher knows about one configured edge.
#[derive(Debug, Clone)]
pub struct NodeView {
    /// Index into the configured edge list.
    pub index: usize,
    pub endpoint: EdgeEndpoint,
    /// Node id: configured, or learned from the edge's status.
    pub node_id: Option<String>,
    pub status: Option<NodeStatus>,
    pub healthy: bool,
    /// When the edge last answered.
    pub last_seen: Option<Instant>,
    /// Last poll error, for `/v1/nodes` and logs.
    pub last_error: Option<String>,
    /// True once at least one poll finished (successfully or not).
    pub polled: bool,
}

/// Shared view of all edges.
#[derive(Clone)]
pub struct Watcher {
    nodes: Arc<RwLock<Vec<NodeView>>>,
}

impl Watcher {
    pub fn new(edges: &[EdgeEndpoint]) -> Self {
        let nodes = edges
            .iter()
            .enumerate()
            .map(|(index, e)| NodeView {
                index,
                endpoint: e.clone(),
                node_id: e.node_id.clone(),
                status: None,
                healthy: false,
                last_seen: None,
                last_error: None,
                polled: false,
            })
            .collect();
        Watcher {
            nodes: Arc::new(RwLock::new(nodes)),
        }
    }

    /// Runs `f` on the current view without copying it.
    pub fn with<R>(&self, f: impl FnOnce(&[NodeView]) -> R) -> R {
        match self.nodes.read() {
            Ok(n) => f(&n),
            Err(p) => f(&p.into_inner()),
        }
    }

    /// The endpoint and node id of the node at `index`.
    pub fn endpoint_at(&self, index: usize) -> Option<(EdgeEndpoint, Option<String>)> {
        let nodes = self.nodes.read().ok()?;
        nodes
            .get(index)
            .map(|n| (n.endpoint.clone(), n.node_id.clone()))
    }

    /// Counts a sandbox just placed on the node at `index` in the local view (until the next
    /// poll replaces it), so placements between polls see each other.
    pub fn note_placed(&self, index: usize, memory_mb: u64, cpu: f64) {
        if let Ok(mut nodes) = self.nodes.write() {
            if let Some(s) = nodes.get_mut(index).and_then(|n| n.status.as_mut()) {
                s.sandboxes_running += 1;
                s.memory_mb_allocated += memory_mb;
                s.cpu_cores_allocated += cpu;
            }
        }
    }

    /// A copy of the current view.
    pub fn snapshot(&self) -> Vec<NodeView> {
        self.nodes.read().map(|n| n.clone()).unwrap_or_default()
    }

    /// The endpoint serving `node_id`, whether it is healthy, and its last error.
    pub fn endpoint_for(&self, node_id: &str) -> Option<(EdgeEndpoint, bool, Option<String>)> {
        let nodes = self.nodes.read().ok()?;
        nodes
            .iter()
            .find(|n| n.node_id.as_deref() == Some(node_id))
            .map(|n| (n.endpoint.clone(), n.healthy, n.last_error.clone()))
    }

    /// The first configured edge (images go there until the cluster issue).
    pub fn first_endpoint(&self) -> Option<EdgeEndpoint> {
        self.nodes.read().ok()?.first().map(|n| n.endpoint.clone())
    }

    /// All configured endpoints.
    pub fn endpoints(&self) -> Vec<EdgeEndpoint> {
        self.snapshot().into_iter().map(|n| n.endpoint).collect()
    }

    /// Marks a node unhealthy right away (a forward just failed to connect).
    pub fn mark_unreachable(&self, url: &str, error: &str) {
        if let Ok(mut nodes) = self.nodes.write() {
            for n in nodes.iter_mut().filter(|n| n.endpoint.url == url) {
                n.healthy = false;
                n.last_error = Some(error.to_string());
            }
        }
    }

    fn record(&self, index: usize, result: Result<NodeStatus, String>) {
        let Ok(mut nodes) = self.nodes.write() else {
            return;
        };
        let Some(n) = nodes.get_mut(index) else {
            return;
        };
        n.polled = true;
        match result {
            Ok(status) => {
                if let Some(configured) = &n.endpoint.node_id {
                    if configured != &status.node {
                        let msg = format!(
                            "edge {} reports node id {:?} but is configured as {:?}",
                            n.endpoint.url, status.node, configured
                        );
                        if n.last_error.as_deref() != Some(msg.as_str()) {
                            tracing::error!("{msg}");
                        }
                        n.healthy = false;
                        n.last_error = Some(msg);
                        return;
                    }
                }
                if !n.healthy {
                    tracing::info!(node = %status.node, url = %n.endpoint.url, "edge healthy");
                }
                n.node_id = Some(status.node.clone());
                n.healthy = status.healthy;
                n.last_seen = Some(Instant::now());
                n.last_error = None;
                n.status = Some(status);
            }
            Err(e) => {
                if n.healthy || n.last_error.is_none() {
                    tracing::warn!(url = %n.endpoint.url, error = %e, "edge unreachable");
                }
                n.healthy = false;
                n.last_error = Some(e);
            }
        }
    }

    /// Polls every edge once, concurrently.
    pub async fn poll_once(&self, http: &reqwest::Client) {
        let endpoints = self.endpoints();
        let polls = endpoints
            .into_iter()
            .enumerate()
            .map(|(i, e)| async move { (i, fetch_status(http, &e).await) });
        for (i, r) in futures::future::join_all(polls).await {
            self.record(i, r);
        }
    }

    /// Starts polling every `period`, first poll right away.
    pub fn spawn(&self, http: reqwest::Client, period: Duration) -> JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                me.poll_once(&http).await;
            }
        })
    }
}

async fn fetch_status(http: &reqwest::Client, e: &EdgeEndpoint) -> Result<NodeStatus, String> {
    let resp = http
        .get(format!("{}/edge/v1/status", e.url))
        .bearer_auth(&e.token)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|err| format!("GET {}/edge/v1/status: {err}", e.url))?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        return Err(format!("GET {}/edge/v1/status: {status}: {body}", e.url));
    }
    resp.json::<NodeStatus>()
        .await
        .map_err(|err| format!("decode status of {}: {err}", e.url))
}
