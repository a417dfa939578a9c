//! The watcher: polls every edge's `GET /edge/v1/status` and keeps the latest view in memory.
//!
//! No database: after a restart the view is rebuilt by polling again.

use std::sync::{Arc, Mutex, RwLock};
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
    /// True while the node's membership state refuses placements (cordoned, draining,
    /// drained, suspect by missed heartbeats, lost): see [`crate::membership`].
    pub cordoned: bool,
}

/// A sandbox this apiserver placed, remembered until a poll that surely includes it.
#[derive(Debug, Clone, Copy)]
struct Placed {
    /// When the edge answered the create.
    at: Instant,
    memory_mb: u64,
    cpu: f64,
}

/// Groups the periodic polls are spread over (see [`Watcher::spawn`]).
const POLL_SLICES: usize = 10;

/// Shared view of all edges.
#[derive(Clone)]
pub struct Watcher {
    nodes: Arc<RwLock<Vec<NodeView>>>,
    /// Per node index: recent placements (lock order: `nodes` first, then `placed`).
    placed: Arc<Mutex<Vec<Vec<Placed>>>>,
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
                cordoned: false,
            })
            .collect();
        Watcher {
            nodes: Arc::new(RwLock::new(nodes)),
            placed: Arc::new(Mutex::new(vec![Vec::new(); edges.len()])),
        }
    }

    /// Adds the edge `e` (a node that joined), or updates its URL and token when a node with
    /// its id is known already (it re-joined after a restart). Returns its index.
    pub fn upsert_endpoint(&self, e: EdgeEndpoint) -> usize {
        let mut nodes = self.nodes.write().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = nodes
            .iter_mut()
            .find(|n| e.node_id.is_some() && n.node_id == e.node_id)
        {
            if n.endpoint.url != e.url || n.endpoint.token != e.token {
                tracing::info!(node = ?e.node_id, url = %e.url, "edge re-joined at a new address");
                n.endpoint.url = e.url.clone();
                n.endpoint.token = e.token.clone();
            }
            return n.index;
        }
        let index = nodes.len();
        tracing::info!(node = ?e.node_id, url = %e.url, "edge joined");
        nodes.push(NodeView {
            index,
            node_id: e.node_id.clone(),
            endpoint: e,
            status: None,
            healthy: false,
            last_seen: None,
            last_error: None,
            polled: false,
            cordoned: false,
        });
        let mut placed = self.placed.lock().unwrap_or_else(|p| p.into_inner());
        placed.resize(nodes.len(), Vec::new());
        index
    }

    /// Lets the node at `index` take placements or not (its membership state).
    pub fn set_cordoned(&self, index: usize, cordoned: bool) {
        let mut nodes = self.nodes.write().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = nodes.get_mut(index) {
            n.cordoned = cordoned;
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

    /// Counts a sandbox just placed on the node at `index` in the local view, so placements
    /// between polls see each other. A poll that was already in flight when the edge answered
    /// the create may or may not include it: [`Watcher::record`] keeps it counted then.
    pub fn note_placed(&self, index: usize, memory_mb: u64, cpu: f64) {
        let Ok(mut nodes) = self.nodes.write() else {
            return;
        };
        if let Some(s) = nodes.get_mut(index).and_then(|n| n.status.as_mut()) {
            s.sandboxes_running += 1;
            s.memory_mb_allocated += memory_mb;
            s.cpu_cores_allocated += cpu;
        }
        let mut placed = self.placed.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(list) = placed.get_mut(index) {
            list.push(Placed {
                at: Instant::now(),
                memory_mb,
                cpu,
            });
        }
    }

    /// Counts a sandbox stopped through this apiserver out of the local view of `node_id`
    /// (so queued creates see the room before the next poll; the poll's figures win then).
    pub fn note_stopped(&self, node_id: &str) {
        let Ok(mut nodes) = self.nodes.write() else {
            return;
        };
        if let Some(s) = nodes
            .iter_mut()
            .find(|n| n.node_id.as_deref() == Some(node_id))
            .and_then(|n| n.status.as_mut())
        {
            s.sandboxes_running = s.sandboxes_running.saturating_sub(1);
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

    /// How long node `node_id` has been unhealthy since it last answered; `None` while it is
    /// healthy, unknown, or has not answered since this apiserver started.
    pub fn silent_for(&self, node_id: &str) -> Option<std::time::Duration> {
        let nodes = self.nodes.read().ok()?;
        let n = nodes
            .iter()
            .find(|n| n.node_id.as_deref() == Some(node_id))?;
        (!n.healthy).then_some(())?;
        n.last_seen.map(|t| t.elapsed())
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

    /// Stores the answer of a poll sent at `started`. Placements the edge answered before
    /// `started` are in the edge's figures; those answered since may or may not be (the edge
    /// computed its status at some point while the poll was in flight), so they stay counted as
    /// far as the local view (which has them) is above the edge's figures.
    fn record(&self, index: usize, result: Result<NodeStatus, PollError>, started: Instant) {
        let Ok(mut nodes) = self.nodes.write() else {
            return;
        };
        let result = result.map(|status| {
            let mut placed = self.placed.lock().unwrap_or_else(|p| p.into_inner());
            let recent: &[Placed] = match placed.get_mut(index) {
                Some(list) => {
                    list.retain(|p| p.at >= started);
                    list
                }
                None => &[],
            };
            let local = nodes.get(index).and_then(|n| n.status.as_ref());
            add_unseen(status, local, recent)
        });
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
                n.last_error = Some(e.to_string());
            }
        }
    }

    /// Records a successful poll of the node at `index` (tests of other modules).
    #[cfg(test)]
    pub(crate) fn record_ok(&self, index: usize, status: NodeStatus) {
        self.record(index, Ok(status), Instant::now());
    }

    /// Polls every edge once, concurrently.
    pub async fn poll_once(&self, http: &reqwest::Client) {
        let endpoints = self.endpoints();
        let polls = endpoints.into_iter().enumerate().map(|(i, e)| async move {
            let started = Instant::now();
            (i, fetch_status(http, &e).await, started)
        });
        for (i, r, started) in futures::future::join_all(polls).await {
            self.record(i, r, started);
        }
    }

    /// Polls the node at `index` now (a node that just joined).
    pub async fn poll_index(&self, http: &reqwest::Client, index: usize) {
        let Some((e, _)) = self.endpoint_at(index) else {
            return;
        };
        let started = Instant::now();
        let r = fetch_status(http, &e).await;
        self.record(index, r, started);
    }

    /// Polls the edges whose index is `slice` modulo `slices`, concurrently.
    pub async fn poll_slice(&self, http: &reqwest::Client, slice: usize, slices: usize) {
        let endpoints: Vec<(usize, EdgeEndpoint)> = self.with(|nodes| {
            nodes
                .iter()
                .filter(|n| n.index % slices.max(1) == slice)
                .map(|n| (n.index, n.endpoint.clone()))
                .collect()
        });
        let polls = endpoints.into_iter().map(|(i, e)| async move {
            let started = Instant::now();
            (i, fetch_status(http, &e).await, started)
        });
        for (i, r, started) in futures::future::join_all(polls).await {
            self.record(i, r, started);
        }
    }

    /// Starts polling: every edge once per `period`, first polls right away. The edges are
    /// polled in `POLL_SLICES` groups spread over the period rather than all at once, so 160
    /// status answers do not arrive in one burst that delays the creates in flight.
    pub fn spawn(&self, http: reqwest::Client, period: Duration) -> JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period / POLL_SLICES as u32);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut slice = 0;
            loop {
                tick.tick().await;
                me.poll_slice(&http, slice, POLL_SLICES).await;
                slice = (slice + 1) % POLL_SLICES;
            }
        })
    }
}

