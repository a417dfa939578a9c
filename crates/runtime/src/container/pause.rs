//! Pausing a container: freeze every process, then give its memory back to the host.
//!
//! Freeze: the v1 freezer (`freezer.state`) or v2 `cgroup.freeze`. Reclaim, while frozen (so
//! nothing refaults what is being dropped), is [`Cgroup::reclaim_memory`]: v2 `memory.reclaim`
//! asked for the whole usage, v1 `memory.force_empty` bounded in time (page cache always,
//! anonymous memory only where swap exists; without swap the report says it stays resident).
//!
//! Resume is a thaw; dropped page cache is read back on demand (there is nothing swapped to
//! prefetch without swap). A VM substrate implements the same calls as snapshot/restore.

use std::path::{Path, PathBuf};
use std::time::Instant;

use dsec_wire::api::PauseReport;

use super::ContainerSandbox;
use crate::cgroup::memory::{host_has_swap, Reclaimed};
use crate::cgroup::Cgroup;
pub use crate::error::PauseError;

/// Gives back as much of the frozen cgroup's memory as the host allows (see
/// [`crate::cgroup::memory`]); returns the method for the report.
fn reclaim(cg: &Cgroup) -> String {
    let swap = if host_has_swap() {
        "swap present: anonymous memory swapped out too"
    } else {
        "no swap: page cache only, anonymous memory stays resident"
    };
    match cg.reclaim_memory() {
        Ok(r) => match r.result {
            Reclaimed::Complete => format!("{} ({swap})", r.file.name()),
            Reclaimed::Partial => format!("{} (partial; {swap})", r.file.name()),
        },
        Err(e) => {
            tracing::warn!(cgroup = %cg.path().display(), error = %e, "reclaim memory of paused sandbox");
            format!("none: reclaim failed: {e}")
        }
    }
}

/// Freezes the cgroup and, when `reclaim_memory`, reclaims its memory. Blocking.
pub fn pause_cgroup(
    id: &str,
    cg: &Cgroup,
    reclaim_memory: bool,
) -> Result<PauseReport, PauseError> {
    let started = Instant::now();
    let before = cg.memory_stat();
    cg.freeze().map_err(|source| PauseError::Freeze {
        id: id.to_string(),
        source,
    })?;
    let method = if reclaim_memory {
        reclaim(cg)
    } else {
        "none (reclaim disabled)".to_string()
    };
    let after = cg.memory_stat();
    Ok(PauseReport {
        memory_before_bytes: before.usage,
        memory_after_bytes: after.usage,
        page_cache_before_bytes: before.cache,
        page_cache_after_bytes: after.cache,
        anon_before_bytes: before.anon,
        anon_after_bytes: after.anon,
        method,
        pause_ms: started.elapsed().as_secs_f64() * 1000.0,
        snapshot_bytes: None,
    })
}

/// Thaws the cgroup. Blocking.
pub fn resume_cgroup(id: &str, cg: &Cgroup) -> Result<(), PauseError> {
    cg.thaw().map_err(|source| PauseError::Thaw {
        id: id.to_string(),
        source,
    })
}

/// The freezer state file of a cgroup: v1 `<freezer>/freezer.state`, v2 `cgroup.events`.
fn freezer_file(cg: &Cgroup) -> Option<PathBuf> {
    match cg {
        Cgroup::V1(c) => c
            .dirs()
            .into_iter()
            .map(|d| d.join("freezer.state"))
            .find(|f| f.exists()),
        Cgroup::V2(c) => Some(c.dir().join("cgroup.events")),
    }
}

/// True when the cgroup is frozen (or freezing). Survives a restart of the edge: the state
/// lives in the kernel.
pub fn is_frozen(cg: &Cgroup) -> bool {
    let Some(file) = freezer_file(cg) else {
        return false;
    };
    frozen_from(&file)
}

fn frozen_from(file: &Path) -> bool {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    if file.ends_with("freezer.state") {
        matches!(text.trim(), "FROZEN" | "FREEZING")
    } else {
        crate::cgroup::parse_keyed(&text, "frozen") == Some(1)
    }
}

impl ContainerSandbox {
    /// Freezes every process of the sandbox and reclaims its memory.
    pub async fn pause(&self, reclaim_memory: bool) -> Result<PauseReport, PauseError> {
        let cg = self.cgroup.clone();
        let id = self.id.clone();
        tokio::task::spawn_blocking(move || pause_cgroup(&id, &cg, reclaim_memory))
            .await
            .map_err(|e| PauseError::Task(e.to_string()))?
    }

    /// Thaws the sandbox.
    pub async fn resume(&self) -> Result<(), PauseError> {
        let cg = self.cgroup.clone();
        let id = self.id.clone();
        tokio::task::spawn_blocking(move || resume_cgroup(&id, &cg))
            .await
            .map_err(|e| PauseError::Task(e.to_string()))?
    }

    /// Whether the sandbox's cgroup is frozen right now.
    pub fn is_frozen(&self) -> bool {
        is_frozen(&self.cgroup)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freezer_states() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("freezer.state");
        std::fs::write(&f, "FROZEN\n").unwrap();
        assert!(frozen_from(&f));
        std::fs::write(&f, "THAWED\n").unwrap();
        assert!(!frozen_from(&f));
        let e = d.path().join("cgroup.events");
        std::fs::write(&e, "populated 1\nfrozen 1\n").unwrap();
        assert!(frozen_from(&e));
        std::fs::write(&e, "populated 1\nfrozen 0\n").unwrap();
        assert!(!frozen_from(&e));
    }
}
