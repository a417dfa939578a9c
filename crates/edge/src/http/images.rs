//! `/edge/v1/images`: import (tar stream), list, remove.

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use dsec_wire::api::{ImageInfo, ImageList};
use futures::TryStreamExt as _;

use super::{ApiPath, ApiQuery, AppState};
use crate::error::EdgeError;

#[derive(Debug, serde::Deserialize)]
pub struct ImportQuery {
    /// `tar` (default), `docker-archive` or `oci` (a tar of an OCI image layout).
    #[serde(default)]
    format: Option<String>,
}

pub async fn import(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    ApiQuery(q): ApiQuery<ImportQuery>,
    body: Body,
) -> Result<(StatusCode, Json<ImageInfo>), EdgeError> {
    let reader =
        tokio_util::io::StreamReader::new(body.into_data_stream().map_err(std::io::Error::other));
    let format = match q.format.as_deref() {
        None => dsec_image::ArchiveFormat::Tar,
        Some(f) => dsec_image::ArchiveFormat::parse(f).ok_or_else(|| {
            EdgeError::BadRequest(format!(
                "unknown image format {f:?}: use tar, docker-archive or oci"
            ))
        })?,
    };
    let info = if format == dsec_image::ArchiveFormat::Tar {
        s.mgr.import_image(&name, reader).await?
    } else {
        s.mgr
            .image_store()
            .import_archive(&name, reader, format)
            .await
            .map_err(EdgeError::from_image)?
    };
    Ok((StatusCode::CREATED, Json(info)))
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
