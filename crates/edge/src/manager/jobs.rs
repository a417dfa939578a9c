//! Job operations: pause, resume or stop every sandbox whose labels match a selector.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use dsec_wire::api::{ErrorDetail, JobOpFailure, JobOpResult, LabelSelector};

use crate::error::EdgeError;

use super::{lock, now_ms, End, Entry, Manager};

/// A job operation on every sandbox matching a label selector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobOp {
    Pause,
    Resume,
    Stop,
}

impl JobOp {
    pub fn parse(s: &str) -> Option<JobOp> {
        match s {
            "pause" => Some(JobOp::Pause),
            "resume" => Some(JobOp::Resume),
            "stop" => Some(JobOp::Stop),
            _ => None,
        }
    }
}

/// True when `labels` has every key/value of `selector` (an empty selector matches nothing).
pub fn labels_match(
    labels: &std::collections::BTreeMap<String, String>,
    selector: &std::collections::BTreeMap<String, String>,
) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

impl Manager {
    /// Pauses, resumes or stops every sandbox whose labels match the selector.
    pub async fn job_op(&self, op: JobOp, sel: &LabelSelector) -> Result<JobOpResult, EdgeError> {
        if sel.labels.is_empty() {
            return Err(EdgeError::BadRequest(
                "labels must name at least one label (an empty selector would match every sandbox)"
                    .into(),
            ));
        }
        let started = Instant::now();
        let matched: Vec<Arc<Entry>> = lock(&self.state)
            .live
            .values()
            .filter(|e| labels_match(&lock(&e.info).labels, &sel.labels))
            .cloned()
            .collect();
        let mut out = JobOpResult {
            matched: matched.len() as u64,
            sandboxes: matched.iter().map(|e| e.id.clone()).collect(),
            ..Default::default()
        };
        use futures::StreamExt as _;
        let results: Vec<(String, Result<(), EdgeError>)> =
            futures::stream::iter(matched.into_iter().map(|e| async move {
                let r = match op {
                    JobOp::Pause => self.pause_entry(&e).await,
                    JobOp::Resume => {
                        e.last_request_ms.store(now_ms(), Ordering::SeqCst);
                        self.resume_entry(&e).await
                    }
                    JobOp::Stop => {
                        self.finish(&e, End::Stopped("stopped by a job operation".into()))
                            .await;
                        Ok(())
                    }
                };
                (e.id.clone(), r)
            }))
            .buffer_unordered(64)
            .collect()
            .await;
        for (id, r) in results {
            match r {
                Ok(()) => out.succeeded += 1,
                Err(err) => out.failed.push(JobOpFailure {
                    id,
                    error: ErrorDetail {
                        code: err.code().to_string(),
                        message: err.to_string(),
                    },
                }),
            }
        }
        out.sandboxes.sort();
        out.duration_ms = started.elapsed().as_secs_f64() * 1000.0;
        Ok(out)
    }
}
