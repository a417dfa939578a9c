//! One warm worker: a container sandbox from the runtime (namespaces, cgroup, seccomp, empty
//! network namespace) running the fork-server (`forkserver.py`) as a long-lived command.
//!
//! The edge talks to the fork-server over a unix socket the server binds inside the sandbox
//! and the edge reaches through `/proc/<aether pid>/root/...` (the sandbox's own mount
//! namespace, as the host sees it). The server accepts exactly one connection and then removes
//! the socket, so code inside the sandbox cannot reach the server afterwards.
//!
//! Per call the edge sets the call's memory limit on the worker's memory cgroup (the warm
//! runtime's own use + the call's limit), resets the high-water mark, and reads the peak and
//! the OOM-kill counter afterwards; the pids limit goes to the user pids cgroup.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dsec_image::{ImageLease, ImageStore};
use dsec_runtime::aether_client::{Call, ChannelError};
use dsec_runtime::cgroup::{Cgroup, CgroupRoot, CgroupVersion};
use dsec_runtime::container::{ContainerSandbox, ContainerSubstrate};
use dsec_runtime::substrate::SandboxSpec;
use dsec_wire::aether::{Reply, Request, Stream};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use super::{FunctionConfig, FunctionError, PoolKey};

/// What went wrong starting or talking to a worker's fork-server. Any of these means the
/// worker is broken (it is destroyed, never reused).
#[derive(Debug, thiserror::Error)]
pub enum ForkServerError {
    #[error("start python3: {0}")]
    Start(ChannelError),
    #[error("the fork-server exited ({code}): {said}")]
    Exited { code: i32, said: String },
    #[error("aether: {0}")]
    Aether(String),
    #[error("the fork-server's request ended")]
    RequestEnded,
    #[error("channel: {0}")]
    Channel(ChannelError),
    #[error("no \"ready\" within {0:?}")]
    NotReady(Duration),
    #[error("connect {}: {source}", path.display())]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("encode request: {0}")]
    Encode(serde_json::Error),
    #[error("request too large")]
    RequestTooLarge,
    #[error("send to the fork-server: {0}")]
    Send(std::io::Error),
    #[error("the fork-server did not answer within {0:?}")]
    AnswerTimeout(Duration),
    #[error("the fork-server did not confirm its cleanup within {0:?}")]
    CleanupTimeout(Duration),
    #[error("the fork-server did not answer: {0}")]
    NoAnswer(std::io::Error),
    #[error("answer of {0} bytes is too large")]
    AnswerTooLarge(usize),
    #[error("read the fork-server's answer: {0}")]
    Read(std::io::Error),
    #[error("bad answer from the fork-server: {0}")]
    BadAnswer(serde_json::Error),
}

/// Why one step of a call broke the worker.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Channel(#[from] ForkServerError),
    /// The fork-server answered with a failure of its own.
    #[error("the fork-server failed: {0}")]
    Server(String),
}

/// The fork-server's source, run with `python3 -I -c`.
pub const FORKSERVER: &str = include_str!("../guest/forkserver.py");
/// How long a new worker may take to answer "ready".
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest answer the server may send.
const MAX_ANSWER: usize = 256 * 1024 * 1024;

