//! `/edge/v1/sandboxes/{id}/files`: upload, download, list, stat, remove, mkdir.

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use dsec_wire::api::{FileInfo, FileList};
use serde::Deserialize;

use super::{ApiPath, ApiQuery, AppState};
use crate::error::EdgeError;
use crate::files::parse_mode;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    path: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteQuery {
    path: String,
    mode: Option<String>,
    /// Create missing parent directories (default true).
    parents: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoveQuery {
    path: String,
    #[serde(default)]
    recursive: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MkdirQuery {
    path: String,
    mode: Option<String>,
    #[serde(default)]
    parents: bool,
}

pub async fn write(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<WriteQuery>,
    body: Body,
) -> Result<Json<FileInfo>, EdgeError> {
    let mode = parse_mode(q.mode.as_deref().unwrap_or("0644"))?;
    let info = s
        .mgr
        .write_file(
            &id,
            &q.path,
            mode,
            q.parents.unwrap_or(true),
            body.into_data_stream(),
        )
        .await?;
    Ok(Json(info))
}

pub async fn read(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Response, EdgeError> {
    let d = s.mgr.read_file(&id, &q.path).await?;
    let mut resp = Body::from_stream(d.body).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    if let Ok(v) = HeaderValue::from_str(&format!("{:04o}", d.mode)) {
        h.insert("x-dsec-mode", v);
    }
    if let Some(size) = d.size {
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(size));
    }
    Ok(resp)
}

pub async fn list(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Json<FileList>, EdgeError> {
    Ok(Json(s.mgr.list_dir(&id, &q.path).await?))
}

pub async fn stat(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Json<FileInfo>, EdgeError> {
    Ok(Json(s.mgr.stat_file(&id, &q.path).await?))
}

pub async fn remove(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<RemoveQuery>,
) -> Result<StatusCode, EdgeError> {
    s.mgr.remove_file(&id, &q.path, q.recursive).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub async fn mkdir(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<MkdirQuery>,
) -> Result<Json<FileInfo>, EdgeError> {
    let mode = parse_mode(q.mode.as_deref().unwrap_or("0755"))?;
    Ok(Json(s.mgr.mkdir(&id, &q.path, mode, q.parents).await?))
}
