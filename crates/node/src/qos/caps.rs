//! Kernel capabilities for QoS and reclaim, detected once at edge start.
//!
//! A missing feature is reported (with what was seen, e.g. `EINVAL`), never fatal: production
//! hosts have SMT and cgroup v2, this development host has neither, and the same code runs on
//! both. The reclaim side reads [`Caps::psi`], [`Caps::damon`], [`Caps::zram`], [`Caps::ksm`].

use std::path::Path;

use dsec_wire::api::{Capability, NodeCapabilities};

use dsec_runtime::qos::{errno_name, PR_SCHED_CORE, PR_SCHED_CORE_GET};

/// What the edge found at start: the wire's [`NodeCapabilities`] (the node status shows it
/// as it is), with the probes that fill it in. Derefs to the fields.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Caps(pub NodeCapabilities);

impl std::ops::Deref for Caps {
    type Target = NodeCapabilities;
    fn deref(&self) -> &NodeCapabilities {
        &self.0
    }
}

fn yes(detail: impl Into<String>) -> Capability {
    Capability {
        available: true,
        detail: detail.into(),
    }
}

fn no(detail: impl Into<String>) -> Capability {
    Capability {
        available: false,
        detail: detail.into(),
    }
}

impl Caps {
    /// Probes the running kernel.
    pub fn detect() -> Caps {
        let root = dsec_runtime::cgroup::CgroupRoot::detect();
        Caps::detect_at(
            Path::new("/"),
            &root,
            probe_core_sched(),
            probe_sched_idle(),
        )
    }

    /// Probes file-system evidence under `sys_root` (`/` on a host; a fixture in tests); the
    /// syscall probes are passed in.
    pub fn detect_at(
        sys_root: &Path,
        cgroup: &dsec_runtime::cgroup::CgroupRoot,
        core_sched: Capability,
        sched_idle: Capability,
    ) -> Caps {
        use dsec_runtime::cgroup::CgroupVersion;
        let p = |rel: &str| sys_root.join(rel);
        let cgroup_version = cgroup.version.as_str();
        let cpu_dir = match cgroup.version {
            CgroupVersion::V1 => cgroup.path.join("cpu"),
            CgroupVersion::V2 => cgroup.path.clone(),
        };
        // cpu.idle is absent from the root cgroup: look one level down too.
        let cpu_idle_file = std::iter::once(cpu_dir.join("cpu.idle"))
            .chain(
                std::fs::read_dir(&cpu_dir)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path().join("cpu.idle")),
            )
            .find(|f| f.exists());
        let cpu_idle = match cpu_idle_file {
            Some(f) => yes(format!("{} ({cgroup_version})", f.display())),
            None => no(format!("no cpu.idle under {}", cpu_dir.display())),
        };
        let smt = match std::fs::read_to_string(p("sys/devices/system/cpu/smt/active")) {
            Ok(s) if s.trim() == "1" => yes("smt/active=1"),
            Ok(s) => no(format!("smt/active={}", s.trim())),
            Err(_) => no("no sys/devices/system/cpu/smt/active"),
        };
        let psi = match std::fs::read_to_string(p("proc/pressure/memory")) {
            Ok(_) => yes("/proc/pressure/{cpu,memory,io}"),
            Err(e) => no(format!("/proc/pressure/memory: {e}")),
        };
        let damon_dir = p("sys/kernel/mm/damon/admin");
        let damon = if damon_dir.is_dir() {
            yes("sysfs /sys/kernel/mm/damon/admin")
        } else {
            no("no /sys/kernel/mm/damon/admin")
        };
        let zram = if p("sys/class/zram-control").is_dir() || p("sys/module/zram").is_dir() {
            yes("zram module loaded")
        } else if module_file_exists(sys_root, "zram") {
            yes("zram module available (not loaded)")
        } else {
            no("no zram module")
        };
        let ksm = match std::fs::read_to_string(p("sys/kernel/mm/ksm/run")) {
            Ok(s) => yes(format!("ksm/run={}", s.trim())),
            Err(_) => no("no /sys/kernel/mm/ksm"),
        };
        let cgroup_favordynmods = match dsec_runtime::cgroup::favor::status() {
            Some(f) if f.is_on() => yes(f.detail()),
            Some(f) => no(f.detail()),
            None => no("not enabled (no container substrate in this process)"),
        };
        Caps(NodeCapabilities {
            cgroup_favordynmods,
            cgroup_version: cgroup_version.into(),
            cpu_idle,
            core_scheduling: core_sched,
            sched_idle,
            smt,
            psi,
            damon,
            zram,
            ksm,
        })
    }

    /// The wire form (node status).
    pub fn to_wire(&self) -> NodeCapabilities {
        self.0.clone()
    }
}

/// True when `lib/modules/<release>/…/<name>.ko*` exists.
fn module_file_exists(sys_root: &Path, name: &str) -> bool {
    let Ok(release) = std::fs::read_to_string(sys_root.join("proc/sys/kernel/osrelease")) else {
        return false;
    };
    let dir = sys_root
        .join("lib/modules")
        .join(release.trim())
        .join("kernel/drivers/block/zram");
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("{name}.ko"))
        })
}

