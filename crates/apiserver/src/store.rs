//! The storage backends behind IAM and the quota ledger: SQLite (default) and PostgreSQL.
//!
//! Everything the apiserver persists (principals, keys, projects, quotas, usage, idempotency
//! keys) is read and written through [`Conn`] / [`Tx`], so the IAM and ledger logic is written
//! once. SQL is written in one dialect with `$1`-style placeholders (rewritten to SQLite's
//! `?1`), using only constructs both engines share (`ON CONFLICT`, `RETURNING`, `CASE`); the
//! few differences are asked of the transaction ([`Tx::for_update`]).
//!
//! Atomicity across apiserver replicas:
//! - SQLite: every write transaction is `BEGIN IMMEDIATE`, which takes the database's write
//!   lock, so no other replica changes usage between a check and its increment.
//! - PostgreSQL: transactions run at READ COMMITTED and lock the quota rows they check with
//!   `SELECT ... FOR UPDATE` (the project and every ancestor), so a concurrent admission waits
//!   and then re-reads the committed usage. Deadlocks and serialization failures are retried
//!   by the callers ([`DbError::is_retryable`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use postgres::types::{to_sql_checked, IsNull, ToSql, Type};

use crate::db::DbError;

/// Where the database lives, parsed from `--db` / `db_path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A SQLite file (`sqlite:///path`, `sqlite://path` or a bare path).
    Sqlite(PathBuf),
    /// A PostgreSQL connection URL (`postgres://user@host:port/db`).
    Postgres(String),
}

impl Target {
    /// Parses `postgres://…` / `postgresql://…` → PostgreSQL; `sqlite://PATH` or a path → SQLite.
    pub fn parse(s: &str) -> Target {
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            Target::Postgres(s.to_string())
        } else if let Some(p) = s.strip_prefix("sqlite://") {
            Target::Sqlite(PathBuf::from(p))
        } else {
            Target::Sqlite(PathBuf::from(s))
        }
    }

    pub fn from_path(p: &Path) -> Target {
        Target::parse(&p.to_string_lossy())
    }

    /// True for a URL naming a database server rather than a file.
    pub fn is_url(s: &str) -> bool {
        matches!(Target::parse(s), Target::Postgres(_))
    }

    /// For messages: the path, or the URL without its password.
    pub fn describe(&self) -> String {
        match self {
            Target::Sqlite(p) => p.display().to_string(),
            Target::Postgres(url) => redact(url),
        }
    }

    /// Opens a new connection (SQLite: WAL, foreign keys, busy timeout).
    pub fn connect(&self) -> Result<Conn, DbError> {
        match self {
            Target::Sqlite(path) => {
                if let Some(parent) = path.parent() {
                    if !parent.as_os_str().is_empty() {
                        let _ = std::fs::create_dir_all(parent);
                    }
                }
                let conn = rusqlite::Connection::open(path).map_err(|source| DbError::Open {
                    path: path.display().to_string(),
                    source,
                })?;
                conn.pragma_update(None, "journal_mode", "WAL")?;
                conn.pragma_update(None, "foreign_keys", "ON")?;
                conn.busy_timeout(Duration::from_secs(10))?;
                conn.pragma_update(None, "synchronous", "NORMAL")?;
                Ok(Conn::Sqlite(conn))
            }
            Target::Postgres(url) => {
                let mut cfg: postgres::Config = url.parse().map_err(|e| DbError::OpenPg {
                    url: redact(url),
                    source: e,
                })?;
                cfg.connect_timeout(Duration::from_secs(10));
                cfg.application_name("dsec-apiserver");
                let client = cfg.connect(postgres::NoTls).map_err(|e| DbError::OpenPg {
                    url: redact(url),
                    source: e,
                })?;
                Ok(Conn::Postgres {
                    client: PgClient(Some(Box::new(client))),
                    stmts: HashMap::new(),
                })
            }
        }
    }
}

