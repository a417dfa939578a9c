//! Exposed ports (issue 18): the apiserver's reverse proxy to TCP ports inside sandboxes.
//!
//! `ANY /v1/sandboxes/{id}/ports/{port}/{path}`, and with `[apiserver] sandbox_domain` set any
//! request whose `Host` is `{port}-{id}.{domain}`, reach `{path}` on that port of the sandbox.
//! The apiserver opens a byte stream to the port through the sandbox's edge
//! (`GET /edge/v1/sandboxes/{id}/ports/{port}/tunnel`, `Upgrade: dsec-tunnel`; the edge connects
//! inside the sandbox's network namespace) and speaks HTTP/1.1 over it with hyper: request and
//! answer bodies stream both ways (chunked or sized), a WebSocket (any `101`) upgrade is
//! pumped byte for byte, the caller's connection stays keep-alive.
//!
//! Access: a valid API key (`Authorization: Bearer dsk_...`, not passed on to the sandbox), or
//! a port URL token (HMAC-SHA256 over sandbox, port and expiry with the server secret; from
//! `POST /v1/sandboxes/{id}/port_urls`) in the `dsec_token` query parameter or the
//! `x-dsec-port-token` header, or else the edge opens only the sandbox's `public_ports`.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderName, StatusCode, Uri, Version};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use axum::Router;
use dsec_wire::api::{
    PortUrl, PortUrlRequest, DEFAULT_PORT_TOKEN_SECS, MAX_PORT_TOKEN_SECS, PORT_TOKEN_HEADER,
    PORT_TOKEN_QUERY,
};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use tracing::Instrument as _;

use crate::error::ApiError;
use crate::routes::AppState;

/// The proxy's routes (outside the API-key layer: they check access themselves).
pub const PROXY_ROUTES: [&str; 3] = [
    "/v1/sandboxes/{id}/ports/{port}",
    "/v1/sandboxes/{id}/ports/{port}/",
    "/v1/sandboxes/{id}/ports/{port}/{*path}",
];

/// The edge's tunnel protocol (see the edge's `ports` module).
const TUNNEL_PROTOCOL: &str = "dsec-tunnel";
const PUBLIC_ONLY_HEADER: &str = "x-dsec-public-only";

/// The proxy routes, merged beside the `/v1` routes.
pub fn router() -> Router<AppState> {
    let mut r = Router::new();
    for p in PROXY_ROUTES {
        r = r.route(p, any(by_path));
    }
    r
}

/// `sbx.example.test`-like: lower-case labels of letters, digits and `-`.
pub fn valid_domain(d: &str) -> bool {
    !d.is_empty()
        && d.len() <= 200
        && d.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        })
}

/// `{port}-{id}` of a `Host` header under `domain` (any `:port` suffix ignored).
pub fn parse_host<'a>(host: &'a str, domain: &str) -> Option<(&'a str, &'a str)> {
    let name = host.rsplit_once(':').map_or(host, |(h, p)| {
        if p.bytes().all(|b| b.is_ascii_digit()) {
            h
        } else {
            host
        }
    });
    let label = name.strip_suffix(domain)?.strip_suffix('.')?;
    if label.contains('.') {
        return None;
    }
    label.split_once('-')
}

