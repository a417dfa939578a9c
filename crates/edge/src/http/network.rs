//! `/edge/v1/sandboxes/{id}/network`: read the policy and counters, change the rules live.

use axum::extract::State;
use axum::Json;
use dsec_wire::api::{NetworkSpec, NetworkStatus};

use super::{ApiJson, ApiPath, AppState};
use crate::error::EdgeError;

pub async fn get(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<NetworkStatus>, EdgeError> {
    Ok(Json(s.mgr.network_status(&id).await?))
}

pub async fn put(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(spec): ApiJson<NetworkSpec>,
) -> Result<Json<NetworkStatus>, EdgeError> {
    Ok(Json(s.mgr.set_network(&id, spec).await?))
}
