//! How the edge tells why a sandbox ended ([`EndReason`]): the cause of each way a sandbox
//! can end on this node, and the list filter over ended sandboxes.
//!
//! | where it ends | reason |
//! |---|---|
//! | `DELETE /edge/v1/sandboxes/{id}`, a job stop | `stopped_by_user` (or what the apiserver names, e.g. `quota_revoked`) |
//! | the TTL reaper ([`crate::ttl`]) | `ttl_idle`, `ttl_total` |
//! | the agent (pid 1) died after the memory limit OOM-killed in the sandbox | `oom_killed_pid1` |
//! | the agent died otherwise (killed from outside, crashed) | `internal_error` |
//! | the edge restarted and could not re-adopt it | `edge_restart_not_adopted` |
//! | the edge shut down with it running | `preempted` |
//! | the node's pressure policy ended it (`[edge.reclaim] stop_on_pressure`) | `memory_pressure` |

use dsec_wire::api::{EndReason, ListSandboxesQuery, SandboxInfo};

/// Records the end on `info`: the machine-readable reason, its detail, and the detail as the
/// free-text `reason` older clients read.
pub fn set(info: &mut SandboxInfo, end: EndReason, detail: String) {
    info.end_reason = Some(end);
    info.reason = Some(detail.clone());
    info.end_detail = Some(detail);
}

/// Adds cleanup problems to an ended sandbox's detail (its reason stays what it was).
pub fn add_problems(info: &mut SandboxInfo, problems: &str) {
    let with = |s: Option<String>| {
        Some(format!(
            "{}; cleanup problems: {problems}",
            s.unwrap_or_default()
        ))
    };
    info.reason = with(info.reason.take());
    info.end_detail = with(info.end_detail.take());
}

/// Why a sandbox whose agent exited on its own ended: `oom_kills` counts what its memory
/// limit OOM-killed in it.
pub fn died(oom_kills: u64) -> (EndReason, String) {
    if oom_kills > 0 {
        (
            EndReason::OomKilledPid1,
            format!(
                "the sandbox's agent (pid 1) died after its memory limit OOM-killed processes \
                 {oom_kills} time(s)"
            ),
        )
    } else {
        (
            EndReason::InternalError,
            "the sandbox's agent exited unexpectedly (killed from outside or crashed)".into(),
        )
    }
}

/// A stop asked through the edge's API: the reason the apiserver names (an `end_reason` query
/// on `DELETE`), else `stopped_by_user`.
pub fn requested(end: Option<EndReason>) -> (EndReason, String) {
    match end {
        None | Some(EndReason::StoppedByUser) => {
            (EndReason::StoppedByUser, "stopped on request".into())
        }
        Some(EndReason::QuotaRevoked) => (
            EndReason::QuotaRevoked,
            "stopped: the API key or quota it ran under was revoked".into(),
        ),
        Some(other) => (other, format!("stopped by the platform ({other})")),
    }
}

/// Whether `q` asks for ended sandboxes at all.
pub fn wants_ended(q: &ListSandboxesQuery) -> bool {
    q.ended.unwrap_or(false) || q.end_reason.is_some()
}

/// Whether the ended sandbox `info` belongs in the list `q` asks for.
pub fn matches(q: &ListSandboxesQuery, info: &SandboxInfo) -> bool {
    wants_ended(q) && q.end_reason.is_none_or(|r| info.end_reason == Some(r))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn died_tells_oom_from_the_rest() {
        assert_eq!(died(2).0, EndReason::OomKilledPid1);
        assert_eq!(died(0).0, EndReason::InternalError);
        assert_eq!(requested(None).0, EndReason::StoppedByUser);
        assert_eq!(
            requested(Some(EndReason::QuotaRevoked)).0,
            EndReason::QuotaRevoked
        );
    }

    #[test]
    fn set_keeps_the_free_text_reason() {
        let mut i = SandboxInfo::default();
        set(&mut i, EndReason::TtlIdle, "idle".into());
        add_problems(&mut i, "umount");
        assert_eq!(i.end_reason, Some(EndReason::TtlIdle));
        assert_eq!(i.reason.as_deref(), Some("idle; cleanup problems: umount"));
        assert_eq!(i.end_detail, i.reason);
    }

    #[test]
    fn list_filter() {
        let mut i = SandboxInfo::default();
        set(&mut i, EndReason::TtlTotal, "t".into());
        let none = ListSandboxesQuery::default();
        assert!(!matches(&none, &i));
        let all = ListSandboxesQuery {
            ended: Some(true),
            ..Default::default()
        };
        assert!(matches(&all, &i));
        let ttl = ListSandboxesQuery {
            end_reason: Some(EndReason::TtlTotal),
            ..Default::default()
        };
        assert!(matches(&ttl, &i));
        let idle = ListSandboxesQuery {
            end_reason: Some(EndReason::TtlIdle),
            ..Default::default()
        };
        assert!(!matches(&idle, &i));
    }
}
