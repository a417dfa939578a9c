//! Cold-memory reclaim and node memory pressure (`[edge.reclaim]`, DESIGN.md §7).
//!
//! When enabled, the edge
//! - sets up a compressed swap tier ([`zram`]) at start and removes it at shutdown;
//! - gives every sandbox the swap policy of its QoS class (`dsec_runtime::cgroup::memory`):
//!   latency-sensitive never swapped, best-effort swapped first;
//! - pushes cold memory of best-effort sandboxes out: with DAMON ([`damon`], `paddr` + DAMOS
//!   `pageout` + memcg filters) when it is the sole DAMON user, else cgroup-driven: a best-effort
//!   sandbox without a request and not busy for `cold_s` (paused ones first, at once) has its
//!   cgroup reclaimed (v1 `memory.force_empty`, v2 `memory.reclaim`): anonymous memory goes to
//!   zram, clean page cache is dropped;
//! - enforces the node memory budget on the sandboxes' parent cgroup and, under pressure
//!   ([`pressure`]), reclaims then pauses best-effort sandboxes, latency-sensitive ones never.
//!
//! Each action is a trajectory entry (`reclaim`, `memory_pressure`) with its reason, a log line
//! and a Prometheus counter (`dsec_edge_reclaimed_bytes_total{sandbox,mechanism}`,
//! `dsec_edge_memory_pressure_actions_total{action}`).

pub mod damon;
pub mod pressure;
pub mod zram;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use dsec_runtime::cgroup::memory::{Reclaimed, SandboxesParent, SwapPolicy};
use dsec_runtime::cgroup::{Cgroup, CgroupRoot};
use dsec_wire::api::{QosClass, SandboxState};
use prometheus::IntCounterVec;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::{now_ms, NodeConfigError, SandboxView};

/// `[edge.reclaim]`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ReclaimConfig {
    /// Off by default: it adds swap to the host and changes cgroup limits.
    pub enabled: bool,
    /// Size of the zram swap device in MiB (0: no swap tier; only page cache is dropped).
    pub zram_mb: u64,
    /// Compression algorithms in order of preference (the first the kernel offers is used).
    pub zram_algorithms: Vec<String>,
    /// Swap priority of the zram device.
    pub swap_priority: i32,
    /// Memory untouched (DAMON) / a sandbox idle (cgroup fallback) this long is cold.
    pub cold_s: u64,
    /// Policy period in milliseconds.
    pub interval_ms: u64,
    /// `auto` (DAMON when possible, else cgroup), `damon`, `cgroup`.
    pub mechanism: String,
    /// v1 `memory.swappiness` of best-effort sandboxes (latency-sensitive: 0).
    pub best_effort_swappiness: u64,
    /// Memory budget of all sandboxes together in MiB, enforced as the parent cgroup's limit
    /// (0: none).
    pub node_memory_budget_mb: u64,
    /// Pressure when the sandboxes' working set reaches this fraction of the budget.
    pub pressure_high_ratio: f64,
    /// Pressure when PSI `some avg10` reaches this (percent; 0: PSI ignored).
    pub pressure_psi_some_avg10: f64,
    /// Pause best-effort sandboxes when reclaim does not end the pressure.
    pub pause_on_pressure: bool,
    /// End best-effort sandboxes (end reason `memory_pressure`, the largest paused one first)
    /// when the pressure outlasts pausing every running one: paused memory that cannot be
    /// swapped out (no zram tier, or a full one) still fills the node. Off by default.
    pub stop_on_pressure: bool,
}

impl Default for ReclaimConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            zram_mb: 4096,
            zram_algorithms: vec!["zstd".into(), "lz4".into()],
            swap_priority: 100,
            cold_s: 120,
            interval_ms: 1000,
            mechanism: "auto".into(),
            best_effort_swappiness: 100,
            node_memory_budget_mb: 0,
            pressure_high_ratio: 0.9,
            pressure_psi_some_avg10: 0.0,
            pause_on_pressure: true,
            stop_on_pressure: false,
        }
    }
}

