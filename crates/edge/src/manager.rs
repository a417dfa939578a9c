//! Sandbox lifecycle: validation, admission, create, watch, stop, and recovery after a crash.
//!
//! Every operation the HTTP API offers is one method here; the transport only parses and maps.
//!
//! A sandbox's life: `create` validates the request, admits it against capacity and the
//! node's (overcommitted) CPU and memory, takes a lease on its image's mounted layers, asks the
//! substrate for the sandbox and persists a record. A watcher task per sandbox notices when it
//! dies on its own (its aether exited or the channel broke) and cleans up exactly like `stop`
//! does, leaving a tombstone (state `failed` + reason) so `GET` can tell what happened.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use bytes::Bytes;
use dsec_image::{ImageLease, ImageStore};
use dsec_runtime::aether_client::AetherClient;
use dsec_runtime::substrate::{CreateOptions, ImageSource, LiveSandbox, SandboxSpec};
use dsec_wire::aether::Request;
use dsec_wire::api::{
    CreateSandboxRequest, ErrorDetail, ExecRequest, FileInfo, FileList, ImageInfo, ImageList,
    JobOpFailure, JobOpResult, LabelSelector, NodeStatus, RunShellRequest, SandboxInfo,
    SandboxList, SandboxState, Substrate,
};
use dsec_wire::id::{is_valid_sandbox_id, make_sandbox_id};
use futures::Stream;
use tokio::sync::OnceCell;

use crate::commands::{self, CommandDefaults, CommandReply};
use crate::config::EdgeConfig;
use crate::error::{EdgeError, Subject};
use crate::files::{self, Download};
use crate::metrics::Metrics;
use crate::records::{self, SandboxRecord};
use crate::substrates::Substrates;

/// Limits of a create request after defaults were applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Validated {
    pub image: String,
    /// Canonical workspace image name, if any.
    pub workspace: Option<String>,
    /// Canonical toolkit image names, bottom-most first.
    pub toolkits: Vec<String>,
    pub memory_mb: u64,
    pub cpu: f64,
    pub pids: u64,
    pub user: String,
    pub hostname: Option<String>,
    /// The request's QoS class, else the edge's default.
    pub qos: dsec_wire::api::QosClass,
}

/// Checks a user name or uid (`root`, `1000`, `agent`).
pub fn validate_user(key: &str, u: &str) -> Result<(), EdgeError> {
    let numeric = !u.is_empty()
        && u.len() <= 10
        && u.bytes().all(|b| b.is_ascii_digit())
        && u.parse::<u32>().is_ok();
    let mut bytes = u.bytes();
    let name = matches!(bytes.next(), Some(b) if b.is_ascii_lowercase() || b == b'_')
        && u.len() <= 32
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"_.-".contains(&b));
    if numeric || name {
        Ok(())
    } else {
        Err(EdgeError::BadRequest(format!(
            "{key} {u:?} must be a user name ([a-z_][a-z0-9_.-]{{0,31}}) or a numeric uid"
        )))
    }
}

/// Checks a hostname: dot-separated labels of `[A-Za-z0-9-]`, at most 64 characters.
pub fn validate_hostname(h: &str) -> Result<(), EdgeError> {
    let ok = !h.is_empty()
        && h.len() <= 64
        && h.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if ok {
        Ok(())
    } else {
        Err(EdgeError::BadRequest(format!(
            "hostname {h:?} must be at most 64 characters of dot-separated labels [A-Za-z0-9-] not starting or ending with '-'"
        )))
    }
}

fn check_map(
    key: &str,
    m: &std::collections::BTreeMap<String, impl AsRef<str>>,
    max_key: usize,
    max_val: usize,
) -> Result<(), EdgeError> {
    if m.len() > 128 {
        return Err(EdgeError::BadRequest(format!("{key}: at most 128 entries")));
    }
    for (k, v) in m {
        if k.is_empty()
            || k.len() > max_key
            || k.contains('\0')
            || v.as_ref().len() > max_val
            || v.as_ref().contains('\0')
        {
            return Err(EdgeError::BadRequest(format!(
                "{key}: entry {k:?} must have a 1..={max_key}-byte name and a value of at most {max_val} bytes, without NUL"
            )));
        }
    }
    Ok(())
}

/// Validates a create request against the node's configuration and the substrate it asks
/// for (pure; no admission).
pub fn validate_create(
    cfg: &EdgeConfig,
    substrates: &Substrates,
    req: &CreateSandboxRequest,
) -> Result<Validated, EdgeError> {
    let substrate = substrates.get(req.substrate)?;
    substrate
        .check_request(req)
        .map_err(|e| EdgeError::BadRequest(e.0))?;
    let image = match substrate.capabilities().image_source {
        ImageSource::Layers => {
            dsec_image::canonical_name(&req.image).map_err(EdgeError::from_image)?
        }
        // Checked by the substrate; resolved to its file when the sandbox is built.
        ImageSource::DiskImage => req.image.clone(),
    };
    let workspace = match &req.workspace {
        Some(w) => Some(dsec_image::canonical_name(w).map_err(EdgeError::from_image)?),
        None => None,
    };
    if req.toolkits.len() > 16 {
        return Err(EdgeError::BadRequest(
            "at most 16 toolkits per sandbox".into(),
        ));
    }
    let toolkits = req
        .toolkits
        .iter()
        .map(|t| dsec_image::canonical_name(t).map_err(EdgeError::from_image))
        .collect::<Result<Vec<_>, _>>()?;
    let memory_mb = req.memory_limit_mb.unwrap_or(cfg.default_memory_mb);
    if memory_mb < 16 || memory_mb > cfg.max_memory_mb {
        return Err(EdgeError::BadRequest(format!(
            "memory_limit_mb {memory_mb} must be between 16 and this node's maximum of {}",
            cfg.max_memory_mb
        )));
    }
    let cpu = req.cpu_cores_limit.unwrap_or(cfg.default_cpu_cores);
    if !(cpu.is_finite() && cpu >= 0.01 && cpu <= cfg.max_cpu_cores) {
        return Err(EdgeError::BadRequest(format!(
            "cpu_cores_limit {cpu} must be between 0.01 and this node's maximum of {}",
            cfg.max_cpu_cores
        )));
    }
    let pids = req.pids_limit.unwrap_or(cfg.default_pids);
    if pids < 8 || pids > cfg.max_pids {
        return Err(EdgeError::BadRequest(format!(
            "pids_limit {pids} must be between 8 and this node's maximum of {}",
            cfg.max_pids
        )));
    }
    let user = req.init_user.clone().unwrap_or_else(|| "root".to_string());
    validate_user("init_user", &user)?;
    if let Some(h) = &req.hostname {
        validate_hostname(h)?;
    }
    for (key, v) in [
        ("ttl_running_stop", req.ttl_running_stop),
        ("ttl_total", req.ttl_total),
    ] {
        if v == Some(0) {
            return Err(EdgeError::BadRequest(format!(
                "{key} must be at least 1 second (omit it for no limit)"
            )));
        }
    }
    check_map("env", &req.env, 256, 128 * 1024)?;
    if req.env.keys().any(|k| k.contains('=')) {
        return Err(EdgeError::BadRequest(
            "env: variable names must not contain '='".into(),
        ));
    }
    check_map("labels", &req.labels, 128, 1024)?;
    let rules: std::collections::BTreeMap<String, String> = req
        .network_rules
        .iter()
        .map(|(k, v)| (k.clone(), v.to_string()))
        .collect();
    check_map("network_rules", &rules, 64, 8)?;
    if let Some(k) = &req.idempotency_key {
        if k.is_empty() || k.len() > 256 {
            return Err(EdgeError::BadRequest(
                "idempotency_key must be 1..=256 bytes".into(),
            ));
        }
    }
    Ok(Validated {
        image,
        workspace,
        toolkits,
        memory_mb,
        cpu,
        pids,
        user,
        hostname: req.hostname.clone(),
        qos: dsec_node::qos::resolve(req.qos, &cfg.qos),
    })
}

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

