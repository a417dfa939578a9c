//! The function-call substrate: stateless calls ("run this code on this input, judge the
//! output") at millisecond latency, on pools of pre-warmed, pre-isolated workers.
//!
//! **Owns**: [`pool`] (pools per (image, toolkits, language): min/max, refill, shrink to zero),
//! [`worker`] (a container sandbox from the runtime holding a Python fork-server, and the
//! per-call cgroup limits), [`languages`] (python, bash, c, cpp, command-in-image),
//! [`admission`] (bounded queue → 429 with a retry hint), [`verdict`] (statuses and test-case
//! verdicts), and the fork-server itself: guest code that runs inside the pooled container,
//! kept in `guest/forkserver.py` (with its own unit tests) and embedded as
//! [`worker::FORKSERVER`].
//!
//! **Must not**: know the edge's sandbox lifecycle or its HTTP layer (the edge serves
//! `/edge/v1/functions/*` in `http/functions.rs` and maps [`FunctionError`] to HTTP statuses in
//! its `error.rs`), or touch cgroups other than its own workers'.
//!
//! ```ignore
//! let fns = Functions::new(cfg.functions.clone(), substrate, images, &cfg);
//! let result = fns.call(FunctionCallRequest { language: "python".into(), code: "print(1)".into(), ..Default::default() }).await?;
//! ```

pub mod admission;
pub mod languages;
pub mod pool;
pub mod verdict;
pub mod worker;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use dsec_image::ImageStore;
use dsec_runtime::container::ContainerSubstrate;
use dsec_wire::api::{
    codes, CaseResult, ErrorDetail, FunctionBatchItem, FunctionBatchRequest, FunctionBatchResult,
    FunctionCallRequest, FunctionCallResult, FunctionPoolList, FunctionStatus, RunResult, Verdict,
};
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};

use self::pool::Pool;
use self::worker::{Begin, ServerRequest, Step, StepResult, WorkerFactory};

/// `[edge.functions]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct FunctionConfig {
    /// Serve `/edge/v1/functions/*` at all.
    pub enabled: bool,
    /// Image of calls that name none.
    pub default_image: String,
    /// Workers each pool keeps while in use.
    pub min_workers: usize,
    /// Most workers (= calls at once) per pool.
    pub max_workers: usize,
    /// A pool unused this long gives back every worker.
    pub idle_shrink_s: f64,
    /// Calls that may wait for a worker per pool; more get 429.
    pub queue_limit: usize,
    /// Memory cgroup cap of a worker (the warm runtime plus the biggest call), MiB.
    pub worker_memory_mb: u64,
    pub worker_cpu_cores: f64,
    /// pids cap of a worker's user cgroup.
    pub worker_pids: u64,
    pub default_timeout_s: f64,
    pub max_timeout_s: f64,
    pub default_memory_mb: u64,
    pub default_pids: u64,
    /// Compile steps' wall/CPU limit in seconds.
    pub compile_timeout_s: f64,
    /// Replace a worker after this many calls (0: never).
    pub recycle_after: u64,
    /// Most calls in one batch.
    pub max_batch: usize,
    /// Longest a call waits in the queue for a worker, in seconds; past it the call is
    /// refused (429 with a retry hint) without having run.
    pub queue_wait_s: f64,
    /// Where toolkit layers of the language table are found when the image store lacks
    /// them (`scripts/images/build-function-toolkits.sh` builds them there): `DIR/NAME` is
    /// imported as image NAME on first use.
    pub toolkit_dir: PathBuf,
    /// Languages added to (or replacing) the built-in table, by name.
    pub languages: BTreeMap<String, languages::LanguageSpec>,
}

impl Default for FunctionConfig {
    fn default() -> Self {
        FunctionConfig {
            enabled: true,
            default_image: "debian".into(),
            min_workers: 1,
            max_workers: 4,
            idle_shrink_s: 300.0,
            queue_limit: 1024,
            worker_memory_mb: 1024,
            worker_cpu_cores: 1.0,
            worker_pids: 256,
            default_timeout_s: 10.0,
            max_timeout_s: 300.0,
            default_memory_mb: 256,
            default_pids: 64,
            compile_timeout_s: 30.0,
            recycle_after: 0,
            max_batch: 10_000,
            queue_wait_s: 60.0,
            toolkit_dir: PathBuf::from("/var/cache/dsec/function-toolkits"),
            languages: BTreeMap::new(),
        }
    }
}

