//! `PUT /edge/v1/sandboxes/{id}/ttl`: change a sandbox's TTLs (see `manager::ttl_update`).

use axum::extract::State;
use axum::Json;
use dsec_wire::api::{SandboxInfo, TtlUpdate};

use super::{ApiJson, ApiPath, AppState};
use crate::error::EdgeError;

pub async fn update(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(u): ApiJson<TtlUpdate>,
) -> Result<Json<SandboxInfo>, EdgeError> {
    Ok(Json(s.mgr.update_ttl(&id, &u)?))
}