impl ReclaimConfig {
    /// Checks the values; the error names the bad key.
    pub fn validate(&self) -> Result<(), NodeConfigError> {
        if !matches!(self.mechanism.as_str(), "auto" | "damon" | "cgroup") {
            return Err(NodeConfigError::new(
                "reclaim.mechanism",
                format!("{:?} must be auto, damon or cgroup", self.mechanism),
            ));
        }
        if self.interval_ms < 100 {
            return Err(NodeConfigError::new(
                "reclaim.interval_ms",
                "must be at least 100",
            ));
        }
        if !(self.pressure_high_ratio > 0.0 && self.pressure_high_ratio <= 1.0) {
            return Err(NodeConfigError::new(
                "reclaim.pressure_high_ratio",
                "must be in (0, 1]",
            ));
        }
        if !(0.0..=100.0).contains(&self.pressure_psi_some_avg10) {
            return Err(NodeConfigError::new(
                "reclaim.pressure_psi_some_avg10",
                "must be in [0, 100]",
            ));
        }
        if self.best_effort_swappiness > 200 {
            return Err(NodeConfigError::new(
                "reclaim.best_effort_swappiness",
                "must be at most 200",
            ));
        }
        Ok(())
    }
}

/// What a round asks of the edge besides reclaim.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PressureAction {
    /// Pause this sandbox (id, why).
    Pause(String, String),
    /// End this sandbox with end reason `memory_pressure` (id, why).
    Stop(String, String),
}

/// One sandbox the policy may act on: running or paused, with a memory cgroup.
#[derive(Debug, Clone)]
struct ReclaimView {
    id: String,
    state: SandboxState,
    qos: QosClass,
    last_request_ms: u64,
    busy: bool,
    cgroup: Cgroup,
}

impl ReclaimView {
    /// The sandboxes of `view` the policy covers.
    fn of(view: &dyn SandboxView) -> Vec<ReclaimView> {
        view.sandboxes()
            .into_iter()
            .filter(|s| matches!(s.state, SandboxState::Running | SandboxState::Paused))
            .filter_map(|s| {
                Some(ReclaimView {
                    cgroup: s.cgroup?,
                    id: s.id,
                    state: s.state,
                    qos: s.qos,
                    last_request_ms: s.last_request_ms,
                    busy: s.busy,
                })
            })
            .collect()
    }
}

/// The Prometheus counters the policy moves (registered by the edge).
#[derive(Clone)]
pub struct ReclaimMetrics {
    /// `dsec_edge_reclaimed_bytes_total{sandbox,mechanism}`.
    pub reclaimed_bytes: IntCounterVec,
    /// `dsec_edge_memory_pressure_actions_total{action}`.
    pub memory_pressure_actions: IntCounterVec,
}

/// Where the policy runs: the node's cgroup parent and its own state directory.
#[derive(Debug, Clone)]
pub struct ReclaimPlace {
    /// The sandboxes' parent cgroup (`dsec/<node>`).
    pub cgroup_parent: String,
    /// `<edge dir>/reclaim`: the zram marker and the kdamond's pid.
    pub state_dir: PathBuf,
}

#[derive(Debug, Default, Clone)]
struct Track {
    qos_applied: Option<QosClass>,
    /// When the sandbox was last reclaimed (ms), 0 never.
    last_reclaim_ms: u64,
    /// Working set right after that reclaim.
    resident_after: u64,
    /// State at the last reclaim (a fresh pause is reclaimed at once).
    reclaimed_state: Option<SandboxState>,
    /// Swapped bytes last seen (DAMON accounting).
    swap_seen: u64,
    /// CPU time last seen (ns) and when (ms).
    cpu_ns_seen: u64,
    cpu_seen_ms: u64,
    /// Last time the sandbox used more than [`ACTIVE_CPU_PERCENT`] of a core (ms).
    cpu_active_ms: u64,
}

