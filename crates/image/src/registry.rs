//! Pulling images from an OCI registry (distribution API v2).
//!
//! Flow: `GET /v2/<repo>/manifests/<ref>` (accepting OCI and Docker manifests and indexes);
//! a `401` with `WWW-Authenticate: Bearer realm=..,service=..,scope=..` sends us to the token
//! server (with basic credentials when given), and the request is retried with the token; a
//! `Basic` challenge is answered with the credentials. An index (manifest list) is resolved to
//! its `linux/amd64` manifest (else the first). Each layer blob is streamed to a local file
//! while hashed and refused unless its sha256 matches the manifest. The layers then go through
//! the same unpack (whiteouts converted) and EROFS build as an OCI layout import.
//!
//! Transport: `https://HOST/...` always uses TLS; `http://HOST/...` plain HTTP (loopback, or
//! with `insecure`). Without a scheme a loopback host is reached over plain HTTP (as Docker does
//! for `localhost`) and any other host over TLS (plain HTTP only with `insecure`). TLS is rustls
//! and trusts the system's roots plus the PEM CA certificates in [`PullOptions::ca_pem`] (the
//! user's `--ca-file`, the edge's `registry_ca_file`).
//!
//! Why this is hand-written and not `oci-client`/`oci-spec` (measured against this workspace's
//! Cargo.lock, December 2026): `oci-client` 0.18 with `rustls-tls` adds 29 crates, among them a
//! second HTTP client (reqwest 0.13 beside our 0.12) and a second TLS crypto stack
//! (`aws-lc-rs`/`aws-lc-sys`, a C/CMake build) — a second copy of what the workspace already
//! builds, on a 2-core build machine. Its pull API also buffers layers in memory or hands out
//! its own stream type, whereas we stream each blob to disk while hashing it, for the EROFS
//! build. `oci-spec` 0.10 (image types only) adds 17 crates (regex, derive_builder, darling,
//! strum, getset, konst) to replace the three private structs below, which read 9 fields.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// What went wrong parsing a reference, reaching a registry or downloading from it.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error(
        "bad registry reference {reference:?}: {why}; use HOST[:PORT]/REPO[:TAG|@sha256:DIGEST]"
    )]
    BadReference {
        reference: String,
        why: &'static str,
    },
    #[error("no PEM certificate (-----BEGIN CERTIFICATE-----) in the CA file")]
    NoPemMarker,
    #[error("bad PEM CA certificate: {0}")]
    BadPem(String),
    #[error("no PEM certificate in the CA file")]
    NoPem,
    #[error("registry {host} is not on loopback: plain HTTP needs insecure (CLI: --insecure); drop http:// to use TLS")]
    PlainHttpRefused { host: String },
    #[error("HTTP client: {0}")]
    Client(reqwest::Error),
    /// A request that failed or whose body could not be read (`reason`: the error chain,
    /// with advice for an untrusted certificate).
    #[error("GET {url}: {reason}")]
    Get { url: String, reason: String },
    #[error("GET {url}: 401 without a usable WWW-Authenticate challenge")]
    NoChallenge { url: String },
    #[error("GET {url}: {status}: {body}")]
    Status {
        url: String,
        status: reqwest::StatusCode,
        body: String,
    },
    #[error("GET {url}: still unauthorized after authenticating; check the credentials")]
    StillUnauthorized { url: String },
    #[error("the registry wants basic credentials: pass a username and password")]
    NeedCredentials,
    #[error("bearer challenge without a realm")]
    NoRealm,
    #[error("bad token realm {realm:?}: {reason}")]
    BadRealm { realm: String, reason: String },
    #[error("token realm {realm} is not an http(s) URL")]
    RealmNotHttp { realm: String },
    #[error("token server {realm}: {reason}")]
    TokenServer { realm: String, reason: String },
    #[error("token server {realm} refused ({status}); check the credentials")]
    TokenRefused {
        realm: String,
        status: reqwest::StatusCode,
    },
    #[error("token server {realm} returned no token")]
    NoToken { realm: String },
    #[error("unsupported registry auth scheme {0:?}")]
    UnsupportedAuth(String),
    #[error("manifest {0} is too large")]
    ManifestTooLarge(String),
    #[error("manifest {reference} does not match its digest (got {got})")]
    ManifestDigest { reference: String, got: String },
    #[error("bad manifest {reference}: {source}")]
    BadManifest {
        reference: String,
        source: serde_json::Error,
    },
    #[error("manifest {digest} ({media_type}) lists no layers")]
    NoLayers { digest: String, media_type: String },
    #[error("layer {digest} is zstd-compressed ({media_type}); only tar and tar+gzip layers are supported")]
    Zstd { digest: String, media_type: String },
    #[error(transparent)]
    Digest(#[from] crate::oci::ArchiveError),
    #[error("create {}: {source}", path.display())]
    CreateBlob {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("download {digest}: {reason}")]
    Download { digest: String, reason: String },
    #[error("write {}: {source}", path.display())]
    WriteBlob {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("layer {digest} is larger than the manifest says ({size} bytes)")]
    LayerTooLarge { digest: String, size: u64 },
    #[error("layer {digest} failed verification: downloaded bytes hash to {got}")]
    LayerDigest { digest: String, got: String },
}

