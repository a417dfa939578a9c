//! Admin operations on projects, quotas, principals and keys.

use super::{
    cpu_milli, valid_project_name, CreatedKey, IamError, ProjectList, ProjectView, Quota, Usage,
};
use crate::db::{now_secs, Db, DbError};
use crate::p;
use crate::store::{Row, Tx};

fn quota_from(r: &Row, at: usize) -> Result<Quota, DbError> {
    Ok(Quota {
        max_sandboxes: r.opt_i64(at)?.map(|v| v.max(0) as u64),
        max_cpu_cores: r.opt_i64(at + 1)?.map(|v| v as f64 / 1000.0),
        max_memory_mb: r.opt_i64(at + 2)?.map(|v| v.max(0) as u64),
        max_creates_per_s: r.opt_i64(at + 3)?.map(|v| v.max(0) as u64),
    })
}

fn quota_of(tx: &mut Tx<'_>, project: &str) -> Result<Option<Quota>, DbError> {
    let sql = format!(
        "SELECT max_sandboxes, max_cpu_milli, max_memory_mb, max_creates_per_s FROM quotas
         WHERE project_id = $1{}",
        tx.for_update()
    );
    tx.query_opt(&sql, p![project])?
        .map(|r| quota_from(&r, 0))
        .transpose()
}

