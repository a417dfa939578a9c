//! E2B compatibility (issue 19): the e2b SDKs work against dsec unchanged.
//!
//! `envd`: the in-sandbox API (Connect RPC `process.Process` / `filesystem.Filesystem`,
//! `/files`, `/health`, `/envs`, `/metrics`), translated onto dsec's native sandbox API.
//! `access`: the per-sandbox envd access token and the check of envd calls.
//!
//! STAND-IN (branch wt3/envd only): the REST control plane and the real dispatcher are
//! engineer e2bapi's `compat/e2b/mod.rs`, which replaces this file at merge. Until then
//! [`router`] sends every `/e2b/...` request carrying `E2b-Sandbox-Id` to [`envd::serve`], so
//! the envd API can be tested. It must not grow anything else.

pub mod access;
pub mod envd;

use axum::extract::{Request, State};
use axum::http::Uri;
use axum::response::Response;
use axum::routing::any;
use axum::Router;

use crate::routes::AppState;

/// `/e2b/{path}` with `E2b-Sandbox-Id`: the sandbox's envd API.
pub fn router(_state: AppState) -> Router<AppState> {
    Router::new().route("/e2b/{*rest}", any(to_envd))
}

async fn to_envd(State(st): State<AppState>, mut req: Request) -> Response {
    let id = req
        .headers()
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .trim()
        .to_string();
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    let rest = pq.strip_prefix("/e2b").unwrap_or(&pq).to_string();
    if let Ok(u) = rest.parse::<Uri>() {
        *req.uri_mut() = u;
    }
    if id.is_empty() {
        return envd::files::http_error(
            axum::http::StatusCode::NOT_FOUND,
            "this build serves only the envd API under /e2b (send E2b-Sandbox-Id)",
        );
    }
    envd::serve(&st, &id, req).await
}