/// A parsed `host[:port]/repo[:tag|@sha256:...]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    pub host: String,
    pub repo: String,
    /// A tag or a `sha256:` digest.
    pub reference: String,
    /// The scheme the reference named: `Some(true)` for `https://`, `Some(false)` for
    /// `http://`, `None` for none (see the module doc for the default).
    pub tls: Option<bool>,
}

impl Reference {
    /// Parses a reference. The first component must be a registry host (contains `.` or `:`,
    /// or is `localhost`); an optional `https://` or `http://` prefix chooses the transport.
    pub fn parse(s: &str) -> Result<Self, RegistryError> {
        let (s, tls) = if let Some(rest) = s.strip_prefix("https://") {
            (rest, Some(true))
        } else if let Some(rest) = s.strip_prefix("http://") {
            (rest, Some(false))
        } else {
            (s, None)
        };
        let bad = |why: &'static str| RegistryError::BadReference {
            reference: s.to_string(),
            why,
        };
        if s.len() > 512 || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad("malformed"));
        }
        let (host, rest) = s.split_once('/').ok_or_else(|| bad("no registry host"))?;
        if !(host.contains('.') || host.contains(':') || host == "localhost") {
            return Err(bad("the first component must be a registry host"));
        }
        let (repo, reference) = if let Some((r, d)) = rest.split_once('@') {
            (r, d.to_string())
        } else {
            match rest.rsplit_once(':') {
                Some((r, t)) if !t.contains('/') => (r, t.to_string()),
                _ => (rest, "latest".to_string()),
            }
        };
        let repo_ok = !repo.is_empty()
            && !repo.contains("..")
            && !repo.starts_with('/')
            && !repo.ends_with('/')
            && repo.bytes().all(|c| {
                c.is_ascii_lowercase()
                    || c.is_ascii_digit()
                    || matches!(c, b'.' | b'_' | b'-' | b'/')
            });
        if !repo_ok {
            return Err(bad("bad repository name"));
        }
        let ref_ok = if let Some(hex) = reference.strip_prefix("sha256:") {
            crate::name::is_digest(hex)
        } else {
            !reference.is_empty()
                && reference.len() <= 128
                && reference
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'_' | b'-'))
        };
        if !ref_ok {
            return Err(bad("bad tag or digest"));
        }
        Ok(Reference {
            host: host.to_string(),
            repo: repo.to_string(),
            reference,
            tls,
        })
    }

    fn is_loopback(&self) -> bool {
        let h = match self.host.rsplit_once(':') {
            Some((h, p)) if p.bytes().all(|c| c.is_ascii_digit()) => h,
            _ => self.host.as_str(),
        };
        h == "localhost" || h == "[::1]" || h.starts_with("127.")
    }
}

/// How to reach the registry.
#[derive(Debug, Clone, Default)]
pub struct PullOptions {
    /// Plain HTTP to a non-loopback registry.
    pub insecure: bool,
    pub username: Option<String>,
    pub password: Option<String>,
    /// PEM CA certificates trusted for TLS in addition to the system's roots (each entry may
    /// hold several certificates).
    pub ca_pem: Vec<String>,
}

/// Parses a PEM bundle into certificates; refuses a bundle without any.
pub fn parse_ca_pem(pem: &str) -> Result<Vec<reqwest::Certificate>, RegistryError> {
    if !pem.contains("-----BEGIN CERTIFICATE-----") {
        return Err(RegistryError::NoPemMarker);
    }
    let certs = reqwest::Certificate::from_pem_bundle(pem.as_bytes())
        .map_err(|e| RegistryError::BadPem(error_chain(&e)))?;
    if certs.is_empty() {
        return Err(RegistryError::NoPem);
    }
    Ok(certs)
}