/// Runs an admin transaction, again when it lost a race with a concurrent one (PostgreSQL).
fn retrying<T>(
    conn: &mut crate::store::Conn,
    mut f: impl FnMut(&mut Tx<'_>) -> Result<Result<T, IamError>, DbError>,
) -> Result<Result<T, IamError>, DbError> {
    let mut attempt = 0;
    loop {
        let mut tx = conn.begin(true)?;
        let r = f(&mut tx).and_then(|v| {
            if v.is_ok() {
                tx.commit()?;
            }
            Ok(v)
        });
        match r {
            Err(e) if e.is_retryable() && attempt < 8 => attempt += 1,
            r => return r,
        }
    }
}

/// A child's quota must fit in its parent's, dimension by dimension (an unlimited parent
/// allows anything; a limited parent requires the child to be limited too).
fn check_fits(child: &Quota, parent: &Quota, parent_name: &str) -> Result<(), IamError> {
    fn dim<T: PartialOrd + std::fmt::Display + Copy>(
        name: &str,
        c: Option<T>,
        p: Option<T>,
        parent: &str,
    ) -> Result<(), IamError> {
        match (c, p) {
            (_, None) => Ok(()),
            (None, Some(p)) => Err(IamError::Invalid(format!(
                "{name} must be set (at most {p}): the parent project {parent:?} limits it"
            ))),
            (Some(c), Some(p)) if c > p => Err(IamError::Invalid(format!(
                "{name} = {c} is more than the parent project {parent:?} has ({p}); a quota is delegated from the parent"
            ))),
            _ => Ok(()),
        }
    }
    dim(
        "max_sandboxes",
        child.max_sandboxes,
        parent.max_sandboxes,
        parent_name,
    )?;
    dim(
        "max_cpu_cores",
        child.max_cpu_cores,
        parent.max_cpu_cores,
        parent_name,
    )?;
    dim(
        "max_memory_mb",
        child.max_memory_mb,
        parent.max_memory_mb,
        parent_name,
    )?;
    dim(
        "max_creates_per_s",
        child.max_creates_per_s,
        parent.max_creates_per_s,
        parent_name,
    )
}

fn validate_quota(q: &Quota) -> Result<(), IamError> {
    if let Some(c) = q.max_cpu_cores {
        if !(c.is_finite() && c >= 0.0) {
            return Err(IamError::Invalid("max_cpu_cores must be >= 0".into()));
        }
    }
    Ok(())
}

fn write_quota(tx: &mut Tx<'_>, project: &str, q: &Quota) -> Result<(), DbError> {
    tx.exec(
        "INSERT INTO quotas (project_id, max_sandboxes, max_cpu_milli, max_memory_mb, max_creates_per_s)
         VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT(project_id) DO UPDATE SET max_sandboxes = excluded.max_sandboxes,
             max_cpu_milli = excluded.max_cpu_milli, max_memory_mb = excluded.max_memory_mb,
             max_creates_per_s = excluded.max_creates_per_s",
        p![
            project,
            q.max_sandboxes.map(|v| v as i64),
            q.max_cpu_cores.map(cpu_milli),
            q.max_memory_mb.map(|v| v as i64),
            q.max_creates_per_s.map(|v| v as i64)
        ],
    )?;
    Ok(())
}

/// Quota checks for setting `q` on `project`: within its parent's, and not below what any
/// child was delegated.
fn check_delegation(tx: &mut Tx<'_>, project: &str, q: &Quota) -> Result<(), IamError> {
    let parent: Option<String> = tx
        .query_opt("SELECT parent_id FROM projects WHERE id = $1", p![project])?
        .ok_or_else(|| IamError::NotFound(format!("project {project:?} does not exist")))?
        .opt_str(0)?;
    if let Some(parent) = parent {
        if let Some(pq) = quota_of(tx, &parent)? {
            check_fits(q, &pq, &parent)?;
        }
    }
    let children: Vec<String> = tx
        .query("SELECT id FROM projects WHERE parent_id = $1", p![project])?
        .iter()
        .map(|r| r.str(0))
        .collect::<Result<_, _>>()?;
    for c in children {
        if let Some(cq) = quota_of(tx, &c)? {
            check_fits(&cq, q, project).map_err(|e| {
                IamError::Invalid(format!(
                    "sub-project {c:?} was delegated more than this quota allows: {e}; lower its quota first"
                ))
            })?;
        }
    }
    Ok(())
}

pub async fn create_project(
    db: &Db,
    name: &str,
    parent: Option<&str>,
    quota: Option<Quota>,
) -> Result<(), IamError> {
    if !valid_project_name(name) {
        return Err(IamError::Invalid(format!(
            "project name {name:?} must match [a-z0-9][a-z0-9-]{{0,62}}"
        )));
    }
    let q = quota.unwrap_or_default();
    validate_quota(&q)?;
    let (name, parent) = (name.to_string(), parent.unwrap_or("root").to_string());
    let r: Result<Result<(), IamError>, DbError> = db
        .run(move |conn| {
            retrying(conn, |tx| {
                if tx
                    .query_opt("SELECT 1 FROM projects WHERE id = $1", p![&name])?
                    .is_some()
                {
                    return Ok(Err(IamError::Conflict(format!(
                        "project {name:?} already exists"
                    ))));
                }
                if tx
                    .query_opt("SELECT 1 FROM projects WHERE id = $1", p![&parent])?
                    .is_none()
                {
                    return Ok(Err(IamError::NotFound(format!(
                        "parent project {parent:?} does not exist"
                    ))));
                }
                tx.exec(
                    "INSERT INTO projects (id, name, parent_id) VALUES ($1, $1, $2)",
                    p![&name, &parent],
                )?;
                if let Err(e) = check_delegation(tx, &name, &q) {
                    return match e {
                        IamError::Db(e) => Err(e),
                        e => Ok(Err(e)),
                    };
                }
                write_quota(tx, &name, &q)?;
                Ok(Ok(()))
            })
        })
        .await;
    r?
}

pub async fn set_quota(db: &Db, name: &str, q: Quota) -> Result<(), IamError> {
    validate_quota(&q)?;
    let name = name.to_string();
    let r: Result<Result<(), IamError>, DbError> = db
        .run(move |conn| {
            retrying(conn, |tx| {
                if let Err(e) = check_delegation(tx, &name, &q) {
                    return match e {
                        IamError::Db(e) => Err(e),
                        e => Ok(Err(e)),
                    };
                }
                write_quota(tx, &name, &q)?;
                Ok(Ok(()))
            })
        })
        .await;
    r?
}

pub async fn list_projects(db: &Db) -> Result<ProjectList, IamError> {
    let projects = db
        .run(|conn| {
            let mut tx = conn.begin(false)?;
            let rows = tx.query(
                "SELECT p.id, p.parent_id, q.max_sandboxes, q.max_cpu_milli, q.max_memory_mb,
                        q.max_creates_per_s, COALESCE(q.used_sandboxes, 0),
                        COALESCE(q.used_cpu_milli, 0), COALESCE(q.used_memory_mb, 0)
                 FROM projects p LEFT JOIN quotas q ON q.project_id = p.id ORDER BY p.id",
                &[],
            )?;
            tx.commit()?;
            rows.iter()
                .map(|r| {
                    Ok(ProjectView {
                        name: r.str(0)?,
                        parent: r.opt_str(1)?,
                        quota: quota_from(r, 2)?,
                        usage: Usage {
                            sandboxes: r.i64(6)?.max(0) as u64,
                            cpu_cores: r.i64(7)? as f64 / 1000.0,
                            memory_mb: r.i64(8)?.max(0) as u64,
                        },
                    })
                })
                .collect::<Result<Vec<_>, DbError>>()
        })
        .await?;
    Ok(ProjectList { projects })
}

/// Issues a key for `principal`, creating the principal (in `project`, of `kind`) if needed.
pub async fn create_key(
    db: &Db,
    principal: &str,
    project: Option<&str>,
    kind: Option<&str>,
) -> Result<CreatedKey, IamError> {
    if principal.is_empty()
        || principal.len() > 64
        || !principal
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.@".contains(&b))
    {
        return Err(IamError::Invalid(
            "principal must be 1-64 characters of [A-Za-z0-9-_.@]".into(),
        ));
    }
    let kind = kind.unwrap_or("user").to_string();
    if kind != "user" && kind != "admin" {
        return Err(IamError::Invalid("kind must be `user` or `admin`".into()));
    }
    let (principal, project) = (principal.to_string(), project.map(str::to_string));
    let r: Result<Result<CreatedKey, IamError>, DbError> = db
        .run(move |conn| {
            retrying(conn, |tx| {
                let existing = tx.query_opt(
                    "SELECT p.id, p.kind, pp.project_id FROM principals p
                     LEFT JOIN principal_projects pp ON pp.principal_id = p.id WHERE p.name = $1",
                    p![&principal],
                )?;
                let (id, kind, home) = match existing {
                    Some(r) => (
                        r.str(0)?,
                        r.str(1)?,
                        r.opt_str(2)?.unwrap_or_else(|| "default".into()),
                    ),
                    None => {
                        let home = project.clone().unwrap_or_else(|| "default".into());
                        if tx
                            .query_opt("SELECT 1 FROM projects WHERE id = $1", p![&home])?
                            .is_none()
                        {
                            return Ok(Err(IamError::NotFound(format!(
                                "project {home:?} does not exist"
                            ))));
                        }
                        let id = format!("p-{}", hex::encode(rand::random::<[u8; 8]>()));
                        tx.exec(
                            "INSERT INTO principals (id, name, kind) VALUES ($1, $2, $3)",
                            p![&id, &principal, &kind],
                        )?;
                        tx.exec(
                            "INSERT INTO principal_projects (principal_id, project_id) VALUES ($1, $2)",
                            p![&id, &home],
                        )?;
                        (id, kind.clone(), home)
                    }
                };
                let key = crate::auth::generate_key();
                let hash = crate::auth::hash_key(&key);
                tx.exec(
                    "INSERT INTO api_keys (key_hash, principal_id, created_at) VALUES ($1, $2, $3)",
                    p![&hash, &id, now_secs()],
                )?;
                Ok(Ok(CreatedKey {
                    principal: principal.clone(),
                    project: home,
                    kind,
                    key_id: hash[..16].to_string(),
                    key,
                }))
            })
        })
        .await;
    r?
}

/// Revokes the key whose id (hash prefix, at least 8 hex characters) or plaintext is given;
/// answers the id of the principal that owned it.
pub async fn revoke_key(db: &Db, key_or_id: &str) -> Result<String, IamError> {
    let prefix = if key_or_id.starts_with("dsk_") {
        crate::auth::hash_key(key_or_id)
    } else {
        key_or_id.to_ascii_lowercase()
    };
    if prefix.len() < 8 || !prefix.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(IamError::Invalid(
            "give the key itself or its key_id (at least 8 hex characters)".into(),
        ));
    }
    let n = db
        .run(move |conn| {
            let pattern = format!("{prefix}%");
            let mut tx = conn.begin(true)?;
            let n = tx.exec(
                "UPDATE api_keys SET revoked_at = $2
                 WHERE key_hash LIKE $1 AND revoked_at IS NULL
                 AND (SELECT COUNT(*) FROM api_keys WHERE key_hash LIKE $1) = 1",
                p![&pattern, now_secs()],
            )?;
            let owner = match n {
                0 => None,
                _ => tx
                    .query_opt(
                        "SELECT principal_id FROM api_keys WHERE key_hash LIKE $1",
                        p![&pattern],
                    )?
                    .map(|r| r.str(0))
                    .transpose()?,
            };
            tx.commit()?;
            Ok(owner)
        })
        .await?;
    n.ok_or_else(|| {
        IamError::NotFound("no single unrevoked key matches; give more of the key_id".into())
    })
}
