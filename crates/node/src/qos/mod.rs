//! CPU QoS classes and overcommit admission (issue 10, DESIGN.md §7).
//!
//! Every sandbox has a [`QosClass`]: the create request's, else the edge's
//! `qos.default_class`. It is recorded in [`SandboxInfo::qos`] (and so in the sandbox record:
//! it survives an edge restart). Applying a class to a sandbox's processes and cgroup is the
//! substrate's (`dsec_runtime::qos`); this module decides the settings ([`Qos::settings`]),
//! admits by measured usage and samples that usage through a [`crate::SandboxView`].

pub mod admission;
pub mod caps;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use dsec_runtime::qos::QosSettings;
use dsec_wire::api::{AdmissionStatus, QosClass, SandboxInfo};
use serde::{Deserialize, Serialize};

use crate::{NodeConfigError, SandboxSnapshot, SandboxView};
pub use admission::{Amount, Policy, Refusal, Snapshot};
pub use caps::Caps;

/// The node's size and overcommit ratios, as admission needs them (from the edge's config,
/// or the machine where the config leaves them out).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Capacity {
    pub memory_mb: u64,
    pub cpu: f64,
    pub memory_overcommit: f64,
    pub cpu_overcommit: f64,
}

/// `[edge.qos]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QosConfig {
    /// Class of a sandbox whose create request names none.
    pub default_class: QosClass,
    /// LS floor: latency-sensitive memory requests stay within physical memory × this
    /// (default 4, the default `memory_overcommit`, so that the default class keeps the
    /// node's density; 1.0 backs every LS request with physical memory).
    pub ls_memory_ratio: f64,
    /// LS floor: latency-sensitive CPU requests stay within the node's cores × this (default
    /// 25, the default `cpu_overcommit`: CPU is compressible and best-effort tasks are
    /// SCHED_IDLE, so by default only memory is held back for LS; lower it to bound LS CPU).
    pub ls_cpu_ratio: f64,
    /// Best-effort admission: LS requests + measured memory use stay within physical × this.
    pub memory_usage_limit: f64,
    /// Best-effort admission: measured CPU use stays within the node's cores × this.
    pub cpu_usage_limit: f64,
    /// What a starting sandbox reserves until it is measured (capped by its request).
    pub start_reservation_mb: u64,
    pub start_reservation_cpu: f64,
    /// How often sandbox usage is measured (milliseconds).
    pub sample_ms: u64,
    /// Best-effort cgroups also get `cpu.idle` = 1 where the kernel has it (the kernel then
    /// shows their weight as 3 instead of 2).
    pub best_effort_cgroup_idle: bool,
    /// Latency-sensitive sandboxes get a core-scheduling cookie where the kernel has them.
    pub core_scheduling: bool,
}

impl Default for QosConfig {
    fn default() -> Self {
        Self {
            default_class: QosClass::LatencySensitive,
            ls_memory_ratio: 4.0,
            ls_cpu_ratio: 25.0,
            memory_usage_limit: 0.9,
            cpu_usage_limit: 1.0,
            start_reservation_mb: 64,
            start_reservation_cpu: 0.1,
            sample_ms: 2000,
            best_effort_cgroup_idle: true,
            core_scheduling: true,
        }
    }
}

impl QosConfig {
    /// Checks the values; the error names the bad key.
    pub fn validate(&self) -> Result<(), NodeConfigError> {
        let pos = |key: &'static str, v: f64, max: f64| {
            if v.is_finite() && v > 0.0 && v <= max {
                Ok(())
            } else {
                Err(NodeConfigError::new(
                    key,
                    format!("{v} must be in (0, {max}]"),
                ))
            }
        };
        pos("qos.ls_memory_ratio", self.ls_memory_ratio, 100.0)?;
        pos("qos.ls_cpu_ratio", self.ls_cpu_ratio, 1000.0)?;
        pos("qos.memory_usage_limit", self.memory_usage_limit, 1.0)?;
        pos("qos.cpu_usage_limit", self.cpu_usage_limit, 100.0)?;
        if !(self.start_reservation_cpu.is_finite() && self.start_reservation_cpu >= 0.0) {
            return Err(NodeConfigError::new(
                "qos.start_reservation_cpu",
                "must be >= 0",
            ));
        }
        if self.sample_ms < 100 {
            return Err(NodeConfigError::new(
                "qos.sample_ms",
                "must be at least 100",
            ));
        }
        Ok(())
    }
}

