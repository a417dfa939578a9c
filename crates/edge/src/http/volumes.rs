//! `/edge/v1/volumes`: this node's volumes (the apiserver keeps names and owners).

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use dsec_wire::api::{EdgeCreateVolume, EdgeVolumeInfo, EdgeVolumeList};

use super::{ApiJson, ApiPath, AppState};
use crate::error::EdgeError;

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, crate::volumes::VolumeError> + Send + 'static,
) -> Result<T, EdgeError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| EdgeError::Internal(format!("volume task: {e}")))?
        .map_err(Into::into)
}

pub async fn create(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<EdgeCreateVolume>,
) -> Result<(StatusCode, Json<EdgeVolumeInfo>), EdgeError> {
    let vols = s.mgr.volumes().clone();
    let info = blocking(move || vols.create(&req.id, req.size_mb)).await?;
    Ok((StatusCode::CREATED, Json(info)))
}

pub async fn list(State(s): State<AppState>) -> Result<Json<EdgeVolumeList>, EdgeError> {
    let vols = s.mgr.volumes().clone();
    let volumes = blocking(move || Ok(vols.list())).await?;
    Ok(Json(EdgeVolumeList { volumes }))
}

pub async fn get(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<EdgeVolumeInfo>, EdgeError> {
    let vols = s.mgr.volumes().clone();
    Ok(Json(blocking(move || vols.info(&id)).await?))
}

pub async fn delete(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, EdgeError> {
    let vols = s.mgr.volumes().clone();
    blocking(move || vols.delete(&id)).await?;
    Ok(StatusCode::NO_CONTENT)
}
