//! The edge's error type and the ONE place errors become HTTP answers.
//!
//! Every manager method returns [`EdgeError`]; each variant has a stable wire code
//! ([`dsec_wire::api::codes`]) and a message that tells the caller what to fix. User errors are
//! 4xx; internal ones are 5xx and logged with their chain.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use dsec_functions::FunctionError;
use dsec_image::ImageError;
use dsec_network::NetError;
use dsec_runtime::aether_client::ChannelError;
use dsec_runtime::error::PauseError;
use dsec_runtime::qos::ApplyQosError;
use dsec_runtime::substrate::{CreateSandboxError, ResolveImageError, WritableLayerError};
use dsec_trajectory::{CallError, TrajectoryError};
use dsec_wire::aether::{AetherError, AetherErrorKind};
use dsec_wire::api::{codes, limits, status_for_code, ErrorBody, ErrorDetail};

/// Anything an edge operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Unauthorized(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("sandbox {0} not found on this node")]
    SandboxNotFound(String),
    #[error("{0}")]
    ImageNotFound(String),
    #[error("{0}")]
    FileNotFound(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    NodeFull(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    SandboxDead(String),
    #[error("{0}")]
    SandboxBusy(String),
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Internal(String),
    /// Nothing answers on a sandbox port (exposed ports): 502.
    #[error("{0}")]
    PortUnreachable(String),

    // The errors of the crates below, typed; [`EdgeError::code`] maps each to its wire code.
    /// The image store failed (a missing or malformed image is the caller's).
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The substrate could not create the sandbox (an invalid spec is the caller's).
    #[error(transparent)]
    Create(#[from] CreateSandboxError),
    /// The node's network failed (a full address range makes the node full).
    #[error(transparent)]
    Network(NetError),
    /// A recorded trajectory log could not be read or written.
    #[error(transparent)]
    Trajectory(TrajectoryError),
    #[error("{op}: {source}")]
    Pause {
        op: &'static str,
        #[source]
        source: PauseError,
    },
    #[error("apply QoS class {class:?}: {source}")]
    Qos {
        class: dsec_wire::api::QosClass,
        #[source]
        source: ApplyQosError,
    },
    #[error("{context} of {sandbox}: {source}")]
    WritableLayer {
        context: &'static str,
        sandbox: String,
        #[source]
        source: WritableLayerError,
    },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// The channel to a sandbox's agent failed (other than closing: that is `SandboxDead`).
    #[error("sandbox {sandbox}: {source}")]
    Channel {
        sandbox: String,
        #[source]
        source: ChannelError,
    },
    /// The sandbox's agent failed a request on its side.
    #[error("sandbox agent: {}", .0.message)]
    Agent(AetherError),
    /// A download from the sandbox could not be read to the end.
    #[error("read failed: {0}")]
    BodyRead(#[source] std::io::Error),
    /// A sandbox's record could not be persisted.
    #[error(transparent)]
    Record(#[from] crate::records::RecordError),
    /// A create failed and undoing what it built failed too.
    #[error("{error}; cleanup also failed: {problems}")]
    CleanupFailed {
        error: Box<EdgeError>,
        problems: String,
    },
}

/// The trajectory log's failures on the wire: a bad id or a relative path is the caller's
/// mistake (400), a missing log or blob 404, a reused step 409, a recorded failure answers
/// with its original code; the rest is internal.
impl From<TrajectoryError> for EdgeError {
    fn from(e: TrajectoryError) -> Self {
        match e {
            TrajectoryError::BadSandboxId(_) | TrajectoryError::RelativePath(_) => {
                EdgeError::BadRequest(e.to_string())
            }
            TrajectoryError::SandboxNotFound(id) => EdgeError::SandboxNotFound(id),
            TrajectoryError::NoLog(_) | TrajectoryError::BlobNotReferenced { .. } => {
                EdgeError::NotFound(e.to_string())
            }
            TrajectoryError::StepConflict { .. } => EdgeError::Conflict(e.to_string()),
            TrajectoryError::Recorded(d) => EdgeError::from_detail(&d),
            TrajectoryError::Io { .. }
            | TrajectoryError::StepLost { .. }
            | TrajectoryError::StepTask { .. }
            | TrajectoryError::BadDigest(_)
            | TrajectoryError::DamagedBlob(_)
            | TrajectoryError::UnreadableResult { .. }
            | TrajectoryError::UnreadableContent { .. } => EdgeError::Trajectory(e),
        }
    }
}

impl CallError for EdgeError {
    fn detail(&self) -> ErrorDetail {
        EdgeError::detail(self)
    }
}

/// What an aether error was about, so `NotFound` maps to the right code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subject {
    File,
    Session,
    Other,
}

impl EdgeError {
    /// Stable wire code: the one place every error, the typed ones of the crates below
    /// included, gets its code (and so its HTTP status, [`status_for_code`]).
    pub fn code(&self) -> &'static str {
        match self {
            EdgeError::Image(e) => match e {
                ImageError::NotFound(_) => codes::IMAGE_NOT_FOUND,
                ImageError::InvalidName(_) | ImageError::Import { .. } => codes::BAD_REQUEST,
                ImageError::InUse { .. } => codes::CONFLICT,
                _ => codes::INTERNAL,
            },
            EdgeError::Create(e) => match e {
                CreateSandboxError::InvalidSpec(_) => codes::BAD_REQUEST,
                _ => codes::INTERNAL,
            },
            EdgeError::Network(e) => match e {
                NetError::Policy(_) => codes::BAD_REQUEST,
                NetError::InUse(_) => codes::NODE_UNAVAILABLE,
                NetError::Exhausted(_) => codes::NODE_FULL,
                _ => codes::INTERNAL,
            },
            EdgeError::Trajectory(_)
            | EdgeError::Pause { .. }
            | EdgeError::Qos { .. }
            | EdgeError::WritableLayer { .. }
            | EdgeError::Io { .. }
            | EdgeError::Channel { .. }
            | EdgeError::Agent(_)
            | EdgeError::BodyRead(_)
            | EdgeError::Record(_)
            | EdgeError::CleanupFailed { .. } => codes::INTERNAL,
            EdgeError::BadRequest(_) => codes::BAD_REQUEST,
            EdgeError::Unauthorized(_) => codes::UNAUTHORIZED,
            EdgeError::Forbidden(_) => codes::FORBIDDEN,
            EdgeError::SandboxNotFound(_) => codes::SANDBOX_NOT_FOUND,
            EdgeError::ImageNotFound(_) => codes::IMAGE_NOT_FOUND,
            EdgeError::FileNotFound(_) => codes::FILE_NOT_FOUND,
            EdgeError::NotFound(_) => codes::NOT_FOUND,
            EdgeError::Conflict(_) => codes::CONFLICT,
            EdgeError::PayloadTooLarge(_) => codes::PAYLOAD_TOO_LARGE,
            EdgeError::NodeFull(_) => codes::NODE_FULL,
            EdgeError::Unavailable(_) => codes::NODE_UNAVAILABLE,
            EdgeError::SandboxDead(_) => codes::SANDBOX_DEAD,
            EdgeError::SandboxBusy(_) => codes::SANDBOX_BUSY,
            EdgeError::Unsupported(_) => codes::UNSUPPORTED,
            EdgeError::Internal(_) => codes::INTERNAL,
            EdgeError::PortUnreachable(_) => codes::PORT_UNREACHABLE,
        }
    }

    /// HTTP status of the answer.
    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(status_for_code(self.code()))
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// The wire form (also used for `StreamEvent::Error`): an internal error's message has its
    /// whole source chain.
    pub fn detail(&self) -> ErrorDetail {
        let mut message = self.to_string();
        if self.status().is_server_error() {
            let mut src = std::error::Error::source(self);
            while let Some(s) = src {
                let part = s.to_string();
                if !message.contains(&part) {
                    message.push_str(": ");
                    message.push_str(&part);
                }
                src = s.source();
            }
        }
        ErrorDetail {
            code: self.code().to_string(),
            message,
        }
    }

    /// The edge error a recorded error detail stands for (a replayed failure answers the same).
    pub fn from_detail(d: &ErrorDetail) -> Self {
        let m = d.message.clone();
        match d.code.as_str() {
            codes::BAD_REQUEST => EdgeError::BadRequest(m),
            codes::FORBIDDEN => EdgeError::Forbidden(m),
            codes::FILE_NOT_FOUND => EdgeError::FileNotFound(m),
            codes::SANDBOX_NOT_FOUND | codes::NOT_FOUND => EdgeError::NotFound(m),
            codes::CONFLICT => EdgeError::Conflict(m),
            codes::PAYLOAD_TOO_LARGE => EdgeError::PayloadTooLarge(m),
            codes::SANDBOX_DEAD => EdgeError::SandboxDead(m),
            codes::UNSUPPORTED => EdgeError::Unsupported(m),
            _ => EdgeError::Internal(m),
        }
    }

    /// An internal error with its whole source chain in the message.
    pub fn internal(context: &str, err: &(dyn std::error::Error + 'static)) -> Self {
        let mut msg = format!("{context}: {err}");
        let mut src = err.source();
        while let Some(s) = src {
            msg.push_str(&format!(": {s}"));
            src = s.source();
        }
        EdgeError::Internal(msg)
    }

    /// Maps an error of a call on a sandbox's channel.
    pub fn from_channel(sandbox: &str, subject: Subject, err: ChannelError) -> Self {
        match err {
            ChannelError::Closed => EdgeError::SandboxDead(format!(
                "sandbox {sandbox} is gone: the channel to its agent closed (it was stopped or died)"
            )),
            ChannelError::Aether(e) => Self::from_aether(subject, e),
            source => EdgeError::Channel {
                sandbox: sandbox.to_string(),
                source,
            },
        }
    }

    /// Maps an `Error` reply from aether.
    pub fn from_aether(subject: Subject, e: AetherError) -> Self {
        match e.kind {
            AetherErrorKind::BadRequest | AetherErrorKind::WrongKind => {
                EdgeError::BadRequest(e.message)
            }
            AetherErrorKind::NotFound => match subject {
                Subject::File => EdgeError::FileNotFound(e.message),
                Subject::Session | Subject::Other => EdgeError::NotFound(e.message),
            },
            AetherErrorKind::PermissionDenied => EdgeError::Forbidden(e.message),
            AetherErrorKind::Setup | AetherErrorKind::Internal => EdgeError::Agent(e),
            AetherErrorKind::Busy => EdgeError::SandboxBusy(e.message),
        }
    }

    /// Maps a disk image lookup error (a malformed name is the user's; a missing image too).
    pub fn from_resolve_image(err: ResolveImageError) -> Self {
        match err {
            ResolveImageError::InvalidName(m) => EdgeError::BadRequest(m),
            ResolveImageError::NotFound(m) => EdgeError::ImageNotFound(m),
        }
    }
}

/// Network errors: a policy the user got wrong is a bad request (its message without the
/// `network policy:` prefix), another edge holding the host's network names makes this node
/// unavailable; the rest stays typed ([`EdgeError::code`]: a full subnet makes the node full,
/// a tool or the DNS proxy failing is internal).
impl From<NetError> for EdgeError {
    fn from(e: NetError) -> Self {
        match e {
            NetError::Policy(p) => EdgeError::BadRequest(p.to_string()),
            NetError::InUse(m) => EdgeError::Unavailable(m),
            other => EdgeError::Network(other),
        }
    }
}

impl IntoResponse for EdgeError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(code = self.code(), error = %self, "request failed");
        } else {
            tracing::debug!(code = self.code(), error = %self, "request rejected");
        }
        (
            status,
            axum::Json(ErrorBody {
                error: self.detail(),
            }),
        )
            .into_response()
    }
}

impl From<JsonRejection> for EdgeError {
    fn from(r: JsonRejection) -> Self {
        match r {
            JsonRejection::BytesRejection(b) if b.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                EdgeError::PayloadTooLarge(format!(
                    "request body is larger than the {} bytes allowed for JSON requests",
                    limits::MAX_JSON_BODY
                ))
            }
            JsonRejection::MissingJsonContentType(_) => EdgeError::BadRequest(
                "expected a JSON body: set `content-type: application/json`".to_string(),
            ),
            other => EdgeError::BadRequest(other.body_text()),
        }
    }
}

