//! Exposed ports (issue 18): the signed-URL route and the proxy to sandbox ports.

#![allow(dead_code)]

use dsec_wire::api::{ErrorBody, PortUrl, PortUrlRequest};
use utoipa::IntoParams;

use super::paths::ERRORS;

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct SandboxPath {
    /// Sandbox id; encodes the owning node.
    #[param(pattern = r"^sb-[a-z0-9]{1,16}-[0-9a-f]{16}$")]
    id: String,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct PortPath {
    /// Sandbox id; encodes the owning node.
    #[param(pattern = r"^sb-[a-z0-9]{1,16}-[0-9a-f]{16}$")]
    id: String,
    /// TCP port inside the sandbox (1..=65535).
    port: u16,
    /// Path (and query) passed to the sandbox's server; `/v1/sandboxes/{id}/ports/{port}` and
    /// `.../{port}/` reach `/`.
    path: String,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct PortTokenQuery {
    /// A port URL token from `POST /v1/sandboxes/{id}/port_urls` (instead of the API key;
    /// also accepted as header `x-dsec-port-token`); removed before the request goes on.
    dsec_token: Option<String>,
}

/// Sign an expiring URL for one port of the sandbox: whoever holds it reaches that port
/// (and only it) without the API key until `expires_at`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/port_urls", tag = "ports", operation_id = "createPortUrl",
    params(SandboxPath),
    request_body = PortUrlRequest,
    responses(
        (status = 200, description = "The signed path (and host when `sandbox_domain` is set)", body = PortUrl),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn create_port_url() {}

macro_rules! proxy_op {
    ($method:ident, $fn:ident, $op:literal) => {
        /// Proxied to the TCP port inside the sandbox (HTTP/1.1, keep-alive, streamed bodies,
        /// WebSocket upgrades; also as `Host: {port}-{id}.{sandbox_domain}`). Needs the API key,
        /// a `dsec_token`, or the port among the sandbox's `public_ports`. 502
        /// `port_unreachable` when nothing listens on the port.
        #[utoipa::path($method, path = "/v1/sandboxes/{id}/ports/{port}/{path}", tag = "ports", operation_id = $op,
            params(PortPath, PortTokenQuery),
            responses(
                (status = 200, description = "Whatever the sandbox's server answers (any status; 101 for an upgrade)"),
                (status = "default", description = ERRORS, body = ErrorBody),
            ))]
        pub fn $fn() {}
    };
}

proxy_op!(get, proxy_get, "portGet");
proxy_op!(post, proxy_post, "portPost");
proxy_op!(put, proxy_put, "portPut");
proxy_op!(delete, proxy_delete, "portDelete");

/// The methods the document describes on the proxy path (every method is proxied).
pub const PROXY_METHODS: &[&str] = &["get", "post", "put", "delete"];
