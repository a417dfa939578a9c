//! cgroup v2: the unified hierarchy (`<root>/<parent>/<id>`).
//!
//! Processes may only live in leaves, so the sandbox's directory has two children: `agent`
//! (aether) and `user` (every command). Memory and CPU limits are on `<id>`; pids.max on `user`
//! is the limit, on `<id>` the limit plus [`AGENT_PIDS_RESERVE`].

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{
    kill_pids, read_file, read_keyed, read_pids, read_u64, write_file, CgroupError, Limits,
    AGENT_DIR, AGENT_PIDS_RESERVE, CPU_PERIOD_US, USER_DIR,
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

    /// `<parent>/<id>` below the root.
    pub fn rel(&self) -> &Path {
        &self.rel
    }

    /// The `cgroup.procs` aether joins (`<id>/agent`).
    pub fn procs_file(&self) -> PathBuf {
        self.dir.join(AGENT_DIR).join("cgroup.procs")
    }

    /// The `cgroup.procs` every command joins (`<id>/user`).
    pub fn user_procs_file(&self) -> PathBuf {
        self.dir.join(USER_DIR).join("cgroup.procs")
    }

    /// Directories to remove, children first.
    pub fn removal_order(&self) -> Vec<PathBuf> {
        vec![
            self.dir.join(USER_DIR),
            self.dir.join(AGENT_DIR),
            self.dir.clone(),
        ]
    }

    /// Creates every missing ancestor, delegates the controllers down to the sandbox's
    /// directory, creates it and writes the limits.
    pub fn create(&self, limits: &Limits) -> Result<(), CgroupError> {
        let mut cur = self.root.clone();
        for comp in self.rel.components() {
            enable_controllers(&cur, &CONTROLLERS);
            cur.push(comp);
            mkdir(&cur)?;
        }
        // Only pids is split between the children; memory and cpu stay on the sandbox's dir.
        enable_controllers(&self.dir, &["pids"]);
        let user = self.dir.join(USER_DIR);
        mkdir(&self.dir.join(AGENT_DIR))?;
        mkdir(&user)?;
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
            let outer = limits.pids.saturating_add(AGENT_PIDS_RESERVE);
            write_file(&self.dir.join("pids.max"), &outer.to_string())?;
            write_file(&user.join("pids.max"), &limits.pids.to_string())?;
        }
        Ok(())
    }

    pub fn oom_kills(&self) -> Result<u64, CgroupError> {
        read_keyed(&self.dir.join("memory.events"), "oom_kill")
    }

    pub fn memory_usage(&self) -> Result<u64, CgroupError> {
        read_u64(&self.dir.join("memory.current"))
    }

    /// Tasks of the user cgroup (the whole sandbox's if there is none).
    pub fn pids_current(&self) -> Result<u64, CgroupError> {
        let user = self.dir.join(USER_DIR).join("pids.current");
        if user.exists() {
            read_u64(&user)
        } else {
            read_u64(&self.dir.join("pids.current"))
        }
    }

    /// Every process of the sandbox: its own dir's and both children's.
    pub fn procs(&self) -> Result<Vec<i32>, CgroupError> {
        let mut all = read_pids(&self.dir.join("cgroup.procs"))?;
        all.extend(read_pids(&self.procs_file())?);
        all.extend(read_pids(&self.user_procs_file())?);
        all.sort_unstable();
        all.dedup();
        Ok(all)
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

fn mkdir(dir: &Path) -> Result<(), CgroupError> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(CgroupError::io("create", dir, e)),
    }
}

/// Enables `controllers` (those offered in `cgroup.controllers`) in `dir`'s subtree_control.
/// Best effort: a controller the host does not delegate is simply not limited.
fn enable_controllers(dir: &Path, controllers: &[&str]) {
    let Ok(offered) = std::fs::read_to_string(dir.join("cgroup.controllers")) else {
        return;
    };
    let enabled = std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
    for &c in controllers {
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
        // The pids limit is on the user cgroup; the sandbox's allows aether's reserve on top.
        assert_eq!(rd("dsec/n0/sb-1/pids.max"), "132");
        assert_eq!(rd("dsec/n0/sb-1/user/pids.max"), "100");
        assert!(!leaf.join("agent/pids.max").exists());
        assert!(!leaf.join("user/memory.max").exists());
        // aether joins agent, commands join user.
        assert_eq!(cg.procs_files(), vec![leaf.join("agent/cgroup.procs")]);
        assert_eq!(cg.user_procs_file(), Some(leaf.join("user/cgroup.procs")));
    }

    #[test]
    fn enables_pids_for_the_children() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        let leaf = d.path().join("p/sb-4");
        std::fs::create_dir_all(&leaf).unwrap();
        // What the parent delegated to the sandbox's dir.
        std::fs::write(leaf.join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        let root = CgroupRoot::detect_at(d.path());
        Cgroup::create(&root, "p", "sb-4", &Limits::default()).unwrap();
        // Only pids is delegated further down.
        assert_eq!(
            std::fs::read_to_string(leaf.join("cgroup.subtree_control")).unwrap(),
            "+pids"
        );
        assert!(leaf.join("agent").is_dir() && leaf.join("user").is_dir());
        // No limit: nothing written.
        assert!(!leaf.join("user/pids.max").exists());
    }

    #[test]
    fn removal_order_children_first() {
        let cg = CgroupV2::new(Path::new("/cg"), Path::new("p/sb-5"));
        let order: Vec<PathBuf> = cg.removal_order();
        assert_eq!(
            order,
            vec![
                PathBuf::from("/cg/p/sb-5/user"),
                PathBuf::from("/cg/p/sb-5/agent"),
                PathBuf::from("/cg/p/sb-5"),
            ]
        );
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
        std::fs::write(leaf.join("agent/cgroup.procs"), "5\n").unwrap();
        std::fs::write(leaf.join("user/cgroup.procs"), "6\n7\n").unwrap();
        assert_eq!(cg.oom_kills().unwrap(), 2);
        assert_eq!(cg.memory_usage().unwrap(), 4096);
        // Without a user pids.current (older layout) the sandbox's count is reported.
        assert_eq!(cg.pids_current().unwrap(), 3);
        std::fs::write(leaf.join("user/pids.current"), "2\n").unwrap();
        assert_eq!(cg.pids_current().unwrap(), 2);
        assert_eq!(cg.procs().unwrap(), vec![5, 6, 7]);
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
