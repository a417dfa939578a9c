//! `GET /edge/v1/status`, `GET /metrics`, `GET /healthz`.

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::Json;
use dsec_wire::api::NodeStatus;

use super::AppState;

pub async fn status(State(s): State<AppState>) -> Json<NodeStatus> {
    Json(s.mgr.status())
}

pub async fn metrics(State(s): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.mgr.metrics().render()
            + &super::images::metrics_text(&s.mgr.image_store().stats())
            + &super::images::cache_metrics_text(s.mgr.image_store().cache_stats()),
    )
}

pub async fn healthz() -> &'static str {
    "ok\n"
}

/// `GET /edge/v1/sandboxes/{id}/metrics`: the sandbox's recent resource samples.
pub async fn sandbox_metrics(
    State(s): State<AppState>,
    super::ApiPath(id): super::ApiPath<String>,
) -> Result<Json<dsec_wire::api::SandboxMetrics>, crate::error::EdgeError> {
    s.mgr.get(&id)?;
    Ok(Json(s.mgr.metrics().sandbox_samples.metrics(&id)))
}
