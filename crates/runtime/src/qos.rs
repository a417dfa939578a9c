//! Applies a sandbox's QoS class to its processes and cgroup, right after the substrate started
//! its agent and before any user command runs (children inherit the policy and the cookie).
//! A container's best-effort agent already starts SCHED_IDLE (its spawn child sets policy and
//! RLIMIT_NICE before exec, see [`crate::container::SchedClass`]); the scheduler pass here is
//! then a check that counts every task it found not idle ([`QosApplied::not_idle_before`]), and
//! the one mechanism for substrates that cannot start idle (a VM's process).
//!
//! * best-effort: every thread of the agent gets SCHED_IDLE; `RLIMIT_NICE` is set to 0/0 so
//!   nothing inside can switch back to SCHED_OTHER (that needs the nice range of RLIMIT_NICE or
//!   CAP_SYS_NICE, and sandboxes keep neither CAP_SYS_NICE nor CAP_SYS_RESOURCE); the cgroup
//!   gets the lowest CPU weight and, where the kernel has it, `cpu.idle` = 1
//!   ([`Cgroup::set_cpu_priority`]).
//! * latency-sensitive: default weight, and a core-scheduling cookie for the agent's thread
//!   group where the kernel supports it (children inherit it), so that no task of another
//!   cookie runs on the sibling hardware thread.

use dsec_wire::api::QosClass;

use crate::cgroup::qos::CpuPriority;
use crate::cgroup::{Cgroup, CgroupError};

/// `prctl` option and sub-commands of core scheduling (linux/prctl.h; not in every libc).
pub const PR_SCHED_CORE: libc::c_int = 62;
pub const PR_SCHED_CORE_GET: libc::c_ulong = 0;
pub const PR_SCHED_CORE_CREATE: libc::c_ulong = 1;
/// `PIDTYPE_TGID` of `enum pid_type`: the cookie covers the whole thread group.
pub const PIDTYPE_TGID: libc::c_ulong = 1;

/// `errno` name for the few values the QoS calls and probes can see.
pub fn errno_name(e: i32) -> String {
    match e {
        libc::EINVAL => "EINVAL".into(),
        libc::ENODEV => "ENODEV".into(),
        libc::EPERM => "EPERM".into(),
        libc::ENOSYS => "ENOSYS".into(),
        libc::ESRCH => "ESRCH".into(),
        libc::EOPNOTSUPP => "EOPNOTSUPP".into(),
        other => format!("errno {other}"),
    }
}

/// What to apply: the class and the node's QoS settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QosSettings {
    pub class: QosClass,
    /// Best-effort cgroups also get `cpu.idle` = 1 where the kernel has it.
    pub best_effort_cgroup_idle: bool,
    /// Latency-sensitive sandboxes get a core-scheduling cookie (only where the kernel has
    /// core scheduling: the caller checks).
    pub core_cookie: bool,
}

/// Why a class could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum ApplyQosError {
    #[error("sched_setscheduler(SCHED_IDLE) on task {tid}: {errno}")]
    Sched { tid: i32, errno: String },
    #[error("prlimit(RLIMIT_NICE) on pid {pid}: {errno}")]
    Rlimit { pid: i32, errno: String },
    #[error("cgroup cpu priority: {0}")]
    Cgroup(#[from] CgroupError),
    #[error("core-scheduling cookie for pid {pid}: {errno}")]
    CoreSched { pid: i32, errno: String },
}

/// What [`apply`] did (logged, and tested from the outside).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QosApplied {
    pub sched_idle_tasks: usize,
    /// Processes of a best-effort sandbox (the agent included) the pass found not SCHED_IDLE
    /// before it set them: 0 when the substrate started the agent idle.
    pub not_idle_before: usize,
    pub cgroup: Option<String>,
    pub core_cookie: bool,
}

/// Threads of process `pid` (`/proc/<pid>/task`).
fn threads(pid: i32) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

fn last_errno() -> String {
    errno_name(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
}

/// Whether task `tid` is SCHED_IDLE now (`None`: it is gone).
fn is_idle(tid: i32) -> Option<bool> {
    // SAFETY: sched_getscheduler takes a plain tid.
    let p = unsafe { libc::sched_getscheduler(tid) };
    (p >= 0).then_some(p & !libc::SCHED_RESET_ON_FORK == libc::SCHED_IDLE)
}

/// Sets SCHED_IDLE on every thread of `pid` and pins its RLIMIT_NICE to 0.
pub fn sched_idle(pid: i32) -> Result<usize, ApplyQosError> {
    let mut n = 0;
    for tid in threads(pid) {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: sched_setscheduler takes a tid and a pointer to a live local.
        let rc = unsafe { libc::sched_setscheduler(tid, libc::SCHED_IDLE, &param) };
        if rc != 0 {
            let errno = last_errno();
            if errno == "ESRCH" {
                continue; // the thread exited meanwhile
            }
            return Err(ApplyQosError::Sched { tid, errno });
        }
        n += 1;
    }
    let zero = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit reads `zero` (a live local) and writes nothing (old limit pointer null).
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NICE, &zero, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(ApplyQosError::Rlimit {
            pid,
            errno: last_errno(),
        });
    }
    Ok(n)
}

