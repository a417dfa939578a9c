//! Keeping the logs: the group commit of the `batch` fsync policy and the retention reaper,
//! and the background task running both.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::error::CallError;
use crate::lock;
use crate::log::FsyncPolicy;
use crate::store::{SandboxLog, Trajectories};

impl<E: CallError> Trajectories<E> {
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