/// The text to show for a failed request: the error chain, and for a TLS certificate the
/// server's name did not prove, what the user can do about it.
fn request_error(host: &str, e: &reqwest::Error) -> String {
    let chain = error_chain(e);
    if chain.contains("invalid peer certificate")
        || (e.is_connect() && chain.contains("certificate"))
    {
        format!(
            "{chain}: the TLS certificate of registry {host} is not trusted; pass the CA \
             certificate that signed it with --ca-file PATH (the edge-wide default is \
             registry_ca_file in the [edge] config)"
        )
    } else {
        chain
    }
}

/// Progress of a pull, for the CLI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullProgress {
    /// The manifest was resolved: its digest, layer count and compressed size.
    Manifest {
        digest: String,
        layers: usize,
        bytes: u64,
    },
    /// Bytes of layer `layer` (1-based) downloaded so far.
    Download {
        layer: usize,
        digest: String,
        done: u64,
        total: u64,
    },
    /// Layer `layer` is being unpacked and built.
    Build { layer: usize },
}

/// Receives progress events; must not block.
pub type ProgressFn = dyn Fn(PullProgress) + Send + Sync;

const MANIFEST_TYPES: &str = "application/vnd.oci.image.manifest.v1+json, \
application/vnd.oci.image.index.v1+json, \
application/vnd.docker.distribution.manifest.v2+json, \
application/vnd.docker.distribution.manifest.list.v2+json";

/// Largest manifest or index accepted.
const MAX_MANIFEST_BYTES: usize = 4 << 20;

#[derive(Deserialize)]
struct Platform {
    #[serde(default)]
    architecture: String,
    #[serde(default)]
    os: String,
}

#[derive(Deserialize)]
struct Descriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    platform: Option<Platform>,
}

#[derive(Deserialize)]
struct Manifest {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    #[serde(default)]
    manifests: Vec<Descriptor>,
    #[serde(default)]
    layers: Vec<Descriptor>,
}

#[derive(Deserialize)]
struct TokenReply {
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    access_token: Option<String>,
}

/// A session with one registry repository: remembers the bearer token.
pub(crate) struct Session<'a> {
    http: reqwest::Client,
    base: String,
    r: &'a Reference,
    opts: &'a PullOptions,
    auth: Option<String>,
}

/// The parts of a `WWW-Authenticate` challenge.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Challenge {
    pub scheme: String,
    pub params: Vec<(String, String)>,
}

/// Parses `Bearer realm="...",service="...",scope="..."` (quoted or bare values).
pub(crate) fn parse_challenge(h: &str) -> Option<Challenge> {
    let h = h.trim();
    let (scheme, rest) = h.split_once(' ').unwrap_or((h, ""));
    let mut params = Vec::new();
    let mut s = rest.trim();
    while !s.is_empty() {
        let (k, after) = s.split_once('=')?;
        let k = k.trim().trim_start_matches(',').trim().to_ascii_lowercase();
        let after = after.trim_start();
        let (v, next) = if let Some(q) = after.strip_prefix('"') {
            let end = q.find('"')?;
            (q[..end].to_string(), &q[end + 1..])
        } else {
            let end = after.find(',').unwrap_or(after.len());
            (after[..end].trim().to_string(), &after[end..])
        };
        params.push((k, v));
        s = next.trim_start().trim_start_matches(',').trim_start();
    }
    Some(Challenge {
        scheme: scheme.to_ascii_lowercase(),
        params,
    })
}

impl<'a> Session<'a> {
    pub(crate) fn new(r: &'a Reference, opts: &'a PullOptions) -> Result<Self, RegistryError> {
        let tls = match r.tls {
            Some(true) => true,
            Some(false) if !opts.insecure && !r.is_loopback() => {
                return Err(RegistryError::PlainHttpRefused {
                    host: r.host.clone(),
                });
            }
            Some(false) => false,
            None => !(opts.insecure || r.is_loopback()),
        };
        let mut b = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(Duration::from_secs(60))
            .https_only(tls);
        for pem in &opts.ca_pem {
            for c in parse_ca_pem(pem)? {
                b = b.add_root_certificate(c);
            }
        }
        let http = b.build().map_err(RegistryError::Client)?;
        Ok(Session {
            http,
            base: format!("{}://{}", if tls { "https" } else { "http" }, r.host),
            r,
            opts,
            auth: None,
        })
    }