/// `/v1/sandboxes/{id}/ports/{port}{rest}` → (id, port, rest).
fn split_path(path: &str) -> Option<(&str, &str, &str)> {
    let r = path.strip_prefix("/v1/sandboxes/")?;
    let (id, r) = r.split_once('/')?;
    let r = r.strip_prefix("ports/")?;
    let (port, rest) = match r.find('/') {
        Some(i) => (&r[..i], &r[i..]),
        None => (r, ""),
    };
    Some((id, port, rest))
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// HMAC-SHA256 (RFC 2104).
pub(crate) fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
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

/// The signing secret: the configured one, else one random secret for this process (also the
/// key of the E2B access tokens, `compat::e2b::access`).
pub fn secret(st: &AppState) -> Vec<u8> {
    static RANDOM: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();
    match &st.config.port_url_secret {
        Some(s) => s.as_bytes().to_vec(),
        None => RANDOM.get_or_init(rand::random).to_vec(),
    }
}

fn mac(secret: &[u8], id: &str, port: u16, expires: u64) -> String {
    hex::encode(hmac_sha256(
        secret,
        format!("dsec-port-url\n{id}\n{port}\n{expires}").as_bytes(),
    ))
}

/// A token `{expires}.{mac}` for `port` of `id`.
pub fn sign(secret: &[u8], id: &str, port: u16, expires: u64) -> String {
    format!("{expires}.{}", mac(secret, id, port, expires))
}

/// Checks a token for `port` of `id` at time `now`.
pub fn check_token(
    secret: &[u8],
    id: &str,
    port: u16,
    token: &str,
    now: u64,
) -> Result<(), ApiError> {
    let refused = |why: &str| {
        ApiError::TokenRefused(format!(
            "the port URL token is {why}; ask for a new one (POST /v1/sandboxes/{id}/port_urls, sandbox.get_url)"
        ))
    };
    let (exp, presented) = token.split_once('.').ok_or_else(|| refused("malformed"))?;
    let exp: u64 = exp.parse().map_err(|_| refused("malformed"))?;
    let expected = mac(secret, id, port, exp);
    let same = presented.len() == expected.len()
        && presented
            .bytes()
            .zip(expected.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if !same {
        return Err(refused(&format!(
            "not valid for port {port} of sandbox {id}"
        )));
    }
    if now > exp {
        return Err(refused(&format!("expired (at {exp}, now {now})")));
    }
    Ok(())
}

/// The query without its `dsec_token` pairs, and the token if there was one.
fn split_token(query: Option<&str>) -> (Option<String>, Option<String>) {
    let Some(q) = query else {
        return (None, None);
    };
    let mut token = None;
    let kept: Vec<&str> = q
        .split('&')
        .filter(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if k == PORT_TOKEN_QUERY {
                token = Some(v.to_string());
                false
            } else {
                true
            }
        })
        .collect();
    let rest = (!kept.is_empty()).then(|| kept.join("&"));
    (rest, token)
}

/// How a caller got in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    Key,
    Token,
    PublicOnly,
}

async fn authorize(
    st: &AppState,
    id: &str,
    port: u16,
    headers: &HeaderMap,
    query_token: Option<&str>,
) -> Result<Access, ApiError> {
    let header_token = headers.get(PORT_TOKEN_HEADER).and_then(|v| v.to_str().ok());
    if let Some(t) = query_token.or(header_token) {
        check_token(&secret(st), id, port, t, now_secs())?;
        return Ok(Access::Token);
    }
    let auth = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match crate::auth::bearer(auth) {
        // Another bearer credential may be the sandbox application's own: passed on.
        Some(k) if k.starts_with("dsk_") => {
            st.verifier.verify(Some(k)).await?;
            Ok(Access::Key)
        }
        // A sandbox made through the E2B API has public ports unless it said otherwise.
        _ if crate::compat::e2b::traffic::allows(st, id, headers).await => Ok(Access::Token),
        _ => Ok(Access::PublicOnly),
    }
}

fn parse_port(s: &str) -> Result<u16, ApiError> {
    s.parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| ApiError::BadRequest(format!("{s:?} is not a TCP port: use 1..=65535")))
}

