//! E2B-compatible API (issue 19): the e2b Python and JavaScript SDKs work against dsec with
//! `E2B_API_URL=http://HOST:7480/e2b`, `E2B_SANDBOX_URL=http://HOST:7480/e2b` and
//! `E2B_API_KEY=<a dsec API key>`.
//!
//! Everything under `/e2b` is translation onto dsec's own primitives: a sandbox made here is
//! an ordinary dsec sandbox (same quotas, placement, labels, pause, trajectory; visible in
//! `dsec ps`). This module must not keep state of its own nor reach sandboxes other than
//! through the edges' HTTP API, like the rest of the apiserver.
//!
//! - REST control plane ([`rest`]): `/e2b/sandboxes`, `/e2b/v2/sandboxes`, ..., behind a
//!   dsec API key in `X-API-Key` (what the SDK sends) or `Authorization: Bearer`.
//! - Sandbox traffic: a request carrying `E2b-Sandbox-Id` goes to the sandbox, whatever its
//!   path: port 49983 (envd, the SDK's `E2b-Sandbox-Port`) to [`envd::serve`], any other port
//!   to the exposed-port proxy ([`crate::ports`]). With `[apiserver] sandbox_domain` set, the
//!   hosts `49983-{id}.{domain}` and `sandbox.{domain}` (with the headers) reach envd too; the
//!   other `{port}-{id}.{domain}` hosts are the port proxy's.
//! - A sandbox created here gets `envdAccessToken` ([`access::envd_token`]) always; its ports
//!   are public unless it was created with `network.allowPublicTraffic = false` (then the
//!   `e2b-traffic-access-token` header, [`access::traffic_token`], or a dsec key opens them).

pub mod access;
pub mod config;
pub mod envd;
pub mod rest;
use crate::time;
pub mod traffic;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post, put};
use axum::Router;

use self::rest::errors::{e2b_error, E2bError};
use crate::routes::AppState;

/// Path prefix of the E2B API on the apiserver.
pub const PREFIX: &str = "/e2b";
/// The port E2B's in-sandbox daemon (envd) listens on; the SDK sends it in `E2b-Sandbox-Port`.
pub const ENVD_PORT: u16 = 49983;
/// The envd version announced to the SDK (it enables features by version).
pub const ENVD_VERSION: &str = "0.5.7";
/// Header naming the sandbox of a sandbox-bound request.
pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
/// Header naming the port of a sandbox-bound request.
pub const SANDBOX_PORT_HEADER: &str = "e2b-sandbox-port";
/// Header of the traffic access token.
pub const TRAFFIC_TOKEN_HEADER: &str = "e2b-traffic-access-token";

/// The E2B operations the OpenAPI document describes (the entry points; the rest follows
/// E2B's own description).
pub const DOCUMENTED: &[(&str, &str)] =
    &[("post", "/e2b/v2/sandboxes"), ("get", "/e2b/v2/sandboxes")];

/// The `/e2b` routes, merged beside `/v1`.
pub fn router(state: AppState) -> Router<AppState> {
    use rest::{lifecycle, metrics, sandboxes, snapshots, templates, volumes};
    let p = |s: &str| format!("{PREFIX}{s}");
    let rest = Router::new()
        .route(
            &p("/sandboxes"),
            post(sandboxes::create).get(sandboxes::list_v1),
        )
        .route(
            &p("/v2/sandboxes"),
            post(sandboxes::create).get(sandboxes::list_v2),
        )
        .route(&p("/sandboxes/metrics"), get(metrics::many))
        .route(
            &p("/sandboxes/{id}"),
            get(sandboxes::get).delete(sandboxes::kill),
        )
        .route(&p("/sandboxes/{id}/timeout"), post(lifecycle::timeout))
        .route(&p("/sandboxes/{id}/refreshes"), post(lifecycle::refresh))
        .route(&p("/sandboxes/{id}/pause"), post(lifecycle::pause))
        .route(&p("/sandboxes/{id}/resume"), post(lifecycle::resume))
        .route(&p("/sandboxes/{id}/connect"), post(lifecycle::connect))
        .route(&p("/v2/sandboxes/{id}/connect"), post(lifecycle::connect))
        .route(&p("/sandboxes/{id}/network"), put(lifecycle::network))
        .route(&p("/sandboxes/{id}/snapshots"), post(snapshots::create))
        .route(&p("/sandboxes/{id}/fork"), post(snapshots::fork))
        .route(&p("/sandboxes/{id}/metrics"), get(metrics::sandbox))
        .route(&p("/sandboxes/{id}/logs"), get(metrics::logs))
        .route(&p("/v2/sandboxes/{id}/logs"), get(metrics::logs_v2))
        .route(&p("/snapshots"), get(snapshots::list))
        .route(&p("/templates"), get(templates::list))
        .route(&p("/templates/aliases/{alias}"), get(templates::alias))
        .route(
            &p("/templates/{id}"),
            get(templates::get).delete(snapshots::delete),
        )
        .route(&p("/volumes"), any(volumes::unsupported))
        .route(&p("/volumes/{*rest}"), any(volumes::unsupported))
        .route(&p("/"), any(unknown))
        .route(&p("/{*rest}"), any(unknown))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    rest.route(PREFIX, any(unknown))
        .route_layer(middleware::from_fn_with_state(state, dispatch))
}

