//! Sandbox lifecycle: validation, admission, create, watch, stop, and recovery after a crash.
//!
//! Every operation the HTTP API offers is one method here; the transport only parses and maps.
//!
//! A sandbox's life: `create` validates the request, admits it against capacity and the
//! node's (overcommitted) CPU and memory, takes a lease on its image's mounted layers, asks the
//! substrate for the sandbox and persists a record. A watcher task per sandbox notices when it
//! dies on its own (its aether exited or the channel broke) and cleans up exactly like `stop`
//! does, leaving a tombstone (state `failed` + reason) so `GET` can tell what happened.
//!
//! One file per verb: [`validate`] (requests, pure), [`create`] (admission and build),
//! [`stop`] (watch, teardown, shutdown), [`pause`] (pause, resume, idle and pressure pauses),
//! [`recover`] (re-adoption after a crash), [`jobs`] (label-selected operations), [`proxy`]
//! (commands, files and TTYs passed to the sandbox's agent), [`network`] (a sandbox's network
//! rules), [`images`] (image store and pack_diff), [`policies`] (what the TTL reaper and the
//! node's policies see). This file holds the manager, its per-sandbox entry and the lookups.

mod admission_queue;
mod agent;
mod create;
mod images;
mod jobs;
mod network;
mod pause;
mod policies;
mod ports;
mod proxy;
mod recover;
mod rollback;
mod stop;
mod ttl_update;
mod validate;

pub use crate::names::{validate_hostname, validate_user};
pub use agent::AgentLease;
pub use jobs::{labels_match, JobOp};
pub use validate::{validate_create, Validated};

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use dsec_image::{ImageLease, ImageStore};
use dsec_runtime::aether_client::AetherClient;
use dsec_runtime::substrate::LiveSandbox;
use dsec_wire::api::EndReason;
use dsec_wire::api::{NodeStatus, SandboxInfo, SandboxList, SandboxState, Substrate};
use dsec_wire::id::is_valid_sandbox_id;
use tokio::sync::OnceCell;

use crate::commands::CommandDefaults;
use crate::config::EdgeConfig;
use crate::error::EdgeError;
use crate::metrics::Metrics;
use crate::records::{self, SandboxRecord};
use crate::substrates::Substrates;

/// Formats seconds since the epoch as RFC 3339 UTC (`2026-01-31T12:00:00Z`).
pub fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

fn now_rfc3339() -> String {
    rfc3339(now_ms() / 1000)
}

/// Milliseconds since the epoch.
pub use dsec_node::now_ms;

/// Marks a sandbox busy (the idle clock does not run) while alive.
struct Busy(Arc<Entry>);

