//! `POST /v1/sandboxes/{id}/fork`: one snapshot of the parent, then `n` creates from it.
//!
//! The snapshot is taken once on the parent's edge (see `dsec_edge::snapshot`). Every child is
//! a create through [`crate::create::create_with`] — the caller's quota, the same placement and
//! admission as any create — with the parent's shape (substrate, limits, TTLs, network groups,
//! user, QoS, labels plus the request's), the snapshot as its image and the platform labels
//! `dsec.fork_of` (the parent) and `dsec.fork_step` (its last completed step at the snapshot),
//! which the child's trajectory records in its first (`create`) record. Each child has its own
//! id, writable layer, network and trajectory. When the edges share a blob store (`posix:`,
//! `s3:`), the parent's edge publishes the snapshot there (`shared` in its answer) and any edge
//! registers it at the first create naming it, so children are placed across the nodes like
//! any create (power-of-k, quotas, overflow); otherwise the snapshot is only in the parent
//! node's image store and the children are placed there.
//!
//! A child that fails leaves nothing behind (the edge's create rolls back); the answer lists
//! the children that exist and the failures by index: 201 when all were made, 207 otherwise.

use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use dsec_wire::api::{
    CreateSandboxRequest, ErrorBody, ErrorDetail, ForkFailure, ForkRequest, ForkResult,
    SandboxInfo, SnapshotInfo, SnapshotRequest, MAX_FORK,
};
use futures::StreamExt as _;

use crate::create::{Extras, LABEL_PROJECT};
use crate::db::Principal;
use crate::error::ApiError;
use crate::routes::AppState;

/// Label naming the sandbox a child was forked from.
pub const LABEL_FORK_OF: &str = "dsec.fork_of";
/// Label naming the parent's last completed trajectory step at the snapshot (empty: none).
pub const LABEL_FORK_STEP: &str = "dsec.fork_step";
/// Creates of one fork in flight at once.
const PARALLEL: usize = 16;

/// Validates a fork request.
pub fn parse(body: &[u8]) -> Result<ForkRequest, ApiError> {
    let req: ForkRequest = serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("invalid fork request: {e}")))?;
    if req.n == 0 || req.n > MAX_FORK {
        return Err(ApiError::BadRequest(format!(
            "n must be 1..={MAX_FORK} (got {})",
            req.n
        )));
    }
    if let Some(k) = req.labels.keys().find(|k| k.starts_with("dsec.")) {
        return Err(ApiError::BadRequest(format!(
            "label {k:?}: the dsec. prefix is the platform's; choose another key"
        )));
    }
    Ok(req)
}

/// The create request of one child of `parent`, started from `snapshot`.
pub fn child_request(
    parent: &SandboxInfo,
    snapshot: &str,
    labels: &std::collections::BTreeMap<String, String>,
) -> CreateSandboxRequest {
    let mut l: std::collections::BTreeMap<String, String> = parent
        .labels
        .iter()
        .filter(|(k, _)| !k.starts_with("dsec."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    l.extend(labels.clone());
    CreateSandboxRequest {
        image: snapshot.to_string(),
        substrate: parent.substrate,
        memory_limit_mb: Some(parent.memory_limit_mb),
        cpu_cores_limit: Some(parent.cpu_cores_limit),
        pids_limit: Some(parent.pids_limit),
        ttl_running_stop: parent.ttl_running_stop,
        ttl_total: parent.ttl_total,
        ttl_action: Some(parent.ttl_action),
        network_rules: parent.network_rules.clone(),
        init_user: Some(parent.init_user.clone()).filter(|u| !u.is_empty()),
        labels: l,
        project: parent.labels.get(LABEL_PROJECT).cloned(),
        qos: Some(parent.qos),
        ..Default::default()
    }
}

async fn body_of(resp: Response) -> (StatusCode, bytes::Bytes) {
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 16 << 20)
        .await
        .unwrap_or_default();
    (status, bytes)
}

fn detail_of(status: StatusCode, bytes: &[u8]) -> ErrorDetail {
    serde_json::from_slice::<ErrorBody>(bytes)
        .map(|b| b.error)
        .unwrap_or_else(|_| ErrorDetail {
            code: dsec_wire::api::codes::INTERNAL.into(),
            message: format!(
                "HTTP {status}: {}",
                String::from_utf8_lossy(&bytes[..bytes.len().min(500)])
            ),
        })
}

/// Calls the parent's edge; a non-2xx answer is passed on as it came.
async fn edge_call<T: serde::de::DeserializeOwned>(
    req: reqwest::RequestBuilder,
    what: &str,
) -> Result<Result<T, Response>, ApiError> {
    let r = req
        .send()
        .await
        .map_err(|e| ApiError::NodeUnavailable(format!("{what}: {e}")))?;
    let status = StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let bytes = r
        .bytes()
        .await
        .map_err(|e| ApiError::NodeUnavailable(format!("{what}: {e}")))?;
    if !status.is_success() {
        let mut resp = (status, bytes).into_response();
        resp.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        );
        return Ok(Err(resp));
    }
    serde_json::from_slice(&bytes)
        .map(Ok)
        .map_err(|e| ApiError::Internal(format!("{what}: decode the edge's answer: {e}")))
}