/// `postgres://user:secret@host/db` → `postgres://user:***@host/db`.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let Some((auth, host)) = rest.split_once('@') else {
        return url.to_string();
    };
    match auth.split_once(':') {
        Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_string(),
    }
}

/// A parameter or column value: the only types the schema uses.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Int(i64),
    Text(String),
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Int(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Text(v.to_string())
    }
}
impl From<&String> for Value {
    fn from(v: &String) -> Self {
        Value::Text(v.clone())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Text(v)
    }
}
impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Self {
        v.map(Into::into).unwrap_or(Value::Null)
    }
}

impl ToSql for Value {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Value::Null => Ok(IsNull::Yes),
            Value::Int(v) if *ty == Type::INT4 => i32::try_from(*v)?.to_sql(ty, out),
            Value::Int(v) if *ty == Type::INT2 => i16::try_from(*v)?.to_sql(ty, out),
            Value::Int(v) => v.to_sql(ty, out),
            Value::Text(s) => s.as_str().to_sql(ty, out),
        }
    }

    fn accepts(ty: &Type) -> bool {
        <i64 as ToSql>::accepts(ty)
            || <i32 as ToSql>::accepts(ty)
            || <i16 as ToSql>::accepts(ty)
            || <&str as ToSql>::accepts(ty)
    }

    to_sql_checked!();
}

impl rusqlite::ToSql for Value {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(match self {
            Value::Null => ToSqlOutput::Borrowed(ValueRef::Null),
            Value::Int(v) => ToSqlOutput::Borrowed(ValueRef::Integer(*v)),
            Value::Text(s) => ToSqlOutput::Borrowed(ValueRef::Text(s.as_bytes())),
        })
    }
}

/// One result row.
#[derive(Debug, Clone)]
pub struct Row(Vec<Value>);

impl Row {
    fn at(&self, i: usize) -> Result<&Value, DbError> {
        self.0
            .get(i)
            .ok_or_else(|| DbError::Type(format!("no column {i}")))
    }

    pub fn opt_i64(&self, i: usize) -> Result<Option<i64>, DbError> {
        match self.at(i)? {
            Value::Null => Ok(None),
            Value::Int(v) => Ok(Some(*v)),
            Value::Text(t) => Err(DbError::Type(format!(
                "column {i}: text {t:?}, not integer"
            ))),
        }
    }

    pub fn i64(&self, i: usize) -> Result<i64, DbError> {
        self.opt_i64(i)?
            .ok_or_else(|| DbError::Type(format!("column {i}: NULL, not integer")))
    }

    pub fn opt_str(&self, i: usize) -> Result<Option<String>, DbError> {
        match self.at(i)? {
            Value::Null => Ok(None),
            Value::Text(t) => Ok(Some(t.clone())),
            Value::Int(v) => Err(DbError::Type(format!("column {i}: integer {v}, not text"))),
        }
    }

    pub fn str(&self, i: usize) -> Result<String, DbError> {
        self.opt_str(i)?
            .ok_or_else(|| DbError::Type(format!("column {i}: NULL, not text")))
    }
}

/// PostgreSQL's blocking client, closed on a thread of its own: its `Drop` runs a small
/// runtime, which panics when the last handle is dropped inside async code.
pub struct PgClient(Option<Box<postgres::Client>>);

impl PgClient {
    fn get(&mut self) -> Result<&mut postgres::Client, DbError> {
        self.0
            .as_deref_mut()
            .ok_or_else(|| DbError::Join("PostgreSQL connection already closed".into()))
    }
}

impl Drop for PgClient {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            let _ = std::thread::Builder::new()
                .name("pg-close".into())
                .spawn(move || drop(c));
        }
    }
}

/// An open connection to either backend.
pub enum Conn {
    Sqlite(rusqlite::Connection),
    Postgres {
        client: PgClient,
        /// Prepared statements by SQL text.
        stmts: HashMap<String, postgres::Statement>,
    },
}

