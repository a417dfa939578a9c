//! `/edge/v1/microvm/templates`: what the microVM substrate keeps to boot faster.

use axum::extract::State;
use axum::Json;
use dsec_wire::api::Substrate;

use super::AppState;
use crate::error::EdgeError;

/// `GET /edge/v1/microvm/templates`: the templates (key, shape, bytes on disk, uses) and how
/// creates started.
pub async fn list(State(s): State<AppState>) -> Result<Json<serde_json::Value>, EdgeError> {
    s.mgr.templates(Substrate::Microvm).map(Json)
}

/// `DELETE /edge/v1/microvm/templates`: removes every template (later creates boot cold and
/// build them again).
pub async fn remove(State(s): State<AppState>) -> Result<Json<serde_json::Value>, EdgeError> {
    let removed = s.mgr.remove_templates(Substrate::Microvm)?;
    Ok(Json(serde_json::json!({ "removed": removed })))
}
