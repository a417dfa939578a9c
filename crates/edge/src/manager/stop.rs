//! Stop: the watcher of a sandbox's death, the one teardown (stop and death alike), and
//! shutdown of the node.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use dsec_wire::api::{SandboxInfo, SandboxState};

use crate::error::EdgeError;
use crate::records;

use super::{lock, End, Entry, Manager};

impl Manager {
    pub(super) fn watch(self: &Arc<Self>, entry: Arc<Entry>) {
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
    pub(super) async fn finish(&self, entry: &Arc<Entry>, why: End) -> SandboxInfo {
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

    /// Stops a sandbox for a reason (TTL reaper).
    pub(crate) async fn stop_because(&self, id: &str, reason: String) {
        if let Ok(e) = self.entry(id) {
            self.finish(&e, End::Stopped(reason)).await;
        }
    }

    /// Stops a sandbox; repeating it answers the final info again.
    pub async fn stop(&self, id: &str) -> Result<SandboxInfo, EdgeError> {
        match self.entry(id) {
            Ok(e) => Ok(self
                .finish(&e, End::Stopped("stopped on request".into()))
                .await),
            Err(EdgeError::SandboxDead(_)) => self.get(id),
            Err(e) => Err(e),
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
