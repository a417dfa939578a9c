//! `/edge/v1/sandboxes/{id}/files`: upload, download, list, stat, remove, mkdir.

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt as _;
use serde::Deserialize;

use super::{ApiPath, ApiQuery, AppState};
use crate::error::EdgeError;
use crate::files::parse_mode;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    path: String,
    /// Client step id (trajectory fast-forward).
    step: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteQuery {
    path: String,
    mode: Option<String>,
    /// Create missing parent directories (default true).
    parents: Option<bool>,
    step: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoveQuery {
    path: String,
    #[serde(default)]
    recursive: bool,
    step: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MkdirQuery {
    path: String,
    mode: Option<String>,
    #[serde(default)]
    parents: bool,
    step: Option<u64>,
}

pub async fn write(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<WriteQuery>,
    body: Body,
) -> Result<Response, EdgeError> {
    let mode = parse_mode(q.mode.as_deref().unwrap_or("0644"))?;
    let (info, replayed) = s
        .mgr
        .write_file(
            &id,
            &q.path,
            (mode, q.parents.unwrap_or(true), q.step),
            body.into_data_stream(),
        )
        .await?;
    Ok(replayed_flag(Json(info), replayed))
}

/// Adds `x-dsec-replayed: true` to an answer served from the trajectory log.
pub fn replayed_flag(answer: impl IntoResponse, replayed: bool) -> Response {
    let mut resp = answer.into_response();
    if replayed {
        resp.headers_mut()
            .insert("x-dsec-replayed", HeaderValue::from_static("true"));
    }
    resp
}

pub async fn read(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Response, EdgeError> {
    let (d, replayed) = s.mgr.read_file(&id, &q.path, q.step).await?;
    let mut resp = replayed_flag(Body::from_stream(d.body), replayed);
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
) -> Result<Response, EdgeError> {
    let (list, replayed) = s.mgr.list_dir(&id, &q.path, q.step).await?;
    Ok(replayed_flag(Json(list), replayed))
}

pub async fn stat(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Response, EdgeError> {
    let (info, replayed) = s.mgr.stat_file(&id, &q.path, q.step).await?;
    Ok(replayed_flag(Json(info), replayed))
}

pub async fn remove(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<RemoveQuery>,
) -> Result<Response, EdgeError> {
    let replayed = s.mgr.remove_file(&id, &q.path, q.recursive, q.step).await?;
    Ok(replayed_flag(StatusCode::NO_CONTENT, replayed))
}

pub async fn mkdir(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<MkdirQuery>,
) -> Result<Response, EdgeError> {
    let mode = parse_mode(q.mode.as_deref().unwrap_or("0755"))?;
    let (info, replayed) = s.mgr.mkdir(&id, &q.path, (mode, q.parents), q.step).await?;
    Ok(replayed_flag(Json(info), replayed))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RenameQuery {
    src: String,
    dst: String,
    #[serde(default)]
    overwrite: bool,
}

/// `POST .../files/rename?src=&dst=&overwrite=`: move a file or directory.
pub async fn rename(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<RenameQuery>,
) -> Result<Json<dsec_wire::api::FileInfo>, EdgeError> {
    let lease = s.mgr.agent_lease(&id).await?;
    let result =
        crate::files::rename(&lease.client, &lease.sandbox, &q.src, &q.dst, q.overwrite).await;
    // Noted in the trajectory log.
    lease.note_value(
        "rename",
        serde_json::json!({"src": q.src, "dst": q.dst, "overwrite": q.overwrite}),
        result
            .as_ref()
            .map(|i| serde_json::to_value(i).unwrap_or_default()),
    );
    Ok(Json(result?))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WatchQuery {
    path: String,
    /// Also every directory below `path` (default true).
    recursive: Option<bool>,
}

/// `GET .../watch?path=&recursive=`: NDJSON filesystem events until the client closes.
pub async fn watch(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<WatchQuery>,
) -> Result<Response, EdgeError> {
    let lease = s.mgr.agent_lease(&id).await?;
    let lines = crate::watch::watch(lease, &q.path, q.recursive.unwrap_or(true)).await?;
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines.map(Ok::<_, std::convert::Infallible>)),
    )
        .into_response())
}
