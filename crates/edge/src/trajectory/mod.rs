//! The trajectory log: per sandbox, a durable, totally ordered record of every call and its
//! result, kept on the node's disk outside every sandbox (`<data>/edge/trajectories/<id>.log`,
//! large outputs by sha256 in `<data>/edge/trajectories/blobs/`).
//!
//! - [`log`]: record format, append with the fsync policy, torn-tail cut on open;
//! - [`fastforward`]: step ids — a completed step answers its recorded result, a running one
//!   is waited for, a reused one with another request is refused;
//! - [`reader`]: filters, JSONL export, provenance ("which call last wrote this file");
//! - [`replay`]: comparing a re-executed call with its record (`dsec replay`).
//!
//! Calls with a step id run in a task of their own, so a client that disconnects (a trainer
//! killed mid-call) neither cancels nor loses them: the result is recorded and the restarted
//! client gets it by repeating the step.
//!
//! Other parts of the edge add state changes with one line:
//! `mgr.trajectory().note(id, "pause", json!({..}), Ok(json!({..})))`.

pub mod fastforward;
pub mod hooks;
pub mod log;
pub mod reader;
pub mod replay;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use dsec_wire::api::{
    codes, CommandResult, ErrorDetail, FileDigest, FileInfo, FileList, LastStep, TrajectoryRecord,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

use crate::error::EdgeError;
use fastforward::{completes_step, Claim, Finished, Steps};
pub use log::FsyncPolicy;
use log::{LogFile, Position};

/// `[edge.trajectory]` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrajectoryConfig {
    /// Log sandboxes by default (a create may still say `trajectory: false`).
    pub enabled: bool,
    /// `batch` (default: group commit every `fsync_interval_ms`), `always` (fdatasync before
    /// answering) or `never`. Records are written before a call is answered under every
    /// policy, so an edge crash loses nothing; the policy decides what a machine crash may lose
    /// (and a machine crash also ends every sandbox, so fast-forward never depends on it).
    pub fsync: FsyncPolicy,
    pub fsync_interval_ms: u64,
    /// How long a log is kept after its sandbox ended, in hours (default 7 days).
    pub retention_hours: u64,
    /// Outputs up to this size are kept in the record; larger ones by digest.
    pub inline_output_bytes: usize,
    /// Largest file content a stepped `read_file` records (larger reads are not fast-forwarded).
    pub max_recorded_read_bytes: u64,
}

impl Default for TrajectoryConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            fsync: FsyncPolicy::Batch,
            fsync_interval_ms: 10,
            retention_hours: 7 * 24,
            inline_output_bytes: 4096,
            max_recorded_read_bytes: 64 * 1024 * 1024,
        }
    }
}

impl TrajectoryConfig {
    /// Checks the values; `Err((key, message))` names the bad key.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.fsync == FsyncPolicy::Batch && !(1..=60_000).contains(&self.fsync_interval_ms) {
            return Err((
                "trajectory.fsync_interval_ms",
                "must be between 1 and 60000 with fsync = \"batch\"".into(),
            ));
        }
        if self.retention_hours == 0 {
            return Err(("trajectory.retention_hours", "must be at least 1".into()));
        }
        if self.inline_output_bytes > 1024 * 1024 {
            return Err((
                "trajectory.inline_output_bytes",
                "must be at most 1 MiB".into(),
            ));
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Unix time in milliseconds.
pub fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// The edge error a recorded error detail stands for (a replayed failure answers the same).
pub fn error_from_detail(d: &ErrorDetail) -> EdgeError {
    let m = d.message.clone();
    match d.code.as_str() {
        codes::BAD_REQUEST => EdgeError::BadRequest(m),
        codes::FORBIDDEN => EdgeError::Forbidden(m),
        codes::FILE_NOT_FOUND => EdgeError::FileNotFound(m),
        codes::SANDBOX_NOT_FOUND | codes::NOT_FOUND => EdgeError::NotFound(m),
        codes::CONFLICT => EdgeError::Conflict(m),
        codes::PAYLOAD_TOO_LARGE => EdgeError::PayloadTooLarge(m),
        codes::SANDBOX_DEAD => EdgeError::SandboxDead(m),
        codes::UNSUPPORTED => EdgeError::Unsupported(m),
        _ => EdgeError::Internal(m),
    }
}

/// What a finished call contributes to its record.
#[derive(Debug, Default)]
pub struct Outcome {
    pub exit_code: Option<i32>,
    pub result: Value,
    /// Output kept out of line: field → bytes (stored by sha256).
    pub blobs: Vec<(String, Vec<u8>)>,
    pub files_written: Vec<FileDigest>,
}

/// A call result that can be recorded and answered again from its record.
pub trait Recorded: Sized + Send + Sync + 'static {
    fn outcome(&self, inline: usize) -> Outcome;
    fn restore(rec: &TrajectoryRecord, blobs: &BlobStore) -> Result<Self, EdgeError>;
}

