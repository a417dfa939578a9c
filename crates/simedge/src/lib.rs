//! **Simulated edge — a test and benchmark mode, never a way to run sandboxes.**
//!
//! A simulated edge speaks the edge HTTP API's lifecycle subset (`POST/GET /edge/v1/sandboxes`,
//! `GET/DELETE /edge/v1/sandboxes/{id}`, `POST /edge/v1/jobs/stop`, `GET /edge/v1/status`)
//! and keeps its sandboxes as records in memory. Nothing runs: every other route (shell, exec,
//! files, tty, pause, ...) answers `501 unsupported`.
//!
//! **Owns**: the in-memory records and the HTTP subset above. **Does not own admission**: a
//! create is validated by the real edge's `validate_create` and admitted by the real edge's
//! code — the sandbox count against `capacity`, then the QoS books (`dsec_node::qos::Qos`:
//! overcommit ratio, latency-sensitive floor, measured usage for best-effort) — and refusals
//! carry the real edge's wire codes ([`dsec_edge::EdgeError`]). A simulated sandbox is never
//! measured, so it counts like a running sandbox the real edge has not sampled yet (by its start
//! reservation). **Must not**: be linked into the production edge, or run anything.
//!
//! It exists so that one machine can stand up a cluster of 160 nodes to test and measure the
//! control plane (placement, quotas, the watcher, forwarding). A real `dsec_edge::Manager` with a
//! no-op driver would still mount image layers, create a directory and persist a record per
//! sandbox and run a TTL reaper and trajectory log per edge, which measures the edge's disk, not
//! the control plane, and costs ~10 MB per edge; this server costs a few hundred bytes per
//! sandbox and many of them can share one process and runtime ([`serve_many`]).
//!
//! Every status it reports carries the label `simulated=true`.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};

use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dsec_edge::config::EdgeConfig;
use dsec_edge::substrates::Substrates;
use dsec_edge::EdgeError;
use dsec_node::qos::{Caps, Qos, QosConfig};
use dsec_runtime::substrate::{
    BoxFut, Capabilities, CreateOptions, CreateSandboxError, LiveSandbox, SandboxSpec,
    Substrate as SubstrateImpl,
};
use dsec_wire::api::{
    codes, status_for_code, CreateSandboxRequest, ErrorBody, ErrorDetail, JobOpResult,
    LabelSelector, NodeStatus, SandboxInfo, SandboxList, SandboxState, Substrate,
};

/// Why a simulated edge refused a create.
#[derive(Debug, thiserror::Error)]
pub enum SimCreateError {
    /// Only container sandboxes are simulated.
    #[error("substrate {substrate:?} is not supported on simulated node {node}")]
    Unsupported { substrate: Substrate, node: String },
    /// Refused by the real edge's validation or admission.
    #[error(transparent)]
    Refused(#[from] EdgeError),
}

impl SimCreateError {
    /// The wire code (the real edge's for a refusal).
    pub fn code(&self) -> &'static str {
        match self {
            SimCreateError::Unsupported { .. } => codes::UNSUPPORTED,
            SimCreateError::Refused(e) => e.code(),
        }
    }
}

/// Configuration of one simulated edge.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub node_id: String,
    /// Most live sandboxes.
    pub capacity: u64,
    pub cpu_cores_total: f64,
    pub memory_mb_total: u64,
    pub cpu_overcommit: f64,
    pub memory_overcommit: f64,
    pub default_memory_mb: u64,
    pub default_cpu_cores: f64,
    /// `[edge.qos]` of the simulated node (default class, LS floor, usage limits).
    pub qos: QosConfig,
    pub labels: BTreeMap<String, String>,
    /// Images reported as cached (for layer-affinity tests).
    pub images: Vec<String>,
    /// Bearer token the apiserver must present.
    pub token: String,
    /// URL reported in the status.
    pub url: String,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            node_id: "sim0".into(),
            capacity: 5000,
            cpu_cores_total: 64.0,
            memory_mb_total: 256 * 1024,
            cpu_overcommit: 25.0,
            memory_overcommit: 4.0,
            default_memory_mb: 1024,
            default_cpu_cores: 1.0,
            qos: QosConfig::default(),
            labels: BTreeMap::new(),
            images: Vec::new(),
            token: String::new(),
            url: String::new(),
        }
    }
}

