//! cgroup drivers: one sandbox's cgroup, whatever the host's cgroup version.
//!
//! * [`v1`] — one hierarchy per controller (`<root>/memory/<parent>/<id>`, `<root>/cpu/...`,
//!   `<root>/pids/...`, `<root>/freezer/...`).
//! * [`v2`] — the unified hierarchy (`<root>/<parent>/<id>`).
//!
//! User processes live in a child cgroup `user` of the sandbox's (v1: in the pids hierarchy only;
//! v2: `<id>/user`, with aether in `<id>/agent` because of the no-internal-processes rule). The
//! pids limit applies to `user`; the sandbox's own cgroup allows [`AGENT_PIDS_RESERVE`] more, so
//! that aether can still start threads and commands while a fork bomb fills `user`. aether moves
//! every child it forks into `user` through the `cgroup.procs` fd it inherits
//! ([`Cgroup::user_procs_file`]).
//!
//! The version is detected from the controller root: v2 iff `<root>/cgroup.controllers` exists
//! (a hybrid host's empty v2 mount at `<root>/unified` is ignored). The root is a parameter so
//! the parsing and path logic can be tested against fixture files in a temporary directory.

pub mod favor;
pub mod memory;
pub mod qos;
pub mod v1;
pub mod v2;

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Name of the user processes' child cgroup.
pub const USER_DIR: &str = "user";
/// Name of aether's child cgroup (v2 only).
pub const AGENT_DIR: &str = "agent";
/// Tasks the sandbox's cgroup allows beyond the user limit: aether's threads and the children
/// it forks before they move into the user cgroup.
pub const AGENT_PIDS_RESERVE: u64 = 32;

/// The default controller root.
pub const DEFAULT_ROOT: &str = "/sys/fs/cgroup";

/// An error of a cgroup operation, naming the file it touched.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("parse {path}: {what}")]
    Parse { path: PathBuf, what: String },
    #[error("invalid cgroup name {0:?}")]
    InvalidName(String),
    #[error("cgroup {path} still has processes after killing them")]
    Busy { path: PathBuf },
}

impl CgroupError {
    pub(crate) fn io(op: &'static str, path: &Path, source: io::Error) -> Self {
        CgroupError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Which cgroup version the host runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

impl CgroupVersion {
    /// `v1` or `v2` (the node status's `cgroup_version`).
    pub fn as_str(self) -> &'static str {
        match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        }
    }
}

/// Where the cgroup file systems are mounted, and which version they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupRoot {
    pub version: CgroupVersion,
    pub path: PathBuf,
}

impl CgroupRoot {
    /// Detects the version of the hierarchy mounted at `path`.
    pub fn detect_at(path: impl Into<PathBuf>) -> Self {
        let path = path.into();
        let version = if path.join("cgroup.controllers").exists() {
            CgroupVersion::V2
        } else {
            CgroupVersion::V1
        };
        CgroupRoot { version, path }
    }

    /// Detects the host's cgroup version at [`DEFAULT_ROOT`].
    pub fn detect() -> Self {
        Self::detect_at(DEFAULT_ROOT)
    }
}

/// Resource limits of one sandbox. Zero means "no limit" for every field.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Limits {
    pub memory_bytes: u64,
    pub cpu_cores: f64,
    pub pids: u64,
}

/// CFS period used for CPU quotas, in microseconds.
pub const CPU_PERIOD_US: u64 = 100_000;

/// The CFS quota for `cores` cores at [`CPU_PERIOD_US`]; `None` means unlimited.
pub fn cpu_quota_us(cores: f64) -> Option<u64> {
    if !(cores.is_finite() && cores > 0.0) {
        return None;
    }
    // At least 1 ms per period: the kernel rejects smaller quotas.
    Some(((cores * CPU_PERIOD_US as f64).round() as u64).max(1000))
}