fn restore_json<T: serde::de::DeserializeOwned>(rec: &TrajectoryRecord) -> Result<T, EdgeError> {
    serde_json::from_value(rec.result.clone()).map_err(|e| {
        EdgeError::Internal(format!(
            "trajectory record {} ({}) has an unreadable result: {e}",
            rec.seq, rec.kind
        ))
    })
}

pub(crate) fn bytes_of(text: &str, b64: &Option<String>) -> Vec<u8> {
    use base64::Engine as _;
    b64.as_ref()
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .unwrap_or_else(|| text.as_bytes().to_vec())
}

impl Recorded for CommandResult {
    fn outcome(&self, inline: usize) -> Outcome {
        let mut kept = self.clone();
        let mut blobs = Vec::new();
        let out = bytes_of(&self.stdout, &self.stdout_b64);
        if out.len() > inline {
            kept.stdout.clear();
            kept.stdout_b64 = None;
            blobs.push(("stdout".to_string(), out));
        }
        let err = bytes_of(&self.stderr, &self.stderr_b64);
        if err.len() > inline {
            kept.stderr.clear();
            kept.stderr_b64 = None;
            blobs.push(("stderr".to_string(), err));
        }
        Outcome {
            exit_code: Some(self.exit_code),
            result: serde_json::to_value(&kept).unwrap_or(Value::Null),
            blobs,
            files_written: Vec::new(),
        }
    }

    fn restore(rec: &TrajectoryRecord, blobs: &BlobStore) -> Result<Self, EdgeError> {
        let mut r: CommandResult = restore_json(rec)?;
        if let Some(d) = rec.blobs.get("stdout") {
            let (s, b) = crate::commands::text_and_b64(&blobs.get(d)?);
            r.stdout = s;
            r.stdout_b64 = b;
        }
        if let Some(d) = rec.blobs.get("stderr") {
            let (s, b) = crate::commands::text_and_b64(&blobs.get(d)?);
            r.stderr = s;
            r.stderr_b64 = b;
        }
        Ok(r)
    }
}

macro_rules! recorded_json {
    ($t:ty) => {
        impl Recorded for $t {
            fn outcome(&self, _inline: usize) -> Outcome {
                Outcome {
                    result: serde_json::to_value(self).unwrap_or(Value::Null),
                    ..Default::default()
                }
            }
            fn restore(rec: &TrajectoryRecord, _blobs: &BlobStore) -> Result<Self, EdgeError> {
                restore_json(rec)
            }
        }
    };
}
recorded_json!(FileInfo);
recorded_json!(FileList);
recorded_json!(());

/// The answer of a file upload, with the digest of what was written.
#[derive(Debug, Clone)]
pub struct Written {
    pub info: FileInfo,
    pub sha256: String,
    pub size: u64,
    /// The content, kept by digest so that `dsec replay` can write it again (stepped uploads).
    pub data: Option<Bytes>,
}

impl Recorded for Written {
    fn outcome(&self, _inline: usize) -> Outcome {
        Outcome {
            result: serde_json::to_value(&self.info).unwrap_or(Value::Null),
            files_written: vec![FileDigest {
                path: self.info.path.clone(),
                sha256: self.sha256.clone(),
                size: self.size,
            }],
            blobs: self
                .data
                .iter()
                .map(|d| ("content".to_string(), d.to_vec()))
                .collect(),
            ..Default::default()
        }
    }
    fn restore(rec: &TrajectoryRecord, _blobs: &BlobStore) -> Result<Self, EdgeError> {
        let info: FileInfo = restore_json(rec)?;
        let (sha256, size) = rec
            .files_written
            .first()
            .map(|f| (f.sha256.clone(), f.size))
            .unwrap_or_default();
        Ok(Written {
            info,
            sha256,
            size,
            data: None,
        })
    }
}

/// A whole file read, as a stepped `read_file` records it.
#[derive(Debug, Clone)]
pub struct Content {
    pub mode: u32,
    pub data: Bytes,
}

impl Recorded for Content {
    fn outcome(&self, inline: usize) -> Outcome {
        use base64::Engine as _;
        let mut result = json!({
            "mode": self.mode,
            "size": self.data.len(),
            "sha256": sha256_hex(&self.data),
        });
        let mut blobs = Vec::new();
        if self.data.len() > inline {
            blobs.push(("content".to_string(), self.data.to_vec()));
        } else {
            result["content_b64"] =
                Value::String(base64::engine::general_purpose::STANDARD.encode(&self.data));
        }
        Outcome {
            result,
            blobs,
            ..Default::default()
        }
    }
    fn restore(rec: &TrajectoryRecord, blobs: &BlobStore) -> Result<Self, EdgeError> {
        use base64::Engine as _;
        let mode = rec
            .result
            .get("mode")
            .and_then(Value::as_u64)
            .unwrap_or(0o644) as u32;
        let data = match (rec.blobs.get("content"), rec.result.get("content_b64")) {
            (Some(d), _) => blobs.get(d)?,
            (None, Some(Value::String(b))) => base64::engine::general_purpose::STANDARD
                .decode(b)
                .map_err(|e| {
                EdgeError::Internal(format!("record {}: content_b64: {e}", rec.seq))
            })?,
            (None, _) => Vec::new(),
        };
        Ok(Content {
            mode,
            data: Bytes::from(data),
        })
    }
}