async fn by_path(State(st): State<AppState>, req: Request) -> Response {
    let path = req.uri().path().to_string();
    let Some((id, port, rest)) = split_path(&path) else {
        return ApiError::NotFound(format!("no route {path}")).into_response();
    };
    let rest = if rest.is_empty() { "/" } else { rest };
    proxy(&st, id, port, rest, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// A request for `port` of sandbox `id` with its path as the sandbox should see it (the E2B
/// API's `E2b-Sandbox-Port` form).
pub async fn proxy_request(st: &AppState, id: &str, port: &str, req: Request) -> Response {
    let path = req.uri().path().to_string();
    proxy(st, id, port, &path, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// The request's host name, lowercased: its `Host` header, else the URI's authority.
pub(crate) fn request_host(req: &Request) -> Option<String> {
    req.headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_ascii_lowercase)
        .or_else(|| req.uri().host().map(str::to_ascii_lowercase))
}

/// Layer on the whole router: a `Host` of `{port}-{id}.{sandbox_domain}` goes to the port.
pub async fn by_host(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let Some(domain) = st.config.sandbox_domain.as_deref() else {
        return next.run(req).await;
    };
    let Some(host) = crate::ports::request_host(&req) else {
        return next.run(req).await;
    };
    let Some((port, id)) = parse_host(&host, domain) else {
        return next.run(req).await;
    };
    let (port, id) = (port.to_string(), id.to_string());
    let path = req.uri().path().to_string();
    proxy(&st, &id, &port, &path, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Request headers that belong to one hop (RFC 9110 §7.6.1), not passed on; an upgrade keeps
/// `connection` and `upgrade`.
const HOP_HEADERS: [HeaderName; 5] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRANSFER_ENCODING,
];

fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| {
                v.split(',')
                    .any(|t| t.trim().eq_ignore_ascii_case("upgrade"))
            })
}

async fn proxy(
    st: &AppState,
    id: &str,
    port: &str,
    path: &str,
    mut req: Request,
) -> Result<Response, ApiError> {
    let port = parse_port(port)?;
    let (query, token) = split_token(req.uri().query());
    let access = authorize(st, id, port, req.headers(), token.as_deref()).await?;
    let edge = st.forwarder.edge_for_sandbox(id)?;
    let url = format!("{}/edge/v1/sandboxes/{id}/ports/{port}/tunnel", edge.url);
    let mut call = st
        .forwarder
        .http()
        .get(&url)
        .bearer_auth(&edge.token)
        .header(header::CONNECTION, "upgrade")
        .header(header::UPGRADE, TUNNEL_PROTOCOL);
    if access == Access::PublicOnly {
        call = call.header(PUBLIC_ONLY_HEADER, "1");
    }
    let node = edge.node_id.clone().unwrap_or_else(|| edge.url.clone());
    let answer = call.send().await.map_err(|e| {
        ApiError::NodeUnavailable(format!("edge {node} is unreachable ({url}): {e}"))
    })?;
    if answer.status() != reqwest::StatusCode::SWITCHING_PROTOCOLS {
        // The edge's refusal (unknown sandbox, not public, nothing listening: 502) as it is.
        return Ok(crate::forward::into_response(answer));
    }
    let stream = answer.upgrade().await.map_err(|e| {
        ApiError::NodeUnavailable(format!("edge {node}: the port tunnel failed: {e}"))
    })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| ApiError::PortUnreachable(format!("port {port} of sandbox {id}: {e}")))?;
    let span = tracing::debug_span!("port", sandbox_id = %id, port);
    tokio::spawn(
        async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(error = %e, "port connection ended");
            }
        }
        .instrument(span),
    );

    let upgrade = is_upgrade(req.headers());
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    let target = match &query {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    parts.uri = target
        .parse::<Uri>()
        .map_err(|e| ApiError::BadRequest(format!("path {target:?}: {e}")))?;
    parts.version = Version::HTTP_11;
    if !upgrade {
        for h in &HOP_HEADERS {
            parts.headers.remove(h);
        }
    }
    parts.headers.remove(PORT_TOKEN_HEADER);
    if access == Access::Key {
        // The caller's API key stays with us.
        parts.headers.remove(header::AUTHORIZATION);
    }
    let mut answer = sender
        .send_request(Request::from_parts(parts, body))
        .await
        .map_err(|e| {
            ApiError::PortUnreachable(format!(
                "port {port} of sandbox {id} closed the connection without a complete HTTP answer: {e}"
            ))
        })?;
    if answer.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_upgrade) = client_upgrade {
            let server_upgrade = hyper::upgrade::on(&mut answer);
            let span = tracing::info_span!("port_upgrade", sandbox_id = %id, port);
            tokio::spawn(
                async move {
                    let (c, s) = tokio::join!(client_upgrade, server_upgrade);
                    match (c, s) {
                        (Ok(c), Ok(s)) => {
                            let r = tokio::io::copy_bidirectional(
                                &mut TokioIo::new(c),
                                &mut TokioIo::new(s),
                            )
                            .await;
                            tracing::debug!(result = ?r, "upgraded port connection closed");
                        }
                        (c, s) => tracing::debug!(
                            client = ?c.err(),
                            sandbox = ?s.err(),
                            "port upgrade failed"
                        ),
                    }
                }
                .instrument(span),
            );
        }
        return Ok(answer.map(Body::new));
    }
    // The caller's connection is ours (HTTP/1.1, keep-alive), whatever the sandbox's server
    // speaks (`http.server` answers HTTP/1.0 and closes).
    *answer.version_mut() = Version::HTTP_11;
    let h = answer.headers_mut();
    for name in &HOP_HEADERS {
        if *name != header::TRANSFER_ENCODING {
            h.remove(name);
        }
    }
    h.remove(header::TRANSFER_ENCODING);
    Ok(answer.map(Body::new))
}

