//! What the TTL reaper and the node's policies (QoS sampler, reclaim) see of the sandboxes
//! and may do to them.

use dsec_wire::api::EndReason;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::error::EdgeError;

use super::{lock, Entry, Manager};

impl Manager {
    /// What the TTL reaper needs to know about every live sandbox.
    fn ttl_views(&self) -> Vec<crate::ttl::TtlView> {
        let entries: Vec<Arc<Entry>> = lock(&self.state).live.values().cloned().collect();
        entries
            .iter()
            .filter(|e| !e.ended.initialized())
            .map(|e| {
                let i = lock(&e.info);
                crate::ttl::TtlView {
                    id: e.id.clone(),
                    state: i.state,
                    created_ms: e.created_ms,
                    last_request_ms: e.last_request_ms.load(Ordering::SeqCst),
                    busy: e.inflight.load(Ordering::SeqCst) > 0,
                    ttl_running_stop: i.ttl_running_stop,
                    ttl_total: i.ttl_total,
                    ttl_action: i.ttl_action,
                }
            })
            .collect()
    }

    /// What the node's policies (QoS sampler, reclaim) see of every live sandbox.
    fn snapshots(&self) -> Vec<dsec_node::SandboxSnapshot> {
        let entries: Vec<Arc<Entry>> = lock(&self.state).live.values().cloned().collect();
        entries
            .iter()
            .filter(|e| !e.ended.initialized())
            .map(|e| {
                let i = lock(&e.info);
                dsec_node::SandboxSnapshot {
                    id: e.id.clone(),
                    state: i.state,
                    qos: i.qos,
                    last_request_ms: e.last_request_ms.load(Ordering::SeqCst),
                    busy: e.inflight.load(Ordering::SeqCst) > 0,
                    cgroup: e.sandbox.cgroup().cloned(),
                }
            })
            .collect()
    }

    /// This manager as the node policies' view of the sandboxes.
    pub fn view(self: &Arc<Self>) -> std::sync::Weak<dyn dsec_node::SandboxView> {
        let weak: std::sync::Weak<Manager> = Arc::downgrade(self);
        weak
    }

    /// Starts the reclaim policy (`[edge.reclaim]`; None when disabled).
    pub async fn start_reclaim(self: &Arc<Self>) -> Option<Arc<dsec_node::reclaim::Reclaim>> {
        let m = &self.metrics;
        dsec_node::reclaim::Reclaim::start(
            self.cfg.reclaim.clone(),
            dsec_node::reclaim::ReclaimPlace {
                cgroup_parent: self.cfg.cgroup_parent(),
                state_dir: self.cfg.edge_dir().join("reclaim"),
            },
            dsec_node::reclaim::ReclaimMetrics {
                reclaimed_bytes: m.reclaimed_bytes.clone(),
                memory_pressure_actions: m.memory_pressure_actions.clone(),
            },
            self.view(),
        )
        .await
    }
}

impl dsec_node::SandboxView for Manager {
    fn sandboxes(&self) -> Vec<dsec_node::SandboxSnapshot> {
        self.snapshots()
    }

    fn pause_for_pressure<'a>(
        &'a self,
        id: &'a str,
        reason: &'a str,
    ) -> dsec_node::BoxFut<'a, Result<(), dsec_node::ViewError>> {
        Box::pin(async move {
            Manager::pause_for_pressure(self, id, reason)
                .await
                .map_err(|e| Box::new(e) as dsec_node::ViewError)
        })
    }

    fn stop_for_pressure<'a>(&'a self, id: &'a str, reason: &'a str) -> dsec_node::BoxFut<'a, ()> {
        Box::pin(Manager::stop_because(
            self,
            id,
            EndReason::MemoryPressure,
            reason.to_string(),
        ))
    }

    fn note(
        &self,
        id: &str,
        kind: &str,
        request: serde_json::Value,
        result: Result<serde_json::Value, &(dyn std::error::Error + Send + Sync + 'static)>,
    ) {
        match result {
            Ok(v) => self.traj.note(id, kind, request, Ok(v)),
            Err(e) => {
                let err = EdgeError::internal(kind, e);
                self.traj.note(id, kind, request, Err(&err));
            }
        }
    }
}

impl crate::ttl::Reapable for Manager {
    fn ttl_views(&self) -> Vec<crate::ttl::TtlView> {
        Manager::ttl_views(self)
    }

    fn stop_because<'a>(
        &'a self,
        id: &'a str,
        end: EndReason,
        reason: String,
    ) -> dsec_runtime::substrate::BoxFut<'a, ()> {
        Box::pin(Manager::stop_because(self, id, end, reason))
    }

    fn pause_idle<'a>(
        &'a self,
        id: &'a str,
        seen_last_request_ms: u64,
    ) -> dsec_runtime::substrate::BoxFut<'a, ()> {
        Box::pin(Manager::pause_idle(self, id, seen_last_request_ms))
    }
}
