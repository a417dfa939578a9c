//! DAMON-driven cold-memory reclaim (sysfs interface, physical-address backend).
//!
//! One kdamond with one `paddr` context monitors the whole of RAM; one DAMOS scheme with action
//! `pageout` applies to regions not accessed (nr_accesses 0) for at least the cold time (age
//! counted in aggregation intervals), restricted by `memcg` filters (`allow`, one per
//! best-effort sandbox's memory cgroup, path relative to the memory hierarchy's root — the same
//! form on v1 and v2). When any allow filter is installed, memory matching none is rejected,
//! so nothing outside the best-effort sandboxes is paged out. With no best-effort sandbox the
//! kdamond is switched off (an empty filter list would page out the whole host).
//!
//! The sysfs interface only adds kdamonds while none runs (`nr_kdamonds` answers EBUSY
//! otherwise) and rebuilds every kdamond directory when the count changes, so the edge uses
//! DAMON only when it is the sole user: `nr_kdamonds` is 0, or the one kdamond is the edge's own
//! from an earlier run (its pid recorded in `<edge>/reclaim/damon.json`). Otherwise
//! [`DamonError::Busy`] and the caller falls back to cgroup-driven reclaim.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum DamonError {
    #[error("DAMON is not available: {0}")]
    Unavailable(String),
    #[error("DAMON is in use by someone else: {0}")]
    Busy(String),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(op: &'static str, path: &Path, source: std::io::Error) -> DamonError {
    DamonError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

fn write(path: &Path, value: &str) -> Result<(), DamonError> {
    std::fs::write(path, value).map_err(|e| io("write", path, e))
}

fn read(path: &Path) -> Result<String, DamonError> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|e| io("read", path, e))
}

/// Monitoring and scheme parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DamonParams {
    pub sample_us: u64,
    pub aggr_us: u64,
    /// Memory untouched this long is cold.
    pub cold_us: u64,
    /// Most bytes paged out per second (DAMOS quota), 0 = no limit.
    pub max_bytes_per_s: u64,
}

impl DamonParams {
    /// The scheme's minimum age in aggregation intervals.
    pub fn min_age_intervals(&self) -> u64 {
        self.cold_us.div_ceil(self.aggr_us.max(1)).max(1)
    }
}

/// The DAMON sysfs admin directory (`/sys/kernel/mm/damon/admin`; a fixture in tests).
#[derive(Debug, Clone)]
pub struct Damon {
    admin: PathBuf,
    marker: PathBuf,
    params: DamonParams,
}

impl Damon {
    pub fn new(admin: impl Into<PathBuf>, marker: impl Into<PathBuf>, params: DamonParams) -> Self {
        Damon {
            admin: admin.into(),
            marker: marker.into(),
            params,
        }
    }

    fn kdamonds(&self) -> PathBuf {
        self.admin.join("kdamonds")
    }

    fn kd(&self) -> PathBuf {
        self.kdamonds().join("0")
    }

    fn ctx(&self) -> PathBuf {
        self.kd().join("contexts/0")
    }

    fn scheme(&self) -> PathBuf {
        self.ctx().join("schemes/0")
    }

    fn recorded_pid(&self) -> Option<String> {
        std::fs::read_to_string(&self.marker)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    }

    /// Claims the kdamond slot: checks nobody else uses DAMON and that `paddr` exists.
    pub fn claim(&self) -> Result<(), DamonError> {
        let nr_file = self.kdamonds().join("nr_kdamonds");
        if !nr_file.exists() {
            return Err(DamonError::Unavailable(format!(
                "{} is missing (no DAMON sysfs interface)",
                nr_file.display()
            )));
        }
        let nr: u64 = read(&nr_file)?.parse().unwrap_or(0);
        if nr > 0 {
            let ours = nr == 1
                && self.recorded_pid().is_some()
                && read(&self.kd().join("pid")).ok() == self.recorded_pid();
            if !ours {
                let state = read(&self.kd().join("state")).unwrap_or_default();
                return Err(DamonError::Busy(format!(
                    "{nr} kdamond(s) configured by another user (kdamond 0 is {state:?}); the sysfs interface cannot add one beside them"
                )));
            }
            // Our own kdamond from an earlier run: switch it off and configure it afresh.
            let _ = write(&self.kd().join("state"), "off");
        } else {
            write(&nr_file, "1")?;
        }
        write(&self.kd().join("contexts/nr_contexts"), "1")?;
        let avail = read(&self.ctx().join("avail_operations")).unwrap_or_default();
        if !avail.split_whitespace().any(|o| o == "paddr") {
            let _ = write(&nr_file, "0");
            return Err(DamonError::Unavailable(format!(
                "no paddr operations (available: {avail:?})"
            )));
        }
        Ok(())
    }