/// Content-addressed store of large outputs.
pub struct BlobStore {
    dir: PathBuf,
}

impl BlobStore {
    fn path(&self, digest: &str) -> Option<PathBuf> {
        (digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| self.dir.join(digest))
    }

    /// Stores `data` (once per content) and answers its digest.
    pub fn put(&self, data: &[u8], sync: bool) -> std::io::Result<String> {
        let digest = sha256_hex(data);
        let path = self.dir.join(&digest);
        if path.exists() {
            // Refresh the retention clock of shared content.
            let _ = std::fs::File::options()
                .append(true)
                .open(&path)
                .and_then(|f| f.set_modified(SystemTime::now()));
            return Ok(digest);
        }
        std::fs::create_dir_all(&self.dir)?;
        let tmp = self
            .dir
            .join(format!(".{digest}.{}", rand::random::<u32>()));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        if sync {
            f.sync_data()?;
        }
        std::fs::rename(&tmp, &path)?;
        Ok(digest)
    }

    pub fn get(&self, digest: &str) -> Result<Vec<u8>, EdgeError> {
        let path = self
            .path(digest)
            .ok_or_else(|| EdgeError::Internal(format!("bad blob digest {digest:?}")))?;
        let data = std::fs::read(&path)
            .map_err(|e| EdgeError::internal(&format!("read trajectory blob {digest}"), &e))?;
        if sha256_hex(&data) != digest {
            return Err(EdgeError::Internal(format!(
                "trajectory blob {digest} does not match its digest (damaged on disk)"
            )));
        }
        Ok(data)
    }
}

/// The open log of one sandbox.
pub struct SandboxLog {
    id: String,
    inner: Mutex<Inner>,
}

struct Inner {
    file: LogFile,
    steps: Steps,
}

impl SandboxLog {
    pub fn id(&self) -> &str {
        &self.id
    }
}

/// An answer, and whether it came from the log instead of running.
#[derive(Debug)]
pub struct Answer<T> {
    pub value: T,
    pub replayed: bool,
}

fn fresh<T>(value: T) -> Answer<T> {
    Answer {
        value,
        replayed: false,
    }
}

/// Every trajectory log of the node.
pub struct Trajectories {
    cfg: TrajectoryConfig,
    dir: PathBuf,
    blobs: BlobStore,
    logs: Mutex<HashMap<String, Arc<SandboxLog>>>,
    /// Logs of ended sandboxes closed with records not yet synced (batch policy): the next group
    /// commit syncs them with the open ones, then drops them.
    closing: Mutex<Vec<Arc<SandboxLog>>>,
    /// Torn bytes cut when logs were opened (reported by tests and metrics).
    cut_bytes: std::sync::atomic::AtomicU64,
    /// Signalled by every append under the batch policy: the group commit runs only when
    /// something was written, instead of waking every interval on an idle node.
    written: Arc<tokio::sync::Notify>,
}

/// A call's request as recorded: the serialized request without `step` and `stream`.
pub fn request_value<T: Serialize>(req: &T) -> Value {
    let mut v = serde_json::to_value(req).unwrap_or(Value::Null);
    if let Some(m) = v.as_object_mut() {
        m.remove("step");
        m.remove("stream");
    }
    v
}

impl Trajectories {
    /// Logs live in `dir` (created on first use).
    pub fn new(cfg: TrajectoryConfig, dir: PathBuf) -> Self {
        let blobs = BlobStore {
            dir: dir.join("blobs"),
        };
        Self {
            cfg,
            dir,
            blobs,
            logs: Mutex::new(HashMap::new()),
            closing: Mutex::new(Vec::new()),
            cut_bytes: std::sync::atomic::AtomicU64::new(0),
            written: Arc::new(tokio::sync::Notify::new()),
        }
    }