/// True for names usable as one path component of a cgroup (sandbox ids, parent segments).
fn valid_component(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// Checks a `a/b/c` parent path (may be empty) and returns it as a relative path.
pub fn validate_parent(parent: &str) -> Result<PathBuf, CgroupError> {
    let trimmed = parent.trim_matches('/');
    if trimmed.is_empty() {
        return Ok(PathBuf::new());
    }
    if trimmed.split('/').all(valid_component) {
        Ok(PathBuf::from(trimmed))
    } else {
        Err(CgroupError::InvalidName(parent.to_string()))
    }
}

/// One sandbox's cgroup (in every v1 controller hierarchy, or the one v2 directory).
#[derive(Debug, Clone)]
pub enum Cgroup {
    V1(v1::CgroupV1),
    V2(v2::CgroupV2),
}

impl Cgroup {
    /// Creates `<parent>/<id>` (parents on demand) and applies `limits`.
    /// On error, whatever was created is removed again.
    pub fn create(
        root: &CgroupRoot,
        parent: &str,
        id: &str,
        limits: &Limits,
    ) -> Result<Self, CgroupError> {
        let cg = Self::open(root, parent, id)?;
        let made = match &cg {
            Cgroup::V1(c) => c.create(limits),
            Cgroup::V2(c) => c.create(limits),
        };
        if let Err(e) = made {
            let _ = cg.destroy();
            return Err(e);
        }
        Ok(cg)
    }

    /// A handle on an existing (or not yet created) cgroup, without touching the file system.
    pub fn open(root: &CgroupRoot, parent: &str, id: &str) -> Result<Self, CgroupError> {
        let parent = validate_parent(parent)?;
        if !valid_component(id) {
            return Err(CgroupError::InvalidName(id.to_string()));
        }
        let rel = parent.join(id);
        Ok(match root.version {
            CgroupVersion::V1 => Cgroup::V1(v1::CgroupV1::new(&root.path, &rel)),
            CgroupVersion::V2 => Cgroup::V2(v2::CgroupV2::new(&root.path, &rel)),
        })
    }

    /// Names of the child cgroups under `parent` (the sandboxes of an earlier run, say).
    pub fn list(root: &CgroupRoot, parent: &str) -> Result<Vec<String>, CgroupError> {
        let parent = validate_parent(parent)?;
        match root.version {
            CgroupVersion::V1 => v1::list(&root.path, &parent),
            CgroupVersion::V2 => list_dir(&root.path.join(&parent)),
        }
    }

    /// The `cgroup.procs` files aether must write itself into (one per v1 hierarchy).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        match self {
            Cgroup::V1(c) => c.procs_files(),
            Cgroup::V2(c) => vec![c.procs_file()],
        }
    }

    /// The `cgroup.procs` file of the user cgroup, which every command aether starts joins
    /// (None on a v1 host without a pids hierarchy).
    pub fn user_procs_file(&self) -> Option<PathBuf> {
        match self {
            Cgroup::V1(c) => c.user_procs_file(),
            Cgroup::V2(c) => Some(c.user_procs_file()),
        }
    }

    /// How many processes the memory limit has OOM-killed.
    pub fn oom_kills(&self) -> Result<u64, CgroupError> {
        match self {
            Cgroup::V1(c) => c.oom_kills(),
            Cgroup::V2(c) => c.oom_kills(),
        }
    }

    pub fn memory_usage(&self) -> Result<u64, CgroupError> {
        match self {
            Cgroup::V1(c) => c.memory_usage(),
            Cgroup::V2(c) => c.memory_usage(),
        }
    }

    /// Tasks counted against the pids limit (those of the user cgroup).
    pub fn pids_current(&self) -> Result<u64, CgroupError> {
        match self {
            Cgroup::V1(c) => c.pids_current(),
            Cgroup::V2(c) => c.pids_current(),
        }
    }

    /// Host pids of every process in the cgroup.
    pub fn procs(&self) -> Result<Vec<i32>, CgroupError> {
        match self {
            Cgroup::V1(c) => c.procs(),
            Cgroup::V2(c) => c.procs(),
        }
    }

    pub fn freeze(&self) -> Result<(), CgroupError> {
        match self {
            Cgroup::V1(c) => c.freeze(),
            Cgroup::V2(c) => c.freeze(),
        }
    }

    pub fn thaw(&self) -> Result<(), CgroupError> {
        match self {
            Cgroup::V1(c) => c.thaw(),
            Cgroup::V2(c) => c.thaw(),
        }
    }

    /// SIGKILLs every process in the cgroup (frozen first so none can fork away).
    pub fn kill_all(&self) -> Result<(), CgroupError> {
        match self {
            Cgroup::V1(c) => c.kill_all(),
            Cgroup::V2(c) => c.kill_all(),
        }
    }

    /// Kills everything and removes the cgroup directories (child cgroups first). Succeeds if
    /// they are already gone.
    pub fn destroy(&self) -> Result<(), CgroupError> {
        self.kill_all()?;
        let dirs = match self {
            Cgroup::V1(c) => c.removal_order(),
            Cgroup::V2(c) => c.removal_order(),
        };
        let mut first_err = None;
        for dir in dirs {
            if let Err(e) = rmdir_retry(&dir) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// The cgroup's path below each hierarchy's root (`<parent>/<id>`).
    pub fn rel(&self) -> &Path {
        match self {
            Cgroup::V1(c) => c.rel(),
            Cgroup::V2(c) => c.rel(),
        }
    }

    /// The cgroup's directory in the primary hierarchy (memory for v1).
    pub fn path(&self) -> &Path {
        match self {
            Cgroup::V1(c) => c.primary_dir(),
            Cgroup::V2(c) => c.dir(),
        }
    }
}

/// Names of the subdirectories of `dir` (none if it does not exist).
pub(crate) fn list_dir(dir: &Path) -> Result<Vec<String>, CgroupError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(CgroupError::io("read dir", dir, e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| CgroupError::io("read dir", dir, e))?;
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            if let Some(name) = entry.file_name().to_str() {
                out.push(name.to_string());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Removes a cgroup directory, retrying for a while on EBUSY (dying processes still attached).
fn rmdir_retry(dir: &Path) -> Result<(), CgroupError> {
    let mut delay = Duration::from_millis(2);
    for _ in 0..40 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(delay);
                delay = (delay * 2).min(Duration::from_millis(100));
            }
            Err(e) => return Err(CgroupError::io("remove", dir, e)),
        }
    }
    Err(CgroupError::Busy {
        path: dir.to_path_buf(),
    })
}

