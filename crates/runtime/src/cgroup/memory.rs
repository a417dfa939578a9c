//! Memory of a sandbox's cgroup and of the sandboxes' parent: the one `memory.stat` parser,
//! the working set, reclaim (bounded in time), the swap policy and the node memory budget.
//! Pause ([`crate::container::pause`]) and the node's reclaim policy (`dsec-node`) both use it.
//!
//! | what            | cgroup v1 (`<root>/memory/<parent>/<id>`)  | cgroup v2 (`<root>/<parent>/<id>`)  |
//! |-----------------|--------------------------------------------|-------------------------------------|
//! | figures         | `memory.usage_in_bytes`, `memory.stat` `total_*` | `memory.current`, `memory.stat`, `memory.swap.current` |
//! | working set     | usage − `total_inactive_file`              | usage − `inactive_file`             |
//! | reclaim now     | `memory.force_empty`, interrupted after [`FORCE_EMPTY_TIMEOUT`] | `memory.reclaim` = usage (EAGAIN: partial) |
//! | never swap (LS) | `memory.swappiness` = 0                    | `memory.swap.max` = 0               |
//! | swap first (BE) | `memory.swappiness` = high (100)           | `memory.swap.max` = max             |
//! | node budget     | parent `memory.limit_in_bytes`             | parent `memory.max`                 |
//!
//! Reclaim gives back page cache always and anonymous memory only where swap exists. v1
//! children inherit `memory.swappiness` from their parent when created, so
//! [`SandboxesParent::prepare`] sets the parent to 0: a sandbox is never swapped until its
//! policy says so.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{parse_keyed, read_file, write_file, Cgroup, CgroupError, CgroupRoot, CgroupVersion};

/// Memory figures of one cgroup (zeros where a file is missing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryStat {
    /// Charged bytes (v1 `memory.usage_in_bytes`, v2 `memory.current`).
    pub usage: u64,
    /// Anonymous resident bytes (v1 `total_rss`, v2 `anon`).
    pub anon: u64,
    /// Page cache (v1 `total_cache`, v2 `file`).
    pub cache: u64,
    /// Bytes swapped out (v1 `total_swap`, v2 `memory.swap.current`).
    pub swap: u64,
    /// Inactive page cache (v1 `total_inactive_file`, v2 `inactive_file`).
    pub inactive_file: u64,
}

impl MemoryStat {
    /// What the cgroup really needs resident: usage less inactive page cache.
    pub fn working_set(&self) -> u64 {
        self.usage.saturating_sub(self.inactive_file)
    }
}

/// Parses `memory.stat` text of a `version` hierarchy (v1: the hierarchical `total_*` keys).
/// `v2_swap` is `memory.swap.current` (v2 keeps swap out of `memory.stat`).
pub fn parse_stat(
    version: CgroupVersion,
    text: &str,
    usage: u64,
    v2_swap: Option<u64>,
) -> MemoryStat {
    let get = |key: &str| parse_keyed(text, key).unwrap_or(0);
    if version == CgroupVersion::V1 {
        MemoryStat {
            usage,
            anon: get("total_rss"),
            cache: get("total_cache"),
            swap: get("total_swap"),
            inactive_file: get("total_inactive_file"),
        }
    } else {
        MemoryStat {
            usage,
            anon: get("anon"),
            cache: get("file"),
            swap: v2_swap.unwrap_or(0),
            inactive_file: get("inactive_file"),
        }
    }
}

/// Reads a number file (`max` is `u64::MAX`); None when missing or malformed.
fn read_number(path: &Path) -> Option<u64> {
    let t = std::fs::read_to_string(path).ok()?;
    let t = t.trim();
    if t == "max" {
        return Some(u64::MAX);
    }
    t.parse().ok()
}

