//! `/edge/v1/sandboxes/{id}/trajectory`: export (JSONL), last step, blobs.

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use dsec_wire::api::LastStep;

use super::{ApiPath, ApiQuery, AppState};
use crate::error::EdgeError;
use crate::trajectory::reader::Filter;

pub async fn export(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(f): ApiQuery<Filter>,
) -> Result<Response, EdgeError> {
    let sandboxes = s.mgr.config().sandboxes_dir();
    let records = s.mgr.trajectory().query(&id, &f, &sandboxes)?;
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        crate::trajectory::reader::to_jsonl(&records),
    )
        .into_response())
}

pub async fn last_step(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<LastStep>, EdgeError> {
    Ok(Json(s.mgr.trajectory().last_step(&id)?))
}

pub async fn blob(
    State(s): State<AppState>,
    ApiPath((id, digest)): ApiPath<(String, String)>,
) -> Result<Response, EdgeError> {
    let data = s.mgr.trajectory().blob_of(&id, &digest)?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], data).into_response())
}