/// The dsec API key of an E2B call: `X-API-Key`, else `Authorization: Bearer`.
pub fn api_key(headers: &HeaderMap) -> Option<&str> {
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .or_else(|| {
            crate::auth::bearer(
                headers
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok()),
            )
        })
}

async fn require_key(State(st): State<AppState>, mut req: Request, next: Next) -> Response {
    match st.verifier.verify(api_key(req.headers())).await {
        Ok(principal) => {
            req.extensions_mut().insert(principal);
            next.run(req).await
        }
        Err(e) => E2bError::from(e).into_response(),
    }
}

/// E2B API families dsec does not implement (answered 501, not 404).
const UNSUPPORTED: &[(&str, &str)] = &[
    ("/secrets", "secrets"),
    ("/v2/templates", "building templates"),
    ("/v3/templates", "building templates"),
    ("/templates/tags", "template tags"),
    ("/teams", "teams"),
    ("/access-tokens", "access tokens"),
    ("/api-keys", "API key management (use `dsec key`)"),
];

async fn unknown(uri: Uri) -> Response {
    let path = uri.path().strip_prefix(PREFIX).unwrap_or(uri.path());
    if let Some((_, what)) = UNSUPPORTED.iter().find(|(p, _)| path.starts_with(p)) {
        return E2bError::unsupported(what).into_response();
    }
    if path.starts_with("/templates") {
        return E2bError::unsupported("changing templates (build, update)").into_response();
    }
    e2b_error(
        StatusCode::NOT_FOUND,
        format!("no E2B endpoint {path} in dsec's E2B-compatible API (see the README section \"Using the E2B SDK\")"),
    )
}

fn header_str<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// Sends a sandbox-bound request (path already without `/e2b`) to envd or to a port.
pub async fn to_sandbox(st: &AppState, id: &str, port: Option<&str>, req: Request) -> Response {
    match port {
        None => envd::serve(st, id, req).await,
        Some(p) if p == ENVD_PORT.to_string() => envd::serve(st, id, req).await,
        Some(p) => crate::ports::proxy_request(st, id, p, req).await,
    }
}

/// Route layer of `/e2b`: a request with `E2b-Sandbox-Id` is the sandbox's, not the API's.
async fn dispatch(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let Some(id) = header_str(req.headers(), SANDBOX_ID_HEADER).map(str::to_string) else {
        return next.run(req).await;
    };
    let port = header_str(req.headers(), SANDBOX_PORT_HEADER).map(str::to_string);
    let req = match strip_prefix(req) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    to_sandbox(&st, &id, port.as_deref(), req).await
}

/// The request with `/e2b` taken off its path.
fn strip_prefix(mut req: Request) -> Result<Request, E2bError> {
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    let rest = pq.strip_prefix(PREFIX).unwrap_or(&pq);
    let rest = if rest.is_empty() || rest.starts_with('?') {
        format!("/{rest}")
    } else {
        rest.to_string()
    };
    match rest.parse::<Uri>() {
        Ok(u) => {
            *req.uri_mut() = u;
            Ok(req)
        }
        Err(e) => Err(E2bError::bad_request(format!("path {rest:?}: {e}"))),
    }
}

/// Layer on the whole router (outside the port proxy's): with a `sandbox_domain`, the hosts
/// `sandbox.{domain}` (with `E2b-Sandbox-Id`) and `49983-{id}.{domain}` reach envd.
pub async fn by_host(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let Some(domain) = st.config.sandbox_domain.as_deref() else {
        return next.run(req).await;
    };
    let Some(host) = crate::ports::request_host(&req) else {
        return next.run(req).await;
    };
    let name = host
        .rsplit_once(':')
        .filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit()))
        .map_or(host.as_str(), |(h, _)| h);
    if name.strip_suffix(domain).and_then(|l| l.strip_suffix('.')) == Some("sandbox") {
        let Some(id) = header_str(req.headers(), SANDBOX_ID_HEADER).map(str::to_string) else {
            return e2b_error(
                StatusCode::BAD_REQUEST,
                "requests to sandbox.{domain} need the E2b-Sandbox-Id header",
            );
        };
        let port = header_str(req.headers(), SANDBOX_PORT_HEADER).map(str::to_string);
        return to_sandbox(&st, &id, port.as_deref(), req).await;
    }
    if let Some((port, id)) = crate::ports::parse_host(&host, domain) {
        if port == ENVD_PORT.to_string() {
            let id = id.to_string();
            return envd::serve(&st, &id, req).await;
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_from_either_header() {
        let mut h = HeaderMap::new();
        assert_eq!(api_key(&h), None);
        h.insert(header::AUTHORIZATION, "Bearer dsk_b".parse().unwrap());
        assert_eq!(api_key(&h), Some("dsk_b"));
        h.insert("x-api-key", "dsk_a".parse().unwrap());
        assert_eq!(api_key(&h), Some("dsk_a"));
    }

    #[test]
    fn prefix_is_stripped() {
        let r = Request::builder()
            .uri("/e2b/process.Process/Start?x=1")
            .body(axum::body::Body::empty())
            .unwrap();
        assert_eq!(
            strip_prefix(r).unwrap().uri().to_string(),
            "/process.Process/Start?x=1"
        );
        let r = Request::builder()
            .uri("/e2b")
            .body(axum::body::Body::empty())
            .unwrap();
        assert_eq!(strip_prefix(r).unwrap().uri().path(), "/");
    }
}
