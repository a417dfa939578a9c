//! `POST /edge/v1/sandboxes/{id}/pack_diff`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use dsec_wire::api::{ImageInfo, PackDiffRequest, SnapshotInfo, SnapshotRequest};

use super::{ApiJson, ApiPath, AppState};
use crate::error::EdgeError;

pub async fn pack_diff(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<PackDiffRequest>,
) -> Result<(StatusCode, Json<ImageInfo>), EdgeError> {
    Ok((StatusCode::CREATED, Json(s.mgr.pack_diff(&id, req).await?)))
}

/// `POST /edge/v1/sandboxes/{id}/snapshot`.
pub async fn snapshot(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<SnapshotRequest>,
) -> Result<(StatusCode, Json<SnapshotInfo>), EdgeError> {
    Ok((StatusCode::CREATED, Json(s.mgr.snapshot(&id, req).await?)))
}
