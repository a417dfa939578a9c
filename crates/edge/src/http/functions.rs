//! `/edge/v1/functions/*`: function calls on the pre-warmed pools ([`dsec_functions`]).
//!
//! | method | path | body | answer |
//! |---|---|---|---|
//! | POST | `/edge/v1/functions/call` | `FunctionCallRequest` | `FunctionCallResult` |
//! | POST | `/edge/v1/functions/batch` | `FunctionBatchRequest` | `FunctionBatchResult` |
//! | GET | `/edge/v1/functions/pools` | | `FunctionPoolList` |
//!
//! A full queue answers 429 `quota_exceeded` with a `Retry-After` header and `retry_after_s`
//! in the body; the call did not run.

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, State};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dsec_wire::api::{FunctionBatchRequest, FunctionCallRequest};

use super::{ApiJson, AppState};
use crate::manager::Manager;
use dsec_functions::{FunctionError, Functions};

/// Largest batch body (10,000 small calls).
const MAX_BATCH_BODY: usize = 32 * 1024 * 1024;

#[derive(Clone)]
struct FnState {
    functions: Option<Arc<Functions>>,
}

/// The function routes (auth as every `/edge/v1` route), merged into the edge's router.
pub fn router(mgr: Arc<Manager>, functions: Option<Arc<Functions>>, token: &str) -> Router {
    let auth_state = AppState {
        mgr,
        token: Arc::from(token),
    };
    Router::new()
        .route("/edge/v1/functions/call", post(call))
        .route("/edge/v1/functions/batch", post(batch))
        .route("/edge/v1/functions/pools", get(pools))
        .route_layer(middleware::from_fn_with_state(auth_state, super::auth))
        .layer(DefaultBodyLimit::max(MAX_BATCH_BODY))
        .with_state(FnState { functions })
}

fn service(s: &FnState) -> Result<&Arc<Functions>, FunctionError> {
    s.functions.as_ref().ok_or(FunctionError::Disabled)
}

async fn call(State(s): State<FnState>, ApiJson(req): ApiJson<FunctionCallRequest>) -> Response {
    let f = match service(&s) {
        Ok(f) => f,
        Err(e) => return crate::error::function_error_response(e),
    };
    match f.call(req).await {
        Ok(r) => Json(r).into_response(),
        Err(e) => crate::error::function_error_response(e),
    }
}

async fn batch(State(s): State<FnState>, ApiJson(req): ApiJson<FunctionBatchRequest>) -> Response {
    let f = match service(&s) {
        Ok(f) => f,
        Err(e) => return crate::error::function_error_response(e),
    };
    match f.batch(req).await {
        Ok(r) => Json(r).into_response(),
        Err(e) => crate::error::function_error_response(e),
    }
}

async fn pools(State(s): State<FnState>) -> Response {
    match service(&s) {
        Ok(f) => Json(f.pools()).into_response(),
        Err(e) => crate::error::function_error_response(e),
    }
}
