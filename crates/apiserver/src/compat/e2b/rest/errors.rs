//! E2B-shaped errors: `{"code": <HTTP status>, "message": "..."}`, the one place dsec errors
//! become them.
//!
//! The SDK maps the status to its exceptions: 401 `AuthenticationException`, 429
//! `RateLimitException`, 503 `ServiceBusyException`, 404 `NotFoundException` /
//! `SandboxNotFoundException` (per call), anything else `SandboxException` with the message.
//! dsec's 410 (`sandbox_dead`) is E2B's 404: to an E2B client an ended sandbox does not exist.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use dsec_wire::api::{status_for_code, ErrorBody};

use crate::error::ApiError;

/// An error answered in E2B's shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{status}: {message}")]
pub struct E2bError {
    pub status: StatusCode,
    pub message: String,
}

impl E2bError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        E2bError {
            status,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    /// An E2B feature dsec does not have (501, named so the caller knows what to drop).
    pub fn unsupported(what: &str) -> Self {
        Self::new(
            StatusCode::NOT_IMPLEMENTED,
            format!("{what} is not supported by dsec's E2B-compatible API (see the README section \"Using the E2B SDK\")"),
        )
    }

    /// From a dsec error body and its status (an edge's or the apiserver's answer).
    pub fn from_dsec(status: StatusCode, body: &[u8]) -> Self {
        let message = serde_json::from_slice::<ErrorBody>(body)
            .map(|b| b.error.message)
            .unwrap_or_else(|_| String::from_utf8_lossy(body).trim().to_string());
        let status = if status == StatusCode::GONE {
            StatusCode::NOT_FOUND
        } else {
            status
        };
        let message = if message.is_empty() {
            status.canonical_reason().unwrap_or("error").to_string()
        } else {
            message
        };
        E2bError { status, message }
    }
}

impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> Self {
        if matches!(e, ApiError::Internal(_)) {
            tracing::error!(error = %e, "internal error (e2b)");
        }
        let status = StatusCode::from_u16(status_for_code(e.code()))
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let message = match e {
            ApiError::Unauthorized => {
                "missing or unknown API key: set E2B_API_KEY to a dsec API key (dsk_...)".into()
            }
            other => other.to_string(),
        };
        E2bError::from_dsec(status, message.as_bytes())
    }
}

/// The E2B error answer.
pub fn e2b_error(status: StatusCode, message: impl Into<String>) -> Response {
    let body = serde_json::json!({"code": status.as_u16(), "message": message.into()});
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        e2b_error(self.status, self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dsec_bodies_become_e2b_errors() {
        let e = E2bError::from_dsec(
            StatusCode::NOT_FOUND,
            br#"{"error":{"code":"sandbox_not_found","message":"sandbox \"x\" not found"}}"#,
        );
        assert_eq!(e.status, 404);
        assert_eq!(e.message, "sandbox \"x\" not found");
        assert_eq!(E2bError::from_dsec(StatusCode::GONE, b"gone").status, 404);
        assert_eq!(
            E2bError::from_dsec(StatusCode::BAD_GATEWAY, b"").message,
            "Bad Gateway"
        );
        let e: E2bError = ApiError::Unauthorized.into();
        assert_eq!(e.status, 401);
        assert!(e.message.contains("E2B_API_KEY"), "{}", e.message);
        let e: E2bError = ApiError::QuotaExceeded("over".into()).into();
        assert_eq!(e.status, 429);
        assert_eq!(e.message, "over");
    }
}