/// The figures of the memory cgroup directory `dir` of a `version` hierarchy.
fn stat_of(version: CgroupVersion, dir: &Path) -> MemoryStat {
    let (usage_file, swap) = match version {
        CgroupVersion::V1 => ("memory.usage_in_bytes", None),
        CgroupVersion::V2 => (
            "memory.current",
            read_number(&dir.join("memory.swap.current")),
        ),
    };
    let usage = read_number(&dir.join(usage_file)).unwrap_or(0);
    let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
    parse_stat(version, &stat, usage, swap)
}

/// True when the host has a swap device (`/proc/swaps` lists one).
pub fn host_has_swap() -> bool {
    std::fs::read_to_string("/proc/swaps")
        .map(|s| s.lines().count() > 1)
        .unwrap_or(false)
}

/// How a reclaim went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reclaimed {
    /// The kernel freed what it was asked for.
    Complete,
    /// It freed less (v2 EAGAIN) or ran out of time (v1 `force_empty` interrupted).
    Partial,
}

/// The kernel interface a reclaim used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReclaimFile {
    /// cgroup v1 `memory.force_empty`.
    ForceEmpty,
    /// cgroup v2 `memory.reclaim`.
    Reclaim,
}

impl ReclaimFile {
    pub fn name(self) -> &'static str {
        match self {
            ReclaimFile::ForceEmpty => "memory.force_empty",
            ReclaimFile::Reclaim => "memory.reclaim",
        }
    }
}

/// What [`Cgroup::reclaim_memory`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReclaimOutcome {
    pub file: ReclaimFile,
    pub result: Reclaimed,
}

/// Swap policy of a sandbox's memory cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SwapPolicy {
    /// Never swapped (latency-sensitive).
    Never,
    /// Swapped first (best-effort); v1 uses this `memory.swappiness` (at most 200).
    First { swappiness: u64 },
}

/// Longest a v1 `force_empty` may run: on a cgroup whose tasks keep touching memory the
/// kernel loop makes progress forever, and only a signal ends it.
pub const FORCE_EMPTY_TIMEOUT: Duration = Duration::from_secs(2);

impl Cgroup {
    /// The cgroup's directory in the memory hierarchy (None: v1 without a memory hierarchy).
    fn memory_dir(&self) -> Option<&Path> {
        match self {
            Cgroup::V1(c) => c.dir("memory"),
            Cgroup::V2(c) => Some(c.dir()),
        }
    }

    fn version(&self) -> CgroupVersion {
        match self {
            Cgroup::V1(_) => CgroupVersion::V1,
            Cgroup::V2(_) => CgroupVersion::V2,
        }
    }

    /// The cgroup's memory figures (zeros where a file is missing).
    pub fn memory_stat(&self) -> MemoryStat {
        match self.memory_dir() {
            Some(d) => stat_of(self.version(), d),
            None => MemoryStat::default(),
        }
    }

    /// Charged memory minus inactive file pages, in bytes (0 without a memory hierarchy).
    pub fn memory_working_set(&self) -> Result<u64, CgroupError> {
        let Some(dir) = self.memory_dir() else {
            return Ok(0);
        };
        // The usage file must be there (a gone cgroup is an error); memory.stat may lag.
        let usage_file = match self.version() {
            CgroupVersion::V1 => "memory.usage_in_bytes",
            CgroupVersion::V2 => "memory.current",
        };
        super::read_u64(&dir.join(usage_file))?;
        Ok(stat_of(self.version(), dir).working_set())
    }

    /// The memcg path as the kernel names it relative to the memory hierarchy's root
    /// (`/dsec/n0/<id>`, the same form on v1 and v2; DAMON's memcg filter takes it).
    pub fn memcg_path(&self) -> String {
        format!("/{}", self.rel().display())
    }