/// A job operation on every sandbox matching a label selector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobOp {
    Pause,
    Resume,
    Stop,
}

impl JobOp {
    pub fn parse(s: &str) -> Option<JobOp> {
        match s {
            "pause" => Some(JobOp::Pause),
            "resume" => Some(JobOp::Resume),
            "stop" => Some(JobOp::Stop),
            _ => None,
        }
    }
}

/// True when `labels` has every key/value of `selector` (an empty selector matches nothing).
pub fn labels_match(
    labels: &std::collections::BTreeMap<String, String>,
    selector: &std::collections::BTreeMap<String, String>,
) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

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
    Stopped(String),
    Died,
}

/// One live sandbox.
struct Entry {
    id: String,
    dir: PathBuf,
    info: Mutex<SandboxInfo>,
    sandbox: Box<dyn LiveSandbox>,
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
}

/// How long admission reuses the machine's CPU count and `MemTotal` (when the config does not
/// set them) before reading them again.
const MACHINE_TOTALS_TTL: std::time::Duration = std::time::Duration::from_secs(1);

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
        Self {
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

    /// Takes over what an earlier, crashed run of the edge left behind.
    ///
    /// For each record: if its aether is still alive (the pid is verified through a pidfd and
    /// its cgroup), the substrate reconnects to it (`Substrate::adopt`) and the sandbox is live
    /// again with its sessions, its image lease and its recorded state (paused stays paused).
    /// Otherwise it is killed, its directory removed and a tombstone (state `failed`, with the
    /// reason) left so `GET` tells what happened. The substrate then reaps every cgroup no
    /// adopted sandbox owns. Returns the ids cleaned up (not the adopted ones).
    pub async fn recover(self: &Arc<Self>) -> Vec<String> {
        let trash = self.cfg.edge_dir().join(records::TRASH_DIR);
        if let Err(e) = records::empty_trash(&trash) {
            tracing::error!(dir = %trash.display(), error = %e, "empty the trash of ended sandboxes");
        }
        let spare = self.cfg.edge_dir().join(records::SPARE_DIR);
        if let Err(e) = records::drop_spares(&spare) {
            tracing::error!(dir = %spare.display(), error = %e, "remove spare sandbox dirs");
        }
        let dir = self.cfg.sandboxes_dir();
        let found = match records::scan(&dir) {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(dir = %dir.display(), error = %e, "scan sandbox records");
                Vec::new()
            }
        };
        let mut reaped = Vec::new();
        let mut adopted = Vec::new();
        for f in found {
            let why = match &f.record {
                Ok(rec)
                    if (rec.pid > 1 && rec.info.state != SandboxState::Creating)
                        // A paused VM has no process, only its snapshot on disk (a substrate
                        // this node lacks says so in the readopt's error).
                        || (rec.info.state == SandboxState::Paused
                            && self
                                .substrates
                                .capabilities(rec.info.substrate)
                                .is_none_or(|c| c.pause_ends_process)) =>
                {
                    match self.readopt(&f.id, &f.dir, rec).await {
                        Ok(()) => {
                            adopted.push(f.id.clone());
                            continue;
                        }
                        Err(e) => e,
                    }
                }
                Ok(rec) => format!(
                    "record in state {:?} without a running agent",
                    rec.info.state
                ),
                Err(e) => format!("unreadable record: {e}"),
            };
            if let Ok(rec) = &f.record {
                if rec.pid > 1 && records::pid_belongs_to(rec.pid, &f.id) {
                    // v1 freezer: a frozen task ignores SIGKILL until thawed.
                    if let Ok(cg) = dsec_runtime::cgroup::Cgroup::open(
                        &dsec_runtime::cgroup::CgroupRoot::detect(),
                        &self.cfg.cgroup_parent(),
                        &f.id,
                    ) {
                        let _ = cg.thaw();
                    }
                    let gone =
                        records::kill_and_wait(rec.pid, std::time::Duration::from_secs(5)).await;
                    tracing::warn!(sandbox = %f.id, pid = rec.pid, gone, "killed a sandbox agent that could not be re-adopted");
                }
            }
            tracing::warn!(sandbox = %f.id, reason = %why, "sandbox of an earlier edge run not re-adopted: cleaning it up");
            dsec_runtime::container::disk::release(&f.dir);
            if let Err(e) = remove_dir(&f.dir) {
                tracing::error!(sandbox = %f.id, dir = %f.dir.display(), error = %e, "remove leftover sandbox dir");
            }
            let mut info = match &f.record {
                Ok(rec) => rec.info.clone(),
                Err(_) => SandboxInfo {
                    id: f.id.clone(),
                    node: self.cfg.node_id.clone(),
                    ..Default::default()
                },
            };
            info.state = SandboxState::Failed;
            info.reason = Some(format!(
                "lost in a restart of the edge and cleaned up: {why}"
            ));
            self.tombstone(&mut lock(&self.state), info);
            self.metrics.sandboxes_failed.inc();
            reaped.push(f.id);
        }
        let mut by_substrate = Vec::new();
        for s in self.substrates.available() {
            by_substrate.extend(s.reap_orphans(adopted.clone()).await);
        }
        crate::network::recover(&self.net, &self.cfg, &adopted).await;
        for id in by_substrate {
            tracing::warn!(sandbox = %id, "substrate reaped leftovers");
            if !reaped.contains(&id) {
                reaped.push(id);
            }
        }
        tracing::info!(
            adopted = adopted.len(),
            cleaned = reaped.len(),
            "recovered sandboxes of an earlier edge run"
        );
        reaped
    }

    /// Re-adopts one recorded sandbox; on error nothing was registered.
    async fn readopt(
        self: &Arc<Self>,
        id: &str,
        dir: &Path,
        rec: &SandboxRecord,
    ) -> Result<(), String> {
        if !is_valid_sandbox_id(id) || rec.info.id != id {
            return Err(format!("record names sandbox {:?}", rec.info.id));
        }
        let substrate = self
            .substrates
            .get(rec.info.substrate)
            .map_err(|e| e.to_string())?;
        // A disk-image substrate (full VM) boots a disk image, not the layer store's image:
        // no lease.
        let lease = match substrate.capabilities().image_source {
            ImageSource::DiskImage => None,
            ImageSource::Layers => Some(
                self.images
                    .acquire(&rec.image)
                    .await
                    .map_err(|e| format!("re-take image lease on {}: {e}", rec.image))?,
            ),
        };
        let sandbox = substrate
            .adopt(id.to_string(), dir.to_path_buf(), rec.pid)
            .await
            .map_err(|e| e.to_string())?;
        let mut info = rec.info.clone();
        let paused = sandbox.is_paused();
        info.state = if paused {
            SandboxState::Paused
        } else {
            SandboxState::Running
        };
        if !paused {
            info.paused_at = None;
        }
        let aether = sandbox.aether().clone();
        let now = now_ms();
        let entry = Arc::new(Entry {
            id: id.to_string(),
            dir: dir.to_path_buf(),
            memory_mb: info.memory_limit_mb,
            cpu: info.cpu_cores_limit,
            info: Mutex::new(info),
            sandbox,
            aether,
            lease: Mutex::new(lease),
            ended: OnceCell::new(),
            env: rec.env.clone(),
            created_ms: if rec.created_ms > 0 {
                rec.created_ms
            } else {
                now
            },
            // The idle clock restarts: time the edge was down does not count as idle.
            last_request_ms: AtomicU64::new(now),
            inflight: AtomicU64::new(0),
            op: tokio::sync::Mutex::new(()),
        });
        entry.persist();
        self.qos.adopt(id, rec.info.qos, entry.memory_mb, entry.cpu);
        {
            let mut st = lock(&self.state);
            st.count += 1;
            st.memory_mb += entry.memory_mb;
            st.cpu += entry.cpu;
            st.live.insert(id.to_string(), entry.clone());
        }
        self.metrics.sandboxes_running.inc();
        tracing::info!(sandbox = %id, paused, "re-adopted sandbox of an earlier edge run");
        self.watch(entry);
        Ok(())
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

    /// Creates a sandbox.
    pub async fn create(
        self: &Arc<Self>,
        req: CreateSandboxRequest,
    ) -> Result<SandboxInfo, EdgeError> {
        let started = Instant::now();
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(EdgeError::Unavailable(format!(
                "node {} is shutting down",
                self.cfg.node_id
            )));
        }
        let v = validate_create(&self.cfg, &self.substrates, &req)?;
        crate::ports::validate_public_ports(&req.public_ports)?;
        let id = make_sandbox_id(&self.cfg.node_id, rand::random());
        if let Some(existing) = self.admit(&id, &v, req.idempotency_key.as_deref())? {
            return Ok(existing);
        }
        match self.build(&id, &req, &v, started).await {
            Ok(entry) => {
                let info = entry.info();
                crate::trajectory::hooks::begin(&self.traj, &id, &req, &info);
                self.qos.started(&id);
                {
                    let mut st = lock(&self.state);
                    st.creating.remove(&id);
                    st.live.insert(id.clone(), entry.clone());
                    if let Some(k) = &req.idempotency_key {
                        st.idempotency.insert(k.clone(), id.clone());
                    }
                }
                self.metrics.sandboxes_created.inc();
                self.metrics.sandboxes_running.inc();
                if self.shutting_down.load(Ordering::SeqCst) {
                    // Shutdown began while this create ran: do not leave it behind.
                    let ended = self
                        .finish(&entry, End::Stopped("the edge shut down".into()))
                        .await;
                    return Err(EdgeError::Unavailable(format!(
                        "node {} shut down while sandbox {} was being created; it was {:?}",
                        self.cfg.node_id, ended.id, ended.state
                    )));
                }
                self.metrics
                    .create_seconds
                    .observe(started.elapsed().as_secs_f64());
                let pid = entry.sandbox.pid();
                self.watch(entry);
                tracing::info!(sandbox = %id, image = %info.image, pid, create_ms = info.create_ms, "sandbox created");
                Ok(info)
            }
            Err(e) => {
                self.qos.release(&id);
                {
                    let mut st = lock(&self.state);
                    st.creating.remove(&id);
                    st.count -= 1;
                    st.memory_mb -= v.memory_mb;
                    st.cpu = (st.cpu - v.cpu).max(0.0);
                }
                self.metrics.sandboxes_create_errors.inc();
                tracing::warn!(sandbox = %id, error = %e, "create failed");
                Err(e)
            }
        }
    }

    /// Admission: capacity, CPU and memory (with overcommit), idempotency. Reserves on success;
    /// returns the existing sandbox for a repeated idempotency key.
    /// The config with the machine's CPU count and memory filled in where it sets none, read
    /// at most every [`MACHINE_TOTALS_TTL`]: reading them (`/proc/meminfo`, and the affinity
    /// mask and cgroup files behind `available_parallelism`) on every create was ~2% of the
    /// node's CPU per sandbox. A change of the machine (memory hot-plug, a balloon, a new CPU
    /// quota) is seen within that period.
    fn admission_cfg(&self) -> Arc<EdgeConfig> {
        if self.cfg.cpu_cores_total.is_some() && self.cfg.memory_mb_total.is_some() {
            return self.cfg.clone();
        }
        let mut cached = lock(&self.admission_cfg);
        if cached.0.is_some_and(|t| t.elapsed() < MACHINE_TOTALS_TTL) {
            return cached.1.clone();
        }
        let mut c = (*self.cfg).clone();
        c.cpu_cores_total = Some(self.cfg.cpu_total());
        c.memory_mb_total = Some(self.cfg.memory_total_mb());
        *cached = (Some(Instant::now()), Arc::new(c));
        cached.1.clone()
    }

    fn admit(
        &self,
        id: &str,
        v: &Validated,
        key: Option<&str>,
    ) -> Result<Option<SandboxInfo>, EdgeError> {
        let mut st = lock(&self.state);
        if let Some(k) = key {
            if let Some(existing) = st.idempotency.get(k) {
                if let Some(e) = st.live.get(existing) {
                    return Ok(Some(e.info()));
                }
                if let Some(t) = st.tombstones.get(existing) {
                    return Ok(Some(t.clone()));
                }
            }
            if st.creating.values().any(|c| c.as_deref() == Some(k)) {
                return Err(EdgeError::Conflict(format!(
                    "a create with idempotency_key {k:?} is in progress; retry in a moment to get its sandbox"
                )));
            }
        }
        let node = &self.cfg.node_id;
        if st.count >= self.cfg.capacity {
            return Err(EdgeError::NodeFull(format!(
                "node {node} is full: {} of {} sandboxes in use",
                st.count, self.cfg.capacity
            )));
        }
        // Memory and CPU: overcommit by measured usage with a latency-sensitive floor.
        self.qos
            .admit(
                &self.admission_cfg().capacity(),
                id,
                v.qos,
                v.memory_mb,
                v.cpu,
            )
            .map_err(|r| {
                EdgeError::NodeFull(format!(
                    "node {node} is full for a {:?} sandbox: {r}",
                    v.qos
                ))
            })?;
        st.count += 1;
        st.memory_mb += v.memory_mb;
        st.cpu += v.cpu;
        st.creating.insert(id.to_string(), key.map(str::to_string));
        Ok(None)
    }

    async fn build(
        &self,
        id: &str,
        req: &CreateSandboxRequest,
        v: &Validated,
        started: Instant,
    ) -> Result<Arc<Entry>, EdgeError> {
        let driver = self.substrates.get(req.substrate)?;
        let caps = driver.capabilities();
        // A full VM boots a disk image, not the layer store's image: no lease.
        let vm_disk = match caps.image_source {
            ImageSource::DiskImage => Some(
                driver
                    .resolve_disk_image(&v.image)
                    .map_err(EdgeError::from_resolve_image)?,
            ),
            ImageSource::Layers => None,
        };
        let lease = match vm_disk {
            Some(_) => None,
            None => Some(
                self.images
                    .acquire_composed(&v.image, v.workspace.as_deref(), &v.toolkits)
                    .await
                    .map_err(EdgeError::from_image)?,
            ),
        };
        let dir = self.cfg.sandboxes_dir().join(id);
        let disk_limit_mb = req
            .disk_limit_mb
            .or((self.cfg.default_disk_limit_mb > 0).then_some(self.cfg.default_disk_limit_mb));
        let short = id.rsplit('-').next().unwrap_or(id).to_string();
        let mut info = SandboxInfo {
            id: id.to_string(),
            node: self.cfg.node_id.clone(),
            state: SandboxState::Creating,
            substrate: req.substrate,
            image: lease
                .as_ref()
                .map_or_else(|| v.image.clone(), |l| l.image().to_string()),
            memory_limit_mb: v.memory_mb,
            cpu_cores_limit: v.cpu,
            pids_limit: v.pids,
            init_user: v.user.clone(),
            hostname: v.hostname.clone().unwrap_or(short),
            ttl_running_stop: req.ttl_running_stop,
            ttl_total: req.ttl_total,
            network_rules: req.network_rules.clone(),
            labels: req.labels.clone(),
            created_at: now_rfc3339(),
            create_ms: None,
            reason: None,
            ttl_action: req.ttl_action.unwrap_or_default(),
            qos: v.qos,
            public_ports: req.public_ports.clone(),
            ..Default::default()
        };
        let created_ms = now_ms();
        let mut record = SandboxRecord {
            info: info.clone(),
            pid: 0,
            image: info.image.clone(),
            env: req.env.clone(),
            created_ms,
            last_request_ms: created_ms,
        };
        // The record is written once the sandbox runs: a crash before leaves a directory
        // without one, which the recovery at start cleans up (its cgroup is reaped by name).
        // A plain container (no disk limit, whose `upper`/`work` would be links into a file
        // system of its own) gets a spare skeleton when there is one.
        let reuse = caps.early_teardown && disk_limit_mb.is_none();
        let spare = self.cfg.edge_dir().join(records::SPARE_DIR);
        if let Err(e) = records::make_sandbox_dir(&dir, &spare, reuse) {
            return Err(EdgeError::internal(
                &format!("create {}", dir.display()),
                &e,
            ));
        }
        // Network namespace, rules and disk limit (issue 8); rolled back with the directory.
        let extras = match crate::network::prepare(&self.net, &self.cfg, id, &dir, req).await {
            Ok(x) => x,
            Err(e) => {
                let _ = remove_dir(&dir);
                return Err(e);
            }
        };
        let spec = SandboxSpec {
            id: id.to_string(),
            hostname: info.hostname.clone(),
            lowers: match &lease {
                Some(l) => l.lowers(),
                None => vm_disk.clone().into_iter().collect(),
            },
            dir: dir.clone(),
            memory_limit_mb: v.memory_mb,
            cpu_cores_limit: v.cpu,
            pids_limit: v.pids,
            user: v.user.clone(),
            env: req.env.clone(),
            netns: extras.netns.clone(),
            protected_paths: req.protected_paths.clone(),
            disk_limit_mb,
        };
        // A best-effort agent starts SCHED_IDLE (the container's spawn sets it before the exec),
        // so no process of the sandbox ever runs as SCHED_OTHER; `apply_qos` below checks it.
        let opts = CreateOptions {
            sched_idle: matches!(v.qos, dsec_wire::api::QosClass::BestEffort),
        };
        let sandbox = match driver.create(spec, opts).await {
            Ok(s) => s,
            Err(e) => {
                let err = EdgeError::from_create(e);
                crate::network::release(&self.net, id, &dir).await;
                if let Err(ce) = remove_dir(&dir) {
                    return Err(EdgeError::Internal(format!(
                        "{err}; cleanup also failed: remove {}: {ce}",
                        dir.display()
                    )));
                }
                return Err(err);
            }
        };
        // The sandbox's nftables chains were added while it started: wait for them.
        let net_ready = crate::network::started(&self.net, &self.cfg, id, &dir).await;
        // QoS before the sandbox is handed out: no user command has run yet.
        let qos = sandbox.apply_qos(&self.qos.settings(v.qos));
        if let Ok(a) = &qos {
            if opts.sched_idle && caps.sched_idle_at_spawn && a.not_idle_before > 0 {
                tracing::warn!(
                    sandbox = %id,
                    tasks = a.not_idle_before,
                    "best-effort container had processes not SCHED_IDLE after spawn (fixed now)"
                );
            }
        }
        info.state = SandboxState::Running;
        info.create_ms = Some(started.elapsed().as_secs_f64() * 1000.0);
        info.boot = sandbox.boot_kind().map(str::to_string);
        if let Some(b) = &info.boot {
            self.metrics.vm_boots.with_label_values(&[b]).inc();
        }
        record.info = info.clone();
        record.pid = sandbox.pid();
        let persisted = match qos.map(|q| (q, net_ready)) {
            Ok((_, Err(e))) => Err(e),
            Ok((_, Ok(()))) => records::write_new(&dir, &record)
                .map_err(|e| EdgeError::internal("persist record", &e)),
            Err(e) => Err(EdgeError::Internal(format!(
                "apply QoS class {:?}: {e}",
                v.qos
            ))),
        };
        if let Err(err) = persisted {
            let destroyed = sandbox.destroy().await;
            crate::network::release(&self.net, id, &dir).await;
            let removed = remove_dir(&dir);
            if destroyed.is_err() || removed.is_err() {
                return Err(EdgeError::Internal(format!(
                    "{err}; cleanup also failed: destroy: {destroyed:?}, remove dir: {removed:?}"
                )));
            }
            return Err(err);
        }
        let aether = sandbox.aether().clone();
        Ok(Arc::new(Entry {
            id: id.to_string(),
            dir,
            info: Mutex::new(info),
            sandbox,
            aether,
            lease: Mutex::new(lease),
            memory_mb: v.memory_mb,
            cpu: v.cpu,
            ended: OnceCell::new(),
            env: req.env.clone(),
            created_ms,
            last_request_ms: AtomicU64::new(now_ms()),
            inflight: AtomicU64::new(0),
            op: tokio::sync::Mutex::new(()),
        }))
    }

    fn watch(self: &Arc<Self>, entry: Arc<Entry>) {
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            entry.sandbox.exited().await;
            if let Some(m) = weak.upgrade() {
                let info = m.finish(&entry, End::Died).await;
                if info.state == SandboxState::Failed {
                    tracing::warn!(sandbox = %entry.id, reason = info.reason.as_deref().unwrap_or(""), "sandbox died");
                }
            }
        });
    }

    /// Ends a sandbox exactly once (stop and the watcher may race); later callers get the
    /// same final info.
    async fn finish(&self, entry: &Arc<Entry>, why: End) -> SandboxInfo {
        entry
            .ended
            .get_or_init(|| self.teardown(entry, why))
            .await
            .clone()
    }

    async fn teardown(&self, entry: &Arc<Entry>, why: End) -> SandboxInfo {
        let oom_kills = entry.sandbox.oom_kills();
        lock(&entry.info).state = SandboxState::Stopping;
        let mut problems = Vec::new();
        let t0 = Instant::now();
        // The directory leaves `sandboxes/` with one rename into the trash and is removed in
        // the background once the sandbox is dead (flushed at shutdown, emptied at start): the
        // stop waits for no unlink. A container's directory moves before the kill (its mounts
        // live only in its own mount namespace, which holds them by reference, and its
        // substrate then finds its subdirectories gone); VM drivers still use files in theirs
        // while they destroy, so theirs moves after.
        let trash = self.cfg.edge_dir().join(records::TRASH_DIR);
        let early = self
            .substrates
            .capabilities(lock(&entry.info).substrate)
            .is_some_and(|c| c.early_teardown);
        let moved = early
            .then(|| records::move_to_trash(&entry.dir, &trash))
            .flatten();
        let dir = moved.clone().unwrap_or_else(|| entry.dir.clone());
        if let Err(e) = entry.sandbox.destroy().await {
            problems.push(format!("destroy: {e}"));
        }
        let destroyed = t0.elapsed();
        crate::network::release(&self.net, &entry.id, &dir).await;
        if moved.is_some() {
            // A container's disk-limit file system moved into the trash with its directory:
            // release it there (the substrate's destroy looked under the old path).
            let d = dir.clone();
            let _ = tokio::task::spawn_blocking(move || dsec_runtime::container::disk::release(&d))
                .await;
        }
        drop(lock(&entry.lease).take());
        let released = t0.elapsed();
        let removed = match moved {
            // Every process is dead; once the mount namespace that held the overlay is gone
            // (released in the background), the emptied directory may serve the next container.
            Some(d) if problems.is_empty() => {
                let spare = self.cfg.edge_dir().join(records::SPARE_DIR);
                let entry = entry.clone();
                records::recycle_in_background(d, spare, move || {
                    entry
                        .sandbox
                        .wait_released(std::time::Duration::from_secs(30))
                });
                Ok(())
            }
            Some(d) => {
                records::remove_in_background(d);
                Ok(())
            }
            None => records::retire(&entry.dir, &trash),
        };
        if let Err(e) = removed {
            problems.push(format!("remove {}: {e}", entry.dir.display()));
        }
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        tracing::debug!(
            sandbox = %entry.id,
            destroy_ms = ms(destroyed),
            release_ms = ms(released - destroyed),
            retire_ms = ms(t0.elapsed() - released),
            "sandbox torn down"
        );
        let mut info = entry.info();
        match &why {
            End::Stopped(reason) => {
                info.state = SandboxState::Stopped;
                info.reason = Some(reason.clone());
                info.paused_at = None;
                self.metrics.sandboxes_stopped.inc();
            }
            End::Died => {
                info.state = SandboxState::Failed;
                let mut reason =
                    "the sandbox's agent exited unexpectedly (killed from outside or crashed)"
                        .to_string();
                if oom_kills > 0 {
                    reason.push_str(&format!(
                        "; the memory limit OOM-killed processes {oom_kills} time(s)"
                    ));
                }
                info.reason = Some(reason);
                self.metrics.sandboxes_failed.inc();
            }
        }
        if !problems.is_empty() {
            let p = problems.join("; ");
            tracing::error!(sandbox = %entry.id, problems = %p, "cleanup of sandbox incomplete");
            info.reason = Some(format!(
                "{}; cleanup problems: {p}",
                info.reason.unwrap_or_default()
            ));
        }
        *lock(&entry.info) = info.clone();
        {
            let mut st = lock(&self.state);
            st.live.remove(&entry.id);
            self.qos.release(&entry.id);
            st.count = st.count.saturating_sub(1);
            st.memory_mb = st.memory_mb.saturating_sub(entry.memory_mb);
            st.cpu = (st.cpu - entry.cpu).max(0.0);
            self.tombstone(&mut st, info.clone());
        }
        self.metrics.sandboxes_running.dec();
        crate::trajectory::hooks::end(&self.traj, &info);
        tracing::info!(
            sandbox = %entry.id,
            state = ?info.state,
            destroy_ms = ms(destroyed),
            "sandbox ended"
        );
        info
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
                "sandbox {id} is {}: {}",
                serde_json::to_value(t.state)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
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

    /// Pauses a sandbox: its processes stop and its memory goes back to the host; state is
    /// kept. Pausing a paused sandbox answers its info again.
    pub async fn pause(&self, id: &str) -> Result<SandboxInfo, EdgeError> {
        let e = self.entry(id)?;
        self.pause_entry(&e).await?;
        Ok(e.info())
    }

    /// Resumes a paused sandbox (a running one answers its info again).
    pub async fn resume(&self, id: &str) -> Result<SandboxInfo, EdgeError> {
        let e = self.entry(id)?;
        e.last_request_ms.store(now_ms(), Ordering::SeqCst);
        self.resume_entry(&e).await?;
        Ok(e.info())
    }

    async fn pause_entry(&self, e: &Arc<Entry>) -> Result<(), EdgeError> {
        let _op = e.op.lock().await;
        match lock(&e.info).state {
            SandboxState::Paused => return Ok(()),
            SandboxState::Running if !e.ended.initialized() => {}
            s => {
                return Err(EdgeError::Conflict(format!(
                    "sandbox {} is {s:?}, only a running sandbox can be paused",
                    e.id
                )))
            }
        }
        let report = e
            .sandbox
            .pause(self.cfg.reclaim_on_pause)
            .await
            .map_err(|err| EdgeError::internal("pause", &err));
        let request = serde_json::json!({ "reclaim": self.cfg.reclaim_on_pause });
        let report = match report {
            Ok(r) => {
                let result = serde_json::to_value(&r).unwrap_or_default();
                self.traj.note(&e.id, "pause", request, Ok(result));
                r
            }
            Err(err) => {
                self.traj.note(&e.id, "pause", request, Err(&err));
                return Err(err);
            }
        };
        {
            let mut i = lock(&e.info);
            i.state = SandboxState::Paused;
            i.paused_at = Some(now_rfc3339());
            i.last_pause = Some(report.clone());
        }
        e.persist();
        self.metrics.sandboxes_running.dec();
        tracing::info!(sandbox = %e.id, before = report.memory_before_bytes, after = report.memory_after_bytes, ms = report.pause_ms, "sandbox paused");
        Ok(())
    }

    async fn resume_entry(&self, e: &Arc<Entry>) -> Result<(), EdgeError> {
        let _op = e.op.lock().await;
        match lock(&e.info).state {
            SandboxState::Running => return Ok(()),
            SandboxState::Paused if !e.ended.initialized() => {}
            s => {
                return Err(EdgeError::SandboxDead(format!(
                    "sandbox {} is {s:?} and cannot be resumed",
                    e.id
                )))
            }
        }
        let resumed = e
            .sandbox
            .resume()
            .await
            .map_err(|err| EdgeError::internal("resume", &err));
        let result = resumed.as_ref().map(|_| serde_json::json!({}));
        self.traj
            .note(&e.id, "resume", serde_json::json!({}), result);
        resumed?;
        {
            let mut i = lock(&e.info);
            i.state = SandboxState::Running;
            i.paused_at = None;
            // A pause's reason (memory pressure) ends with the pause.
            if i.reason
                .as_deref()
                .is_some_and(|r| r.starts_with("paused:"))
            {
                i.reason = None;
            }
        }
        e.persist();
        self.metrics.sandboxes_running.inc();
        tracing::info!(sandbox = %e.id, "sandbox resumed");
        Ok(())
    }

    /// Pauses, resumes or stops every sandbox whose labels match the selector.
    pub async fn job_op(&self, op: JobOp, sel: &LabelSelector) -> Result<JobOpResult, EdgeError> {
        if sel.labels.is_empty() {
            return Err(EdgeError::BadRequest(
                "labels must name at least one label (an empty selector would match every sandbox)"
                    .into(),
            ));
        }
        let started = Instant::now();
        let matched: Vec<Arc<Entry>> = lock(&self.state)
            .live
            .values()
            .filter(|e| labels_match(&lock(&e.info).labels, &sel.labels))
            .cloned()
            .collect();
        let mut out = JobOpResult {
            matched: matched.len() as u64,
            sandboxes: matched.iter().map(|e| e.id.clone()).collect(),
            ..Default::default()
        };
        use futures::StreamExt as _;
        let results: Vec<(String, Result<(), EdgeError>)> =
            futures::stream::iter(matched.into_iter().map(|e| async move {
                let r = match op {
                    JobOp::Pause => self.pause_entry(&e).await,
                    JobOp::Resume => {
                        e.last_request_ms.store(now_ms(), Ordering::SeqCst);
                        self.resume_entry(&e).await
                    }
                    JobOp::Stop => {
                        self.finish(&e, End::Stopped("stopped by a job operation".into()))
                            .await;
                        Ok(())
                    }
                };
                (e.id.clone(), r)
            }))
            .buffer_unordered(64)
            .collect()
            .await;
        for (id, r) in results {
            match r {
                Ok(()) => out.succeeded += 1,
                Err(err) => out.failed.push(JobOpFailure {
                    id,
                    error: ErrorDetail {
                        code: err.code().to_string(),
                        message: err.to_string(),
                    },
                }),
            }
        }
        out.sandboxes.sort();
        out.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
        Ok(out)
    }

    /// What the TTL reaper needs to know about every live sandbox.
    fn ttl_views(&self) -> Vec<crate::ttl::TtlView> {
        let entries: Vec<Arc<Entry>> = lock(&self.state).live.values().cloned().collect();
        entries
            .iter()
            .filter(|e| !e.ended.initialized())
            .map(|e| {
                let i = lock(&e.info);
                crate::ttl::TtlView {
                    id: e.id.clone(),
                    state: i.state,
                    created_ms: e.created_ms,
                    last_request_ms: e.last_request_ms.load(Ordering::SeqCst),
                    busy: e.inflight.load(Ordering::SeqCst) > 0,
                    ttl_running_stop: i.ttl_running_stop,
                    ttl_total: i.ttl_total,
                    ttl_action: i.ttl_action,
                }
            })
            .collect()
    }

    /// What the node's policies (QoS sampler, reclaim) see of every live sandbox.
    fn snapshots(&self) -> Vec<dsec_node::SandboxSnapshot> {
        let entries: Vec<Arc<Entry>> = lock(&self.state).live.values().cloned().collect();
        entries
            .iter()
            .filter(|e| !e.ended.initialized())
            .map(|e| {
                let i = lock(&e.info);
                dsec_node::SandboxSnapshot {
                    id: e.id.clone(),
                    state: i.state,
                    qos: i.qos,
                    last_request_ms: e.last_request_ms.load(Ordering::SeqCst),
                    busy: e.inflight.load(Ordering::SeqCst) > 0,
                    cgroup: e.sandbox.cgroup().cloned(),
                }
            })
            .collect()
    }

    /// This manager as the node policies' view of the sandboxes.
    pub fn view(self: &Arc<Self>) -> std::sync::Weak<dyn dsec_node::SandboxView> {
        let weak: std::sync::Weak<Manager> = Arc::downgrade(self);
        weak
    }

    /// Starts the reclaim policy (`[edge.reclaim]`; None when disabled).
    pub async fn start_reclaim(self: &Arc<Self>) -> Option<Arc<dsec_node::reclaim::Reclaim>> {
        let m = &self.metrics;
        dsec_node::reclaim::Reclaim::start(
            self.cfg.reclaim.clone(),
            dsec_node::reclaim::ReclaimPlace {
                cgroup_parent: self.cfg.cgroup_parent(),
                state_dir: self.cfg.edge_dir().join("reclaim"),
            },
            dsec_node::reclaim::ReclaimMetrics {
                reclaimed_bytes: m.reclaimed_bytes.clone(),
                memory_pressure_actions: m.memory_pressure_actions.clone(),
            },
            self.view(),
        )
        .await
    }

    /// Pauses a sandbox because the node is short of memory; the reason goes into its info
    /// and its trajectory (a `memory_pressure` entry).
    async fn pause_for_pressure(&self, id: &str, reason: &str) -> Result<(), EdgeError> {
        let e = self.entry(id)?;
        self.pause_entry(&e).await?;
        lock(&e.info).reason = Some(format!("paused: {reason}"));
        e.persist();
        self.traj.note(
            id,
            "memory_pressure",
            serde_json::json!({ "action": "pause", "reason": reason }),
            Ok(serde_json::to_value(lock(&e.info).last_pause.clone()).unwrap_or_default()),
        );
        Ok(())
    }

    /// Stops a sandbox for a reason (TTL reaper).
    pub(crate) async fn stop_because(&self, id: &str, reason: String) {
        if let Ok(e) = self.entry(id) {
            self.finish(&e, End::Stopped(reason)).await;
        }
    }

    /// Pauses a sandbox unless a request touched it since `idle_since_ms` (TTL reaper).
    pub(crate) async fn pause_idle(&self, id: &str, seen_last_request_ms: u64) {
        if let Ok(e) = self.entry(id) {
            if e.last_request_ms.load(Ordering::SeqCst) != seen_last_request_ms
                || e.inflight.load(Ordering::SeqCst) > 0
            {
                return;
            }
            if let Err(err) = self.pause_entry(&e).await {
                tracing::warn!(sandbox = %id, error = %err, "idle TTL pause failed");
            }
        }
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

    pub fn list(&self) -> SandboxList {
        let entries: Vec<Arc<Entry>> = lock(&self.state).live.values().cloned().collect();
        let mut sandboxes: Vec<SandboxInfo> = entries.iter().map(|e| e.info()).collect();
        sandboxes.sort_by(|a, b| a.created_at.cmp(&b.created_at).then(a.id.cmp(&b.id)));
        SandboxList { sandboxes }
    }

    /// Stops a sandbox; repeating it answers the final info again.
    /// The sandbox's network policy, addresses and denied counters.
    pub async fn network_status(
        &self,
        id: &str,
    ) -> Result<dsec_wire::api::NetworkStatus, EdgeError> {
        let e = self.entry(id)?;
        let groups = lock(&e.info).network_rules.clone();
        Ok(self.net.status(id, &groups).await)
    }

    /// Replaces a running sandbox's network rules (effective for the next new connection).
    pub async fn set_network(
        &self,
        id: &str,
        spec: dsec_wire::api::NetworkSpec,
    ) -> Result<dsec_wire::api::NetworkStatus, EdgeError> {
        let e = self.running(id)?;
        let request = serde_json::to_value(&spec).unwrap_or_default();
        if let Err(err) = self.net.update(id, &spec).await {
            let err = EdgeError::from(err);
            self.traj.note(id, "network", request, Err(&err));
            return Err(err);
        }
        self.traj.note(
            id,
            "network",
            request,
            Ok(serde_json::json!({ "applied": true })),
        );
        crate::network::saved(&self.net, id, &e.dir);
        let st = self
            .net
            .status(id, &std::collections::BTreeMap::new())
            .await;
        lock(&e.info).network_rules = st.groups.clone();
        Ok(st)
    }

    pub async fn stop(&self, id: &str) -> Result<SandboxInfo, EdgeError> {
        match self.entry(id) {
            Ok(e) => Ok(self
                .finish(&e, End::Stopped("stopped on request".into()))
                .await),
            Err(EdgeError::SandboxDead(_)) => self.get(id),
            Err(e) => Err(e),
        }
    }

    pub async fn shell(
        self: &Arc<Self>,
        id: &str,
        req: RunShellRequest,
    ) -> Result<CommandReply, EdgeError> {
        let e = self.touch(id).await?;
        let (r, stdin) = commands::shell_request(&req, self.cmd_defaults())?;
        self.metrics.commands.with_label_values(&["shell"]).inc();
        let key = crate::trajectory::hooks::shell_key(&req);
        self.logged_command(id, "shell", &req, key, (req.step, req.stream), e, r, stdin)
            .await
    }

    pub async fn exec(
        self: &Arc<Self>,
        id: &str,
        req: ExecRequest,
    ) -> Result<CommandReply, EdgeError> {
        let e = self.touch(id).await?;
        let (r, stdin) = commands::exec_request(&req, self.cmd_defaults())?;
        self.metrics.commands.with_label_values(&["exec"]).inc();
        let key = crate::trajectory::hooks::exec_key(&req, &stdin);
        self.logged_command(id, "exec", &req, key, (req.step, req.stream), e, r, stdin)
            .await
    }

    /// Runs a command through the trajectory log (fast-forward, recording).
    #[allow(clippy::too_many_arguments)]
    async fn logged_command<Q: serde::Serialize>(
        self: &Arc<Self>,
        id: &str,
        kind: &'static str,
        req: &Q,
        key: serde_json::Value,
        (step, stream): (Option<u64>, bool),
        e: Busy,
        r: Request,
        stdin: Bytes,
    ) -> Result<CommandReply, EdgeError> {
        use crate::trajectory::{hooks, request_value};
        let request = request_value(req);
        if stream && step.is_none() {
            return match self.run_command(e, r, stdin, true).await? {
                CommandReply::Stream(s) => Ok(CommandReply::Stream(hooks::record_stream(
                    &self.traj,
                    id,
                    kind,
                    request,
                    key,
                    s,
                    1 << 20,
                ))),
                other => Ok(other),
            };
        }
        let me = self.clone();
        let run = move || async move {
            match me.run_command(e, r, stdin, false).await? {
                CommandReply::Done(c) | CommandReply::Replayed(c) => Ok(c),
                CommandReply::Stream(_) => Err(EdgeError::Internal("unexpected stream".into())),
            }
        };
        let a = self.traj.call(id, step, kind, request, key, run).await?;
        Ok(hooks::command_reply(a, stream))
    }

    async fn run_command(
        &self,
        busy: Busy,
        r: Request,
        stdin: Bytes,
        stream: bool,
    ) -> Result<CommandReply, EdgeError> {
        let e = busy.0.clone();
        let oom_before = e.sandbox.oom_kills();
        let chan = |err| EdgeError::from_channel(&e.id, Subject::Other, err);
        let timeout_ms = commands::request_timeout_ms(&r);
        let call = e.aether.call(r, stdin).await.map_err(chan)?;
        if stream {
            let probe_entry = e.clone();
            let probe: commands::OomProbe = Arc::new(move || probe_entry.sandbox.oom_kills());
            let s = commands::stream_call(e.aether.clone(), call, e.id.clone(), probe, oom_before);
            // The sandbox stays busy until the stream ends.
            let s = futures::StreamExt::map(s, move |chunk| {
                let _busy = &busy;
                chunk
            });
            return Ok(CommandReply::Stream(Box::pin(s)));
        }
        let deadline = std::time::Duration::from_millis(timeout_ms) + commands::AGENT_GRACE;
        let out = commands::collect_call(e.aether.clone(), call, &e.id, deadline).await?;
        let oom = e.sandbox.oom_kills() > oom_before;
        Ok(CommandReply::Done(commands::output_result(&out, oom)))
    }

    pub async fn close_session(&self, id: &str, session: &str) -> Result<(), EdgeError> {
        let e = self.touch(id).await?;
        if !commands::is_valid_session(session) {
            return Err(EdgeError::BadRequest(format!(
                "session {session:?} must match [A-Za-z0-9._-]{{1,64}}"
            )));
        }
        e.aether
            .request(
                Request::CloseSession {
                    session: session.to_string(),
                },
                Bytes::new(),
            )
            .await
            .map(|_| ())
            .map_err(|err| EdgeError::from_channel(id, Subject::Session, err))
    }

    /// Uploads a file; with a `step` the body is buffered (hashed before it runs or is
    /// fast-forwarded). Answers whether the result was replayed from the trajectory log.
    pub async fn write_file<S>(
        &self,
        id: &str,
        path: &str,
        (mode, parents, step): (u32, bool, Option<u64>),
        body: S,
    ) -> Result<(FileInfo, bool), EdgeError>
    where
        S: Stream<Item = Result<Bytes, axum::Error>> + Send + Unpin + 'static,
    {
        use crate::trajectory::{hooks, Written};
        let e = self.touch(id).await?;
        let max = self.cfg.max_upload_bytes;
        let request = serde_json::json!({"path": path, "mode": mode, "parents": parents});
        let (p, aether) = (path.to_string(), e.0.aether.clone());
        let a = if step.is_some() {
            let data =
                hooks::buffer_body(body, max.min(self.traj.config().max_recorded_read_bytes))
                    .await?;
            let sha256 = crate::trajectory::sha256_hex(&data);
            let key = serde_json::json!({"path": path, "mode": mode, "sha256": sha256});
            let size = data.len() as u64;
            let id2 = id.to_string();
            let run = move || async move {
                let _busy = e;
                let body = futures::stream::iter([Ok::<_, axum::Error>(data.clone())]);
                let info = files::upload(&aether, &id2, &p, mode, parents, body, max).await?;
                let data = Some(data);
                Ok(Written {
                    info,
                    sha256,
                    size,
                    data,
                })
            };
            self.traj
                .call(id, step, "write_file", request.clone(), key, run)
                .await?
        } else {
            let (body, hashed) = hooks::hashing(body);
            let id2 = id.to_string();
            let run = move || async move {
                let _busy = e;
                let info = files::upload(&aether, &id2, &p, mode, parents, body, max).await?;
                let (sha256, size) = hashed.finish();
                Ok(Written {
                    info,
                    sha256,
                    size,
                    data: None,
                })
            };
            self.traj
                .call(id, None, "write_file", request.clone(), request, run)
                .await?
        };
        Ok((a.value.info, a.replayed))
    }

    /// Downloads a file; with a `step` the content is read whole and recorded so that the
    /// step answers the same bytes again.
    pub async fn read_file(
        &self,
        id: &str,
        path: &str,
        step: Option<u64>,
    ) -> Result<(Download, bool), EdgeError> {
        use crate::trajectory::hooks;
        let e = self.touch(id).await?;
        let request = serde_json::json!({"path": path});
        if step.is_none() {
            let r = files::download(&e.0.aether, id, path).await;
            let result = r
                .as_ref()
                .map(|d| serde_json::json!({"mode": d.mode, "size": d.size}));
            self.traj.note(id, "read_file", request, result);
            return r.map(|d| (d, false));
        }
        let max = self.traj.config().max_recorded_read_bytes;
        let (p, id2) = (path.to_string(), id.to_string());
        let run = move || async move {
            let d = files::download(&e.0.aether, &id2, &p).await?;
            hooks::collect_download(d, max).await
        };
        let a = self
            .traj
            .call(id, step, "read_file", request.clone(), request, run)
            .await?;
        Ok((hooks::content_download(a.value), a.replayed))
    }

    pub async fn stat_file(
        &self,
        id: &str,
        path: &str,
        step: Option<u64>,
    ) -> Result<(FileInfo, bool), EdgeError> {
        let e = self.touch(id).await?;
        let request = serde_json::json!({"path": path});
        let (p, id2) = (path.to_string(), id.to_string());
        let run = move || async move { files::stat(&e.0.aether, &id2, &p).await };
        let a = self
            .traj
            .call(id, step, "stat", request.clone(), request, run)
            .await?;
        Ok((a.value, a.replayed))
    }

    pub async fn list_dir(
        &self,
        id: &str,
        path: &str,
        step: Option<u64>,
    ) -> Result<(FileList, bool), EdgeError> {
        let e = self.touch(id).await?;
        let request = serde_json::json!({"path": path});
        let (p, id2) = (path.to_string(), id.to_string());
        let run = move || async move { files::list(&e.0.aether, &id2, &p).await };
        let a = self
            .traj
            .call(id, step, "list_files", request.clone(), request, run)
            .await?;
        Ok((a.value, a.replayed))
    }

    pub async fn remove_file(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
        step: Option<u64>,
    ) -> Result<bool, EdgeError> {
        let e = self.touch(id).await?;
        let request = serde_json::json!({"path": path, "recursive": recursive});
        let (p, id2) = (path.to_string(), id.to_string());
        let run = move || async move { files::remove(&e.0.aether, &id2, &p, recursive).await };
        let a = self
            .traj
            .call(id, step, "remove", request.clone(), request, run)
            .await?;
        Ok(a.replayed)
    }

    pub async fn mkdir(
        &self,
        id: &str,
        path: &str,
        (mode, parents): (u32, bool),
        step: Option<u64>,
    ) -> Result<(FileInfo, bool), EdgeError> {
        let e = self.touch(id).await?;
        let request = serde_json::json!({"path": path, "mode": mode, "parents": parents});
        let (p, id2) = (path.to_string(), id.to_string());
        let run = move || async move { files::mkdir(&e.0.aether, &id2, &p, mode, parents).await };
        let a = self
            .traj
            .call(id, step, "mkdir", request.clone(), request, run)
            .await?;
        Ok((a.value, a.replayed))
    }

    /// Exposed ports: what a connection to a port of sandbox `id` needs (resumes a paused
    /// sandbox, resets its idle clock). Containers only so far.
    pub async fn port_target(&self, id: &str) -> Result<crate::ports::PortTarget, EdgeError> {
        let e = self.touch(id).await?;
        let info = e.info();
        if info.substrate != Substrate::Container {
            return Err(EdgeError::Unsupported(format!(
                "exposed ports reach container sandboxes so far; sandbox {id} is a {:?}",
                info.substrate
            )));
        }
        Ok(crate::ports::PortTarget {
            pid: e.sandbox.pid(),
            public_ports: info.public_ports,
        })
    }

    /// Whether sandbox `id` is live here (not ended).
    pub fn is_live(&self, id: &str) -> bool {
        self.entry(id).is_ok_and(|e| !e.ended.initialized())
    }

    /// Checks a TTY request and returns the channel to open it on (after the upgrade).
    pub async fn tty_channel(
        &self,
        id: &str,
        rows: u16,
        cols: u16,
    ) -> Result<AetherClient, EdgeError> {
        let e = self.touch(id).await?;
        crate::tty::check_size(rows, cols)?;
        Ok(e.aether.clone())
    }

    pub async fn import_image<R>(&self, name: &str, reader: R) -> Result<ImageInfo, EdgeError>
    where
        R: tokio::io::AsyncRead + Send + Unpin + 'static,
    {
        let name = dsec_image::canonical_name(name).map_err(EdgeError::from_image)?;
        self.images
            .import_tar(&name, reader)
            .await
            .map_err(EdgeError::from_image)
    }

    /// `pack_diff`: the sandbox's writable layer becomes image `req.name` = its layers + diff.
    pub async fn pack_diff(
        &self,
        id: &str,
        req: dsec_wire::api::PackDiffRequest,
    ) -> Result<ImageInfo, EdgeError> {
        let entry = self.running(id)?;
        let kind = lock(&entry.info).substrate;
        if !self
            .substrates
            .capabilities(kind)
            .is_some_and(|c| c.pack_diff)
        {
            return Err(EdgeError::Unsupported(format!(
                "sandbox {id}: pack_diff is not supported for {} sandboxes (their disk is not a layer of the image store)",
                self.substrates.label(kind)
            )));
        }
        let (parent_images, parent_digests) = lock(&entry.lease)
            .as_ref()
            .map(|l| (l.images().to_vec(), l.digests()))
            .ok_or_else(|| EdgeError::Conflict(format!("sandbox {id} holds no image")))?;
        crate::pack::pack_diff(
            &self.images,
            id,
            &entry.dir,
            entry.sandbox.as_ref(),
            &parent_images,
            &parent_digests,
            &req,
        )
        .await
    }

    /// The node's image store.
    pub fn image_store(&self) -> &Arc<ImageStore> {
        &self.images
    }

    pub fn list_images(&self) -> ImageList {
        ImageList {
            images: self.images.list(),
        }
    }

    pub fn remove_image(&self, name: &str) -> Result<(), EdgeError> {
        let name = dsec_image::canonical_name(name).map_err(EdgeError::from_image)?;
        self.images.remove(&name).map_err(EdgeError::from_image)?;
        // Layer files may be gone: what substrates keep per layer file (the microVM's
        // virtio-pmem copies) too, in the background.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            for s in self.substrates.available() {
                let s = s.clone();
                rt.spawn(async move { s.images_removed().await });
            }
        }
        Ok(())
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
        }
    }

    /// Stops every sandbox and unmounts every layer.
    pub async fn shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        let entries: Vec<Arc<Entry>> = lock(&self.state).live.values().cloned().collect();
        tracing::info!(count = entries.len(), "stopping every sandbox");
        let stops = entries
            .iter()
            .map(|e| self.finish(e, End::Stopped("the edge shut down".into())));
        futures::future::join_all(stops).await;
        // Logs closed by those stops are synced by the group commit; do it now, as the
        // background task ends with the process.
        let traj = self.traj.clone();
        let _ = tokio::task::spawn_blocking(move || traj.sync_all()).await;
        for s in self.substrates.available() {
            s.shutdown().await;
        }
        self.net.shutdown().await;
        if !records::flush_retired(std::time::Duration::from_secs(30)).await {
            tracing::error!("directories of ended sandboxes still being removed at shutdown");
        }
        let spare = self.cfg.edge_dir().join(records::SPARE_DIR);
        if let Err(e) = records::drop_spares(&spare) {
            tracing::error!(dir = %spare.display(), error = %e, "remove spare sandbox dirs");
        }
        if let Err(e) = self.images.unmount_all() {
            tracing::error!(error = %e, "unmount image layers");
        }
    }
}

