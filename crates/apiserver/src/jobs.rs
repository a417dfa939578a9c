//! Job-level operations across the cluster: `POST /v1/jobs/{pause,resume,stop}` with a
//! [`LabelSelector`] body is sent to every edge at once and the answers are summed. Edges that
//! do not answer are listed in `unreachable_nodes` (their sandboxes are not counted).

use std::time::Instant;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use dsec_wire::api::{JobOpResult, LabelSelector};

use crate::error::ApiError;
use crate::routes::AppState;

/// Sums the per-edge answers into one.
pub fn merge(parts: Vec<JobOpResult>, unreachable: Vec<String>) -> JobOpResult {
    let mut out = JobOpResult {
        unreachable_nodes: unreachable,
        ..Default::default()
    };
    for p in parts {
        out.matched += p.matched;
        out.succeeded += p.succeeded;
        out.failed.extend(p.failed);
        out.sandboxes.extend(p.sandboxes);
        out.unreachable_nodes.extend(p.unreachable_nodes);
    }
    out.sandboxes.sort();
    out
}

pub async fn job(
    State(st): State<AppState>,
    Path(op): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    if !matches!(op.as_str(), "pause" | "resume" | "stop") {
        return Err(ApiError::NotFound(format!(
            "no job operation {op:?}: use pause, resume or stop"
        )));
    }
    let sel: LabelSelector = serde_json::from_slice(&body).map_err(|e| {
        ApiError::BadRequest(format!(
            "invalid label selector (expected {{\"labels\": {{...}}}}): {e}"
        ))
    })?;
    if sel.labels.is_empty() {
        return Err(ApiError::BadRequest(
            "labels must name at least one label (an empty selector would match every sandbox)"
                .into(),
        ));
    }
    let started = Instant::now();
    let endpoints = st.forwarder.watcher().endpoints();
    let http = st.forwarder.http().clone();
    let calls = endpoints.iter().map(|e| {
        let http = http.clone();
        let url = format!("{}/edge/v1/jobs/{op}", e.url);
        let sel = &sel;
        async move {
            match http.post(&url).bearer_auth(&e.token).json(sel).send().await {
                Ok(r) if r.status().is_success() => r
                    .json::<JobOpResult>()
                    .await
                    .map_err(|err| format!("decode {url}: {err}")),
                Ok(r) => Err(format!("{url}: {}", r.status())),
                Err(err) => Err(format!("{url}: {err}")),
            }
        }
    });
    let results = futures::future::join_all(calls).await;
    let mut parts = Vec::new();
    let mut unreachable = Vec::new();
    for (e, r) in endpoints.iter().zip(results) {
        match r {
            Ok(p) => parts.push(p),
            Err(err) => {
                tracing::warn!(error = %err, "job operation on edge");
                unreachable.push(e.node_id.clone().unwrap_or_else(|| e.url.clone()));
            }
        }
    }
    let mut out = merge(parts, unreachable);
    out.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
    Ok(axum::Json(out).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_counts() {
        let a = JobOpResult {
            matched: 2,
            succeeded: 2,
            sandboxes: vec!["b".into(), "a".into()],
            ..Default::default()
        };
        let b = JobOpResult {
            matched: 1,
            succeeded: 0,
            failed: vec![dsec_wire::api::JobOpFailure {
                id: "c".into(),
                error: dsec_wire::api::ErrorDetail {
                    code: "internal".into(),
                    message: "x".into(),
                },
            }],
            sandboxes: vec!["c".into()],
            ..Default::default()
        };
        let m = merge(vec![a, b], vec!["n9".into()]);
        assert_eq!((m.matched, m.succeeded, m.failed.len()), (3, 2, 1));
        assert_eq!(m.sandboxes, vec!["a", "b", "c"]);
        assert_eq!(m.unreachable_nodes, vec!["n9"]);
    }
}