    /// GET with the current credentials; on a 401 fetches a token once and retries.
    async fn get(
        &mut self,
        url: &str,
        accept: Option<&str>,
    ) -> Result<reqwest::Response, RegistryError> {
        for attempt in 0..2 {
            let mut req = self.http.get(url);
            if let Some(a) = accept {
                req = req.header(reqwest::header::ACCEPT, a);
            }
            if let Some(auth) = &self.auth {
                req = req.header(reqwest::header::AUTHORIZATION, auth);
            }
            let resp = req.send().await.map_err(|e| RegistryError::Get {
                url: url.to_string(),
                reason: request_error(&self.r.host, &e),
            })?;
            if resp.status() == reqwest::StatusCode::UNAUTHORIZED && attempt == 0 {
                let challenge = resp
                    .headers()
                    .get(reqwest::header::WWW_AUTHENTICATE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(parse_challenge)
                    .ok_or_else(|| RegistryError::NoChallenge {
                        url: url.to_string(),
                    })?;
                self.authenticate(&challenge).await?;
                continue;
            }
            if !resp.status().is_success() {
                let status = resp.status();
                let body = resp.text().await.unwrap_or_default();
                let body: String = body.chars().take(300).collect();
                return Err(RegistryError::Status {
                    url: url.to_string(),
                    status,
                    body: body.trim().to_string(),
                });
            }
            return Ok(resp);
        }
        Err(RegistryError::StillUnauthorized {
            url: url.to_string(),
        })
    }

    async fn authenticate(&mut self, c: &Challenge) -> Result<(), RegistryError> {
        let param = |k: &str| {
            c.params
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
        };
        match c.scheme.as_str() {
            "basic" => {
                let (Some(u), Some(p)) = (&self.opts.username, &self.opts.password) else {
                    return Err(RegistryError::NeedCredentials);
                };
                self.auth = Some(format!("Basic {}", base64(&format!("{u}:{p}"))));
                Ok(())
            }
            "bearer" => {
                let realm = param("realm").ok_or(RegistryError::NoRealm)?;
                let mut url = reqwest::Url::parse(&realm).map_err(|e| RegistryError::BadRealm {
                    realm: realm.clone(),
                    reason: e.to_string(),
                })?;
                if !matches!(url.scheme(), "http" | "https") {
                    return Err(RegistryError::RealmNotHttp { realm });
                }
                let scope =
                    param("scope").unwrap_or_else(|| format!("repository:{}:pull", self.r.repo));
                {
                    let mut q = url.query_pairs_mut();
                    if let Some(s) = param("service") {
                        q.append_pair("service", &s);
                    }
                    q.append_pair("scope", &scope);
                }
                let mut req = self.http.get(url.clone());
                if let (Some(u), Some(p)) = (&self.opts.username, &self.opts.password) {
                    req = req.basic_auth(u, Some(p));
                }
                let resp = req.send().await.map_err(|e| RegistryError::TokenServer {
                    realm: realm.clone(),
                    reason: request_error(&realm, &e),
                })?;
                if !resp.status().is_success() {
                    return Err(RegistryError::TokenRefused {
                        realm,
                        status: resp.status(),
                    });
                }
                let body = resp.bytes().await.map_err(|e| RegistryError::TokenServer {
                    realm: realm.clone(),
                    reason: e.to_string(),
                })?;
                let t: TokenReply =
                    serde_json::from_slice(&body).map_err(|e| RegistryError::TokenServer {
                        realm: realm.clone(),
                        reason: format!("bad reply: {e}"),
                    })?;
                let token = t
                    .token
                    .or(t.access_token)
                    .filter(|t| !t.is_empty())
                    .ok_or_else(|| RegistryError::NoToken {
                        realm: realm.clone(),
                    })?;
                self.auth = Some(format!("Bearer {token}"));
                Ok(())
            }
            other => Err(RegistryError::UnsupportedAuth(other.to_string())),
        }
    }

    /// Fetches a manifest (by tag or digest), verifying its digest when known.
    async fn manifest(&mut self, reference: &str) -> Result<(Manifest, String), RegistryError> {
        let url = format!("{}/v2/{}/manifests/{}", self.base, self.r.repo, reference);
        let resp = self.get(&url, Some(MANIFEST_TYPES)).await?;
        let ctype = resp
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let body = resp.bytes().await.map_err(|e| RegistryError::Get {
            url: url.clone(),
            reason: error_chain(&e),
        })?;
        if body.len() > MAX_MANIFEST_BYTES {
            return Err(RegistryError::ManifestTooLarge(reference.to_string()));
        }
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(&body)));
        if reference.starts_with("sha256:") && digest != reference {
            return Err(RegistryError::ManifestDigest {
                reference: reference.to_string(),
                got: digest,
            });
        }
        let mut m: Manifest =
            serde_json::from_slice(&body).map_err(|source| RegistryError::BadManifest {
                reference: reference.to_string(),
                source,
            })?;
        if m.media_type.is_empty() {
            m.media_type = ctype;
        }
        Ok((m, digest))
    }

    /// Resolves the reference to an image manifest (following one index level).
    async fn resolve(&mut self) -> Result<(Vec<Descriptor>, String), RegistryError> {
        let reference = self.r.reference.clone();
        let (mut m, mut digest) = self.manifest(&reference).await?;
        for _ in 0..2 {
            if m.manifests.is_empty() {
                break;
            }
            let pick = m
                .manifests
                .iter()
                .position(|d| {
                    d.platform
                        .as_ref()
                        .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
                })
                .unwrap_or(0);
            let d = m.manifests.swap_remove(pick);
            let _ = d.media_type;
            let (m2, dg) = self.manifest(&d.digest).await?;
            m = m2;
            digest = dg;
        }
        if m.layers.is_empty() {
            return Err(RegistryError::NoLayers {
                digest,
                media_type: m.media_type,
            });
        }
        for l in &m.layers {
            if l.media_type.contains("zstd") {
                return Err(RegistryError::Zstd {
                    digest: l.digest.clone(),
                    media_type: l.media_type.clone(),
                });
            }
            crate::oci::oci_blob(Path::new(""), &l.digest)?;
        }
        Ok((m.layers, digest))
    }

    /// Streams blob `d` to `dst`, hashing as it goes; refuses a digest mismatch.
    async fn blob(
        &mut self,
        index: usize,
        d: &Descriptor,
        dst: &Path,
        progress: &ProgressFn,
    ) -> Result<u64, RegistryError> {
        let url = format!("{}/v2/{}/blobs/{}", self.base, self.r.repo, d.digest);
        let mut resp = self.get(&url, None).await?;
        let total = resp.content_length().unwrap_or(d.size);
        let mut f = std::fs::File::create(dst).map_err(|source| RegistryError::CreateBlob {
            path: dst.to_path_buf(),
            source,
        })?;
        let mut h = Sha256::new();
        let mut done = 0u64;
        let mut last = std::time::Instant::now();
        while let Some(chunk) = resp.chunk().await.map_err(|e| RegistryError::Download {
            digest: d.digest.clone(),
            reason: error_chain(&e),
        })? {
            h.update(&chunk);
            f.write_all(&chunk)
                .map_err(|source| RegistryError::WriteBlob {
                    path: dst.to_path_buf(),
                    source,
                })?;
            done += chunk.len() as u64;
            if d.size > 0 && done > d.size {
                return Err(RegistryError::LayerTooLarge {
                    digest: d.digest.clone(),
                    size: d.size,
                });
            }
            if last.elapsed() >= Duration::from_millis(200) {
                last = std::time::Instant::now();
                progress(PullProgress::Download {
                    layer: index,
                    digest: d.digest.clone(),
                    done,
                    total,
                });
            }
        }
        progress(PullProgress::Download {
            layer: index,
            digest: d.digest.clone(),
            done,
            total,
        });
        let got = format!("sha256:{}", hex::encode(h.finalize()));
        if got != d.digest {
            return Err(RegistryError::LayerDigest {
                digest: d.digest.clone(),
                got,
            });
        }
        Ok(done)
    }
}

