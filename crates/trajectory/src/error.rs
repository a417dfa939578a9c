//! What the trajectory log can fail with, and what it needs of a call's own error.

use dsec_wire::api::ErrorDetail;

/// A failure of the trajectory log itself (the edge maps each variant to a wire code in its
/// `error.rs`).
#[derive(Debug, thiserror::Error)]
pub enum TrajectoryError {
    /// `begin` on an id that is not a sandbox id (a user error).
    #[error("bad sandbox id {0:?}")]
    BadSandboxId(String),
    /// A read of a log under an id that cannot be a sandbox's.
    #[error("sandbox {0} not found on this node")]
    SandboxNotFound(String),
    /// The sandbox keeps no log here.
    #[error(
        "sandbox {0} has no trajectory log on this node (created with trajectory: false, \
         unknown, or its log passed the retention period)"
    )]
    NoLog(String),
    /// A blob not referenced by the sandbox's log.
    #[error("no record of sandbox {sandbox} keeps a blob {digest}")]
    BlobNotReferenced { sandbox: String, digest: String },
    /// A provenance query with a relative path (a user error).
    #[error("path {0:?} must be absolute")]
    RelativePath(String),
    /// A step id reused with another request, or the like (see [`crate::fastforward`]).
    #[error("sandbox {sandbox}: {reason}")]
    StepConflict { sandbox: String, reason: String },
    /// A step being waited for ended without a result.
    #[error("step {step} of sandbox {sandbox} ended without a result")]
    StepLost { sandbox: String, step: u64 },
    /// The task running a stepped call panicked or was cancelled.
    #[error("step {step} task failed: {reason}")]
    StepTask { step: u64, reason: String },
    /// Reading or writing a log, a blob or their directory.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A blob name that is not a sha256 digest.
    #[error("bad blob digest {0:?}")]
    BadDigest(String),
    /// A blob whose content does not hash to its name.
    #[error("trajectory blob {0} does not match its digest (damaged on disk)")]
    DamagedBlob(String),
    /// A record whose result cannot be read back as the call's answer.
    #[error("trajectory record {seq} ({kind}) has an unreadable result: {reason}")]
    UnreadableResult {
        seq: u64,
        kind: String,
        reason: String,
    },
    /// A recorded file content that is not valid base64.
    #[error("record {seq}: content_b64: {reason}")]
    UnreadableContent { seq: u64, reason: String },
    /// A call that failed when it ran, answered again from its record: the original code and
    /// message.
    #[error("{}", .0.message)]
    Recorded(ErrorDetail),
}

impl TrajectoryError {
    pub(crate) fn io(
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        TrajectoryError::Io {
            context: context.into(),
            source: source.into(),
        }
    }
}

/// The error type of the calls run through the log (the edge's error): it is recorded as a
/// wire [`ErrorDetail`], and the log's own failures convert into it.
pub trait CallError: From<TrajectoryError> + Send + Sync + 'static {
    /// The wire code and message this error is recorded (and answered again) with.
    fn detail(&self) -> ErrorDetail;
}
