//! Prometheus metrics of one edge (`GET /metrics`, text format, unauthenticated).

use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

/// Every metric the edge exports. Counters are atomics: cheap on hot paths.
pub struct Metrics {
    registry: Registry,
    /// Per-sandbox resource samples (issue 18), exported on the same registry.
    pub sandbox_samples: std::sync::Arc<crate::metrics_sampler::Sampler>,
    pub sandboxes_created: IntCounter,
    pub sandboxes_stopped: IntCounter,
    pub sandboxes_failed: IntCounter,
    pub sandboxes_create_errors: IntCounter,
    pub sandboxes_running: IntGauge,
    /// Port tunnels (exposed ports) open right now.
    pub port_tunnels_open: IntGauge,
    pub create_seconds: Histogram,
    /// Labels: `kind` = shell | exec.
    pub commands: IntCounterVec,
    /// Labels: `route`, `method`, `status`.
    pub http_requests: IntCounterVec,
    /// Bytes the reclaim policy took out of a sandbox. Labels: `sandbox`, `mechanism`.
    pub reclaimed_bytes: IntCounterVec,
    /// Node memory pressure actions. Labels: `action` = reclaim | pause.
    pub memory_pressure_actions: IntCounterVec,
    /// microVM creates by how the guest started. Labels: `boot` = cold | template |
    /// cold-fallback.
    pub vm_boots: IntCounterVec,
}

impl Metrics {
    pub fn new(node: &str) -> Self {
        let registry = Registry::new_custom(
            Some("dsec_edge".into()),
            Some([("node".to_string(), node.to_string())].into()),
        )
        .expect("metric prefix and labels are valid");
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("valid metric");
            registry
                .register(Box::new(c.clone()))
                .expect("metric registered once");
            c
        };
        let sandboxes_created =
            counter("sandboxes_created_total", "Sandboxes created successfully");
        let sandboxes_stopped = counter("sandboxes_stopped_total", "Sandboxes stopped on request");
        let sandboxes_failed =
            counter("sandboxes_failed_total", "Sandboxes that died on their own");
        let sandboxes_create_errors =
            counter("sandbox_create_errors_total", "Create requests that failed");
        let sandboxes_running = IntGauge::new("sandboxes_running", "Sandboxes currently running")
            .expect("valid metric");
        registry
            .register(Box::new(sandboxes_running.clone()))
            .expect("metric registered once");
        let port_tunnels_open = IntGauge::new(
            "port_tunnels_open",
            "Connections to sandbox ports (exposed ports) open right now",
        )
        .expect("valid metric");
        registry
            .register(Box::new(port_tunnels_open.clone()))
            .expect("metric registered once");
        let create_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "sandbox_create_seconds",
                "Time from create request to sandbox ready",
            )
            .buckets(vec![
                0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            ]),
        )
        .expect("valid metric");
        registry
            .register(Box::new(create_seconds.clone()))
            .expect("metric registered once");
        let commands = IntCounterVec::new(
            Opts::new("commands_total", "Commands run in sandboxes"),
            &["kind"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(commands.clone()))
            .expect("metric registered once");
        let http_requests = IntCounterVec::new(
            Opts::new("http_requests_total", "HTTP requests by route and status"),
            &["route", "method", "status"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(http_requests.clone()))
            .expect("metric registered once");
        let reclaimed_bytes = IntCounterVec::new(
            Opts::new(
                "reclaimed_bytes_total",
                "Memory reclaimed from sandboxes by the reclaim policy",
            ),
            &["sandbox", "mechanism"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(reclaimed_bytes.clone()))
            .expect("metric registered once");
        let memory_pressure_actions = IntCounterVec::new(
            Opts::new(
                "memory_pressure_actions_total",
                "Actions taken under node memory pressure",
            ),
            &["action"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(memory_pressure_actions.clone()))
            .expect("metric registered once");
        let vm_boots = IntCounterVec::new(
            Opts::new(
                "vm_boots_total",
                "VM sandboxes created, by boot: cold, template (restored from a template snapshot), cold-fallback",
            ),
            &["boot"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(vm_boots.clone()))
            .expect("metric registered once");
        let sandbox_samples = crate::metrics_sampler::Sampler::new(&registry);
        Self {
            vm_boots,
            sandbox_samples,
            registry,
            sandboxes_created,
            sandboxes_stopped,
            sandboxes_failed,
            sandboxes_create_errors,
            sandboxes_running,
            port_tunnels_open,
            create_seconds,
            commands,
            http_requests,
            reclaimed_bytes,
            memory_pressure_actions,
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::warn!(error = %e, "encode metrics");
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_text() {
        let m = Metrics::new("n0");
        m.sandboxes_created.inc();
        m.commands.with_label_values(&["shell"]).inc();
        m.http_requests
            .with_label_values(&["/edge/v1/status", "GET", "200"])
            .inc();
        let text = m.render();
        assert!(
            text.contains("dsec_edge_sandboxes_created_total{node=\"n0\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("dsec_edge_commands_total{kind=\"shell\",node=\"n0\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("dsec_edge_sandbox_create_seconds_bucket"),
            "{text}"
        );
    }
}
