//! `create_many` (issue 22, item 3): `POST /v1/batches` submits `count` creates of one shape
//! that wait in the burst queue ([`crate::queue`]) and are placed as capacity frees;
//! `GET /v1/batches/{id}` reads the progress (placed / queued / failed) while it runs;
//! `DELETE /v1/batches/{id}` cancels the creates still queued (placed sandboxes keep running;
//! stop them with `POST /v1/jobs/stop {"labels": {"dsec.batch": id}}`).
//!
//! **Owns** the batches of this apiserver, in memory: a batch is served by the apiserver that
//! took it (another answers 404), and a restart of it drops the batches' queued creates (their
//! placed sandboxes live on, labelled `dsec.batch`). **Must not** place anything itself: every
//! create is [`crate::queue::create::create_queued`]'s, with the idempotency key
//! `batch-<id>-<i>`, so no create of a batch is made twice.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use dsec_wire::api::{BatchState, BatchStatus, CreateBatchRequest, ErrorBody};

use crate::create::Extras;
use crate::db::Principal;
use crate::error::ApiError;
use crate::routes::AppState;

/// Label naming the batch a sandbox belongs to.
pub const LABEL_BATCH: &str = "dsec.batch";
/// Most sandboxes in one batch.
pub const MAX_COUNT: u64 = 100_000;
/// Default `wait_s` of a batch's creates.
pub const DEFAULT_WAIT_S: f64 = 3600.0;
/// Finished batches kept for reading (the oldest finished go first).
const KEEP_FINISHED: usize = 256;

/// The batches of this apiserver.
#[derive(Default)]
pub struct Batches {
    map: Mutex<HashMap<String, Arc<Batch>>>,
}

pub struct Batch {
    owner: String,
    created: Instant,
    cancel: tokio::sync::watch::Sender<bool>,
    status: Mutex<BatchStatus>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Batch {
    fn snapshot(&self) -> BatchStatus {
        lock(&self.status).clone()
    }

    fn record(&self, outcome: Outcome) {
        let mut s = lock(&self.status);
        s.queued = s.queued.saturating_sub(1);
        match outcome {
            Outcome::Placed(id) => {
                s.placed += 1;
                s.sandbox_ids.push(id);
            }
            Outcome::Failed(code, msg) => {
                s.failed += 1;
                *s.errors.entry(code).or_default() += 1;
                s.last_error = Some(msg);
            }
            Outcome::Cancelled => s.cancelled += 1,
        }
        if s.queued == 0 && s.state == BatchState::Running {
            s.state = BatchState::Done;
        }
    }
}

enum Outcome {
    Placed(String),
    Failed(String, String),
    Cancelled,
}

impl Batches {
    fn get(&self, id: &str, principal: &Principal) -> Result<Arc<Batch>, ApiError> {
        let map = lock(&self.map);
        map.get(id)
            .filter(|b| b.owner == principal.id || principal.kind == "admin")
            .cloned()
            .ok_or_else(|| {
                ApiError::NotFound(format!(
                    "no batch {id:?} on this apiserver (a batch is served by the apiserver that took it)"
                ))
            })
    }

