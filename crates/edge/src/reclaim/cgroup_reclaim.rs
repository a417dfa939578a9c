//! cgroup-driven memory policy: swap policy per QoS class, reclaim of one sandbox's cgroup,
//! the node memory budget on the sandboxes' parent cgroup, and memory figures.
//!
//! | what              | cgroup v1 (`<root>/memory/<parent>/<id>`) | cgroup v2 (`<root>/<parent>/<id>`) |
//! |-------------------|-------------------------------------------|------------------------------------|
//! | never swap (LS)   | `memory.swappiness` = 0                   | `memory.swap.max` = 0              |
//! | swap first (BE)   | `memory.swappiness` = high (100)          | `memory.swap.max` = max            |
//! | reclaim now       | `memory.force_empty` (reclaims everything it can, swapping anon at the cgroup's swappiness) | `memory.reclaim` = usage (EAGAIN = partial) |
//! | node budget       | parent `memory.limit_in_bytes`            | parent `memory.max`                |
//! | working set       | `usage_in_bytes` − `total_inactive_file`  | `memory.current` − `inactive_file` |
//!
//! v1 children inherit `memory.swappiness` from their parent when created, so the parent is set
//! to 0: a sandbox is latency-sensitive (never swapped) until the policy raises it.

use std::path::{Path, PathBuf};

use dsec_runtime::cgroup::{CgroupRoot, CgroupVersion};
use dsec_wire::api::QosClass;

#[derive(Debug, thiserror::Error)]
pub enum CgroupReclaimError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(op: &'static str, path: &Path, source: std::io::Error) -> CgroupReclaimError {
    CgroupReclaimError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

fn write(path: &Path, value: &str) -> Result<(), CgroupReclaimError> {
    std::fs::write(path, value).map_err(|e| io("write", path, e))
}

fn read_u64(path: &Path) -> Option<u64> {
    let t = std::fs::read_to_string(path).ok()?;
    let t = t.trim();
    if t == "max" {
        return Some(u64::MAX);
    }
    t.parse().ok()
}

fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next() == Some(key)).then(|| it.next()?.parse().ok())?
    })
}

/// The memory cgroups of one node's sandboxes.
#[derive(Debug, Clone)]
pub struct MemCgroups {
    pub version: CgroupVersion,
    /// Directory of the parent (`dsec/<node>`) in the memory hierarchy.
    pub parent_dir: PathBuf,
    /// The parent path as DAMON's memcg filter names it (`/dsec/<node>`).
    pub parent_rel: String,
}

/// Memory figures of one cgroup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemFigures {
    /// Charged bytes (v1 usage_in_bytes, v2 memory.current).
    pub usage: u64,
    /// Anonymous resident bytes (v1 total_rss, v2 anon).
    pub anon: u64,
    /// Page cache (v1 total_cache, v2 file).
    pub cache: u64,
    /// Bytes swapped out (v1 total_swap, v2 memory.swap.current).
    pub swap: u64,
    /// Inactive page cache (v1 total_inactive_file, v2 inactive_file).
    pub inactive_file: u64,
}

impl MemFigures {
    /// What the cgroup really needs resident: usage less inactive page cache.
    pub fn working_set(&self) -> u64 {
        self.usage.saturating_sub(self.inactive_file)
    }
}

/// Parses `memory.stat` (v1 hierarchical `total_*` keys, else v2 keys).
pub fn parse_stat(text: &str, usage: u64, v2_swap: Option<u64>) -> MemFigures {
    if keyed(text, "total_rss").is_some() {
        MemFigures {
            usage,
            anon: keyed(text, "total_rss").unwrap_or(0),
            cache: keyed(text, "total_cache").unwrap_or(0),
            swap: keyed(text, "total_swap").unwrap_or(0),
            inactive_file: keyed(text, "total_inactive_file").unwrap_or(0),
        }
    } else {
        MemFigures {
            usage,
            anon: keyed(text, "anon").unwrap_or(0),
            cache: keyed(text, "file").unwrap_or(0),
            swap: v2_swap.unwrap_or(0),
            inactive_file: keyed(text, "inactive_file").unwrap_or(0),
        }
    }
}

impl MemCgroups {
    pub fn new(root: &CgroupRoot, parent: &str) -> Self {
        let rel = parent.trim_matches('/');
        let parent_dir = match root.version {
            CgroupVersion::V1 => root.path.join("memory").join(rel),
            CgroupVersion::V2 => root.path.join(rel),
        };
        MemCgroups {
            version: root.version,
            parent_dir,
            parent_rel: format!("/{rel}"),
        }
    }

    pub fn dir(&self, id: &str) -> PathBuf {
        self.parent_dir.join(id)
    }

    /// The memcg path DAMON's filter takes for a sandbox (relative to the hierarchy root).
    pub fn memcg_path(&self, id: &str) -> String {
        format!("{}/{id}", self.parent_rel)
    }