/// Gives `pid`'s thread group a new core-scheduling cookie.
pub fn core_cookie(pid: i32) -> Result<(), ApplyQosError> {
    // SAFETY: PR_SCHED_CORE_CREATE takes plain integers (pid, pid type, 0).
    let rc = unsafe {
        libc::prctl(
            PR_SCHED_CORE,
            PR_SCHED_CORE_CREATE,
            pid as libc::c_ulong,
            PIDTYPE_TGID,
            0 as libc::c_ulong,
        )
    };
    if rc != 0 {
        return Err(ApplyQosError::CoreSched {
            pid,
            errno: last_errno(),
        });
    }
    Ok(())
}

/// Applies `s.class` to the sandbox whose agent is host process `pid` and whose processes
/// live in `cgroup` (None for a sandbox without a host cgroup of its own, a VM: the scheduler
/// part only, on `pid`).
pub fn apply(
    pid: i32,
    cgroup: Option<&Cgroup>,
    s: &QosSettings,
) -> Result<QosApplied, ApplyQosError> {
    let cg = cgroup.filter(|c| c.path().is_dir());
    let mut out = QosApplied::default();
    match s.class {
        QosClass::BestEffort => {
            if let Some(cg) = cg {
                let a = cg.set_cpu_priority(CpuPriority::Lowest {
                    idle: s.best_effort_cgroup_idle,
                })?;
                out.cgroup = Some(match a.idle {
                    Some(i) => format!("{} cpu.idle={}", a.weight, u8::from(i)),
                    None => a.weight,
                });
            }
            // The agent first: whatever it forks from now on inherits SCHED_IDLE and the
            // RLIMIT_NICE of 0. Then what it forked before — its `default` shell is started
            // while the edge answers the create — from the sandbox's cgroup, twice: a fork in
            // flight during the first pass (its policy copied from the agent before the agent
            // was set, the child not yet listed) is listed by the second.
            if pid > 1 {
                if is_idle(pid) == Some(false) {
                    out.not_idle_before += 1;
                }
                out.sched_idle_tasks += sched_idle(pid)?;
            }
            let mut done = vec![pid];
            for pass in 0..2 {
                if pass > 0 {
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
                let pids: Vec<i32> = cg.and_then(|c| c.procs().ok()).unwrap_or_default();
                for p in pids {
                    if p <= 1 || done.contains(&p) {
                        continue;
                    }
                    done.push(p);
                    if is_idle(p) == Some(false) {
                        out.not_idle_before += 1;
                    }
                    match sched_idle(p) {
                        Ok(n) => out.sched_idle_tasks += n,
                        // A process of the sandbox that exited meanwhile.
                        Err(ApplyQosError::Rlimit { errno, .. }) if errno == "ESRCH" => {}
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        QosClass::LatencySensitive => {
            if let Some(cg) = cg {
                out.cgroup = Some(cg.set_cpu_priority(CpuPriority::Normal)?.weight);
            }
            if s.core_cookie && pid > 1 {
                core_cookie(pid)?;
                out.core_cookie = true;
            }
        }
    }
    tracing::debug!(pid, class = ?s.class, applied = ?out, "QoS class applied");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs CAP_SYS_NICE to undo nothing: a child process is made SCHED_IDLE and checked.
    #[test]
    fn sched_idle_on_a_child_process() {
        let mut child = match std::process::Command::new("sleep").arg("5").spawn() {
            Ok(c) => c,
            Err(e) => {
                println!("skipped: cannot spawn sleep: {e}");
                return;
            }
        };
        let pid = child.id() as i32;
        let r = sched_idle(pid);
        let policy = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                let after = s.rsplit_once(')')?.1.to_string();
                after.split_whitespace().nth(38).map(str::to_string)
            });
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap_or_default();
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(r.unwrap(), 1);
        // Field 41 of /proc/<pid>/stat (the 39th after the command) is the policy: 5 = IDLE.
        assert_eq!(policy.as_deref(), Some("5"));
        let nice = limits
            .lines()
            .find(|l| l.starts_with("Max nice priority"))
            .unwrap_or("");
        assert_eq!(
            nice.split_whitespace().collect::<Vec<_>>()[3..5],
            ["0", "0"]
        );
    }
}