/// A bad `[edge.functions]` value: the key and what is allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct FunctionConfigError {
    pub key: &'static str,
    pub message: String,
}

impl FunctionConfig {
    /// Checks the values; the error names the bad key.
    pub fn validate(&self) -> Result<(), FunctionConfigError> {
        let bad = |key, message: &str| {
            Err(FunctionConfigError {
                key,
                message: message.to_string(),
            })
        };
        if self.max_workers == 0 {
            return bad("functions.max_workers", "must be at least 1");
        }
        if self.min_workers > self.max_workers {
            return bad("functions.min_workers", "must not exceed max_workers");
        }
        if self.worker_memory_mb < 64 {
            return bad("functions.worker_memory_mb", "must be at least 64");
        }
        if !(self.default_timeout_s > 0.0 && self.max_timeout_s >= self.default_timeout_s) {
            return bad(
                "functions.default_timeout_s",
                "must be > 0 and <= max_timeout_s",
            );
        }
        if !(self.queue_wait_s.is_finite() && self.queue_wait_s > 0.0) {
            return bad("functions.queue_wait_s", "must be > 0");
        }
        languages::Languages::new(&self.languages).map_err(|e| FunctionConfigError {
            key: "functions.languages",
            message: e.to_string(),
        })?;
        Ok(())
    }
}

/// What a pool serves.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolKey {
    pub image: String,
    pub toolkits: Vec<String>,
    pub language: String,
}

impl std::fmt::Display for PoolKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.image, self.language)?;
        for t in &self.toolkits {
            write!(f, "+{t}")?;
        }
        Ok(())
    }
}

/// Why a function call could not be run (a call that ran but failed is a result, not this).
#[derive(Debug, thiserror::Error)]
pub enum FunctionError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{message}")]
    QueueFull { message: String, retry_after_s: u64 },
    #[error("{0}")]
    Image(dsec_image::ImageError),
    #[error("function worker: {0}")]
    Worker(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("function calls are disabled on this node ([edge.functions] enabled = false) or not supported by its substrate")]
    Disabled,
}

impl FunctionError {
    /// The wire code, for the per-item errors of a batch (the edge's `error.rs` maps a
    /// whole call's error to the same code and its HTTP status).
    pub fn code(&self) -> &'static str {
        match self {
            FunctionError::BadRequest(_) => codes::BAD_REQUEST,
            FunctionError::QueueFull { .. } => codes::QUOTA_EXCEEDED,
            FunctionError::Image(_) => codes::IMAGE_NOT_FOUND,
            FunctionError::Worker(_) => codes::INTERNAL,
            FunctionError::Unavailable(_) => codes::NODE_UNAVAILABLE,
            FunctionError::Disabled => codes::UNSUPPORTED,
        }
    }
}

/// The function-call service of one edge.
pub struct Functions {
    cfg: Arc<FunctionConfig>,
    factory: Arc<WorkerFactory>,
    pools: Mutex<HashMap<PoolKey, Arc<Pool>>>,
    languages: languages::Languages,
    /// Held while a toolkit layer is imported from `toolkit_dir` (one import at a time).
    toolkit_import: tokio::sync::Mutex<()>,
}

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