/// `$1` → `?1` (SQLite's numbered parameters; a number may appear more than once).
fn sqlite_sql(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '$' && chars.peek().is_some_and(|n| n.is_ascii_digit()) {
            out.push('?');
        } else {
            out.push(c);
        }
    }
    out
}

impl Conn {
    pub fn is_postgres(&self) -> bool {
        matches!(self, Conn::Postgres { .. })
    }

    /// True when the server closed the connection (restart, network): open a new one.
    pub fn is_broken(&self) -> bool {
        match self {
            Conn::Sqlite(_) => false,
            Conn::Postgres { client, .. } => client.0.as_ref().is_none_or(|c| c.is_closed()),
        }
    }

    /// Runs a batch of statements outside any transaction (schema set-up).
    pub fn batch(&mut self, sql: &str) -> Result<(), DbError> {
        match self {
            Conn::Sqlite(c) => Ok(c.execute_batch(sql)?),
            Conn::Postgres { client, .. } => Ok(client.get()?.batch_execute(sql)?),
        }
    }

    /// Starts a transaction. SQLite: `BEGIN IMMEDIATE` (the write lock) when `write`;
    /// PostgreSQL: READ COMMITTED, rows locked explicitly with [`Tx::for_update`].
    pub fn begin(&mut self, write: bool) -> Result<Tx<'_>, DbError> {
        match self {
            Conn::Sqlite(c) => {
                let behavior = if write {
                    rusqlite::TransactionBehavior::Immediate
                } else {
                    rusqlite::TransactionBehavior::Deferred
                };
                Ok(Tx::Sqlite(c.transaction_with_behavior(behavior)?))
            }
            Conn::Postgres { client, stmts } => Ok(Tx::Postgres {
                tx: client.get()?.transaction()?,
                stmts,
            }),
        }
    }
}

/// A transaction on either backend; dropped without [`Tx::commit`] it rolls back.
pub enum Tx<'a> {
    Sqlite(rusqlite::Transaction<'a>),
    Postgres {
        tx: postgres::Transaction<'a>,
        stmts: &'a mut HashMap<String, postgres::Statement>,
    },
}

fn pg_row(row: &postgres::Row) -> Result<Row, DbError> {
    let mut out = Vec::with_capacity(row.len());
    for (i, col) in row.columns().iter().enumerate() {
        let ty = col.type_();
        let v = if *ty == Type::INT8 {
            row.try_get::<_, Option<i64>>(i)?.into()
        } else if *ty == Type::INT4 {
            row.try_get::<_, Option<i32>>(i)?.map(i64::from).into()
        } else if *ty == Type::INT2 {
            row.try_get::<_, Option<i16>>(i)?.map(i64::from).into()
        } else if *ty == Type::BOOL {
            row.try_get::<_, Option<bool>>(i)?.map(i64::from).into()
        } else if *ty == Type::TEXT || *ty == Type::VARCHAR || *ty == Type::NAME {
            row.try_get::<_, Option<String>>(i)?.into()
        } else {
            return Err(DbError::Type(format!(
                "column {:?} has unsupported type {ty}",
                col.name()
            )));
        };
        out.push(v);
    }
    Ok(Row(out))
}

fn sqlite_row(row: &rusqlite::Row<'_>, n: usize) -> Result<Row, DbError> {
    use rusqlite::types::ValueRef;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        out.push(match row.get_ref(i)? {
            ValueRef::Null => Value::Null,
            ValueRef::Integer(v) => Value::Int(v),
            ValueRef::Real(v) => Value::Int(v as i64),
            ValueRef::Text(t) | ValueRef::Blob(t) => {
                Value::Text(String::from_utf8_lossy(t).into_owned())
            }
        });
    }
    Ok(Row(out))
}

