//! The IAM database: principals, API keys (sha256 only), projects, quotas, usage and
//! idempotency keys, on SQLite (default) or PostgreSQL ([`crate::store`]).
//!
//! The schema is shaped for the cluster issue (hierarchical projects, per-principal keys,
//! revocation); a fresh database has one `admin` principal and one `default` project.

use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::p;
use crate::store::{Conn, Target};

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("open IAM database {path}: {source}")]
    Open {
        path: String,
        source: rusqlite::Error,
    },
    #[error("connect to IAM database {url}: {source}")]
    OpenPg {
        url: String,
        source: postgres::Error,
    },
    #[error("IAM database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("IAM database (PostgreSQL): {0}")]
    Pg(#[from] postgres::Error),
    #[error("IAM database: unexpected value: {0}")]
    Type(String),
    #[error("IAM database task failed: {0}")]
    Join(String),
}

impl DbError {
    /// The connection to the server broke (I/O error, closed, connection exception `08…`, or
    /// the server ended the session `57P0…`): the connection must be replaced. The failed
    /// transaction is not run again (its commit may have reached the server).
    pub fn is_connection_lost(&self) -> bool {
        match self {
            DbError::Pg(e) => match e.code() {
                None => true,
                Some(c) => c.code().starts_with("08") || c.code().starts_with("57P0"),
            },
            _ => false,
        }
    }

    /// A transient conflict between concurrent transactions (PostgreSQL deadlock,
    /// serialization failure, or a unique key taken by a concurrent insert; SQLite busy):
    /// running the transaction again is safe and expected to succeed.
    pub fn is_retryable(&self) -> bool {
        use postgres::error::SqlState;
        match self {
            DbError::Pg(e) => e.code().is_some_and(|c| {
                *c == SqlState::T_R_DEADLOCK_DETECTED
                    || *c == SqlState::T_R_SERIALIZATION_FAILURE
                    || *c == SqlState::UNIQUE_VIOLATION
            }),
            DbError::Sql(rusqlite::Error::SqliteFailure(e, _)) => {
                e.code == rusqlite::ErrorCode::DatabaseBusy
            }
            _ => false,
        }
    }
}

