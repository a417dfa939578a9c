//! Admin routes: projects, quotas, keys; and `GET /v1/cluster` (the live view `dsec top` shows).

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};

use super::{admin, CreateKeyRequest, CreateProjectRequest, Quota};
use crate::db::Principal;
use crate::error::ApiError;
use crate::routes::AppState;

fn require_admin(p: &Principal) -> Result<(), ApiError> {
    if p.kind == "admin" {
        Ok(())
    } else {
        Err(ApiError::Forbidden(format!(
            "principal {:?} is not an admin; ask an admin to do this",
            p.name
        )))
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest(format!("invalid {what}: {e}")))
}

pub async fn list_projects(State(st): State<AppState>) -> Result<Response, ApiError> {
    Ok(Json(admin::list_projects(&st.db).await?).into_response())
}

pub async fn create_project(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    require_admin(&p)?;
    let req: CreateProjectRequest = parse(&body, "project")?;
    admin::create_project(&st.db, &req.name, req.parent.as_deref(), req.quota).await?;
    let list = admin::list_projects(&st.db).await?;
    let view = list.projects.into_iter().find(|v| v.name == req.name);
    Ok((axum::http::StatusCode::CREATED, Json(view)).into_response())
}

pub async fn set_quota(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(name): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    require_admin(&p)?;
    let q: Quota = parse(&body, "quota")?;
    admin::set_quota(&st.db, &name, q).await?;
    let list = admin::list_projects(&st.db).await?;
    Ok(Json(list.projects.into_iter().find(|v| v.name == name)).into_response())
}

pub async fn create_key(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    require_admin(&p)?;
    let req: CreateKeyRequest = parse(&body, "key request")?;
    let k = admin::create_key(
        &st.db,
        &req.principal,
        req.project.as_deref(),
        req.kind.as_deref(),
    )
    .await?;
    Ok((axum::http::StatusCode::CREATED, Json(k)).into_response())
}

/// Query of `DELETE /v1/keys/{id}`.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RevokeQuery {
    /// Also stop every sandbox the key's principal created (end reason `quota_revoked`).
    #[serde(default)]
    pub stop_sandboxes: bool,
}

pub async fn revoke_key(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(id): Path<String>,
    q: Result<axum::extract::Query<RevokeQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    require_admin(&p)?;
    let q = q.map_err(|e| ApiError::BadRequest(format!("bad query: {e}")))?;
    let owner = admin::revoke_key(&st.db, &id).await?;
    st.verifier.forget_all();
    let stopped_sandboxes = if q.stop_sandboxes {
        crate::revoke::stop_sandboxes_of(&st, &owner).await
    } else {
        Vec::new()
    };
    Ok(Json(RevokedKey {
        revoked: id,
        stopped_sandboxes,
    })
    .into_response())
}

pub use dsec_wire::admin::{ClusterNode, ClusterView, RevokedKey};

pub async fn cluster(State(st): State<AppState>) -> Json<ClusterView> {
    let cfg = &st.config.placement;
    let view = st.forwarder.watcher().with(|nodes| {
        let list: Vec<ClusterNode> = nodes
            .iter()
            .map(|n| {
                let (sandboxes, capacity, labels) = n
                    .status
                    .as_ref()
                    .map(|s| {
                        (
                            s.sandboxes_running + s.sandboxes_paused,
                            s.capacity_sandboxes,
                            s.labels.clone(),
                        )
                    })
                    .unwrap_or_default();
                ClusterNode {
                    node: n.node_id.clone().unwrap_or_default(),
                    url: n.endpoint.url.clone(),
                    healthy: n.healthy,
                    sandboxes,
                    capacity,
                    load: crate::placement::load(n),
                    labels,
                    last_error: n.last_error.clone(),
                    last_seen_ms_ago: n.last_seen.map(|t| t.elapsed().as_millis() as u64),
                }
            })
            .collect();
        let util = crate::placement::primary_utilisation(nodes, cfg);
        (list, util)
    });
    let (nodes, util) = view;
    let m = &st.metrics;
    Json(ClusterView {
        sandboxes: nodes.iter().map(|n| n.sandboxes).sum(),
        capacity: nodes.iter().filter(|n| n.healthy).map(|n| n.capacity).sum(),
        healthy_nodes: nodes.iter().filter(|n| n.healthy).count() as u64,
        nodes,
        primary_utilisation: util,
        overflow_threshold: cfg.overflow_threshold,
        placement: cfg.strategy,
        created_total: m.sandboxes_created.get(),
        quota_refusals_total: m.quota_refusals.get(),
        placement_refusals_total: m.placement_refusals.get(),
        overflow_placements_total: m.overflow_placements.get(),
    })
}