    pub fn config(&self) -> &TrajectoryConfig {
        &self.cfg
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn blobs(&self) -> &BlobStore {
        &self.blobs
    }

    /// Torn-tail bytes cut since start.
    pub fn cut_bytes(&self) -> u64 {
        self.cut_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn log_path(&self, id: &str) -> Option<PathBuf> {
        dsec_wire::id::is_valid_sandbox_id(id).then(|| self.dir.join(format!("{id}.log")))
    }

    /// Opens the log at `path`; `new`: the log of a sandbox being created (see
    /// [`LogFile::create`]).
    fn open_log(&self, id: &str, path: &Path, new: bool) -> Result<Arc<SandboxLog>, EdgeError> {
        let (file, opened) = if new {
            LogFile::create(path, self.cfg.fsync)
        } else {
            LogFile::open(path, self.cfg.fsync)
        }
        .map_err(|e| EdgeError::internal("open trajectory log", &e))?;
        self.cut_bytes
            .fetch_add(opened.cut_bytes, std::sync::atomic::Ordering::Relaxed);
        let steps = Steps::from_records(opened.records.iter().map(|(r, p)| (r, *p)));
        Ok(Arc::new(SandboxLog {
            id: id.to_string(),
            inner: Mutex::new(Inner { file, steps }),
        }))
    }

    /// Starts the log of a new sandbox when `enabled` (the create request's `trajectory`, else
    /// the config). A failure to start it fails the create: calls must not go unlogged.
    pub fn begin(&self, id: &str, enabled: Option<bool>) -> Result<(), EdgeError> {
        if !enabled.unwrap_or(self.cfg.enabled) {
            return Ok(());
        }
        let path = self
            .log_path(id)
            .ok_or_else(|| EdgeError::BadRequest(format!("bad sandbox id {id:?}")))?;
        // The directory exists after the first create: made on demand rather than checked
        // (a stat) on every create.
        let log = match self.open_log(id, &path, true) {
            Err(_) if !self.dir.is_dir() => {
                std::fs::create_dir_all(&self.dir).map_err(|e| {
                    EdgeError::internal(&format!("create {}", self.dir.display()), &e)
                })?;
                self.open_log(id, &path, true)?
            }
            r => r?,
        };
        lock(&self.logs).insert(id.to_string(), log);
        Ok(())
    }

    /// The open log of `id`; a log left on disk (an earlier edge run, a re-adopted sandbox) is
    /// opened — its torn tail cut — on first use. `None` when the sandbox keeps no log.
    pub fn get(&self, id: &str) -> Option<Arc<SandboxLog>> {
        if let Some(l) = lock(&self.logs).get(id) {
            return Some(l.clone());
        }
        let path = self.log_path(id)?;
        if !path.is_file() {
            return None;
        }
        let mut logs = lock(&self.logs);
        if let Some(l) = logs.get(id) {
            return Some(l.clone());
        }
        match self.open_log(id, &path, false) {
            Ok(l) => {
                logs.insert(id.to_string(), l.clone());
                Some(l)
            }
            Err(e) => {
                tracing::error!(sandbox = %id, error = %e, "open trajectory log");
                None
            }
        }
    }

    /// Appends a record (blocking I/O: blobs first, then the frame). Answers it with its seq.
    #[allow(clippy::too_many_arguments)]
    fn append(
        &self,
        log: &SandboxLog,
        step: Option<u64>,
        kind: &str,
        request: Value,
        key: Value,
        start_ms: f64,
        end_ms: f64,
        outcome: Result<Outcome, ErrorDetail>,
    ) -> Result<(TrajectoryRecord, Position), EdgeError> {
        let sync = self.cfg.fsync == FsyncPolicy::Always;
        if self.cfg.fsync == FsyncPolicy::Batch {
            // A stored permit if the committer is busy: this append is synced by the next round.
            self.written.notify_one();
        }
        let mut rec = TrajectoryRecord {
            seq: 0,
            step,
            kind: kind.to_string(),
            request,
            key,
            start_ms,
            end_ms,
            ok: outcome.is_ok(),
            ..Default::default()
        };
        match outcome {
            Ok(o) => {
                rec.exit_code = o.exit_code;
                rec.result = o.result;
                rec.files_written = o.files_written;
                let mut blobs = BTreeMap::new();
                for (field, data) in o.blobs {
                    let d = self
                        .blobs
                        .put(&data, sync)
                        .map_err(|e| EdgeError::internal("store trajectory blob", &e))?;
                    blobs.insert(field, d);
                }
                rec.blobs = blobs;
            }
            Err(e) => rec.error = Some(e),
        }
        let mut inner = lock(&log.inner);
        let pos = inner
            .file
            .append(&mut rec)
            .map_err(|e| EdgeError::internal("append to trajectory log", &e))?;
        if let Some(s) = step {
            if completes_step(&rec) {
                inner.steps.complete(s, kind, rec.key.clone(), pos);
            } else {
                inner.steps.release(s);
            }
        }
        Ok((rec, pos))
    }

    /// Records a call that already happened — for state changes (pause, resume, network rules,
    /// TTL, stop) made elsewhere in the edge. Never fails the caller: a write problem is logged.
    pub fn note(&self, id: &str, kind: &str, request: Value, result: Result<Value, &EdgeError>) {
        let Some(log) = self.get(id) else { return };
        let t = now_ms();
        let outcome = result
            .map(|v| Outcome {
                result: v,
                ..Default::default()
            })
            .map_err(|e| e.detail());
        if let Err(e) = self.append(&log, None, kind, request, Value::Null, t, t, outcome) {
            tracing::error!(sandbox = %id, kind, error = %e, "record trajectory entry");
        }
    }

    /// Runs one call through the log: fast-forwards a known step, waits for a running one,
    /// refuses a conflicting one; otherwise runs `run` and records it (a stepped call in a task
    /// of its own that finishes even when the caller goes away).
    pub async fn call<T, F, Fut>(
        self: &Arc<Self>,
        id: &str,
        step: Option<u64>,
        kind: &'static str,
        request: Value,
        key: Value,
        run: F,
    ) -> Result<Answer<T>, EdgeError>
    where
        T: Recorded,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, EdgeError>> + Send + 'static,
    {
        let Some(log) = self.get(id) else {
            return run().await.map(fresh);
        };
        let Some(step) = step else {
            let start = now_ms();
            let r = run().await;
            self.record_async(log, None, kind, request, key, start, &r)
                .await;
            return r.map(fresh);
        };
        let claim = lock(&log.inner).steps.claim(step, kind, &key);
        match claim {
            Claim::Conflict(m) => Err(EdgeError::Conflict(format!("sandbox {id}: {m}"))),
            Claim::Replay(pos) => {
                let rec = lock(&log.inner)
                    .file
                    .read_at(pos)
                    .map_err(|e| EdgeError::internal("read trajectory record", &e))?;
                self.answer_from(&rec)
            }
            Claim::Wait(mut w) => {
                let finished = loop {
                    if let Some(f) = w.borrow_and_update().clone() {
                        break f;
                    }
                    if w.changed().await.is_err() {
                        return Err(EdgeError::Internal(format!(
                            "step {step} of sandbox {id} ended without a result"
                        )));
                    }
                };
                match finished {
                    Finished::Recorded(rec) => self.answer_from(&rec),
                    Finished::Failed(d) => Err(error_from_detail(&d)),
                }
            }
            Claim::Run(tx) => {
                let fut = run();
                let this = self.clone();
                let task = tokio::spawn(async move {
                    let start = now_ms();
                    let r = fut.await;
                    let rec = this
                        .record_async(log.clone(), Some(step), kind, request, key, start, &r)
                        .await;
                    let finished = match (rec, &r) {
                        (Some(rec), _) if completes_step(&rec) => Finished::Recorded(Arc::new(rec)),
                        (_, Err(e)) => Finished::Failed(e.detail()),
                        (_, Ok(_)) => {
                            lock(&log.inner).steps.release(step);
                            Finished::Failed(ErrorDetail {
                                code: codes::INTERNAL.into(),
                                message: format!(
                                    "step {step} ran but could not be recorded; see the edge log"
                                ),
                            })
                        }
                    };
                    let _ = tx.send(Some(finished));
                    r
                });
                match task.await {
                    Ok(r) => r.map(fresh),
                    Err(e) => Err(EdgeError::Internal(format!("step {step} task failed: {e}"))),
                }
            }
        }
    }

    fn answer_from<T: Recorded>(&self, rec: &TrajectoryRecord) -> Result<Answer<T>, EdgeError> {
        if let Some(e) = &rec.error {
            return Err(error_from_detail(e));
        }
        Ok(Answer {
            value: T::restore(rec, &self.blobs)?,
            replayed: true,
        })
    }

    /// Records a finished call off the async threads; `None` (logged) when it could not.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn record_async<T: Recorded>(
        self: &Arc<Self>,
        log: Arc<SandboxLog>,
        step: Option<u64>,
        kind: &'static str,
        request: Value,
        key: Value,
        start_ms: f64,
        r: &Result<T, EdgeError>,
    ) -> Option<TrajectoryRecord> {
        let end_ms = now_ms();
        let outcome = match r {
            Ok(v) => Ok(v.outcome(self.cfg.inline_output_bytes)),
            Err(e) => Err(e.detail()),
        };
        let this = self.clone();
        let id = log.id.clone();
        let res = tokio::task::spawn_blocking(move || {
            this.append(&log, step, kind, request, key, start_ms, end_ms, outcome)
        })
        .await;
        match res {
            Ok(Ok((rec, _))) => Some(rec),
            Ok(Err(e)) => {
                tracing::error!(sandbox = %id, kind, error = %e, "record trajectory entry");
                None
            }
            Err(e) => {
                tracing::error!(sandbox = %id, kind, error = %e, "record trajectory entry");
                None
            }
        }
    }

    /// Closes the log of an ended sandbox (the file stays until retention ends). Under the
    /// batch policy its last records are synced by the next group commit, within the same
    /// `fsync_interval_ms` window as any other record (not here, on the stop's path: one
    /// `fdatasync` per window covers the records of the sandbox's last call and its `stop`);
    /// under `always` nothing is pending; under `never` it is synced here, as before.
    pub fn close(&self, id: &str) {
        let Some(log) = lock(&self.logs).remove(id) else {
            return;
        };
        if self.cfg.fsync == FsyncPolicy::Batch {
            let pending = lock(&log.inner).file.has_pending_sync();
            if pending {
                lock(&self.closing).push(log);
                // The stop's own append already woke the group commit; this covers a commit
                // that ran between that append and this close.
                self.written.notify_one();
            }
            return;
        }
        let synced = lock(&log.inner).file.sync();
        if let Err(e) = synced {
            tracing::error!(sandbox = %id, error = %e, "sync trajectory log");
        }
    }

    /// Every valid record of `id`'s log (a torn tail is skipped, not cut: that happens on open).
    pub fn read(&self, id: &str) -> Result<Vec<TrajectoryRecord>, EdgeError> {
        let path = self
            .log_path(id)
            .ok_or_else(|| EdgeError::SandboxNotFound(id.to_string()))?;
        if let Some(log) = lock(&self.logs).get(id).cloned() {
            // Records appended so far are all in the file; hold the lock so none is half-read.
            let _inner = lock(&log.inner);
            return log::read_all(&path)
                .map_err(|e| EdgeError::internal("read trajectory log", &e));
        }
        match log::read_all(&path) {
            Ok(r) => Ok(r),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(EdgeError::NotFound(format!(
                "sandbox {id} has no trajectory log on this node (created with trajectory: false, \
                 unknown, or its log passed the retention period)"
            )))
            }
            Err(e) => Err(EdgeError::internal("read trajectory log", &e)),
        }
    }