impl From<PathRejection> for EdgeError {
    fn from(r: PathRejection) -> Self {
        EdgeError::BadRequest(r.body_text())
    }
}

impl From<QueryRejection> for EdgeError {
    fn from(r: QueryRejection) -> Self {
        EdgeError::BadRequest(r.body_text())
    }
}

/// How a [`FunctionError`] becomes an answer: a full queue is 429 with `Retry-After` and the
/// retry hint in the body; the rest answer as the matching [`EdgeError`].
pub fn function_error_response(e: FunctionError) -> Response {
    match e {
        FunctionError::QueueFull {
            message,
            retry_after_s,
        } => {
            let body = serde_json::json!({
                "error": {"code": dsec_wire::api::codes::QUOTA_EXCEEDED, "message": message},
                "retry_after_s": retry_after_s,
            });
            let mut resp = (StatusCode::TOO_MANY_REQUESTS, axum::Json(body)).into_response();
            if let Ok(v) = axum::http::HeaderValue::from_str(&retry_after_s.to_string()) {
                resp.headers_mut()
                    .insert(axum::http::header::RETRY_AFTER, v);
            }
            resp
        }
        FunctionError::BadRequest(m) => EdgeError::BadRequest(m).into_response(),
        FunctionError::Image(e) => EdgeError::Image(e).into_response(),
        FunctionError::Worker(m) => {
            tracing::error!(error = %m, "function worker");
            EdgeError::Internal(m).into_response()
        }
        FunctionError::Unavailable(m) => EdgeError::Unavailable(m).into_response(),
        e @ FunctionError::Disabled => EdgeError::Unsupported(e.to_string()).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_network::PolicyError;

    #[test]
    fn codes_map_to_statuses() {
        let cases = [
            (EdgeError::BadRequest("x".into()), 400),
            (EdgeError::Unauthorized("x".into()), 401),
            (EdgeError::Forbidden("x".into()), 403),
            (EdgeError::SandboxNotFound("sb".into()), 404),
            (EdgeError::ImageNotFound("x".into()), 404),
            (EdgeError::FileNotFound("x".into()), 404),
            (EdgeError::Conflict("x".into()), 409),
            (EdgeError::SandboxDead("x".into()), 410),
            (EdgeError::PayloadTooLarge("x".into()), 413),
            (EdgeError::Unsupported("x".into()), 501),
            (EdgeError::NodeFull("x".into()), 503),
            (EdgeError::Internal("x".into()), 500),
        ];
        for (e, status) in cases {
            assert_eq!(e.status().as_u16(), status, "{e:?}");
        }
    }

    #[test]
    fn aether_errors_by_subject() {
        let nf = AetherError {
            kind: AetherErrorKind::NotFound,
            message: "no such file: /x".into(),
        };
        assert_eq!(
            EdgeError::from_aether(Subject::File, nf.clone()).code(),
            codes::FILE_NOT_FOUND
        );
        assert_eq!(
            EdgeError::from_aether(Subject::Session, nf).code(),
            codes::NOT_FOUND
        );
        let pd = AetherError {
            kind: AetherErrorKind::PermissionDenied,
            message: "denied".into(),
        };
        assert_eq!(
            EdgeError::from_aether(Subject::File, pd).code(),
            codes::FORBIDDEN
        );
        let closed = EdgeError::from_channel(
            "sb-n0-0000000000000001",
            Subject::Other,
            ChannelError::Closed,
        );
        assert_eq!(closed.code(), codes::SANDBOX_DEAD);
    }

    #[test]
    fn busy_agent_is_retryable() {
        let busy = AetherError {
            kind: AetherErrorKind::Busy,
            message: "the sandbox is at its process limit; kill processes or retry".into(),
        };
        let e = EdgeError::from_aether(Subject::File, busy);
        assert_eq!(e.code(), codes::SANDBOX_BUSY);
        assert_eq!(e.status().as_u16(), 503);
        assert!(e.to_string().contains("process limit"));
    }

    #[test]
    fn image_errors() {
        let e = EdgeError::from(ImageError::NotFound("nope".into()));
        assert_eq!(e.code(), codes::IMAGE_NOT_FOUND);
        assert!(e.to_string().contains("nope") && e.to_string().contains("import"));
        let e = EdgeError::from(ImageError::InUse {
            name: "a".into(),
            users: 2,
        });
        assert_eq!(e.status().as_u16(), 409);
    }

    #[test]
    fn network_errors() {
        let e = EdgeError::from(NetError::Policy(PolicyError::Protocol("sctp".into())));
        assert_eq!((e.code(), e.status().as_u16()), (codes::BAD_REQUEST, 400));
        assert_eq!(
            e.to_string(),
            "protocol \"sctp\" must be tcp, udp, icmp or any"
        );
        let e = EdgeError::from(NetError::InUse("held by pid 7".into()));
        assert_eq!(
            (e.code(), e.to_string().as_str()),
            (codes::NODE_UNAVAILABLE, "held by pid 7")
        );
        let e = EdgeError::from(NetError::Exhausted("10.201.0.0/16".into()));
        assert_eq!(e.code(), codes::NODE_FULL);
        assert_eq!(e.status().as_u16(), 503);
        assert_eq!(
            e.to_string(),
            "no free sandbox address left in 10.201.0.0/16"
        );
        let e = EdgeError::from(NetError::Tool {
            tool: "nft",
            message: "Operation not permitted".into(),
        });
        assert_eq!((e.code(), e.status().as_u16()), (codes::INTERNAL, 500));
        assert_eq!(e.to_string(), "nft: Operation not permitted");
    }

    #[test]
    fn internal_keeps_the_chain() {
        let io = std::io::Error::other("disk on fire");
        let e = EdgeError::internal("write record", &io);
        assert!(e.to_string().contains("write record: disk on fire"));
    }
}