/// One tracked (not running) sandbox.
struct SimSandbox {
    image: Arc<str>,
    memory_mb: u64,
    cpu: f64,
    labels: BTreeMap<String, String>,
    created_at: Arc<str>,
    /// Its idempotency key, so a stop forgets it without scanning every key.
    idempotency_key: Option<String>,
}

#[derive(Default)]
struct SimState {
    live: HashMap<String, SimSandbox>,
    /// idempotency key → sandbox id (live sandboxes only).
    idem: HashMap<String, String>,
    /// Requests of the live sandboxes (the status's `*_allocated`).
    memory_mb: u64,
    cpu: f64,
    created_total: u64,
}

/// A simulated edge: state plus its router.
pub struct SimulatedEdge {
    cfg: SimConfig,
    /// The edge configuration the real validation and admission read (from `cfg`).
    edge: EdgeConfig,
    /// The real edge's admission books.
    qos: Qos,
    /// The registry the real validation asks: the container substrate's capabilities only.
    substrates: Substrates,
    state: Mutex<SimState>,
}

/// The container substrate as the real validation sees it (kind, capabilities, request
/// checks); a simulated edge books sandboxes and starts none, so its create refuses.
struct SimContainer;

impl SubstrateImpl for SimContainer {
    fn kind(&self) -> dsec_wire::api::Substrate {
        dsec_wire::api::Substrate::Container
    }
    fn capabilities(&self) -> Capabilities {
        dsec_runtime::container::substrate::CAPABILITIES
    }
    fn create(
        &self,
        _spec: SandboxSpec,
        _opts: CreateOptions,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, CreateSandboxError>> {
        Box::pin(async {
            Err(CreateSandboxError::Setup(
                "a simulated edge starts no sandbox".into(),
            ))
        })
    }
}

fn lock(m: &Mutex<SimState>) -> MutexGuard<'_, SimState> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn error(code: &str, message: impl Into<String>) -> Response {
    let status =
        StatusCode::from_u16(status_for_code(code)).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = ErrorBody {
        error: ErrorDetail {
            code: code.to_string(),
            message: message.into(),
        },
    };
    (status, Json(body)).into_response()
}

fn now_rfc3339() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // Seconds since the epoch is enough for a simulated record; keep it sortable.
    format!("@{secs:012}")
}

impl SimulatedEdge {
    pub fn new(cfg: SimConfig) -> Arc<Self> {
        let node = cfg.node_id.clone();
        let edge = EdgeConfig {
            node_id: cfg.node_id.clone(),
            capacity: cfg.capacity,
            cpu_cores_total: Some(cfg.cpu_cores_total),
            memory_mb_total: Some(cfg.memory_mb_total),
            cpu_overcommit: cfg.cpu_overcommit,
            memory_overcommit: cfg.memory_overcommit,
            default_memory_mb: cfg.default_memory_mb,
            default_cpu_cores: cfg.default_cpu_cores,
            qos: cfg.qos.clone(),
            labels: cfg.labels.clone(),
            ..Default::default()
        };
        // No kernel is probed: a simulated node has no QoS capabilities.
        let qos = Qos::with_caps(&cfg.qos, Caps::default());
        Arc::new(SimulatedEdge {
            cfg,
            edge,
            qos,
            substrates: Substrates::only(&node, Arc::new(SimContainer)),
            state: Mutex::new(SimState::default()),
        })
    }

    pub fn config(&self) -> &SimConfig {
        &self.cfg
    }

