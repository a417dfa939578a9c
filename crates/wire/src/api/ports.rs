//! Exposed ports: a TCP port of a sandbox reached through the apiserver.
//!
//! `ANY /v1/sandboxes/{id}/ports/{port}/{path}` (and `{port}-{id}.{sandbox_domain}` by `Host`)
//! is proxied to the port inside the sandbox: HTTP/1.1 with keep-alive, chunked and streamed
//! bodies, WebSocket upgrades. Access needs the API key, a URL token from
//! `POST /v1/sandboxes/{id}/port_urls` (query `dsec_token=`, or header `x-dsec-port-token`),
//! or the port being one of the sandbox's `public_ports`.

use serde::{Deserialize, Serialize};

/// The query parameter carrying a signed port URL token.
pub const PORT_TOKEN_QUERY: &str = "dsec_token";
/// The header that may carry a signed port URL token instead of the query.
pub const PORT_TOKEN_HEADER: &str = "x-dsec-port-token";

/// Largest `expires_in` of a port URL token (seconds): 7 days.
pub const MAX_PORT_TOKEN_SECS: u64 = 7 * 24 * 3600;
/// `expires_in` when a request names none (seconds).
pub const DEFAULT_PORT_TOKEN_SECS: u64 = 3600;

/// `POST /v1/sandboxes/{id}/port_urls`: sign a URL for one port of the sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PortUrlRequest {
    /// The TCP port inside the sandbox (1..=65535).
    pub port: u16,
    /// Seconds the token stays valid (default 3600, at most 604800).
    #[serde(default)]
    pub expires_in: Option<u64>,
}

/// A signed URL for one sandbox port.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PortUrl {
    pub sandbox_id: String,
    pub port: u16,
    /// Path on the apiserver, with the token in its query: `/v1/sandboxes/{id}/ports/{port}/?dsec_token=...`.
    pub path: String,
    /// The token alone (also accepted in the `x-dsec-port-token` header).
    pub token: String,
    /// When the token stops being accepted (seconds since the epoch).
    pub expires_at: u64,
    /// `{port}-{id}.{sandbox_domain}` when the apiserver has a `sandbox_domain`.
    #[serde(default)]
    pub host: Option<String>,
}
