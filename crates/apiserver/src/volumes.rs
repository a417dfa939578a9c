//! `/v1/volumes`: named persistent volumes of a project, and resolving a create request's
//! `volumes` (names in the sandbox's project) to the node's volume ids.
//!
//! The IAM database records each volume (`volumes` table: id, name, project, node, size) and
//! is the only place names and owners live; the edge holding the volume (node-local) keeps
//! its data and knows which sandboxes mount it. A name resolves only in the sandbox's own
//! project, so another project's volume cannot be mounted (404 naming the project), and a
//! project the caller may not use is refused (403) before any name is looked up.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use dsec_wire::api::{
    is_valid_volume_name, CreateSandboxRequest, CreateVolumeRequest, EdgeCreateVolume,
    EdgeVolumeInfo, VolumeInfo, VolumeList, VolumeMount, VolumeMountSpec, VolumeQuery,
    MAX_VOLUME_MB, MIN_VOLUME_MB,
};

use crate::config::EdgeEndpoint;
use crate::db::Principal;
use crate::error::ApiError;
use crate::p;
use crate::routes::AppState;
use crate::store::Tx;

/// How long the apiserver waits for an edge to make (mkfs) or delete a volume.
const EDGE_TIMEOUT: Duration = Duration::from_secs(120);

/// One row of the `volumes` table.
#[derive(Debug, Clone)]
struct Row {
    id: String,
    name: String,
    project: String,
    node: String,
    size_mb: u64,
    created_ms: i64,
}

impl Row {
    fn info(&self) -> VolumeInfo {
        VolumeInfo {
            id: self.id.clone(),
            name: self.name.clone(),
            project: self.project.clone(),
            node: self.node.clone(),
            size_mb: self.size_mb,
            created_at: rfc3339_ms(self.created_ms),
            used_by: Vec::new(),
        }
    }
}

fn rfc3339_ms(ms: i64) -> String {
    crate::time::format(ms.max(0) / 1000)
}

const COLUMNS: &str = "id, name, project_id, node, size_mb, created_ms";

fn row_of(r: &crate::store::Row) -> Result<Row, crate::db::DbError> {
    Ok(Row {
        id: r.str(0)?,
        name: r.str(1)?,
        project: r.str(2)?,
        node: r.str(3)?,
        size_mb: r.i64(4)?.max(0) as u64,
        created_ms: r.i64(5)?,
    })
}

/// The principal may use `project` (its home project or a descendant; admins any existing one).
fn check_access(tx: &mut Tx<'_>, principal: &Principal, project: &str) -> Result<(), ApiError> {
    let mut cur = Some(project.to_string());
    let mut seen = 0;
    while let Some(p) = cur {
        seen += 1;
        if seen > 64 {
            break;
        }
        if principal.kind != "admin" && p == principal.project {
            return Ok(());
        }
        let row = tx
            .query_opt("SELECT parent_id FROM projects WHERE id = $1", p![&p])
            .map_err(db_err)?;
        let Some(row) = row else {
            return Err(ApiError::NotFound(format!(
                "project {p:?} does not exist; see `dsec project ls`"
            )));
        };
        if principal.kind == "admin" {
            return Ok(());
        }
        cur = row.opt_str(0).map_err(db_err)?;
    }
    Err(ApiError::Forbidden(format!(
        "project {project:?} is outside your project {:?} and its sub-projects",
        principal.project
    )))
}

fn db_err(e: crate::db::DbError) -> ApiError {
    ApiError::Internal(e.to_string())
}

fn project_of(principal: &Principal, asked: Option<&str>) -> String {
    asked.map_or_else(|| principal.project.clone(), str::to_string)
}

/// Looks a volume up by name in `project` (after the access check).
async fn find(
    st: &AppState,
    principal: &Principal,
    project: &str,
    name: &str,
) -> Result<Row, ApiError> {
    let (principal, project, name) = (principal.clone(), project.to_string(), name.to_string());
    let found = st
        .db
        .run(move |conn| {
            let mut tx = conn.begin(false)?;
            let access = check_access(&mut tx, &principal, &project);
            let row = match access {
                Ok(()) => tx
                    .query_opt(
                        &format!(
                            "SELECT {COLUMNS} FROM volumes WHERE project_id = $1 AND name = $2"
                        ),
                        p![&project, &name],
                    )?
                    .map(|r| row_of(&r))
                    .transpose()?,
                Err(_) => None,
            };
            tx.commit()?;
            Ok((access, row, project, name))
        })
        .await
        .map_err(db_err)?;
    let (access, row, project, name) = found;
    access?;
    row.ok_or_else(|| {
        ApiError::NotFound(format!(
            "volume {name:?} not found in project {project:?}; create it with `dsec volume create {name} SIZE_MB` (or client.create_volume)"
        ))
    })
}

