//! Pause and resume: `POST /edge/v1/sandboxes/{id}/pause|resume` and the job-level
//! `POST /edge/v1/jobs/{pause,resume,stop}` with a [`LabelSelector`] body.

use axum::extract::State;
use axum::Json;
use dsec_wire::api::{JobOpResult, LabelSelector, SandboxInfo};

use super::{ApiJson, ApiPath, AppState};
use crate::error::EdgeError;
use crate::manager::JobOp;

pub async fn pause(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<SandboxInfo>, EdgeError> {
    Ok(Json(s.mgr.pause(&id).await?))
}

pub async fn resume(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<SandboxInfo>, EdgeError> {
    Ok(Json(s.mgr.resume(&id).await?))
}

pub async fn job(
    State(s): State<AppState>,
    ApiPath(op): ApiPath<String>,
    ApiJson(sel): ApiJson<LabelSelector>,
) -> Result<Json<JobOpResult>, EdgeError> {
    let op = JobOp::parse(&op).ok_or_else(|| {
        EdgeError::NotFound(format!(
            "no job operation {op:?}: use pause, resume or stop"
        ))
    })?;
    Ok(Json(s.mgr.job_op(op, &sel).await?))
}
