//! A create with `wait_s`: waits for its turn in the [`super::BurstQueue`], then makes one
//! attempt through [`crate::create::create_with`]; an attempt that finds no room puts it back
//! in its place until `wait_s` passes. The answer is the sandbox plus a `queue` report
//! ([`dsec_wire::api::QueueReport`]) and the header `x-dsec-queue-wait-ms`.

use std::time::{Duration, Instant};

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use dsec_wire::api::{codes, CreateSandboxRequest, ErrorBody, QueueReport};

use crate::create::{create_with, Extras};
use crate::db::Principal;
use crate::error::{error_response, ApiError};
use crate::routes::AppState;

/// Longest `wait_s` accepted (a day).
pub const MAX_WAIT_S: f64 = 86_400.0;

/// Largest create answer read back to add the queue report (a sandbox's info is ~1 KiB).
const MAX_ANSWER: usize = 1 << 20;

/// Checks `wait_s`; the error says what to send instead.
pub fn check_wait_s(wait_s: f64) -> Result<Duration, ApiError> {
    if !(wait_s.is_finite() && wait_s > 0.0 && wait_s <= MAX_WAIT_S) {
        return Err(ApiError::BadRequest(format!(
            "wait_s must be a number of seconds in (0, {MAX_WAIT_S}]; got {wait_s}; leave it out to be refused at once when no node has room"
        )));
    }
    Ok(Duration::from_secs_f64(wait_s))
}

/// A create that waits up to `wait` for capacity. `cancel` (a batch's) ends the wait early
/// with `None`: only while it waits for its turn, never while an attempt is out.
pub async fn create_queued(
    st: &AppState,
    principal: &Principal,
    req: CreateSandboxRequest,
    wait: Duration,
    extras: Extras,
    mut cancel: Option<tokio::sync::watch::Receiver<bool>>,
) -> Option<Result<Response, ApiError>> {
    let arrived = Instant::now();
    let deadline = arrived + wait;
    let project = req
        .project
        .clone()
        .unwrap_or_else(|| principal.project.clone());
    let queue = st.queue.clone();
    let mut ticket: Option<u64> = None;
    let shape = std::sync::Arc::new(req.clone());
    let mut attempts = 0u32;
    let mut last_refusal: Option<String> = None;
    loop {
        let turn = queue.wait_turn(&project, ticket, &shape, deadline);
        let turn = match cancel.as_mut() {
            Some(c) => tokio::select! {
                t = turn => t,
                _ = c.wait_for(|stop| *stop) => return None,
            },
            None => turn.await,
        };
        let slot = match turn {
            Ok(s) => s,
            Err(e) => {
                let why = last_refusal.unwrap_or_else(|| {
                    st.forwarder
                        .watcher()
                        .with(|nodes| super::room::why_no_room(nodes, &req))
                });
                return Some(Ok(refused(
                    st,
                    &req,
                    wait,
                    arrived,
                    attempts,
                    &e.to_string(),
                    &why,
                )));
            }
        };
        attempts += 1;
        ticket = Some(slot.ticket);
        let waited = arrived.elapsed();
        let resp = match create_with(st, principal, req.clone(), extras.clone()).await {
            Ok(r) => r,
            Err(e) => {
                observe(st, "error", arrived);
                return Some(Err(e));
            }
        };
        if resp.status().is_success() {
            let (dispatched, slot_ticket) = (slot.dispatched, slot.ticket);
            slot.placed();
            observe(st, "placed", arrived);
            let report = QueueReport {
                waited_ms: waited.as_secs_f64() * 1e3,
                ticket: slot_ticket,
                dispatched,
                attempts,
            };
            return Some(Ok(with_report(resp, &report).await));
        }
        if resp.status() != StatusCode::SERVICE_UNAVAILABLE {
            // A user error (bad image, quota): waiting does not change it.
            drop(slot);
            observe(st, "error", arrived);
            return Some(Ok(resp));
        }
        let (parts, body) = resp.into_parts();
        let bytes = axum::body::to_bytes(body, MAX_ANSWER)
            .await
            .unwrap_or_default();
        let err = serde_json::from_slice::<ErrorBody>(&bytes).ok();
        let no_room = err.as_ref().is_some_and(|e| {
            e.error.code == codes::NODE_FULL || e.error.code == codes::NODE_UNAVAILABLE
        });
        if !no_room {
            drop(slot);
            observe(st, "error", arrived);
            return Some(Ok(Response::from_parts(
                parts,
                axum::body::Body::from(bytes),
            )));
        }
        let why = err.map(|e| e.error.message).unwrap_or_default();
        slot.no_room(&why);
        last_refusal = Some(why);
        if Instant::now() >= deadline {
            let why = last_refusal.unwrap_or_default();
            return Some(Ok(refused(
                st,
                &req,
                wait,
                arrived,
                attempts,
                "wait_s passed",
                &why,
            )));
        }
    }
}

fn observe(st: &AppState, outcome: &str, arrived: Instant) {
    st.metrics
        .queue_wait_seconds
        .with_label_values(&[outcome])
        .observe(arrived.elapsed().as_secs_f64());
}

/// `503 node_full` past `wait_s`, naming what was lacking and what to change.
fn refused(
    st: &AppState,
    req: &CreateSandboxRequest,
    wait: Duration,
    arrived: Instant,
    attempts: u32,
    what: &str,
    why: &str,
) -> Response {
    observe(st, "refused", arrived);
    st.metrics.placement_refusals.inc();
    let asked = format!(
        "{} MiB, {} cores",
        req.memory_limit_mb.unwrap_or(st.config.default_memory_mb),
        req.cpu_cores_limit.unwrap_or(st.config.default_cpu_cores)
    );
    error_response(
        codes::NODE_FULL,
        format!(
            "no node had room for this sandbox ({asked}) within wait_s={:.1} s ({what}; {attempts} attempt(s)); last refusal: {why}; ask for less (memory_limit_mb, cpu_cores_limit, or qos=best_effort), wait longer (wait_s), or add nodes",
            wait.as_secs_f64()
        ),
    )
}

/// The create answer with `queue` added and the wait in `x-dsec-queue-wait-ms`.
async fn with_report(resp: Response, report: &QueueReport) -> Response {
    let (mut parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_ANSWER).await else {
        return (StatusCode::BAD_GATEWAY, "create answer unreadable").into_response();
    };
    let body = match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(serde_json::Value::Object(mut m)) => {
            m.insert(
                "queue".into(),
                serde_json::to_value(report).unwrap_or_default(),
            );
            serde_json::to_vec(&m)
                .map(bytes::Bytes::from)
                .unwrap_or(bytes)
        }
        _ => bytes,
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    if let Ok(v) = HeaderValue::from_str(&format!("{:.1}", report.waited_ms)) {
        parts.headers.insert("x-dsec-queue-wait-ms", v);
    }
    Response::from_parts(parts, axum::body::Body::from(body))
}