/// What one step (compile or run) asks of the server.
#[derive(Debug, Clone, Serialize)]
pub struct Step {
    pub run: RunSpec,
    /// Base64 of the step's stdin.
    pub stdin: String,
    pub timeout_ms: u64,
    pub cpu_ms: u64,
    /// RLIMIT_FSIZE - 1: larger output (or any larger file) is `output_exceeded`.
    pub fsize: u64,
    /// Bytes of each output stream sent back.
    pub keep: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum RunSpec {
    /// Run the file in the warm interpreter (forked, no new interpreter start).
    Python {
        code_path: String,
        args: Vec<String>,
    },
    Exec {
        argv: Vec<String>,
    },
}

/// One request frame to the server.
#[derive(Debug, Clone, Serialize, Default)]
pub struct ServerRequest {
    /// Start a call: fresh scratch dir with these files (base64) and this environment.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub begin: Option<Begin>,
    pub steps: Vec<Step>,
    /// Stop after the first step that fails.
    pub stop_on_fail: bool,
    /// End the call: wipe its scratch dir and every world-writable dir.
    pub end: bool,
    /// Only kill and reap whatever is left (after the edge swept the worker's cgroup).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub reap: bool,
    /// With `end`: answer right after the last run, then kill, reap and wipe, and confirm that
    /// in a second answer (read it with [`Worker::read_answer`] before lending the worker again).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub early: bool,
    /// Files to read back after the last step (relative to the scratch dir, or absolute under
    /// the wiped dirs), answered in [`ServerAnswer::files`].
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fetch: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Begin {
    pub files: BTreeMap<String, String>,
    pub env: BTreeMap<String, String>,
}

/// The server's account of one step.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct StepResult {
    pub exit: i32,
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub stdout_size: u64,
    pub stderr_size: u64,
    pub wall_ms: f64,
    pub cpu_ms: f64,
    pub timed_out: bool,
    pub cpu_exceeded: bool,
    pub output_exceeded: bool,
}

#[derive(Debug, Clone, Deserialize, Default)]
pub struct ServerAnswer {
    #[serde(default)]
    pub results: Vec<StepResult>,
    /// Every process of the call is gone and (after `end`) its files too.
    #[serde(default)]
    pub clean: bool,
    #[serde(default)]
    pub error: Option<String>,
    /// Processes the server could not get rid of (diagnostics).
    #[serde(default)]
    pub survivors: Vec<String>,
    /// An `early` answer: the cleanup's own answer follows.
    #[serde(default)]
    pub pending: bool,
    /// The `fetch` files that existed: path → base64 content.
    #[serde(default)]
    pub files: BTreeMap<String, String>,
}

/// Memory measured around one exchange.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryReport {
    pub peak_bytes: u64,
    pub oom_kills: u64,
}

/// Builds workers.
pub struct WorkerFactory {
    pub substrate: Arc<ContainerSubstrate>,
    pub images: Arc<ImageStore>,
    /// `<data>/edge/functions`: one dir per worker.
    pub dir: PathBuf,
    pub node_id: String,
    pub cfg: Arc<FunctionConfig>,
}

/// A warm worker. Owned by exactly one call at a time.
pub struct Worker {
    pub id: String,
    pub key: PoolKey,
    sandbox: ContainerSandbox,
    substrate: Arc<ContainerSubstrate>,
    lease: Option<ImageLease>,
    dir: PathBuf,
    conn: UnixStream,
    /// The server's `Exec`; kept so its output frames have a home.
    _server: Call,
    /// Host pid of the fork-server (the one process a clean worker's user cgroup holds).
    server_pid: Option<i32>,
    mem: MemFiles,
    /// Memory cap of the worker (bytes): the most a call may set.
    cap_bytes: u64,
    pids_cap: u64,
    /// What the limit files hold (written by us), so unchanged values are not rewritten.
    cur_limit: Option<u64>,
    cur_pids: Option<u64>,
    /// The cgroup's OOM-kill counter as last read (before the next call).
    oom_seen: u64,
    pub calls: u64,
    pub created: Instant,
}