    fn info(&self, id: &str, s: &SimSandbox, state: SandboxState) -> SandboxInfo {
        SandboxInfo {
            id: id.to_string(),
            node: self.cfg.node_id.clone(),
            state,
            substrate: Substrate::Container,
            image: s.image.to_string(),
            memory_limit_mb: s.memory_mb,
            cpu_cores_limit: s.cpu,
            labels: s.labels.clone(),
            created_at: s.created_at.to_string(),
            reason: (state == SandboxState::Stopped).then(|| "stopped on request".to_string()),
            ..Default::default()
        }
    }

    /// Admission and bookkeeping of one create: the real edge's validation, idempotency,
    /// capacity and QoS admission, in the real edge's order.
    pub fn create(&self, req: &CreateSandboxRequest) -> Result<SandboxInfo, SimCreateError> {
        if req.image.is_empty() {
            return Err(EdgeError::BadRequest("image must not be empty".into()).into());
        }
        if req.substrate != Substrate::Container {
            return Err(SimCreateError::Unsupported {
                substrate: req.substrate,
                node: self.cfg.node_id.clone(),
            });
        }
        let v = dsec_edge::manager::validate_create(&self.edge, &self.substrates, req)?;
        let (memory_mb, cpu) = (v.memory_mb, v.cpu);
        let mut st = lock(&self.state);
        if let Some(k) = &req.idempotency_key {
            if let Some(id) = st.idem.get(k) {
                if let Some(s) = st.live.get(id) {
                    return Ok(self.info(id, s, SandboxState::Running));
                }
            }
        }
        let node = &self.cfg.node_id;
        if st.live.len() as u64 >= self.cfg.capacity {
            return Err(EdgeError::NodeFull(format!(
                "node {node} is full: {} of {} sandboxes in use",
                st.live.len(),
                self.cfg.capacity
            ))
            .into());
        }
        let id = loop {
            let id = dsec_wire::id::make_sandbox_id(node, rand::random());
            if !st.live.contains_key(&id) {
                break id;
            }
        };
        // Memory and CPU: the real edge's books (overcommit by measured usage with a
        // latency-sensitive floor); the sandbox "starts" at once.
        self.qos
            .admit(&self.edge.capacity(), &id, v.qos, memory_mb, cpu)
            .map_err(|r| {
                EdgeError::NodeFull(format!(
                    "node {node} is full for a {:?} sandbox: {r}",
                    v.qos
                ))
            })?;
        self.qos.started(&id);
        let s = SimSandbox {
            image: Arc::from(req.image.as_str()),
            memory_mb,
            cpu,
            labels: req.labels.clone(),
            created_at: Arc::from(now_rfc3339().as_str()),
            idempotency_key: req.idempotency_key.clone(),
        };
        let info = self.info(&id, &s, SandboxState::Running);
        st.memory_mb += memory_mb;
        st.cpu += cpu;
        st.created_total += 1;
        if let Some(k) = &req.idempotency_key {
            st.idem.insert(k.clone(), id.clone());
        }
        st.live.insert(id, s);
        Ok(info)
    }

    /// Removes a sandbox; `None` when unknown.
    pub fn stop(&self, id: &str) -> Option<SandboxInfo> {
        let mut st = lock(&self.state);
        let s = st.live.remove(id)?;
        self.qos.release(id);
        st.memory_mb = st.memory_mb.saturating_sub(s.memory_mb);
        st.cpu = (st.cpu - s.cpu).max(0.0);
        if let Some(k) = &s.idempotency_key {
            if st.idem.get(k).is_some_and(|v| v == id) {
                st.idem.remove(k);
            }
        }
        Some(self.info(id, &s, SandboxState::Stopped))
    }

    pub fn status(&self) -> NodeStatus {
        let st = lock(&self.state);
        let mut labels = self.cfg.labels.clone();
        labels.insert("simulated".into(), "true".into());
        NodeStatus {
            node: self.cfg.node_id.clone(),
            url: self.cfg.url.clone(),
            healthy: true,
            substrates: vec![Substrate::Container],
            sandboxes_running: st.live.len() as u64,
            sandboxes_paused: 0,
            capacity_sandboxes: self.cfg.capacity,
            cpu_cores_total: self.cfg.cpu_cores_total,
            cpu_cores_allocated: st.cpu,
            memory_mb_total: self.cfg.memory_mb_total,
            memory_mb_allocated: st.memory_mb,
            memory_mb_available: self.cfg.memory_mb_total.saturating_sub(st.memory_mb),
            images: self.cfg.images.clone(),
            cgroup_version: "simulated".into(),
            labels,
            capabilities: Some(self.qos.caps().to_wire()),
            admission: Some(self.qos.status(&self.edge.capacity())),
            membership: None,
        }
    }