const SCHEMA_SQLITE: &str = "
CREATE TABLE IF NOT EXISTS principals (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_hash TEXT PRIMARY KEY,
    principal_id TEXT NOT NULL REFERENCES principals(id),
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
);
CREATE TABLE IF NOT EXISTS projects (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    parent_id TEXT REFERENCES projects(id)
);
-- Quota (NULL: unlimited) and usage of a project (usage includes every descendant's).
CREATE TABLE IF NOT EXISTS quotas (
    project_id TEXT PRIMARY KEY REFERENCES projects(id),
    max_sandboxes INTEGER,
    max_cpu_milli INTEGER,
    max_memory_mb INTEGER,
    max_creates_per_s INTEGER,
    used_sandboxes INTEGER NOT NULL DEFAULT 0,
    used_cpu_milli INTEGER NOT NULL DEFAULT 0,
    used_memory_mb INTEGER NOT NULL DEFAULT 0,
    rate_sec INTEGER NOT NULL DEFAULT 0,
    rate_count INTEGER NOT NULL DEFAULT 0
);
-- One row per admitted sandbox (sandbox_id NULL while its create is in flight).
CREATE TABLE IF NOT EXISTS allocations (
    res_id TEXT PRIMARY KEY,
    sandbox_id TEXT UNIQUE,
    node TEXT,
    project_id TEXT NOT NULL,
    cpu_milli INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    created_ms INTEGER NOT NULL,
    idem_key TEXT
);
CREATE UNIQUE INDEX IF NOT EXISTS allocations_idem ON allocations(project_id, idem_key)
    WHERE idem_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS allocations_node ON allocations(node);
-- The project a principal works in (it may also use the project's descendants).
CREATE TABLE IF NOT EXISTS principal_projects (
    principal_id TEXT PRIMARY KEY REFERENCES principals(id),
    project_id TEXT NOT NULL REFERENCES projects(id)
);
-- Named volumes (`crate::volumes`): owned by a project, kept on one node.
CREATE TABLE IF NOT EXISTS volumes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    project_id TEXT NOT NULL REFERENCES projects(id),
    node TEXT NOT NULL,
    size_mb BIGINT NOT NULL,
    created_ms BIGINT NOT NULL,
    UNIQUE (project_id, name)
);
";

/// The same schema in PostgreSQL's types (64-bit integers throughout).
const SCHEMA_PG: &str = "
CREATE TABLE IF NOT EXISTS principals (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS api_keys (
    key_hash TEXT PRIMARY KEY,
    principal_id TEXT NOT NULL REFERENCES principals(id),
    created_at BIGINT NOT NULL,
    revoked_at BIGINT
);
CREATE TABLE IF NOT EXISTS projects (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    parent_id TEXT REFERENCES projects(id)
);
CREATE TABLE IF NOT EXISTS quotas (
    project_id TEXT PRIMARY KEY REFERENCES projects(id),
    max_sandboxes BIGINT,
    max_cpu_milli BIGINT,
    max_memory_mb BIGINT,
    max_creates_per_s BIGINT,
    used_sandboxes BIGINT NOT NULL DEFAULT 0,
    used_cpu_milli BIGINT NOT NULL DEFAULT 0,
    used_memory_mb BIGINT NOT NULL DEFAULT 0,
    rate_sec BIGINT NOT NULL DEFAULT 0,
    rate_count BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS allocations (
    res_id TEXT PRIMARY KEY,
    sandbox_id TEXT UNIQUE,
    node TEXT,
    project_id TEXT NOT NULL,
    cpu_milli BIGINT NOT NULL,
    memory_mb BIGINT NOT NULL,
    created_ms BIGINT NOT NULL,
    idem_key TEXT
);
CREATE UNIQUE INDEX IF NOT EXISTS allocations_idem ON allocations(project_id, idem_key)
    WHERE idem_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS allocations_node ON allocations(node);
CREATE INDEX IF NOT EXISTS allocations_pending ON allocations(created_ms) WHERE sandbox_id IS NULL;
CREATE TABLE IF NOT EXISTS principal_projects (
    principal_id TEXT PRIMARY KEY REFERENCES principals(id),
    project_id TEXT NOT NULL REFERENCES projects(id)
);
-- Named volumes (`crate::volumes`): owned by a project, kept on one node.
CREATE TABLE IF NOT EXISTS volumes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    project_id TEXT NOT NULL REFERENCES projects(id),
    node TEXT NOT NULL,
    size_mb BIGINT NOT NULL,
    created_ms BIGINT NOT NULL,
    UNIQUE (project_id, name)
);
";

/// Rows every database starts with (both dialects).
const SEED: &[&str] = &[
    "INSERT INTO projects (id, name, parent_id) VALUES ('root', 'root', NULL) ON CONFLICT DO NOTHING",
    // Databases made before projects had a parent: hang `default` under `root`.
    "UPDATE projects SET parent_id = 'root' WHERE id = 'default' AND parent_id IS NULL",
    // `WHERE true`: SQLite needs it to parse `INSERT ... SELECT ... ON CONFLICT`.
    "INSERT INTO quotas (project_id) SELECT id FROM projects WHERE true ON CONFLICT DO NOTHING",
];

/// A principal that a key belongs to.
#[derive(Debug, Clone, PartialEq)]
pub struct Principal {
    pub id: String,
    pub name: String,
    /// `admin` (every project and the admin routes) or `user`.
    pub kind: String,
    /// Home project: the principal may use it and its descendants.
    pub project: String,
}

/// Handle to the IAM database; cheap to clone. Calls run on the blocking pool.
#[derive(Clone)]
pub struct Db {
    conn: Arc<Mutex<Conn>>,
    target: Target,
}

pub(crate) fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Creates the schema and seed rows on a fresh connection (idempotent; serialized between
/// replicas starting at once).
fn migrate(conn: &mut Conn) -> Result<(), DbError> {
    let pg = conn.is_postgres();
    let mut tx = conn.begin(true)?;
    if pg {
        // CREATE TABLE IF NOT EXISTS is not safe against a concurrent twin: one at a time.
        tx.exec("SELECT pg_advisory_xact_lock(7480)", &[])?;
    }
    for stmt in if pg { SCHEMA_PG } else { SCHEMA_SQLITE }.split(';') {
        if stmt
            .lines()
            .any(|l| !l.trim().is_empty() && !l.trim().starts_with("--"))
        {
            tx.exec(stmt, &[])?;
        }
    }
    for stmt in SEED {
        tx.exec(stmt, &[])?;
    }
    tx.commit()
}

impl Db {
    /// Opens (creating if needed) the SQLite database at `path` and its schema.
    pub fn open(path: &Path) -> Result<Db, DbError> {
        Db::connect(Target::Sqlite(path.to_path_buf()))
    }

    /// Opens the database `--db` names (`sqlite:///path`, a path, or `postgres://…`),
    /// creating the schema if needed.
    pub fn open_url(url: &str) -> Result<Db, DbError> {
        Db::connect(Target::parse(url))
    }

    /// Connects and creates the schema if needed. Safe to call from async code (PostgreSQL's
    /// blocking client then connects on a scoped thread).
    pub fn connect(target: Target) -> Result<Db, DbError> {
        let open = || {
            let mut conn = target.connect()?;
            migrate(&mut conn)?;
            Ok::<_, DbError>(conn)
        };
        let conn = match target {
            Target::Sqlite(_) => open()?,
            Target::Postgres(_) => std::thread::scope(|s| {
                s.spawn(open)
                    .join()
                    .map_err(|_| DbError::Join("IAM database connect panicked".into()))?
            })?,
        };
        Ok(Db {
            conn: Arc::new(Mutex::new(conn)),
            target,
        })
    }

    /// Where the database lives (other connections, e.g. the quota ledger, open it again).
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// Runs `f` on the connection. PostgreSQL's blocking client runs its own small runtime,
    /// which must not start inside an async context, so there `f` runs on a scoped thread.
    pub(crate) fn with<T: Send>(
        &self,
        f: impl FnOnce(&mut Conn) -> Result<T, DbError> + Send,
    ) -> Result<T, DbError> {
        let run = || {
            let mut guard = self
                .conn
                .lock()
                .map_err(|_| DbError::Join("IAM database lock poisoned".into()))?;
            if guard.is_broken() {
                tracing::warn!(db = %self.target.describe(), "IAM database connection lost; reconnecting");
                *guard = self.target.connect()?;
            }
            let r = f(&mut guard);
            if let Err(e) = &r {
                if e.is_connection_lost() {
                    tracing::warn!(db = %self.target.describe(), error = %e, "IAM database connection lost; reconnecting");
                    if let Ok(c) = self.target.connect() {
                        *guard = c;
                    }
                }
            }
            r
        };
        match self.target {
            Target::Sqlite(_) => run(),
            Target::Postgres(_) => std::thread::scope(|s| {
                s.spawn(run)
                    .join()
                    .map_err(|_| DbError::Join("IAM database call panicked".into()))?
            }),
        }
    }

    pub(crate) async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Conn) -> Result<T, DbError> + Send + 'static,
    ) -> Result<T, DbError> {
        let db = self.clone();
        tokio::task::spawn_blocking(move || db.with(f))
            .await
            .map_err(|e| DbError::Join(e.to_string()))?
    }

    /// On an empty database: creates the `admin` principal, the `default` project and an admin
    /// key, and returns the plaintext key (the only time it exists outside its holder).
    pub fn bootstrap(&self) -> Result<Option<String>, DbError> {
        self.with(|conn| {
            let pg = conn.is_postgres();
            let mut tx = conn.begin(true)?;
            if pg {
                // Two replicas starting on an empty database: one bootstraps.
                tx.exec("SELECT pg_advisory_xact_lock(7481)", &[])?;
            }
            let count = tx
                .query_opt("SELECT COUNT(*) FROM principals", &[])?
                .map(|r| r.i64(0))
                .transpose()?
                .unwrap_or(0);
            if count > 0 {
                return Ok(None);
            }
            tx.exec(
                "INSERT INTO principals (id, name, kind) VALUES ('p-admin', 'admin', 'admin')",
                &[],
            )?;
            tx.exec(
                "INSERT INTO projects (id, name, parent_id) VALUES ('default', 'default', 'root')
                 ON CONFLICT DO NOTHING",
                &[],
            )?;
            tx.exec(
                "INSERT INTO quotas (project_id) VALUES ('default') ON CONFLICT DO NOTHING",
                &[],
            )?;
            let key = crate::auth::generate_key();
            tx.exec(
                "INSERT INTO api_keys (key_hash, principal_id, created_at) VALUES ($1, 'p-admin', $2)",
                p![crate::auth::hash_key(&key), now_secs()],
            )?;
            tx.commit()?;
            Ok(Some(key))
        })
    }

    /// Issues a new key for the principal named `name`; returns the plaintext.
    pub fn issue_key(&self, principal_name: &str) -> Result<Option<String>, DbError> {
        self.with(move |conn| {
            let mut tx = conn.begin(true)?;
            let id = tx
                .query_opt(
                    "SELECT id FROM principals WHERE name = $1",
                    p![principal_name],
                )?
                .map(|r| r.str(0))
                .transpose()?;
            let Some(id) = id else { return Ok(None) };
            let key = crate::auth::generate_key();
            tx.exec(
                "INSERT INTO api_keys (key_hash, principal_id, created_at) VALUES ($1, $2, $3)",
                p![crate::auth::hash_key(&key), id, now_secs()],
            )?;
            tx.commit()?;
            Ok(Some(key))
        })
    }

    /// Marks a key revoked.
    pub fn revoke_key(&self, key_hash: &str) -> Result<bool, DbError> {
        self.with(move |conn| {
            let mut tx = conn.begin(true)?;
            let n = tx.exec(
                "UPDATE api_keys SET revoked_at = $2 WHERE key_hash = $1 AND revoked_at IS NULL",
                p![key_hash, now_secs()],
            )?;
            tx.commit()?;
            Ok(n > 0)
        })
    }

    /// The principal owning an unrevoked key with this hash.
    pub async fn principal_for(&self, key_hash: String) -> Result<Option<Principal>, DbError> {
        self.run(move |conn| {
            let mut tx = conn.begin(false)?;
            let row = tx.query_opt(
                "SELECT p.id, p.name, p.kind, COALESCE(pp.project_id, 'default')
                 FROM api_keys k JOIN principals p ON p.id = k.principal_id
                 LEFT JOIN principal_projects pp ON pp.principal_id = p.id
                 WHERE k.key_hash = $1 AND k.revoked_at IS NULL",
                p![key_hash],
            )?;
            let out = match row {
                Some(r) => Some(Principal {
                    id: r.str(0)?,
                    name: r.str(1)?,
                    kind: r.str(2)?,
                    project: r.str(3)?,
                }),
                None => None,
            };
            tx.commit()?;
            Ok(out)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bootstrap_once_and_lookup() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("iam.db")).unwrap();
        let key = db.bootstrap().unwrap().expect("first start makes a key");
        assert!(db.bootstrap().unwrap().is_none(), "second start makes none");
        let p = db
            .principal_for(crate::auth::hash_key(&key))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(p.name, "admin");
        assert!(db
            .principal_for(crate::auth::hash_key("dsk_nope"))
            .await
            .unwrap()
            .is_none());
        let k2 = db.issue_key("admin").unwrap().unwrap();
        assert_ne!(k2, key);
        assert!(db.revoke_key(&crate::auth::hash_key(&k2)).unwrap());
        assert!(db
            .principal_for(crate::auth::hash_key(&k2))
            .await
            .unwrap()
            .is_none());
        // Reopen: persisted.
        drop(db);
        let db = Db::open(&dir.path().join("iam.db")).unwrap();
        assert!(db
            .principal_for(crate::auth::hash_key(&key))
            .await
            .unwrap()
            .is_some());
    }
}