impl Busy {
    fn new(e: Arc<Entry>) -> Self {
        e.inflight.fetch_add(1, Ordering::SeqCst);
        Busy(e)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.last_request_ms.store(now_ms(), Ordering::SeqCst);
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl std::ops::Deref for Busy {
    type Target = Arc<Entry>;
    fn deref(&self) -> &Arc<Entry> {
        &self.0
    }
}

/// How a sandbox ended.
#[derive(Debug, Clone)]
enum End {
    Stopped(EndReason, String),
    Died,
}

/// One live sandbox.
struct Entry {
    id: String,
    dir: PathBuf,
    info: Mutex<SandboxInfo>,
    sandbox: Arc<dyn LiveSandbox>,
    aether: AetherClient,
    lease: Mutex<Option<ImageLease>>,
    memory_mb: u64,
    cpu: f64,
    ended: OnceCell<SandboxInfo>,
    /// Environment of the create request (persisted in the record).
    env: std::collections::BTreeMap<String, String>,
    created_ms: u64,
    /// The idle clock: when the last request touched the sandbox (epoch ms).
    last_request_ms: AtomicU64,
    /// Requests running right now (the idle TTL waits for them).
    inflight: AtomicU64,
    /// Serialises pause and resume.
    op: tokio::sync::Mutex<()>,
}

impl Entry {
    fn info(&self) -> SandboxInfo {
        let mut i = lock(&self.info).clone();
        i.last_request_at = Some(rfc3339(self.last_request_ms.load(Ordering::SeqCst) / 1000));
        i
    }

    fn record(&self) -> SandboxRecord {
        SandboxRecord {
            info: self.info(),
            pid: self.sandbox.pid(),
            image: lock(&self.info).image.clone(),
            env: self.env.clone(),
            created_ms: self.created_ms,
            last_request_ms: self.last_request_ms.load(Ordering::SeqCst),
        }
    }

    fn persist(&self) {
        if let Err(e) = records::write(&self.dir, &self.record()) {
            tracing::error!(sandbox = %self.id, error = %e, "persist sandbox record");
        }
    }
}

#[derive(Default)]
struct State {
    live: HashMap<String, Arc<Entry>>,
    /// Creates admitted but not finished: id → idempotency key.
    creating: HashMap<String, Option<String>>,
    count: u64,
    memory_mb: u64,
    cpu: f64,
    tombstones: HashMap<String, SandboxInfo>,
    tomb_order: VecDeque<String>,
    /// idempotency key → sandbox id.
    idempotency: HashMap<String, String>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The sandbox manager of one node.
pub struct Manager {
    cfg: Arc<EdgeConfig>,
    /// The substrates of this node, by name.
    substrates: Substrates,
    images: Arc<ImageStore>,
    metrics: Arc<Metrics>,
    state: Mutex<State>,
    shutting_down: AtomicBool,
    traj: Arc<crate::trajectory::Trajectories>,
    net: Arc<dsec_network::Network>,
    /// QoS capabilities and admission books (issue 10).
    qos: Arc<dsec_node::qos::Qos>,
    /// `cfg` as admission sees it: see [`Manager::admission_cfg`].
    admission_cfg: Mutex<(Option<Instant>, Arc<EdgeConfig>)>,
    /// This node's named volumes and which sandboxes mount them.
    volumes: Arc<crate::volumes::Volumes>,
}

impl Manager {
    pub fn new(
        cfg: Arc<EdgeConfig>,
        substrates: Substrates,
        images: Arc<ImageStore>,
        metrics: Arc<Metrics>,
    ) -> Self {
        let qos = Arc::new(dsec_node::qos::Qos::new(&cfg.qos));
        let traj = Arc::new(crate::trajectory::Trajectories::new(
            cfg.trajectory.clone(),
            cfg.edge_dir().join("trajectories"),
        ));
        let volumes = Arc::new(crate::volumes::Volumes::new(cfg.edge_dir().join("volumes")));
        Self {
            volumes,
            traj,
            net: dsec_network::Network::new(cfg.network.clone()),
            admission_cfg: Mutex::new((None, cfg.clone())),
            cfg,
            substrates,
            images,
            metrics,
            state: Mutex::new(State::default()),
            shutting_down: AtomicBool::new(false),
            qos,
        }
    }

    /// What `kind`'s substrate keeps to start sandboxes faster (`GET
    /// /edge/v1/microvm/templates`).
    pub fn templates(&self, kind: Substrate) -> Result<serde_json::Value, EdgeError> {
        self.substrates
            .get(kind)?
            .templates()
            .ok_or_else(|| self.no_templates(kind))
    }

    /// Removes those (`DELETE /edge/v1/microvm/templates`); how many.
    pub fn remove_templates(&self, kind: Substrate) -> Result<usize, EdgeError> {
        self.substrates
            .get(kind)?
            .remove_templates()
            .ok_or_else(|| self.no_templates(kind))
    }

    fn no_templates(&self, kind: Substrate) -> EdgeError {
        EdgeError::Unsupported(format!(
            "{} templates are off on this node",
            self.substrates.label(kind)
        ))
    }

    /// This node's volumes.
    pub fn volumes(&self) -> &Arc<crate::volumes::Volumes> {
        &self.volumes
    }

    pub fn config(&self) -> &EdgeConfig {
        &self.cfg
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// QoS capabilities and admission books.
    pub fn qos(&self) -> &Arc<dsec_node::qos::Qos> {
        &self.qos
    }

    /// The trajectory logs; `trajectory().note(id, kind, request, result)` records a state change.
    pub fn trajectory(&self) -> &Arc<crate::trajectory::Trajectories> {
        &self.traj
    }

    fn cmd_defaults(&self) -> CommandDefaults {
        CommandDefaults {
            default_timeout_s: self.cfg.default_timeout_s,
            max_timeout_s: self.cfg.max_timeout_s,
        }
    }

    /// Remembers an ended sandbox (bounded).
    fn tombstone(&self, st: &mut State, info: SandboxInfo) {
        let id = info.id.clone();
        st.tombstones.insert(id.clone(), info);
        st.tomb_order.push_back(id);
        while st.tomb_order.len() > self.cfg.tombstones {
            if let Some(old) = st.tomb_order.pop_front() {
                st.tombstones.remove(&old);
                st.idempotency.retain(|_, v| *v != old);
            }
        }
    }

    fn entry(&self, id: &str) -> Result<Arc<Entry>, EdgeError> {
        if !is_valid_sandbox_id(id) {
            return Err(EdgeError::SandboxNotFound(id.to_string()));
        }
        let st = lock(&self.state);
        if let Some(e) = st.live.get(id) {
            return Ok(e.clone());
        }
        match st.tombstones.get(id) {
            Some(t) => Err(EdgeError::SandboxDead(format!(
                "sandbox {id} is {}{}: {}",
                serde_json::to_value(t.state)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
                t.end_reason.map(|r| format!(" ({r})")).unwrap_or_default(),
                t.reason.as_deref().unwrap_or("ended")
            ))),
            None => Err(EdgeError::SandboxNotFound(id.to_string())),
        }
    }

    /// A running sandbox (not paused), without touching the idle clock.
    fn running(&self, id: &str) -> Result<Arc<Entry>, EdgeError> {
        let e = self.entry(id)?;
        if e.ended.initialized() || lock(&e.info).state != SandboxState::Running {
            return Err(EdgeError::SandboxDead(format!(
                "sandbox {id} is not running (resume it first if it is paused)"
            )));
        }
        Ok(e)
    }

    /// A running sandbox, for calls that need its agent: resets the idle clock and resumes a
    /// paused sandbox first (transparent resume). The sandbox counts as busy (the idle TTL
    /// waits) while the returned guard lives.
    async fn touch(&self, id: &str) -> Result<Busy, EdgeError> {
        let e = Busy::new(self.entry(id)?);
        e.last_request_ms.store(now_ms(), Ordering::SeqCst);
        let state = lock(&e.info).state;
        if state == SandboxState::Paused {
            self.resume_entry(&e).await?;
        }
        if e.ended.initialized() || lock(&e.info).state != SandboxState::Running {
            return Err(EdgeError::SandboxDead(format!("sandbox {id} is stopping")));
        }
        Ok(e)
    }
    pub fn get(&self, id: &str) -> Result<SandboxInfo, EdgeError> {
        match self.entry(id) {
            Ok(e) => Ok(e.info()),
            Err(EdgeError::SandboxDead(_)) => {
                let st = lock(&self.state);
                st.tombstones
                    .get(id)
                    .cloned()
                    .ok_or_else(|| EdgeError::SandboxNotFound(id.to_string()))
            }
            Err(e) => Err(e),
        }
    }

    /// The live sandboxes (and with `q.ended`/`q.end_reason` the remembered ended ones).
    pub fn list(&self, q: &dsec_wire::api::ListSandboxesQuery) -> SandboxList {
        let (entries, ended): (Vec<Arc<Entry>>, Vec<SandboxInfo>) = {
            let st = lock(&self.state);
            let ended = if crate::end_reason::wants_ended(q) {
                st.tombstones
                    .values()
                    .filter(|t| crate::end_reason::matches(q, t))
                    .cloned()
                    .collect()
            } else {
                Vec::new()
            };
            let live = if q.end_reason.is_some() {
                Vec::new()
            } else {
                st.live.values().cloned().collect()
            };
            (live, ended)
        };
        let mut sandboxes: Vec<SandboxInfo> = entries.iter().map(|e| e.info()).collect();
        sandboxes.extend(ended);
        sandboxes.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        SandboxList { sandboxes }
    }

    /// The node's status as the watcher polls it.
    pub fn status(&self) -> NodeStatus {
        let (live, paused, memory_mb, cpu) = {
            let st = lock(&self.state);
            let paused = st
                .live
                .values()
                .filter(|e| lock(&e.info).state == SandboxState::Paused)
                .count() as u64;
            (st.live.len() as u64, paused, st.memory_mb, st.cpu)
        };
        let running = live - paused;
        NodeStatus {
            node: self.cfg.node_id.clone(),
            url: self.cfg.url(),
            healthy: !self.shutting_down.load(Ordering::Relaxed),
            substrates: self.substrates.kinds(),
            sandboxes_running: running,
            sandboxes_paused: paused,
            capacity_sandboxes: self.cfg.capacity,
            cpu_cores_total: self.cfg.cpu_total(),
            cpu_cores_allocated: cpu,
            memory_mb_total: self.cfg.memory_total_mb(),
            memory_mb_allocated: memory_mb,
            memory_mb_available: crate::config::machine_meminfo_mb("MemAvailable").unwrap_or(0),
            images: self.images.list().into_iter().map(|i| i.name).collect(),
            cgroup_version: cgroup_version().to_string(),
            labels: self.cfg.labels.clone(),
            capabilities: Some(self.qos.caps().to_wire()),
            admission: Some(self.qos.status(&self.cfg.capacity())),
            membership: None,
        }
    }
}

/// `v1` or `v2`: the host's cgroup version as the runtime detects it (the one rule).
pub fn cgroup_version() -> &'static str {
    dsec_runtime::cgroup::CgroupRoot::detect().version.as_str()
}

/// Removes a directory tree; a missing one is fine.
fn remove_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use dsec_runtime::substrate::{CreateOptions, SandboxSpec};
    use dsec_wire::api::Substrate;

    /// Admission is pure bookkeeping: a substrate that must never be called is enough.
    pub(crate) struct NoDriver;

    impl dsec_runtime::substrate::Substrate for NoDriver {
        fn kind(&self) -> Substrate {
            Substrate::Container
        }
        fn capabilities(&self) -> dsec_runtime::substrate::Capabilities {
            dsec_runtime::container::substrate::CAPABILITIES
        }
        fn create(
            &self,
            _spec: SandboxSpec,
            _opts: CreateOptions,
        ) -> dsec_runtime::substrate::BoxFut<
            '_,
            Result<Box<dyn LiveSandbox>, dsec_runtime::substrate::CreateSandboxError>,
        > {
            unreachable!("admission tests do not create sandboxes")
        }
    }

    fn manager(cfg: EdgeConfig, dir: &Path) -> Manager {
        let images = Arc::new(ImageStore::open(dir.join("images")).unwrap());
        Manager::new(
            Arc::new(cfg),
            Substrates::only("n0", Arc::new(NoDriver)),
            images,
            Arc::new(Metrics::new("n0")),
        )
    }

    fn limits(memory_mb: u64, cpu: f64) -> Validated {
        Validated {
            image: "busybox:latest".into(),
            workspace: None,
            toolkits: Vec::new(),
            memory_mb,
            cpu,
            pids: 64,
            user: "root".into(),
            hostname: None,
            qos: Default::default(),
        }
    }

    #[test]
    fn admission() {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = EdgeConfig {
            capacity: 3,
            memory_mb_total: Some(1000),
            memory_overcommit: 1.0,
            cpu_cores_total: Some(2.0),
            cpu_overcommit: 2.0,
            ..EdgeConfig::default()
        };
        let m = manager(cfg, tmp.path());
        assert!(m
            .admit("sb-n0-0000000000000001", &limits(600, 1.0), Some("k"))
            .unwrap()
            .is_none());
        let e = m
            .admit("sb-n0-0000000000000002", &limits(500, 1.0), None)
            .unwrap_err();
        assert_eq!(e.code(), "node_full");
        assert!(e.to_string().contains("MiB"), "{e}");
        let e = m
            .admit("sb-n0-0000000000000002", &limits(100, 3.5), None)
            .unwrap_err();
        assert!(e.to_string().contains("cores"), "{e}");
        let e = m
            .admit("sb-n0-0000000000000002", &limits(100, 1.0), Some("k"))
            .unwrap_err();
        assert_eq!(
            e.code(),
            "conflict",
            "same idempotency key while the first create runs"
        );
        assert!(m
            .admit("sb-n0-0000000000000002", &limits(100, 1.0), None)
            .unwrap()
            .is_none());
        assert!(m
            .admit("sb-n0-0000000000000003", &limits(100, 1.0), None)
            .unwrap()
            .is_none());
        let e = m
            .admit("sb-n0-0000000000000004", &limits(10, 0.1), None)
            .unwrap_err();
        assert!(e.to_string().contains("3 of 3"), "{e}");
        let st = m.status();
        assert_eq!(
            st.memory_mb_allocated, 800,
            "creates in progress count as allocated"
        );
        assert_eq!(st.sandboxes_running, 0);
        assert_eq!(st.capacity_sandboxes, 3);
    }

    #[test]
    fn unknown_and_malformed_ids() {
        let tmp = tempfile::tempdir().unwrap();
        let m = manager(EdgeConfig::default(), tmp.path());
        assert_eq!(m.get("../etc").unwrap_err().code(), "sandbox_not_found");
        assert_eq!(
            m.get("sb-n0-0000000000000001").unwrap_err().code(),
            "sandbox_not_found"
        );
        assert!(m.list(&Default::default()).sandboxes.is_empty());
    }

    #[test]
    fn time_format() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_767_225_599), "2025-12-31T23:59:59Z");
    }
}