    /// Writes the whole configuration for `memcgs` (memory cgroup paths) and switches the
    /// kdamond on (or commits to a running one); no memcg switches it off.
    pub fn apply(&self, memcgs: &[String]) -> Result<(), DamonError> {
        let state_file = self.kd().join("state");
        let running = read(&state_file).map(|s| s == "on").unwrap_or(false);
        if memcgs.is_empty() {
            if running {
                write(&state_file, "off")?;
            }
            return Ok(());
        }
        let ctx = self.ctx();
        let p = self.params;
        write(&ctx.join("operations"), "paddr")?;
        let iv = ctx.join("monitoring_attrs/intervals");
        write(&iv.join("sample_us"), &p.sample_us.to_string())?;
        write(&iv.join("aggr_us"), &p.aggr_us.to_string())?;
        write(&iv.join("update_us"), &(p.aggr_us * 10).to_string())?;
        let nr = ctx.join("monitoring_attrs/nr_regions");
        write(&nr.join("min"), "10")?;
        write(&nr.join("max"), "1000")?;
        // paddr with no regions given: DAMON monitors the largest System RAM resource.
        write(&ctx.join("targets/nr_targets"), "1")?;
        write(&ctx.join("schemes/nr_schemes"), "1")?;
        let s = self.scheme();
        write(&s.join("action"), "pageout")?;
        let ap = s.join("access_pattern");
        write(&ap.join("sz/min"), "0")?;
        write(&ap.join("sz/max"), &u64::MAX.to_string())?;
        write(&ap.join("nr_accesses/min"), "0")?;
        write(&ap.join("nr_accesses/max"), "0")?;
        write(&ap.join("age/min"), &p.min_age_intervals().to_string())?;
        write(&ap.join("age/max"), &u32::MAX.to_string())?;
        if p.max_bytes_per_s > 0 {
            write(&s.join("quotas/bytes"), &p.max_bytes_per_s.to_string())?;
            write(&s.join("quotas/reset_interval_ms"), "1000")?;
        }
        // memcg is an operations-layer filter (`ops_filters` since 6.15; `filters` before).
        let filters = if s.join("ops_filters").is_dir() {
            s.join("ops_filters")
        } else {
            s.join("filters")
        };
        write(&filters.join("nr_filters"), &memcgs.len().to_string())?;
        for (i, path) in memcgs.iter().enumerate() {
            let f = filters.join(i.to_string());
            write(&f.join("type"), "memcg")?;
            write(&f.join("memcg_path"), path)?;
            write(&f.join("matching"), "Y")?;
            write(&f.join("allow"), "Y")?;
        }
        write(&state_file, if running { "commit" } else { "on" })?;
        if let Ok(pid) = read(&self.kd().join("pid")) {
            if let Some(dir) = self.marker.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            let _ = std::fs::write(&self.marker, pid);
        }
        Ok(())
    }

    /// Bytes the scheme paged out so far (refreshes the stats first).
    pub fn applied_bytes(&self) -> u64 {
        let state = self.kd().join("state");
        if read(&state).map(|s| s == "on").unwrap_or(false) {
            let _ = write(&state, "update_schemes_stats");
        }
        read(&self.scheme().join("stats/sz_applied"))
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }

    /// Switches the kdamond off and removes it (only the edge's own).
    pub fn release(&self) -> Result<(), DamonError> {
        let state = self.kd().join("state");
        if read(&state).map(|s| s == "on").unwrap_or(false) {
            write(&state, "off")?;
        }
        write(&self.kdamonds().join("nr_kdamonds"), "0")?;
        let _ = std::fs::remove_file(&self.marker);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sysfs-shaped fixture: files the kernel would create.
    fn fixture(nr: u64, state: &str) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        let kd = d.path().join("kdamonds");
        let ctx = kd.join("0/contexts/0");
        let s = ctx.join("schemes/0");
        for dir in [
            ctx.join("monitoring_attrs/intervals"),
            ctx.join("monitoring_attrs/nr_regions"),
            ctx.join("targets"),
            s.join("access_pattern/sz"),
            s.join("access_pattern/nr_accesses"),
            s.join("access_pattern/age"),
            s.join("quotas"),
            s.join("stats"),
            s.join("ops_filters/0"),
            s.join("ops_filters/1"),
        ] {
            std::fs::create_dir_all(dir).unwrap();
        }
        std::fs::write(kd.join("nr_kdamonds"), nr.to_string()).unwrap();
        std::fs::write(kd.join("0/state"), state).unwrap();
        std::fs::write(kd.join("0/pid"), "4242").unwrap();
        std::fs::write(ctx.join("avail_operations"), "paddr\n").unwrap();
        std::fs::write(s.join("stats/sz_applied"), "52428800\n").unwrap();
        d
    }

    fn params() -> DamonParams {
        DamonParams {
            sample_us: 5000,
            aggr_us: 100_000,
            cold_us: 5_000_000,
            max_bytes_per_s: 0,
        }
    }

    #[test]
    fn min_age_in_intervals() {
        assert_eq!(params().min_age_intervals(), 50);
        let p = DamonParams {
            cold_us: 1,
            ..params()
        };
        assert_eq!(p.min_age_intervals(), 1);
    }

    #[test]
    fn busy_when_someone_else_runs_a_kdamond() {
        let d = fixture(1, "on");
        let dm = Damon::new(d.path(), d.path().join("marker"), params());
        let err = dm.claim().unwrap_err();
        assert!(matches!(err, DamonError::Busy(_)), "{err}");
        // Recorded as ours: claimed (switched off for reconfiguration).
        std::fs::write(d.path().join("marker"), "4242").unwrap();
        dm.claim().unwrap();
        assert_eq!(
            std::fs::read_to_string(d.path().join("kdamonds/0/state")).unwrap(),
            "off"
        );
    }

    #[test]
    fn configures_pageout_with_memcg_filters() {
        let d = fixture(0, "off");
        let marker = d.path().join("edge/damon.json");
        let dm = Damon::new(d.path(), &marker, params());
        dm.claim().unwrap();
        let memcgs = vec!["/dsec/n0/sb-a".to_string(), "/dsec/n0/sb-b".to_string()];
        dm.apply(&memcgs).unwrap();
        let kd = d.path().join("kdamonds/0");
        let rd = |p: &str| std::fs::read_to_string(kd.join(p)).unwrap();
        assert_eq!(rd("state"), "on");
        assert_eq!(rd("contexts/0/operations"), "paddr");
        let s = "contexts/0/schemes/0/";
        assert_eq!(rd(&format!("{s}action")), "pageout");
        assert_eq!(rd(&format!("{s}access_pattern/age/min")), "50");
        assert_eq!(rd(&format!("{s}access_pattern/nr_accesses/max")), "0");
        assert_eq!(rd(&format!("{s}ops_filters/nr_filters")), "2");
        assert_eq!(rd(&format!("{s}ops_filters/1/type")), "memcg");
        assert_eq!(rd(&format!("{s}ops_filters/1/memcg_path")), "/dsec/n0/sb-b");
        assert_eq!(rd(&format!("{s}ops_filters/0/allow")), "Y");
        assert_eq!(std::fs::read_to_string(&marker).unwrap(), "4242");
        // Running: a change is committed, not restarted.
        dm.apply(&memcgs[..1]).unwrap();
        assert_eq!(rd("state"), "commit");
        std::fs::write(kd.join("state"), "on").unwrap();
        assert_eq!(dm.applied_bytes(), 52428800);
        // No best-effort sandbox: off.
        std::fs::write(kd.join("state"), "on").unwrap();
        dm.apply(&[]).unwrap();
        assert_eq!(rd("state"), "off");
        dm.release().unwrap();
        assert_eq!(
            std::fs::read_to_string(d.path().join("kdamonds/nr_kdamonds")).unwrap(),
            "0"
        );
        assert!(!marker.exists());
    }
}
