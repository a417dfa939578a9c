//! `POST /sandboxes/{id}/timeout`, `/refreshes`, `/pause`, `/resume`, `/connect` (and
//! `/v2/sandboxes/{id}/connect`), `PUT /sandboxes/{id}/network`: the edges' own TTL, pause,
//! resume and network routes.
//!
//! `timeout` sets the idle TTL (`PUT /edge/v1/sandboxes/{id}/ttl`, which also resets the idle
//! clock); `/connect` resumes a paused sandbox under the same id and answers 201 (200 when it
//! was running).

use axum::extract::{Path, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use dsec_wire::api::{SandboxInfo, SandboxState, TtlUpdate};
use serde::Deserialize;
use serde_json::Value;

use super::errors::E2bError;
use super::{created, edge_call, live_sandbox, not_found_as};
use crate::routes::AppState;

fn body_json<T: for<'de> Deserialize<'de> + Default>(
    body: &[u8],
    shape: &str,
) -> Result<T, E2bError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body)
        .map_err(|e| E2bError::bad_request(format!("invalid body ({e}); send {shape}")))
}

fn positive(v: Option<i64>, field: &str) -> Result<Option<u64>, E2bError> {
    match v {
        None => Ok(None),
        Some(t) if t > 0 => Ok(Some(t as u64)),
        Some(t) => Err(E2bError::bad_request(format!(
            "{field} must be a positive number of seconds (got {t})"
        ))),
    }
}

/// Sets the idle TTL of `id` (and resets its idle clock).
pub async fn set_ttl(st: &AppState, id: &str, secs: Option<u64>) -> Result<SandboxInfo, E2bError> {
    let u = TtlUpdate {
        ttl_running_stop: secs,
        ..Default::default()
    };
    let body = serde_json::to_value(&u).unwrap_or_default();
    edge_call(st, Method::PUT, id, "/ttl", Some(&body))
        .await
        .map_err(|e| not_found_as(e, id))
}

#[derive(Debug, Default, Deserialize)]
struct TimeoutBody {
    timeout: Option<i64>,
}

/// `POST /sandboxes/{id}/timeout` `{"timeout": seconds}`: 204.
pub async fn timeout(
    State(st): State<AppState>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<StatusCode, E2bError> {
    let b: TimeoutBody = body_json(&body, "{\"timeout\": seconds}")?;
    let secs = positive(b.timeout, "timeout")?
        .ok_or_else(|| E2bError::bad_request("timeout is required (seconds)"))?;
    live_sandbox(&st, &id).await?;
    set_ttl(&st, &id, Some(secs)).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
struct RefreshBody {
    duration: Option<i64>,
}

/// `POST /sandboxes/{id}/refreshes` `{"duration": seconds}`: resets the idle clock (and sets
/// the TTL to `duration` when given): 204.
pub async fn refresh(
    State(st): State<AppState>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<StatusCode, E2bError> {
    let b: RefreshBody = body_json(&body, "{\"duration\": seconds}")?;
    let secs = positive(b.duration, "duration")?;
    live_sandbox(&st, &id).await?;
    set_ttl(&st, &id, secs).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /sandboxes/{id}/pause`: 204; 409 when it is paused already.
pub async fn pause(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    let info = live_sandbox(&st, &id).await?;
    if info.state == SandboxState::Paused {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is already paused"),
        ));
    }
    let _: SandboxInfo = edge_call(&st, Method::POST, &id, "/pause", None)
        .await
        .map_err(|e| not_found_as(e, &id))?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConnectBody {
    timeout: Option<i64>,
    auto_pause: Option<bool>,
    memory: Option<Value>,
}

/// Resumes `id` if paused and applies `timeout`; 201 if it was resumed, 200 if it ran.
async fn connect_inner(st: &AppState, id: &str, body: &[u8]) -> Result<Response, E2bError> {
    let b: ConnectBody = body_json(body, "{\"timeout\": seconds}")?;
    let secs = positive(b.timeout, "timeout")?;
    let _ = (b.auto_pause, b.memory);
    let info = live_sandbox(st, id).await?;
    let was_paused = info.state == SandboxState::Paused;
    if was_paused {
        let _: SandboxInfo = edge_call(st, Method::POST, id, "/resume", None)
            .await
            .map_err(|e| not_found_as(e, id))?;
    }
    let info = set_ttl(st, id, secs).await?;
    let status = if was_paused {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(created(st, &info))).into_response())
}

/// `POST /sandboxes/{id}/connect`, `POST /v2/sandboxes/{id}/connect`.
pub async fn connect(
    State(st): State<AppState>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, E2bError> {
    connect_inner(&st, &id, &body).await
}

/// `POST /sandboxes/{id}/resume` (E2B's older call): like connect, but a running sandbox is
/// a 409.
pub async fn resume(
    State(st): State<AppState>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, E2bError> {
    let info = live_sandbox(&st, &id).await?;
    if info.state != SandboxState::Paused {
        return Err(E2bError::new(
            StatusCode::CONFLICT,
            format!("sandbox {id} is not paused"),
        ));
    }
    let mut r = connect_inner(&st, &id, &body).await?;
    *r.status_mut() = StatusCode::CREATED;
    Ok(r)
}

/// `PUT /sandboxes/{id}/network` (E2B's `SandboxNetworkUpdateConfig`): the native network
/// update (new connections follow it at once): 204.
pub async fn network(
    State(st): State<AppState>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<StatusCode, E2bError> {
    #[derive(Debug, Default, Deserialize)]
    struct Update {
        #[serde(rename = "allow_internet_access")]
        allow_internet_access: Option<bool>,
        #[serde(flatten)]
        net: super::sandboxes::NetworkConfig,
    }
    let u: Update = body_json(&body, "{\"allowOut\": [...], \"denyOut\": [...]}")?;
    let (spec, _) = super::sandboxes::network_of(u.allow_internet_access, Some(&u.net))?;
    live_sandbox(&st, &id).await?;
    let body = serde_json::to_value(&spec).unwrap_or_default();
    let _: Value = edge_call(&st, Method::PUT, &id, "/network", Some(&body))
        .await
        .map_err(|e| not_found_as(e, &id))?;
    Ok(StatusCode::NO_CONTENT)
}
