//! CPU QoS knobs and usage counters of a sandbox's cgroup (issue 10).
//!
//! * [`Cgroup::set_cpu_priority`]: `Lowest` is v1 `cpu.shares` = 2 (then `cpu.idle` = 1 where
//!   the v1 cpu controller has it — the kernel then pins the weight to 3, `WEIGHT_IDLEPRIO`),
//!   v2 `cpu.weight` = 1 then `cpu.idle` = 1; `Normal` is `cpu.shares` = 1024 / `cpu.weight` =
//!   100 with `cpu.idle` = 0. The weight is written before `cpu.idle`: the kernel refuses a
//!   weight change of an idle group (EINVAL).
//! * the working set, the figure admission counts, is in [`super::memory`].
//! * [`Cgroup::cpu_usage_ns`]: CPU time consumed. v2 reads `cpu.stat` `usage_usec`; the v1 cpu
//!   controller has no usage counter (cpuacct is a separate hierarchy sandboxes do not join), so
//!   v1 sums `/proc/<tid>/schedstat` over the live tasks of the cgroup (time of exited tasks is
//!   lost: callers clamp negative deltas).

use std::path::Path;

use super::{read_file, read_keyed, read_u64, write_file, Cgroup, CgroupError};

/// CPU priority of a sandbox's cgroup among its siblings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuPriority {
    /// Default weight (latency-sensitive).
    Normal,
    /// Lowest weight and, when `idle` is true and the kernel has it, a SCHED_IDLE group.
    Lowest { idle: bool },
}

/// What [`Cgroup::set_cpu_priority`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuPriorityApplied {
    /// `cpu.shares=2` or `cpu.weight=1`, ...
    pub weight: String,
    /// `Some(v)` when `cpu.idle` was written with `v`; `None` when the file does not exist.
    pub idle: Option<bool>,
}

/// v1 `cpu.shares` of a best-effort sandbox.
pub const V1_SHARES_LOWEST: u64 = 2;
/// v1 default `cpu.shares`.
pub const V1_SHARES_NORMAL: u64 = 1024;
/// v2 `cpu.weight` of a best-effort sandbox.
pub const V2_WEIGHT_LOWEST: u64 = 1;
/// v2 default `cpu.weight`.
pub const V2_WEIGHT_NORMAL: u64 = 100;

impl Cgroup {
    /// Sets the CPU weight (and `cpu.idle` where present) of the sandbox's cgroup.
    pub fn set_cpu_priority(&self, p: CpuPriority) -> Result<CpuPriorityApplied, CgroupError> {
        let (dir, weight_file, lowest, normal) = match self {
            Cgroup::V1(c) => match c.dir("cpu") {
                Some(d) => (d, "cpu.shares", V1_SHARES_LOWEST, V1_SHARES_NORMAL),
                None => {
                    return Err(CgroupError::io(
                        "set cpu priority",
                        c.primary_dir(),
                        std::io::Error::new(
                            std::io::ErrorKind::Unsupported,
                            "the v1 cpu hierarchy is not mounted",
                        ),
                    ))
                }
            },
            Cgroup::V2(c) => (c.dir(), "cpu.weight", V2_WEIGHT_LOWEST, V2_WEIGHT_NORMAL),
        };
        let idle_file = dir.join("cpu.idle");
        let has_idle = idle_file.exists();
        let (weight, idle) = match p {
            CpuPriority::Normal => (normal, has_idle.then_some(false)),
            CpuPriority::Lowest { idle } => (lowest, (has_idle && idle).then_some(true)),
        };
        // An idle group refuses weight changes: leave idle first, set the weight, then idle.
        if has_idle && read_u64(&idle_file).unwrap_or(0) != 0 {
            write_file(&idle_file, "0")?;
        }
        write_file(&dir.join(weight_file), &weight.to_string())?;
        if idle == Some(true) {
            write_file(&idle_file, "1")?;
        }
        Ok(CpuPriorityApplied {
            weight: format!("{weight_file}={weight}"),
            idle,
        })
    }

    /// CPU time the sandbox consumed, in nanoseconds (see the module docs for v1).
    pub fn cpu_usage_ns(&self) -> Result<u64, CgroupError> {
        match self {
            Cgroup::V2(c) => Ok(read_keyed(&c.dir().join("cpu.stat"), "usage_usec")? * 1000),
            Cgroup::V1(c) => {
                let Some(dir) = c.dir("cpu") else {
                    return Ok(0);
                };
                Ok(sum_schedstat(&dir.join("tasks"), Path::new("/proc")))
            }
        }
    }
}

