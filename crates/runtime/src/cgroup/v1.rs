//! cgroup v1: one directory per controller hierarchy (`<root>/<controller>/<parent>/<id>`).
//!
//! Hierarchies that are not mounted on the host are skipped (their limits are not applied).

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{
    kill_pids, read_file, read_keyed, read_pids, read_u64, write_file, CgroupError, Limits,
    AGENT_PIDS_RESERVE, CPU_PERIOD_US, USER_DIR,
};

/// Controllers a sandbox joins, in the order they are created.
pub const CONTROLLERS: [&str; 4] = ["memory", "cpu", "pids", "freezer"];
/// The hierarchy whose directory names the cgroup in messages.
pub const PRIMARY: &str = "memory";

#[derive(Debug, Clone)]
pub struct CgroupV1 {
    /// (controller, directory of this cgroup in that controller's hierarchy), for every
    /// controller whose hierarchy is mounted.
    dirs: Vec<(&'static str, PathBuf)>,
    primary: PathBuf,
    rel: PathBuf,
}

impl CgroupV1 {
    pub fn new(root: &Path, rel: &Path) -> Self {
        let dirs = CONTROLLERS
            .iter()
            .filter(|c| root.join(c).is_dir())
            .map(|c| (*c, root.join(c).join(rel)))
            .collect();
        CgroupV1 {
            dirs,
            primary: root.join(PRIMARY).join(rel),
            rel: rel.to_path_buf(),
        }
    }

    /// `<parent>/<id>`, the same in every hierarchy.
    pub fn rel(&self) -> &Path {
        &self.rel
    }

    /// This cgroup's directory in `controller`'s hierarchy, if that hierarchy is mounted.
    pub fn dir(&self, controller: &str) -> Option<&Path> {
        self.dirs
            .iter()
            .find(|(c, _)| *c == controller)
            .map(|(_, d)| d.as_path())
    }

    pub fn primary_dir(&self) -> &Path {
        &self.primary
    }

    /// Every directory of this cgroup, one per mounted hierarchy.
    pub fn dirs(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|(_, d)| d.clone()).collect()
    }

    /// Every directory to remove, children (the user cgroup) before their parents.
    pub fn removal_order(&self) -> Vec<PathBuf> {
        let mut out: Vec<PathBuf> = self.user_dir().into_iter().collect();
        out.extend(self.dirs());
        out
    }

    /// `<pids>/<parent>/<id>/user`: the user processes' pids cgroup (aether stays in `<id>`).
    fn user_dir(&self) -> Option<PathBuf> {
        self.dir("pids").map(|d| d.join(USER_DIR))
    }

