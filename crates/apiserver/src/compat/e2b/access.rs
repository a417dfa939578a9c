//! Who may call a sandbox's envd API, and the per-sandbox envd access token
//! (`envdAccessToken`, sent back by the SDK as `X-Access-Token`).
//!
//! The token is derived, not stored: lowercase hex HMAC-SHA256 with the apiserver's port URL
//! secret as the key over `"e2b-envd:" + sandbox_id`, so every replica sharing the secret
//! computes the same token. An envd call is allowed with the matching `X-Access-Token`, or
//! with a dsec API key (`X-API-Key` or `Authorization: Bearer`) whose principal is an admin or
//! whose project is the sandbox's project; anything else is refused (401). It must not accept
//! a token derived from anything a caller controls besides the sandbox id.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;

use crate::ports::hmac_sha256;
use crate::routes::AppState;

/// The envd access token of `sandbox_id` under `secret`.
pub fn envd_token(secret: &[u8], sandbox_id: &str) -> String {
    hex::encode(hmac_sha256(
        secret,
        format!("e2b-envd:{sandbox_id}").as_bytes(),
    ))
}

/// The traffic access token of `sandbox_id` (header `e2b-traffic-access-token`).
pub fn traffic_token(secret: &[u8], sandbox_id: &str) -> String {
    hex::encode(hmac_sha256(
        secret,
        format!("e2b-traffic:{sandbox_id}").as_bytes(),
    ))
}

/// Constant-time comparison of a presented token with the expected one.
pub fn same_token(presented: &str, expected: &str) -> bool {
    presented.len() == expected.len()
        && presented
            .bytes()
            .zip(expected.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Why an envd call was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EnvdAccessError {
    #[error("missing credentials for sandbox {0}: send the sandbox's X-Access-Token (envdAccessToken) or a dsec API key (X-API-Key)")]
    Missing(String),
    #[error("the X-Access-Token does not belong to sandbox {0}")]
    WrongToken(String),
    #[error("unknown or revoked API key")]
    UnknownKey,
    #[error("sandbox {0} belongs to another project than this API key's")]
    OtherProject(String),
    #[error("sandbox {0} not found")]
    SandboxNotFound(String),
    #[error("{0}")]
    Unavailable(String),
}

/// The API key a request carries (`X-API-Key`, else `Authorization: Bearer`).
pub fn api_key(headers: &HeaderMap) -> Option<&str> {
    if let Some(k) = headers.get("x-api-key").and_then(|v| v.to_str().ok()) {
        let k = k.trim();
        if !k.is_empty() {
            return Some(k);
        }
    }
    crate::auth::bearer(
        headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok()),
    )
}

/// How long a key's verdict on a sandbox is kept.
const VERDICT_TTL: Duration = Duration::from_secs(30);
const MAX_VERDICTS: usize = 10_000;

fn verdicts() -> &'static Mutex<HashMap<(String, String), Instant>> {
    static V: std::sync::OnceLock<Mutex<HashMap<(String, String), Instant>>> =
        std::sync::OnceLock::new();
    V.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Checks an envd call to `sandbox_id`.
pub async fn check(
    st: &AppState,
    sandbox_id: &str,
    headers: &HeaderMap,
) -> Result<(), EnvdAccessError> {
    if let Some(t) = headers.get("x-access-token").and_then(|v| v.to_str().ok()) {
        let expected = envd_token(&crate::ports::secret(st), sandbox_id);
        return if same_token(t.trim(), &expected) {
            Ok(())
        } else {
            Err(EnvdAccessError::WrongToken(sandbox_id.to_string()))
        };
    }
    let Some(key) = api_key(headers) else {
        return Err(EnvdAccessError::Missing(sandbox_id.to_string()));
    };
    let principal = st
        .verifier
        .verify(Some(key))
        .await
        .map_err(|_| EnvdAccessError::UnknownKey)?;
    if principal.kind == "admin" {
        return Ok(());
    }
    let cache_key = (principal.id.clone(), sandbox_id.to_string());
    if let Ok(v) = verdicts().lock() {
        if v.get(&cache_key)
            .is_some_and(|at| at.elapsed() < VERDICT_TTL)
        {
            return Ok(());
        }
    }
    let facts = super::envd::native::Native::new(st, sandbox_id)
        .map_err(|e| EnvdAccessError::Unavailable(e.message))?
        .sandbox()
        .await
        .map_err(|e| match e.code {
            dsec_e2b_envd::connect::Code::NotFound => {
                EnvdAccessError::SandboxNotFound(sandbox_id.to_string())
            }
            _ => EnvdAccessError::Unavailable(e.message),
        })?;
    if !owned_by(&facts.labels, &principal.project) {
        return Err(EnvdAccessError::OtherProject(sandbox_id.to_string()));
    }
    if let Ok(mut v) = verdicts().lock() {
        if v.len() >= MAX_VERDICTS {
            v.clear();
        }
        v.insert(cache_key, Instant::now());
    }
    Ok(())
}

/// Whether a sandbox with these labels is charged to `project`.
pub fn owned_by(labels: &std::collections::BTreeMap<String, String>, project: &str) -> bool {
    labels
        .get(crate::create::LABEL_PROJECT)
        .is_some_and(|p| p == project)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_per_sandbox_and_per_secret() {
        let a = envd_token(b"secret", "sb-n0-1");
        assert_eq!(a.len(), 64);
        assert!(a
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(a, envd_token(b"secret", "sb-n0-1"));
        assert_ne!(a, envd_token(b"secret", "sb-n0-2"));
        assert_ne!(a, envd_token(b"other", "sb-n0-1"));
        assert_ne!(a, traffic_token(b"secret", "sb-n0-1"));
        assert!(same_token(&a, &a));
        assert!(!same_token(&a, &a[1..]));
        // RFC 4231 test case 2.
        assert_eq!(
            hex::encode(hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn keys_from_either_header_and_project_ownership() {
        let mut h = HeaderMap::new();
        assert_eq!(api_key(&h), None);
        h.insert("authorization", "Bearer dsk_b".parse().unwrap());
        assert_eq!(api_key(&h), Some("dsk_b"));
        h.insert("x-api-key", "dsk_a".parse().unwrap());
        assert_eq!(api_key(&h), Some("dsk_a"));
        let mut labels = std::collections::BTreeMap::new();
        assert!(!owned_by(&labels, "default"));
        labels.insert("dsec.project".to_string(), "team-a".to_string());
        assert!(owned_by(&labels, "team-a"));
        assert!(!owned_by(&labels, "team-b"));
    }
}
