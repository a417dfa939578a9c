//! Prometheus metrics of the apiserver.

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub forward_seconds: HistogramVec,
    pub forward_errors: IntCounterVec,
    pub sandboxes_created: IntCounter,
    pub quota_refusals: IntCounter,
    pub placement_refusals: IntCounter,
    pub edge_refusals: IntCounter,
    pub overflow_placements: IntCounter,
    pub sandboxfusion_unauthorized: IntCounter,
    /// Time creates with `wait_s` spent from arrival to their answer, by outcome.
    pub queue_wait_seconds: HistogramVec,
    /// Creates with `wait_s` waiting in the burst queue now.
    pub queue_waiting: IntGauge,
}

fn counter(name: &str, help: &str) -> IntCounter {
    IntCounter::new(name, help).expect("static metric definition")
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "dsec_api_requests_total",
                "API requests by route and status",
            ),
            &["method", "route", "status"],
        )
        .expect("static metric definition");
        let forward_seconds = HistogramVec::new(
            HistogramOpts::new(
                "dsec_api_forward_seconds",
                "Time until an edge's answer headers arrive, by route",
            )
            .buckets(vec![
                0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0,
            ]),
            &["route"],
        )
        .expect("static metric definition");
        let forward_errors = IntCounterVec::new(
            Opts::new(
                "dsec_api_forward_errors_total",
                "Forwards that could not reach an edge",
            ),
            &["node"],
        )
        .expect("static metric definition");
        let sandboxes_created = counter(
            "dsec_api_sandboxes_created_total",
            "Sandboxes this apiserver placed",
        );
        let quota_refusals = counter(
            "dsec_api_quota_refusals_total",
            "Creates refused by a project quota",
        );
        let placement_refusals = counter(
            "dsec_api_placement_refusals_total",
            "Creates refused because no node had room",
        );
        let edge_refusals = counter(
            "dsec_api_edge_refusals_total",
            "Edge admission refusals that were retried on another node",
        );
        let overflow_placements = counter(
            "dsec_api_overflow_placements_total",
            "Sandboxes sent to the overflow pool",
        );
        let sandboxfusion_unauthorized = counter(
            "dsec_api_sandboxfusion_unauthorized_total",
            "SandboxFusion-compatible calls refused for a missing or invalid key in the URL",
        );
        let queue_wait_seconds = HistogramVec::new(
            HistogramOpts::new(
                "dsec_api_queue_wait_seconds",
                "Creates with wait_s: time from arrival to the answer, by outcome (placed, refused, error)",
            )
            .buckets(vec![
                0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
                1800.0,
            ]),
            &["outcome"],
        )
        .expect("static metric definition");
        let queue_waiting = IntGauge::new(
            "dsec_api_queue_waiting",
            "Creates with wait_s waiting in the burst queue",
        )
        .expect("static metric definition");
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(queue_wait_seconds.clone()),
            Box::new(queue_waiting.clone()),
            Box::new(forward_seconds.clone()),
            Box::new(forward_errors.clone()),
            Box::new(sandboxes_created.clone()),
            Box::new(quota_refusals.clone()),
            Box::new(placement_refusals.clone()),
            Box::new(edge_refusals.clone()),
            Box::new(overflow_placements.clone()),
            Box::new(sandboxfusion_unauthorized.clone()),
        ] {
            registry.register(c).expect("metric registered once");
        }
        Metrics {
            registry,
            requests,
            forward_seconds,
            forward_errors,
            sandboxes_created,
            quota_refusals,
            placement_refusals,
            edge_refusals,
            overflow_placements,
            sandboxfusion_unauthorized,
            queue_wait_seconds,
            queue_waiting,
        }
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        let enc = TextEncoder::new();
        if let Err(e) = enc.encode(&self.registry.gather(), &mut buf) {
            tracing::error!(error = %e, "encode metrics");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
