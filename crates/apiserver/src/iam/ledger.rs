//! The quota ledger: admits creates against the project tree's quotas, atomically across
//! apiserver replicas.
//!
//! One writer thread per apiserver owns a connection to the shared database and applies
//! operations in batches (group commit): each batch is one `BEGIN IMMEDIATE` transaction, which
//! takes SQLite's write lock, so no other replica can change usage between a check and its
//! increment. Within a batch the operations run in order, each seeing the previous ones.
//! Callers get their answer only after the batch committed.

use std::collections::HashSet;
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use rusqlite::{params, Connection, OptionalExtension, Transaction};
use tokio::sync::oneshot;

use super::{cpu_milli, IamError};

/// Largest number of operations applied in one transaction.
const MAX_BATCH: usize = 1024;

/// A create to admit.
#[derive(Debug, Clone)]
pub struct Reservation {
    /// Unique id of this reservation (also given to the edge as a label).
    pub res_id: String,
    pub project: String,
    /// `None` for admins; else the principal's home project, which must be `project` or one
    /// of its ancestors.
    pub home: Option<String>,
    pub cpu_cores: f64,
    pub memory_mb: u64,
    pub idempotency_key: Option<String>,
}

/// The ledger's answer to a reservation.
#[derive(Debug, Clone, PartialEq)]
pub enum Reserved {
    /// Charged; go ahead and create.
    New,
    /// The idempotency key already names this sandbox.
    Existing { sandbox_id: String },
    /// A create with this idempotency key is still in flight.
    InFlight,
}

/// What the watcher saw on one edge, to reconcile against.
#[derive(Debug, Clone)]
pub struct EdgeLive {
    pub node: String,
    /// (sandbox id, reservation id label if present).
    pub sandboxes: Vec<(String, Option<String>)>,
}

enum Op {
    Reserve(Reservation, oneshot::Sender<Result<Reserved, IamError>>),
    Bind {
        res_id: String,
        sandbox_id: String,
        node: String,
    },
    ReleaseReservation(String),
    ReleaseSandbox(String),
    Reconcile {
        edges: Vec<EdgeLive>,
        /// Allocations younger than this (ms since the epoch) are left alone.
        before_ms: i64,
        /// Unbound reservations older than this are released.
        pending_before_ms: i64,
        reply: oneshot::Sender<Result<u64, IamError>>,
    },
}

/// Handle to the writer thread; cheap to clone.
#[derive(Clone)]
pub struct Ledger {
    tx: mpsc::Sender<Op>,
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn gone() -> IamError {
    IamError::Db(crate::db::DbError::Join("the quota ledger stopped".into()))
}

impl Ledger {
    /// Opens its own connection to the database at `path` and starts the writer thread.
    pub fn open(path: &Path) -> Result<Ledger, IamError> {
        let conn = Connection::open(path).map_err(|source| crate::db::DbError::Open {
            path: path.display().to_string(),
            source,
        })?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.busy_timeout(Duration::from_secs(10))?;
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("quota-ledger".into())
            .spawn(move || writer(conn, rx))
            .map_err(|e| IamError::Db(crate::db::DbError::Join(format!("start ledger: {e}"))))?;
        Ok(Ledger { tx })
    }

    pub async fn reserve(&self, r: Reservation) -> Result<Reserved, IamError> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Op::Reserve(r, tx)).map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Records which sandbox a reservation became (fire and forget).
    pub fn bind(&self, res_id: &str, sandbox_id: &str, node: &str) {
        let _ = self.tx.send(Op::Bind {
            res_id: res_id.into(),
            sandbox_id: sandbox_id.into(),
            node: node.into(),
        });
    }

    /// Gives back a reservation whose create failed.
    pub fn release_reservation(&self, res_id: &str) {
        let _ = self.tx.send(Op::ReleaseReservation(res_id.into()));
    }

