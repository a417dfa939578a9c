//! Errors: the error body every server answers with, the stable codes and their HTTP statuses.

use serde::{Deserialize, Serialize};

/// Every error answer: `{"error": {"code": "...", "message": "..."}}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    /// Stable machine-readable code, one of [`ErrorCode`] (kept a string on the wire so that a
    /// client reading a code it does not know yet still gets the message).
    #[cfg_attr(feature = "openapi", schema(value_type = ErrorCode))]
    pub code: String,
    /// What was wrong and what to do about it.
    pub message: String,
}

/// Every stable error code. 4xx codes mean the caller must fix something, 5xx the server side
/// (or the node) failed; [`ErrorCode::status`] gives the HTTP status of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 400: the request is malformed or a value is out of range.
    BadRequest,
    /// 401: no API key, or not a valid one.
    Unauthorized,
    /// 403: the key may not do this (e.g. admin routes).
    Forbidden,
    /// 404: no such sandbox.
    SandboxNotFound,
    /// 404: no such image.
    ImageNotFound,
    /// 404: no such file inside the sandbox.
    FileNotFound,
    /// 404: no such route or resource.
    NotFound,
    /// 409: the resource is in the wrong state (image in use, sandbox not running, step reused
    /// with another request, ...).
    Conflict,
    /// 413: the body is over the size limit.
    PayloadTooLarge,
    /// 429: a project quota (count, CPU, memory, creation rate) would be exceeded.
    QuotaExceeded,
    /// 503: no node has room for the sandbox; retry later.
    NodeFull,
    /// 503: the node owning the sandbox does not answer.
    NodeUnavailable,
    /// 503: the sandbox is at its process limit; retry.
    SandboxBusy,
    /// 410: the sandbox died (its reason is in the sandbox's `reason`).
    SandboxDead,
    /// 501: the substrate or node does not support this operation.
    Unsupported,
    /// 500: a server-side failure (logged with its cause).
    Internal,
    /// 502: nothing answers on the sandbox port a request was sent to (exposed ports).
    PortUnreachable,
}

impl ErrorCode {
    /// Every code, in the order of the enum.
    pub const ALL: [ErrorCode; 17] = [
        ErrorCode::BadRequest,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::SandboxNotFound,
        ErrorCode::ImageNotFound,
        ErrorCode::FileNotFound,
        ErrorCode::NotFound,
        ErrorCode::Conflict,
        ErrorCode::PayloadTooLarge,
        ErrorCode::QuotaExceeded,
        ErrorCode::NodeFull,
        ErrorCode::NodeUnavailable,
        ErrorCode::SandboxBusy,
        ErrorCode::SandboxDead,
        ErrorCode::Unsupported,
        ErrorCode::Internal,
        ErrorCode::PortUnreachable,
    ];

    /// The code as it appears in [`ErrorDetail::code`].
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::SandboxNotFound => "sandbox_not_found",
            ErrorCode::ImageNotFound => "image_not_found",
            ErrorCode::FileNotFound => "file_not_found",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::QuotaExceeded => "quota_exceeded",
            ErrorCode::NodeFull => "node_full",
            ErrorCode::NodeUnavailable => "node_unavailable",
            ErrorCode::SandboxBusy => "sandbox_busy",
            ErrorCode::SandboxDead => "sandbox_dead",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::Internal => "internal",
            ErrorCode::PortUnreachable => "port_unreachable",
        }
    }

    /// The HTTP status answered with this code.
    pub const fn status(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::SandboxNotFound
            | ErrorCode::ImageNotFound
            | ErrorCode::FileNotFound
            | ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::SandboxDead => 410,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::QuotaExceeded => 429,
            ErrorCode::Unsupported => 501,
            ErrorCode::NodeFull | ErrorCode::NodeUnavailable | ErrorCode::SandboxBusy => 503,
            ErrorCode::Internal => 500,
            ErrorCode::PortUnreachable => 502,
        }
    }

    /// The code named `code`, if it is one.
    pub fn parse(code: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|c| c.as_str() == code)
    }
}

/// Stable error codes as strings (the values of [`ErrorCode`]).
pub mod codes {
    use super::ErrorCode;

    pub const BAD_REQUEST: &str = ErrorCode::BadRequest.as_str();
    pub const UNAUTHORIZED: &str = ErrorCode::Unauthorized.as_str();
    pub const FORBIDDEN: &str = ErrorCode::Forbidden.as_str();
    pub const SANDBOX_NOT_FOUND: &str = ErrorCode::SandboxNotFound.as_str();
    pub const IMAGE_NOT_FOUND: &str = ErrorCode::ImageNotFound.as_str();
    pub const FILE_NOT_FOUND: &str = ErrorCode::FileNotFound.as_str();
    pub const NOT_FOUND: &str = ErrorCode::NotFound.as_str();
    pub const CONFLICT: &str = ErrorCode::Conflict.as_str();
    pub const PAYLOAD_TOO_LARGE: &str = ErrorCode::PayloadTooLarge.as_str();
    pub const QUOTA_EXCEEDED: &str = ErrorCode::QuotaExceeded.as_str();
    pub const NODE_FULL: &str = ErrorCode::NodeFull.as_str();
    pub const NODE_UNAVAILABLE: &str = ErrorCode::NodeUnavailable.as_str();
    pub const SANDBOX_BUSY: &str = ErrorCode::SandboxBusy.as_str();
    pub const SANDBOX_DEAD: &str = ErrorCode::SandboxDead.as_str();
    pub const UNSUPPORTED: &str = ErrorCode::Unsupported.as_str();
    pub const INTERNAL: &str = ErrorCode::Internal.as_str();
    pub const PORT_UNREACHABLE: &str = ErrorCode::PortUnreachable.as_str();
}

/// Maps an error code to its HTTP status (500 for a code this build does not know).
pub fn status_for_code(code: &str) -> u16 {
    ErrorCode::parse(code).map_or(500, ErrorCode::status)
}