    pub fn list(&self) -> SandboxList {
        let st = lock(&self.state);
        let sandboxes = st
            .live
            .iter()
            .map(|(id, s)| self.info(id, s, SandboxState::Running))
            .collect();
        SandboxList { sandboxes }
    }

    /// The HTTP router (same paths and token rule as a real edge).
    pub fn router(self: &Arc<Self>) -> Router {
        let api = Router::new()
            .route("/edge/v1/sandboxes", post(create).get(list))
            .route("/edge/v1/sandboxes/{id}", get(get_one).delete(stop))
            .route("/edge/v1/jobs/{op}", post(job))
            .route("/edge/v1/status", get(status))
            .fallback(unsupported)
            .route_layer(middleware::from_fn_with_state(self.clone(), auth));
        Router::new()
            .route("/healthz", get(|| async { "ok\n" }))
            .merge(api)
            .fallback(unsupported)
            .with_state(self.clone())
    }
}

type St = State<Arc<SimulatedEdge>>;

async fn auth(State(s): St, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    if s.cfg.token.is_empty() || presented == Some(s.cfg.token.as_str()) {
        next.run(req).await
    } else {
        error(codes::UNAUTHORIZED, "wrong or missing edge token")
    }
}

async fn create(State(s): St, body: axum::body::Bytes) -> Response {
    let req: CreateSandboxRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(codes::BAD_REQUEST, format!("invalid create request: {e}")),
    };
    match s.create(&req) {
        Ok(info) => (StatusCode::CREATED, Json(info)).into_response(),
        Err(e) => error(e.code(), e.to_string()),
    }
}

async fn list(State(s): St) -> Json<SandboxList> {
    Json(s.list())
}

async fn get_one(State(s): St, Path(id): Path<String>) -> Response {
    let st = lock(&s.state);
    match st.live.get(&id) {
        Some(sb) => Json(s.info(&id, sb, SandboxState::Running)).into_response(),
        None => error(
            codes::SANDBOX_NOT_FOUND,
            format!("sandbox {id:?} not found"),
        ),
    }
}

async fn stop(State(s): St, Path(id): Path<String>) -> Response {
    match s.stop(&id) {
        Some(info) => Json(info).into_response(),
        None => error(
            codes::SANDBOX_NOT_FOUND,
            format!("sandbox {id:?} not found"),
        ),
    }
}

async fn job(State(s): St, Path(op): Path<String>, body: axum::body::Bytes) -> Response {
    if op != "stop" {
        return error(
            codes::UNSUPPORTED,
            format!("job {op} is not supported on a simulated edge (test/benchmark mode)"),
        );
    }
    let sel: LabelSelector = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return error(codes::BAD_REQUEST, format!("invalid label selector: {e}")),
    };
    let ids: Vec<String> = {
        let st = lock(&s.state);
        st.live
            .iter()
            .filter(|(_, sb)| sel.labels.iter().all(|(k, v)| sb.labels.get(k) == Some(v)))
            .map(|(id, _)| id.clone())
            .collect()
    };
    let mut out = JobOpResult {
        matched: ids.len() as u64,
        ..Default::default()
    };
    for id in ids {
        if s.stop(&id).is_some() {
            out.succeeded += 1;
        }
        out.sandboxes.push(id);
    }
    Json(out).into_response()
}

async fn status(State(s): St) -> Json<NodeStatus> {
    Json(s.status())
}

async fn unsupported(req: Request) -> Response {
    error(
        codes::UNSUPPORTED,
        format!(
            "{} {} is not supported: this is a simulated edge (test/benchmark mode) that tracks sandboxes without running them",
            req.method(),
            req.uri().path()
        ),
    )
}

