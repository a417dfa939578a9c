//! IAM: principals with API keys, a project tree with delegated quotas, and the quota ledger.
//!
//! - Every principal (a person or an agent alike) has a kind (`admin` or `user`) and a home
//!   project; it may create sandboxes in that project and in its descendants.
//! - Projects form a tree under `root`. A quota (concurrent sandboxes, CPU cores, memory,
//!   creations per second; absent = unlimited) is set per project. A child's quota is delegated
//!   from its parent: it can never be set above the parent's, and a create is admitted only
//!   when the project **and every ancestor** have room — so a child never exceeds what its
//!   parent has left, whatever its siblings use.
//! - Usage is kept in the database (SQLite or PostgreSQL, [`crate::store`]) and changed only
//!   inside transactions that lock it (`BEGIN IMMEDIATE`, or `SELECT ... FOR UPDATE` on the
//!   ancestor chain's quota rows; [`ledger`]), so any number of apiserver replicas sharing the
//!   database never over-admit.

pub mod admin;
pub mod http;
pub mod ledger;

use serde::{Deserialize, Serialize};

/// Limits of one project; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Quota {
    #[serde(default)]
    pub max_sandboxes: Option<u64>,
    #[serde(default)]
    pub max_cpu_cores: Option<f64>,
    #[serde(default)]
    pub max_memory_mb: Option<u64>,
    #[serde(default)]
    pub max_creates_per_s: Option<u64>,
}

/// What a project (with its descendants) uses now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Usage {
    pub sandboxes: u64,
    pub cpu_cores: f64,
    pub memory_mb: u64,
}

/// A project as the admin API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ProjectView {
    pub name: String,
    pub parent: Option<String>,
    pub quota: Quota,
    pub usage: Usage,
}

/// `GET /v1/projects`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ProjectList {
    pub projects: Vec<ProjectView>,
}

/// `POST /v1/projects`.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateProjectRequest {
    pub name: String,
    /// Parent project (default `root`).
    #[serde(default)]
    pub parent: Option<String>,
    #[serde(default)]
    pub quota: Option<Quota>,
}

/// `POST /v1/keys`: a key for a (new or existing) principal.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateKeyRequest {
    /// Principal name; created when it does not exist.
    pub principal: String,
    /// Home project of a new principal (default `default`).
    #[serde(default)]
    pub project: Option<String>,
    /// `user` (default) or `admin`.
    #[serde(default)]
    pub kind: Option<String>,
}

/// Answer of `POST /v1/keys`: the only time the plaintext key exists outside its holder.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct CreatedKey {
    pub principal: String,
    pub project: String,
    pub kind: String,
    /// Public id of the key (first 16 hex characters of its hash), for `revoke`.
    pub key_id: String,
    pub key: String,
}

/// Why an IAM operation was refused.
#[derive(Debug, thiserror::Error)]
pub enum IamError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    QuotaExceeded(String),
    #[error(transparent)]
    Db(#[from] crate::db::DbError),
}

impl From<rusqlite::Error> for IamError {
    fn from(e: rusqlite::Error) -> Self {
        IamError::Db(crate::db::DbError::Sql(e))
    }
}

impl From<postgres::Error> for IamError {
    fn from(e: postgres::Error) -> Self {
        IamError::Db(crate::db::DbError::Pg(e))
    }
}

impl From<IamError> for crate::error::ApiError {
    fn from(e: IamError) -> Self {
        use crate::error::ApiError;
        match e {
            IamError::NotFound(m) => ApiError::NotFound(m),
            IamError::Invalid(m) => ApiError::BadRequest(m),
            IamError::Conflict(m) => ApiError::Conflict(m),
            IamError::Forbidden(m) => ApiError::Forbidden(m),
            IamError::QuotaExceeded(m) => ApiError::QuotaExceeded(m),
            IamError::Db(e) => ApiError::Internal(e.to_string()),
        }
    }
}

/// Project names: `[a-z0-9][a-z0-9-]{0,62}`.
pub fn valid_project_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// CPU is accounted in thousandths of a core so sums stay exact.
pub fn cpu_milli(cores: f64) -> i64 {
    (cores * 1000.0).round() as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_project_name("team-a"));
        assert!(!valid_project_name("-a"));
        assert!(!valid_project_name("A"));
        assert!(!valid_project_name(""));
        assert_eq!(cpu_milli(0.5), 500);
    }
}
