//! The edge's admission queue (issue 22, item 6): a create refused only because earlier
//! sandboxes are still starting (their start reservations, or running sandboxes not measured
//! yet) waits here until they settle, instead of being refused with `node_full`.
//!
//! **Owns** the wait: bounded in time (the request's `wait_s`, else [`DEFAULT_WAIT`], never
//! more than [`MAX_WAIT`]) and in size ([`MAX_WAITING`] creates at once). A create that would
//! not fit even once every starting sandbox is running and idle (a real lack of capacity: the
//! sandbox count, the overcommit ratio, the LS floor, memory really in use) is refused at once,
//! naming the resource and what to ask for instead. CPU in use is compressible and changes from
//! moment to moment: a best-effort create it refuses waits (up to the bound) too. **Must not** change the admission
//! rules themselves (`dsec_node::qos::admission`).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use dsec_wire::api::SandboxInfo;

use crate::error::EdgeError;

use super::{Manager, Validated};

/// How long a create waits for starting sandboxes when its request sets no `wait_s`.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(100);
/// Longest wait at the edge (the apiserver's queue holds longer waits; its forward of a create
/// gives up after 120 s).
pub const MAX_WAIT: Duration = Duration::from_secs(110);
/// Most creates waiting at once on one node.
pub const MAX_WAITING: usize = 4096;
/// Re-check period while waiting (a wake-up between a check and the wait is not kept).
const RECHECK: Duration = Duration::from_millis(100);

/// The wait bound of a create.
pub fn wait_bound(wait_s: Option<f64>) -> Duration {
    match wait_s {
        Some(s) if s.is_finite() && s > 0.0 => Duration::from_secs_f64(s).min(MAX_WAIT),
        Some(_) => Duration::ZERO,
        None => DEFAULT_WAIT,
    }
}

/// The message of a `node_full` refusal (without the variant's prefix).
fn message_of(e: &EdgeError) -> String {
    match e {
        EdgeError::NodeFull(m) => m.clone(),
        other => other.to_string(),
    }
}

/// Counts a waiting create while it lives.
struct Waiting<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Manager {
    /// [`Manager::admit`], waiting up to `bound` while only starting sandboxes stand in the way.
    pub(super) async fn admit_or_wait(
        &self,
        id: &str,
        v: &Validated,
        key: Option<&str>,
        bound: Duration,
    ) -> Result<Option<SandboxInfo>, EdgeError> {
        let since = Instant::now();
        let deadline = since + bound;
        let mut waiting: Option<Waiting<'_>> = None;
        loop {
            let freed = self.qos.freed();
            let err = match self.admit(id, v, key) {
                Err(Admit::Wait(e)) => e,
                Err(Admit::Refused(e)) => return Err(e),
                Ok(r) => {
                    if waiting.is_some() {
                        tracing::debug!(sandbox = %id, waited_ms = since.elapsed().as_millis() as u64, "admitted after waiting for starting sandboxes");
                    }
                    return Ok(r);
                }
            };
            if waiting.is_none() {
                let n = self.qos.waiting.fetch_add(1, Ordering::Relaxed);
                waiting = Some(Waiting(&self.qos.waiting));
                if n >= MAX_WAITING {
                    return Err(EdgeError::NodeFull(format!(
                        "{}; {n} creates already wait for sandboxes starting on node {}: retry later or send wait_s to the apiserver",
                        message_of(&err),
                        self.cfg.node_id
                    )));
                }
            }
            if self.shutting_down.load(Ordering::Relaxed) {
                return Err(EdgeError::Unavailable(format!(
                    "node {} is shutting down",
                    self.cfg.node_id
                )));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(EdgeError::NodeFull(format!(
                    "{}; still so after waiting {:.1} s for the sandboxes starting on this node (raise wait_s to wait longer)",
                    message_of(&err),
                    now.duration_since(since).as_secs_f64()
                )));
            }
            self.qos.sample_soon();
            let _ = tokio::time::timeout(RECHECK.min(deadline - now), freed).await;
        }
    }
}

/// Why [`Manager::admit`] did not admit.
#[derive(Debug)]
pub(super) enum Admit {
    /// Refused for good (or for another reason than room).
    Refused(EdgeError),
    /// Refused only because earlier sandboxes are still starting: wait and retry.
    Wait(EdgeError),
}

impl Admit {
    /// The refusal, whether waiting could help or not.
    pub(super) fn error(&self) -> &EdgeError {
        match self {
            Admit::Refused(e) | Admit::Wait(e) => e,
        }
    }

    #[cfg(test)]
    pub(super) fn code(&self) -> &'static str {
        self.error().code()
    }
}

impl std::fmt::Display for Admit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error().fmt(f)
    }
}

impl From<EdgeError> for Admit {
    fn from(e: EdgeError) -> Self {
        Admit::Refused(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_bounds() {
        assert_eq!(wait_bound(None), DEFAULT_WAIT);
        assert_eq!(wait_bound(Some(5.0)), Duration::from_secs(5));
        assert_eq!(wait_bound(Some(1e9)), MAX_WAIT);
        assert!(
            MAX_WAIT < Duration::from_secs(120),
            "the apiserver's forward gives up at 120 s"
        );
        assert_eq!(wait_bound(Some(0.0)), Duration::ZERO);
    }
}