    /// Gives back what a stopped sandbox held.
    pub fn release_sandbox(&self, sandbox_id: &str) {
        let _ = self.tx.send(Op::ReleaseSandbox(sandbox_id.into()));
    }

    /// Releases allocations of sandboxes the edges no longer have; binds reservations whose
    /// sandbox exists (an apiserver died between create and bind). Returns how many changed.
    pub async fn reconcile(
        &self,
        edges: Vec<EdgeLive>,
        before_ms: i64,
        pending_before_ms: i64,
    ) -> Result<u64, IamError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Op::Reconcile {
                edges,
                before_ms,
                pending_before_ms,
                reply: tx,
            })
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

enum Reply {
    Reserve(
        oneshot::Sender<Result<Reserved, IamError>>,
        Result<Reserved, IamError>,
    ),
    Count(
        oneshot::Sender<Result<u64, IamError>>,
        Result<u64, IamError>,
    ),
}

fn writer(mut conn: Connection, rx: mpsc::Receiver<Op>) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        let mut replies = Vec::with_capacity(batch.len());
        let result = apply_batch(&mut conn, batch, &mut replies);
        match result {
            Ok(()) => {
                for r in replies {
                    match r {
                        Reply::Reserve(tx, v) => {
                            let _ = tx.send(v);
                        }
                        Reply::Count(tx, v) => {
                            let _ = tx.send(v);
                        }
                    }
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "quota ledger transaction failed");
                let msg = e.to_string();
                for r in replies {
                    let err =
                        || IamError::Db(crate::db::DbError::Join(format!("quota ledger: {msg}")));
                    match r {
                        Reply::Reserve(tx, _) => {
                            let _ = tx.send(Err(err()));
                        }
                        Reply::Count(tx, _) => {
                            let _ = tx.send(Err(err()));
                        }
                    }
                }
            }
        }
    }
}

fn apply_batch(
    conn: &mut Connection,
    batch: Vec<Op>,
    replies: &mut Vec<Reply>,
) -> Result<(), rusqlite::Error> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    let now = now_ms();
    for op in batch {
        match op {
            Op::Reserve(r, reply) => {
                let v = reserve(&tx, &r, now);
                // SQL errors abort the whole batch; refusals are per reservation.
                let v = match v {
                    Err(IamError::Db(crate::db::DbError::Sql(e))) => {
                        replies.push(Reply::Reserve(
                            reply,
                            Err(IamError::Conflict(String::new())),
                        ));
                        return Err(e);
                    }
                    v => v,
                };
                replies.push(Reply::Reserve(reply, v));
            }
            Op::Bind {
                res_id,
                sandbox_id,
                node,
            } => {
                tx.execute(
                    "UPDATE allocations SET sandbox_id = ?2, node = ?3 WHERE res_id = ?1",
                    params![res_id, sandbox_id, node],
                )?;
            }
            Op::ReleaseReservation(res_id) => {
                release_where(&tx, "res_id", &res_id)?;
            }
            Op::ReleaseSandbox(id) => {
                release_where(&tx, "sandbox_id", &id)?;
            }
            Op::Reconcile {
                edges,
                before_ms,
                pending_before_ms,
                reply,
            } => {
                let v = reconcile(&tx, &edges, before_ms, pending_before_ms, now);
                match v {
                    Ok(n) => replies.push(Reply::Count(reply, Ok(n))),
                    Err(e) => {
                        replies.push(Reply::Count(reply, Ok(0)));
                        return Err(e);
                    }
                }
            }
        }
    }
    tx.commit()
}

