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

pub use dsec_wire::admin::{
    CreateKeyRequest, CreateProjectRequest, CreatedKey, ProjectList, ProjectView, Quota, Usage,
};

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