    /// Memory figures of a cgroup directory (zeros where files are missing).
    pub fn figures_of(&self, dir: &Path) -> MemFigures {
        let (usage_file, swap) = match self.version {
            CgroupVersion::V1 => ("memory.usage_in_bytes", None),
            CgroupVersion::V2 => ("memory.current", read_u64(&dir.join("memory.swap.current"))),
        };
        let usage = read_u64(&dir.join(usage_file)).unwrap_or(0);
        let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
        parse_stat(&stat, usage, swap)
    }

    pub fn figures(&self, id: &str) -> MemFigures {
        self.figures_of(&self.dir(id))
    }

    /// Creates the parent if needed and makes it the LS default (v1 swappiness 0, inherited
    /// by new children).
    pub fn prepare_parent(&self) -> Result<(), CgroupReclaimError> {
        std::fs::create_dir_all(&self.parent_dir).map_err(|e| io("create", &self.parent_dir, e))?;
        if self.version == CgroupVersion::V1 {
            write(&self.parent_dir.join("memory.swappiness"), "0")?;
        }
        Ok(())
    }

    /// Applies a QoS class's swap policy to a sandbox's cgroup.
    pub fn apply_swap_policy(
        &self,
        id: &str,
        class: QosClass,
        be_swappiness: u64,
    ) -> Result<(), CgroupReclaimError> {
        let dir = self.dir(id);
        match self.version {
            CgroupVersion::V1 => {
                let v = match class {
                    QosClass::LatencySensitive => 0,
                    QosClass::BestEffort => be_swappiness.min(200),
                };
                write(&dir.join("memory.swappiness"), &v.to_string())
            }
            CgroupVersion::V2 => {
                let v = match class {
                    QosClass::LatencySensitive => "0",
                    QosClass::BestEffort => "max",
                };
                let f = dir.join("memory.swap.max");
                if f.exists() {
                    write(&f, v)
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Reclaims what it can of a sandbox's memory now. Returns the method used.
    pub fn reclaim(&self, id: &str) -> Result<&'static str, CgroupReclaimError> {
        let dir = self.dir(id);
        match self.version {
            CgroupVersion::V1 => {
                force_empty_bounded(&dir.join("memory.force_empty"))?;
                Ok("cgroup-v1-force_empty")
            }
            CgroupVersion::V2 => {
                let usage = read_u64(&dir.join("memory.current")).unwrap_or(0).max(4096);
                let f = dir.join("memory.reclaim");
                match std::fs::write(&f, usage.to_string()) {
                    Ok(()) => Ok("cgroup-v2-memory.reclaim"),
                    // EAGAIN: the kernel reclaimed less than asked: expected for a live cgroup.
                    Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                        Ok("cgroup-v2-memory.reclaim")
                    }
                    Err(e) => Err(io("write", &f, e)),
                }
            }
        }
    }

    fn limit_file(&self) -> PathBuf {
        self.parent_dir.join(match self.version {
            CgroupVersion::V1 => "memory.limit_in_bytes",
            CgroupVersion::V2 => "memory.max",
        })
    }

    /// Enforces the node memory budget as the parent's limit (None: unlimited).
    pub fn set_budget(&self, bytes: Option<u64>) -> Result<(), CgroupReclaimError> {
        let v = match (bytes, self.version) {
            (Some(b), _) => b.to_string(),
            (None, CgroupVersion::V1) => "-1".to_string(),
            (None, CgroupVersion::V2) => "max".to_string(),
        };
        write(&self.limit_file(), &v)
    }

    /// The parent's limit in bytes (u64::MAX-ish when unlimited).
    pub fn budget(&self) -> Option<u64> {
        read_u64(&self.limit_file())
    }

    /// v2: `some avg10` of the parent's `memory.pressure`; v1 has no per-cgroup PSI (None).
    pub fn parent_psi_some_avg10(&self) -> Option<f64> {
        if self.version != CgroupVersion::V2 {
            return None;
        }
        let text = std::fs::read_to_string(self.parent_dir.join("memory.pressure")).ok()?;
        super::pressure::parse_psi(&text).map(|p| p.some_avg10)
    }
}

/// Longest a v1 `force_empty` may run: on a cgroup whose tasks keep touching memory the
/// kernel loop makes progress forever, and only a signal ends it.
const FORCE_EMPTY_TIMEOUT_S: &str = "2";

/// Writes `0` to a v1 `memory.force_empty` from a child process that `timeout` interrupts
/// (SIGINT ends the kernel's reclaim loop with EINTR): the reclaim cannot hang the edge.
fn force_empty_bounded(file: &Path) -> Result<(), CgroupReclaimError> {
    if !file.exists() {
        return Err(io(
            "write",
            file,
            std::io::Error::from(std::io::ErrorKind::NotFound),
        ));
    }
    if cfg!(test) {
        // Fixture files in unit tests: a plain write.
        return write(file, "0");
    }
    let out = std::process::Command::new("timeout")
        .args([
            "-s",
            "INT",
            FORCE_EMPTY_TIMEOUT_S,
            "sh",
            "-c",
            "echo 0 > \"$1\"",
            "sh",
        ])
        .arg(file)
        .output()
        .map_err(|e| io("run timeout sh for", file, e))?;
    // 124: timed out (reclaimed for the whole time: the cgroup is active); partial is fine.
    if out.status.success() || out.status.code() == Some(124) {
        Ok(())
    } else {
        Err(io(
            "write",
            file,
            std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1_STAT: &str = "cache 100\nrss 200\nswap 0\ntotal_cache 4096\ntotal_rss 8192\ntotal_swap 1024\ntotal_inactive_file 512\n";
    const V2_STAT: &str = "anon 52428800\nfile 1048576\ninactive_file 4096\nactive_file 8192\n";

    #[test]
    fn stat_parsing_both_versions() {
        let v1 = parse_stat(V1_STAT, 20000, None);
        assert_eq!(
            v1,
            MemFigures {
                usage: 20000,
                anon: 8192,
                cache: 4096,
                swap: 1024,
                inactive_file: 512
            }
        );
        assert_eq!(v1.working_set(), 19488);
        let v2 = parse_stat(V2_STAT, 60_000_000, Some(77));
        assert_eq!(v2.anon, 52428800);
        assert_eq!(v2.cache, 1048576);
        assert_eq!(v2.swap, 77);
        assert_eq!(v2.inactive_file, 4096);
    }

    fn v2_fixture() -> (tempfile::TempDir, MemCgroups) {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("cgroup.controllers"), "memory\n").unwrap();
        let root = CgroupRoot::detect_at(d.path());
        let m = MemCgroups::new(&root, "dsec/n0");
        let sb = m.dir("sb-1");
        std::fs::create_dir_all(&sb).unwrap();
        for f in ["memory.swap.max", "memory.reclaim"] {
            std::fs::write(sb.join(f), "").unwrap();
        }
        std::fs::write(sb.join("memory.current"), "123456\n").unwrap();
        std::fs::write(sb.join("memory.swap.current"), "4096\n").unwrap();
        std::fs::write(sb.join("memory.stat"), V2_STAT).unwrap();
        std::fs::write(m.parent_dir.join("memory.max"), "max\n").unwrap();
        std::fs::write(
            m.parent_dir.join("memory.pressure"),
            "some avg10=12.50 avg60=3.00 avg300=0.10 total=99\nfull avg10=1.00 avg60=0.00 avg300=0.00 total=5\n",
        )
        .unwrap();
        (d, m)
    }

    #[test]
    fn v2_paths_against_fixture() {
        let (_d, m) = v2_fixture();
        assert_eq!(m.version, CgroupVersion::V2);
        assert_eq!(m.memcg_path("sb-1"), "/dsec/n0/sb-1");
        m.apply_swap_policy("sb-1", QosClass::LatencySensitive, 100)
            .unwrap();
        let swap_max = m.dir("sb-1").join("memory.swap.max");
        assert_eq!(std::fs::read_to_string(&swap_max).unwrap(), "0");
        m.apply_swap_policy("sb-1", QosClass::BestEffort, 100)
            .unwrap();
        assert_eq!(std::fs::read_to_string(&swap_max).unwrap(), "max");
        assert_eq!(m.reclaim("sb-1").unwrap(), "cgroup-v2-memory.reclaim");
        assert_eq!(
            std::fs::read_to_string(m.dir("sb-1").join("memory.reclaim")).unwrap(),
            "123456"
        );
        let f = m.figures("sb-1");
        assert_eq!((f.usage, f.swap, f.anon), (123456, 4096, 52428800));
        assert_eq!(m.budget(), Some(u64::MAX));
        m.set_budget(Some(1 << 30)).unwrap();
        assert_eq!(m.budget(), Some(1 << 30));
        m.set_budget(None).unwrap();
        assert_eq!(
            std::fs::read_to_string(m.parent_dir.join("memory.max")).unwrap(),
            "max"
        );
        assert_eq!(m.parent_psi_some_avg10(), Some(12.5));
    }

    #[test]
    fn v1_paths_against_fixture() {
        let d = tempfile::tempdir().unwrap();
        let root = CgroupRoot::detect_at(d.path());
        let m = MemCgroups::new(&root, "dsec/n0");
        assert_eq!(m.parent_dir, d.path().join("memory/dsec/n0"));
        m.prepare_parent().unwrap();
        assert_eq!(
            std::fs::read_to_string(m.parent_dir.join("memory.swappiness")).unwrap(),
            "0"
        );
        std::fs::create_dir_all(m.dir("sb-1")).unwrap();
        std::fs::write(m.dir("sb-1").join("memory.force_empty"), "").unwrap();
        m.apply_swap_policy("sb-1", QosClass::BestEffort, 100)
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(m.dir("sb-1").join("memory.swappiness")).unwrap(),
            "100"
        );
        assert_eq!(m.reclaim("sb-1").unwrap(), "cgroup-v1-force_empty");
        m.set_budget(None).unwrap();
        assert_eq!(
            std::fs::read_to_string(m.parent_dir.join("memory.limit_in_bytes")).unwrap(),
            "-1"
        );
        assert_eq!(m.parent_psi_some_avg10(), None);
    }
}
