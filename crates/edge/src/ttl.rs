//! The TTL reaper: stops (or pauses) idle sandboxes and stops those past their hard lifetime.
//!
//! - `ttl_running_stop`: seconds without a request (the idle clock, reset by every request and
//!   held while one runs), then `ttl_action`: `stop` (default) or `pause`. A paused sandbox's
//!   idle clock does not run: it is already out of the way.
//! - `ttl_total`: seconds since creation, then stop, whatever the state.
//!
//! The decision is a pure function ([`decide`]); [`spawn`] runs it every `ttl_check_ms` over
//! whatever implements [`Reapable`] (the manager), so this module does not depend on it.

use std::sync::{Arc, Weak};
use std::time::Duration;

use dsec_node::now_ms;
use dsec_wire::api::{EndReason, SandboxState, TtlAction};

use dsec_runtime::substrate::BoxFut;

/// What the TTL reaper sees of one sandbox.
pub struct TtlView {
    pub id: String,
    pub state: SandboxState,
    pub created_ms: u64,
    pub last_request_ms: u64,
    pub busy: bool,
    pub ttl_running_stop: Option<u64>,
    pub ttl_total: Option<u64>,
    pub ttl_action: TtlAction,
}

/// What the reaper may see and do (implemented by the manager).
pub trait Reapable: Send + Sync + 'static {
    /// Every live sandbox.
    fn ttl_views(&self) -> Vec<TtlView>;
    /// Stops a sandbox for `end` ([`EndReason::TtlIdle`] or [`EndReason::TtlTotal`]), giving
    /// `reason` as the detail.
    fn stop_because<'a>(&'a self, id: &'a str, end: EndReason, reason: String) -> BoxFut<'a, ()>;
    /// Pauses a sandbox unless a request touched it since `seen_last_request_ms`.
    fn pause_idle<'a>(&'a self, id: &'a str, seen_last_request_ms: u64) -> BoxFut<'a, ()>;
}

/// What the reaper does to one sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Stop(EndReason, String),
    Pause,
}

/// Decides what to do with one sandbox at `now_ms` (None: leave it alone).
pub(crate) fn decide(v: &TtlView, now_ms: u64) -> Option<Decision> {
    if matches!(
        v.state,
        SandboxState::Creating
            | SandboxState::Stopping
            | SandboxState::Stopped
            | SandboxState::Failed
    ) {
        return None;
    }
    if let Some(total) = v.ttl_total {
        if now_ms.saturating_sub(v.created_ms) >= total.saturating_mul(1000) {
            return Some(Decision::Stop(
                EndReason::TtlTotal,
                format!("its hard lifetime ttl_total of {total} s ended"),
            ));
        }
    }
    let idle = v.ttl_running_stop?;
    if v.state != SandboxState::Running || v.busy {
        return None;
    }
    if now_ms.saturating_sub(v.last_request_ms) < idle.saturating_mul(1000) {
        return None;
    }
    Some(match v.ttl_action {
        TtlAction::Stop => Decision::Stop(
            EndReason::TtlIdle,
            format!("idle for ttl_running_stop = {idle} s without a request"),
        ),
        TtlAction::Pause => Decision::Pause,
    })
}

/// One pass over every live sandbox.
pub async fn sweep(mgr: &dyn Reapable) {
    let now = now_ms();
    let todo: Vec<(TtlView, Decision)> = mgr
        .ttl_views()
        .into_iter()
        .filter_map(|v| decide(&v, now).map(|d| (v, d)))
        .collect();
    for (v, d) in todo {
        match d {
            Decision::Stop(end, reason) => {
                tracing::info!(sandbox = %v.id, %end, %reason, "TTL stop");
                mgr.stop_because(&v.id, end, reason).await;
            }
            Decision::Pause => {
                tracing::info!(sandbox = %v.id, "idle TTL pause");
                mgr.pause_idle(&v.id, v.last_request_ms).await;
            }
        }
    }
}

/// Runs the reaper every `every_ms` until `target` is dropped.
pub fn spawn<T: Reapable>(target: &Arc<T>, every_ms: u64) -> tokio::task::JoinHandle<()> {
    let weak: Weak<T> = Arc::downgrade(target);
    let every = Duration::from_millis(every_ms);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(m) = weak.upgrade() else { return };
            sweep(&*m).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(state: SandboxState) -> TtlView {
        TtlView {
            id: "sb-n0-0000000000000001".into(),
            state,
            created_ms: 1_000_000,
            last_request_ms: 1_000_000,
            busy: false,
            ttl_running_stop: Some(10),
            ttl_total: None,
            ttl_action: TtlAction::Stop,
        }
    }

    #[test]
    fn idle_stop_and_pause() {
        let v = view(SandboxState::Running);
        assert_eq!(decide(&v, 1_009_999), None);
        assert!(
            matches!(decide(&v, 1_010_000), Some(Decision::Stop(EndReason::TtlIdle, r)) if r.contains("idle"))
        );
        let p = TtlView {
            ttl_action: TtlAction::Pause,
            ..view(SandboxState::Running)
        };
        assert_eq!(decide(&p, 1_010_000), Some(Decision::Pause));
        // Already paused: the idle clock does not run.
        let paused = TtlView {
            ttl_action: TtlAction::Pause,
            ..view(SandboxState::Paused)
        };
        assert_eq!(decide(&paused, 9_000_000), None);
        // A request in flight holds the clock.
        let busy = TtlView {
            busy: true,
            ..view(SandboxState::Running)
        };
        assert_eq!(decide(&busy, 9_000_000), None);
        let none = TtlView {
            ttl_running_stop: None,
            ..view(SandboxState::Running)
        };
        assert_eq!(decide(&none, 9_000_000), None);
    }

    #[test]
    fn hard_lifetime_applies_in_every_live_state() {
        for state in [SandboxState::Running, SandboxState::Paused] {
            let v = TtlView {
                ttl_total: Some(5),
                ttl_running_stop: None,
                busy: true,
                ..view(state)
            };
            assert_eq!(decide(&v, 1_004_999), None);
            assert!(
                matches!(decide(&v, 1_005_000), Some(Decision::Stop(EndReason::TtlTotal, r)) if r.contains("ttl_total"))
            );
        }
        let ended = TtlView {
            ttl_total: Some(1),
            ..view(SandboxState::Stopped)
        };
        assert_eq!(decide(&ended, 9_000_000), None);
    }
}