impl Functions {
    /// Creates the service; removes worker dirs an earlier run left (their cgroups were reaped
    /// with the other orphans) and starts the upkeep task.
    pub fn start(
        cfg: FunctionConfig,
        substrate: ContainerSubstrate,
        images: Arc<ImageStore>,
        dir: PathBuf,
        node_id: &str,
    ) -> Arc<Self> {
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %dir.display(), error = %e, "remove stale function workers");
            }
        }
        let langs = languages::Languages::new(&cfg.languages).unwrap_or_else(|e| {
            tracing::warn!(error = %e, "function language table: using the built-in one");
            languages::Languages::builtin()
        });
        let cfg = Arc::new(cfg);
        let me = Arc::new(Functions {
            languages: langs,
            toolkit_import: tokio::sync::Mutex::new(()),
            factory: Arc::new(WorkerFactory {
                substrate: Arc::new(substrate),
                images,
                dir,
                node_id: node_id.to_string(),
                cfg: cfg.clone(),
            }),
            cfg,
            pools: Mutex::new(HashMap::new()),
        });
        let weak = Arc::downgrade(&me);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tick.tick().await;
                let Some(me) = weak.upgrade() else { return };
                for p in me.all_pools() {
                    p.tick().await;
                }
            }
        });
        me
    }

    fn all_pools(&self) -> Vec<Arc<Pool>> {
        self.pools
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    fn pool(&self, key: PoolKey) -> Arc<Pool> {
        self.pools
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.clone())
            .or_insert_with(|| Pool::new(key, self.cfg.clone(), self.factory.clone()))
            .clone()
    }

    pub fn pools(&self) -> FunctionPoolList {
        let mut pools: Vec<_> = self.all_pools().iter().map(|p| p.info()).collect();
        pools.sort_by(|a, b| (&a.image, &a.language).cmp(&(&b.image, &b.language)));
        FunctionPoolList { pools }
    }

    /// Runs one call.
    pub async fn call(
        &self,
        req: FunctionCallRequest,
    ) -> Result<FunctionCallResult, FunctionError> {
        let mut prepared = self.prepare(&req)?;
        if let Some((toolkit, optional)) = prepared.toolkit.take() {
            if self.ensure_toolkit(&toolkit).await? {
                prepared.key.toolkits.push(toolkit);
            } else if !optional {
                return Err(FunctionError::BadRequest(format!(
                    "language {:?} needs the toolkit {toolkit:?}, which this node does not have \
                     (build it with scripts/images/build-function-toolkits.sh into {}); \
                     this node runs: {}",
                    req.language,
                    self.cfg.toolkit_dir.display(),
                    self.runnable_languages().join(", ")
                )));
            }
        }
        let pool = self.pool(prepared.key.clone());
        let mut lent = pool.acquire().await?;
        let started = Instant::now();
        let out = run_call(&mut lent.worker, &prepared, &req).await;
        lent.worker.calls += 1;
        let mut result = out.result;
        result.worker = lent.worker.id.clone();
        result.queue_ms = lent.queue_ms;
        result.files = out.files;
        match out.health {
            Health::Known(healthy) => pool.release(lent, healthy, started.elapsed()),
            // The answer goes out now; the worker goes back to the pool (or is replaced) once
            // its server has confirmed the cleanup. Its slot stays taken until then, and a
            // spawned task cannot be cancelled by a client that hangs up.
            Health::Pending => {
                pool.settling();
                tokio::spawn(async move {
                    let healthy = finish_pending(&mut lent.worker, CLEANUP_MARGIN).await;
                    pool.release_settled(lent, healthy, started.elapsed());
                });
            }
        }
        Ok(result)
    }

    /// Runs many calls with bounded concurrency; `results[i]` answers `calls[i]`. Items never
    /// get 429: they wait for room in the queue instead.
    pub async fn batch(
        &self,
        req: FunctionBatchRequest,
    ) -> Result<FunctionBatchResult, FunctionError> {
        if req.calls.len() > self.cfg.max_batch {
            return Err(FunctionError::BadRequest(format!(
                "a batch holds at most {} calls ({} given); split it",
                self.cfg.max_batch,
                req.calls.len()
            )));
        }
        let conc = req
            .concurrency
            .unwrap_or(self.cfg.max_workers)
            .clamp(1, self.cfg.max_workers.max(1) * 2);
        let results = futures::stream::iter(req.calls.into_iter().map(|c| async move {
            loop {
                match self.call(c.clone()).await {
                    Ok(r) => {
                        return FunctionBatchItem {
                            result: Some(r),
                            error: None,
                        }
                    }
                    Err(FunctionError::QueueFull { retry_after_s, .. }) => {
                        let ms = (retry_after_s * 1000).min(50);
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                    }
                    Err(e) => {
                        return FunctionBatchItem {
                            result: None,
                            error: Some(ErrorDetail {
                                code: e.code().to_string(),
                                message: e.to_string(),
                            }),
                        }
                    }
                }
            }
        }))
        .buffered(conc)
        .collect::<Vec<_>>()
        .await;
        Ok(FunctionBatchResult { results })
    }

    /// Destroys every worker (waits a little for busy ones).
    pub async fn shutdown(&self) {
        for p in self.all_pools() {
            p.shutdown(Duration::from_secs(10)).await;
        }
    }

    fn prepare(&self, req: &FunctionCallRequest) -> Result<Prepared, FunctionError> {
        let Some(language) = self.languages.canonical(&req.language) else {
            return Err(FunctionError::BadRequest(format!(
                "unknown language {:?}: this node runs {} (more are added in the config file's \
                 [edge.functions.languages])",
                req.language,
                self.runnable_languages().join(", ")
            )));
        };
        let (plan, toolkit) = match self.languages.get(language) {
            Some(sp) => (
                languages::plan_for(sp, &req.code, &req.args),
                // A call naming its own toolkits uses those instead of the table's.
                sp.toolkit
                    .clone()
                    .filter(|_| req.toolkits.is_empty())
                    .map(|t| (t, sp.toolkit_optional)),
            ),
            None => (languages::plan_command(&req.args, &req.command)?, None),
        };
        let bad = |m: String| Err(FunctionError::BadRequest(m));
        let secs = |v: Option<f64>, what: &str, default: f64| -> Result<u64, FunctionError> {
            let s = v.unwrap_or(default);
            if !(s.is_finite() && s > 0.0 && s <= self.cfg.max_timeout_s) {
                return Err(FunctionError::BadRequest(format!(
                    "{what} must be > 0 and at most {} seconds",
                    self.cfg.max_timeout_s
                )));
            }
            Ok((s * 1000.0).ceil() as u64)
        };
        let timeout_ms = secs(req.timeout, "timeout", self.cfg.default_timeout_s)?;
        let cpu_ms = secs(
            req.cpu_time_limit,
            "cpu_time_limit",
            timeout_ms as f64 / 1000.0,
        )?;
        let memory_mb = req.memory_limit_mb.unwrap_or(self.cfg.default_memory_mb);
        if memory_mb == 0 || memory_mb > self.cfg.worker_memory_mb.saturating_sub(32) {
            return bad(format!(
                "memory_limit_mb must be between 1 and {} on this node",
                self.cfg.worker_memory_mb.saturating_sub(32)
            ));
        }
        let max_output = req
            .max_output
            .unwrap_or(dsec_wire::api::limits::DEFAULT_MAX_OUTPUT);
        if max_output == 0 || max_output > dsec_wire::api::limits::MAX_MAX_OUTPUT {
            return bad(format!(
                "max_output must be between 1 and {}",
                dsec_wire::api::limits::MAX_MAX_OUTPUT
            ));
        }
        let pids = req.pids_limit.unwrap_or(self.cfg.default_pids);
        if pids == 0 || pids >= self.cfg.worker_pids {
            return bad(format!(
                "pids_limit must be between 1 and {}",
                self.cfg.worker_pids - 1
            ));
        }
        for (k, v) in req.env.iter() {
            if k.is_empty() || k.contains('=') || k.contains('\0') {
                return bad(format!("bad environment variable name {k:?}"));
            }
            if v.contains('\0') {
                return bad(format!(
                    "environment variable {k:?} has a NUL byte in its value"
                ));
            }
        }
        for path in req
            .files
            .keys()
            .chain(req.files_base64.keys())
            .chain(req.fetch_files.iter())
        {
            if !call_path_ok(path) {
                return bad(format!(
                    "file name {path:?} must be a relative path inside the scratch dir or an \
                     absolute one under {}",
                    ABS_DIRS.join(", ")
                ));
            }
        }
        if req.fetch_files.len() > MAX_FETCH {
            return bad(format!(
                "fetch_files names at most {MAX_FETCH} files ({} given)",
                req.fetch_files.len()
            ));
        }
        if let Some(cases) = &req.test_cases {
            if cases.is_empty() {
                return bad("test_cases must hold at least one case".into());
            }
        }
        let image = req
            .image
            .clone()
            .unwrap_or_else(|| self.cfg.default_image.clone());
        let image = dsec_image::canonical_name(&image).map_err(FunctionError::Image)?;
        let mut files: BTreeMap<String, String> = req
            .files
            .iter()
            .map(|(k, v)| (k.clone(), B64.encode(v.as_bytes())))
            .collect();
        for (k, v) in &req.files_base64 {
            if B64.decode(v.as_bytes()).is_err() {
                return bad(format!("files_base64[{k:?}] is not valid base64"));
            }
            files.insert(k.clone(), v.clone());
        }
        if let Some(f) = &plan.code_file {
            if !req.code.is_empty() || language != "command" {
                files.insert(f.clone(), B64.encode(req.code.as_bytes()));
            }
        }
        let compile_ms = secs(
            req.compile_timeout,
            "compile_timeout",
            self.cfg.compile_timeout_s,
        )?;
        Ok(Prepared {
            key: PoolKey {
                image,
                toolkits: req.toolkits.clone(),
                language: language.to_string(),
            },
            toolkit,
            fetch: req.fetch_files.clone(),
            plan,
            files,
            timeout_ms,
            cpu_ms,
            memory_mb,
            max_output,
            pids,
            compile_ms,
        })
    }

    /// The languages this node can run now: those needing no toolkit, or whose toolkit is in
    /// the image store or in `toolkit_dir`.
    pub fn runnable_languages(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .languages
            .iter()
            .filter(|(_, sp)| match &sp.toolkit {
                None => true,
                Some(_) if sp.toolkit_optional => true,
                Some(t) => self.toolkit_present(t),
            })
            .map(|(k, _)| k.clone())
            .collect();
        out.push("command".into());
        out
    }

    fn toolkit_present(&self, name: &str) -> bool {
        self.factory.images.get(name).is_ok() || self.cfg.toolkit_dir.join(name).is_dir()
    }

    /// Makes toolkit `name` an image of the store, importing `toolkit_dir/name` the first time.
    /// False when neither has it.
    async fn ensure_toolkit(&self, name: &str) -> Result<bool, FunctionError> {
        if self.factory.images.get(name).is_ok() {
            return Ok(true);
        }
        let dir = self.cfg.toolkit_dir.join(name);
        if !dir.is_dir() {
            return Ok(false);
        }
        let _one = self.toolkit_import.lock().await;
        if self.factory.images.get(name).is_ok() {
            return Ok(true);
        }
        let started = Instant::now();
        self.factory
            .images
            .import_dir(name, &dir)
            .await
            .map_err(FunctionError::Image)?;
        tracing::info!(toolkit = name, dir = %dir.display(), secs = started.elapsed().as_secs_f64(), "function toolkit imported");
        Ok(true)
    }
}