impl WorkerFactory {
    /// Starts a container for `key` and its fork-server; everything built is removed on error.
    pub async fn create(&self, key: &PoolKey) -> Result<Worker, FunctionError> {
        let lease = self
            .images
            .acquire_composed(&key.image, None, &key.toolkits)
            .await
            .map_err(FunctionError::Image)?;
        let id = dsec_wire::id::make_sandbox_id(&self.node_id, rand::random());
        let dir = self.dir.join(&id);
        std::fs::create_dir_all(&dir)
            .map_err(|e| FunctionError::Worker(format!("create {}: {e}", dir.display())))?;
        let spec = SandboxSpec {
            id: id.clone(),
            hostname: "fn".into(),
            lowers: lease.lowers(),
            dir: dir.clone(),
            memory_limit_mb: self.cfg.worker_memory_mb,
            cpu_cores_limit: self.cfg.worker_cpu_cores,
            pids_limit: self.cfg.worker_pids,
            user: "root".into(),
            env: BTreeMap::new(),
            netns: None,
            protected_paths: Vec::new(),
            disk_limit_mb: None,
            layer_files: Vec::new(),
            binds: Vec::new(),
        };
        let sandbox = match self.substrate.create(spec).await {
            Ok(s) => s,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(FunctionError::Worker(format!(
                    "start worker container: {e}"
                )));
            }
        };
        match start_server(&sandbox).await {
            Ok((conn, server)) => {
                let mem = MemFiles::new(self.substrate.cgroup_root(), sandbox.cgroup());
                // aether starts a `default` shell session in every container ahead of its
                // first call; a worker has no use for it (and it must not be taken for the
                // fork-server): end it. Were it started after this, the first call's sweep
                // removes it as a stray.
                let close = Request::CloseSession {
                    session: "default".into(),
                };
                if let Ok(c) = sandbox.aether().call(close, Bytes::new()).await {
                    let _ = dsec_runtime::aether_client::collect(c).await;
                }
                let server_pid = user_pids(&sandbox)
                    .into_iter()
                    .find(|p| *p != sandbox.pid() && is_forkserver(*p));
                let oom_seen = sandbox.cgroup().oom_kills().unwrap_or(0);
                Ok(Worker {
                    id,
                    key: key.clone(),
                    sandbox,
                    substrate: self.substrate.clone(),
                    lease: Some(lease),
                    dir,
                    conn,
                    _server: server,
                    server_pid,
                    mem,
                    cap_bytes: self.cfg.worker_memory_mb * 1024 * 1024,
                    pids_cap: self.cfg.worker_pids,
                    cur_limit: None,
                    cur_pids: None,
                    oom_seen,
                    calls: 0,
                    created: Instant::now(),
                })
            }
            Err(e) => {
                let cleanup = self.substrate.destroy(&sandbox).await;
                let _ = std::fs::remove_dir_all(&dir);
                Err(FunctionError::Worker(match cleanup {
                    Ok(()) => format!("start the warm runtime in {id}: {e}"),
                    Err(c) => {
                        format!("start the warm runtime in {id}: {e}; cleanup also failed: {c}")
                    }
                }))
            }
        }
    }
}

/// Runs the fork-server through aether, waits for "ready" and connects to its socket.
async fn start_server(sandbox: &ContainerSandbox) -> Result<(UnixStream, Call), ForkServerError> {
    let token = hex::encode(rand::random::<[u8; 8]>());
    let inside = format!("/run/dsec-fn/{token}.sock");
    let req = Request::Exec {
        argv: vec![
            "python3".into(),
            "-I".into(),
            "-c".into(),
            FORKSERVER.into(),
            inside.clone(),
        ],
        timeout_ms: 0,
        env: BTreeMap::new(),
        cwd: Some("/".into()),
        user: Some("root".into()),
        max_output: 64 * 1024,
        stream: true,
    };
    let mut call = sandbox
        .aether()
        .call(req, Bytes::new())
        .await
        .map_err(ForkServerError::Start)?;
    let mut said = Vec::new();
    let ready = tokio::time::timeout(READY_TIMEOUT, async {
        loop {
            match call.next().await {
                Ok(Some((Reply::Output { stream }, body))) => {
                    if stream == Stream::Stdout {
                        said.extend_from_slice(&body);
                        if said.windows(6).any(|w| w == b"ready\n") {
                            return Ok(());
                        }
                    } else {
                        said.extend_from_slice(&body);
                    }
                }
                Ok(Some((Reply::CommandDone(o), body))) => {
                    return Err(ForkServerError::Exited {
                        code: o.exit_code,
                        said: format!(
                            "{}{}",
                            String::from_utf8_lossy(&said),
                            String::from_utf8_lossy(&body)
                        ),
                    })
                }
                Ok(Some((Reply::Error(e), _))) => return Err(ForkServerError::Aether(e.message)),
                Ok(Some(_)) => {}
                Ok(None) => return Err(ForkServerError::RequestEnded),
                Err(e) => return Err(ForkServerError::Channel(e)),
            }
        }
    })
    .await;
    match ready {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => return Err(ForkServerError::NotReady(READY_TIMEOUT)),
    }
    let host = PathBuf::from(format!("/proc/{}/root{inside}", sandbox.pid()));
    let conn = UnixStream::connect(&host)
        .await
        .map_err(|source| ForkServerError::Connect { path: host, source })?;
    Ok((conn, call))
}

