//! cgroup v2: the unified hierarchy (`<root>/<parent>/<id>`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{
    kill_pids, read_file, read_keyed, read_pids, read_u64, write_file, CgroupError, Limits,
    CPU_PERIOD_US,
};

/// Controllers enabled for the sandboxes' parents (those the host offers).
pub const CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];

#[derive(Debug, Clone)]
pub struct CgroupV2 {
    root: PathBuf,
    rel: PathBuf,
    dir: PathBuf,
}

impl CgroupV2 {
    pub fn new(root: &Path, rel: &Path) -> Self {
        CgroupV2 {
            root: root.to_path_buf(),
            rel: rel.to_path_buf(),
            dir: root.join(rel),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    /// Creates every missing ancestor, delegates the controllers down to the sandbox's
    /// directory, creates it and writes the limits.
    pub fn create(&self, limits: &Limits) -> Result<(), CgroupError> {
        let mut cur = self.root.clone();
        for comp in self.rel.components() {
            enable_controllers(&cur);
            cur.push(comp);
            match std::fs::create_dir(&cur) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(CgroupError::io("create", &cur, e)),
            }
        }
        if limits.memory_bytes > 0 {
            write_file(
                &self.dir.join("memory.max"),
                &limits.memory_bytes.to_string(),
            )?;
            let swap = self.dir.join("memory.swap.max");
            if swap.exists() {
                write_file(&swap, "0")?;
            }
        }
        if let Some(quota) = super::cpu_quota_us(limits.cpu_cores) {
            write_file(
                &self.dir.join("cpu.max"),
                &format!("{quota} {CPU_PERIOD_US}"),
            )?;
        }
        if limits.pids > 0 {
            write_file(&self.dir.join("pids.max"), &limits.pids.to_string())?;
        }
        Ok(())
    }

    pub fn oom_kills(&self) -> Result<u64, CgroupError> {
        read_keyed(&self.dir.join("memory.events"), "oom_kill")
    }

    pub fn memory_usage(&self) -> Result<u64, CgroupError> {
        read_u64(&self.dir.join("memory.current"))
    }

    pub fn pids_current(&self) -> Result<u64, CgroupError> {
        read_u64(&self.dir.join("pids.current"))
    }

    pub fn procs(&self) -> Result<Vec<i32>, CgroupError> {
        read_pids(&self.procs_file())
    }

    pub fn freeze(&self) -> Result<(), CgroupError> {
        self.set_frozen(true)
    }

    pub fn thaw(&self) -> Result<(), CgroupError> {
        self.set_frozen(false)
    }

    fn set_frozen(&self, frozen: bool) -> Result<(), CgroupError> {
        write_file(
            &self.dir.join("cgroup.freeze"),
            if frozen { "1" } else { "0" },
        )?;
        let events = self.dir.join("cgroup.events");
        let want = u64::from(frozen);
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            if super::parse_keyed(&read_file(&events)?, "frozen") == Some(want) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(CgroupError::Parse {
                    path: events,
                    what: format!("frozen did not become {want}"),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn kill_all(&self) -> Result<(), CgroupError> {
        if !self.dir.exists() {
            return Ok(());
        }
        let kill = self.dir.join("cgroup.kill");
        if kill.exists() {
            return write_file(&kill, "1");
        }
        // Kernels before 5.14: freeze, kill, thaw.
        let frozen = self.freeze().is_ok();
        let killed = self.procs().and_then(|p| kill_pids(&p));
        if frozen {
            self.thaw()?;
        }
        killed
    }
}

/// Enables [`CONTROLLERS`] (those offered in `cgroup.controllers`) in `dir`'s subtree_control.
/// Best effort: a controller the host does not delegate is simply not limited.
fn enable_controllers(dir: &Path) {
    let Ok(offered) = std::fs::read_to_string(dir.join("cgroup.controllers")) else {
        return;
    };
    let enabled = std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
    for c in CONTROLLERS {
        let on = |text: &str| text.split_whitespace().any(|w| w == c);
        if on(&offered) && !on(&enabled) {
            if let Err(e) = std::fs::write(dir.join("cgroup.subtree_control"), format!("+{c}")) {
                tracing::warn!(dir = %dir.display(), controller = c, error = %e, "enable cgroup controller");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::{Cgroup, CgroupRoot, CgroupVersion};

    #[test]
    fn create_delegates_and_writes_limits() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join("cgroup.controllers"),
            "cpuset cpu io memory pids\n",
        )
        .unwrap();
        std::fs::write(d.path().join("cgroup.subtree_control"), "").unwrap();
        let root = CgroupRoot::detect_at(d.path());
        assert_eq!(root.version, CgroupVersion::V2);
        // The intermediate dir offers only memory.
        std::fs::create_dir_all(d.path().join("dsec")).unwrap();
        std::fs::write(d.path().join("dsec/cgroup.controllers"), "memory\n").unwrap();
        let leaf = d.path().join("dsec/n0/sb-1");
        std::fs::create_dir_all(&leaf).unwrap();
        std::fs::write(leaf.join("memory.swap.max"), "max\n").unwrap();
        let limits = Limits {
            memory_bytes: 1 << 30,
            cpu_cores: 2.0,
            pids: 100,
        };
        let cg = Cgroup::create(&root, "dsec/n0", "sb-1", &limits).unwrap();
        let rd = |p: &str| std::fs::read_to_string(d.path().join(p)).unwrap();
        // A plain file keeps only the last write: the last offered controller.
        assert_eq!(rd("cgroup.subtree_control"), "+pids");
        assert_eq!(rd("dsec/cgroup.subtree_control"), "+memory");
        assert_eq!(rd("dsec/n0/sb-1/memory.max"), "1073741824");
        assert_eq!(rd("dsec/n0/sb-1/memory.swap.max"), "0");
        assert_eq!(rd("dsec/n0/sb-1/cpu.max"), "200000 100000");
        assert_eq!(rd("dsec/n0/sb-1/pids.max"), "100");
        assert_eq!(cg.procs_files(), vec![leaf.join("cgroup.procs")]);
    }

    #[test]
    fn reads_counters() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("cgroup.controllers"), "").unwrap();
        let root = CgroupRoot::detect_at(d.path());
        let cg = Cgroup::create(&root, "p", "sb-2", &Limits::default()).unwrap();
        let leaf = d.path().join("p/sb-2");
        std::fs::write(
            leaf.join("memory.events"),
            "low 0\nhigh 0\nmax 9\noom 3\noom_kill 2\n",
        )
        .unwrap();
        std::fs::write(leaf.join("memory.current"), "4096\n").unwrap();
        std::fs::write(leaf.join("pids.current"), "3\n").unwrap();
        std::fs::write(leaf.join("cgroup.procs"), "5\n6\n").unwrap();
        assert_eq!(cg.oom_kills().unwrap(), 2);
        assert_eq!(cg.memory_usage().unwrap(), 4096);
        assert_eq!(cg.pids_current().unwrap(), 3);
        assert_eq!(cg.procs().unwrap(), vec![5, 6]);
        assert!(!leaf.join("memory.max").exists());
        // cgroup.kill present: kill_all writes it.
        std::fs::write(leaf.join("cgroup.kill"), "").unwrap();
        cg.kill_all().unwrap();
        assert_eq!(
            std::fs::read_to_string(leaf.join("cgroup.kill")).unwrap(),
            "1"
        );
        // freeze waits for cgroup.events to report it.
        std::fs::write(leaf.join("cgroup.events"), "populated 1\nfrozen 1\n").unwrap();
        cg.freeze().unwrap();
        assert_eq!(
            std::fs::read_to_string(leaf.join("cgroup.freeze")).unwrap(),
            "1"
        );
    }
}
