//! API keys: generation, hashing, and verification with a short in-memory cache.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::db::{Db, Principal};
use crate::error::ApiError;

/// A fresh key: `dsk_` + 32 random hex characters.
pub fn generate_key() -> String {
    let mut raw = [0u8; 16];
    rand::thread_rng().fill_bytes(&mut raw);
    format!("dsk_{}", hex::encode(raw))
}

/// sha256 of the key, hex; the only form stored.
pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Extracts the key from an `Authorization: Bearer <key>` header value.
pub fn bearer(value: Option<&str>) -> Option<&str> {
    let v = value?.trim();
    let (scheme, key) = v.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let key = key.trim();
    (!key.is_empty()).then_some(key)
}

/// Verifies keys against the database, caching hits for `ttl`.
pub struct KeyVerifier {
    db: Db,
    ttl: Duration,
    cache: Mutex<HashMap<String, (Principal, Instant)>>,
}

/// Upper bound on cached keys; the cache is cleared when it grows past it.
const MAX_CACHED: usize = 10_000;

impl KeyVerifier {
    pub fn new(db: Db, ttl: Duration) -> Self {
        KeyVerifier {
            db,
            ttl,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Drops every cached key (after a revocation on this replica; others drop it after `ttl`).
    pub fn forget_all(&self) {
        if let Ok(mut c) = self.cache.lock() {
            c.clear();
        }
    }

    /// The principal owning `key`, or `Unauthorized`.
    pub async fn verify(&self, key: Option<&str>) -> Result<Principal, ApiError> {
        let key = key.ok_or(ApiError::Unauthorized)?;
        if !key.starts_with("dsk_") || key.len() > 128 {
            return Err(ApiError::Unauthorized);
        }
        let hash = hash_key(key);
        if let Ok(cache) = self.cache.lock() {
            if let Some((p, at)) = cache.get(&hash) {
                if at.elapsed() < self.ttl {
                    return Ok(p.clone());
                }
            }
        }
        let principal = self
            .db
            .principal_for(hash.clone())
            .await?
            .ok_or(ApiError::Unauthorized)?;
        if let Ok(mut cache) = self.cache.lock() {
            if cache.len() >= MAX_CACHED {
                cache.clear();
            }
            cache.insert(hash, (principal.clone(), Instant::now()));
        }
        Ok(principal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_format_and_hash() {
        let k = generate_key();
        assert!(k.starts_with("dsk_"));
        assert_eq!(k.len(), 4 + 32);
        assert!(k[4..].bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(generate_key(), k);
        assert_eq!(
            hash_key("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer(Some("Bearer dsk_x")), Some("dsk_x"));
        assert_eq!(bearer(Some("bearer  dsk_x ")), Some("dsk_x"));
        assert_eq!(bearer(Some("Basic abc")), None);
        assert_eq!(bearer(Some("Bearer ")), None);
        assert_eq!(bearer(None), None);
    }

    #[tokio::test]
    async fn verifier_caches_and_rejects() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("iam.db")).unwrap();
        let key = db.bootstrap().unwrap().unwrap();
        let v = KeyVerifier::new(db, Duration::from_secs(10));
        assert_eq!(v.verify(Some(&key)).await.unwrap().name, "admin");
        assert_eq!(v.verify(Some(&key)).await.unwrap().name, "admin");
        assert!(v.verify(Some("dsk_0000")).await.is_err());
        assert!(v.verify(None).await.is_err());
    }
}
