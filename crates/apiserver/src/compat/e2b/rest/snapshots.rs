//! `POST /sandboxes/{id}/snapshots`, `GET /snapshots`, `POST /sandboxes/{id}/fork` and
//! `DELETE /templates/{snapshot}`: dsec's snapshot (an image of the sandbox's layers plus its
//! writable layer, named `snapshot/...`) and fork (one snapshot, then native creates).

use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use dsec_wire::api::{ForkResult, ImageList, SnapshotInfo, MAX_FORK};
use serde::Deserialize;
use serde_json::{json, Value};

use super::errors::E2bError;
use super::{created, edge_call, live_sandbox, not_found_as};
use crate::db::Principal;
use crate::routes::AppState;

/// Image names of snapshots start with this.
pub const SNAPSHOT_PREFIX: &str = "snapshot/";

fn snapshot_json(name: &str) -> Value {
    json!({"snapshotID": name, "names": [name]})
}

#[derive(Debug, Default, Deserialize)]
struct SnapshotBody {
    name: Option<String>,
    memory: Option<Value>,
}

/// `POST /sandboxes/{id}/snapshots` `{"name"?}`: 201 `{"snapshotID", "names"}`.
pub async fn create(
    State(st): State<AppState>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, E2bError> {
    let b: SnapshotBody = if body.iter().all(u8::is_ascii_whitespace) {
        SnapshotBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            E2bError::bad_request(format!("invalid body ({e}); send {{\"name\": \"...\"}}"))
        })?
    };
    if b.memory.as_ref().is_some_and(|m| m.as_bool() == Some(true)) {
        return Err(E2bError::unsupported("a memory snapshot (memory: true)"));
    }
    live_sandbox(&st, &id).await?;
    let name = b
        .name
        .filter(|n| !n.is_empty())
        .map(|n| format!("{SNAPSHOT_PREFIX}{}", n.trim_start_matches(SNAPSHOT_PREFIX)));
    let req = json!({ "name": name });
    let snap: SnapshotInfo = edge_call(&st, Method::POST, &id, "/snapshot", Some(&req))
        .await
        .map_err(|e| not_found_as(e, &id))?;
    Ok((StatusCode::CREATED, Json(snapshot_json(&snap.id))).into_response())
}

/// `GET /snapshots?sandboxID=&name=&limit=`: the `snapshot/` images of the image edge.
pub async fn list(
    State(st): State<AppState>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, E2bError> {
    let images = image_list(&st).await?;
    let sandbox = q.get("sandboxID").filter(|s| !s.is_empty());
    let name = q.get("name").filter(|s| !s.is_empty());
    let out: Vec<Value> = images
        .images
        .iter()
        .filter(|i| i.name.starts_with(SNAPSHOT_PREFIX))
        .filter(|i| sandbox.is_none_or(|s| i.name.contains(s.as_str())))
        .filter(|i| {
            name.is_none_or(|n| {
                i.name.trim_start_matches(SNAPSHOT_PREFIX) == n.as_str() || i.name == *n
            })
        })
        .map(|i| snapshot_json(&i.name))
        .collect();
    Ok(Json(out).into_response())
}

/// The image list of the image edge (images live on the first edge, as for `/v1/images`).
pub async fn image_list(st: &AppState) -> Result<ImageList, E2bError> {
    let edge =
        st.forwarder.watcher().first_endpoint().ok_or_else(|| {
            E2bError::new(StatusCode::SERVICE_UNAVAILABLE, "no edge is configured")
        })?;
    let resp = st
        .forwarder
        .http()
        .get(format!("{}/edge/v1/images", edge.url))
        .bearer_auth(&edge.token)
        .send()
        .await
        .map_err(|e| E2bError::new(StatusCode::SERVICE_UNAVAILABLE, format!("list images: {e}")))?;
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let bytes = resp
        .bytes()
        .await
        .map_err(|e| E2bError::new(StatusCode::SERVICE_UNAVAILABLE, format!("list images: {e}")))?;
    if !status.is_success() {
        return Err(E2bError::from_dsec(status, &bytes));
    }
    serde_json::from_slice(&bytes)
        .map_err(|e| E2bError::new(StatusCode::BAD_GATEWAY, format!("decode images: {e}")))
}

/// `DELETE /templates/{id}`: removes a snapshot (other images are the operator's: 403).
pub async fn delete(
    State(st): State<AppState>,
    Path(name): Path<String>,
) -> Result<StatusCode, E2bError> {
    if !name.starts_with(SNAPSHOT_PREFIX) {
        return Err(E2bError::new(
            StatusCode::FORBIDDEN,
            format!("{name:?} is a dsec image, not a snapshot: remove it with `dsec image rm`"),
        ));
    }
    let edge =
        st.forwarder.watcher().first_endpoint().ok_or_else(|| {
            E2bError::new(StatusCode::SERVICE_UNAVAILABLE, "no edge is configured")
        })?;
    let resp = st
        .forwarder
        .http()
        .delete(format!("{}/edge/v1/images/{name}", edge.url))
        .bearer_auth(&edge.token)
        .send()
        .await
        .map_err(|e| {
            E2bError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("remove {name}: {e}"),
            )
        })?;
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    if status.is_success() {
        return Ok(StatusCode::NO_CONTENT);
    }
    let bytes = resp.bytes().await.unwrap_or_default();
    Err(E2bError::from_dsec(status, &bytes))
}

