//! Why a sandbox ended: a machine-readable cause that tells the platform's doing apart from
//! the agent's, so an RL trainer can mask rollouts that infrastructure killed instead of
//! learning from a fake zero reward.
//!
//! Every ended sandbox (state `stopped` or `failed`) carries one in
//! [`SandboxInfo::end_reason`](super::SandboxInfo::end_reason), with a human-readable
//! [`end_detail`](super::SandboxInfo::end_detail); the same pair is in the last record of its
//! trajectory, and `GET /v1/sandboxes?end_reason=R` lists the ended sandboxes with that cause.

use serde::{Deserialize, Serialize};

/// The cause of a sandbox's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    /// A client stopped it (`DELETE /v1/sandboxes/{id}`, `POST /v1/jobs/stop`).
    StoppedByUser,
    /// The idle TTL (`ttl_running_stop`) ran out.
    TtlIdle,
    /// The hard lifetime (`ttl_total`) ran out.
    TtlTotal,
    /// The sandbox's memory limit OOM-killed its init (aether): the workload used too much
    /// memory.
    OomKilledPid1,
    /// The node holding the sandbox stopped answering and did not come back within the grace.
    NodeLost,
    /// The edge restarted and could not re-adopt the sandbox (its agent was gone or its record
    /// unreadable).
    EdgeRestartNotAdopted,
    /// The platform took the node away (the edge shut down or drained).
    Preempted,
    /// The node ran short of memory and stopped the sandbox to recover.
    MemoryPressure,
    /// The API key or project quota the sandbox ran under was revoked.
    QuotaRevoked,
    /// Anything else that went wrong on the platform's side (see the detail).
    InternalError,
}

impl EndReason {
    /// Every reason, in the order of the enum.
    pub const ALL: [EndReason; 10] = [
        EndReason::StoppedByUser,
        EndReason::TtlIdle,
        EndReason::TtlTotal,
        EndReason::OomKilledPid1,
        EndReason::NodeLost,
        EndReason::EdgeRestartNotAdopted,
        EndReason::Preempted,
        EndReason::MemoryPressure,
        EndReason::QuotaRevoked,
        EndReason::InternalError,
    ];

    /// The reason as it appears on the wire.
    pub const fn as_str(self) -> &'static str {
        match self {
            EndReason::StoppedByUser => "stopped_by_user",
            EndReason::TtlIdle => "ttl_idle",
            EndReason::TtlTotal => "ttl_total",
            EndReason::OomKilledPid1 => "oom_killed_pid1",
            EndReason::NodeLost => "node_lost",
            EndReason::EdgeRestartNotAdopted => "edge_restart_not_adopted",
            EndReason::Preempted => "preempted",
            EndReason::MemoryPressure => "memory_pressure",
            EndReason::QuotaRevoked => "quota_revoked",
            EndReason::InternalError => "internal_error",
        }
    }

    /// The reason named `s`, if it is one.
    pub fn parse(s: &str) -> Option<EndReason> {
        EndReason::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// True when the platform, not the agent or its trainer, ended the sandbox: a rollout
    /// that ended this way says nothing about the agent and should be masked.
    pub const fn is_infrastructure(self) -> bool {
        match self {
            EndReason::StoppedByUser
            | EndReason::TtlIdle
            | EndReason::TtlTotal
            | EndReason::OomKilledPid1 => false,
            EndReason::NodeLost
            | EndReason::EdgeRestartNotAdopted
            | EndReason::Preempted
            | EndReason::MemoryPressure
            | EndReason::QuotaRevoked
            | EndReason::InternalError => true,
        }
    }
}

impl std::fmt::Display for EndReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for EndReason {
    type Err = UnknownEndReason;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        EndReason::parse(s).ok_or_else(|| UnknownEndReason(s.to_string()))
    }
}

/// A string that is not an [`EndReason`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown end reason {0:?}; one of: stopped_by_user, ttl_idle, ttl_total, oom_killed_pid1, node_lost, edge_restart_not_adopted, preempted, memory_pressure, quota_revoked, internal_error")]
pub struct UnknownEndReason(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_serialize_as_their_strings() {
        let mut seen = std::collections::BTreeSet::new();
        for r in EndReason::ALL {
            assert_eq!(serde_json::to_value(r).unwrap(), r.as_str());
            assert_eq!(r.as_str().parse::<EndReason>(), Ok(r));
            assert!(seen.insert(r.as_str()));
        }
        assert!("stopped".parse::<EndReason>().is_err());
        assert!(!EndReason::TtlIdle.is_infrastructure());
        assert!(EndReason::NodeLost.is_infrastructure());
    }
}