/// The edge of node `node`, healthy.
fn edge_of(st: &AppState, node: &str) -> Result<EdgeEndpoint, ApiError> {
    match st.forwarder.watcher().endpoint_for(node) {
        Some((e, true, _)) => Ok(e),
        Some((_, false, err)) => Err(ApiError::NodeUnavailable(format!(
            "node {node}, which holds the volume, is unavailable{}",
            err.map(|e| format!(": {e}")).unwrap_or_default()
        ))),
        None => Err(ApiError::NodeUnavailable(format!(
            "node {node}, which holds the volume, is not one of this apiserver's nodes"
        ))),
    }
}

fn json(status: StatusCode, body: Bytes) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// `POST /v1/volumes`.
pub async fn create(
    State(st): State<AppState>,
    axum::Extension(principal): axum::Extension<Principal>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: CreateVolumeRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::BadRequest(format!("invalid volume request: {e}")))?;
    if !is_valid_volume_name(&req.name) {
        return Err(ApiError::BadRequest(format!(
            "volume name {:?} must match [a-z0-9][a-z0-9-]{{0,62}}",
            req.name
        )));
    }
    if !(MIN_VOLUME_MB..=MAX_VOLUME_MB).contains(&req.size_mb) {
        return Err(ApiError::BadRequest(format!(
            "size_mb {} is out of range: give {MIN_VOLUME_MB} to {MAX_VOLUME_MB} MiB",
            req.size_mb
        )));
    }
    let project = project_of(&principal, req.project.as_deref());
    // The node: the one asked for, else a healthy one (the least loaded by sandboxes).
    let node = match &req.node {
        Some(n) => {
            edge_of(&st, n)?;
            n.clone()
        }
        None => st
            .forwarder
            .watcher()
            .with(|nodes| {
                nodes
                    .iter()
                    .filter(|n| n.healthy)
                    .filter_map(|n| {
                        let load = n.status.as_ref().map_or(0, |s| s.sandboxes_running);
                        n.node_id.clone().map(|id| (load, id))
                    })
                    .min()
                    .map(|(_, id)| id)
            })
            .ok_or_else(|| {
                ApiError::NodeUnavailable(
                    "no healthy node to keep the volume on; see GET /v1/nodes".into(),
                )
            })?,
    };
    let edge = edge_of(&st, &node)?;
    let id = format!("vol-{}", hex::encode(rand::random::<[u8; 8]>()));
    let row = Row {
        id: id.clone(),
        name: req.name.clone(),
        project: project.clone(),
        node: node.clone(),
        size_mb: req.size_mb,
        created_ms: crate::iam::ledger::now_ms(),
    };
    // The name is taken first (unique in the project), then the edge makes the file system.
    {
        let (row, principal) = (row.clone(), principal.clone());
        let taken = st
            .db
            .run(move |conn| {
                let mut tx = conn.begin(true)?;
                if let Err(e) = check_access(&mut tx, &principal, &row.project) {
                    return Ok(Err(e));
                }
                let exists = tx.query_opt(
                    "SELECT id FROM volumes WHERE project_id = $1 AND name = $2",
                    p![&row.project, &row.name],
                )?;
                if exists.is_some() {
                    return Ok(Err(ApiError::Conflict(format!(
                        "volume {:?} already exists in project {:?}",
                        row.name, row.project
                    ))));
                }
                tx.exec(
                    &format!("INSERT INTO volumes ({COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6)"),
                    p![
                        &row.id,
                        &row.name,
                        &row.project,
                        &row.node,
                        row.size_mb as i64,
                        row.created_ms
                    ],
                )?;
                tx.commit()?;
                Ok(Ok(()))
            })
            .await
            .map_err(db_err)?;
        taken?;
    }
    let sent = st
        .forwarder
        .http()
        .post(format!("{}/edge/v1/volumes", edge.url))
        .bearer_auth(&edge.token)
        .json(&EdgeCreateVolume {
            id: id.clone(),
            size_mb: req.size_mb,
        })
        .timeout(EDGE_TIMEOUT)
        .send()
        .await;
    let failed = match sent {
        Ok(r) if r.status().is_success() => None,
        Ok(r) => {
            let status =
                StatusCode::from_u16(r.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
            Some(json(status, r.bytes().await.unwrap_or_default()))
        }
        Err(e) => Some(
            ApiError::NodeUnavailable(format!("node {node} did not make the volume: {e}"))
                .into_response(),
        ),
    };
    if let Some(resp) = failed {
        forget(&st, &id).await;
        return Ok(resp);
    }
    tracing::info!(volume = %id, name = %row.name, project = %project, node = %node, size_mb = row.size_mb, "volume created");
    Ok((StatusCode::CREATED, Json(row.info())).into_response())
}

async fn forget(st: &AppState, id: &str) {
    let id = id.to_string();
    let r = st
        .db
        .run(move |conn| {
            let mut tx = conn.begin(true)?;
            tx.exec("DELETE FROM volumes WHERE id = $1", p![&id])?;
            tx.commit()
        })
        .await;
    if let Err(e) = r {
        tracing::error!(error = %e, "forget a volume row");
    }
}

/// The volume routes' query, or a 400 saying what it may hold (axum's own rejection is plain text).
fn volume_query(q: Result<Query<VolumeQuery>, QueryRejection>) -> Result<VolumeQuery, ApiError> {
    q.map(|Query(q)| q).map_err(|e| {
        ApiError::BadRequest(format!(
            "bad volume query ({e}); the only parameter is project=<name>"
        ))
    })
}