    fn insert(&self, id: String, b: Arc<Batch>) {
        let mut map = lock(&self.map);
        let mut finished: Vec<(Instant, String)> = map
            .iter()
            .filter(|(_, b)| lock(&b.status).state != BatchState::Running)
            .map(|(k, b)| (b.created, k.clone()))
            .collect();
        if finished.len() > KEEP_FINISHED {
            finished.sort();
            for (_, k) in &finished[..finished.len() - KEEP_FINISHED] {
                map.remove(k);
            }
        }
        map.insert(id, b);
    }
}

/// RFC 3339 UTC of now.
fn now_rfc3339() -> String {
    crate::time::format(crate::time::now())
}

/// `POST /v1/batches`.
pub async fn create(
    State(st): State<AppState>,
    axum::Extension(principal): axum::Extension<Principal>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let req: CreateBatchRequest = serde_json::from_slice(&body).map_err(|e| {
        ApiError::BadRequest(format!(
            "invalid batch (expected {{\"request\": {{create}}, \"count\": N}}): {e}"
        ))
    })?;
    if req.count == 0 || req.count > MAX_COUNT {
        return Err(ApiError::BadRequest(format!(
            "count must be in 1..={MAX_COUNT}; got {}; split larger jobs into several batches",
            req.count
        )));
    }
    let wait = crate::queue::create::check_wait_s(req.wait_s.unwrap_or(DEFAULT_WAIT_S))?;
    if req.request.idempotency_key.is_some() {
        return Err(ApiError::BadRequest(
            "request.idempotency_key must be left out: each create of a batch gets batch-<id>-<i>"
                .into(),
        ));
    }
    let id = format!("bt-{}", hex::encode(rand::random::<[u8; 8]>()));
    let (cancel, cancelled) = tokio::sync::watch::channel(false);
    let batch = Arc::new(Batch {
        owner: principal.id.clone(),
        created: Instant::now(),
        cancel,
        status: Mutex::new(BatchStatus {
            id: id.clone(),
            state: BatchState::Running,
            count: req.count,
            placed: 0,
            queued: req.count,
            failed: 0,
            cancelled: 0,
            sandbox_ids: Vec::new(),
            errors: BTreeMap::new(),
            last_error: None,
            created_at: now_rfc3339(),
        }),
    });
    st.batches.insert(id.clone(), batch.clone());
    let mut base = req.request.clone();
    base.wait_s = None;
    base.labels.extend(req.labels.clone());
    let extras = Extras {
        labels: [(LABEL_BATCH.to_string(), id.clone())].into(),
        only_node: None,
    };
    tracing::info!(batch = %id, count = req.count, project = ?base.project, "batch submitted");
    for i in 0..req.count {
        let mut one = base.clone();
        one.idempotency_key = Some(format!("batch-{id}-{i}"));
        let (st, principal, extras, batch, cancelled) = (
            st.clone(),
            principal.clone(),
            extras.clone(),
            batch.clone(),
            cancelled.clone(),
        );
        tokio::spawn(async move {
            let r = crate::queue::create::create_queued(
                &st,
                &principal,
                one,
                wait,
                extras,
                Some(cancelled),
            )
            .await;
            batch.record(outcome_of(r).await);
        });
    }
    Ok((StatusCode::ACCEPTED, Json(batch.snapshot())).into_response())
}

async fn outcome_of(r: Option<Result<Response, ApiError>>) -> Outcome {
    let resp = match r {
        None => return Outcome::Cancelled,
        Some(Err(e)) => return Outcome::Failed(e.code().to_string(), e.to_string()),
        Some(Ok(r)) => r,
    };
    let ok = resp.status().is_success();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap_or_default();
    if ok {
        #[derive(serde::Deserialize)]
        struct Id {
            id: String,
        }
        return match serde_json::from_slice::<Id>(&bytes) {
            Ok(i) => Outcome::Placed(i.id),
            Err(e) => Outcome::Failed("internal".into(), format!("create answer: {e}")),
        };
    }
    match serde_json::from_slice::<ErrorBody>(&bytes) {
        Ok(e) => Outcome::Failed(e.error.code, e.error.message),
        Err(_) => Outcome::Failed(
            "internal".into(),
            String::from_utf8_lossy(&bytes).into_owned(),
        ),
    }
}

/// `GET /v1/batches/{id}`.
pub async fn get(
    State(st): State<AppState>,
    axum::Extension(principal): axum::Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<BatchStatus>, ApiError> {
    Ok(Json(st.batches.get(&id, &principal)?.snapshot()))
}

/// `DELETE /v1/batches/{id}`: the queued creates leave the queue; the answer is the progress
/// once they have (creates already out at a node finish first, for at most a few seconds).
pub async fn cancel(
    State(st): State<AppState>,
    axum::Extension(principal): axum::Extension<Principal>,
    Path(id): Path<String>,
) -> Result<Json<BatchStatus>, ApiError> {
    let b = st.batches.get(&id, &principal)?;
    {
        let mut s = lock(&b.status);
        if s.state == BatchState::Running {
            s.state = BatchState::Cancelled;
        }
    }
    let _ = b.cancel.send(true);
    let until = Instant::now() + Duration::from_secs(10);
    while lock(&b.status).queued > 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(Json(b.snapshot()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_of_now_is_well_formed() {
        let s = super::now_rfc3339();
        assert_eq!(s.len(), 20, "{s}");
        assert!(
            s.starts_with("20") && s.ends_with('Z') && &s[10..11] == "T",
            "{s}"
        );
    }
}