    /// Gives back what the kernel can of the cgroup's memory now (page cache always,
    /// anonymous memory where swap exists). Best on a frozen cgroup: nothing refaults. Blocking,
    /// at most about [`FORCE_EMPTY_TIMEOUT`] on v1.
    pub fn reclaim_memory(&self) -> Result<ReclaimOutcome, CgroupError> {
        let dir = self.memory_dir().ok_or_else(|| {
            CgroupError::io(
                "reclaim",
                self.path(),
                std::io::Error::new(
                    std::io::ErrorKind::Unsupported,
                    "the v1 memory hierarchy is not mounted",
                ),
            )
        })?;
        match self.version() {
            CgroupVersion::V1 => {
                let result = force_empty_bounded(&dir.join("memory.force_empty"))?;
                Ok(ReclaimOutcome {
                    file: ReclaimFile::ForceEmpty,
                    result,
                })
            }
            CgroupVersion::V2 => {
                let usage = read_number(&dir.join("memory.current"))
                    .unwrap_or(0)
                    .max(4096);
                let f = dir.join("memory.reclaim");
                let result = match std::fs::write(&f, usage.to_string()) {
                    Ok(()) => Reclaimed::Complete,
                    // EAGAIN: the kernel reclaimed less than asked: expected for a live cgroup.
                    Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => Reclaimed::Partial,
                    Err(e) => return Err(CgroupError::io("write", &f, e)),
                };
                Ok(ReclaimOutcome {
                    file: ReclaimFile::Reclaim,
                    result,
                })
            }
        }
    }

    /// Applies a swap policy (v1 `memory.swappiness`, v2 `memory.swap.max` where it exists).
    pub fn set_swap_policy(&self, policy: SwapPolicy) -> Result<(), CgroupError> {
        let Some(dir) = self.memory_dir() else {
            return Ok(());
        };
        match self.version() {
            CgroupVersion::V1 => {
                let v = match policy {
                    SwapPolicy::Never => 0,
                    SwapPolicy::First { swappiness } => swappiness.min(200),
                };
                write_file(&dir.join("memory.swappiness"), &v.to_string())
            }
            CgroupVersion::V2 => {
                let f = dir.join("memory.swap.max");
                if !f.exists() {
                    return Ok(());
                }
                let v = match policy {
                    SwapPolicy::Never => "0",
                    SwapPolicy::First { .. } => "max",
                };
                write_file(&f, v)
            }
        }
    }
}

/// Writes `0` to a v1 `memory.force_empty` from a child process that `timeout` interrupts
/// (SIGINT ends the kernel's reclaim loop with EINTR): a reclaim cannot hang its caller.
fn force_empty_bounded(file: &Path) -> Result<Reclaimed, CgroupError> {
    if !file.exists() {
        return Err(CgroupError::io(
            "write",
            file,
            std::io::Error::from(std::io::ErrorKind::NotFound),
        ));
    }
    if !file.starts_with(super::DEFAULT_ROOT) {
        // Fixture files (unit tests): a plain write, nothing to interrupt.
        write_file(file, "0")?;
        return Ok(Reclaimed::Complete);
    }
    let out = std::process::Command::new("timeout")
        .args(["-s", "INT"])
        .arg(format!("{}", FORCE_EMPTY_TIMEOUT.as_secs().max(1)))
        .args(["sh", "-c", "echo 0 > \"$1\"", "sh"])
        .arg(file)
        .output()
        .map_err(|e| CgroupError::io("run timeout sh for", file, e))?;
    match out.status.code() {
        Some(0) => Ok(Reclaimed::Complete),
        // 124: timed out (reclaimed for the whole time: the cgroup is active).
        Some(124) => Ok(Reclaimed::Partial),
        _ => Err(CgroupError::io(
            "write",
            file,
            std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        )),
    }
}

/// The parent cgroup of one node's sandboxes (`<parent>` below the memory hierarchy): the
/// node memory budget, its figures and pressure.
#[derive(Debug, Clone)]
pub struct SandboxesParent {
    version: CgroupVersion,
    dir: PathBuf,
}

impl SandboxesParent {
    /// The parent `parent` (e.g. `dsec/n0`) in `root`'s memory hierarchy.
    pub fn new(root: &CgroupRoot, parent: &str) -> Result<Self, CgroupError> {
        let rel = super::validate_parent(parent)?;
        let dir = match root.version {
            CgroupVersion::V1 => root.path.join("memory").join(rel),
            CgroupVersion::V2 => root.path.join(rel),
        };
        Ok(SandboxesParent {
            version: root.version,
            dir,
        })
    }

