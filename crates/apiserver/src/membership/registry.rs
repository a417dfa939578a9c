//! The membership rows in the IAM database: one per node (joined edges, and static ones once
//! an admin cordoned them or they were lost), and the cluster join tokens (sha256 only).
//!
//! With PostgreSQL every apiserver replica reads the same rows, so a join, a cordon or a loss
//! recorded by one is seen by the others on their next sync (every `membership_sync_ms`).

use std::collections::BTreeMap;

use dsec_wire::api::{JoinRequest, NodePool};

use crate::db::{Db, DbError};
use crate::p;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS cluster_nodes (
    node_id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    token TEXT NOT NULL,
    pool TEXT NOT NULL,
    labels TEXT NOT NULL,
    capacity BIGINT NOT NULL,
    joined BIGINT NOT NULL,
    admin_state TEXT NOT NULL,
    joined_ms BIGINT NOT NULL,
    heartbeat_ms BIGINT,
    lost_ms BIGINT
);
CREATE TABLE IF NOT EXISTS join_tokens (
    token_hash TEXT PRIMARY KEY,
    created_ms BIGINT NOT NULL
)";

/// What an admin decided about a node (independent of whether it answers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdminState {
    Active,
    Cordoned,
    Draining,
    Drained,
}

impl AdminState {
    pub fn as_str(self) -> &'static str {
        match self {
            AdminState::Active => "active",
            AdminState::Cordoned => "cordoned",
            AdminState::Draining => "draining",
            AdminState::Drained => "drained",
        }
    }

    fn parse(s: &str) -> AdminState {
        match s {
            "cordoned" => AdminState::Cordoned,
            "draining" => AdminState::Draining,
            "drained" => AdminState::Drained,
            _ => AdminState::Active,
        }
    }
}

/// One membership row.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    pub node_id: String,
    pub url: String,
    pub token: String,
    pub pool: NodePool,
    pub labels: BTreeMap<String, String>,
    pub capacity: u64,
    /// Joined through `POST /v1/nodes/join` (else a static edge with a row for its state).
    pub joined: bool,
    pub admin: AdminState,
    pub heartbeat_ms: Option<i64>,
    /// Set when the node was declared lost; cleared once its sandboxes were stopped on return.
    pub lost_ms: Option<i64>,
}

fn pool_str(p: NodePool) -> &'static str {
    match p {
        NodePool::Primary => "primary",
        NodePool::Overflow => "overflow",
    }
}

/// Creates the tables if needed (serialized between replicas starting at once).
pub fn ensure_schema(db: &Db) -> Result<(), DbError> {
    db.with(|conn| {
        let pg = conn.is_postgres();
        let mut tx = conn.begin(true)?;
        if pg {
            tx.exec("SELECT pg_advisory_xact_lock(7482)", &[])?;
        }
        for stmt in SCHEMA.split(';') {
            tx.exec(stmt, &[])?;
        }
        tx.commit()
    })
}

/// Records a join (or a re-join after a restart: URL and token may change; the admin state
/// and a pending loss are kept).
pub async fn join(db: &Db, req: JoinRequest, now: i64) -> Result<(), DbError> {
    let labels = serde_json::to_string(&req.labels).unwrap_or_else(|_| "{}".into());
    db.run(move |conn| {
        let mut tx = conn.begin(true)?;
        tx.exec(
            "INSERT INTO cluster_nodes (node_id, url, token, pool, labels, capacity, joined,
                 admin_state, joined_ms, heartbeat_ms, lost_ms)
             VALUES ($1, $2, $3, $4, $5, $6, 1, 'active', $7, $7, NULL)
             ON CONFLICT (node_id) DO UPDATE SET url = $2, token = $3, pool = $4, labels = $5,
                 capacity = $6, joined = 1, heartbeat_ms = $7",
            p![
                req.node_id,
                req.url,
                req.token,
                pool_str(req.pool),
                labels,
                req.capacity as i64,
                now
            ],
        )?;
        tx.commit()
    })
    .await
}

