//! Resource metrics of one sandbox, sampled over time by its edge
//! (`GET /v1/sandboxes/{id}/metrics`).

use serde::{Deserialize, Serialize};

/// One sample.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MetricsSample {
    /// When it was taken, milliseconds since the Unix epoch.
    pub time_ms: u64,
    /// CPU time used by the sandbox's processes since it started, in seconds.
    pub cpu_time_s: f64,
    /// CPU use since the previous sample, in percent of one core (200 = two cores busy).
    pub cpu_percent: f64,
    /// The sandbox's CPU limit in cores.
    pub cpu_limit_cores: f64,
    pub memory_bytes: u64,
    pub memory_limit_bytes: u64,
    /// Bytes used and size of the file system of the sandbox's root as its agent sees it (its
    /// writable layer's own file system when the sandbox has a disk limit).
    pub disk_used_bytes: u64,
    pub disk_limit_bytes: u64,
    /// Bytes received and sent on the sandbox's network interfaces (loopback excluded).
    pub net_rx_bytes: u64,
    pub net_tx_bytes: u64,
    /// Processes (tasks counted against the pids limit).
    pub pids: u64,
}

/// `GET /v1/sandboxes/{id}/metrics`: the newest sample first is `samples.last()`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SandboxMetrics {
    pub sandbox_id: String,
    /// Seconds between the edge's samples.
    pub interval_s: f64,
    /// Oldest first; at most the edge's history length.
    pub samples: Vec<MetricsSample>,
}

/// What a sandbox's agent measures from inside (the `Stats` request).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
pub struct AgentStats {
    pub disk_used_bytes: u64,
    pub disk_total_bytes: u64,
    pub net_rx_bytes: u64,
    pub net_tx_bytes: u64,
    /// The kernel's CPU time of everything (a VM guest's own kernel; meaningless in a container,
    /// whose kernel is the host's).
    pub kernel_cpu_time_s: f64,
    /// `MemTotal - MemAvailable` of the kernel the agent runs on (same caveat).
    pub kernel_memory_used_bytes: u64,
}