/// The class a create request gets on this edge.
pub fn resolve(requested: Option<QosClass>, cfg: &QosConfig) -> QosClass {
    requested.unwrap_or(cfg.default_class)
}

/// The QoS class of a sandbox (what the reclaim policy filters on).
pub fn class_of(info: &SandboxInfo) -> QosClass {
    info.qos
}

/// True for a best-effort sandbox.
pub fn is_best_effort(info: &SandboxInfo) -> bool {
    class_of(info) == QosClass::BestEffort
}

/// One sandbox in the books.
#[derive(Debug, Clone)]
struct Booked {
    class: QosClass,
    req: Amount,
    /// Admitted, not yet running: counts by its reservation.
    starting: bool,
    /// Last measured working set (MiB) and CPU use (cores).
    used: Option<Amount>,
    /// Last CPU counter (ns) and when it was read.
    cpu_mark: Option<(u64, Instant)>,
}

/// Time constant of the CPU use admission reads: a measured rate is smoothed over about this
/// long, so a momentary burst of a sandbox does not refuse best-effort creates.
pub const CPU_SMOOTHING: Duration = Duration::from_secs(5);

/// Shortest time between two samples asked for by waiting creates ([`Qos::sample_soon`]).
pub const SAMPLE_SOON_MIN: Duration = Duration::from_millis(250);