/// Asks the kernel for this thread's core-scheduling cookie: EINVAL means the kernel was built
/// without CONFIG_SCHED_CORE, ENODEV that the machine has no SMT.
pub fn probe_core_sched() -> Capability {
    let mut cookie: u64 = 0;
    // SAFETY: PR_SCHED_CORE_GET writes one u64 through the pointer, which points to a live
    // local; pid 0 is the calling thread.
    let rc = unsafe {
        libc::prctl(
            PR_SCHED_CORE,
            PR_SCHED_CORE_GET,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            &mut cookie as *mut u64,
        )
    };
    if rc == 0 {
        yes("prctl(PR_SCHED_CORE)")
    } else {
        let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        no(errno_name(e))
    }
}

/// Switches a scratch thread to SCHED_IDLE and reads the policy back.
pub fn probe_sched_idle() -> Capability {
    let probe = std::thread::spawn(|| {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: pid 0 is the calling (scratch) thread; `param` is a live local.
        let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
        }
        // SAFETY: plain syscall on the calling thread.
        Ok(unsafe { libc::sched_getscheduler(0) })
    });
    match probe.join() {
        Ok(Ok(p)) if p == libc::SCHED_IDLE => yes("sched_setscheduler(SCHED_IDLE)"),
        Ok(Ok(p)) => no(format!("policy read back as {p}")),
        Ok(Err(e)) => no(errno_name(e)),
        Err(_) => no("probe thread panicked"),
    }
}

impl std::fmt::Display for Caps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show = |c: &Capability| {
            if c.available {
                "available".to_string()
            } else {
                format!("unavailable ({})", c.detail)
            }
        };
        write!(
            f,
            "cgroup {}, favordynmods: {}, cpu.idle: {}, core scheduling: {}, SCHED_IDLE: {}, SMT: {}, PSI: {}, DAMON: {}, zram: {}, KSM: {}",
            self.cgroup_version,
            show(&self.cgroup_favordynmods),
            show(&self.cpu_idle),
            show(&self.core_scheduling),
            show(&self.sched_idle),
            show(&self.smt),
            show(&self.psi),
            show(&self.damon),
            show(&self.zram),
            show(&self.ksm)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_runtime::cgroup::CgroupRoot;

    #[test]
    fn fixture_host_v2_with_everything() {
        let d = tempfile::tempdir().unwrap();
        let w = |rel: &str, text: &str| {
            let f = d.path().join(rel);
            std::fs::create_dir_all(f.parent().unwrap()).unwrap();
            std::fs::write(f, text).unwrap();
        };
        w("cg/cgroup.controllers", "cpu memory pids\n");
        w("cg/dsec/cpu.idle", "0\n");
        w("sys/devices/system/cpu/smt/active", "1\n");
        w("proc/pressure/memory", "some avg10=0.00\n");
        std::fs::create_dir_all(d.path().join("sys/kernel/mm/damon/admin")).unwrap();
        std::fs::create_dir_all(d.path().join("sys/class/zram-control")).unwrap();
        w("sys/kernel/mm/ksm/run", "0\n");
        let root = CgroupRoot::detect_at(d.path().join("cg"));
        let c = Caps::detect_at(d.path(), &root, yes("x"), yes("y"));
        assert_eq!(c.cgroup_version, "v2");
        for cap in [&c.cpu_idle, &c.smt, &c.psi, &c.damon, &c.zram, &c.ksm] {
            assert!(cap.available, "{cap:?}");
        }
        let wire = c.to_wire();
        assert_eq!(wire.cgroup_version, "v2");
        assert!(wire.ksm.available);
    }

    #[test]
    fn fixture_host_v1_without_features() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("cg/cpu")).unwrap();
        std::fs::create_dir_all(d.path().join("sys/devices/system/cpu/smt")).unwrap();
        std::fs::write(d.path().join("sys/devices/system/cpu/smt/active"), "0\n").unwrap();
        // zram only as a module file.
        std::fs::create_dir_all(d.path().join("proc/sys/kernel")).unwrap();
        std::fs::write(d.path().join("proc/sys/kernel/osrelease"), "6.1.0-x\n").unwrap();
        let m = d
            .path()
            .join("lib/modules/6.1.0-x/kernel/drivers/block/zram");
        std::fs::create_dir_all(&m).unwrap();
        std::fs::write(m.join("zram.ko.xz"), "").unwrap();
        let root = CgroupRoot::detect_at(d.path().join("cg"));
        let c = Caps::detect_at(d.path(), &root, no("EINVAL"), yes("y"));
        assert_eq!(c.cgroup_version, "v1");
        assert!(!c.cpu_idle.available && !c.smt.available && !c.psi.available);
        assert!(!c.damon.available && !c.ksm.available);
        assert!(c.zram.available, "{:?}", c.zram);
        let text = c.to_string();
        assert!(
            text.contains("core scheduling: unavailable (EINVAL)"),
            "{text}"
        );
    }

    #[test]
    fn core_cookie_matches_the_probe() {
        let caps = probe_core_sched();
        // SAFETY: getpid has no preconditions.
        let me = unsafe { libc::getpid() };
        match dsec_runtime::qos::core_cookie(me) {
            Ok(()) => assert!(caps.available),
            Err(dsec_runtime::qos::ApplyQosError::CoreSched { errno, .. }) => {
                println!("core scheduling unavailable here: {errno}");
                assert!(!caps.available);
                assert_eq!(errno, caps.detail);
            }
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn probes_on_this_host() {
        // Whatever the kernel says, the probes answer without failing.
        let core = probe_core_sched();
        let idle = probe_sched_idle();
        println!("core scheduling: {core:?}; SCHED_IDLE: {idle:?}");
        assert!(core.available || !core.detail.is_empty());
        assert!(
            idle.available,
            "SCHED_IDLE exists since Linux 2.6.23: {idle:?}"
        );
    }
}