/// The project and its ancestors, nearest first.
fn chain(tx: &Transaction<'_>, project: &str) -> Result<Vec<String>, IamError> {
    let mut out = Vec::new();
    let mut cur = Some(project.to_string());
    let mut stmt = tx.prepare_cached("SELECT parent_id FROM projects WHERE id = ?1")?;
    while let Some(p) = cur {
        if out.contains(&p) || out.len() > 64 {
            return Err(IamError::Invalid(format!("project tree loops at {p:?}")));
        }
        let parent: Option<Option<String>> = stmt.query_row([&p], |r| r.get(0)).optional()?;
        let Some(parent) = parent else {
            return Err(IamError::NotFound(format!(
                "project {p:?} does not exist; see `dsec project ls`"
            )));
        };
        out.push(p);
        cur = parent;
    }
    Ok(out)
}

struct Row {
    max_sandboxes: Option<i64>,
    max_cpu_milli: Option<i64>,
    max_memory_mb: Option<i64>,
    max_rate: Option<i64>,
    used_sandboxes: i64,
    used_cpu_milli: i64,
    used_memory_mb: i64,
    rate_sec: i64,
    rate_count: i64,
}

fn quota_row(tx: &Transaction<'_>, project: &str) -> Result<Row, rusqlite::Error> {
    let mut stmt = tx.prepare_cached(
        "SELECT max_sandboxes, max_cpu_milli, max_memory_mb, max_creates_per_s,
                used_sandboxes, used_cpu_milli, used_memory_mb, rate_sec, rate_count
         FROM quotas WHERE project_id = ?1",
    )?;
    stmt.query_row([project], |r| {
        Ok(Row {
            max_sandboxes: r.get(0)?,
            max_cpu_milli: r.get(1)?,
            max_memory_mb: r.get(2)?,
            max_rate: r.get(3)?,
            used_sandboxes: r.get(4)?,
            used_cpu_milli: r.get(5)?,
            used_memory_mb: r.get(6)?,
            rate_sec: r.get(7)?,
            rate_count: r.get(8)?,
        })
    })
}

fn reserve(tx: &Transaction<'_>, r: &Reservation, now: i64) -> Result<Reserved, IamError> {
    if let Some(key) = &r.idempotency_key {
        let mut stmt = tx.prepare_cached(
            "SELECT sandbox_id FROM allocations WHERE project_id = ?1 AND idem_key = ?2",
        )?;
        let hit: Option<Option<String>> = stmt
            .query_row(params![r.project, key], |row| row.get(0))
            .optional()?;
        match hit {
            Some(Some(id)) => return Ok(Reserved::Existing { sandbox_id: id }),
            Some(None) => return Ok(Reserved::InFlight),
            None => {}
        }
    }
    let chain = chain(tx, &r.project)?;
    if let Some(home) = &r.home {
        if !chain.contains(home) {
            return Err(IamError::Forbidden(format!(
                "project {:?} is outside your project {home:?} and its sub-projects",
                r.project
            )));
        }
    }
    let cpu = cpu_milli(r.cpu_cores);
    let mem = r.memory_mb as i64;
    let sec = now / 1000;
    let mut rows = Vec::with_capacity(chain.len());
    for p in &chain {
        let q = quota_row(tx, p)?;
        let whose = if p == &r.project {
            format!("project {p:?}")
        } else {
            format!("project {:?} (through its parent {p:?})", r.project)
        };
        if let Some(m) = q.max_sandboxes {
            if q.used_sandboxes + 1 > m {
                return Err(IamError::QuotaExceeded(format!(
                    "{whose} is at its quota of {m} concurrent sandboxes; stop some or raise the quota"
                )));
            }
        }
        if let Some(m) = q.max_cpu_milli {
            if q.used_cpu_milli + cpu > m {
                return Err(IamError::QuotaExceeded(format!(
                    "{whose}: {:.3} of {:.3} CPU cores in use, {:.3} more asked",
                    q.used_cpu_milli as f64 / 1000.0,
                    m as f64 / 1000.0,
                    cpu as f64 / 1000.0
                )));
            }
        }
        if let Some(m) = q.max_memory_mb {
            if q.used_memory_mb + mem > m {
                return Err(IamError::QuotaExceeded(format!(
                    "{whose}: {} of {m} MiB of memory in use, {mem} MiB more asked",
                    q.used_memory_mb
                )));
            }
        }
        let count = if q.rate_sec == sec { q.rate_count } else { 0 };
        if let Some(m) = q.max_rate {
            if count + 1 > m {
                return Err(IamError::QuotaExceeded(format!(
                    "{whose} is at its rate of {m} creations per second; retry in a moment"
                )));
            }
        }
        rows.push((p, count));
    }
    let mut up = tx.prepare_cached(
        "UPDATE quotas SET used_sandboxes = used_sandboxes + 1, used_cpu_milli = used_cpu_milli + ?2,
             used_memory_mb = used_memory_mb + ?3, rate_sec = ?4, rate_count = ?5
         WHERE project_id = ?1",
    )?;
    for (p, count) in rows {
        up.execute(params![p, cpu, mem, sec, count + 1])?;
    }
    tx.prepare_cached(
        "INSERT INTO allocations (res_id, project_id, cpu_milli, memory_mb, created_ms, idem_key)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![
        r.res_id,
        r.project,
        cpu,
        mem,
        now,
        r.idempotency_key
    ])?;
    Ok(Reserved::New)
}