impl Worker {
    /// Sends one request and waits up to `deadline` for the answer. Any error means the worker
    /// is broken (it must be destroyed, never reused).
    pub async fn exchange(
        &mut self,
        req: &ServerRequest,
        deadline: Duration,
    ) -> Result<ServerAnswer, ForkServerError> {
        let mut frame = Vec::with_capacity(512);
        frame.extend_from_slice(&[0u8; 4]);
        serde_json::to_writer(&mut frame, req).map_err(ForkServerError::Encode)?;
        let len = u32::try_from(frame.len() - 4).map_err(|_| ForkServerError::RequestTooLarge)?;
        frame[..4].copy_from_slice(&len.to_be_bytes());
        let fut = async {
            self.conn
                .write_all(&frame)
                .await
                .map_err(ForkServerError::Send)?;
            self.recv().await
        };
        match tokio::time::timeout(deadline, fut).await {
            Ok(r) => r,
            Err(_) => Err(ForkServerError::AnswerTimeout(deadline)),
        }
    }

    /// One step of a call armed by [`Worker::arm`] (`base`): the exchange, then the memory
    /// report. The answer, or why the worker is broken (its channel failed, or the fork-server
    /// itself reported a failure).
    pub async fn measured(
        &mut self,
        req: &ServerRequest,
        deadline: Duration,
        base: u64,
    ) -> (Result<ServerAnswer, StepError>, MemoryReport) {
        let ans = self.exchange(req, deadline).await;
        let mem = self.disarm(base);
        let ans = match ans {
            Ok(ServerAnswer { error: Some(e), .. }) => Err(StepError::Server(e)),
            Ok(a) => Ok(a),
            Err(e) => Err(e.into()),
        };
        (ans, mem)
    }

    /// Reads the answer that follows an `early` one (the call's cleanup). Any error means the
    /// worker is broken.
    pub async fn read_answer(
        &mut self,
        deadline: Duration,
    ) -> Result<ServerAnswer, ForkServerError> {
        match tokio::time::timeout(deadline, self.recv()).await {
            Ok(r) => r,
            Err(_) => Err(ForkServerError::CleanupTimeout(deadline)),
        }
    }

    async fn recv(&mut self) -> Result<ServerAnswer, ForkServerError> {
        let mut prefix = [0u8; 4];
        self.conn
            .read_exact(&mut prefix)
            .await
            .map_err(ForkServerError::NoAnswer)?;
        let n = u32::from_be_bytes(prefix) as usize;
        if n > MAX_ANSWER {
            return Err(ForkServerError::AnswerTooLarge(n));
        }
        let mut buf = vec![0u8; n];
        self.conn
            .read_exact(&mut buf)
            .await
            .map_err(ForkServerError::Read)?;
        let ans =
            serde_json::from_slice::<ServerAnswer>(&buf).map_err(ForkServerError::BadAnswer)?;
        Ok(ans)
    }

    /// Before a call: memory limit = current use (rounded up to a MiB, so that back-to-back
    /// calls usually need no write) + `limit_mb`, at most the worker's cap; high-water mark
    /// reset; pids limit (`0`: the worker's cap). A limit file is written only when its value
    /// changes: the limits stay armed between calls (the next call arms its own; nothing but
    /// the fork-server's cleanup runs in between). Returns the baseline use.
    pub fn arm(&mut self, limit_mb: u64, pids: u64) -> u64 {
        const MIB: u64 = 1024 * 1024;
        let base = self.mem.usage().unwrap_or(0);
        let limit = base
            .div_ceil(MIB)
            .saturating_mul(MIB)
            .saturating_add(limit_mb.saturating_mul(MIB))
            .min(self.cap_bytes.max(base));
        if self.cur_limit != Some(limit) {
            self.cur_limit = self.mem.set_limit(limit).then_some(limit);
        }
        self.mem.reset_peak();
        // +1 for the fork-server itself, which lives in the same user cgroup.
        let pids = if pids > 0 {
            pids.saturating_add(1).min(self.pids_cap.max(2))
        } else {
            self.pids_cap
        };
        if self.cur_pids != Some(pids) {
            self.cur_pids = self.mem.set_pids(pids).then_some(pids);
        }
        base
    }

