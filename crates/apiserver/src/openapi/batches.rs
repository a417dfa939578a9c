//! Batches (`create_many`, issue 22): submit, read progress, cancel.

#![allow(dead_code)]

use dsec_wire::api::{BatchStatus, CreateBatchRequest, ErrorBody};
use utoipa::IntoParams;

use super::paths::ERRORS;

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct BatchPath {
    /// Batch id (`bt-` and 16 hex digits), from `POST /v1/batches`.
    id: String,
}

/// Submit `count` creates of one shape: they wait in the apiserver's queue and are placed as
/// capacity frees (each sandbox labelled `dsec.batch=<id>`). Served by this apiserver only.
#[utoipa::path(post, path = "/v1/batches", tag = "batches", operation_id = "createBatch",
    request_body = CreateBatchRequest,
    responses(
        (status = 202, description = "Accepted; the creates run in the background", body = BatchStatus),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn create_batch() {}

/// Progress of a batch: placed, queued, failed (with error codes), the placed sandbox ids.
#[utoipa::path(get, path = "/v1/batches/{id}", tag = "batches", operation_id = "getBatch",
    params(BatchPath),
    responses(
        (status = 200, description = "OK", body = BatchStatus),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn get_batch() {}

/// Cancel a batch: its creates still queued leave the queue (placed sandboxes keep running;
/// stop them with `POST /v1/jobs/stop` and the label `dsec.batch`).
#[utoipa::path(delete, path = "/v1/batches/{id}", tag = "batches", operation_id = "cancelBatch",
    params(BatchPath),
    responses(
        (status = 200, description = "Cancelled; the progress once the queued creates left", body = BatchStatus),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn cancel_batch() {}