/// Downloads the manifest and layer blobs of `r` into `work`; returns the layer files
/// (bottom first) and the manifest digest.
pub(crate) async fn download(
    r: &Reference,
    opts: &PullOptions,
    work: &Path,
    progress: &ProgressFn,
) -> Result<(Vec<PathBuf>, String), RegistryError> {
    let mut s = Session::new(r, opts)?;
    let (layers, digest) = s.resolve().await?;
    progress(PullProgress::Manifest {
        digest: digest.clone(),
        layers: layers.len(),
        bytes: layers.iter().map(|l| l.size).sum(),
    });
    let mut files = Vec::with_capacity(layers.len());
    for (i, l) in layers.iter().enumerate() {
        let dst = work.join(format!("blob-{i}"));
        s.blob(i + 1, l, &dst, progress).await?;
        files.push(dst);
    }
    Ok((files, digest))
}

fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        let s = e.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = e.source();
    }
    out
}

/// Standard base64 (for basic credentials).
fn base64(s: &str) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let b = s.as_bytes();
    let mut out = String::with_capacity(b.len().div_ceil(3) * 4);
    for c in b.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        out.push(T[(n >> 18) as usize & 63] as char);
        out.push(T[(n >> 12) as usize & 63] as char);
        out.push(if c.len() > 1 {
            T[(n >> 6) as usize & 63] as char
        } else {
            '='
        });
        out.push(if c.len() > 2 {
            T[n as usize & 63] as char
        } else {
            '='
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references() {
        let r = Reference::parse("127.0.0.1:5000/team/app:v1").unwrap();
        assert_eq!(r.host, "127.0.0.1:5000");
        assert_eq!(r.repo, "team/app");
        assert_eq!(r.reference, "v1");
        assert!(r.is_loopback());
        let r = Reference::parse("localhost:5000/app").unwrap();
        assert_eq!(r.reference, "latest");
        let d = format!("sha256:{}", "a".repeat(64));
        let r = Reference::parse(&format!("reg.example.test/app@{d}")).unwrap();
        assert_eq!(r.reference, d);
        assert!(!r.is_loopback());
        for bad in [
            "app:v1",
            "reg.example.test/",
            "reg.example.test/App",
            "reg.example.test/a/../b",
            "reg.example.test/app@sha256:zz",
            "reg.example.test/app:v 1",
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Reference::parse("127.0.0.1:5000/app").unwrap().tls, None);
        let r = Reference::parse("https://127.0.0.1:5000/app:v2").unwrap();
        assert_eq!((r.host.as_str(), r.tls), ("127.0.0.1:5000", Some(true)));
        assert_eq!(r.reference, "v2");
        assert_eq!(
            Reference::parse("http://reg.example.test/app").unwrap().tls,
            Some(false)
        );
    }

    #[test]
    fn transport_follows_scheme_host_and_insecure() {
        let base = |r: &str, insecure: bool| {
            let r = Reference::parse(r).unwrap();
            let opts = PullOptions {
                insecure,
                ..Default::default()
            };
            Session::new(&r, &opts).map(|s| s.base.clone())
        };
        assert_eq!(
            base("reg.example.test/app", false).unwrap(),
            "https://reg.example.test"
        );
        assert_eq!(
            base("reg.example.test/app", true).unwrap(),
            "http://reg.example.test"
        );
        assert_eq!(
            base("127.0.0.1:5000/app", false).unwrap(),
            "http://127.0.0.1:5000"
        );
        assert_eq!(
            base("https://127.0.0.1:5000/app", false).unwrap(),
            "https://127.0.0.1:5000"
        );
        let e = base("http://reg.example.test/app", false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--insecure"), "{e}");
        assert_eq!(
            base("http://reg.example.test/app", true).unwrap(),
            "http://reg.example.test"
        );
    }

    #[test]
    fn ca_pem_is_checked() {
        let e = parse_ca_pem("not a certificate").unwrap_err().to_string();
        assert!(e.contains("BEGIN CERTIFICATE"), "{e}");
        let r = Reference::parse("https://reg.example.test/app").unwrap();
        let opts = PullOptions {
            ca_pem: vec!["-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".into()],
            ..Default::default()
        };
        assert!(Session::new(&r, &opts).is_err());
    }

    #[test]
    fn challenges() {
        let c = parse_challenge(
            r#"Bearer realm="http://127.0.0.1:9/token",service="reg",scope="repository:a/b:pull,push""#,
        )
        .unwrap();
        assert_eq!(c.scheme, "bearer");
        assert_eq!(
            c.params,
            vec![
                ("realm".into(), "http://127.0.0.1:9/token".into()),
                ("service".into(), "reg".into()),
                ("scope".into(), "repository:a/b:pull,push".into()),
            ]
        );
        let c = parse_challenge("Basic realm=x").unwrap();
        assert_eq!(c.scheme, "basic");
        assert_eq!(c.params, vec![("realm".into(), "x".into())]);
    }

    #[test]
    fn base64_matches_rfc4648() {
        assert_eq!(base64(""), "");
        assert_eq!(base64("f"), "Zg==");
        assert_eq!(base64("fo"), "Zm8=");
        assert_eq!(base64("foo"), "Zm9v");
        assert_eq!(base64("user:pass"), "dXNlcjpwYXNz");
    }
}