    /// `GET .../trajectory/last_step`.
    pub fn last_step(&self, id: &str) -> Result<LastStep, EdgeError> {
        let Some(log) = self.get(id) else {
            if !dsec_wire::id::is_valid_sandbox_id(id) {
                return Err(EdgeError::SandboxNotFound(id.to_string()));
            }
            return Ok(LastStep {
                sandbox: id.to_string(),
                enabled: false,
                ..Default::default()
            });
        };
        let inner = lock(&log.inner);
        Ok(LastStep {
            sandbox: id.to_string(),
            last_completed_step: inner.steps.last_completed(),
            running_steps: inner.steps.running(),
            records: inner.file.next_seq() - 1,
            enabled: true,
        })
    }

    /// Group commit of the `batch` policy: syncs every open log and every log closed since the
    /// last commit (also called at edge shutdown, after every sandbox ended).
    pub fn sync_all(&self) {
        let mut logs: Vec<Arc<SandboxLog>> = lock(&self.logs).values().cloned().collect();
        logs.append(&mut lock(&self.closing));
        for log in logs {
            // fdatasync outside the lock: appends go on meanwhile.
            let pending = lock(&log.inner).file.take_pending_sync();
            if let Some(r) = pending {
                if let Err(e) = r.and_then(|f| f.sync_data()) {
                    tracing::error!(sandbox = %log.id, error = %e, "sync trajectory log");
                }
            }
        }
    }