/// Deletes the allocation where `column = value` and gives its usage back up the tree.
fn release_where(tx: &Transaction<'_>, column: &str, value: &str) -> Result<bool, rusqlite::Error> {
    let sql = format!(
        "DELETE FROM allocations WHERE {column} = ?1 RETURNING project_id, cpu_milli, memory_mb"
    );
    let row: Option<(String, i64, i64)> = tx
        .prepare_cached(&sql)?
        .query_row([value], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .optional()?;
    let Some((project, cpu, mem)) = row else {
        return Ok(false);
    };
    let chain = match chain(tx, &project) {
        Ok(c) => c,
        Err(IamError::Db(crate::db::DbError::Sql(e))) => return Err(e),
        Err(e) => {
            tracing::error!(project = %project, error = %e, "release: project chain");
            vec![project]
        }
    };
    let mut down = tx.prepare_cached(
        "UPDATE quotas SET used_sandboxes = MAX(used_sandboxes - 1, 0),
             used_cpu_milli = MAX(used_cpu_milli - ?2, 0), used_memory_mb = MAX(used_memory_mb - ?3, 0)
         WHERE project_id = ?1",
    )?;
    for p in chain {
        down.execute(params![p, cpu, mem])?;
    }
    Ok(true)
}

fn reconcile(
    tx: &Transaction<'_>,
    edges: &[EdgeLive],
    before_ms: i64,
    pending_before_ms: i64,
    _now: i64,
) -> Result<u64, rusqlite::Error> {
    let mut changed = 0u64;
    for e in edges {
        let live: HashSet<&str> = e.sandboxes.iter().map(|(id, _)| id.as_str()).collect();
        // Reservations whose create succeeded but whose bind was lost.
        for (id, res) in &e.sandboxes {
            if let Some(res) = res {
                let n = tx
                    .prepare_cached(
                        "UPDATE allocations SET sandbox_id = ?2, node = ?3
                         WHERE res_id = ?1 AND sandbox_id IS NULL",
                    )?
                    .execute(params![res, id, e.node])?;
                changed += n as u64;
            }
        }
        let ids: Vec<String> = {
            let mut stmt = tx.prepare_cached(
                "SELECT sandbox_id FROM allocations WHERE node = ?1 AND created_ms < ?2
                 AND sandbox_id IS NOT NULL",
            )?;
            let rows = stmt.query_map(params![e.node, before_ms], |r| r.get::<_, String>(0))?;
            rows.collect::<Result<_, _>>()?
        };
        for id in ids.iter().filter(|id| !live.contains(id.as_str())) {
            if release_where(tx, "sandbox_id", id)? {
                changed += 1;
            }
        }
    }
    let pending: Vec<String> = {
        let mut stmt = tx.prepare_cached(
            "SELECT res_id FROM allocations WHERE sandbox_id IS NULL AND created_ms < ?1",
        )?;
        let rows = stmt.query_map([pending_before_ms], |r| r.get::<_, String>(0))?;
        rows.collect::<Result<_, _>>()?
    };
    for res in pending {
        if release_where(tx, "res_id", &res)? {
            changed += 1;
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iam::{admin, Quota};

    fn res(project: &str, key: Option<&str>) -> Reservation {
        Reservation {
            res_id: format!("r{}", rand::random::<u64>()),
            project: project.into(),
            home: None,
            cpu_cores: 1.0,
            memory_mb: 512,
            idempotency_key: key.map(str::to_string),
        }
    }

    #[tokio::test]
    async fn child_never_exceeds_parent_and_release_gives_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("iam.db");
        let db = crate::db::Db::open(&path).unwrap();
        db.bootstrap().unwrap();
        let q = |n| Quota {
            max_sandboxes: Some(n),
            ..Default::default()
        };
        admin::create_project(&db, "team", Some("root"), Some(q(3)))
            .await
            .unwrap();
        admin::create_project(&db, "a", Some("team"), Some(q(3)))
            .await
            .unwrap();
        admin::create_project(&db, "b", Some("team"), Some(q(2)))
            .await
            .unwrap();
        // Above the parent's quota: refused.
        assert!(admin::set_quota(&db, "a", q(4)).await.is_err());
        let l = Ledger::open(&path).unwrap();
        let mut kept = Vec::new();
        for _ in 0..2 {
            let r = res("b", None);
            assert_eq!(l.reserve(r.clone()).await.unwrap(), Reserved::New);
            kept.push(r.res_id);
        }
        // `a` may use only what `team` has left: 1.
        assert_eq!(l.reserve(res("a", None)).await.unwrap(), Reserved::New);
        let e = l.reserve(res("a", None)).await.unwrap_err();
        assert!(matches!(e, IamError::QuotaExceeded(_)), "{e}");
        l.release_reservation(&kept[0]);
        assert_eq!(l.reserve(res("a", None)).await.unwrap(), Reserved::New);
        let p = admin::list_projects(&db).await.unwrap();
        let team = p.projects.iter().find(|p| p.name == "team").unwrap();
        assert_eq!(team.usage.sandboxes, 3);
        assert_eq!(team.usage.memory_mb, 3 * 512);
    }

    #[tokio::test]
    async fn idempotency_and_home_project() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("iam.db");
        let db = crate::db::Db::open(&path).unwrap();
        db.bootstrap().unwrap();
        admin::create_project(&db, "x", None, None).await.unwrap();
        let l = Ledger::open(&path).unwrap();
        let r = res("x", Some("k1"));
        assert_eq!(l.reserve(r.clone()).await.unwrap(), Reserved::New);
        assert_eq!(
            l.reserve(res("x", Some("k1"))).await.unwrap(),
            Reserved::InFlight
        );
        l.bind(&r.res_id, "sb-n0-0000000000000001", "n0");
        assert_eq!(
            l.reserve(res("x", Some("k1"))).await.unwrap(),
            Reserved::Existing {
                sandbox_id: "sb-n0-0000000000000001".into()
            }
        );
        let mut other = res("x", None);
        other.home = Some("default".into());
        assert!(matches!(
            l.reserve(other).await.unwrap_err(),
            IamError::Forbidden(_)
        ));
        // Reconcile: the edge no longer has it → released.
        let n = l
            .reconcile(
                vec![EdgeLive {
                    node: "n0".into(),
                    sandboxes: vec![],
                }],
                now_ms() + 1000,
                0,
            )
            .await
            .unwrap();
        assert_eq!(n, 1);
        assert_eq!(
            l.reserve(res("x", Some("k1"))).await.unwrap(),
            Reserved::New
        );
    }
}