    /// The parent's directory in the memory hierarchy.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// Creates the parent if needed and makes "never swap" the default of new children (v1
    /// `memory.swappiness` 0, inherited at creation).
    pub fn prepare(&self) -> Result<(), CgroupError> {
        std::fs::create_dir_all(&self.dir).map_err(|e| CgroupError::io("create", &self.dir, e))?;
        if self.version == CgroupVersion::V1 {
            write_file(&self.dir.join("memory.swappiness"), "0")?;
        }
        Ok(())
    }

    /// Memory figures of all sandboxes together.
    pub fn memory_stat(&self) -> MemoryStat {
        stat_of(self.version, &self.dir)
    }

    fn limit_file(&self) -> PathBuf {
        self.dir.join(match self.version {
            CgroupVersion::V1 => "memory.limit_in_bytes",
            CgroupVersion::V2 => "memory.max",
        })
    }

    /// Enforces the node memory budget as the parent's limit (None: unlimited).
    pub fn set_budget(&self, bytes: Option<u64>) -> Result<(), CgroupError> {
        let v = match (bytes, self.version) {
            (Some(b), _) => b.to_string(),
            (None, CgroupVersion::V1) => "-1".to_string(),
            (None, CgroupVersion::V2) => "max".to_string(),
        };
        write_file(&self.limit_file(), &v)
    }

    /// The parent's limit in bytes (huge when unlimited), None when unreadable.
    pub fn budget(&self) -> Option<u64> {
        read_number(&self.limit_file())
    }

    /// v2: the parent's `memory.pressure` text; v1 has no per-cgroup PSI (None).
    pub fn pressure_text(&self) -> Option<String> {
        if self.version != CgroupVersion::V2 {
            return None;
        }
        read_file(&self.dir.join("memory.pressure")).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::Limits;

    const V1_STAT: &str = "cache 100\nrss 200\nswap 0\ntotal_cache 4096\ntotal_rss 8192\ntotal_swap 1024\ntotal_inactive_file 512\n";
    const V2_STAT: &str = "anon 52428800\nfile 1048576\ninactive_file 4096\nactive_file 8192\n";

    #[test]
    fn stat_parsing_both_versions() {
        let v1 = parse_stat(CgroupVersion::V1, V1_STAT, 20000, None);
        assert_eq!(
            v1,
            MemoryStat {
                usage: 20000,
                anon: 8192,
                cache: 4096,
                swap: 1024,
                inactive_file: 512
            }
        );
        assert_eq!(v1.working_set(), 19488);
        let v2 = parse_stat(CgroupVersion::V2, V2_STAT, 60_000_000, Some(77));
        assert_eq!(
            (v2.anon, v2.cache, v2.swap, v2.inactive_file),
            (52428800, 1048576, 77, 4096)
        );
        // Per-cgroup v1 keys (`cache`, `rss`) are not the hierarchical ones.
        let v1_local = parse_stat(
            CgroupVersion::V1,
            "cache 10\nrss 20\ntotal_cache 100\ntotal_rss 200\n",
            5,
            None,
        );
        assert_eq!((v1_local.cache, v1_local.anon), (100, 200));
        assert_eq!(parse_stat(CgroupVersion::V2, "garbage", 1, None).cache, 0);
    }

    fn v2_fixture() -> (tempfile::TempDir, Cgroup, SandboxesParent) {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("cgroup.controllers"), "memory\n").unwrap();
        let root = CgroupRoot::detect_at(d.path());
        let cg = Cgroup::create(&root, "dsec/n0", "sb-1", &Limits::default()).unwrap();
        let sb = cg.path().to_path_buf();
        for f in ["memory.swap.max", "memory.reclaim"] {
            std::fs::write(sb.join(f), "").unwrap();
        }
        std::fs::write(sb.join("memory.current"), "123456\n").unwrap();
        std::fs::write(sb.join("memory.swap.current"), "4096\n").unwrap();
        std::fs::write(sb.join("memory.stat"), V2_STAT).unwrap();
        let parent = SandboxesParent::new(&root, "dsec/n0").unwrap();
        std::fs::write(parent.dir().join("memory.max"), "max\n").unwrap();
        std::fs::write(
            parent.dir().join("memory.pressure"),
            "some avg10=12.50 avg60=3.00 avg300=0.10 total=99\n",
        )
        .unwrap();
        (d, cg, parent)
    }