/// `polled` plus the `recent` placements it may not include yet: at most as many as the local
/// view (`local`, which counts every placement) has above `polled`.
fn add_unseen(mut polled: NodeStatus, local: Option<&NodeStatus>, recent: &[Placed]) -> NodeStatus {
    let (Some(local), false) = (local, recent.is_empty()) else {
        return polled;
    };
    let used = |s: &NodeStatus| s.sandboxes_running + s.sandboxes_paused;
    let count = (recent.len() as u64).min(used(local).saturating_sub(used(&polled)));
    let mem: u64 = recent.iter().map(|p| p.memory_mb).sum();
    let mem = mem.min(
        local
            .memory_mb_allocated
            .saturating_sub(polled.memory_mb_allocated),
    );
    let cpu: f64 = recent.iter().map(|p| p.cpu).sum();
    let cpu = cpu.min((local.cpu_cores_allocated - polled.cpu_cores_allocated).max(0.0));
    polled.sandboxes_running += count;
    polled.memory_mb_allocated += mem;
    polled.cpu_cores_allocated += cpu;
    polled
}

/// Why one poll of an edge's status failed (kept as the node's `last_error`).
#[derive(Debug, thiserror::Error)]
enum PollError {
    #[error("GET {url}/edge/v1/status: {source}")]
    Send { url: String, source: reqwest::Error },
    #[error("GET {url}/edge/v1/status: {status}: {body}")]
    Status {
        url: String,
        status: reqwest::StatusCode,
        body: String,
    },
    #[error("decode status of {url}: {source}")]
    Decode { url: String, source: reqwest::Error },
}

