//! Reaping what an earlier run of the edge left: the cgroups of sandboxes it no longer knows.

use super::*;

impl ContainerSubstrate {
    /// Removes the cgroups of sandboxes an earlier run of the edge left (after a crash) that
    /// are not in `known_live`; returns the ids cleaned.
    pub async fn reap_orphans(&self, known_live: &[String]) -> Vec<String> {
        let root = self.cgroup_root.clone();
        let parent = self.config.cgroup_parent.clone();
        let live: Vec<String> = known_live.to_vec();
        let reaped = tokio::task::spawn_blocking(move || {
            let names = match Cgroup::list(&root, &parent) {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(error = %e, "list sandbox cgroups");
                    return Vec::new();
                }
            };
            let mut reaped = Vec::new();
            for name in names {
                if live.contains(&name) || !dsec_wire::id::is_valid_sandbox_id(&name) {
                    continue;
                }
                match Cgroup::open(&root, &parent, &name).and_then(|cg| cg.destroy()) {
                    Ok(()) => reaped.push(name),
                    Err(e) => {
                        tracing::warn!(sandbox = %name, error = %e, "reap orphaned sandbox cgroup")
                    }
                }
            }
            reaped
        })
        .await;
        reaped.unwrap_or_default()
    }
}
