//! Pausing a container: freeze every process, then give its memory back to the host.
//!
//! Freeze: the v1 freezer (`freezer.state`) or v2 `cgroup.freeze`. Reclaim, while frozen (so
//! nothing refaults what is being dropped):
//! - v2: `memory.reclaim` asked for the whole usage (the kernel frees what it can; page cache
//!   always, anonymous memory only where swap exists);
//! - v1: `memory.force_empty`, which on a cgroup that still has tasks runs the same per-cgroup
//!   reclaim loop (page cache and reclaimable slab; anonymous memory only where swap exists).
//!   This host has no swap, so anonymous memory stays resident; the report says so.
//!
//! Resume is a thaw; dropped page cache is read back on demand (there is nothing swapped to
//! prefetch without swap). A VM substrate implements the same calls as snapshot/restore.

use std::path::{Path, PathBuf};
use std::time::Instant;

use dsec_wire::api::PauseReport;

use super::ContainerSandbox;
use crate::cgroup::Cgroup;
pub use crate::error::PauseError;

/// Memory of one cgroup split the way a pause report needs it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStat {
    /// Total charged bytes (`memory.usage_in_bytes` / `memory.current`).
    pub usage: u64,
    /// Page cache (v1 `total_cache`, v2 `file`).
    pub cache: u64,
    /// Anonymous memory (v1 `total_rss`, v2 `anon`).
    pub anon: u64,
}

/// Parses `memory.stat` text: v1 keys `total_cache`/`total_rss` (hierarchical), else v2
/// `file`/`anon`.
pub fn parse_memory_stat(text: &str, usage: u64) -> MemoryStat {
    let get = |key: &str| {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse::<u64>().ok()).flatten()
        })
    };
    let (cache, anon) = match (get("total_cache"), get("total_rss")) {
        (Some(c), Some(a)) => (c, a),
        _ => (get("file").unwrap_or(0), get("anon").unwrap_or(0)),
    };
    MemoryStat { usage, cache, anon }
}

fn v1_or_v2(cg: &Cgroup) -> bool {
    matches!(cg, Cgroup::V1(_))
}

/// Reads the cgroup's memory figures (zeros where a file is missing).
pub fn memory_stat(cg: &Cgroup) -> MemoryStat {
    let dir = cg.path();
    let usage_file = if v1_or_v2(cg) {
        "memory.usage_in_bytes"
    } else {
        "memory.current"
    };
    let usage = std::fs::read_to_string(dir.join(usage_file))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
    parse_memory_stat(&stat, usage)
}

fn has_swap() -> bool {
    std::fs::read_to_string("/proc/swaps")
        .map(|s| s.lines().count() > 1)
        .unwrap_or(false)
}

/// Gives back as much of the frozen cgroup's memory as the host allows; returns the method.
fn reclaim(cg: &Cgroup, usage: u64) -> String {
    let swap = if has_swap() {
        "swap present: anonymous memory swapped out too"
    } else {
        "no swap: page cache only, anonymous memory stays resident"
    };
    let dir = cg.path();
    let (file, value) = if v1_or_v2(cg) {
        (dir.join("memory.force_empty"), "0".to_string())
    } else {
        (dir.join("memory.reclaim"), usage.max(4096).to_string())
    };
    let name = file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match std::fs::write(&file, value) {
        Ok(()) => format!("{name} ({swap})"),
        // memory.reclaim answers EAGAIN when it could not free everything asked: expected.
        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => format!("{name} (partial; {swap})"),
        Err(e) => {
            tracing::warn!(file = %file.display(), error = %e, "reclaim memory of paused sandbox");
            format!("none: {name} failed: {e}")
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
    let before = memory_stat(cg);
    cg.freeze().map_err(|source| PauseError::Freeze {
        id: id.to_string(),
        source,
    })?;
    let method = if reclaim_memory {
        reclaim(cg, before.usage)
    } else {
        "none (reclaim disabled)".to_string()
    };
    let after = memory_stat(cg);
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
    fn parses_v1_and_v2_stat() {
        let v1 = "cache 10\nrss 20\ntotal_cache 100\ntotal_rss 200\n";
        assert_eq!(
            parse_memory_stat(v1, 5),
            MemoryStat {
                usage: 5,
                cache: 100,
                anon: 200
            }
        );
        let v2 = "anon 300\nfile 400\nkernel 7\n";
        assert_eq!(
            parse_memory_stat(v2, 9),
            MemoryStat {
                usage: 9,
                cache: 400,
                anon: 300
            }
        );
        assert_eq!(parse_memory_stat("garbage", 1).cache, 0);
    }

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