    /// The `cgroup.procs` of the user cgroup, if the pids hierarchy is mounted.
    pub fn user_procs_file(&self) -> Option<PathBuf> {
        self.user_dir().map(|d| d.join("cgroup.procs"))
    }

    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .map(|(_, d)| d.join("cgroup.procs"))
            .collect()
    }

    pub fn create(&self, limits: &Limits) -> Result<(), CgroupError> {
        for (_, dir) in &self.dirs {
            std::fs::create_dir_all(dir).map_err(|e| CgroupError::io("create", dir, e))?;
        }
        if let Some(mem) = self.dir("memory") {
            if limits.memory_bytes > 0 {
                let v = limits.memory_bytes.to_string();
                write_file(&mem.join("memory.limit_in_bytes"), &v)?;
                // memsw exists only with swap accounting; equal to the limit means no swap.
                let memsw = mem.join("memory.memsw.limit_in_bytes");
                if memsw.exists() {
                    write_file(&memsw, &v)?;
                }
            }
        }
        if let Some(cpu) = self.dir("cpu") {
            if let Some(quota) = super::cpu_quota_us(limits.cpu_cores) {
                write_file(&cpu.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                write_file(&cpu.join("cpu.cfs_quota_us"), &quota.to_string())?;
            }
        }
        if let Some(pids) = self.dir("pids") {
            // User processes get their own pids cgroup below the sandbox's, so that a fork bomb
            // exhausts its limit while aether keeps a reserve for its threads.
            let user = pids.join(USER_DIR);
            match std::fs::create_dir(&user) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(CgroupError::io("create", &user, e)),
            }
            if limits.pids > 0 {
                let outer = limits.pids.saturating_add(AGENT_PIDS_RESERVE);
                write_file(&pids.join("pids.max"), &outer.to_string())?;
                write_file(&user.join("pids.max"), &limits.pids.to_string())?;
            }
        }
        Ok(())
    }

    pub fn oom_kills(&self) -> Result<u64, CgroupError> {
        match self.dir("memory") {
            Some(d) => read_keyed(&d.join("memory.oom_control"), "oom_kill"),
            None => Ok(0),
        }
    }

    pub fn memory_usage(&self) -> Result<u64, CgroupError> {
        match self.dir("memory") {
            Some(d) => read_u64(&d.join("memory.usage_in_bytes")),
            None => Ok(0),
        }
    }

    /// Tasks of the user cgroup (what the pids limit applies to); the whole sandbox's when
    /// there is no user cgroup (created by an older version).
    pub fn pids_current(&self) -> Result<u64, CgroupError> {
        match self.dir("pids") {
            Some(d) => {
                let user = d.join(USER_DIR).join("pids.current");
                if user.exists() {
                    read_u64(&user)
                } else {
                    read_u64(&d.join("pids.current"))
                }
            }
            None => Ok(self.procs()?.len() as u64),
        }
    }

    /// Pids in any of the hierarchies (normally they all hold the same set), the user cgroup
    /// included.
    pub fn procs(&self) -> Result<Vec<i32>, CgroupError> {
        let mut all = Vec::new();
        for f in self.procs_files().into_iter().chain(self.user_procs_file()) {
            all.extend(read_pids(&f)?);
        }
        all.sort_unstable();
        all.dedup();
        Ok(all)
    }

    pub fn freeze(&self) -> Result<(), CgroupError> {
        self.set_freezer("FROZEN")
    }

    pub fn thaw(&self) -> Result<(), CgroupError> {
        self.set_freezer("THAWED")
    }

    fn set_freezer(&self, state: &str) -> Result<(), CgroupError> {
        let Some(dir) = self.dir("freezer") else {
            return Err(CgroupError::io(
                "freeze",
                &self.primary,
                io::Error::from(io::ErrorKind::Unsupported),
            ));
        };
        let file = dir.join("freezer.state");
        write_file(&file, state)?;
        // FREEZING turns into FROZEN once every task stopped; wait a little for it.
        let deadline = Instant::now() + Duration::from_secs(2);
        loop {
            if read_file(&file)?.trim() == state {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(CgroupError::Parse {
                    path: file,
                    what: format!("did not reach {state}"),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn kill_all(&self) -> Result<(), CgroupError> {
        if self.dirs.iter().all(|(_, d)| !d.exists()) {
            return Ok(());
        }
        let frozen = self.dir("freezer").is_some_and(|d| d.exists()) && self.freeze().is_ok();
        let killed = self.procs().and_then(|p| kill_pids(&p));
        if frozen {
            // SIGKILL is delivered when the tasks thaw.
            self.thaw()?;
        } else {
            // Without a freezer, a process may fork between read and kill: go round again.
            for _ in 0..10 {
                let pids = self.procs()?;
                if pids.is_empty() {
                    break;
                }
                kill_pids(&pids)?;
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        killed
    }
}

/// Names of the child cgroups under `parent` in any controller hierarchy.
pub fn list(root: &Path, parent: &Path) -> Result<Vec<String>, CgroupError> {
    let mut out = Vec::new();
    for c in CONTROLLERS {
        out.extend(super::list_dir(&root.join(c).join(parent))?);
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// A v1 hierarchy for unit tests: a temporary directory with one folder per controller.
#[cfg(test)]
pub(crate) fn fixture() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for c in CONTROLLERS {
        std::fs::create_dir(d.path().join(c)).unwrap();
    }
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::{Cgroup, CgroupRoot, CgroupVersion};

    #[test]
    fn create_writes_limits() {
        let d = fixture();
        let root = CgroupRoot::detect_at(d.path());
        assert_eq!(root.version, CgroupVersion::V1);
        // memsw present in the fixture: it must be written too.
        let mem = d.path().join("memory/dsec/n0/sb-1");
        std::fs::create_dir_all(&mem).unwrap();
        std::fs::write(mem.join("memory.memsw.limit_in_bytes"), "").unwrap();
        let limits = Limits {
            memory_bytes: 256 << 20,
            cpu_cores: 1.5,
            pids: 64,
        };
        let cg = Cgroup::create(&root, "dsec/n0", "sb-1", &limits).unwrap();
        let rd = |p: &str| std::fs::read_to_string(d.path().join(p)).unwrap();
        assert_eq!(rd("memory/dsec/n0/sb-1/memory.limit_in_bytes"), "268435456");
        assert_eq!(
            rd("memory/dsec/n0/sb-1/memory.memsw.limit_in_bytes"),
            "268435456"
        );
        assert_eq!(rd("cpu/dsec/n0/sb-1/cpu.cfs_period_us"), "100000");
        assert_eq!(rd("cpu/dsec/n0/sb-1/cpu.cfs_quota_us"), "150000");
        // The limit is on the user cgroup; the sandbox's allows aether's reserve on top.
        assert_eq!(rd("pids/dsec/n0/sb-1/pids.max"), "96");
        assert_eq!(rd("pids/dsec/n0/sb-1/user/pids.max"), "64");
        assert_eq!(
            cg.user_procs_file(),
            Some(d.path().join("pids/dsec/n0/sb-1/user/cgroup.procs"))
        );
        // Only the pids hierarchy is split.
        assert!(!d.path().join("memory/dsec/n0/sb-1/user").exists());
        assert!(d.path().join("freezer/dsec/n0/sb-1").is_dir());
        assert_eq!(cg.procs_files().len(), 4);
        assert_eq!(cg.path(), d.path().join("memory/dsec/n0/sb-1"));
    }

    #[test]
    fn reads_counters() {
        let d = fixture();
        let root = CgroupRoot::detect_at(d.path());
        let cg = Cgroup::create(&root, "dsec", "sb-2", &Limits::default()).unwrap();
        let m = d.path().join("memory/dsec/sb-2");
        std::fs::write(
            m.join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n",
        )
        .unwrap();
        std::fs::write(m.join("memory.usage_in_bytes"), "12345\n").unwrap();
        std::fs::write(d.path().join("pids/dsec/sb-2/pids.current"), "7\n").unwrap();
        std::fs::write(m.join("cgroup.procs"), "10\n11\n").unwrap();
        std::fs::write(d.path().join("pids/dsec/sb-2/cgroup.procs"), "11\n").unwrap();
        std::fs::write(d.path().join("pids/dsec/sb-2/user/cgroup.procs"), "12\n").unwrap();
        assert_eq!(cg.oom_kills().unwrap(), 4);
        assert_eq!(cg.memory_usage().unwrap(), 12345);
        // No user pids.current (older layout): the sandbox's count.
        assert_eq!(cg.pids_current().unwrap(), 7);
        std::fs::write(d.path().join("pids/dsec/sb-2/user/pids.current"), "5\n").unwrap();
        assert_eq!(cg.pids_current().unwrap(), 5);
        assert_eq!(cg.procs().unwrap(), vec![10, 11, 12]);
        // No limits given: no limit files written.
        assert!(!m.join("memory.limit_in_bytes").exists());
        assert_eq!(Cgroup::list(&root, "dsec").unwrap(), vec!["sb-2"]);
    }

    #[test]
    fn missing_hierarchies_are_skipped() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("memory")).unwrap();
        let root = CgroupRoot::detect_at(d.path());
        let cg = Cgroup::create(
            &root,
            "dsec",
            "sb-3",
            &Limits {
                memory_bytes: 1 << 20,
                cpu_cores: 1.0,
                pids: 5,
            },
        )
        .unwrap();
        assert_eq!(
            cg.procs_files(),
            vec![d.path().join("memory/dsec/sb-3/cgroup.procs")]
        );
        assert!(!d.path().join("pids").exists());
        assert_eq!(cg.user_procs_file(), None);
    }

    #[test]
    fn removal_order_children_first() {
        let d = fixture();
        let root = CgroupRoot::detect_at(d.path());
        let Cgroup::V1(cg) = Cgroup::open(&root, "dsec", "sb-4").unwrap() else {
            panic!("v1 expected");
        };
        let order = cg.removal_order();
        assert_eq!(order[0], d.path().join("pids/dsec/sb-4/user"));
        assert_eq!(order.len(), 5);
        assert!(order.contains(&d.path().join("pids/dsec/sb-4")));
    }
}
