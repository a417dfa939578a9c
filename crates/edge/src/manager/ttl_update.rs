//! Changing a live sandbox's TTLs (`PUT /edge/v1/sandboxes/{id}/ttl`, the E2B `timeout`).

use std::sync::atomic::Ordering;

use dsec_wire::api::{SandboxInfo, TtlUpdate};

use crate::error::EdgeError;

use super::{lock, now_ms, Manager};

/// Longest TTL accepted (a year), so that a typo does not keep a sandbox forever.
pub const MAX_TTL_S: u64 = 365 * 86_400;

impl Manager {
    /// Sets the TTLs given in `u` (0 removes one) and resets the idle clock; recorded in the
    /// trajectory and persisted.
    pub fn update_ttl(&self, id: &str, u: &TtlUpdate) -> Result<SandboxInfo, EdgeError> {
        for (key, v) in [
            ("ttl_running_stop", u.ttl_running_stop),
            ("ttl_total", u.ttl_total),
        ] {
            if v.is_some_and(|v| v > MAX_TTL_S) {
                return Err(EdgeError::BadRequest(format!(
                    "{key} must be at most {MAX_TTL_S} seconds"
                )));
            }
        }
        let e = self.entry(id)?;
        e.last_request_ms.store(now_ms(), Ordering::SeqCst);
        {
            let mut i = lock(&e.info);
            if let Some(t) = u.ttl_running_stop {
                i.ttl_running_stop = (t > 0).then_some(t);
            }
            if let Some(t) = u.ttl_total {
                i.ttl_total = (t > 0).then_some(t);
            }
            if let Some(a) = u.ttl_action {
                i.ttl_action = a;
            }
        }
        e.persist();
        let request = serde_json::to_value(u).unwrap_or_default();
        let info = e.info();
        self.traj.note(
            &e.id,
            "ttl",
            request,
            Ok::<_, &EdgeError>(serde_json::json!({
                "ttl_running_stop": info.ttl_running_stop,
                "ttl_total": info.ttl_total,
            })),
        );
        Ok(info)
    }
}
