//! Every trajectory log of the node: starting and opening logs, appending records, running a
//! call through its log (fast-forward, waiting for a running step, refusing a conflicting one),
//! reading a log back.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use dsec_wire::api::{codes, ErrorDetail, LastStep, TrajectoryRecord};
use serde_json::Value;

use crate::blobs::BlobStore;
use crate::config::TrajectoryConfig;
use crate::error::{CallError, TrajectoryError};
use crate::fastforward::{completes_step, Claim, Finished, Steps};
use crate::log::{self, FsyncPolicy, LogFile, Position};
use crate::recorded::{Outcome, Recorded};
use crate::{lock, now_ms};

/// The open log of one sandbox.
pub struct SandboxLog {
    pub(crate) id: String,
    pub(crate) inner: Mutex<Inner>,
}

pub(crate) struct Inner {
    pub(crate) file: LogFile,
    pub(crate) steps: Steps,
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
///
/// `E` is the error type of the calls run through it ([`Trajectories::call`]): what a failed
/// call is recorded and answered again as.
pub struct Trajectories<E> {
    pub(crate) cfg: TrajectoryConfig,
    pub(crate) dir: PathBuf,
    pub(crate) blobs: BlobStore,
    pub(crate) logs: Mutex<HashMap<String, Arc<SandboxLog>>>,
    /// Logs of ended sandboxes closed with records not yet synced (batch policy): the next group
    /// commit syncs them with the open ones, then drops them.
    pub(crate) closing: Mutex<Vec<Arc<SandboxLog>>>,
    /// Torn bytes cut when logs were opened (reported by tests and metrics).
    pub(crate) cut_bytes: std::sync::atomic::AtomicU64,
    /// Signalled by every append under the batch policy: the group commit runs only when
    /// something was written, instead of waking every interval on an idle node.
    pub(crate) written: Arc<tokio::sync::Notify>,
    _calls: PhantomData<fn() -> E>,
}

impl<E: CallError> Trajectories<E> {
    /// Logs live in `dir` (created on first use).
    pub fn new(cfg: TrajectoryConfig, dir: PathBuf) -> Self {
        let blobs = BlobStore::new(dir.join("blobs"));
        Self {
            cfg,
            dir,
            blobs,
            logs: Mutex::new(HashMap::new()),
            closing: Mutex::new(Vec::new()),
            cut_bytes: std::sync::atomic::AtomicU64::new(0),
            written: Arc::new(tokio::sync::Notify::new()),
            _calls: PhantomData,
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
    fn open_log(
        &self,
        id: &str,
        path: &Path,
        new: bool,
    ) -> Result<Arc<SandboxLog>, TrajectoryError> {
        let (file, opened) = if new {
            LogFile::create(path, self.cfg.fsync)
        } else {
            LogFile::open(path, self.cfg.fsync)
        }
        .map_err(|e| TrajectoryError::io("open trajectory log", e))?;
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
    pub fn begin(&self, id: &str, enabled: Option<bool>) -> Result<(), TrajectoryError> {
        if !enabled.unwrap_or(self.cfg.enabled) {
            return Ok(());
        }
        let path = self
            .log_path(id)
            .ok_or_else(|| TrajectoryError::BadSandboxId(id.to_string()))?;
        // The directory exists after the first create: made on demand rather than checked
        // (a stat) on every create.
        let log = match self.open_log(id, &path, true) {
            Err(_) if !self.dir.is_dir() => {
                std::fs::create_dir_all(&self.dir).map_err(|e| {
                    TrajectoryError::io(format!("create {}", self.dir.display()), e)
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
    ) -> Result<(TrajectoryRecord, Position), TrajectoryError> {
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
                        .map_err(|e| TrajectoryError::io("store trajectory blob", e))?;
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
            .map_err(|e| TrajectoryError::io("append to trajectory log", e))?;
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
    pub fn note(&self, id: &str, kind: &str, request: Value, result: Result<Value, &E>) {
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
    ) -> Result<Answer<T>, E>
    where
        T: Recorded,
        F: FnOnce() -> Fut,
        T: Recorded,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
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
            Claim::Conflict(reason) => Err(TrajectoryError::StepConflict {
                sandbox: id.to_string(),
                reason,
            }
            .into()),
            Claim::Replay(pos) => {
                let rec = lock(&log.inner)
                    .file
                    .read_at(pos)
                    .map_err(|e| TrajectoryError::io("read trajectory record", e))?;
                self.answer_from(&rec)
            }
            Claim::Wait(mut w) => {
                let finished = loop {
                    if let Some(f) = w.borrow_and_update().clone() {
                        break f;
                    }
                    if w.changed().await.is_err() {
                        return Err(TrajectoryError::StepLost {
                            sandbox: id.to_string(),
                            step,
                        }
                        .into());
                    }
                };
                match finished {
                    Finished::Recorded(rec) => self.answer_from(&rec),
                    Finished::Failed(d) => Err(TrajectoryError::Recorded(d).into()),
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
                    Err(e) => Err(TrajectoryError::StepTask {
                        step,
                        reason: e.to_string(),
                    }
                    .into()),
                }
            }
        }
    }

    fn answer_from<T: Recorded>(&self, rec: &TrajectoryRecord) -> Result<Answer<T>, E> {
        if let Some(e) = &rec.error {
            return Err(TrajectoryError::Recorded(e.clone()).into());
        }
        Ok(Answer {
            value: T::restore(rec, &self.blobs)?,
            replayed: true,
        })
    }

    /// Records a finished call off the async threads; `None` (logged) when it could not.
    #[allow(clippy::too_many_arguments)]
    pub async fn record_async<T: Recorded>(
        self: &Arc<Self>,
        log: Arc<SandboxLog>,
        step: Option<u64>,
        kind: &'static str,
        request: Value,
        key: Value,
        start_ms: f64,
        r: &Result<T, E>,
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
    pub fn read(&self, id: &str) -> Result<Vec<TrajectoryRecord>, TrajectoryError> {
        let path = self
            .log_path(id)
            .ok_or_else(|| TrajectoryError::SandboxNotFound(id.to_string()))?;
        if let Some(log) = lock(&self.logs).get(id).cloned() {
            // Records appended so far are all in the file; hold the lock so none is half-read.
            let _inner = lock(&log.inner);
            return log::read_all(&path).map_err(|e| TrajectoryError::io("read trajectory log", e));
        }
        match log::read_all(&path) {
            Ok(r) => Ok(r),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(TrajectoryError::NoLog(id.to_string()))
            }
            Err(e) => Err(TrajectoryError::io("read trajectory log", e)),
        }
    }

    /// `GET .../trajectory/last_step`.
    pub fn last_step(&self, id: &str) -> Result<LastStep, TrajectoryError> {
        let Some(log) = self.get(id) else {
            if !dsec_wire::id::is_valid_sandbox_id(id) {
                return Err(TrajectoryError::SandboxNotFound(id.to_string()));
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
}
