//! Who may reach the ports of a sandbox created through E2B without a dsec credential.
//!
//! E2B sandboxes' ports are public by default (`get_host(port)` URLs are opened by plain
//! browsers and HTTP clients). A sandbox created here carries the label
//! `dsec.e2b.public_traffic`; the port proxy asks [`allows`] when a caller brings neither an
//! API key nor a port URL token. A sandbox made with `allowPublicTraffic = false` opens its
//! ports to the `e2b-traffic-access-token` header instead. Sandboxes not made through E2B are
//! never opened here. The label is read from the sandbox's edge and kept for a few seconds.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, Method};
use dsec_wire::api::SandboxInfo;

use super::rest::{LABEL_E2B, LABEL_PUBLIC_TRAFFIC};
use crate::routes::AppState;

/// How long a sandbox's traffic setting is trusted without asking its edge again.
const CACHE_FOR: Duration = Duration::from_secs(10);
/// The cache is cleared past this many sandboxes.
const MAX_CACHED: usize = 10_000;

/// The traffic setting of an E2B sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Traffic {
    /// Not made through E2B: only dsec's own rules apply.
    NotE2b,
    Public,
    /// Needs the traffic access token.
    TokenOnly,
}

/// Reads the setting from the sandbox's labels.
pub fn traffic_of(info: &SandboxInfo) -> Traffic {
    if !info.labels.contains_key(LABEL_E2B) {
        return Traffic::NotE2b;
    }
    match info.labels.get(LABEL_PUBLIC_TRAFFIC).map(String::as_str) {
        Some("false") => Traffic::TokenOnly,
        _ => Traffic::Public,
    }
}

fn cache() -> &'static Mutex<HashMap<String, (Traffic, Instant)>> {
    static CACHE: std::sync::OnceLock<Mutex<HashMap<String, (Traffic, Instant)>>> =
        std::sync::OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

async fn traffic(st: &AppState, id: &str) -> Traffic {
    if let Ok(c) = cache().lock() {
        if let Some((t, at)) = c.get(id) {
            if at.elapsed() < CACHE_FOR {
                return *t;
            }
        }
    }
    let t = match super::rest::edge_call::<SandboxInfo>(st, Method::GET, id, "", None).await {
        Ok(info) => traffic_of(&info),
        // Unknown: nothing opened; the proxy's own answer will say what is wrong.
        Err(_) => return Traffic::NotE2b,
    };
    if let Ok(mut c) = cache().lock() {
        if c.len() >= MAX_CACHED {
            c.clear();
        }
        c.insert(id.to_string(), (t, Instant::now()));
    }
    t
}

/// Whether a caller without dsec credentials may reach every port of `id`.
pub async fn allows(st: &AppState, id: &str, headers: &HeaderMap) -> bool {
    match traffic(st, id).await {
        Traffic::NotE2b => false,
        Traffic::Public => true,
        Traffic::TokenOnly => headers
            .get(super::TRAFFIC_TOKEN_HEADER)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| {
                super::access::same_token(
                    t,
                    &super::access::traffic_token(&crate::ports::secret(st), id),
                )
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_e2b_sandboxes_are_opened() {
        let mut i = SandboxInfo::default();
        assert_eq!(traffic_of(&i), Traffic::NotE2b);
        i.labels.insert(LABEL_E2B.into(), "1".into());
        assert_eq!(traffic_of(&i), Traffic::Public);
        i.labels.insert(LABEL_PUBLIC_TRAFFIC.into(), "false".into());
        assert_eq!(traffic_of(&i), Traffic::TokenOnly);
    }
}