#[derive(Debug, Default, Deserialize)]
struct ForkBody {
    timeout: Option<i64>,
    count: Option<i64>,
}

/// `POST /sandboxes/{id}/fork` `{"count", "timeout"}`: the native fork (one snapshot, `count`
/// creates); 201 with one `{"sandbox"}` or `{"error"}` per child.
pub async fn fork(
    State(st): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, E2bError> {
    let b: ForkBody = if body.iter().all(u8::is_ascii_whitespace) {
        ForkBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            E2bError::bad_request(format!(
                "invalid body ({e}); send {{\"count\": n, \"timeout\": seconds}}"
            ))
        })?
    };
    let count = b.count.unwrap_or(1);
    if !(1..=i64::from(MAX_FORK)).contains(&count) {
        return Err(E2bError::bad_request(format!(
            "count must be 1..={MAX_FORK} (got {count})"
        )));
    }
    let timeout = match b.timeout {
        None => None,
        Some(t) if t > 0 => Some(t as u64),
        Some(t) => {
            return Err(E2bError::bad_request(format!(
                "timeout must be a positive number of seconds (got {t})"
            )))
        }
    };
    live_sandbox(&st, &id).await?;
    let native = bytes::Bytes::from(json!({ "n": count }).to_string());
    let resp = crate::fork::fork(
        State(st.clone()),
        Extension(principal),
        Path(id.clone()),
        native,
    )
    .await
    .map_err(E2bError::from)?;
    let (status, bytes) = super::sandboxes::body_of(resp).await;
    if !status.is_success() {
        return Err(not_found_as(E2bError::from_dsec(status, &bytes), &id));
    }
    let result: ForkResult = serde_json::from_slice(&bytes)
        .map_err(|e| E2bError::new(StatusCode::BAD_GATEWAY, format!("decode the fork: {e}")))?;
    let mut out = Vec::new();
    for child in &result.children {
        let info = match timeout {
            Some(t) => super::lifecycle::set_ttl(&st, &child.id, Some(t))
                .await
                .unwrap_or_else(|_| child.clone()),
            None => child.clone(),
        };
        out.push(json!({ "sandbox": created(&st, &info) }));
    }
    for f in &result.failed {
        let status = dsec_wire::api::status_for_code(&f.error.code);
        out.push(json!({ "error": { "code": status, "message": f.error.message } }));
    }
    Ok((StatusCode::CREATED, Json(out)).into_response())
}
