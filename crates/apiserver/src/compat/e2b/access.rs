//! The per-sandbox envd access token (`envdAccessToken`, sent back as `X-Access-Token`).
//!
//! The token is derived, not stored: lowercase hex HMAC-SHA256 with the apiserver's port URL
//! secret as the key over `"e2b-envd:" + sandbox_id`. Any apiserver replica sharing the
//! secret computes the same token, so the REST side (which hands it out) and the envd side
//! (which checks it) agree without shared storage. It must not be derived from anything a
//! caller controls besides the sandbox id.

use sha2::{Digest, Sha256};

/// HMAC-SHA256 (RFC 2104).
fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    let mut k = [0u8; 64];
    if key.len() > 64 {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut ipad = [0x36u8; 64];
    let mut opad = [0x5cu8; 64];
    for i in 0..64 {
        ipad[i] ^= k[i];
        opad[i] ^= k[i];
    }
    let inner = Sha256::new()
        .chain_update(ipad)
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(opad)
        .chain_update(inner)
        .finalize()
        .into()
}

/// The envd access token of `sandbox_id` under `secret`.
pub fn envd_token(secret: &[u8], sandbox_id: &str) -> String {
    hex::encode(hmac_sha256(
        secret,
        format!("e2b-envd:{sandbox_id}").as_bytes(),
    ))
}

/// The traffic access token of `sandbox_id` (header `e2b-traffic-access-token`), needed to
/// reach the ports of a sandbox created with `network.allowPublicTraffic = false`.
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
        // RFC 4231 test case 2 through the same HMAC.
        assert_eq!(
            hex::encode(hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