pub async fn fork(
    State(st): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<String>,
    body: bytes::Bytes,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let req = parse(&body)?;
    let edge = st.forwarder.edge_for_sandbox(&id)?;
    let http = st.forwarder.http();
    let parent: SandboxInfo = match edge_call(
        http.get(format!("{}/edge/v1/sandboxes/{id}", edge.url))
            .bearer_auth(&edge.token),
        "read the parent sandbox",
    )
    .await?
    {
        Ok(p) => p,
        Err(resp) => return Ok(resp),
    };
    let snap_req = SnapshotRequest {
        name: req.snapshot_name.clone(),
        memory: false,
    };
    let snapshot: SnapshotInfo = match edge_call(
        http.post(format!("{}/edge/v1/sandboxes/{id}/snapshot", edge.url))
            .bearer_auth(&edge.token)
            .json(&snap_req),
        "snapshot the parent sandbox",
    )
    .await?
    {
        Ok(s) => s,
        Err(resp) => return Ok(resp),
    };
    let extras = Extras {
        labels: [
            (LABEL_FORK_OF.to_string(), id.clone()),
            (
                LABEL_FORK_STEP.to_string(),
                snapshot.step.map(|s| s.to_string()).unwrap_or_default(),
            ),
        ]
        .into(),
        only_node: (!snapshot.shared).then(|| parent.node.clone()),
    };
    let child = child_request(&parent, &snapshot.id, &req.labels);
    let results: Vec<(u32, Result<SandboxInfo, ErrorDetail>)> = futures::stream::iter(0..req.n)
        .map(|i| {
            let (st, principal, child, extras) = (&st, &principal, child.clone(), extras.clone());
            async move {
                let r = match crate::create::create_with(st, principal, child, extras).await {
                    Ok(resp) => {
                        let (status, bytes) = body_of(resp).await;
                        if status.is_success() {
                            serde_json::from_slice::<SandboxInfo>(&bytes).map_err(|e| ErrorDetail {
                                code: dsec_wire::api::codes::INTERNAL.into(),
                                message: format!("decode the child's info: {e}"),
                            })
                        } else {
                            Err(detail_of(status, &bytes))
                        }
                    }
                    Err(e) => Err(e.body().error),
                };
                (i, r)
            }
        })
        .buffered(PARALLEL)
        .collect()
        .await;
    let mut out = ForkResult {
        snapshot,
        children: Vec::new(),
        failed: Vec::new(),
        duration_ms: 0.0,
    };
    for (index, r) in results {
        match r {
            Ok(info) => out.children.push(info),
            Err(error) => out.failed.push(ForkFailure { index, error }),
        }
    }
    out.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
    tracing::info!(parent = %id, children = out.children.len(), failed = out.failed.len(), ms = out.duration_ms, "fork");
    let status = if out.failed.is_empty() {
        StatusCode::CREATED
    } else {
        StatusCode::MULTI_STATUS
    };
    Ok((status, axum::Json(out)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_checks_n_and_labels() {
        assert!(parse(br#"{"n": 4}"#).is_ok());
        assert!(parse(br#"{"n": 0}"#).is_err());
        assert!(parse(br#"{"n": 101}"#).is_err());
        assert!(parse(br#"{"n": 2, "labels": {"dsec.fork_of": "x"}}"#).is_err());
        assert!(parse(br#"{"n": 2, "bogus": 1}"#).is_err());
    }

    #[test]
    fn children_keep_the_parents_shape() {
        let parent = SandboxInfo {
            id: "sb-n0-0000000000000001".into(),
            memory_limit_mb: 256,
            cpu_cores_limit: 0.5,
            init_user: "root".into(),
            labels: [
                ("job".to_string(), "j".to_string()),
                (LABEL_PROJECT.to_string(), "p".to_string()),
                ("dsec.reservation".to_string(), "r".to_string()),
            ]
            .into(),
            ..Default::default()
        };
        let c = child_request(
            &parent,
            "snapshot/x",
            &[("k".to_string(), "v".to_string())].into(),
        );
        assert_eq!(c.image, "snapshot/x");
        assert_eq!(c.memory_limit_mb, Some(256));
        assert_eq!(c.project.as_deref(), Some("p"));
        assert_eq!(c.labels.len(), 2, "{:?}", c.labels);
        assert_eq!(c.labels.get("job").map(String::as_str), Some("j"));
    }
}