    /// Removes logs (and blobs) untouched for longer than the retention period whose sandbox
    /// is not open here. Answers the ids removed.
    pub fn reap(&self) -> Vec<String> {
        let keep = Duration::from_secs(self.cfg.retention_hours * 3600);
        let open: Vec<String> = lock(&self.logs).keys().cloned().collect();
        let old = |p: &Path| {
            std::fs::metadata(p)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > keep)
        };
        let mut removed = Vec::new();
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                let p = e.path();
                let Some(id) = p
                    .file_name()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(".log"))
                else {
                    continue;
                };
                if !open.iter().any(|o| o == id) && old(&p) && std::fs::remove_file(&p).is_ok() {
                    removed.push(id.to_string());
                }
            }
        }
        if let Ok(rd) = std::fs::read_dir(&self.blobs.dir) {
            for e in rd.flatten() {
                if old(&e.path()) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        if !removed.is_empty() {
            tracing::info!(
                count = removed.len(),
                "removed trajectory logs past retention"
            );
        }
        removed
    }

    /// The background task: group commit (batch policy) and the retention reaper. The commit
    /// waits for an append, then for the group window, then syncs what is pending.
    pub fn spawn_background(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let weak = Arc::downgrade(self);
        let window = Duration::from_millis(self.cfg.fsync_interval_ms);
        let batch = self.cfg.fsync == FsyncPolicy::Batch;
        let written = self.written.clone();
        const REAP_EVERY: Duration = Duration::from_secs(3600);
        tokio::spawn(async move {
            // Logs past retention are removed at start, then every REAP_EVERY.
            if let Some(t) = weak.upgrade() {
                let _ = tokio::task::spawn_blocking(move || t.reap()).await;
            }
            let mut last_reap = std::time::Instant::now();
            loop {
                let appended = tokio::select! {
                    _ = written.notified(), if batch => true,
                    _ = tokio::time::sleep(REAP_EVERY) => false,
                };
                if appended {
                    tokio::time::sleep(window).await;
                }
                let Some(t) = weak.upgrade() else { return };
                if appended {
                    let t2 = t.clone();
                    let _ = tokio::task::spawn_blocking(move || t2.sync_all()).await;
                }
                if last_reap.elapsed() > REAP_EVERY {
                    last_reap = std::time::Instant::now();
                    let t2 = t.clone();
                    let _ = tokio::task::spawn_blocking(move || t2.reap()).await;
                }
            }
        })
    }
}

