//! Stop: the watcher of a sandbox's death, the one teardown (stop and death alike), and
//! shutdown of the node.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use dsec_wire::api::EndReason;
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
        // stop waits for no unlink. The substrate orders the move and its destroy: a container
        // moves its directory before the kill (its mounts live only in its own mount namespace)
        // and releases its disk limit's file system where the directory went; a VM still uses
        // files in its directory while it is destroyed, so it does not move it and the
        // directory is retired after.
        let trash = self.cfg.edge_dir().join(records::TRASH_DIR);
        let dest = trash.join(&entry.id);
        let (was_moved, destroy) = entry.sandbox.destroy_moving_dir(&dest).await;
        if let Err(e) = destroy {
            problems.push(format!("destroy: {e}"));
        }
        let moved = was_moved.then_some(dest);
        let dir = moved.clone().unwrap_or_else(|| entry.dir.clone());
        let destroyed = t0.elapsed();
        crate::network::release(&self.net, &entry.id, &dir).await;
        {
            let (vols, id) = (self.volumes.clone(), entry.id.clone());
            if let Err(e) = tokio::task::spawn_blocking(move || vols.release(&id)).await {
                problems.push(format!("release volumes: {e}"));
            }
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
            End::Stopped(end, reason) => {
                info.state = SandboxState::Stopped;
                crate::end_reason::set(&mut info, *end, reason.clone());
                info.paused_at = None;
                self.metrics.sandboxes_stopped.inc();
            }
            End::Died => {
                info.state = SandboxState::Failed;
                let (end, detail) = crate::end_reason::died(oom_kills);
                crate::end_reason::set(&mut info, end, detail);
                self.metrics.sandboxes_failed.inc();
            }
        }
        if !problems.is_empty() {
            let p = problems.join("; ");
            tracing::error!(sandbox = %entry.id, problems = %p, "cleanup of sandbox incomplete");
            crate::end_reason::add_problems(&mut info, &p);
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
    pub(crate) async fn stop_because(&self, id: &str, end: EndReason, reason: String) {
        if let Ok(e) = self.entry(id) {
            self.finish(&e, End::Stopped(end, reason)).await;
        }
    }

    /// Stops a sandbox; `end` is the reason the apiserver names (default `stopped_by_user`).
    /// Repeating it answers the final info again.
    pub async fn stop(&self, id: &str, end: Option<EndReason>) -> Result<SandboxInfo, EdgeError> {
        match self.entry(id) {
            Ok(e) => {
                let (end, detail) = crate::end_reason::requested(end);
                Ok(self.finish(&e, End::Stopped(end, detail)).await)
            }
            Err(EdgeError::SandboxDead(_)) => self.get(id),
            Err(e) => Err(e),
        }
    }

    /// Stops every sandbox and unmounts every layer.
    pub async fn shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        let entries: Vec<Arc<Entry>> = lock(&self.state).live.values().cloned().collect();
        tracing::info!(count = entries.len(), "stopping every sandbox");
        let stops = entries.iter().map(|e| {
            self.finish(
                e,
                End::Stopped(EndReason::Preempted, "the edge shut down".into()),
            )
        });
        futures::future::join_all(stops).await;
        // Logs closed by those stops are synced by the group commit; do it now, as the
        // background task ends with the process.
        let traj = self.traj.clone();
        let _ = tokio::task::spawn_blocking(move || traj.sync_all()).await;
        for s in self.substrates.available() {
            s.shutdown().await;
        }
        self.net.shutdown().await;
        self.volumes.unmount_all();
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