    /// After a call: peak above `base`, OOM kills since the last look.
    pub fn disarm(&mut self, base: u64) -> MemoryReport {
        let peak = self.mem.peak().unwrap_or(0).saturating_sub(base);
        let now = self.oom_kills();
        let oom = now.saturating_sub(self.oom_seen);
        self.oom_seen = now;
        MemoryReport {
            peak_bytes: peak,
            oom_kills: oom,
        }
    }

    /// Takes in OOM kills that happened outside a call (its cleanup), so that the next call
    /// is not blamed for them.
    pub fn refresh_oom(&mut self) {
        self.oom_seen = self.oom_kills();
    }

    pub fn oom_kills(&self) -> u64 {
        self.sandbox.cgroup().oom_kills().unwrap_or(0)
    }

    /// The worker's container is still there (its agent and channel alive).
    pub fn alive(&self) -> bool {
        !self.sandbox.aether().is_closed() && self.sandbox.exit_status().is_none()
    }

    /// Processes in the worker's user cgroup (the fork-server and whatever a call left).
    pub fn user_procs(&self) -> usize {
        user_pids(&self.sandbox).len()
    }

    /// Host pids in the user cgroup other than the fork-server (and aether).
    pub fn strays(&self) -> Vec<i32> {
        let aether = self.sandbox.pid();
        user_pids(&self.sandbox)
            .into_iter()
            .filter(|p| Some(*p) != self.server_pid && *p != aether)
            .collect()
    }