/// `POST /v1/sandboxes/{id}/port_urls`: a signed, expiring URL for one port.
pub async fn port_url(
    State(st): State<AppState>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<axum::Json<PortUrl>, ApiError> {
    let req: PortUrlRequest = serde_json::from_slice(&body).map_err(|e| {
        ApiError::BadRequest(format!(
            "body must be {{\"port\": 1..65535, \"expires_in\": seconds}}: {e}"
        ))
    })?;
    if req.port == 0 {
        return Err(ApiError::BadRequest(
            "port 0 is not a TCP port: use 1..=65535".into(),
        ));
    }
    let secs = req.expires_in.unwrap_or(DEFAULT_PORT_TOKEN_SECS);
    if secs == 0 || secs > MAX_PORT_TOKEN_SECS {
        return Err(ApiError::BadRequest(format!(
            "expires_in must be 1..={MAX_PORT_TOKEN_SECS} seconds"
        )));
    }
    // The node must be one we know (a malformed id is a 404 here, not at first use).
    st.forwarder.edge_for_sandbox(&id)?;
    let expires_at = now_secs() + secs;
    let token = sign(&secret(&st), &id, req.port, expires_at);
    Ok(axum::Json(PortUrl {
        path: format!(
            "/v1/sandboxes/{id}/ports/{}/?{PORT_TOKEN_QUERY}={token}",
            req.port
        ),
        host: st
            .config
            .sandbox_domain
            .as_ref()
            .map(|d| format!("{}-{id}.{d}", req.port)),
        sandbox_id: id,
        port: req.port,
        token,
        expires_at,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc4231_case_2() {
        assert_eq!(
            hex::encode(hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn tokens_are_bound_to_sandbox_port_and_time() {
        let k = b"0123456789abcdef";
        let t = sign(k, "sb-n0-1", 8000, 1000);
        assert!(check_token(k, "sb-n0-1", 8000, &t, 999).is_ok());
        assert!(check_token(k, "sb-n0-1", 8000, &t, 1000).is_ok());
        let expired = check_token(k, "sb-n0-1", 8000, &t, 1001).unwrap_err();
        assert!(expired.to_string().contains("expired"), "{expired}");
        assert!(check_token(k, "sb-n0-1", 8001, &t, 10).is_err());
        assert!(check_token(k, "sb-n0-2", 8000, &t, 10).is_err());
        assert!(check_token(b"another secret!!", "sb-n0-1", 8000, &t, 10).is_err());
        // A later expiry with the old signature is refused.
        let forged = t.replacen("1000", "9999", 1);
        assert!(check_token(k, "sb-n0-1", 8000, &forged, 10).is_err());
        assert!(check_token(k, "sb-n0-1", 8000, "junk", 10).is_err());
        assert_eq!(
            ApiError::TokenRefused("x".into()).into_response().status(),
            401
        );
    }

    #[test]
    fn paths_and_hosts() {
        assert_eq!(
            split_path("/v1/sandboxes/sb-n0-1/ports/8000/a/b"),
            Some(("sb-n0-1", "8000", "/a/b"))
        );
        assert_eq!(
            split_path("/v1/sandboxes/sb-n0-1/ports/8000"),
            Some(("sb-n0-1", "8000", ""))
        );
        assert_eq!(split_path("/v1/sandboxes/sb-n0-1/files"), None);
        assert_eq!(
            parse_host("8000-sb-n0-1.sbx.dsec.test:7480", "sbx.dsec.test"),
            Some(("8000", "sb-n0-1"))
        );
        assert_eq!(
            parse_host("8000-sb-n0-1.sbx.dsec.test", "sbx.dsec.test"),
            Some(("8000", "sb-n0-1"))
        );
        assert_eq!(parse_host("sbx.dsec.test", "sbx.dsec.test"), None);
        assert_eq!(parse_host("a.b.sbx.dsec.test", "sbx.dsec.test"), None);
        assert_eq!(parse_host("127.0.0.1:7480", "sbx.dsec.test"), None);
        assert!(valid_domain("sbx.dsec.test"));
        assert!(!valid_domain("Sbx.test"));
        assert!(!valid_domain("a..b"));
    }

    #[test]
    fn token_is_taken_out_of_the_query() {
        assert_eq!(
            split_token(Some("a=1&dsec_token=5.ab&b=2")),
            (Some("a=1&b=2".into()), Some("5.ab".into()))
        );
        assert_eq!(
            split_token(Some("dsec_token=5.ab")),
            (None, Some("5.ab".into()))
        );
        assert_eq!(split_token(None), (None, None));
    }
}