/// A joined node's heartbeat; false when no such joined node is recorded.
pub async fn heartbeat(db: &Db, node_id: String, now: i64) -> Result<bool, DbError> {
    db.run(move |conn| {
        let mut tx = conn.begin(true)?;
        let n = tx.exec(
            "UPDATE cluster_nodes SET heartbeat_ms = $2 WHERE node_id = $1 AND joined = 1",
            p![node_id, now],
        )?;
        tx.commit()?;
        Ok(n > 0)
    })
    .await
}

/// Sets the admin state of `node_id`, creating the row of a static edge (`url`, `token`).
pub async fn set_admin(
    db: &Db,
    node_id: String,
    url: String,
    token: String,
    state: AdminState,
) -> Result<(), DbError> {
    db.run(move |conn| {
        let mut tx = conn.begin(true)?;
        tx.exec(
            "INSERT INTO cluster_nodes (node_id, url, token, pool, labels, capacity, joined,
                 admin_state, joined_ms, heartbeat_ms, lost_ms)
             VALUES ($1, $2, $3, 'primary', '{}', 0, 0, $4, $5, NULL, NULL)
             ON CONFLICT (node_id) DO UPDATE SET admin_state = $4",
            p![
                node_id,
                url,
                token,
                state.as_str(),
                crate::iam::ledger::now_ms()
            ],
        )?;
        tx.commit()
    })
    .await
}

/// Marks `node_id` lost at `now`; true when this call did (not already lost).
pub async fn set_lost(
    db: &Db,
    node_id: String,
    url: String,
    token: String,
    now: i64,
) -> Result<bool, DbError> {
    db.run(move |conn| {
        let mut tx = conn.begin(true)?;
        tx.exec(
            "INSERT INTO cluster_nodes (node_id, url, token, pool, labels, capacity, joined,
                 admin_state, joined_ms, heartbeat_ms, lost_ms)
             VALUES ($1, $2, $3, 'primary', '{}', 0, 0, 'active', $4, NULL, NULL)
             ON CONFLICT (node_id) DO NOTHING",
            p![node_id.as_str(), url, token, now],
        )?;
        let n = tx.exec(
            "UPDATE cluster_nodes SET lost_ms = $2 WHERE node_id = $1 AND lost_ms IS NULL",
            p![node_id, now],
        )?;
        tx.commit()?;
        Ok(n > 0)
    })
    .await
}

/// Clears the loss of `node_id` (its sandboxes were stopped after it came back).
pub async fn clear_lost(db: &Db, node_id: String) -> Result<(), DbError> {
    db.run(move |conn| {
        let mut tx = conn.begin(true)?;
        tx.exec(
            "UPDATE cluster_nodes SET lost_ms = NULL WHERE node_id = $1",
            p![node_id],
        )?;
        tx.commit()
    })
    .await
}

/// Every row.
pub async fn all(db: &Db) -> Result<Vec<Member>, DbError> {
    db.run(|conn| {
        let mut tx = conn.begin(false)?;
        let rows = tx.query(
            "SELECT node_id, url, token, pool, labels, capacity, joined, admin_state,
                 heartbeat_ms, lost_ms FROM cluster_nodes ORDER BY node_id",
            &[],
        )?;
        tx.commit()?;
        rows.into_iter()
            .map(|r| {
                Ok(Member {
                    node_id: r.str(0)?,
                    url: r.str(1)?,
                    token: r.str(2)?,
                    pool: if r.str(3)? == "overflow" {
                        NodePool::Overflow
                    } else {
                        NodePool::Primary
                    },
                    labels: serde_json::from_str(&r.str(4)?).unwrap_or_default(),
                    capacity: u64::try_from(r.i64(5)?).unwrap_or(0),
                    joined: r.i64(6)? != 0,
                    admin: AdminState::parse(&r.str(7)?),
                    heartbeat_ms: r.opt_i64(8)?,
                    lost_ms: r.opt_i64(9)?,
                })
            })
            .collect()
    })
    .await
}

