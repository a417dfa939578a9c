//! `/edge/v1/sandboxes/{id}/processes...`: process handles (start, list, get, output, wait,
//! stdin, signal, kill).

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use dsec_wire::api::{
    ProcessInfo, ProcessInputRequest, ProcessList, SignalProcessRequest, StartProcessRequest,
};
use futures::StreamExt as _;
use serde::Deserialize;

use super::{ApiJson, ApiPath, ApiQuery, AppState};
use crate::error::EdgeError;
use crate::processes;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    all: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutputQuery {
    #[serde(default)]
    offset: u64,
    #[serde(default)]
    follow: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitQuery {
    /// Seconds (default 60).
    timeout: Option<f64>,
}

pub async fn start(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<StartProcessRequest>,
) -> Result<(StatusCode, Json<ProcessInfo>), EdgeError> {
    let lease = s.mgr.agent_lease(&id).await?;
    Ok((
        StatusCode::CREATED,
        Json(processes::start(&lease, req).await?),
    ))
}

pub async fn list(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<ProcessList>, EdgeError> {
    let lease = s.mgr.agent_lease(&id).await?;
    Ok(Json(processes::list(&lease, q.all).await?))
}

pub async fn get(
    State(s): State<AppState>,
    ApiPath((id, pid)): ApiPath<(String, String)>,
) -> Result<Json<ProcessInfo>, EdgeError> {
    let lease = s.mgr.agent_lease(&id).await?;
    let pid = processes::resolve(&lease, &pid).await?;
    Ok(Json(processes::wait(&lease, pid, 0.0).await?))
}

pub async fn wait(
    State(s): State<AppState>,
    ApiPath((id, pid)): ApiPath<(String, String)>,
    ApiQuery(q): ApiQuery<WaitQuery>,
) -> Result<Json<ProcessInfo>, EdgeError> {
    let lease = s.mgr.agent_lease(&id).await?;
    let pid = processes::resolve(&lease, &pid).await?;
    Ok(Json(
        processes::wait(&lease, pid, q.timeout.unwrap_or(60.0)).await?,
    ))
}

pub async fn output(
    State(s): State<AppState>,
    ApiPath((id, pid)): ApiPath<(String, String)>,
    ApiQuery(q): ApiQuery<OutputQuery>,
) -> Result<Response, EdgeError> {
    let lease = s.mgr.agent_lease(&id).await?;
    let pid = processes::resolve(&lease, &pid).await?;
    let lines = processes::output(lease, pid, q.offset, q.follow).await?;
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines.map(Ok::<_, Infallible>)),
    )
        .into_response())
}

pub async fn stdin(
    State(s): State<AppState>,
    ApiPath((id, pid)): ApiPath<(String, String)>,
    ApiJson(req): ApiJson<ProcessInputRequest>,
) -> Result<Json<ProcessInfo>, EdgeError> {
    let lease = s.mgr.agent_lease(&id).await?;
    let pid = processes::resolve(&lease, &pid).await?;
    Ok(Json(processes::input(&lease, pid, req).await?))
}

pub async fn signal(
    State(s): State<AppState>,
    ApiPath((id, pid)): ApiPath<(String, String)>,
    ApiJson(req): ApiJson<SignalProcessRequest>,
) -> Result<Json<ProcessInfo>, EdgeError> {
    let lease = s.mgr.agent_lease(&id).await?;
    let pid = processes::resolve(&lease, &pid).await?;
    Ok(Json(processes::signal(&lease, pid, req).await?))
}

/// SIGKILL to the whole process group (and session).
pub async fn kill(
    State(s): State<AppState>,
    ApiPath((id, pid)): ApiPath<(String, String)>,
) -> Result<Json<ProcessInfo>, EdgeError> {
    let lease = s.mgr.agent_lease(&id).await?;
    let pid = processes::resolve(&lease, &pid).await?;
    let req = SignalProcessRequest {
        signal: "SIGKILL".into(),
        group: true,
    };
    Ok(Json(processes::signal(&lease, pid, req).await?))
}
