//! The IAM database (SQLite): principals, API keys (sha256 only), projects.
//!
//! The schema is shaped for the cluster issue (hierarchical projects, per-principal keys,
//! revocation); today there is one `admin` principal and one `default` project.

use std::path::Path;
use std::sync::{Arc, Mutex};

use rusqlite::{params, Connection, OptionalExtension};

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("open IAM database {path}: {source}")]
    Open {
        path: String,
        source: rusqlite::Error,
    },
    #[error("IAM database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("IAM database task failed: {0}")]
    Join(String),
}

const SCHEMA: &str = "
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
-- Quota (NULL: unlimited) and usage of a project; usage includes every descendant's.
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
INSERT OR IGNORE INTO projects (id, name, parent_id) VALUES ('root', 'root', NULL);
INSERT OR IGNORE INTO quotas (project_id) VALUES ('root');
";

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
    conn: Arc<Mutex<Connection>>,
    path: std::path::PathBuf,
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl Db {
    /// Opens (creating if needed) the database and its schema.
    pub fn open(path: &Path) -> Result<Db, DbError> {
        if let Some(parent) = path.parent() {
            if !parent.as_os_str().is_empty() {
                let _ = std::fs::create_dir_all(parent);
            }
        }
        let conn = Connection::open(path).map_err(|source| DbError::Open {
            path: path.display().to_string(),
            source,
        })?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch("BEGIN IMMEDIATE")?;
        let schema = conn.execute_batch(SCHEMA).and_then(|()| {
            // Databases made before projects had a parent: hang `default` under `root`.
            conn.execute_batch(
                "UPDATE projects SET parent_id = 'root' WHERE id = 'default' AND parent_id IS NULL;
                 INSERT OR IGNORE INTO quotas (project_id) SELECT id FROM projects;",
            )
        });
        match schema {
            Ok(()) => conn.execute_batch("COMMIT")?,
            Err(e) => {
                let _ = conn.execute_batch("ROLLBACK");
                return Err(e.into());
            }
        }
        Ok(Db {
            conn: Arc::new(Mutex::new(conn)),
            path: path.to_path_buf(),
        })
    }

    /// The path the database was opened from (other connections, e.g. the quota ledger).
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn with<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, DbError>,
    ) -> Result<T, DbError> {
        let mut guard = self
            .conn
            .lock()
            .map_err(|_| DbError::Join("IAM database lock poisoned".into()))?;
        f(&mut guard)
    }

    pub(crate) async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, DbError> + Send + 'static,
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
            let tx = conn.transaction()?;
            let count: i64 = tx.query_row("SELECT COUNT(*) FROM principals", [], |r| r.get(0))?;
            if count > 0 {
                return Ok(None);
            }
            tx.execute(
                "INSERT INTO principals (id, name, kind) VALUES ('p-admin', 'admin', 'admin')",
                [],
            )?;
            tx.execute(
                "INSERT OR IGNORE INTO projects (id, name, parent_id) VALUES ('default', 'default', 'root')",
                [],
            )?;
            tx.execute(
                "INSERT OR IGNORE INTO quotas (project_id) VALUES ('default')",
                [],
            )?;
            let key = crate::auth::generate_key();
            tx.execute(
                "INSERT INTO api_keys (key_hash, principal_id, created_at) VALUES (?1, 'p-admin', ?2)",
                params![crate::auth::hash_key(&key), now_secs()],
            )?;
            tx.commit()?;
            Ok(Some(key))
        })
    }

    /// Issues a new key for the principal named `name`; returns the plaintext.
    pub fn issue_key(&self, principal_name: &str) -> Result<Option<String>, DbError> {
        let name = principal_name.to_string();
        self.with(move |conn| {
            let id: Option<String> = conn
                .query_row("SELECT id FROM principals WHERE name = ?1", [&name], |r| {
                    r.get(0)
                })
                .optional()?;
            let Some(id) = id else { return Ok(None) };
            let key = crate::auth::generate_key();
            conn.execute(
                "INSERT INTO api_keys (key_hash, principal_id, created_at) VALUES (?1, ?2, ?3)",
                params![crate::auth::hash_key(&key), id, now_secs()],
            )?;
            Ok(Some(key))
        })
    }

    /// Marks a key revoked.
    pub fn revoke_key(&self, key_hash: &str) -> Result<bool, DbError> {
        let h = key_hash.to_string();
        self.with(move |conn| {
            let n = conn.execute(
                "UPDATE api_keys SET revoked_at = ?2 WHERE key_hash = ?1 AND revoked_at IS NULL",
                params![h, now_secs()],
            )?;
            Ok(n > 0)
        })
    }

    /// The principal owning an unrevoked key with this hash.
    pub async fn principal_for(&self, key_hash: String) -> Result<Option<Principal>, DbError> {
        self.run(move |conn| {
            Ok(conn
                .query_row(
                    "SELECT p.id, p.name, p.kind, COALESCE(pp.project_id, 'default')
                     FROM api_keys k JOIN principals p ON p.id = k.principal_id
                     LEFT JOIN principal_projects pp ON pp.principal_id = p.id
                     WHERE k.key_hash = ?1 AND k.revoked_at IS NULL",
                    [&key_hash],
                    |r| {
                        Ok(Principal {
                            id: r.get(0)?,
                            name: r.get(1)?,
                            kind: r.get(2)?,
                            project: r.get(3)?,
                        })
                    },
                )
                .optional()?)
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
