//! The membership routes: `POST /v1/nodes/join` and `POST /v1/nodes/{id}/heartbeat`
//! (authorized by a cluster join token), `GET /v1/nodes`, and the admin routes
//! `POST /v1/nodes/{id}/cordon|uncordon|drain` and `POST /v1/nodes/tokens`.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use dsec_wire::api::{
    DrainRequest, JoinAnswer, JoinRequest, JoinToken, NodeList, NodeState, NodeStatus,
};

use super::registry::{self, AdminState};
use crate::auth::bearer;
use crate::db::Principal;
use crate::error::ApiError;
use crate::iam::ledger::now_ms;
use crate::routes::AppState;

fn require_admin(p: &Principal) -> Result<(), ApiError> {
    if p.kind == "admin" {
        Ok(())
    } else {
        Err(ApiError::Forbidden(format!(
            "principal {:?} is not an admin; ask an admin to manage nodes",
            p.name
        )))
    }
}

fn node_path(p: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    let id = p
        .map(|Path(id)| id)
        .map_err(|e| ApiError::BadRequest(e.body_text()))?;
    if !crate::config::valid_node_id(&id) {
        return Err(ApiError::BadRequest(format!(
            "node id {id:?} must match [a-z0-9]{{1,16}}"
        )));
    }
    Ok(id)
}

/// 401 unless the request carries a cluster join token (the configured `join_token` or one
/// issued by `POST /v1/nodes/tokens`).
async fn require_join_token(st: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let refused = || {
        ApiError::TokenRefused(
            "missing or unknown cluster join token: pass the apiserver's join_token or one from \
             `dsec node token create` (dsec edge --join URL --token TOKEN)"
                .into(),
        )
    };
    let token = bearer(
        headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok()),
    )
    .ok_or_else(refused)?;
    if st.config.join_token.as_deref() == Some(token) {
        return Ok(());
    }
    if token.len() <= 128 && registry::token_known(&st.db, token).await? {
        return Ok(());
    }
    Err(refused())
}

fn answer(st: &AppState, node_id: &str) -> JoinAnswer {
    JoinAnswer {
        node_id: node_id.to_string(),
        state: st
            .membership
            .state(node_id)
            .map_or(NodeState::Suspect, |s| s.0),
        heartbeat_period_ms: st.config.heartbeat_period_ms,
    }
}

/// `POST /v1/nodes/join`.
pub async fn join(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    require_join_token(&st, &headers).await?;
    let req: JoinRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::BadRequest(format!("invalid join request: {e}")))?;
    if !crate::config::valid_node_id(&req.node_id) {
        return Err(ApiError::BadRequest(format!(
            "node_id {:?} must match [a-z0-9]{{1,16}}",
            req.node_id
        )));
    }
    if !(req.url.starts_with("http://") || req.url.starts_with("https://"))
        || reqwest::Url::parse(&req.url).is_err()
    {
        return Err(ApiError::BadRequest(format!(
            "url {:?} must be the edge's base URL, http://host:port",
            req.url
        )));
    }
    if let Some(e) = st
        .config
        .edges
        .iter()
        .find(|e| e.node_id.as_deref() == Some(req.node_id.as_str()))
    {
        return Err(ApiError::Conflict(format!(
            "node id {} is in this apiserver's static edge list (at {}); join with another --node-id",
            req.node_id, e.url
        )));
    }
    // A static edge that reported this id (its configured list has no id for it): taking it
    // over would re-point that node's sandboxes at the joining edge.
    if let Some((e, _, _)) = st.forwarder.watcher().endpoint_for(&req.node_id) {
        let joined = st.membership.member(&req.node_id).is_some_and(|m| m.joined);
        if !joined && e.url != req.url {
            return Err(ApiError::Conflict(format!(
                "node id {} is a static edge of this apiserver (at {}); join with another --node-id",
                req.node_id, e.url
            )));
        }
    }
    let node_id = req.node_id.clone();
    let endpoint = crate::config::EdgeEndpoint {
        node_id: Some(req.node_id.clone()),
        url: req.url.clone(),
        token: req.token.clone(),
    };
    registry::join(&st.db, req, now_ms()).await?;
    // Poll it at once, so it takes placements as soon as the join is answered.
    let index = st.forwarder.watcher().upsert_endpoint(endpoint);
    st.forwarder
        .watcher()
        .poll_index(st.forwarder.http(), index)
        .await;
    st.membership.refresh().await;
    tracing::info!(node = %node_id, "edge joined the cluster");
    Ok((StatusCode::OK, Json(answer(&st, &node_id))).into_response())
}

/// `POST /v1/nodes/{id}/heartbeat`.
pub async fn heartbeat(
    State(st): State<AppState>,
    headers: HeaderMap,
    id: Result<Path<String>, PathRejection>,
) -> Result<Json<JoinAnswer>, ApiError> {
    require_join_token(&st, &headers).await?;
    let id = node_path(id)?;
    if !registry::heartbeat(&st.db, id.clone(), now_ms()).await? {
        return Err(ApiError::NotFound(format!(
            "node {id} has not joined (or was removed): join again with POST /v1/nodes/join"
        )));
    }
    Ok(Json(answer(&st, &id)))
}

/// `GET /v1/nodes`: every node's last status with its membership state.
pub async fn list(State(st): State<AppState>) -> Json<NodeList> {
    let nodes = st
        .forwarder
        .watcher()
        .snapshot()
        .into_iter()
        .map(|v| {
            let mut s = v.status.unwrap_or_else(|| NodeStatus {
                node: v.node_id.clone().unwrap_or_default(),
                url: v.endpoint.url.clone(),
                ..Default::default()
            });
            s.healthy = v.healthy;
            let mut m = st.membership.describe(v.node_id.as_deref(), v.last_seen);
            if let (Some(member), true) = (
                v.node_id.as_deref().and_then(|n| st.membership.member(n)),
                s.labels.is_empty(),
            ) {
                s.labels = member.labels;
            }
            if m.state == NodeState::Suspect && m.detail.is_none() {
                m.detail = v.last_error.clone();
            }
            s.membership = Some(m);
            s
        })
        .collect();
    Json(NodeList { nodes })
}

async fn admin_set(
    st: AppState,
    p: Principal,
    id: Result<Path<String>, PathRejection>,
    state: AdminState,
) -> Result<Response, ApiError> {
    require_admin(&p)?;
    let id = node_path(id)?;
    Ok(Json(super::drain::set(&st.membership, &id, state).await?).into_response())
}

/// `POST /v1/nodes/{id}/cordon`.
pub async fn cordon(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    admin_set(st, p, id, AdminState::Cordoned).await
}

/// `POST /v1/nodes/{id}/uncordon`.
pub async fn uncordon(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, ApiError> {
    admin_set(st, p, id, AdminState::Active).await
}

/// `POST /v1/nodes/{id}/drain`.
pub async fn drain(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    id: Result<Path<String>, PathRejection>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    require_admin(&p)?;
    let id = node_path(id)?;
    let req: DrainRequest = if body.iter().all(u8::is_ascii_whitespace) {
        DrainRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| ApiError::BadRequest(format!("invalid drain request: {e}")))?
    };
    Ok(Json(super::drain::drain(&st.membership, &id, req.policy).await?).into_response())
}

/// `POST /v1/nodes/tokens`: a new cluster join token (shown once).
pub async fn create_token(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
) -> Result<Response, ApiError> {
    require_admin(&p)?;
    let token = registry::create_token(&st.db).await?;
    Ok((StatusCode::CREATED, Json(JoinToken { token })).into_response())
}
