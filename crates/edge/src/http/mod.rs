//! The edge HTTP API: `/edge/v1/...` (bearer token), `/metrics` and `/healthz` (open).
//!
//! One file per resource. Handlers parse, call ONE [`Manager`] method and map its result;
//! errors become answers only in [`crate::error`].

mod extract;
mod files;
pub mod functions;
mod images;
mod network;
mod pack;
mod pause;
mod ports;
mod processes;
mod sandboxes;
mod status;
mod templates;
mod trajectory;
mod ttl;
mod tty;
mod volumes;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;
use dsec_wire::api::limits;
use tracing::Instrument as _;

use crate::error::EdgeError;
use crate::manager::Manager;

pub use extract::{ApiJson, ApiPath, ApiQuery};

/// Shared state of every handler.
#[derive(Clone)]
pub struct AppState {
    pub mgr: Arc<Manager>,
    pub token: Arc<str>,
}

/// Builds the edge's router.
pub fn router(mgr: Arc<Manager>, token: &str) -> Router {
    let state = AppState {
        mgr,
        token: Arc::from(token),
    };
    let sb = "/edge/v1/sandboxes/{id}";
    let api = Router::new()
        .route(
            "/edge/v1/sandboxes",
            post(sandboxes::create).get(sandboxes::list),
        )
        .route(sb, get(sandboxes::get).delete(sandboxes::stop))
        .route(&format!("{sb}/shell"), post(sandboxes::shell))
        .route(&format!("{sb}/exec"), post(sandboxes::exec))
        .route(
            &format!("{sb}/sessions/{{name}}"),
            delete(sandboxes::close_session),
        )
        .route(
            &format!("{sb}/files"),
            get(files::read).put(files::write).delete(files::remove),
        )
        .route(&format!("{sb}/files/list"), get(files::list))
        .route(&format!("{sb}/files/stat"), get(files::stat))
        .route(&format!("{sb}/files/mkdir"), post(files::mkdir))
        .route(&format!("{sb}/files/rename"), post(files::rename))
        .route(&format!("{sb}/watch"), get(files::watch))
        .route(&format!("{sb}/metrics"), get(status::sandbox_metrics))
        .route(
            &format!("{sb}/processes"),
            post(processes::start).get(processes::list),
        )
        .route(&format!("{sb}/processes/{{pid}}"), get(processes::get))
        .route(
            &format!("{sb}/processes/{{pid}}/output"),
            get(processes::output),
        )
        .route(
            &format!("{sb}/processes/{{pid}}/wait"),
            post(processes::wait),
        )
        .route(
            &format!("{sb}/processes/{{pid}}/stdin"),
            post(processes::stdin),
        )
        .route(
            &format!("{sb}/processes/{{pid}}/signal"),
            post(processes::signal),
        )
        .route(
            &format!("{sb}/processes/{{pid}}/kill"),
            post(processes::kill),
        )
        .route(&format!("{sb}/tty"), get(tty::open))
        .route(&format!("{sb}/ports/{{port}}/tunnel"), get(ports::tunnel))
        .route(&format!("{sb}/trajectory"), get(trajectory::export))
        .route(
            &format!("{sb}/trajectory/last_step"),
            get(trajectory::last_step),
        )
        .route(
            &format!("{sb}/trajectory/blobs/{{digest}}"),
            get(trajectory::blob),
        )
        .route(
            &format!("{sb}/network"),
            get(network::get).put(network::put),
        )
        .route(&format!("{sb}/pause"), post(pause::pause))
        .route(&format!("{sb}/ttl"), axum::routing::put(ttl::update))
        .route(&format!("{sb}/resume"), post(pause::resume))
        .route("/edge/v1/jobs/{op}", post(pause::job))
        .route(&format!("{sb}/pack_diff"), post(pack::pack_diff))
        .route(&format!("{sb}/snapshot"), post(pack::snapshot))
        .route("/edge/v1/images", get(images::list))
        .route(
            "/edge/v1/images/{*name}",
            axum::routing::put(images::import)
                .delete(images::remove)
                .post(images::action),
        )
        .route("/edge/v1/status", get(status::status))
        .route("/edge/v1/volumes", get(volumes::list).post(volumes::create))
        .route(
            "/edge/v1/volumes/{id}",
            get(volumes::get).delete(volumes::delete),
        )
        .route(
            "/edge/v1/microvm/templates",
            get(templates::list).delete(templates::remove),
        )
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    let open = Router::new()
        .route("/metrics", get(status::metrics))
        .route("/healthz", get(status::healthz));
    api.merge(open)
        .route_layer(middleware::from_fn_with_state(state.clone(), observe))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limits::MAX_JSON_BODY))
        .with_state(state)
}

async fn not_found(req: Request) -> EdgeError {
    EdgeError::NotFound(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
}

async fn method_not_allowed(req: Request) -> Response {
    let msg = format!(
        "method {} is not allowed on {}",
        req.method(),
        req.uri().path()
    );
    let mut resp = EdgeError::BadRequest(msg).into_response();
    *resp.status_mut() = axum::http::StatusCode::METHOD_NOT_ALLOWED;
    resp
}

/// Constant-time comparison of the presented token.
fn token_matches(presented: &[u8], expected: &[u8]) -> bool {
    presented.len() == expected.len()
        && presented
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

pub(crate) async fn auth(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match presented {
        Some(t) if token_matches(t.trim().as_bytes(), s.token.as_bytes()) => next.run(req).await,
        Some(_) => EdgeError::Unauthorized(
            "the edge token is wrong: use the token this edge printed or was configured with"
                .into(),
        )
        .into_response(),
        None => {
            EdgeError::Unauthorized("missing `Authorization: Bearer <edge token>` header".into())
                .into_response()
        }
    }
}

/// The sandbox id in a request path, for the request span.
fn sandbox_of(path: &str) -> &str {
    path.strip_prefix("/edge/v1/sandboxes/")
        .map(|r| r.split('/').next().unwrap_or(""))
        .unwrap_or("")
}

/// A span per request (with the sandbox id) and the request counter by route and status.
async fn observe(State(s): State<AppState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let method = req.method().clone();
    let sandbox = sandbox_of(req.uri().path()).to_string();
    let span = tracing::info_span!("edge_http", %method, %route, sandbox = %sandbox);
    let started = std::time::Instant::now();
    let resp = next.run(req).instrument(span.clone()).await;
    let status = resp.status();
    span.in_scope(|| {
        tracing::debug!(
            status = status.as_u16(),
            ms = started.elapsed().as_secs_f64() * 1000.0,
            "request"
        )
    });
    s.mgr
        .metrics()
        .http_requests
        .with_label_values(&[&route, method.as_str(), status.as_str()])
        .inc();
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens() {
        assert!(token_matches(b"abc", b"abc"));
        assert!(!token_matches(b"abd", b"abc"));
        assert!(!token_matches(b"ab", b"abc"));
    }

    #[test]
    fn sandbox_in_path() {
        assert_eq!(sandbox_of("/edge/v1/sandboxes/sb-n0-1/shell"), "sb-n0-1");
        assert_eq!(sandbox_of("/edge/v1/sandboxes/sb-n0-1"), "sb-n0-1");
        assert_eq!(sandbox_of("/edge/v1/status"), "");
    }
}