async fn fetch_status(http: &reqwest::Client, e: &EdgeEndpoint) -> Result<NodeStatus, PollError> {
    let resp = http
        .get(format!("{}/edge/v1/status", e.url))
        .bearer_auth(&e.token)
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .map_err(|source| PollError::Send {
            url: e.url.clone(),
            source,
        })?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        return Err(PollError::Status {
            url: e.url.clone(),
            status,
            body,
        });
    }
    resp.json::<NodeStatus>()
        .await
        .map_err(|source| PollError::Decode {
            url: e.url.clone(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(running: u64) -> NodeStatus {
        NodeStatus {
            node: "n1".into(),
            url: "http://n1.example.test".into(),
            healthy: true,
            substrates: vec![],
            sandboxes_running: running,
            sandboxes_paused: 0,
            capacity_sandboxes: 10,
            cpu_cores_total: 8.0,
            cpu_cores_allocated: running as f64,
            memory_mb_total: 10_000,
            memory_mb_allocated: running * 100,
            memory_mb_available: 10_000,
            images: vec![],
            cgroup_version: "v1".into(),
            labels: Default::default(),
            ..Default::default()
        }
    }

    fn watcher() -> Watcher {
        Watcher::new(&[EdgeEndpoint {
            url: "http://n1.example.test".into(),
            token: "t".into(),
            node_id: None,
        }])
    }

    fn running(w: &Watcher) -> u64 {
        w.with(|n| n[0].status.as_ref().map(|s| s.sandboxes_running))
            .unwrap_or(0)
    }

    #[test]
    fn a_poll_in_flight_does_not_forget_placements_it_missed() {
        let w = watcher();
        w.record(0, Ok(status(3)), Instant::now());
        let started = Instant::now();
        w.note_placed(0, 100, 1.0);
        w.note_placed(0, 100, 1.0);
        assert_eq!(running(&w), 5);
        // The edge computed its answer before both creates reached it.
        w.record(0, Ok(status(3)), started);
        assert_eq!(running(&w), 5);
        w.with(|n| {
            let s = n[0].status.as_ref().unwrap();
            assert_eq!((s.memory_mb_allocated, s.cpu_cores_allocated), (500, 5.0));
        });
        // ... or after one of them: not counted twice.
        let started = Instant::now();
        w.note_placed(0, 100, 1.0);
        w.record(0, Ok(status(5)), started);
        assert_eq!(running(&w), 6);
        // A poll sent after the placements replaces the local figures (deletes show up).
        w.record(0, Ok(status(2)), Instant::now());
        assert_eq!(running(&w), 2);
    }
}