/// `GET /v1/volumes?project=P`.
pub async fn list(
    State(st): State<AppState>,
    axum::Extension(principal): axum::Extension<Principal>,
    q: Result<Query<VolumeQuery>, QueryRejection>,
) -> Result<Json<VolumeList>, ApiError> {
    let q = volume_query(q)?;
    let project = project_of(&principal, q.project.as_deref());
    let rows = st
        .db
        .run(move |conn| {
            let mut tx = conn.begin(false)?;
            if let Err(e) = check_access(&mut tx, &principal, &project) {
                return Ok(Err(e));
            }
            let rows = tx
                .query(
                    &format!("SELECT {COLUMNS} FROM volumes WHERE project_id = $1 ORDER BY name"),
                    p![&project],
                )?
                .iter()
                .map(row_of)
                .collect::<Result<Vec<_>, _>>()?;
            tx.commit()?;
            Ok(Ok(rows))
        })
        .await
        .map_err(db_err)??;
    Ok(Json(VolumeList {
        volumes: rows.iter().map(Row::info).collect(),
    }))
}

/// `GET /v1/volumes/{name}?project=P`: the row, with the sandboxes using it from its node.
pub async fn get(
    State(st): State<AppState>,
    axum::Extension(principal): axum::Extension<Principal>,
    Path(name): Path<String>,
    q: Result<Query<VolumeQuery>, QueryRejection>,
) -> Result<Json<VolumeInfo>, ApiError> {
    let q = volume_query(q)?;
    let project = project_of(&principal, q.project.as_deref());
    let row = find(&st, &principal, &project, &name).await?;
    let mut info = row.info();
    if let Ok(edge) = edge_of(&st, &row.node) {
        let r = st
            .forwarder
            .http()
            .get(format!("{}/edge/v1/volumes/{}", edge.url, row.id))
            .bearer_auth(&edge.token)
            .send()
            .await;
        if let Ok(r) = r {
            if let Ok(e) = r.json::<EdgeVolumeInfo>().await {
                info.used_by = e.used_by;
            }
        }
    }
    Ok(Json(info))
}

/// `DELETE /v1/volumes/{name}?project=P`: refused (409 naming the sandboxes) while mounted.
pub async fn delete(
    State(st): State<AppState>,
    axum::Extension(principal): axum::Extension<Principal>,
    Path(name): Path<String>,
    q: Result<Query<VolumeQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let q = volume_query(q)?;
    let project = project_of(&principal, q.project.as_deref());
    let row = find(&st, &principal, &project, &name).await?;
    let edge = edge_of(&st, &row.node)?;
    let r = st
        .forwarder
        .http()
        .delete(format!("{}/edge/v1/volumes/{}", edge.url, row.id))
        .bearer_auth(&edge.token)
        .timeout(EDGE_TIMEOUT)
        .send()
        .await
        .map_err(|e| {
            ApiError::NodeUnavailable(format!(
                "node {} did not delete volume {name:?}: {e}",
                row.node
            ))
        })?;
    let status = r.status().as_u16();
    // 404: the node lost it (its data dir was wiped): the record goes too.
    if !(r.status().is_success() || status == 404) {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
        return Ok(json(status, r.bytes().await.unwrap_or_default()));
    }
    forget(&st, &row.id).await;
    tracing::info!(volume = %row.id, name = %row.name, project = %row.project, "volume deleted");
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// For a create: resolves `req.volumes` (names in `project`) to the node's ids and answers
/// the node they all live on (`None` without volumes).
pub async fn resolve_mounts(
    st: &AppState,
    principal: &Principal,
    project: &str,
    req: &mut CreateSandboxRequest,
) -> Result<Option<String>, ApiError> {
    if req.volumes.is_empty() {
        return Ok(None);
    }
    let mut node: Option<(String, String)> = None;
    let mut resolved = std::collections::BTreeMap::new();
    for (path, m) in &req.volumes {
        dsec_wire::api::check_volume_path(path).map_err(ApiError::BadRequest)?;
        let row = find(st, principal, project, m.name()).await?;
        match &node {
            Some((n, first)) if *n != row.node => {
                return Err(ApiError::BadRequest(format!(
                    "volumes {first:?} (node {n}) and {:?} (node {}) are on different nodes; a sandbox can only mount volumes of one node",
                    row.name, row.node
                )))
            }
            Some(_) => {}
            None => node = Some((row.node.clone(), row.name.clone())),
        }
        resolved.insert(
            path.clone(),
            VolumeMount::Spec(VolumeMountSpec {
                name: row.id.clone(),
                read_only: m.read_only(),
            }),
        );
    }
    req.volumes = resolved;
    Ok(node.map(|(n, _)| n))
}

#[cfg(test)]
mod tests {
    #[test]
    fn times() {
        assert_eq!(super::rfc3339_ms(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::rfc3339_ms(1_767_225_600_000), "2026-01-01T00:00:00Z");
    }
}
