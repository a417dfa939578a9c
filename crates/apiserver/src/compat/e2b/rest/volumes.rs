//! `/volumes`: dsec has no volumes in this build, so every volume call answers a clear 501
//! (E2B's shape) instead of pretending.

use axum::http::Uri;

use super::errors::E2bError;

/// Every `/volumes` route.
pub async fn unsupported(uri: Uri) -> E2bError {
    E2bError::unsupported(&format!("volumes ({})", uri.path()))
}