/// A sandbox using more CPU than this (percent of one core) between two rounds is not idle,
/// whether or not it gets requests (a background job, a memory hog).
const ACTIVE_CPU_PERCENT: u64 = 2;

#[derive(Default)]
struct Inner {
    tracks: HashMap<String, Track>,
    episode: pressure::Episode,
    damon_memcgs: Vec<String>,
    /// The swap tier was found full (warned once until it drains).
    zram_full: bool,
}

/// The running reclaim policy of one edge.
pub struct Reclaim {
    cfg: ReclaimConfig,
    /// The sandboxes' parent cgroup: the budget, its figures and pressure.
    parent: SandboxesParent,
    metrics: ReclaimMetrics,
    zram_host: zram::ZramHost,
    zram_marker: PathBuf,
    zram: Option<zram::ZramDevice>,
    damon: Option<damon::Damon>,
    /// `damon` or `cgroup`.
    mechanism: &'static str,
    budget_set: bool,
    inner: Mutex<Inner>,
    task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Bytes → MiB for messages.
fn mib(b: u64) -> u64 {
    b >> 20
}

impl Reclaim {
    /// Sets up the swap tier, the budget and the mechanism, and starts the policy task.
    /// Returns None when reclaim is disabled. Never fails the edge: what cannot be set up is
    /// logged and reported as missing.
    pub async fn start(
        cfg: ReclaimConfig,
        place: ReclaimPlace,
        metrics: ReclaimMetrics,
        view: Weak<dyn SandboxView>,
    ) -> Option<Arc<Reclaim>> {
        if !cfg.enabled {
            return None;
        }
        let root = CgroupRoot::detect();
        let parent = match SandboxesParent::new(&root, &place.cgroup_parent) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "reclaim: the sandboxes' parent cgroup");
                return None;
            }
        };
        let setup = {
            let cfg = cfg.clone();
            tokio::task::spawn_blocking(move || Self::setup(cfg, parent, place.state_dir, metrics))
        };
        let reclaim = match setup.await {
            Ok(r) => Arc::new(r),
            Err(e) => {
                tracing::error!(error = %e, "reclaim setup task");
                return None;
            }
        };
        let me = reclaim.clone();
        let every = Duration::from_millis(cfg.interval_ms);
        let handle = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(v) = view.upgrade() else { return };
                me.tick(&v).await;
            }
        });
        *lock(&reclaim.task) = Some(handle);
        Some(reclaim)
    }

    fn setup(
        cfg: ReclaimConfig,
        parent: SandboxesParent,
        dir: PathBuf,
        metrics: ReclaimMetrics,
    ) -> Reclaim {
        let zram_host = zram::ZramHost::default();
        let zram_marker = dir.join("zram.json");
        let zram = if cfg.zram_mb > 0 {
            match zram_host.setup(
                &zram_marker,
                cfg.zram_mb,
                &cfg.zram_algorithms,
                cfg.swap_priority,
            ) {
                Ok(d) => {
                    tracing::info!(device = d.marker.device, algorithm = %d.marker.algorithm, mb = cfg.zram_mb, reused = d.reused, "reclaim: zram swap tier ready");
                    Some(d)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reclaim: no zram swap tier; only page cache can be reclaimed");
                    None
                }
            }
        } else {
            None
        };
        if let Err(e) = parent.prepare() {
            tracing::warn!(error = %e, "reclaim: prepare the sandboxes' parent cgroup");
        }
        let mut budget_set = false;
        if cfg.node_memory_budget_mb > 0 {
            match parent.set_budget(Some(cfg.node_memory_budget_mb << 20)) {
                Ok(()) => budget_set = true,
                Err(e) => tracing::warn!(error = %e, "reclaim: enforce the node memory budget"),
            }
        }
        let params = damon::DamonParams {
            sample_us: 5_000,
            aggr_us: 100_000,
            cold_us: cfg.cold_s.saturating_mul(1_000_000),
            max_bytes_per_s: 256 << 20,
        };
        let mut damon = None;
        let mut why_not_damon = String::from("mechanism = \"cgroup\" in config");
        if cfg.mechanism != "cgroup" {
            let d = damon::Damon::new("/sys/kernel/mm/damon/admin", dir.join("damon.pid"), params);
            match d.claim() {
                Ok(()) => damon = Some(d),
                Err(e) => why_not_damon = e.to_string(),
            }
        }
        let mechanism = if damon.is_some() { "damon" } else { "cgroup" };
        if damon.is_none() {
            tracing::warn!(reason = %why_not_damon, "reclaim: DAMON not used; falling back to cgroup-driven reclaim of idle best-effort sandboxes");
        }
        tracing::info!(
            mechanism,
            cold_s = cfg.cold_s,
            budget_mb = cfg.node_memory_budget_mb,
            "reclaim: policy started"
        );
        Reclaim {
            cfg,
            parent,
            metrics,
            zram_host,
            zram_marker,
            zram,
            damon,
            mechanism,
            budget_set,
            inner: Mutex::new(Inner::default()),
            task: Mutex::new(None),
        }
    }

    /// `damon` or `cgroup`.
    pub fn mechanism(&self) -> &'static str {
        self.mechanism
    }

    /// The zram device number, when the swap tier is up.
    pub fn zram_device(&self) -> Option<u32> {
        self.zram.as_ref().map(|d| d.marker.device)
    }

    /// One policy round.
    pub async fn tick(self: &Arc<Self>, view: &Arc<dyn SandboxView>) {
        let me = self.clone();
        let v = view.clone();
        let pause = tokio::task::spawn_blocking(move || {
            let sandboxes = ReclaimView::of(&*v);
            me.round(&*v, sandboxes)
        })
        .await;
        let action = match pause {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(error = %e, "reclaim round");
                return;
            }
        };
        if let Some(PressureAction::Stop(id, reason)) = &action {
            tracing::warn!(sandbox = %id, %reason, "memory pressure: ending best-effort sandbox");
            view.stop_for_pressure(id, reason).await;
            self.metrics
                .memory_pressure_actions
                .with_label_values(&["stop"])
                .inc();
        }
        if let Some(PressureAction::Pause(id, reason)) = action {
            tracing::warn!(sandbox = %id, %reason, "memory pressure: pausing best-effort sandbox");
            match view.pause_for_pressure(&id, &reason).await {
                Ok(()) => self
                    .metrics
                    .memory_pressure_actions
                    .with_label_values(&["pause"])
                    .inc(),
                Err(e) => tracing::warn!(sandbox = %id, error = %e, "memory pressure pause"),
            }
        }
    }

    /// The blocking part of a round; returns a sandbox to pause or end, and why.
    fn round(&self, view: &dyn SandboxView, views: Vec<ReclaimView>) -> Option<PressureAction> {
        let now = now_ms();
        let mut inner = lock(&self.inner);
        // Forget sandboxes that are gone.
        let live: BTreeSet<&str> = views.iter().map(|v| v.id.as_str()).collect();
        let gone: Vec<String> = inner
            .tracks
            .keys()
            .filter(|id| !live.contains(id.as_str()))
            .cloned()
            .collect();
        for id in gone {
            inner.tracks.remove(&id);
            let _ = self
                .metrics
                .reclaimed_bytes
                .remove_label_values(&[&id, self.mechanism]);
        }
        self.check_zram_fill(&mut inner);
        // Swap policy per QoS class.
        for v in &views {
            let t = inner.tracks.entry(v.id.clone()).or_default();
            if t.qos_applied != Some(v.qos) {
                let policy = match v.qos {
                    QosClass::LatencySensitive => SwapPolicy::Never,
                    QosClass::BestEffort => SwapPolicy::First {
                        swappiness: self.cfg.best_effort_swappiness,
                    },
                };
                match v.cgroup.set_swap_policy(policy) {
                    Ok(()) => t.qos_applied = Some(v.qos),
                    Err(e) => {
                        tracing::debug!(sandbox = %v.id, error = %e, "apply swap policy")
                    }
                }
            }
        }
        let be: Vec<&ReclaimView> = views
            .iter()
            .filter(|v| v.qos == QosClass::BestEffort)
            .collect();
        // Cold memory.
        if let Some(d) = &self.damon {
            let memcgs: Vec<String> = be.iter().map(|v| v.cgroup.memcg_path()).collect();
            if memcgs != inner.damon_memcgs {
                match d.apply(&memcgs) {
                    Ok(()) => inner.damon_memcgs = memcgs,
                    Err(e) => tracing::warn!(error = %e, "reclaim: update DAMON filters"),
                }
            }
            for v in &be {
                let swap = v.cgroup.memory_stat().swap;
                let t = inner.tracks.entry(v.id.clone()).or_default();
                if swap > t.swap_seen {
                    self.metrics
                        .reclaimed_bytes
                        .with_label_values(&[&v.id, "damon"])
                        .inc_by(swap - t.swap_seen);
                }
                t.swap_seen = swap;
            }
        } else {
            let cold_ms = self.cfg.cold_s.saturating_mul(1000);
            for v in be.iter().filter(|v| v.state == SandboxState::Running) {
                let t = inner.tracks.entry(v.id.clone()).or_default();
                note_cpu(&v.cgroup, t, now);
            }
            let mut todo: Vec<(&ReclaimView, String)> = Vec::new();
            for v in &be {
                let t = inner.tracks.get(&v.id).cloned().unwrap_or_default();
                let reason = match v.state {
                    SandboxState::Paused if t.reclaimed_state != Some(SandboxState::Paused) => {
                        "paused".to_string()
                    }
                    SandboxState::Running
                        if !v.busy
                            && now.saturating_sub(v.last_request_ms.max(t.cpu_active_ms))
                                >= cold_ms
                            && now.saturating_sub(t.last_reclaim_ms) >= cold_ms =>
                    {
                        let grown = v.cgroup.memory_stat().working_set()
                            > t.resident_after.saturating_add(4 << 20);
                        if t.last_reclaim_ms != 0
                            && t.reclaimed_state == Some(SandboxState::Running)
                            && !grown
                        {
                            continue;
                        }
                        format!(
                            "cold: no request and under {ACTIVE_CPU_PERCENT}% CPU for {} s",
                            now.saturating_sub(v.last_request_ms.max(t.cpu_active_ms)) / 1000
                        )
                    }
                    _ => continue,
                };
                todo.push((v, reason));
            }
            // Paused sandboxes first.
            todo.sort_by_key(|(v, _)| v.state != SandboxState::Paused);
            for (v, reason) in todo {
                self.reclaim_one(view, &mut inner, v, &reason, now);
            }
        }
        // Node pressure.
        let parent = self.parent.memory_stat();
        let psi = self
            .parent
            .pressure_text()
            .and_then(|t| pressure::parse_psi(&t))
            .or_else(pressure::host_psi)
            .map(|p| p.some_avg10);
        let input = pressure::PressureInput {
            working_set: parent.working_set(),
            budget: if self.budget_set {
                self.parent.budget()
            } else {
                None
            },
            psi_some_avg10: psi,
        };
        let th = pressure::Thresholds {
            high_ratio: self.cfg.pressure_high_ratio,
            psi_some_avg10: self.cfg.pressure_psi_some_avg10,
        };
        let reason = pressure::pressure_reason(&input, &th);
        let step = inner.episode.tick(reason.is_some());
        let (Some(step), Some(reason)) = (step, reason) else {
            return None;
        };
        let mut ordered: Vec<&ReclaimView> = be.clone();
        ordered.sort_by_key(|v| v.state != SandboxState::Paused);
        if !ordered.is_empty() {
            tracing::warn!(%reason, sandboxes = ordered.len(), "memory pressure: reclaiming best-effort sandboxes");
            self.metrics
                .memory_pressure_actions
                .with_label_values(&["reclaim"])
                .inc();
        }
        for v in &ordered {
            self.reclaim_one(view, &mut inner, v, &reason, now);
        }
        if step != pressure::Step::ReclaimAndPause || !self.cfg.pause_on_pressure {
            return None;
        }
        // The largest running best-effort sandbox.
        let largest = |state: SandboxState| {
            be.iter()
                .filter(|v| v.state == state)
                .map(|v| (v.cgroup.memory_stat().usage, v))
                .max_by_key(|(u, _)| *u)
                .map(|(_, v)| v.id.clone())
        };
        if let Some(id) = largest(SandboxState::Running) {
            return Some(PressureAction::Pause(
                id,
                format!("{reason}; reclaim did not relieve it"),
            ));
        }
        // Nothing left to pause: once the pause has had its ticks, end the largest paused one.
        if !self.cfg.stop_on_pressure || inner.episode.ticks() < pressure::STOP_AFTER_TICKS {
            return None;
        }
        let id = largest(SandboxState::Paused)?;
        // A new episode: the next stop waits until this one's memory is given back.
        inner.episode = pressure::Episode::default();
        Some(PressureAction::Stop(
            id,
            format!("{reason}; reclaim and pausing every best-effort sandbox did not relieve it"),
        ))
    }

    /// Warns once when the zram device holds 95% of its `disksize` (uncompressed): nothing
    /// more can be swapped, so reclaim only drops page cache until it drains.
    fn check_zram_fill(&self, inner: &mut Inner) {
        let Some(d) = &self.zram else { return };
        let Some((orig, _, used)) = self.zram_host.mm_stat(d.marker.device) else {
            return;
        };
        let full = orig.saturating_mul(100) >= d.marker.disksize_bytes.saturating_mul(95);
        if full && !inner.zram_full {
            tracing::warn!(
                device = d.marker.device,
                stored_mb = mib(orig),
                memory_mb = mib(used),
                disksize_mb = mib(d.marker.disksize_bytes),
                "reclaim: the zram swap tier is full (raise reclaim.zram_mb: it is the uncompressed capacity)"
            );
        }
        inner.zram_full = full;
    }

    fn reclaim_one(
        &self,
        view: &dyn SandboxView,
        inner: &mut Inner,
        v: &ReclaimView,
        reason: &str,
        now: u64,
    ) {
        let before = v.cgroup.memory_stat();
        let result = v.cgroup.reclaim_memory();
        let after = v.cgroup.memory_stat();
        let t = inner.tracks.entry(v.id.clone()).or_default();
        t.last_reclaim_ms = now;
        t.resident_after = after.working_set();
        t.reclaimed_state = Some(v.state);
        let request =
            json!({ "reason": reason, "mechanism": self.mechanism, "zram": self.zram.is_some() });
        match result {
            Ok(r) => {
                let method = match r.file {
                    dsec_runtime::cgroup::memory::ReclaimFile::ForceEmpty => {
                        "cgroup-v1-force_empty"
                    }
                    dsec_runtime::cgroup::memory::ReclaimFile::Reclaim => {
                        "cgroup-v2-memory.reclaim"
                    }
                };
                let partial = r.result == Reclaimed::Partial;
                let freed = before.usage.saturating_sub(after.usage);
                self.metrics
                    .reclaimed_bytes
                    .with_label_values(&[&v.id, self.mechanism])
                    .inc_by(freed);
                tracing::info!(sandbox = %v.id, %reason, method, partial, before_mb = mib(before.usage), after_mb = mib(after.usage), swap_mb = mib(after.swap), "reclaimed sandbox memory");
                view.note(
                    &v.id,
                    "reclaim",
                    request,
                    Ok(json!({
                        "method": method,
                        "partial": partial,
                        "usage_before_bytes": before.usage,
                        "usage_after_bytes": after.usage,
                        "anon_after_bytes": after.anon,
                        "swap_after_bytes": after.swap,
                    })),
                );
            }
            Err(e) => {
                tracing::warn!(sandbox = %v.id, error = %e, "reclaim sandbox memory");
                view.note(&v.id, "reclaim", request, Err(&e));
            }
        }
    }

    /// Stops the task, the kdamond, the budget and the swap tier (after the sandboxes are
    /// gone: swapoff then has nothing to bring back).
    pub async fn shutdown(self: &Arc<Self>) {
        if let Some(h) = lock(&self.task).take() {
            h.abort();
        }
        let me = self.clone();
        let done = tokio::task::spawn_blocking(move || me.teardown()).await;
        if let Err(e) = done {
            tracing::error!(error = %e, "reclaim teardown task");
        }
    }

    fn teardown(&self) {
        if let Some(d) = &self.damon {
            if let Err(e) = d.release() {
                tracing::warn!(error = %e, "reclaim: release the kdamond");
            }
        }
        if self.budget_set {
            if let Err(e) = self.parent.set_budget(None) {
                tracing::warn!(error = %e, "reclaim: lift the node memory budget");
            }
        }
        match self.zram_host.teardown(&self.zram_marker) {
            Ok(Some(n)) => tracing::info!(device = n, "reclaim: zram swap tier removed"),
            Ok(None) => {}
            Err(e) => tracing::warn!(error = %e, "reclaim: remove the zram swap tier"),
        }
    }
}

