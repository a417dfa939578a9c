//! Node policies of one edge: what the node can do and how much it admits, and how it keeps
//! memory in hand.
//!
//! * [`qos`] — QoS classes, the kernel capabilities behind them ([`qos::caps`]), overcommit
//!   admission by measured usage ([`qos::admission`]) and the usage sampler.
//! * [`reclaim`] — cold-memory reclaim (DAMON or cgroup-driven), the zram swap tier, the node
//!   memory budget and memory pressure (reclaim, then pause, then — when enabled — end
//!   best-effort sandboxes).
//!
//! What this crate owns: the policy decisions and the node-wide kernel objects they need
//! (the zram device, the kdamond). What it must not do: keep sandbox state, touch a sandbox's
//! cgroup files directly or by naming convention (every cgroup read and write goes through
//! `dsec_runtime::cgroup` on the [`Cgroup`] a [`SandboxView`] hands out), or depend on the edge
//! crate. It reaches sandboxes only through [`SandboxView`], which the edge's manager
//! implements.

pub mod qos;
pub mod reclaim;

use std::future::Future;
use std::pin::Pin;

use dsec_runtime::cgroup::Cgroup;
use dsec_wire::api::{QosClass, SandboxState};

/// A boxed `Send` future (the view trait is object-safe).
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A boxed error from the edge's side of the view (only logged here).
pub type ViewError = Box<dyn std::error::Error + Send + Sync>;

/// One live sandbox as the node's policies see it.
#[derive(Debug, Clone)]
pub struct SandboxSnapshot {
    pub id: String,
    pub state: SandboxState,
    pub qos: QosClass,
    /// When the last request arrived (ms since the epoch).
    pub last_request_ms: u64,
    /// A request is running in it right now.
    pub busy: bool,
    /// The host cgroup its processes and memory are charged to (containers); `None` for a
    /// sandbox whose memory the host cannot measure or reclaim by cgroup (a VM).
    pub cgroup: Option<Cgroup>,
}

/// What the node's policies may see and do of the edge's sandboxes.
pub trait SandboxView: Send + Sync + 'static {
    /// Every live sandbox (not ended).
    fn sandboxes(&self) -> Vec<SandboxSnapshot>;
    /// Pauses a sandbox because the node is short of memory (`reason` goes into its info and
    /// trajectory).
    fn pause_for_pressure<'a>(
        &'a self,
        id: &'a str,
        reason: &'a str,
    ) -> BoxFut<'a, Result<(), ViewError>>;
    /// Ends a sandbox because the node is short of memory and pausing did not relieve it
    /// (end reason `memory_pressure`; `reason` is its detail).
    fn stop_for_pressure<'a>(&'a self, id: &'a str, reason: &'a str) -> BoxFut<'a, ()>;
    /// Records a state change the policy made in the sandbox's trajectory.
    fn note(
        &self,
        id: &str,
        kind: &str,
        request: serde_json::Value,
        result: Result<serde_json::Value, &(dyn std::error::Error + Send + Sync + 'static)>,
    );
}

/// A bad `[edge.qos]` / `[edge.reclaim]` value: which key, and what is allowed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct NodeConfigError {
    pub key: &'static str,
    pub message: String,
}

impl NodeConfigError {
    pub(crate) fn new(key: &'static str, message: impl Into<String>) -> Self {
        NodeConfigError {
            key,
            message: message.into(),
        }
    }
}

/// Milliseconds since the epoch (the clock of [`SandboxSnapshot::last_request_ms`]).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