/// The node's QoS state: capabilities and the admission books (one per manager).
pub struct Qos {
    cfg: QosConfig,
    caps: Caps,
    books: Mutex<HashMap<String, Booked>>,
    /// Woken when admission room may have freed (a start finished, a sandbox left, a sample).
    freed: tokio::sync::Notify,
    /// Woken when a create waits for starting sandboxes to be measured.
    sample_soon: tokio::sync::Notify,
    /// Creates waiting for admission on this node now (the edge bounds it).
    pub waiting: std::sync::atomic::AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Qos {
    /// Detects the kernel's capabilities (once) and logs what is missing.
    pub fn new(cfg: &QosConfig) -> Self {
        let caps = Caps::detect();
        tracing::info!(capabilities = %caps, "QoS capabilities");
        Self::with_caps(cfg, caps)
    }

    pub fn with_caps(cfg: &QosConfig, caps: Caps) -> Self {
        Qos {
            cfg: cfg.clone(),
            caps,
            books: Mutex::new(HashMap::new()),
            freed: tokio::sync::Notify::new(),
            sample_soon: tokio::sync::Notify::new(),
            waiting: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    pub fn caps(&self) -> &Caps {
        &self.caps
    }

    pub fn config(&self) -> &QosConfig {
        &self.cfg
    }

    /// What the substrate applies to a new sandbox of `class` on this node.
    pub fn settings(&self, class: QosClass) -> QosSettings {
        QosSettings {
            class,
            best_effort_cgroup_idle: self.cfg.best_effort_cgroup_idle,
            core_cookie: self.caps.core_scheduling.available && self.cfg.core_scheduling,
        }
    }

    /// The admission policy for a node of this size.
    pub fn policy(&self, node: &Capacity) -> Policy {
        Policy {
            physical: Amount::new(node.memory_mb as f64, node.cpu),
            memory_overcommit: node.memory_overcommit,
            cpu_overcommit: node.cpu_overcommit,
            ls_memory_ratio: self.cfg.ls_memory_ratio,
            ls_cpu_ratio: self.cfg.ls_cpu_ratio,
            memory_usage_limit: self.cfg.memory_usage_limit,
            cpu_usage_limit: self.cfg.cpu_usage_limit,
            start_reservation: Amount::new(
                self.cfg.start_reservation_mb as f64,
                self.cfg.start_reservation_cpu,
            ),
        }
    }

    fn snapshot_of(&self, books: &HashMap<String, Booked>) -> Snapshot {
        self.snapshot_parts(books).0
    }

    /// The snapshot and how much of its `used` is running sandboxes not measured yet (counted
    /// by their reservation).
    fn snapshot_parts(&self, books: &HashMap<String, Booked>) -> (Snapshot, Amount) {
        let res = self.policy_reservation();
        let mut unmeasured = Amount::default();
        let mut s = Snapshot::default();
        for b in books.values() {
            match b.class {
                QosClass::LatencySensitive => s.committed_ls += b.req,
                QosClass::BestEffort => s.committed_be += b.req,
            }
            if b.starting {
                s.reserved +=
                    Amount::new(b.req.memory_mb.min(res.memory_mb), b.req.cpu.min(res.cpu));
                continue;
            }
            // Not measured yet: its reservation (a sandbox without a cgroup to measure, a
            // microVM, is set to its request by `sample`).
            let used = b.used.unwrap_or_else(|| {
                let r = Amount::new(b.req.memory_mb.min(res.memory_mb), b.req.cpu.min(res.cpu));
                unmeasured.cpu += r.cpu;
                if b.class == QosClass::BestEffort {
                    unmeasured.memory_mb += r.memory_mb;
                }
                r
            });
            // LS memory counts by its request (the floor); BE by its working set.
            if b.class == QosClass::BestEffort {
                s.used.memory_mb += used.memory_mb;
            }
            s.used.cpu += used.cpu;
        }
        (s, unmeasured)
    }

    fn policy_reservation(&self) -> Amount {
        Amount::new(
            self.cfg.start_reservation_mb as f64,
            self.cfg.start_reservation_cpu,
        )
    }

    /// The current snapshot (for the status and tests).
    pub fn snapshot(&self) -> Snapshot {
        self.snapshot_of(&lock(&self.books))
    }

    /// Admits and books a starting sandbox, or says why not.
    pub fn admit(
        &self,
        node: &Capacity,
        id: &str,
        class: QosClass,
        memory_mb: u64,
        cpu: f64,
    ) -> Result<(), Refusal> {
        let mut books = lock(&self.books);
        let req = Amount::new(memory_mb as f64, cpu);
        let policy = self.policy(node);
        let (snap, unmeasured) = self.snapshot_parts(&books);
        admission::check(class, req, &policy, &snap).map_err(|mut r| {
            // Only starting or unmeasured sandboxes in the way: it fits once they settle. CPU
            // in use is compressible and changes from moment to moment (best-effort tasks are
            // SCHED_IDLE): waiting for it is worth it too, up to the request's wait bound.
            r.transient = admission::check(class, req, &policy, &snap.settled(unmeasured)).is_ok()
                || (r.resource == "cpu" && r.rule.starts_with("measured usage"));
            r
        })?;
        books.insert(
            id.to_string(),
            Booked {
                class,
                req,
                starting: true,
                used: None,
                cpu_mark: None,
            },
        );
        Ok(())
    }

    /// The sandbox is running: from now on it counts by measurement.
    pub fn started(&self, id: &str) {
        if let Some(b) = lock(&self.books).get_mut(id) {
            b.starting = false;
        }
        self.freed.notify_waiters();
        self.sample_soon.notify_one();
    }

    /// Resolves when admission room may have freed (a start finished, a sandbox left, usage
    /// was measured). Waiting creates re-check after it (and after a short timeout: a wake-up
    /// between their check and this call is not kept).
    pub fn freed(&self) -> tokio::sync::futures::Notified<'_> {
        self.freed.notified()
    }

    /// Asks the sampler to measure soon (at most every [`SAMPLE_SOON_MIN`]): a create waits
    /// for running sandboxes that still count by their start reservation.
    pub fn sample_soon(&self) {
        self.sample_soon.notify_one();
    }

    /// A re-adopted sandbox (edge restart).
    pub fn adopt(&self, id: &str, class: QosClass, memory_mb: u64, cpu: f64) {
        lock(&self.books).insert(
            id.to_string(),
            Booked {
                class,
                req: Amount::new(memory_mb as f64, cpu),
                starting: false,
                used: None,
                cpu_mark: None,
            },
        );
    }

    /// The sandbox is gone (or its create failed).
    pub fn release(&self, id: &str) {
        lock(&self.books).remove(id);
        self.freed.notify_waiters();
    }

    /// Admission figures for the node status. The free figures (what placement reads) are
    /// those once the sandboxes starting now are running and measured: a create that fits
    /// then waits at the edge for them instead of being refused ([`Refusal::transient`]).
    pub fn status(&self, node: &Capacity) -> AdmissionStatus {
        let policy = self.policy(node);
        let (snap, unmeasured) = self.snapshot_parts(&lock(&self.books));
        let mut st = admission::status(&policy, &snap);
        let settled = admission::status(&policy, &snap.settled(unmeasured));
        st.memory_mb_free_be = settled.memory_mb_free_be;
        st.cpu_cores_free_be = settled.cpu_cores_free_be;
        st.memory_mb_free_ls = settled.memory_mb_free_ls;
        st.cpu_cores_free_ls = settled.cpu_cores_free_ls;
        st
    }

    /// Measures every running sandbox's working set and CPU use (blocking file reads) from
    /// the cgroups in `live`; a booked sandbox without one (a VM, whose guest memory stays
    /// resident) counts by its request.
    pub fn sample(&self, live: &[SandboxSnapshot]) {
        let ids: Vec<String> = lock(&self.books)
            .iter()
            .filter(|(_, b)| !b.starting)
            .map(|(id, _)| id.clone())
            .collect();
        let mut measured = Vec::with_capacity(ids.len());
        let mut unmeasurable = Vec::new();
        for id in ids {
            let cg = live
                .iter()
                .find(|s| s.id == id)
                .and_then(|s| s.cgroup.as_ref())
                .filter(|c| c.path().is_dir());
            let Some(cg) = cg else {
                unmeasurable.push(id);
                continue;
            };
            let mem = cg.memory_working_set().ok();
            let cpu = cg.cpu_usage_ns().ok();
            measured.push((id, mem, cpu, Instant::now()));
        }
        let mut books = lock(&self.books);
        for id in unmeasurable {
            if let Some(b) = books.get_mut(&id) {
                b.used = Some(b.req);
            }
        }
        for (id, mem, cpu_ns, at) in measured {
            let Some(b) = books.get_mut(&id) else {
                continue;
            };
            let mut used = b.used.unwrap_or_default();
            if let Some(m) = mem {
                used.memory_mb = m as f64 / (1024.0 * 1024.0);
            }
            if let Some(ns) = cpu_ns {
                match b.cpu_mark {
                    // First sample: the CPU it used so far is its start (aether, the first
                    // shell), not what it will use: it counts as idle until the next sample
                    // measures a rate.
                    None => used.cpu = 0.0,
                    Some((prev, t0)) => {
                        let dt = at.duration_since(t0).as_secs_f64();
                        if dt > 0.0 {
                            let rate = ns.saturating_sub(prev) as f64 / 1e9 / dt;
                            // Smoothed exponentially over ~CPU_SMOOTHING.
                            let a = 1.0 - (-dt / CPU_SMOOTHING.as_secs_f64()).exp();
                            used.cpu += a * (rate - used.cpu);
                        }
                    }
                }
                b.cpu_mark = Some((ns, at));
            }
            b.used = Some(used);
        }
        drop(books);
        self.freed.notify_waiters();
    }
}

/// Measures usage every `qos.sample_ms` while the view (the edge's manager) lives.
pub fn spawn_sampler(view: Weak<dyn SandboxView>, qos: Arc<Qos>) -> tokio::task::JoinHandle<()> {
    let every = Duration::from_millis(qos.config().sample_ms);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = Instant::now();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                // A create waits for starting sandboxes to be measured: sample sooner.
                _ = qos.sample_soon.notified() => {
                    let next = last + SAMPLE_SOON_MIN;
                    if Instant::now() < next {
                        tokio::time::sleep_until(next.into()).await;
                    }
                }
            }
            last = Instant::now();
            let Some(v) = view.upgrade() else { return };
            let q = qos.clone();
            let _ = tokio::task::spawn_blocking(move || q.sample(&v.sandboxes())).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_and_requested() {
        let cfg = QosConfig::default();
        assert_eq!(resolve(None, &cfg), QosClass::LatencySensitive);
        assert_eq!(
            resolve(Some(QosClass::BestEffort), &cfg),
            QosClass::BestEffort
        );
        let be = QosConfig {
            default_class: QosClass::BestEffort,
            ..Default::default()
        };
        assert_eq!(resolve(None, &be), QosClass::BestEffort);
        assert_eq!(
            resolve(Some(QosClass::LatencySensitive), &be),
            QosClass::LatencySensitive
        );
        let info = SandboxInfo {
            qos: QosClass::BestEffort,
            ..Default::default()
        };
        assert!(is_best_effort(&info));
        let t: QosConfig = toml::from_str("default_class = \"best_effort\"").unwrap();
        assert_eq!(t.default_class, QosClass::BestEffort);
    }

    #[test]
    fn books_follow_the_lifecycle() {
        let strict = QosConfig {
            ls_memory_ratio: 1.0,
            ..QosConfig::default()
        };
        let q = Qos::with_caps(&strict, Caps::default());
        let edge = Capacity {
            memory_mb: 2048,
            cpu: 2.0,
            memory_overcommit: 4.0,
            cpu_overcommit: 25.0,
        };
        q.admit(&edge, "a", QosClass::BestEffort, 1024, 0.5)
            .unwrap();
        // Starting: its reservation.
        let s = q.snapshot();
        assert_eq!(s.reserved, Amount::new(64.0, 0.1));
        assert_eq!(s.committed_be, Amount::new(1024.0, 0.5));
        // Running, not measured yet: still its reservation.
        q.started("a");
        let s = q.snapshot();
        assert_eq!(
            (s.reserved, s.used),
            (Amount::default(), Amount::new(64.0, 0.1))
        );
        // No cgroup to measure (a microVM): its request.
        q.sample(&[SandboxSnapshot {
            id: "a".into(),
            state: dsec_wire::api::SandboxState::Running,
            qos: QosClass::BestEffort,
            last_request_ms: 0,
            busy: false,
            cgroup: None,
        }]);
        assert_eq!(q.snapshot().used, Amount::new(1024.0, 0.5));
        // Measured: its working set and CPU rate.
        lock(&q.books).get_mut("a").unwrap().used = Some(Amount::new(3.0, 0.01));
        assert_eq!(q.snapshot().used, Amount::new(3.0, 0.01));
        // LS floor: 1.0 x 2048 MiB.
        q.admit(&edge, "b", QosClass::LatencySensitive, 2048, 1.0)
            .unwrap();
        let e = q
            .admit(&edge, "c", QosClass::LatencySensitive, 16, 0.1)
            .unwrap_err();
        assert!(e.rule.starts_with("latency-sensitive floor"), "{e}");
        // The LS floor is all of memory: best-effort is out of room by usage.
        assert!(q.admit(&edge, "d", QosClass::BestEffort, 16, 0.1).is_err());
        assert_eq!(q.status(&edge).memory_mb_committed_ls, 2048);
        q.release("b");
        q.adopt("b2", QosClass::LatencySensitive, 512, 0.5);
        q.admit(&edge, "d", QosClass::BestEffort, 16, 0.1).unwrap();
        let st = q.status(&edge);
        assert_eq!(
            (st.memory_mb_committed_ls, st.memory_mb_committed_be),
            (512, 1040)
        );
        q.release("nope");
    }

    #[test]
    fn sample_measures_through_the_views_cgroup() {
        use dsec_runtime::cgroup::{Cgroup, CgroupRoot, Limits};
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("cgroup.controllers"), "cpu memory\n").unwrap();
        let root = CgroupRoot::detect_at(d.path());
        let cg = Cgroup::create(&root, "dsec/n0", "sb-1", &Limits::default()).unwrap();
        std::fs::write(cg.path().join("memory.current"), "20971520\n").unwrap();
        std::fs::write(
            cg.path().join("memory.stat"),
            "anon 1\ninactive_file 10485760\n",
        )
        .unwrap();
        std::fs::write(cg.path().join("cpu.stat"), "usage_usec 1000\n").unwrap();
        let q = Qos::with_caps(&QosConfig::default(), Caps::default());
        q.adopt("sb-1", QosClass::BestEffort, 1024, 1.0);
        let snap = SandboxSnapshot {
            id: "sb-1".into(),
            state: dsec_wire::api::SandboxState::Running,
            qos: QosClass::BestEffort,
            last_request_ms: 0,
            busy: false,
            cgroup: Some(cg),
        };
        q.sample(std::slice::from_ref(&snap));
        // The working set (20 MiB charged, 10 MiB of it inactive page cache), not the request.
        assert_eq!(q.snapshot().used.memory_mb, 10.0);
        // A sandbox the view no longer lists counts by its request.
        q.sample(&[]);
        assert_eq!(q.snapshot().used.memory_mb, 1024.0);
    }
}