/// Issues a cluster join token; returns the plaintext (the only copy).
pub async fn create_token(db: &Db) -> Result<String, DbError> {
    use rand::RngCore;
    let mut raw = [0u8; 24];
    rand::thread_rng().fill_bytes(&mut raw);
    let token = format!("dsj_{}", hex::encode(raw));
    let hash = crate::auth::hash_key(&token);
    db.run(move |conn| {
        let mut tx = conn.begin(true)?;
        tx.exec(
            "INSERT INTO join_tokens (token_hash, created_ms) VALUES ($1, $2)",
            p![hash, crate::iam::ledger::now_ms()],
        )?;
        tx.commit()
    })
    .await?;
    Ok(token)
}

/// True when `token` was issued by [`create_token`].
pub async fn token_known(db: &Db, token: &str) -> Result<bool, DbError> {
    let hash = crate::auth::hash_key(token);
    db.run(move |conn| {
        let mut tx = conn.begin(false)?;
        let row = tx.query_opt(
            "SELECT created_ms FROM join_tokens WHERE token_hash = $1",
            p![hash],
        )?;
        tx.commit()?;
        Ok(row.is_some())
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn join_cordon_loss_and_tokens_persist() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("iam.db")).unwrap();
        ensure_schema(&db).unwrap();
        ensure_schema(&db).unwrap();
        let req = JoinRequest {
            node_id: "n7".into(),
            url: "http://n7.dsec.test:1".into(),
            token: "t".into(),
            capacity: 9,
            pool: NodePool::Overflow,
            labels: [("zone".to_string(), "a".to_string())].into(),
        };
        join(&db, req.clone(), 10).await.unwrap();
        set_admin(
            &db,
            "n7".into(),
            String::new(),
            String::new(),
            AdminState::Cordoned,
        )
        .await
        .unwrap();
        // A re-join (new URL after a restart) keeps the cordon.
        join(
            &db,
            JoinRequest {
                url: "http://n7.dsec.test:2".into(),
                ..req
            },
            20,
        )
        .await
        .unwrap();
        assert!(heartbeat(&db, "n7".into(), 30).await.unwrap());
        assert!(!heartbeat(&db, "nx".into(), 30).await.unwrap());
        assert!(set_lost(&db, "n7".into(), String::new(), String::new(), 40)
            .await
            .unwrap());
        assert!(
            !set_lost(&db, "n7".into(), String::new(), String::new(), 50)
                .await
                .unwrap()
        );
        // a static edge gets a row when it is lost
        assert!(set_lost(
            &db,
            "s1".into(),
            "http://s1.dsec.test".into(),
            "k".into(),
            60
        )
        .await
        .unwrap());
        let rows = all(&db).await.unwrap();
        assert_eq!(rows.len(), 2);
        let m = &rows[0];
        assert_eq!(
            (m.url.as_str(), m.pool, m.capacity, m.joined, m.admin),
            (
                "http://n7.dsec.test:2",
                NodePool::Overflow,
                9,
                true,
                AdminState::Cordoned
            )
        );
        assert_eq!((m.heartbeat_ms, m.lost_ms), (Some(30), Some(40)));
        assert_eq!(m.labels.get("zone").map(String::as_str), Some("a"));
        assert!(!rows[1].joined && rows[1].lost_ms == Some(60));
        clear_lost(&db, "n7".into()).await.unwrap();
        assert_eq!(all(&db).await.unwrap()[0].lost_ms, None);
        let t = create_token(&db).await.unwrap();
        assert!(token_known(&db, &t).await.unwrap());
        assert!(!token_known(&db, "dsj_nope").await.unwrap());
    }
}