/// Serves each edge on its own already-bound listener, all in this runtime.
pub fn serve_many(
    edges: Vec<(Arc<SimulatedEdge>, tokio::net::TcpListener)>,
) -> Vec<tokio::task::JoinHandle<()>> {
    edges
        .into_iter()
        .map(|(edge, listener)| {
            let router = edge.router();
            tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, router).await {
                    tracing::error!(error = %e, "simulated edge stopped serving");
                }
            })
        })
        .collect()
}

/// `http://addr`.
pub fn url_of(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_until_full_and_idempotent() {
        let e = SimulatedEdge::new(SimConfig {
            capacity: 2,
            ..Default::default()
        });
        let req = CreateSandboxRequest {
            image: "busybox".into(),
            idempotency_key: Some("k".into()),
            ..Default::default()
        };
        let a = e.create(&req).unwrap();
        let again = e.create(&req).unwrap();
        assert_eq!(a.id, again.id);
        let b = e
            .create(&CreateSandboxRequest {
                image: "busybox".into(),
                ..Default::default()
            })
            .unwrap();
        let full = e
            .create(&CreateSandboxRequest {
                image: "busybox".into(),
                ..Default::default()
            })
            .unwrap_err();
        assert_eq!(full.code(), codes::NODE_FULL);
        assert_eq!(e.status().sandboxes_running, 2);
        assert!(e.stop(&b.id).is_some());
        assert!(e.stop(&b.id).is_none());
        assert_eq!(e.status().memory_mb_allocated, 1024);
        assert_eq!(
            e.status().labels.get("simulated").map(String::as_str),
            Some("true")
        );
    }

    #[test]
    fn refuses_what_the_real_edge_refuses() {
        let e = SimulatedEdge::new(SimConfig::default());
        // The real edge's validation: too little memory is the caller's mistake.
        let bad = e
            .create(&CreateSandboxRequest {
                image: "busybox".into(),
                memory_limit_mb: Some(4),
                ..Default::default()
            })
            .unwrap_err();
        assert_eq!(bad.code(), codes::BAD_REQUEST);
        assert!(bad.to_string().contains("memory_limit_mb 4"), "{bad}");
        let vm = e
            .create(&CreateSandboxRequest {
                image: "busybox".into(),
                substrate: Substrate::Microvm,
                ..Default::default()
            })
            .unwrap_err();
        assert_eq!(vm.code(), codes::UNSUPPORTED);
    }

    #[test]
    fn admits_by_the_real_edges_qos_rules() {
        use dsec_wire::api::QosClass;
        // 1 GiB node, overcommit 4, LS floor 1.0: LS requests stay within physical memory.
        let e = SimulatedEdge::new(SimConfig {
            memory_mb_total: 1024,
            qos: QosConfig {
                ls_memory_ratio: 1.0,
                ..Default::default()
            },
            ..Default::default()
        });
        let ls = |mb| CreateSandboxRequest {
            image: "busybox".into(),
            memory_limit_mb: Some(mb),
            qos: Some(QosClass::LatencySensitive),
            ..Default::default()
        };
        let be = |mb| CreateSandboxRequest {
            qos: Some(QosClass::BestEffort),
            ..ls(mb)
        };
        e.create(&ls(768)).unwrap();
        let full = e.create(&ls(512)).unwrap_err();
        assert_eq!(full.code(), codes::NODE_FULL);
        assert!(
            full.to_string().contains("latency-sensitive floor"),
            "{full}"
        );
        // Best-effort counts by usage (a simulated sandbox by its start reservation), so a
        // request past the LS floor still fits under the overcommit ratio.
        e.create(&be(2048)).unwrap();
        let st = e.status();
        let adm = st.admission.expect("admission figures reported");
        assert_eq!(adm.memory_mb_committed_ls, 768);
        assert_eq!(adm.memory_mb_committed_be, 2048);
        assert_eq!(adm.memory_mb_free_ls, 256);
    }
}
