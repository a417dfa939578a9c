//! **Simulated edge — a test and benchmark mode, never a way to run sandboxes.**
//!
//! A simulated edge speaks the edge HTTP API's lifecycle subset (`POST/GET /edge/v1/sandboxes`,
//! `GET/DELETE /edge/v1/sandboxes/{id}`, `POST /edge/v1/jobs/stop`, `GET /edge/v1/status`)
//! and keeps its sandboxes as records in memory, with the same admission rules as a real
//! edge (capacity, CPU and memory with overcommit, idempotency keys). Nothing runs: every
//! other route (shell, exec, files, tty, pause, ...) answers `501 unsupported`.
//!
//! It exists so that one machine can stand up a cluster of 160 nodes to test and measure the
//! control plane (placement, quotas, the watcher, forwarding). A real [`crate::Manager`] with a
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
use dsec_wire::api::{
    codes, status_for_code, CreateSandboxRequest, ErrorBody, ErrorDetail, JobOpResult,
    LabelSelector, NodeStatus, SandboxInfo, SandboxList, SandboxState, Substrate,
};

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
    memory_mb: u64,
    cpu: f64,
    created_total: u64,
}

/// A simulated edge: state plus its router.
pub struct SimulatedEdge {
    cfg: SimConfig,
    state: Mutex<SimState>,
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
        Arc::new(SimulatedEdge {
            cfg,
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

    /// Admission and bookkeeping of one create.
    pub fn create(&self, req: &CreateSandboxRequest) -> Result<SandboxInfo, (String, String)> {
        if req.image.is_empty() {
            return Err((codes::BAD_REQUEST.into(), "image must not be empty".into()));
        }
        if req.substrate != Substrate::Container {
            return Err((
                codes::UNSUPPORTED.into(),
                format!(
                    "substrate {:?} is not supported on simulated node {}",
                    req.substrate, self.cfg.node_id
                ),
            ));
        }
        let memory_mb = req.memory_limit_mb.unwrap_or(self.cfg.default_memory_mb);
        let cpu = req.cpu_cores_limit.unwrap_or(self.cfg.default_cpu_cores);
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
            return Err((
                codes::NODE_FULL.into(),
                format!(
                    "node {node} is full: {} of {} sandboxes in use",
                    st.live.len(),
                    self.cfg.capacity
                ),
            ));
        }
        let mem_cap = (self.cfg.memory_mb_total as f64 * self.cfg.memory_overcommit) as u64;
        if st.memory_mb + memory_mb > mem_cap {
            return Err((
                codes::NODE_FULL.into(),
                format!(
                    "node {node} is full: memory {} + {memory_mb} MiB > {mem_cap} MiB",
                    st.memory_mb
                ),
            ));
        }
        let cpu_cap = self.cfg.cpu_cores_total * self.cfg.cpu_overcommit;
        if st.cpu + cpu > cpu_cap + 1e-9 {
            return Err((
                codes::NODE_FULL.into(),
                format!(
                    "node {node} is full: {:.2} + {cpu} cores > {cpu_cap:.2}",
                    st.cpu
                ),
            ));
        }
        let id = loop {
            let id = dsec_wire::id::make_sandbox_id(node, rand::random());
            if !st.live.contains_key(&id) {
                break id;
            }
        };
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
            ..Default::default()
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
        Err((code, msg)) => error(&code, msg),
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
        assert_eq!(full.0, codes::NODE_FULL);
        assert_eq!(e.status().sandboxes_running, 2);
        assert!(e.stop(&b.id).is_some());
        assert!(e.stop(&b.id).is_none());
        assert_eq!(e.status().memory_mb_allocated, 1024);
        assert_eq!(
            e.status().labels.get("simulated").map(String::as_str),
            Some("true")
        );
    }
}
