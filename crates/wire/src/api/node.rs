//! Nodes: edge status, capabilities and admission (`/v1/nodes`, `/edge/v1/status`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Substrate;

/// An edge's view of itself (`GET /edge/v1/status`), polled by the watcher.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeStatus {
    pub node: String,
    pub url: String,
    pub healthy: bool,
    pub substrates: Vec<Substrate>,
    pub sandboxes_running: u64,
    pub sandboxes_paused: u64,
    pub capacity_sandboxes: u64,
    pub cpu_cores_total: f64,
    pub cpu_cores_allocated: f64,
    pub memory_mb_total: u64,
    pub memory_mb_allocated: u64,
    pub memory_mb_available: u64,
    pub images: Vec<String>,
    pub cgroup_version: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Kernel features for QoS and reclaim, detected at edge start (issue 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<NodeCapabilities>,
    /// Admission by measured usage (issue 10): what the node would still admit per class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<AdmissionStatus>,
    /// Membership (issue 22): state, pool, heartbeats; added by the apiserver.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub membership: Option<super::NodeMembership>,
}

/// One kernel feature: present or not, and what was seen (`EINVAL`, the file checked, ...).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Capability {
    pub available: bool,
    #[serde(default)]
    pub detail: String,
}

/// Kernel features the edge found at start.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default)]
pub struct NodeCapabilities {
    /// `v1` or `v2`.
    pub cgroup_version: String,
    /// `cpu.idle` on the cpu controller (SCHED_IDLE cgroups).
    pub cpu_idle: Capability,
    /// `prctl(PR_SCHED_CORE)` core-scheduling cookies.
    pub core_scheduling: Capability,
    /// The SCHED_IDLE scheduling policy for tasks.
    pub sched_idle: Capability,
    /// Simultaneous multithreading (sibling hardware threads).
    pub smt: Capability,
    /// Pressure stall information (`/proc/pressure`).
    pub psi: Capability,
    /// DAMON through sysfs.
    pub damon: Capability,
    /// zram compressed block devices.
    pub zram: Capability,
    /// Kernel same-page merging.
    pub ksm: Capability,
    /// cgroup `favordynmods` held on (cheap `cgroup.procs` moves: no RCU grace period per move).
    pub cgroup_favordynmods: Capability,
}

/// Admission figures of one node (memory in MiB, CPU in cores). `used` is the measured
/// working set / CPU use of the node's sandboxes plus reservations of those still starting;
/// `free_*` is the largest request of that class the node admits now.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default)]
pub struct AdmissionStatus {
    pub memory_mb_used: u64,
    pub cpu_cores_used: f64,
    pub memory_mb_committed_ls: u64,
    pub cpu_cores_committed_ls: f64,
    pub memory_mb_committed_be: u64,
    pub cpu_cores_committed_be: f64,
    pub memory_mb_free_ls: u64,
    pub cpu_cores_free_ls: f64,
    pub memory_mb_free_be: u64,
    pub cpu_cores_free_be: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeList {
    pub nodes: Vec<NodeStatus>,
}