    /// Makes the worker clean again after a call whose processes outlived the server's own
    /// cleanup (a process forked while the server was killing, a process in an unkillable
    /// sleep for a moment): freezes the whole container (so nothing can fork and no reaper can
    /// free a pid for reuse), SIGKILLs every process of the user cgroup but the fork-server,
    /// thaws, and repeats until none is left; then the server reaps and re-checks. Returns
    /// whether the worker is clean (if not, it must be destroyed).
    pub async fn sweep(&mut self, margin: Duration) -> bool {
        // Processes killed by the server's reap (a child forked while it was killing) may take
        // a moment to leave the cgroup: look again, then sweep again.
        for attempt in 0..3 {
            if !self.sweep_once(margin).await {
                return false;
            }
            for _ in 0..50 {
                if self.strays().is_empty() {
                    return self.alive();
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            tracing::debug!(worker = %self.id, attempt, strays = ?self.strays(), "function worker: processes left after the reap");
        }
        tracing::warn!(worker = %self.id, strays = ?self.strays(), "function worker: processes keep appearing after sweeps");
        false
    }

    /// One sweep: kill from outside until no stray is left, then the server reaps and wipes.
    async fn sweep_once(&mut self, margin: Duration) -> bool {
        let Some(server) = self.server_pid else {
            tracing::warn!(worker = %self.id, "function worker: fork-server pid unknown");
            return false;
        };
        let cg = self.sandbox.cgroup();
        for round in 0..200 {
            let strays = self.strays();
            if strays.is_empty() {
                break;
            }
            if round == 199 {
                tracing::warn!(worker = %self.id, ?strays, "function worker: processes survive SIGKILL");
                return false;
            }
            let frozen = cg.freeze().is_ok();
            for p in &strays {
                // SAFETY: kill(2) with a pid read from the frozen container's cgroup (no reaper
                // in it can run, so the pid cannot have been freed and reused) and a constant
                // signal; it touches no memory.
                unsafe {
                    libc::kill(*p, libc::SIGKILL);
                }
            }
            if frozen {
                if let Err(e) = cg.thaw() {
                    tracing::warn!(worker = %self.id, error = %e, "thaw function worker");
                    return false;
                }
            }
            tokio::time::sleep(Duration::from_millis(if round < 10 { 1 } else { 10 })).await;
        }
        if !self.user_pids_has(server) {
            tracing::warn!(worker = %self.id, "function worker: the fork-server is gone");
            return false;
        }
        let reap = ServerRequest {
            reap: true,
            ..Default::default()
        };
        match self.exchange(&reap, margin).await {
            Ok(a) if a.clean && a.error.is_none() => self.alive(),
            Ok(a) => {
                tracing::warn!(worker = %self.id, survivors = ?a.survivors, error = ?a.error, "function worker still unclean after a sweep");
                false
            }
            Err(e) => {
                tracing::warn!(worker = %self.id, error = %e, "function worker: reap after a sweep");
                false
            }
        }
    }

    fn user_pids_has(&self, pid: i32) -> bool {
        user_pids(&self.sandbox).contains(&pid)
    }

    /// Kills the container, removes its cgroup and directory, gives the image lease back.
    pub async fn destroy(mut self) {
        if let Err(e) = self.substrate.destroy(&self.sandbox).await {
            tracing::warn!(worker = %self.id, error = %e, "destroy function worker");
        }
        if let Err(e) = remove_dir(&self.dir) {
            tracing::warn!(worker = %self.id, error = %e, "remove function worker dir");
        }
        drop(self.lease.take());
    }
}

/// Host pids in a sandbox's user cgroup (empty when unreadable).
fn user_pids(sandbox: &ContainerSandbox) -> Vec<i32> {
    sandbox
        .cgroup()
        .user_procs_file()
        .and_then(|f| std::fs::read_to_string(f).ok())
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// Whether host pid `pid` runs the fork-server (`python3 -I -c <server> <socket>`).
fn is_forkserver(pid: i32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| c.starts_with(b"python3\0-I\0-c\0"))
        .unwrap_or(false)
}

fn remove_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The memory and pids cgroup files a call touches.
struct MemFiles {
    v2: bool,
    dir: PathBuf,
    user_pids_max: Option<PathBuf>,
}

impl MemFiles {
    fn new(root: &CgroupRoot, cg: &Cgroup) -> Self {
        MemFiles {
            v2: root.version == CgroupVersion::V2,
            dir: cg.path().to_path_buf(),
            user_pids_max: cg
                .user_procs_file()
                .and_then(|f| f.parent().map(|p| p.join("pids.max"))),
        }
    }

    fn file(&self, v1: &str, v2: &str) -> PathBuf {
        self.dir.join(if self.v2 { v2 } else { v1 })
    }

    fn read(&self, p: PathBuf) -> Option<u64> {
        std::fs::read_to_string(p).ok()?.trim().parse().ok()
    }

    fn usage(&self) -> Option<u64> {
        self.read(self.file("memory.usage_in_bytes", "memory.current"))
    }

    fn peak(&self) -> Option<u64> {
        self.read(self.file("memory.max_usage_in_bytes", "memory.peak"))
    }

    fn reset_peak(&self) {
        // v1: writing 0 resets the high-water mark. v2 (6.12+): writing resets it for this fd
        // only, so the peak on v2 is the worker's lifetime peak (best effort).
        if !self.v2 {
            let _ = std::fs::write(self.file("memory.max_usage_in_bytes", ""), "0");
        }
    }

    /// Whether the write succeeded.
    fn set_limit(&self, bytes: u64) -> bool {
        std::fs::write(
            self.file("memory.limit_in_bytes", "memory.max"),
            bytes.to_string(),
        )
        .is_ok()
    }

    fn set_pids(&self, n: u64) -> bool {
        match &self.user_pids_max {
            Some(p) => std::fs::write(p, n.to_string()).is_ok(),
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_sends_early_and_reap_only_when_set() {
        let plain = serde_json::to_value(ServerRequest {
            end: true,
            ..Default::default()
        })
        .unwrap();
        assert!(plain.get("early").is_none() && plain.get("reap").is_none());
        let early = serde_json::to_value(ServerRequest {
            end: true,
            early: true,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(early["early"], true);
    }

    #[test]
    fn early_answer_is_pending_and_the_cleanup_answer_is_not() {
        let first: ServerAnswer =
            serde_json::from_str(r#"{"results": [], "clean": true, "pending": true}"#).unwrap();
        assert!(first.pending);
        let second: ServerAnswer =
            serde_json::from_str(r#"{"results": [], "clean": false, "survivors": ["7 (sh)"]}"#)
                .unwrap();
        assert!(!second.pending && !second.clean);
    }
}
