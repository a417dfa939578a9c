//! Per-sandbox resource metrics, sampled over time.
//!
//! Every [`INTERVAL`] the sampler takes one sample of every running sandbox: CPU time (the
//! kernel's accounting of the sandbox cgroup's processes, read on the host), memory and pids
//! (the cgroup), and disk and network bytes (measured by the sandbox's agent from inside, where
//! the sandbox's root and network namespace are). It keeps the last [`HISTORY`] samples per
//! sandbox for `GET .../metrics` and exports the newest as gauges on the edge's `/metrics`
//! with a `sandbox` label; a sandbox that ends is dropped from both.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use dsec_runtime::aether_client::AetherClient;
use dsec_wire::aether::{Reply, Request};
use dsec_wire::api::{AgentStats, MetricsSample, SandboxMetrics};
use prometheus::{GaugeVec, Opts, Registry};

/// Time between samples.
pub const INTERVAL: Duration = Duration::from_secs(2);
/// Samples kept per sandbox (two minutes).
pub const HISTORY: usize = 60;
/// How long one agent may take to answer `Stats`.
const AGENT_TIMEOUT: Duration = Duration::from_secs(2);
/// Agents asked at once.
const CONCURRENCY: usize = 32;

/// What the manager knows about one running sandbox at sampling time.
pub struct Source {
    pub id: String,
    pub client: AetherClient,
    pub memory_bytes: u64,
    pub memory_limit_bytes: u64,
    pub cpu_limit_cores: f64,
    pub pids: u64,
    /// Host pids of every process of the sandbox (its cgroup), for the CPU time.
    pub host_pids: Vec<i32>,
    /// True for VM guests: their CPU time and memory come from the guest's own kernel when the
    /// host has no processes to account (no cgroup).
    pub guest_kernel: bool,
    /// A paused sandbox keeps its history but is not measured (its agent is frozen).
    pub paused: bool,
}

/// What the sampler sees of the node (implemented by the manager).
pub trait Sampled: Send + Sync + 'static {
    /// Every live sandbox.
    fn metric_sources(&self) -> Vec<Source>;
    fn sampler(&self) -> &Arc<Sampler>;
}

/// Samples every [`INTERVAL`] until the manager is gone.
pub fn spawn<T: Sampled>(target: &Arc<T>) -> tokio::task::JoinHandle<()> {
    let weak = Arc::downgrade(target);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(m) = weak.upgrade() else { return };
            let sources = m.metric_sources();
            let sampler = m.sampler().clone();
            drop(m);
            sampler.round(sources).await;
        }
    })
}

/// Seconds of CPU used by a process and its waited-for descendants (`/proc/PID/stat` fields
/// 14-17: utime stime cutime cstime).
pub fn parse_stat_cpu_ticks(stat: &str) -> u64 {
    // The command name (field 2) may hold spaces and parentheses: fields start after the last ')'.
    let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
        return 0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state); utime is field 14 → index 11.
    (11..15)
        .filter_map(|i| f.get(i).and_then(|v| v.parse::<u64>().ok()))
        .sum()
}