// ---- small file helpers shared by both drivers ----

pub(crate) fn write_file(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(path, value).map_err(|e| CgroupError::io("write", path, e))
}

pub(crate) fn read_file(path: &Path) -> Result<String, CgroupError> {
    std::fs::read_to_string(path).map_err(|e| CgroupError::io("read", path, e))
}

pub(crate) fn read_u64(path: &Path) -> Result<u64, CgroupError> {
    let text = read_file(path)?;
    let t = text.trim();
    if t == "max" {
        return Ok(u64::MAX);
    }
    t.parse().map_err(|_| CgroupError::Parse {
        path: path.to_path_buf(),
        what: format!("not a number: {t:?}"),
    })
}

/// Reads `key value` lines (memory.stat, memory.events, memory.oom_control) and returns `key`.
pub(crate) fn read_keyed(path: &Path, key: &str) -> Result<u64, CgroupError> {
    let text = read_file(path)?;
    parse_keyed(&text, key).ok_or_else(|| CgroupError::Parse {
        path: path.to_path_buf(),
        what: format!("no numeric field {key:?}"),
    })
}

pub(crate) fn parse_keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut it = line.split_whitespace();
        (it.next() == Some(key)).then(|| it.next()?.parse().ok())?
    })
}

/// Parses a `cgroup.procs` file: one pid per line.
pub(crate) fn read_pids(path: &Path) -> Result<Vec<i32>, CgroupError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(CgroupError::io("read", path, e)),
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            l.trim().parse().map_err(|_| CgroupError::Parse {
                path: path.to_path_buf(),
                what: format!("bad pid {l:?}"),
            })
        })
        .collect()
}

