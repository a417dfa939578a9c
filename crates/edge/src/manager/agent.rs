//! The agent of a running sandbox lent to calls that talk to it directly (process handles,
//! file watch, rename: [`crate::processes`], [`crate::watch`]) and what the metrics sampler
//! ([`crate::metrics_sampler`]) measures of every sandbox.

use std::sync::Arc;

use bytes::Bytes;
use dsec_runtime::aether_client::{AetherClient, ChannelError};
use dsec_wire::aether::{Reply, Request};
use dsec_wire::api::SandboxState;

use super::{lock, Busy, Entry, Manager};
use crate::error::{EdgeError, Subject};
use crate::trajectory::Trajectories;

/// A running sandbox's agent, lent to one call: the sandbox counts as busy (its idle TTL
/// waits) while the lease lives, so a client following a process's output keeps it alive.
pub struct AgentLease {
    pub client: AetherClient,
    pub sandbox: String,
    traj: Arc<Trajectories>,
    _busy: Busy,
}

impl AgentLease {
    /// A channel error of this sandbox as an API error.
    pub fn chan(&self, e: ChannelError) -> EdgeError {
        EdgeError::from_channel(&self.sandbox, Subject::Other, e)
    }

    /// One request to the agent; its terminal reply.
    pub async fn ask(&self, req: Request, body: Bytes) -> Result<Reply, EdgeError> {
        let (reply, _) = self
            .client
            .request(req, body)
            .await
            .map_err(|e| self.chan(e))?;
        Ok(reply)
    }

    /// Records a call in the sandbox's trajectory log (never fails the call).
    pub fn note_value(
        &self,
        kind: &str,
        request: serde_json::Value,
        result: Result<serde_json::Value, &EdgeError>,
    ) {
        self.traj.note(&self.sandbox, kind, request, result);
    }
}

impl Manager {
    /// A running sandbox's agent for process handles, watches and file moves: resumes a
    /// paused sandbox first and keeps it busy while the lease lives.
    pub async fn agent_lease(&self, id: &str) -> Result<AgentLease, EdgeError> {
        let e = self.touch(id).await?;
        Ok(AgentLease {
            client: e.0.aether.clone(),
            sandbox: id.to_string(),
            traj: self.traj.clone(),
            _busy: e,
        })
    }

    /// What the metrics sampler measures of every live sandbox.
    fn metric_sources(&self) -> Vec<crate::metrics_sampler::Source> {
        let entries: Vec<Arc<Entry>> = lock(&self.state).live.values().cloned().collect();
        entries
            .iter()
            .filter(|e| !e.ended.initialized())
            .map(|e| {
                let usage = e.sandbox.usage();
                let host_pids = match e.sandbox.cgroup() {
                    Some(cg) => cg.procs().unwrap_or_default(),
                    None => vec![e.sandbox.pid()]
                        .into_iter()
                        .filter(|p| *p > 0)
                        .collect(),
                };
                crate::metrics_sampler::Source {
                    id: e.id.clone(),
                    client: e.aether.clone(),
                    memory_bytes: usage.memory_bytes,
                    memory_limit_bytes: e.memory_mb * 1024 * 1024,
                    cpu_limit_cores: e.cpu,
                    pids: usage.pids,
                    guest_kernel: host_pids.is_empty(),
                    host_pids,
                    paused: lock(&e.info).state != SandboxState::Running,
                }
            })
            .collect()
    }
}

impl crate::metrics_sampler::Sampled for Manager {
    fn metric_sources(&self) -> Vec<crate::metrics_sampler::Source> {
        Manager::metric_sources(self)
    }

    fn sampler(&self) -> &Arc<crate::metrics_sampler::Sampler> {
        &self.metrics.sandbox_samples
    }
}