/// Samples a sandbox's CPU time; marks it active when it used more than
/// [`ACTIVE_CPU_PERCENT`] of a core since the last sample.
fn note_cpu(cg: &Cgroup, t: &mut Track, now: u64) {
    let Ok(ns) = cg.cpu_usage_ns() else { return };
    if t.cpu_seen_ms != 0 && cpu_active(t.cpu_ns_seen, ns, t.cpu_seen_ms, now) {
        t.cpu_active_ms = now;
    }
    t.cpu_ns_seen = ns;
    t.cpu_seen_ms = now;
}

/// True when CPU time grew from `ns0` to `ns1` by more than [`ACTIVE_CPU_PERCENT`] of the wall
/// time from `ms0` to `ms1` (a counter that went down — v1 sums live tasks only — is idle).
fn cpu_active(ns0: u64, ns1: u64, ms0: u64, ms1: u64) -> bool {
    let wall_ns = ms1.saturating_sub(ms0).saturating_mul(1_000_000);
    wall_ns > 0 && ns1.saturating_sub(ns0).saturating_mul(100) > wall_ns * ACTIVE_CPU_PERCENT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_activity() {
        // 1 s of wall time: 30 ms of CPU is 3%, active; 10 ms idle; a counter going down idle.
        assert!(cpu_active(0, 30_000_000, 1000, 2000));
        assert!(!cpu_active(0, 10_000_000, 1000, 2000));
        assert!(!cpu_active(50_000_000, 10_000_000, 1000, 2000));
        assert!(!cpu_active(0, 10_000_000, 1000, 1000));
    }

    #[test]
    fn config_defaults_and_validation() {
        let c = ReclaimConfig::default();
        assert!(!c.enabled);
        c.validate().unwrap();
        let bad = ReclaimConfig {
            mechanism: "magic".into(),
            ..Default::default()
        };
        assert_eq!(bad.validate().unwrap_err().key, "reclaim.mechanism");
        let bad = ReclaimConfig {
            pressure_high_ratio: 1.5,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
    }
}
