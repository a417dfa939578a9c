//! The in-sandbox envd API (Connect-RPC `process.Process` / `filesystem.Filesystem`, `/files`,
//! `/health`, ...): PLACEHOLDER until engineer envd's implementation is merged.
//!
//! Contract (both sides keep it):
//!
//! ```ignore
//! pub async fn serve(
//!     state: &crate::routes::AppState,
//!     sandbox_id: &str,
//!     req: axum::extract::Request,          // = http::Request<axum::body::Body>
//! ) -> axum::response::Response             // = http::Response<axum::body::Body>
//! ```
//!
//! `req` is the caller's request with the `/e2b` prefix already taken off its path (so a
//! Connect call arrives as `/process.Process/Start`, an upload as `/files?path=...`), every
//! header kept (`X-Access-Token`, `E2b-Sandbox-Id`, `E2b-Sandbox-Port`, `Connect-*`). The
//! dispatcher (`compat::e2b::dispatch`) calls it for a request carrying `E2b-Sandbox-Id`
//! with port 49983 (or no port), for the host `49983-{id}.{sandbox_domain}` and for
//! `sandbox.{sandbox_domain}`. The access token is `access::envd_token(secret, id)` with the
//! secret of `crate::ports::secret(state)`; checking it is this module's job. The axum types
//! are used rather than `hyper::body::Incoming`, because `axum::serve` hands every request to
//! the router with an `axum::body::Body` (which streams the same bytes).
//!
//! It must not answer anything but an E2B-shaped error until the real module replaces it.

use axum::extract::Request;
use axum::response::Response;

use crate::routes::AppState;

/// Answers 501 in E2B's error shape: the envd services are not part of this build.
pub async fn serve(_state: &AppState, sandbox_id: &str, req: Request) -> Response {
    super::rest::errors::e2b_error(
        axum::http::StatusCode::NOT_IMPLEMENTED,
        format!(
            "the in-sandbox (envd) API is not available in this build ({} {} for sandbox {sandbox_id}); use dsec's own SDK for commands and files",
            req.method(),
            req.uri().path()
        ),
    )
}
