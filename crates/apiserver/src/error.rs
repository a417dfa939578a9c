//! The one place where apiserver errors become HTTP answers.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use dsec_wire::api::{codes, status_for_code, ErrorBody, ErrorDetail};

/// Every error the apiserver itself produces (edge errors pass through unchanged).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("missing or unknown API key; set DSEC_API_KEY or pass --api-key")]
    Unauthorized,
    #[error("sandbox {0:?} not found")]
    SandboxNotFound(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("{0}")]
    NodeUnavailable(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    QuotaExceeded(String),
    /// The sandbox ended (410), e.g. its node was lost.
    #[error("{0}")]
    SandboxDead(String),
    #[error("internal error: {0}")]
    Internal(String),
    /// A port URL token was refused (wrong, expired, for another port).
    #[error("{0}")]
    TokenRefused(String),
    /// Nothing answered on a sandbox port (exposed ports): 502.
    #[error("{0}")]
    PortUnreachable(String),
}

impl ApiError {
    pub fn code(&self) -> &'static str {
        match self {
            ApiError::Unauthorized => codes::UNAUTHORIZED,
            ApiError::SandboxNotFound(_) => codes::SANDBOX_NOT_FOUND,
            ApiError::NotFound(_) => codes::NOT_FOUND,
            ApiError::BadRequest(_) => codes::BAD_REQUEST,
            ApiError::PayloadTooLarge(_) => codes::PAYLOAD_TOO_LARGE,
            ApiError::NodeUnavailable(_) => codes::NODE_UNAVAILABLE,
            ApiError::Conflict(_) => codes::CONFLICT,
            ApiError::Forbidden(_) => codes::FORBIDDEN,
            ApiError::QuotaExceeded(_) => codes::QUOTA_EXCEEDED,
            ApiError::SandboxDead(_) => codes::SANDBOX_DEAD,
            ApiError::Internal(_) => codes::INTERNAL,
            ApiError::TokenRefused(_) => codes::UNAUTHORIZED,
            ApiError::PortUnreachable(_) => codes::PORT_UNREACHABLE,
        }
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code().to_string(),
                message: self.to_string(),
            },
        }
    }
}

impl From<crate::db::DbError> for ApiError {
    fn from(e: crate::db::DbError) -> Self {
        ApiError::Internal(e.to_string())
    }
}

/// Builds an `ErrorBody` answer for `code` with `message`.
pub fn error_response(code: &str, message: impl Into<String>) -> Response {
    let body = ErrorBody {
        error: ErrorDetail {
            code: code.to_string(),
            message: message.into(),
        },
    };
    json_error(status_for_code(code), &body)
}

fn json_error(status: u16, body: &ErrorBody) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let text = serde_json::to_string(body).unwrap_or_else(|_| {
        r#"{"error":{"code":"internal","message":"could not encode error"}}"#.to_string()
    });
    (status, [(header::CONTENT_TYPE, "application/json")], text).into_response()
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if matches!(self, ApiError::Internal(_)) {
            tracing::error!(error = %self, "internal error");
        }
        json_error(status_for_code(self.code()), &self.body())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_statuses() {
        assert_eq!(ApiError::Unauthorized.into_response().status(), 401);
        assert_eq!(
            ApiError::SandboxNotFound("x".into())
                .into_response()
                .status(),
            404
        );
        assert_eq!(
            ApiError::NodeUnavailable("x".into())
                .into_response()
                .status(),
            503
        );
        assert_eq!(
            ApiError::PayloadTooLarge("x".into())
                .into_response()
                .status(),
            413
        );
        assert_eq!(
            ApiError::BadRequest("x".into()).into_response().status(),
            400
        );
    }
}