impl dsec_node::SandboxView for Manager {
    fn sandboxes(&self) -> Vec<dsec_node::SandboxSnapshot> {
        self.snapshots()
    }

    fn pause_for_pressure<'a>(
        &'a self,
        id: &'a str,
        reason: &'a str,
    ) -> dsec_node::BoxFut<'a, Result<(), dsec_node::ViewError>> {
        Box::pin(async move {
            Manager::pause_for_pressure(self, id, reason)
                .await
                .map_err(|e| Box::new(e) as dsec_node::ViewError)
        })
    }

    fn note(
        &self,
        id: &str,
        kind: &str,
        request: serde_json::Value,
        result: Result<serde_json::Value, &(dyn std::error::Error + Send + Sync + 'static)>,
    ) {
        match result {
            Ok(v) => self.traj.note(id, kind, request, Ok(v)),
            Err(e) => {
                let err = EdgeError::internal(kind, e);
                self.traj.note(id, kind, request, Err(&err));
            }
        }
    }
}

impl crate::ttl::Reapable for Manager {
    fn ttl_views(&self) -> Vec<crate::ttl::TtlView> {
        Manager::ttl_views(self)
    }

    fn stop_because<'a>(
        &'a self,
        id: &'a str,
        reason: String,
    ) -> dsec_runtime::substrate::BoxFut<'a, ()> {
        Box::pin(Manager::stop_because(self, id, reason))
    }

    fn pause_idle<'a>(
        &'a self,
        id: &'a str,
        seen_last_request_ms: u64,
    ) -> dsec_runtime::substrate::BoxFut<'a, ()> {
        Box::pin(Manager::pause_idle(self, id, seen_last_request_ms))
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
mod tests {
    use super::*;