impl Tx<'_> {
    pub fn is_postgres(&self) -> bool {
        matches!(self, Tx::Postgres { .. })
    }

    /// `" FOR UPDATE"` on PostgreSQL (row locks), `""` on SQLite (the whole database is
    /// already locked by `BEGIN IMMEDIATE`).
    pub fn for_update(&self) -> &'static str {
        if self.is_postgres() {
            " FOR UPDATE"
        } else {
            ""
        }
    }

    fn pg_stmt(
        tx: &mut postgres::Transaction<'_>,
        stmts: &mut HashMap<String, postgres::Statement>,
        sql: &str,
    ) -> Result<postgres::Statement, DbError> {
        if let Some(s) = stmts.get(sql) {
            return Ok(s.clone());
        }
        let s = tx.prepare(sql)?;
        if stmts.len() > 256 {
            stmts.clear();
        }
        stmts.insert(sql.to_string(), s.clone());
        Ok(s)
    }

    /// Executes a statement; returns the number of rows changed.
    pub fn exec(&mut self, sql: &str, params: &[Value]) -> Result<u64, DbError> {
        match self {
            Tx::Sqlite(tx) => {
                let mut stmt = tx.prepare_cached(&sqlite_sql(sql))?;
                let n = stmt.execute(rusqlite::params_from_iter(params.iter()))?;
                Ok(n as u64)
            }
            Tx::Postgres { tx, stmts } => {
                let stmt = Self::pg_stmt(tx, stmts, sql)?;
                let p: Vec<&(dyn ToSql + Sync)> =
                    params.iter().map(|v| v as &(dyn ToSql + Sync)).collect();
                Ok(tx.execute(&stmt, &p)?)
            }
        }
    }

    /// Runs a query; returns every row.
    pub fn query(&mut self, sql: &str, params: &[Value]) -> Result<Vec<Row>, DbError> {
        match self {
            Tx::Sqlite(tx) => {
                let mut stmt = tx.prepare_cached(&sqlite_sql(sql))?;
                let n = stmt.column_count();
                let mut rows = stmt.query(rusqlite::params_from_iter(params.iter()))?;
                let mut out = Vec::new();
                while let Some(r) = rows.next()? {
                    out.push(sqlite_row(r, n)?);
                }
                Ok(out)
            }
            Tx::Postgres { tx, stmts } => {
                let stmt = Self::pg_stmt(tx, stmts, sql)?;
                let p: Vec<&(dyn ToSql + Sync)> =
                    params.iter().map(|v| v as &(dyn ToSql + Sync)).collect();
                tx.query(&stmt, &p)?.iter().map(pg_row).collect()
            }
        }
    }

    /// The first row, if any.
    pub fn query_opt(&mut self, sql: &str, params: &[Value]) -> Result<Option<Row>, DbError> {
        Ok(self.query(sql, params)?.into_iter().next())
    }

    pub fn commit(self) -> Result<(), DbError> {
        match self {
            Tx::Sqlite(tx) => Ok(tx.commit()?),
            Tx::Postgres { tx, .. } => Ok(tx.commit()?),
        }
    }
}

/// Shorthand for a parameter list: `p![a, b, c]`.
#[macro_export]
macro_rules! p {
    ($($v:expr),* $(,)?) => {
        &[$($crate::store::Value::from($v)),*]
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_targets() {
        assert_eq!(
            Target::parse("sqlite:///var/x.db"),
            Target::Sqlite("/var/x.db".into())
        );
        assert_eq!(
            Target::parse("/var/x.db"),
            Target::Sqlite("/var/x.db".into())
        );
        assert_eq!(
            Target::parse("postgres://u@127.0.0.1:5432/d"),
            Target::Postgres("postgres://u@127.0.0.1:5432/d".into())
        );
        assert!(Target::is_url("postgresql://u@h/d"));
        assert_eq!(
            Target::parse("postgres://u:pw@h/d").describe(),
            "postgres://u:***@h/d"
        );
    }

    #[test]
    fn placeholders() {
        assert_eq!(
            sqlite_sql("UPDATE t SET a = $2 WHERE b = $1 AND c = '$x' AND d = $12"),
            "UPDATE t SET a = ?2 WHERE b = ?1 AND c = '$x' AND d = ?12"
        );
    }
}