/// Sums the first field (ns on the CPU) of `<proc>/<tid>/schedstat` over the tids in `tasks`.
/// Tasks that exit meanwhile are skipped.
fn sum_schedstat(tasks: &Path, proc: &Path) -> u64 {
    let Ok(text) = read_file(tasks) else {
        return 0;
    };
    text.lines()
        .filter_map(|l| l.trim().parse::<u32>().ok())
        .filter_map(|tid| {
            std::fs::read_to_string(proc.join(tid.to_string()).join("schedstat")).ok()
        })
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::{CgroupRoot, Limits};

    fn rd(p: &Path) -> String {
        std::fs::read_to_string(p).unwrap()
    }

    #[test]
    fn v1_shares_and_idle() {
        let d = crate::cgroup::v1::fixture();
        let root = CgroupRoot::detect_at(d.path());
        let cg = Cgroup::create(&root, "dsec/n0", "sb-1", &Limits::default()).unwrap();
        let cpu = d.path().join("cpu/dsec/n0/sb-1");
        // No cpu.idle (older kernel): shares only.
        let a = cg
            .set_cpu_priority(CpuPriority::Lowest { idle: true })
            .unwrap();
        assert_eq!(a.weight, "cpu.shares=2");
        assert_eq!(a.idle, None);
        assert_eq!(rd(&cpu.join("cpu.shares")), "2");
        assert!(!cpu.join("cpu.idle").exists());
        // With cpu.idle: weight first, then idle.
        std::fs::write(cpu.join("cpu.idle"), "0\n").unwrap();
        let a = cg
            .set_cpu_priority(CpuPriority::Lowest { idle: true })
            .unwrap();
        assert_eq!(a.idle, Some(true));
        assert_eq!(rd(&cpu.join("cpu.idle")), "1");
        // Not idle when asked not to be.
        std::fs::write(cpu.join("cpu.idle"), "0\n").unwrap();
        let a = cg
            .set_cpu_priority(CpuPriority::Lowest { idle: false })
            .unwrap();
        assert_eq!((a.idle, rd(&cpu.join("cpu.idle"))), (None, "0\n".into()));
        // Back to normal: idle cleared, default shares.
        std::fs::write(cpu.join("cpu.idle"), "1\n").unwrap();
        let a = cg.set_cpu_priority(CpuPriority::Normal).unwrap();
        assert_eq!(a.weight, "cpu.shares=1024");
        assert_eq!(a.idle, Some(false));
        assert_eq!(rd(&cpu.join("cpu.idle")), "0");
        assert_eq!(rd(&cpu.join("cpu.shares")), "1024");
    }

    #[test]
    fn v1_without_cpu_hierarchy_is_an_error() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("memory")).unwrap();
        let root = CgroupRoot::detect_at(d.path());
        let cg = Cgroup::create(&root, "dsec", "sb-2", &Limits::default()).unwrap();
        assert!(cg.set_cpu_priority(CpuPriority::Normal).is_err());
    }

    #[test]
    fn v2_weight_and_idle() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("cgroup.controllers"), "cpu memory pids\n").unwrap();
        let root = CgroupRoot::detect_at(d.path());
        let cg = Cgroup::create(&root, "dsec/n0", "sb-3", &Limits::default()).unwrap();
        let leaf = d.path().join("dsec/n0/sb-3");
        std::fs::write(leaf.join("cpu.weight"), "100\n").unwrap();
        std::fs::write(leaf.join("cpu.idle"), "0\n").unwrap();
        let a = cg
            .set_cpu_priority(CpuPriority::Lowest { idle: true })
            .unwrap();
        assert_eq!(a.weight, "cpu.weight=1");
        assert_eq!(a.idle, Some(true));
        assert_eq!(rd(&leaf.join("cpu.weight")), "1");
        assert_eq!(rd(&leaf.join("cpu.idle")), "1");
        let a = cg.set_cpu_priority(CpuPriority::Normal).unwrap();
        assert_eq!(a.weight, "cpu.weight=100");
        assert_eq!(rd(&leaf.join("cpu.weight")), "100");
        assert_eq!(rd(&leaf.join("cpu.idle")), "0");
        // A kernel without cpu.idle (before 5.15): weight only.
        std::fs::remove_file(leaf.join("cpu.idle")).unwrap();
        let a = cg
            .set_cpu_priority(CpuPriority::Lowest { idle: true })
            .unwrap();
        assert_eq!(a.idle, None);
        assert_eq!(rd(&leaf.join("cpu.weight")), "1");
    }

    #[test]
    fn usage_counters() {
        // v2: memory.current - inactive_file, cpu.stat usage_usec.
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("cgroup.controllers"), "").unwrap();
        let root = CgroupRoot::detect_at(d.path());
        let cg = Cgroup::create(&root, "p", "sb-4", &Limits::default()).unwrap();
        let leaf = d.path().join("p/sb-4");
        std::fs::write(leaf.join("memory.current"), "10000\n").unwrap();
        std::fs::write(
            leaf.join("memory.stat"),
            "anon 6000\nfile 4000\nactive_file 1000\ninactive_file 3000\n",
        )
        .unwrap();
        std::fs::write(
            leaf.join("cpu.stat"),
            "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n",
        )
        .unwrap();
        assert_eq!(cg.memory_working_set().unwrap(), 7000);
        assert_eq!(cg.cpu_usage_ns().unwrap(), 1_500_000);
        // v1: usage_in_bytes - total_inactive_file.
        let d = crate::cgroup::v1::fixture();
        let root = CgroupRoot::detect_at(d.path());
        let cg = Cgroup::create(&root, "p", "sb-5", &Limits::default()).unwrap();
        let mem = d.path().join("memory/p/sb-5");
        std::fs::write(mem.join("memory.usage_in_bytes"), "9000\n").unwrap();
        std::fs::write(
            mem.join("memory.stat"),
            "inactive_file 1\ntotal_inactive_file 2000\n",
        )
        .unwrap();
        assert_eq!(cg.memory_working_set().unwrap(), 7000);
    }

    #[test]
    fn schedstat_sum() {
        let d = tempfile::tempdir().unwrap();
        let proc = d.path().join("proc");
        for (tid, s) in [(10, "500 7 3\n"), (11, "250 1 1\n")] {
            std::fs::create_dir_all(proc.join(tid.to_string())).unwrap();
            std::fs::write(proc.join(tid.to_string()).join("schedstat"), s).unwrap();
        }
        let tasks = d.path().join("tasks");
        // 12 exited meanwhile: skipped.
        std::fs::write(&tasks, "10\n11\n12\n").unwrap();
        assert_eq!(sum_schedstat(&tasks, &proc), 750);
        assert_eq!(sum_schedstat(&d.path().join("missing"), &proc), 0);
    }
}
