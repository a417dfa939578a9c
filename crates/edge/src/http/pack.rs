//! `POST /edge/v1/sandboxes/{id}/pack_diff`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use dsec_wire::api::{ImageInfo, PackDiffRequest};

use super::{ApiJson, ApiPath, AppState};
use crate::error::EdgeError;

pub async fn pack_diff(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<PackDiffRequest>,
) -> Result<(StatusCode, Json<ImageInfo>), EdgeError> {
    Ok((StatusCode::CREATED, Json(s.mgr.pack_diff(&id, req).await?)))
}
