//! `/edge/v1/sandboxes`: create, list, get, stop, shell, exec, sessions.

use std::convert::Infallible;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use dsec_wire::api::{
    CreateSandboxRequest, EndReason, ExecRequest, ListSandboxesQuery, RunShellRequest, SandboxInfo,
    SandboxList,
};
use futures::StreamExt as _;

use super::{ApiJson, ApiPath, ApiQuery, AppState};
use crate::commands::CommandReply;
use crate::error::EdgeError;

pub async fn create(
    State(s): State<AppState>,
    ApiJson(req): ApiJson<CreateSandboxRequest>,
) -> Result<(StatusCode, Json<SandboxInfo>), EdgeError> {
    Ok((StatusCode::CREATED, Json(s.mgr.create(req).await?)))
}

pub async fn list(
    State(s): State<AppState>,
    ApiQuery(q): ApiQuery<ListSandboxesQuery>,
) -> Json<SandboxList> {
    Json(s.mgr.list(&q))
}

/// Query of the edge's `DELETE /edge/v1/sandboxes/{id}`: the apiserver names why it stops a
/// sandbox (e.g. `quota_revoked`); without one it is `stopped_by_user`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StopQuery {
    #[serde(default)]
    pub end_reason: Option<EndReason>,
}

pub async fn get(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<SandboxInfo>, EdgeError> {
    Ok(Json(s.mgr.get(&id)?))
}

pub async fn stop(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<StopQuery>,
) -> Result<Json<SandboxInfo>, EdgeError> {
    Ok(Json(s.mgr.stop(&id, q.end_reason).await?))
}

pub async fn shell(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<RunShellRequest>,
) -> Result<Response, EdgeError> {
    Ok(command_response(s.mgr.shell(&id, req).await?))
}

pub async fn exec(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(req): ApiJson<ExecRequest>,
) -> Result<Response, EdgeError> {
    Ok(command_response(s.mgr.exec(&id, req).await?))
}

pub async fn close_session(
    State(s): State<AppState>,
    ApiPath((id, name)): ApiPath<(String, String)>,
) -> Result<StatusCode, EdgeError> {
    s.mgr.close_session(&id, &name).await?;
    Ok(StatusCode::NO_CONTENT)
}

fn command_response(reply: CommandReply) -> Response {
    match reply {
        CommandReply::Done(result) => Json(result).into_response(),
        CommandReply::Replayed(result) => super::files::replayed_flag(Json(result), true),
        CommandReply::Stream(lines) => (
            [(header::CONTENT_TYPE, "application/x-ndjson")],
            Body::from_stream(lines.map(Ok::<_, Infallible>)),
        )
            .into_response(),
    }
}
