//! `POST /v1/sandboxes`: quota admission, placement, forwarding with bounded retries, and
//! cross-replica idempotency.
//!
//! 1. The quota ledger charges the project and its ancestors (or answers with the sandbox an
//!    idempotency key already names, on any replica).
//! 2. The request gets two labels, `dsec.project` and `dsec.reservation`, so the watcher can
//!    reconcile usage with what the edges really run, even if this apiserver dies mid-create.
//! 3. Placement gives an ordered list of nodes; a node refusing at admission (503) or refusing
//!    the connection is skipped for the next one. A timeout is NOT retried elsewhere (the
//!    first node may have created the sandbox): the caller retries with its idempotency key.
//! 4. On success the reservation is bound to the sandbox id; on failure it is released.

use std::time::{Duration, Instant};

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dsec_wire::api::{codes, CreateSandboxRequest};

use crate::db::Principal;
use crate::error::{error_response, ApiError};
use crate::iam::ledger::{Reservation, Reserved};
use crate::placement;
use crate::routes::AppState;

/// Label carrying the project a sandbox is charged to.
pub const LABEL_PROJECT: &str = "dsec.project";
/// Label carrying the principal that created a sandbox (revoking its key with
/// `stop_sandboxes` stops it).
pub const LABEL_PRINCIPAL: &str = "dsec.principal";
/// Label carrying the quota reservation of a sandbox (reconciliation).
pub const LABEL_RESERVATION: &str = "dsec.reservation";

/// How long a retried create waits for an in-flight create with the same idempotency key.
const IN_FLIGHT_WAIT: Duration = Duration::from_secs(10);

/// The two fields of an edge's `SandboxInfo` answer the ledger needs (the answer itself is
/// passed on unchanged; decoding all of it per create is wasted work).
#[derive(serde::Deserialize)]
struct CreatedOn {
    id: String,
    node: String,
}

fn json(status: StatusCode, body: Bytes) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

pub async fn create(
    st: &AppState,
    principal: &Principal,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CreateSandboxRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::BadRequest(format!("invalid create request: {e}")))?;
    if let Some(w) = req.wait_s {
        // Burst queueing (issue 22): wait for capacity instead of a `node_full` refusal.
        let wait = crate::queue::create::check_wait_s(w)?;
        return crate::queue::create::create_queued(
            st,
            principal,
            req,
            wait,
            Extras::default(),
            None,
        )
        .await
        .unwrap_or_else(|| Err(ApiError::Internal("queued create cancelled".into())));
    }
    create_with(st, principal, req, Extras::default()).await
}

/// What a create made by the platform itself (a fork's children) adds to a caller's.
#[derive(Debug, Default, Clone)]
pub struct Extras {
    /// `dsec.` labels of the platform's own (kept, unlike a caller's).
    pub labels: std::collections::BTreeMap<String, String>,
    /// Place only on this node (where the image is).
    pub only_node: Option<String>,
}