    #[test]
    fn v2_against_fixture() {
        let (_d, cg, parent) = v2_fixture();
        assert_eq!(cg.memcg_path(), "/dsec/n0/sb-1");
        cg.set_swap_policy(SwapPolicy::Never).unwrap();
        let swap_max = cg.path().join("memory.swap.max");
        assert_eq!(std::fs::read_to_string(&swap_max).unwrap(), "0");
        cg.set_swap_policy(SwapPolicy::First { swappiness: 100 })
            .unwrap();
        assert_eq!(std::fs::read_to_string(&swap_max).unwrap(), "max");
        let r = cg.reclaim_memory().unwrap();
        assert_eq!(
            r,
            ReclaimOutcome {
                file: ReclaimFile::Reclaim,
                result: Reclaimed::Complete
            }
        );
        assert_eq!(
            std::fs::read_to_string(cg.path().join("memory.reclaim")).unwrap(),
            "123456"
        );
        let s = cg.memory_stat();
        assert_eq!((s.usage, s.swap, s.anon), (123456, 4096, 52428800));
        assert_eq!(cg.memory_working_set().unwrap(), 123456 - 4096);
        assert_eq!(parent.budget(), Some(u64::MAX));
        parent.set_budget(Some(1 << 30)).unwrap();
        assert_eq!(parent.budget(), Some(1 << 30));
        parent.set_budget(None).unwrap();
        assert_eq!(
            std::fs::read_to_string(parent.dir().join("memory.max")).unwrap(),
            "max"
        );
        assert!(parent
            .pressure_text()
            .unwrap()
            .starts_with("some avg10=12.50"));
    }

    #[test]
    fn v1_against_fixture() {
        let d = crate::cgroup::v1::fixture();
        let root = CgroupRoot::detect_at(d.path());
        let parent = SandboxesParent::new(&root, "dsec/n0").unwrap();
        assert_eq!(parent.dir(), d.path().join("memory/dsec/n0"));
        parent.prepare().unwrap();
        assert_eq!(
            std::fs::read_to_string(parent.dir().join("memory.swappiness")).unwrap(),
            "0"
        );
        let cg = Cgroup::create(&root, "dsec/n0", "sb-1", &Limits::default()).unwrap();
        assert_eq!(cg.memcg_path(), "/dsec/n0/sb-1");
        let mem = d.path().join("memory/dsec/n0/sb-1");
        // No force_empty file: an error naming it, not a silent success.
        assert!(cg.reclaim_memory().is_err());
        std::fs::write(mem.join("memory.force_empty"), "").unwrap();
        cg.set_swap_policy(SwapPolicy::First { swappiness: 300 })
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(mem.join("memory.swappiness")).unwrap(),
            "200"
        );
        assert_eq!(cg.reclaim_memory().unwrap().file, ReclaimFile::ForceEmpty);
        std::fs::write(mem.join("memory.usage_in_bytes"), "9000\n").unwrap();
        std::fs::write(
            mem.join("memory.stat"),
            "inactive_file 1\ntotal_inactive_file 2000\n",
        )
        .unwrap();
        assert_eq!(cg.memory_working_set().unwrap(), 7000);
        parent.set_budget(None).unwrap();
        assert_eq!(
            std::fs::read_to_string(parent.dir().join("memory.limit_in_bytes")).unwrap(),
            "-1"
        );
        assert_eq!(parent.pressure_text(), None);
    }
}