/// SIGKILLs each pid; a pid that is already gone is fine.
pub(crate) fn kill_pids(pids: &[i32]) -> Result<(), CgroupError> {
    for &pid in pids {
        if pid <= 0 {
            continue;
        }
        // SAFETY: kill(2) takes plain integers; pid > 0 targets exactly one process.
        let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(CgroupError::Io {
                    op: "kill",
                    path: PathBuf::from(format!("pid {pid}")),
                    source: e,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_version_from_root() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(CgroupRoot::detect_at(d.path()).version, CgroupVersion::V1);
        std::fs::write(d.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        assert_eq!(CgroupRoot::detect_at(d.path()).version, CgroupVersion::V2);
    }

    #[test]
    fn quota() {
        assert_eq!(cpu_quota_us(1.0), Some(100_000));
        assert_eq!(cpu_quota_us(0.5), Some(50_000));
        assert_eq!(cpu_quota_us(0.001), Some(1000));
        assert_eq!(cpu_quota_us(0.0), None);
        assert_eq!(cpu_quota_us(f64::NAN), None);
    }

    #[test]
    fn names() {
        assert_eq!(
            validate_parent("dsec/n0").unwrap(),
            PathBuf::from("dsec/n0")
        );
        assert_eq!(
            validate_parent("/dsec/n0/").unwrap(),
            PathBuf::from("dsec/n0")
        );
        assert_eq!(validate_parent("").unwrap(), PathBuf::new());
        assert!(validate_parent("dsec/../etc").is_err());
        assert!(validate_parent("a b").is_err());
        let root = CgroupRoot {
            version: CgroupVersion::V2,
            path: "/x".into(),
        };
        assert!(Cgroup::open(&root, "dsec", "..").is_err());
        assert!(Cgroup::open(&root, "dsec", "a/b").is_err());
    }

    #[test]
    fn keyed_parsing() {
        let oom = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        assert_eq!(parse_keyed(oom, "oom_kill"), Some(3));
        assert_eq!(parse_keyed(oom, "under_oom"), Some(0));
        assert_eq!(parse_keyed(oom, "missing"), None);
        let events = "low 0\nhigh 0\nmax 5\noom 2\noom_kill 2\noom_group_kill 0\n";
        assert_eq!(parse_keyed(events, "oom_kill"), Some(2));
        assert_eq!(parse_keyed(events, "oom"), Some(2));
    }

    #[test]
    fn pids_parsing() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("cgroup.procs");
        std::fs::write(&f, "12\n345\n\n").unwrap();
        assert_eq!(read_pids(&f).unwrap(), vec![12, 345]);
        std::fs::write(&f, "12\nxyz\n").unwrap();
        assert!(read_pids(&f).is_err());
        assert_eq!(
            read_pids(&d.path().join("missing")).unwrap(),
            Vec::<i32>::new()
        );
    }

    #[test]
    fn list_children_of_parent() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("cgroup.controllers"), "memory\n").unwrap();
        let root = CgroupRoot::detect_at(d.path());
        assert!(Cgroup::list(&root, "dsec/n0").unwrap().is_empty());
        std::fs::create_dir_all(d.path().join("dsec/n0/sb-b")).unwrap();
        std::fs::create_dir_all(d.path().join("dsec/n0/sb-a")).unwrap();
        std::fs::write(d.path().join("dsec/n0/cgroup.procs"), "").unwrap();
        assert_eq!(
            Cgroup::list(&root, "dsec/n0").unwrap(),
            vec!["sb-a", "sb-b"]
        );
    }
}
