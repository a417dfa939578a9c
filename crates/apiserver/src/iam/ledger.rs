//! The quota ledger: admits creates against the project tree's quotas, atomically across
//! apiserver replicas.
//!
//! One writer thread per apiserver owns a connection to the shared database and applies
//! operations in batches (group commit): each batch is one transaction. On SQLite it is
//! `BEGIN IMMEDIATE`, which takes the write lock; on PostgreSQL every admission locks the quota
//! rows of the project and all its ancestors with `SELECT ... FOR UPDATE` before checking them.
//! Either way no other replica can change usage between a check and its increment. A batch
//! that loses a race (PostgreSQL deadlock or serialization failure, a concurrent insert of the
//! same idempotency key) is rolled back and run again. Within a batch the operations run in
//! order, each seeing the previous ones. Callers get their answer only after the batch
//! committed.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::db::DbError;
use crate::p;
use crate::store::{Conn, Tx};

use super::{cpu_milli, IamError};

/// Largest number of operations applied in one transaction.
const MAX_BATCH: usize = 1024;

/// How long a busy ledger waits for more operations before committing a batch (group
/// commit): adds at most this much to a create's latency under load, none when idle or when
/// operations arrive one at a time (a single client's create → stop → create sequence).
const LINGER: Duration = Duration::from_millis(1);

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
    /// Opens its own connection to the database `db` uses and starts the writer thread.
    pub fn open(db: &crate::db::Db) -> Result<Ledger, IamError> {
        let target = db.target().clone();
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        // The connection is made on the writer thread: PostgreSQL's blocking client must not
        // start inside the caller's async runtime.
        std::thread::Builder::new()
            .name("quota-ledger".into())
            .spawn(move || match target.connect() {
                Ok(conn) => {
                    let _ = ready_tx.send(Ok(()));
                    writer(conn, &target, rx)
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| IamError::Db(DbError::Join(format!("start ledger: {e}"))))?;
        ready_rx
            .recv()
            .map_err(|_| IamError::Db(DbError::Join("the quota ledger did not start".into())))??;
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

/// The answer an operation gets once its batch committed.
enum Answer {
    None,
    Reserve(Result<Reserved, IamError>),
    Count(u64),
}

/// Largest number of times a batch is run again after losing a race.
const MAX_RETRIES: u32 = 20;

fn writer(mut conn: Conn, target: &crate::store::Target, rx: mpsc::Receiver<Op>) {
    // Projects are never re-parented or deleted, so a project's ancestor chain can be kept.
    let mut chains: HashMap<String, Vec<String>> = HashMap::new();
    let mut lost = false;
    // When the previous batch held several operations and committed less than LINGER ago,
    // the ledger is busy: wait LINGER for more operations before opening the transaction, so
    // one commit (the WAL append, the lock, the page writes) serves many creates and deletes.
    // An idle ledger commits at once, and so does one that sees single operations: a lone
    // client's reserve, bind and release arrive a few hundred microseconds apart, and waiting
    // would only delay its next create (the queue still batches whatever piles up during a
    // commit).
    let mut last_commit: Option<Instant> = None;
    let mut last_len = 0usize;
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        drain(&rx, &mut batch);
        if batch.len() < MAX_BATCH
            && last_len > 1
            && last_commit.is_some_and(|t| t.elapsed() < LINGER)
        {
            std::thread::sleep(LINGER);
            drain(&rx, &mut batch);
        }
        let mut attempt = 0;
        let result = loop {
            if lost || conn.is_broken() {
                tracing::warn!(db = %target.describe(), "quota ledger connection lost; reconnecting");
                match target.connect() {
                    Ok(c) => {
                        conn = c;
                        lost = false;
                    }
                    Err(e) => break Err(e),
                }
            }
            match apply_batch(&mut conn, &batch, &mut chains) {
                Err(e) if e.is_connection_lost() => {
                    lost = true;
                    break Err(e);
                }
                Err(e) if e.is_retryable() && attempt < MAX_RETRIES => {
                    attempt += 1;
                    tracing::debug!(error = %e, attempt, "quota ledger batch lost a race; again");
                    // Back off a little (jittered) so racing replicas interleave.
                    let ms = rand::random::<u64>() % (2 << attempt.min(5));
                    std::thread::sleep(std::time::Duration::from_millis(ms));
                }
                r => break r,
            }
        };
        last_commit = Some(Instant::now());
        last_len = batch.len();
        match result {
            Ok(answers) => {
                for (op, a) in batch.into_iter().zip(answers) {
                    match (op, a) {
                        (Op::Reserve(_, tx), Answer::Reserve(v)) => {
                            let _ = tx.send(v);
                        }
                        (Op::Reconcile { reply, .. }, Answer::Count(n)) => {
                            let _ = reply.send(Ok(n));
                        }
                        _ => {}
                    }
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "quota ledger transaction failed");
                let msg = e.to_string();
                let err = || IamError::Db(DbError::Join(format!("quota ledger: {msg}")));
                for op in batch {
                    match op {
                        Op::Reserve(_, tx) => {
                            let _ = tx.send(Err(err()));
                        }
                        Op::Reconcile { reply, .. } => {
                            let _ = reply.send(Err(err()));
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}

/// Moves every queued operation into `batch`, up to `MAX_BATCH`.
fn drain(rx: &mpsc::Receiver<Op>, batch: &mut Vec<Op>) {
    while batch.len() < MAX_BATCH {
        match rx.try_recv() {
            Ok(op) => batch.push(op),
            Err(_) => break,
        }
    }
}

/// Runs every operation of the batch in one transaction; one answer per operation.
/// What one batch transaction has read: the quota rows it locked (changed in memory and
/// written back once, before commit), and the cached ancestor chains.
struct Batch<'a> {
    chains: &'a mut HashMap<String, Vec<String>>,
    rows: HashMap<String, Row>,
    dirty: HashSet<String>,
}

impl Batch<'_> {
    /// Writes back every changed quota row (its usage columns only: an admin may change the
    /// limits, but not while this transaction holds the rows).
    fn flush(&mut self, tx: &mut Tx<'_>) -> Result<(), DbError> {
        for p in self.dirty.drain() {
            let Some(q) = self.rows.get(&p) else { continue };
            tx.exec(
                "UPDATE quotas SET used_sandboxes = $2, used_cpu_milli = $3, used_memory_mb = $4,
                     rate_sec = $5, rate_count = $6
                 WHERE project_id = $1",
                p![
                    &p,
                    q.used_sandboxes,
                    q.used_cpu_milli,
                    q.used_memory_mb,
                    q.rate_sec,
                    q.rate_count
                ],
            )?;
        }
        Ok(())
    }
}

fn apply_batch(
    conn: &mut Conn,
    batch: &[Op],
    chains: &mut HashMap<String, Vec<String>>,
) -> Result<Vec<Answer>, DbError> {
    let mut tx = conn.begin(true)?;
    let mut b = Batch {
        chains,
        rows: HashMap::new(),
        dirty: HashSet::new(),
    };
    let answers = run_ops(&mut tx, &mut b, batch)?;
    b.flush(&mut tx)?;
    tx.commit()?;
    Ok(answers)
}

fn run_ops(tx: &mut Tx<'_>, b: &mut Batch<'_>, batch: &[Op]) -> Result<Vec<Answer>, DbError> {
    let now = now_ms();
    let mut answers = Vec::with_capacity(batch.len());
    for op in batch {
        answers.push(match op {
            Op::Reserve(r, _) => match reserve(tx, b, r, now) {
                // Database errors abort the whole batch; refusals are per reservation.
                Err(IamError::Db(e)) => return Err(e),
                v => Answer::Reserve(v),
            },
            Op::Bind {
                res_id,
                sandbox_id,
                node,
            } => {
                tx.exec(
                    "UPDATE allocations SET sandbox_id = $2, node = $3 WHERE res_id = $1",
                    p![res_id, sandbox_id, node],
                )?;
                Answer::None
            }
            Op::ReleaseReservation(res_id) => {
                release_where(tx, b, "res_id", res_id)?;
                Answer::None
            }
            Op::ReleaseSandbox(id) => {
                release_where(tx, b, "sandbox_id", id)?;
                Answer::None
            }
            Op::Reconcile {
                edges,
                before_ms,
                pending_before_ms,
                ..
            } => Answer::Count(reconcile(tx, b, edges, *before_ms, *pending_before_ms)?),
        });
    }
    Ok(answers)
}

/// The project and its ancestors, nearest first (cached: projects never move).
fn chain(tx: &mut Tx<'_>, b: &mut Batch<'_>, project: &str) -> Result<Vec<String>, IamError> {
    if let Some(c) = b.chains.get(project) {
        return Ok(c.clone());
    }
    let c = read_chain(tx, project)?;
    if b.chains.len() > 100_000 {
        b.chains.clear();
    }
    b.chains.insert(project.to_string(), c.clone());
    Ok(c)
}

fn read_chain(tx: &mut Tx<'_>, project: &str) -> Result<Vec<String>, IamError> {
    let mut out: Vec<String> = Vec::new();
    let mut cur = Some(project.to_string());
    while let Some(p) = cur {
        if out.contains(&p) || out.len() > 64 {
            return Err(IamError::Invalid(format!("project tree loops at {p:?}")));
        }
        let Some(row) = tx.query_opt("SELECT parent_id FROM projects WHERE id = $1", p![&p])?
        else {
            return Err(IamError::NotFound(format!(
                "project {p:?} does not exist; see `dsec project ls`"
            )));
        };
        cur = row.opt_str(0)?;
        out.push(p);
    }
    Ok(out)
}

#[derive(Clone)]
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

/// Reads (on PostgreSQL: and locks until commit) the quota rows of `chain`, root first (every
/// chain ends at `root`, so all lockers take rows in the same order), once per batch.
fn lock_chain(tx: &mut Tx<'_>, b: &mut Batch<'_>, chain: &[String]) -> Result<(), IamError> {
    for p in chain.iter().rev() {
        if !b.rows.contains_key(p) {
            let row = quota_row(tx, p)?;
            b.rows.insert(p.clone(), row);
        }
    }
    Ok(())
}

fn quota_row(tx: &mut Tx<'_>, project: &str) -> Result<Row, IamError> {
    let sql = format!(
        "SELECT max_sandboxes, max_cpu_milli, max_memory_mb, max_creates_per_s,
                used_sandboxes, used_cpu_milli, used_memory_mb, rate_sec, rate_count
         FROM quotas WHERE project_id = $1{}",
        tx.for_update()
    );
    let Some(r) = tx.query_opt(&sql, p![project])? else {
        return Err(IamError::NotFound(format!(
            "project {project:?} has no quota row"
        )));
    };
    Ok(Row {
        max_sandboxes: r.opt_i64(0)?,
        max_cpu_milli: r.opt_i64(1)?,
        max_memory_mb: r.opt_i64(2)?,
        max_rate: r.opt_i64(3)?,
        used_sandboxes: r.i64(4)?,
        used_cpu_milli: r.i64(5)?,
        used_memory_mb: r.i64(6)?,
        rate_sec: r.i64(7)?,
        rate_count: r.i64(8)?,
    })
}

fn reserve(
    tx: &mut Tx<'_>,
    b: &mut Batch<'_>,
    r: &Reservation,
    now: i64,
) -> Result<Reserved, IamError> {
    let chain = chain(tx, b, &r.project)?;
    if let Some(home) = &r.home {
        if !chain.contains(home) {
            return Err(IamError::Forbidden(format!(
                "project {:?} is outside your project {home:?} and its sub-projects",
                r.project
            )));
        }
    }
    // Lock the chain, then read usage: a concurrent admission on another replica waits here
    // and sees this one's increment once it commits.
    lock_chain(tx, b, &chain)?;
    // The idempotency key is checked under the locks, so a retry racing its original on
    // another replica sees the original's allocation.
    if let Some(key) = &r.idempotency_key {
        let hit = tx.query_opt(
            "SELECT sandbox_id FROM allocations WHERE project_id = $1 AND idem_key = $2",
            p![&r.project, key],
        )?;
        if let Some(row) = hit {
            return Ok(match row.opt_str(0)? {
                Some(id) => Reserved::Existing { sandbox_id: id },
                None => Reserved::InFlight,
            });
        }
    }
    let cpu = cpu_milli(r.cpu_cores);
    let mem = r.memory_mb as i64;
    let sec = now / 1000;
    let mut counts = Vec::with_capacity(chain.len());
    for p in &chain {
        let Some(q) = b.rows.get(p) else {
            return Err(IamError::NotFound(format!(
                "project {p:?} has no quota row"
            )));
        };
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
        counts.push((p, count));
    }
    for (p, count) in counts {
        if let Some(q) = b.rows.get_mut(p) {
            q.used_sandboxes += 1;
            q.used_cpu_milli += cpu;
            q.used_memory_mb += mem;
            q.rate_sec = sec;
            q.rate_count = count + 1;
            b.dirty.insert(p.clone());
        }
    }
    tx.exec(
        "INSERT INTO allocations (res_id, project_id, cpu_milli, memory_mb, created_ms, idem_key)
         VALUES ($1, $2, $3, $4, $5, $6)",
        p![
            &r.res_id,
            &r.project,
            cpu,
            mem,
            now,
            r.idempotency_key.as_ref()
        ],
    )?;
    Ok(Reserved::New)
}

/// Deletes the allocation where `column = value` and gives its usage back up the tree.
fn release_where(
    tx: &mut Tx<'_>,
    b: &mut Batch<'_>,
    column: &str,
    value: &str,
) -> Result<bool, DbError> {
    let sql = format!(
        "DELETE FROM allocations WHERE {column} = $1 RETURNING project_id, cpu_milli, memory_mb"
    );
    let Some(row) = tx.query_opt(&sql, p![value])? else {
        return Ok(false);
    };
    let (project, cpu, mem) = (row.str(0)?, row.i64(1)?, row.i64(2)?);
    let chain = match chain(tx, b, &project) {
        Ok(c) => c,
        Err(IamError::Db(e)) => return Err(e),
        Err(e) => {
            tracing::error!(project = %project, error = %e, "release: project chain");
            vec![project.clone()]
        }
    };
    match lock_chain(tx, b, &chain) {
        Ok(()) => {}
        Err(IamError::Db(e)) => return Err(e),
        Err(e) => tracing::error!(project = %project, error = %e, "release: quota rows"),
    }
    for p in &chain {
        if let Some(q) = b.rows.get_mut(p) {
            q.used_sandboxes = (q.used_sandboxes - 1).max(0);
            q.used_cpu_milli = (q.used_cpu_milli - cpu).max(0);
            q.used_memory_mb = (q.used_memory_mb - mem).max(0);
            b.dirty.insert(p.clone());
        }
    }
    Ok(true)
}

fn reconcile(
    tx: &mut Tx<'_>,
    b: &mut Batch<'_>,
    edges: &[EdgeLive],
    before_ms: i64,
    pending_before_ms: i64,
) -> Result<u64, DbError> {
    let mut changed = 0u64;
    for e in edges {
        let live: HashSet<&str> = e.sandboxes.iter().map(|(id, _)| id.as_str()).collect();
        // Reservations whose create succeeded but whose bind was lost.
        for (id, res) in &e.sandboxes {
            if let Some(res) = res {
                changed += tx.exec(
                    "UPDATE allocations SET sandbox_id = $2, node = $3
                     WHERE res_id = $1 AND sandbox_id IS NULL",
                    p![res, id, &e.node],
                )?;
            }
        }
        let ids = tx.query(
            "SELECT sandbox_id FROM allocations WHERE node = $1 AND created_ms < $2
             AND sandbox_id IS NOT NULL",
            p![&e.node, before_ms],
        )?;
        for row in ids {
            let id = row.str(0)?;
            if !live.contains(id.as_str()) && release_where(tx, b, "sandbox_id", &id)? {
                changed += 1;
            }
        }
    }
    let pending = tx.query(
        "SELECT res_id FROM allocations WHERE sandbox_id IS NULL AND created_ms < $1",
        p![pending_before_ms],
    )?;
    for row in pending {
        if release_where(tx, b, "res_id", &row.str(0)?)? {
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
        let l = Ledger::open(&db).unwrap();
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
        let l = Ledger::open(&db).unwrap();
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