    /// [`validate_create`] on a node that runs containers only.
    fn validate(cfg: &EdgeConfig, req: &CreateSandboxRequest) -> Result<Validated, EdgeError> {
        validate_create(cfg, &Substrates::only("n0", Arc::new(NoDriver)), req)
    }

    fn req(image: &str) -> CreateSandboxRequest {
        CreateSandboxRequest {
            image: image.into(),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_applied() {
        let cfg = EdgeConfig::default();
        let v = validate(&cfg, &req("busybox")).unwrap();
        assert_eq!(v.image, "busybox:latest");
        assert_eq!(v.memory_mb, 1024);
        assert_eq!(v.cpu, 1.0);
        assert_eq!(v.pids, 1024);
        assert_eq!(v.user, "root");
    }

    #[test]
    fn rejections() {
        let cfg = EdgeConfig::default();
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                substrate: Substrate::Function,
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert_eq!(e.status().as_u16(), 501);
        assert!(e.to_string().contains("container"));
        assert_eq!(
            validate(&cfg, &req("Bad Name"))
                .unwrap_err()
                .status()
                .as_u16(),
            400
        );
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                memory_limit_mb: Some(1 << 30),
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("memory_limit_mb"));
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                cpu_cores_limit: Some(f64::INFINITY),
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("cpu_cores_limit"));
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                pids_limit: Some(1),
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("pids_limit"));
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                init_user: Some("ro ot".into()),
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("init_user"));
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                hostname: Some("-bad".into()),
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("hostname"));
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                ttl_total: Some(0),
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("ttl_total"));
    }

    #[test]
    fn users_and_hostnames() {
        for ok in ["root", "1000", "agent", "_svc", "a.b-c"] {
            validate_user("init_user", ok).unwrap();
        }
        for bad in ["", "Root", "1a b", "x/y", "99999999999"] {
            assert!(validate_user("init_user", bad).is_err(), "{bad}");
        }
        for ok in ["box", "a-b.example.test", "X1"] {
            validate_hostname(ok).unwrap();
        }
        for bad in ["", "a..b", "a_b", &"a".repeat(65)] {
            assert!(validate_hostname(bad).is_err(), "{bad}");
        }
    }

    /// Admission is pure bookkeeping: a substrate that must never be called is enough.
    struct NoDriver;

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
        assert!(m.list().sandboxes.is_empty());
    }

    #[test]
    fn time_format() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_767_225_599), "2025-12-31T23:59:59Z");
    }
}