/// The inode change time (Unix ns) of `path` in a sandbox's writable layer, refusing `..` and
/// symlinks on the way (the agent controls that tree).
pub fn changed_ns_in_upper(upper: &Path, path: &str) -> Option<i128> {
    use std::os::unix::fs::MetadataExt as _;
    let comps: Vec<&str> = path
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    let mut p = upper.to_path_buf();
    let mut m = std::fs::symlink_metadata(&p).ok()?;
    for (i, comp) in comps.iter().enumerate() {
        if *comp == ".." {
            return None;
        }
        p.push(comp);
        m = std::fs::symlink_metadata(&p).ok()?;
        // An intermediate symlink may point anywhere on the host: stop there.
        if m.file_type().is_symlink() && i + 1 < comps.len() {
            return None;
        }
    }
    Some(m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128)
}

impl Trajectories {
    /// Records of `id` passing `f`; with `f.path`, the calls that last wrote that path.
    pub fn query(
        &self,
        id: &str,
        f: &reader::Filter,
        sandboxes_dir: &Path,
    ) -> Result<Vec<TrajectoryRecord>, EdgeError> {
        let all = self.read(id)?;
        let picked: Vec<TrajectoryRecord> = match &f.path {
            Some(path) => {
                if !path.starts_with('/') {
                    return Err(EdgeError::BadRequest(format!(
                        "path {path:?} must be absolute"
                    )));
                }
                let live = lock(&self.logs).contains_key(id);
                let upper = sandboxes_dir.join(id).join("upper");
                let changed = live.then(|| changed_ns_in_upper(&upper, path)).flatten();
                reader::provenance(&all, path, changed)
            }
            None => all,
        };
        Ok(picked.into_iter().filter(|r| f.matches(r)).collect())
    }

