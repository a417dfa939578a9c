//! Pause and resume (on request, by the idle TTL, under memory pressure).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use dsec_wire::api::{SandboxInfo, SandboxState};

use crate::error::EdgeError;

use super::{lock, now_ms, now_rfc3339, Entry, Manager};

impl Manager {
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

    pub(super) async fn pause_entry(&self, e: &Arc<Entry>) -> Result<(), EdgeError> {
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
            .map_err(|source| EdgeError::Pause {
                op: "pause",
                source,
            });
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

    pub(super) async fn resume_entry(&self, e: &Arc<Entry>) -> Result<(), EdgeError> {
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
        let resumed = e.sandbox.resume().await.map_err(|source| EdgeError::Pause {
            op: "resume",
            source,
        });
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

    /// Pauses a sandbox because the node is short of memory; the reason goes into its info
    /// and its trajectory (a `memory_pressure` entry).
    pub(super) async fn pause_for_pressure(&self, id: &str, reason: &str) -> Result<(), EdgeError> {
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
}
