//! `/edge/v1/images`: import (tar stream), list, remove.

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use dsec_wire::api::{ImageInfo, ImageList};
use futures::TryStreamExt as _;

use super::{ApiPath, AppState};
use crate::error::EdgeError;

pub async fn import(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    body: Body,
) -> Result<(StatusCode, Json<ImageInfo>), EdgeError> {
    let reader =
        tokio_util::io::StreamReader::new(body.into_data_stream().map_err(std::io::Error::other));
    Ok((
        StatusCode::CREATED,
        Json(s.mgr.import_image(&name, reader).await?),
    ))
}

pub async fn list(State(s): State<AppState>) -> Json<ImageList> {
    Json(s.mgr.list_images())
}

pub async fn remove(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> Result<StatusCode, EdgeError> {
    s.mgr.remove_image(&name)?;
    Ok(StatusCode::NO_CONTENT)
}