/// Absolute paths a call's files may have (wiped after every call).
const ABS_DIRS: &[&str] = &["/tmp", "/var/tmp", "/dev/shm"];

/// Most files one call may fetch back.
const MAX_FETCH: usize = 256;

/// A relative path inside the scratch dir, or an absolute one under [`ABS_DIRS`], with no
/// `.`/`..`/empty components.
fn call_path_ok(path: &str) -> bool {
    if path.is_empty() || path.contains('\0') {
        return false;
    }
    let rel = match path.strip_prefix('/') {
        Some(rest) => {
            let Some(dir) = ABS_DIRS
                .iter()
                .find(|d| rest.starts_with(&d[1..]) && rest[d.len() - 1..].starts_with('/'))
            else {
                return false;
            };
            &rest[dir.len()..]
        }
        None => path,
    };
    rel.split('/')
        .all(|c| !c.is_empty() && c != "." && c != "..")
}

struct Prepared {
    key: PoolKey,
    /// The language's toolkit (and whether it may be absent), added to `key` by `call`.
    toolkit: Option<(String, bool)>,
    fetch: Vec<String>,
    plan: languages::Plan,
    files: BTreeMap<String, String>,
    timeout_ms: u64,
    cpu_ms: u64,
    memory_mb: u64,
    max_output: u64,
    pids: u64,
    compile_ms: u64,
}

