//! `GET /templates`, `/templates/{id}`, `/templates/aliases/{alias}`: dsec images as E2B
//! templates (read-only: building templates is `dsec image import/pull`, not this API).

use axum::extract::{Path, State};
use axum::Json;
use dsec_wire::api::ImageInfo;
use serde_json::{json, Value};

use super::errors::E2bError;
use super::snapshots::image_list;
use crate::routes::AppState;

/// `source` of an image registered by `dsec image alias` (its `parent` is the target).
pub const ALIAS_SOURCE: &str = "alias";

fn aliases_of(all: &[ImageInfo], name: &str) -> Vec<String> {
    all.iter()
        .filter(|i| i.source.as_deref() == Some(ALIAS_SOURCE) && i.parent.as_deref() == Some(name))
        .map(|i| i.name.clone())
        .collect()
}

/// One image as an E2B `Template`.
pub fn template(st: &AppState, all: &[ImageInfo], i: &ImageInfo) -> Value {
    json!({
        "templateID": i.name,
        "buildID": i.layers.last().map(|l| l.digest.clone()).unwrap_or_default(),
        "cpuCount": (st.config.default_cpu_cores.ceil() as u64).max(1),
        "memoryMB": st.config.default_memory_mb,
        "diskSizeMB": i.size_bytes / (1024 * 1024),
        "public": false,
        "aliases": aliases_of(all, &i.name),
        "names": [i.name],
        "createdAt": i.created_at,
        "updatedAt": i.created_at,
        "createdBy": null,
        "lastSpawnedAt": null,
        "spawnCount": i.in_use,
        "buildCount": 1,
        "envdVersion": super::super::ENVD_VERSION,
        "buildStatus": "ready",
        "description": i.source.clone().unwrap_or_default(),
    })
}

/// `GET /templates`.
pub async fn list(State(st): State<AppState>) -> Result<Json<Vec<Value>>, E2bError> {
    let all = image_list(&st).await?.images;
    Ok(Json(all.iter().map(|i| template(&st, &all, i)).collect()))
}

fn find<'a>(all: &'a [ImageInfo], id: &str) -> Result<&'a ImageInfo, E2bError> {
    let canonical = if id.contains(':') {
        id.to_string()
    } else {
        format!("{id}:latest")
    };
    all.iter()
        .find(|i| i.name == id || i.name == canonical)
        .ok_or_else(|| {
            E2bError::not_found(format!(
                "template {id:?} not found: it must be a dsec image or alias (see `dsec image ls`)"
            ))
        })
}

/// `GET /templates/{id}`: the template with its (one) build.
pub async fn get(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, E2bError> {
    let all = image_list(&st).await?.images;
    let i = find(&all, &id)?;
    let mut v = template(&st, &all, i);
    if let Value::Object(o) = &mut v {
        o.insert(
            "builds".into(),
            json!([{
                "buildID": i.layers.last().map(|l| l.digest.clone()).unwrap_or_default(),
                "status": "ready",
                "createdAt": i.created_at,
                "updatedAt": i.created_at,
                "finishedAt": i.created_at,
                "cpuCount": (st.config.default_cpu_cores.ceil() as u64).max(1),
                "memoryMB": st.config.default_memory_mb,
                "diskSizeMB": i.size_bytes / (1024 * 1024),
                "envdVersion": super::super::ENVD_VERSION,
            }]),
        );
    }
    Ok(Json(v))
}

/// `GET /templates/aliases/{alias}`.
pub async fn alias(
    State(st): State<AppState>,
    Path(alias): Path<String>,
) -> Result<Json<Value>, E2bError> {
    let all = image_list(&st).await?.images;
    let i = find(&all, &alias)?;
    let target = if i.source.as_deref() == Some(ALIAS_SOURCE) {
        i.parent.clone().unwrap_or_else(|| i.name.clone())
    } else {
        i.name.clone()
    };
    Ok(Json(json!({"templateID": target, "public": false})))
}