    /// A blob referenced by `id`'s log.
    pub fn blob_of(&self, id: &str, digest: &str) -> Result<Vec<u8>, EdgeError> {
        let referenced = self
            .read(id)?
            .iter()
            .any(|r| r.blobs.values().any(|d| d == digest));
        if !referenced {
            return Err(EdgeError::NotFound(format!(
                "no record of sandbox {id} keeps a blob {digest}"
            )));
        }
        self.blobs.get(digest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn traj(dir: &Path) -> Arc<Trajectories> {
        Arc::new(Trajectories::new(
            TrajectoryConfig {
                inline_output_bytes: 8,
                ..Default::default()
            },
            dir.to_path_buf(),
        ))
    }

    const ID: &str = "sb-n0-00000000000000aa";

    #[tokio::test]
    async fn steps_fast_forward_and_survive_reopen() {
        let d = tempfile::tempdir().unwrap();
        let t = traj(d.path());
        t.begin(ID, None).unwrap();
        let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let call = |t: Arc<Trajectories>, cmd: &'static str| {
            let runs = runs.clone();
            async move {
                t.call(
                    ID,
                    Some(1),
                    "shell",
                    json!({"cmd": cmd}),
                    json!({"cmd": cmd}),
                    move || async move {
                        runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        Ok(CommandResult {
                            stdout: "a long output, kept out of line".into(),
                            ..Default::default()
                        })
                    },
                )
                .await
            }
        };
        let a = call(t.clone(), "x").await.unwrap();
        assert!(!a.replayed);
        let b = call(t.clone(), "x").await.unwrap();
        assert!(b.replayed);
        assert_eq!(a.value, b.value, "blob-stored output restored");
        assert_eq!(call(t.clone(), "y").await.unwrap_err().code(), "conflict");
        assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
        // A new edge (same directory) rebuilds the step index from the log.
        let t2 = traj(d.path());
        let c = call(t2.clone(), "x").await.unwrap();
        assert!(c.replayed);
        assert_eq!(c.value, a.value);
        assert_eq!(t2.last_step(ID).unwrap().last_completed_step, Some(1));
        let recs = t2.read(ID).unwrap();
        assert_eq!(recs.len(), 1);
        assert_eq!(recs[0].blobs.len(), 1);
    }

    #[tokio::test]
    async fn running_step_is_waited_for_and_survives_the_caller() {
        let d = tempfile::tempdir().unwrap();
        let t = traj(d.path());
        t.begin(ID, None).unwrap();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let t1 = t.clone();
        let first = tokio::spawn(async move {
            t1.call(
                ID,
                Some(7),
                "exec",
                json!(1),
                json!(1),
                move || async move {
                    let _ = go_rx.await;
                    Ok(CommandResult {
                        exit_code: 3,
                        ..Default::default()
                    })
                },
            )
            .await
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(t.last_step(ID).unwrap().running_steps, vec![7]);
        // The first caller goes away: the call still finishes and is recorded.
        first.abort();
        let t2 = t.clone();
        let waiter = tokio::spawn(async move {
            t2.call(ID, Some(7), "exec", json!(1), json!(1), || async {
                Err::<CommandResult, _>(EdgeError::Internal("must not run".into()))
            })
            .await
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        let _ = go_tx.send(());
        let got = waiter.await.unwrap().unwrap();
        assert!(got.replayed);
        assert_eq!(got.value.exit_code, 3);
        assert_eq!(t.read(ID).unwrap().len(), 1);
    }

    #[tokio::test]
    async fn internal_errors_free_the_step_user_errors_complete_it() {
        let d = tempfile::tempdir().unwrap();
        let t = traj(d.path());
        t.begin(ID, None).unwrap();
        let e = t
            .call(ID, Some(1), "stat", json!(1), json!(1), || async {
                Err::<FileInfo, _>(EdgeError::Internal("agent hiccup".into()))
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), "internal");
        let e = t
            .call(ID, Some(1), "stat", json!(1), json!(1), || async {
                Err::<FileInfo, _>(EdgeError::FileNotFound("no /x".into()))
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), "file_not_found");
        let e = t
            .call(ID, Some(1), "stat", json!(1), json!(1), || async {
                Err::<FileInfo, _>(EdgeError::Internal("must not run".into()))
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), "file_not_found", "replayed user error");
        assert_eq!(t.read(ID).unwrap().len(), 2);
    }

    #[test]
    fn closed_logs_are_synced_by_the_next_group_commit() {
        let d = tempfile::tempdir().unwrap();
        let t = traj(d.path());
        assert_eq!(t.config().fsync, FsyncPolicy::Batch);
        t.begin(ID, None).unwrap();
        t.note(ID, "stop", json!({}), Ok(json!({})));
        t.close(ID);
        assert!(!lock(&t.logs).contains_key(ID));
        assert_eq!(lock(&t.closing).len(), 1, "closed with a record pending");
        t.sync_all();
        assert!(lock(&t.closing).is_empty(), "synced and dropped");
        // A log closed with nothing pending is not queued.
        let other = "sb-n0-00000000000000dd";
        t.begin(other, None).unwrap();
        t.note(other, "stop", json!({}), Ok(json!({})));
        t.sync_all();
        t.close(other);
        assert!(lock(&t.closing).is_empty());
        assert_eq!(t.read(ID).unwrap().len(), 1);
    }

    #[test]
    fn begin_on_an_existing_log_keeps_its_records() {
        let d = tempfile::tempdir().unwrap();
        let t = traj(d.path());
        t.begin(ID, None).unwrap();
        t.note(ID, "create", json!({}), Ok(json!({})));
        t.close(ID);
        let t2 = traj(d.path());
        t2.begin(ID, None).unwrap();
        t2.note(ID, "x", json!({}), Ok(json!({})));
        let seqs: Vec<u64> = t2.read(ID).unwrap().iter().map(|r| r.seq).collect();
        assert_eq!(seqs, vec![1, 2]);
    }

    #[test]
    fn begin_makes_the_directory_on_demand() {
        let d = tempfile::tempdir().unwrap();
        let t = traj(&d.path().join("a/b"));
        t.begin(ID, None).unwrap();
        assert!(d.path().join(format!("a/b/{ID}.log")).is_file());
    }

    #[tokio::test]
    async fn disabled_sandboxes_keep_no_log() {
        let d = tempfile::tempdir().unwrap();
        let t = traj(d.path());
        t.begin(ID, Some(false)).unwrap();
        for _ in 0..2 {
            let a = t
                .call(ID, Some(1), "shell", json!(1), json!(1), || async {
                    Ok(CommandResult::default())
                })
                .await
                .unwrap();
            assert!(!a.replayed);
        }
        assert!(!t.last_step(ID).unwrap().enabled);
        assert_eq!(t.read(ID).unwrap_err().code(), "not_found");
    }

    #[test]
    fn reaper_keeps_open_and_recent_logs() {
        let d = tempfile::tempdir().unwrap();
        let t = traj(d.path());
        t.begin(ID, None).unwrap();
        let old = d.path().join("sb-n0-00000000000000bb.log");
        std::fs::write(&old, b"").unwrap();
        let f = std::fs::File::options().append(true).open(&old).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(8 * 24 * 3600))
            .unwrap();
        let recent = d.path().join("sb-n0-00000000000000cc.log");
        std::fs::write(&recent, b"").unwrap();
        assert_eq!(t.reap(), vec!["sb-n0-00000000000000bb".to_string()]);
        assert!(recent.exists());
        assert!(t.log_path(ID).unwrap().exists());
    }

    #[test]
    fn config_validation() {
        assert!(TrajectoryConfig::default().validate().is_ok());
        let c = TrajectoryConfig {
            retention_hours: 0,
            ..Default::default()
        };
        assert_eq!(c.validate().unwrap_err().0, "trajectory.retention_hours");
    }
}