/// A create: quota reservation, placement, forward; the answer is the edge's.
pub async fn create_with(
    st: &AppState,
    principal: &Principal,
    mut req: CreateSandboxRequest,
    extras: Extras,
) -> Result<Response, ApiError> {
    // The `dsec.` label prefix is the platform's: a caller's values (e.g. copied from another
    // sandbox's info, as `dsec replay` does) are dropped and replaced below, never trusted.
    req.labels.retain(|k, _| !k.starts_with("dsec."));
    req.labels.extend(extras.labels.clone());
    let cfg = &st.config;
    let project = req
        .project
        .clone()
        .unwrap_or_else(|| principal.project.clone());
    // Volumes resolve in the sandbox's project and pin it to their node (node-local).
    let volume_node = crate::volumes::resolve_mounts(st, principal, &project, &mut req).await?;
    let memory_mb = req.memory_limit_mb.unwrap_or(cfg.default_memory_mb);
    let cpu = req.cpu_cores_limit.unwrap_or(cfg.default_cpu_cores);
    if let Some(msg) = st
        .forwarder
        .watcher()
        .with(|nodes| placement::beyond_largest_node(nodes, &req))
    {
        return Err(ApiError::BadRequest(msg));
    }
    if let Some(msg) = st
        .forwarder
        .watcher()
        .with(|nodes| crate::offered::never_placeable(nodes, &req))
    {
        return Err(ApiError::BadRequest(msg));
    }
    let res_id = hex::encode(rand::random::<[u8; 12]>());
    let reservation = Reservation {
        res_id: res_id.clone(),
        project: project.clone(),
        home: (principal.kind != "admin").then(|| principal.project.clone()),
        cpu_cores: cpu,
        memory_mb,
        idempotency_key: req.idempotency_key.clone(),
    };
    let waited = Instant::now();
    loop {
        match st.ledger.reserve(reservation.clone()).await {
            Ok(Reserved::New) => break,
            Ok(Reserved::Existing { sandbox_id }) => return existing(st, &sandbox_id).await,
            Ok(Reserved::InFlight) => {
                if waited.elapsed() > IN_FLIGHT_WAIT {
                    return Err(ApiError::Conflict(format!(
                        "a create with idempotency_key {:?} is still in progress; retry to get its sandbox",
                        req.idempotency_key.as_deref().unwrap_or("")
                    )));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                if matches!(e, crate::iam::IamError::QuotaExceeded(_)) {
                    st.metrics.quota_refusals.inc();
                }
                return Err(e.into());
            }
        }
    }
    req.labels.insert(LABEL_PROJECT.into(), project);
    req.labels
        .insert(LABEL_PRINCIPAL.into(), principal.id.clone());
    req.labels.insert(LABEL_RESERVATION.into(), res_id.clone());
    let body = match serde_json::to_vec(&req) {
        Ok(b) => Bytes::from(b),
        Err(e) => {
            st.ledger.release_reservation(&res_id);
            return Err(ApiError::Internal(format!("encode create request: {e}")));
        }
    };
    let mut plan = st
        .forwarder
        .watcher()
        .with(|nodes| placement::plan(nodes, &req, &cfg.placement, &mut rand::thread_rng()));
    if let Some(only) = &extras.only_node {
        let w = st.forwarder.watcher();
        plan.nodes
            .retain(|i| w.endpoint_at(*i).and_then(|(_, n)| n).as_deref() == Some(only));
    }
    if let Some(only) = &volume_node {
        let w = st.forwarder.watcher();
        plan.nodes
            .retain(|i| w.endpoint_at(*i).and_then(|(_, n)| n).as_deref() == Some(only));
        if plan.nodes.is_empty() {
            st.ledger.release_reservation(&res_id);
            st.metrics.placement_refusals.inc();
            return Ok(error_response(
                codes::NODE_FULL,
                format!(
                    "the sandbox mounts volumes kept on node {only}, which is unhealthy or has no room for it; retry later or see GET /v1/nodes"
                ),
            ));
        }
    }
    if plan.nodes.is_empty() {
        st.ledger.release_reservation(&res_id);
        st.metrics.placement_refusals.inc();
        let why = st
            .forwarder
            .watcher()
            .with(|nodes| crate::queue::room::why_no_room(nodes, &req));
        return Ok(error_response(
            codes::NODE_FULL,
            format!(
                "no healthy node has room for this sandbox (primary pool {:.0}% used; {why}); retry later, send wait_s to wait for capacity, or see GET /v1/nodes",
                plan.primary_utilisation * 100.0
            ),
        ));
    }
    let mut last: Option<Response> = None;
    let mut tried = Vec::new();
    for idx in plan.nodes {
        let Some((edge, node)) = st.forwarder.watcher().endpoint_at(idx) else {
            continue;
        };
        let name = node.clone().unwrap_or_else(|| edge.url.clone());
        tried.push(name.clone());
        let url = format!("{}/edge/v1/sandboxes", edge.url);
        let sent = st
            .forwarder
            .http()
            .post(&url)
            .bearer_auth(&edge.token)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.clone())
            .timeout(Duration::from_secs(120))
            .send()
            .await;
        let resp = match sent {
            Ok(r) => r,
            Err(e) if e.is_connect() => {
                st.forwarder
                    .watcher()
                    .mark_unreachable(&edge.url, &e.to_string());
                last = Some(error_response(
                    codes::NODE_UNAVAILABLE,
                    format!("node {name} is unreachable: {e}"),
                ));
                continue;
            }
            Err(e) => {
                // The node may have created it: do not create a second one elsewhere. The
                // reservation stays until reconciliation binds or releases it.
                return Err(ApiError::NodeUnavailable(format!(
                    "node {name} did not answer the create ({e}); retry with the same idempotency_key to get the sandbox if it was made"
                )));
            }
        };
        let status =
            StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        let bytes = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => {
                return Err(ApiError::NodeUnavailable(format!(
                    "node {name}: reading the create answer failed ({e}); retry with the same idempotency_key"
                )))
            }
        };
        if status.is_success() {
            match serde_json::from_slice::<CreatedOn>(&bytes) {
                Ok(info) => {
                    st.ledger.bind(&res_id, &info.id, &info.node);
                    st.forwarder.watcher().note_placed(idx, memory_mb, cpu);
                    st.metrics.sandboxes_created.inc();
                    if plan.overflow {
                        st.metrics.overflow_placements.inc();
                    }
                }
                Err(e) => tracing::error!(node = %name, error = %e, "decode create answer"),
            }
            let mut r = json(status, bytes);
            if let Ok(v) = name.parse() {
                r.headers_mut().insert("x-dsec-node", v);
            }
            if plan.overflow {
                r.headers_mut().insert(
                    "x-dsec-pool",
                    axum::http::HeaderValue::from_static("overflow"),
                );
            }
            return Ok(r);
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            st.metrics.edge_refusals.inc();
            last = Some(json(status, bytes));
            continue;
        }
        // A user error (bad image, bad limits, ...): the same everywhere.
        st.ledger.release_reservation(&res_id);
        return Ok(json(status, bytes));
    }
    st.ledger.release_reservation(&res_id);
    st.metrics.placement_refusals.inc();
    Ok(last.unwrap_or_else(|| {
        error_response(
            codes::NODE_FULL,
            format!(
                "every node tried refused the sandbox ({})",
                tried.join(", ")
            ),
        )
    }))
}

/// The sandbox an idempotency key already names, as its edge reports it now.
async fn existing(st: &AppState, id: &str) -> Result<Response, ApiError> {
    let edge = st.forwarder.edge_for_sandbox(id)?;
    let resp = st
        .forwarder
        .http()
        .get(format!("{}/edge/v1/sandboxes/{id}", edge.url))
        .bearer_auth(&edge.token)
        .send()
        .await
        .map_err(|e| {
            ApiError::NodeUnavailable(format!("node of sandbox {id} is unreachable: {e}"))
        })?;
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let bytes = resp
        .bytes()
        .await
        .map_err(|e| ApiError::NodeUnavailable(format!("read sandbox {id}: {e}")))?;
    let mut r = json(status, bytes);
    r.headers_mut().insert(
        "x-dsec-idempotent-replay",
        axum::http::HeaderValue::from_static("true"),
    );
    Ok(r)
}
