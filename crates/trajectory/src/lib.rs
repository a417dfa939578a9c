//! The trajectory log: per sandbox, a durable, totally ordered record of every call and its
//! result, kept on the node's disk outside every sandbox (`<data>/edge/trajectories/<id>.log`,
//! large outputs by sha256 in `<data>/edge/trajectories/blobs/`).
//!
//! **Owns**: the record format and its file ([`log`]), step ids and fast-forward
//! ([`fastforward`]), the per-node set of logs with group commit and retention ([`store`],
//! [`maintenance`]), content-addressed blobs ([`blobs`]), what a call result keeps in its record
//! ([`recorded`]), filters/export/provenance ([`reader`], [`query`]) and comparing a re-executed
//! call with its record ([`replay`], used by `dsec replay`).
//!
//! **Must not**: know the edge's lifecycle, its `Manager` or its HTTP layer, or decide wire
//! codes and HTTP statuses. A call's error type is the caller's ([`CallError`]); this crate's
//! own failures are [`TrajectoryError`], which the edge maps to the wire in its `error.rs`.
//!
//! Calls with a step id run in a task of their own, so a client that disconnects (a trainer
//! killed mid-call) neither cancels nor loses them: the result is recorded and the restarted
//! client gets it by repeating the step.
//!
//! Other parts of the edge add state changes with one line:
//! `mgr.trajectory().note(id, "pause", json!({..}), Ok(json!({..})))`.

pub mod blobs;
pub mod config;
pub mod error;
pub mod fastforward;
pub mod log;
pub mod maintenance;
pub mod query;
pub mod reader;
pub mod recorded;
pub mod replay;
pub mod store;

#[cfg(test)]
mod tests;

use std::sync::{Mutex, MutexGuard};
use std::time::SystemTime;

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest as _, Sha256};

pub use blobs::BlobStore;
pub use config::TrajectoryConfig;
pub use error::{CallError, TrajectoryError};
pub use log::FsyncPolicy;
pub use query::changed_ns_in_upper;
pub use recorded::{bytes_of, text_and_b64, Content, Outcome, Recorded, Written};
pub use store::{Answer, SandboxLog, Trajectories};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Unix time in milliseconds.
pub fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// A call's request as recorded: the serialized request without `step` and `stream`.
pub fn request_value<T: Serialize>(req: &T) -> Value {
    let mut v = serde_json::to_value(req).unwrap_or(Value::Null);
    if let Some(m) = v.as_object_mut() {
        m.remove("step");
        m.remove("stream");
    }
    v
}