fn cpu_seconds(pids: &[i32]) -> f64 {
    // SAFETY: sysconf takes an int name and no pointers.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let total: u64 = pids
        .iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/stat")).ok())
        .map(|s| parse_stat_cpu_ticks(&s))
        .sum();
    total as f64 / ticks
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// CPU percent of one core between two samples.
pub fn cpu_percent(prev: Option<&MetricsSample>, cur: &MetricsSample) -> f64 {
    let Some(p) = prev else { return 0.0 };
    let dt = cur.time_ms.saturating_sub(p.time_ms) as f64 / 1000.0;
    if dt <= 0.0 {
        return 0.0;
    }
    ((cur.cpu_time_s - p.cpu_time_s).max(0.0) / dt * 100.0).max(0.0)
}

struct Gauges {
    cpu_seconds: GaugeVec,
    cpu_percent: GaugeVec,
    memory: GaugeVec,
    memory_limit: GaugeVec,
    disk_used: GaugeVec,
    disk_limit: GaugeVec,
    net_rx: GaugeVec,
    net_tx: GaugeVec,
    pids: GaugeVec,
}

impl Gauges {
    fn new(reg: &Registry) -> Self {
        let g = |name: &str, help: &str| {
            let v = GaugeVec::new(Opts::new(name, help), &["sandbox"]).expect("gauge");
            if let Err(e) = reg.register(Box::new(v.clone())) {
                tracing::warn!(metric = name, error = %e, "register sandbox metric");
            }
            v
        };
        Gauges {
            cpu_seconds: g("sandbox_cpu_seconds", "CPU time used by the sandbox"),
            cpu_percent: g("sandbox_cpu_percent", "CPU use in percent of one core"),
            memory: g("sandbox_memory_bytes", "Memory used by the sandbox"),
            memory_limit: g("sandbox_memory_limit_bytes", "The sandbox's memory limit"),
            disk_used: g("sandbox_disk_used_bytes", "Disk used by the sandbox's root"),
            disk_limit: g("sandbox_disk_limit_bytes", "Size of the sandbox's root fs"),
            net_rx: g("sandbox_network_rx_bytes", "Bytes received by the sandbox"),
            net_tx: g("sandbox_network_tx_bytes", "Bytes sent by the sandbox"),
            pids: g("sandbox_pids", "Processes of the sandbox"),
        }
    }

    fn all(&self) -> [&GaugeVec; 9] {
        [
            &self.cpu_seconds,
            &self.cpu_percent,
            &self.memory,
            &self.memory_limit,
            &self.disk_used,
            &self.disk_limit,
            &self.net_rx,
            &self.net_tx,
            &self.pids,
        ]
    }

    fn set(&self, id: &str, s: &MetricsSample) {
        let l = &[id];
        self.cpu_seconds.with_label_values(l).set(s.cpu_time_s);
        self.cpu_percent.with_label_values(l).set(s.cpu_percent);
        self.memory.with_label_values(l).set(s.memory_bytes as f64);
        self.memory_limit
            .with_label_values(l)
            .set(s.memory_limit_bytes as f64);
        self.disk_used
            .with_label_values(l)
            .set(s.disk_used_bytes as f64);
        self.disk_limit
            .with_label_values(l)
            .set(s.disk_limit_bytes as f64);
        self.net_rx.with_label_values(l).set(s.net_rx_bytes as f64);
        self.net_tx.with_label_values(l).set(s.net_tx_bytes as f64);
        self.pids.with_label_values(l).set(s.pids as f64);
    }

    fn remove(&self, id: &str) {
        for g in self.all() {
            let _ = g.remove_label_values(&[id]);
        }
    }
}

/// The sampler's state: history per sandbox and the gauges.
pub struct Sampler {
    history: Mutex<HashMap<String, VecDeque<MetricsSample>>>,
    gauges: Gauges,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn agent_stats(client: &AetherClient) -> Option<AgentStats> {
    let call = client.request(Request::Stats, Bytes::new());
    match tokio::time::timeout(AGENT_TIMEOUT, call).await {
        Ok(Ok((Reply::Stats(s), _))) => Some(s),
        _ => None,
    }
}

impl Sampler {
    pub fn new(reg: &Registry) -> Arc<Self> {
        Arc::new(Sampler {
            history: Mutex::new(HashMap::new()),
            gauges: Gauges::new(reg),
        })
    }

    /// The history of one sandbox (empty when it was not sampled yet).
    pub fn metrics(&self, id: &str) -> SandboxMetrics {
        SandboxMetrics {
            sandbox_id: id.to_string(),
            interval_s: INTERVAL.as_secs_f64(),
            samples: lock(&self.history)
                .get(id)
                .map(|h| h.iter().cloned().collect())
                .unwrap_or_default(),
        }
    }

    /// Measures one sandbox now.
    pub async fn measure(src: &Source) -> MetricsSample {
        let agent = agent_stats(&src.client).await.unwrap_or_default();
        let host_cpu = cpu_seconds(&src.host_pids);
        let (cpu_time_s, memory_bytes) = if src.guest_kernel && src.host_pids.is_empty() {
            (agent.kernel_cpu_time_s, agent.kernel_memory_used_bytes)
        } else {
            (host_cpu, src.memory_bytes)
        };
        MetricsSample {
            time_ms: now_ms(),
            cpu_time_s,
            cpu_percent: 0.0,
            cpu_limit_cores: src.cpu_limit_cores,
            memory_bytes,
            memory_limit_bytes: src.memory_limit_bytes,
            disk_used_bytes: agent.disk_used_bytes,
            disk_limit_bytes: agent.disk_total_bytes,
            net_rx_bytes: agent.net_rx_bytes,
            net_tx_bytes: agent.net_tx_bytes,
            pids: src.pids,
        }
    }

    /// Records a sample of `id` (computing its CPU percent from the previous one).
    pub fn record(&self, id: &str, mut s: MetricsSample) {
        let mut h = lock(&self.history);
        let q = h.entry(id.to_string()).or_default();
        s.cpu_percent = cpu_percent(q.back(), &s);
        self.gauges.set(id, &s);
        q.push_back(s);
        while q.len() > HISTORY {
            q.pop_front();
        }
    }

    /// One round over the running sandboxes; forgets the ones that are gone.
    pub async fn round(self: &Arc<Self>, sources: Vec<Source>) {
        let live: std::collections::HashSet<String> =
            sources.iter().map(|s| s.id.clone()).collect();
        let gone: Vec<String> = lock(&self.history)
            .keys()
            .filter(|k| !live.contains(*k))
            .cloned()
            .collect();
        for id in gone {
            lock(&self.history).remove(&id);
            self.gauges.remove(&id);
        }
        use futures::StreamExt as _;
        let me = self.clone();
        futures::stream::iter(sources.into_iter().filter(|s| !s.paused))
            .for_each_concurrent(CONCURRENCY, |src| {
                let me = me.clone();
                async move {
                    let s = Sampler::measure(&src).await;
                    me.record(&src.id, s);
                }
            })
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_after_the_command_name() {
        let s = "42 (a (b) c) S 1 42 42 0 -1 4194560 100 0 0 0 7 3 2 1 20 0 1 0 100 1000 10";
        assert_eq!(parse_stat_cpu_ticks(s), 7 + 3 + 2 + 1);
        assert_eq!(parse_stat_cpu_ticks("garbage"), 0);
    }

    #[test]
    fn percent_of_one_core() {
        let a = MetricsSample {
            time_ms: 1000,
            cpu_time_s: 1.0,
            ..Default::default()
        };
        let b = MetricsSample {
            time_ms: 3000,
            cpu_time_s: 4.0,
            ..Default::default()
        };
        assert!((cpu_percent(Some(&a), &b) - 150.0).abs() < 1e-9);
        assert_eq!(cpu_percent(None, &b), 0.0);
    }

    #[test]
    fn history_is_bounded_and_gauges_follow_the_live_set() {
        let reg = Registry::new();
        let s = Sampler::new(&reg);
        for i in 0..(HISTORY as u64 + 5) {
            s.record(
                "sb-a",
                MetricsSample {
                    time_ms: i * 1000,
                    ..Default::default()
                },
            );
        }
        assert_eq!(s.metrics("sb-a").samples.len(), HISTORY);
        assert_eq!(s.metrics("sb-a").samples[0].time_ms, 5000);
        let text = |reg: &Registry| {
            use prometheus::Encoder as _;
            let mut buf = Vec::new();
            prometheus::TextEncoder::new()
                .encode(&reg.gather(), &mut buf)
                .unwrap();
            String::from_utf8(buf).unwrap()
        };
        assert!(text(&reg).contains("sandbox_pids{sandbox=\"sb-a\"}"));
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(s.round(Vec::new()));
        assert!(s.metrics("sb-a").samples.is_empty());
        assert!(!text(&reg).contains("sb-a"));
    }
}