struct CallOutcome {
    result: FunctionCallResult,
    health: Health,
    files: BTreeMap<String, String>,
}

/// Whether a worker may serve another call after this one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Health {
    Known(bool),
    /// Its server answered early: read the cleanup's answer first ([`finish_pending`]).
    Pending,
}

/// How long the server's cleanup (and a sweep) may take.
const CLEANUP_MARGIN: Duration = Duration::from_secs(10);

fn run_result(r: &StepResult, status: FunctionStatus, peak: u64) -> RunResult {
    let text = |b: &str| {
        let bytes = B64.decode(b).unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    RunResult {
        status,
        exit_code: r.exit,
        signal: r.signal,
        stdout: text(&r.stdout),
        stderr: text(&r.stderr),
        wall_ms: r.wall_ms,
        cpu_ms: r.cpu_ms,
        peak_memory_bytes: peak,
    }
}

fn sandbox_error(message: String) -> RunResult {
    RunResult {
        status: FunctionStatus::SandboxError,
        exit_code: -1,
        stderr: message,
        ..Default::default()
    }
}

/// Runs a prepared call on a worker: begin (+ compile), then the runs, then end.
async fn run_call(w: &mut worker::Worker, p: &Prepared, req: &FunctionCallRequest) -> CallOutcome {
    let margin = CLEANUP_MARGIN;
    let broken = |msg: String| CallOutcome {
        result: FunctionCallResult {
            run: sandbox_error(msg),
            verdict: req.test_cases.as_ref().map(|_| Verdict::SandboxError),
            ..Default::default()
        },
        health: Health::Known(false),
        files: BTreeMap::new(),
    };
    let mut env = p.plan.env.clone();
    env.extend(req.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    let begin = Some(Begin {
        files: p.files.clone(),
        env,
    });
    let mut compile_result = None;
    let mut begun = begin;
    if let Some(argv) = &p.plan.compile {
        let base = w.arm(p.memory_mb.max(w_cap_mb(w)), 0);
        let step = Step {
            run: worker::RunSpec::Exec { argv: argv.clone() },
            stdin: String::new(),
            timeout_ms: p.compile_ms,
            cpu_ms: p.compile_ms,
            fsize: 256 * 1024 * 1024,
            keep: 64 * 1024,
        };
        let req_c = ServerRequest {
            begin: begun.take(),
            steps: vec![step],
            stop_on_fail: true,
            end: false,
            reap: false,
            early: false,
            fetch: Vec::new(),
        };
        let (ans, mem) = w
            .measured(&req_c, Duration::from_millis(p.compile_ms) + margin, base)
            .await;
        let ans = match ans {
            Ok(a) => a,
            Err(e) => return broken(e.to_string()),
        };
        let Some(r) = ans.results.first() else {
            return broken("the fork-server ran no compile step".into());
        };
        let status = verdict::status_of(r, verdict::hit_memory_limit(&mem), true);
        let rr = run_result(r, status, mem.peak_bytes);
        if status != FunctionStatus::Ok {
            // End the call (wipe), then report the compiler's complaint.
            let end = ServerRequest {
                end: true,
                ..Default::default()
            };
            let clean =
                matches!(w.exchange(&end, margin).await, Ok(a) if a.clean && a.error.is_none());
            let healthy = settle(w, clean, margin).await;
            let verdict = req.test_cases.as_ref().map(|_| Verdict::CompileError);
            return CallOutcome {
                result: FunctionCallResult {
                    run: rr.clone(),
                    compile: Some(rr),
                    cases: None,
                    verdict,
                    ..Default::default()
                },
                health: Health::Known(healthy),
                files: BTreeMap::new(),
            };
        }
        compile_result = Some(rr);
    }
    let stdins: Vec<&str> = match &req.test_cases {
        Some(cases) => cases.iter().map(|c| c.stdin.as_str()).collect(),
        None => vec![req.stdin.as_str()],
    };
    let steps: Vec<Step> = stdins
        .iter()
        .map(|s| Step {
            run: p.plan.run.clone(),
            stdin: B64.encode(s.as_bytes()),
            timeout_ms: p.timeout_ms,
            cpu_ms: p.cpu_ms,
            fsize: p.max_output,
            keep: p.max_output,
        })
        .collect();
    let n = steps.len() as u32;
    let run_req = ServerRequest {
        begin: begun.take(),
        steps,
        stop_on_fail: false,
        end: true,
        reap: false,
        early: true,
        fetch: p.fetch.clone(),
    };
    let base = w.arm(p.memory_mb, p.pids);
    let (ans, mem) = w
        .measured(
            &run_req,
            Duration::from_millis(p.timeout_ms) * n + margin,
            base,
        )
        .await;
    let ans = match ans {
        Ok(a) => a,
        Err(e) => return broken(e.to_string()),
    };
    if ans.results.len() != stdins.len() {
        return broken(format!(
            "the fork-server ran {} of {} runs",
            ans.results.len(),
            stdins.len()
        ));
    }
    if !ans.clean {
        tracing::debug!(worker = %w.id, survivors = ?ans.survivors, "function call left processes behind");
    }
    // The fork-server must be the only process left in the worker's user cgroup (checked
    // after its cleanup when it answered early).
    let health = if ans.pending {
        Health::Pending
    } else {
        Health::Known(settle(w, ans.clean, margin).await)
    };
    let oom = verdict::hit_memory_limit(&mem);
    let runs: Vec<RunResult> = ans
        .results
        .iter()
        .map(|r| {
            let mut status = verdict::status_of(r, oom, false);
            // A run the OOM killer stopped but that the server saw as a plain SIGKILL is
            // caught above; a run whose peak crossed the limit and then failed is too.
            if status == FunctionStatus::RuntimeError
                && mem.peak_bytes >= p.memory_mb * 1024 * 1024 * 95 / 100
            {
                status = FunctionStatus::MemoryExceeded;
            }
            run_result(r, status, mem.peak_bytes)
        })
        .collect();
    let (cases, verdict) = match &req.test_cases {
        Some(tc) => {
            let cases: Vec<CaseResult> = runs
                .iter()
                .zip(tc)
                .map(|(r, c)| CaseResult {
                    verdict: verdict::verdict(r.status, &r.stdout, &c.expected, req.compare),
                    run: r.clone(),
                })
                .collect();
            let v = verdict::overall(cases.iter().map(|c| c.verdict));
            (Some(cases), Some(v))
        }
        None => (None, None),
    };
    CallOutcome {
        result: FunctionCallResult {
            run: runs.into_iter().next().unwrap_or_default(),
            compile: compile_result,
            cases,
            verdict,
            ..Default::default()
        },
        health,
        files: ans.files,
    }
}

/// After an early answer: reads the server's cleanup answer, then settles the worker like any
/// call. Whether the worker may serve another call.
async fn finish_pending(w: &mut worker::Worker, margin: Duration) -> bool {
    let clean = match w.read_answer(margin).await {
        Ok(a) if a.error.is_none() => {
            if !a.clean {
                tracing::debug!(worker = %w.id, survivors = ?a.survivors, "function call left processes behind");
            }
            a.clean
        }
        Ok(a) => {
            tracing::warn!(worker = %w.id, error = ?a.error, "function worker: cleanup failed");
            return false;
        }
        Err(e) => {
            tracing::warn!(worker = %w.id, error = %e, "function worker: no cleanup answer");
            return false;
        }
    };
    let healthy = settle(w, clean, margin).await;
    w.refresh_oom();
    healthy
}

/// After a call: the worker is reusable when its server reported it clean and nothing but the
/// server is left in its user cgroup; otherwise the worker is swept (every leftover process
/// killed from outside, then reaped and re-wiped by the server), and only a worker that cannot
/// be made clean is reported unhealthy (and replaced).
async fn settle(w: &mut worker::Worker, clean: bool, margin: Duration) -> bool {
    if !w.alive() {
        return false;
    }
    if clean && w.strays().is_empty() {
        return true;
    }
    let ok = w.sweep(margin).await;
    tracing::info!(worker = %w.id, server_clean = clean, swept_clean = ok, "function worker swept after a call");
    ok
}

/// The worker's memory cap in MiB (compile steps get all of it).
fn w_cap_mb(_w: &worker::Worker) -> u64 {
    u64::MAX / (2 * 1024 * 1024)
}
