//! Cluster membership (issue 22): which nodes exist and whether they take placements.
//!
//! - **Joins**: an edge started with `dsec edge --join URL --token T` registers itself
//!   (`POST /v1/nodes/join`, authorized by a cluster join token, [`http`]) and heartbeats
//!   (`POST /v1/nodes/{id}/heartbeat`). The rows live in the IAM database ([`registry`]); every
//!   apiserver re-reads them every `membership_sync_ms` and adds new nodes to its watcher, so
//!   with PostgreSQL every replica sees a join within a few seconds, without a restart. The
//!   static `--edge` list keeps working; those nodes get a row once an admin cordons them or
//!   they are lost.
//! - **States** ([`NodeState`]), judged by each apiserver from its own polls of the edge (a
//!   failed poll: `suspect`) and, for joined edges, their heartbeats (none for
//!   `heartbeat_timeout_ms`: `suspect`); silent for `node_lost_after_ms`: `lost`
//!   ([`loss`]). Admin states: `cordoned`, `draining`, `drained` ([`drain`]). Only a `healthy`
//!   node takes placements: the one hook in placement is [`crate::watcher::NodeView::cordoned`].
//! - **Loss** is recorded in the database (`lost_ms`) by the first replica that sees it; the
//!   lost node's quota allocations are released then (deleted rows: exactly once, whichever
//!   replica gets there). A node that answers again after the loss has its sandboxes stopped
//!   with end reason `node_lost` before it takes placements again; one that answers within
//!   the grace is healthy again with its sandboxes, which never stopped.
//!
//! This module must not place sandboxes or hold sandbox state: it only says which nodes may
//! take them, and talks to edges through their HTTP API.

pub mod drain;
pub mod http;
pub mod loss;
pub mod registry;
#[cfg(test)]
pub mod samples;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use dsec_wire::api::{NodeMembership, NodePool, NodeState};
use tokio::task::JoinHandle;

use crate::config::{ApiConfig, EdgeEndpoint};
use crate::db::Db;
use crate::iam::ledger::{now_ms, Ledger};
use crate::watcher::Watcher;
use registry::{AdminState, Member};

/// What one apiserver knows about membership; cheap to clone.
#[derive(Clone)]
pub struct Membership {
    inner: Arc<Inner>,
}

struct Inner {
    db: Db,
    watcher: Watcher,
    http: reqwest::Client,
    ledger: Ledger,
    config: Arc<ApiConfig>,
    /// The database rows as of the last sync, by node id.
    members: RwLock<HashMap<String, Member>>,
    /// The state and its reason per node id, as of the last tick.
    states: RwLock<HashMap<String, (NodeState, Option<String>)>>,
    /// Lost nodes whose sandboxes are being stopped now (they came back).
    evicting: Mutex<HashSet<String>>,
}

fn read<T: Clone>(l: &RwLock<T>) -> T {
    l.read().unwrap_or_else(|p| p.into_inner()).clone()
}

impl Membership {
    pub fn new(
        db: Db,
        watcher: Watcher,
        http: reqwest::Client,
        ledger: Ledger,
        config: Arc<ApiConfig>,
    ) -> Membership {
        Membership {
            inner: Arc::new(Inner {
                db,
                watcher,
                http,
                ledger,
                config,
                members: RwLock::new(HashMap::new()),
                states: RwLock::new(HashMap::new()),
                evicting: Mutex::new(HashSet::new()),
            }),
        }
    }

    pub fn db(&self) -> &Db {
        &self.inner.db
    }

    pub fn watcher(&self) -> &Watcher {
        &self.inner.watcher
    }

    pub fn config(&self) -> &ApiConfig {
        &self.inner.config
    }

    pub fn http(&self) -> &reqwest::Client {
        &self.inner.http
    }

    pub fn ledger(&self) -> &Ledger {
        &self.inner.ledger
    }

    /// The database row of `node_id` as of the last sync.
    pub fn member(&self, node_id: &str) -> Option<Member> {
        self.inner
            .members
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(node_id)
            .cloned()
    }

    /// True while `node_id` counts as lost (silent past the grace, or back but its sandboxes
    /// not stopped yet).
    pub fn is_lost(&self, node_id: &str) -> bool {
        self.member(node_id).is_some_and(|m| m.lost_ms.is_some())
    }

    /// The state of `node_id` as of the last tick.
    pub fn state(&self, node_id: &str) -> Option<(NodeState, Option<String>)> {
        self.inner
            .states
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(node_id)
            .cloned()
    }

    /// The membership facts `GET /v1/nodes` shows for the node at `view`.
    pub fn describe(&self, node_id: Option<&str>, last_seen: Option<Instant>) -> NodeMembership {
        let member = node_id.and_then(|n| self.member(n));
        let (state, detail) = node_id
            .and_then(|n| self.state(n))
            .unwrap_or((NodeState::Suspect, Some("not polled yet".into())));
        NodeMembership {
            state,
            pool: member.as_ref().map_or(NodePool::Primary, |m| m.pool),
            joined: member.as_ref().is_some_and(|m| m.joined),
            last_heartbeat_ms: member.as_ref().and_then(|m| m.heartbeat_ms),
            last_seen_ms: last_seen.map(|t| now_ms() - t.elapsed().as_millis() as i64),
            detail,
        }
    }

    /// Re-reads the rows, adds joined nodes to the watcher, judges every node's state and
    /// acts on losses and returns.
    pub async fn tick(&self) {
        match registry::all(&self.inner.db).await {
            Ok(rows) => {
                for m in rows.iter().filter(|m| m.joined) {
                    self.inner.watcher.upsert_endpoint(EdgeEndpoint {
                        node_id: Some(m.node_id.clone()),
                        url: m.url.clone(),
                        token: m.token.clone(),
                    });
                }
                let map = rows.into_iter().map(|m| (m.node_id.clone(), m)).collect();
                *self
                    .inner
                    .members
                    .write()
                    .unwrap_or_else(|p| p.into_inner()) = map;
            }
            Err(e) => tracing::warn!(error = %e, "read membership rows"),
        }
        let members = read(&self.inner.members);
        let now = now_ms();
        let lost_after = Duration::from_millis(self.inner.config.node_lost_after_ms);
        let hb_timeout = self.inner.config.heartbeat_timeout_ms as i64;
        let mut states = HashMap::new();
        for n in self.inner.watcher.snapshot() {
            // A static edge that never answered: placement's own rules apply (last resort).
            let Some(id) = n.node_id.clone() else {
                continue;
            };
            let m = members.get(&id);
            let silent = self.inner.watcher.silent_for(&id);
            let (state, detail) = if let Some(lost_ms) = m.and_then(|m| m.lost_ms) {
                if n.healthy {
                    self.evict(id.clone(), n.endpoint.clone());
                }
                (
                    NodeState::Lost,
                    Some(format!(
                        "lost since {lost_ms} (ms since the epoch); its sandboxes are failed with end reason node_lost{}",
                        if n.healthy { "; it answers again: stopping them" } else { "" }
                    )),
                )
            } else if !n.healthy {
                if silent.is_some_and(|s| s >= lost_after) {
                    loss::declare(self, &id, &n.endpoint, now).await;
                    (
                        NodeState::Lost,
                        Some("silent past node_lost_after_ms".into()),
                    )
                } else {
                    (
                        NodeState::Suspect,
                        Some(
                            n.last_error
                                .clone()
                                .unwrap_or_else(|| "the edge reports itself unhealthy".into()),
                        ),
                    )
                }
            } else if let Some(hb) = m
                .filter(|m| m.joined)
                .and_then(|m| m.heartbeat_ms)
                .filter(|hb| now - hb > hb_timeout)
            {
                (
                    NodeState::Suspect,
                    Some(format!(
                        "no heartbeat for {} ms (heartbeat_timeout_ms = {hb_timeout})",
                        now - hb
                    )),
                )
            } else {
                match m.map_or(AdminState::Active, |m| m.admin) {
                    AdminState::Active => (NodeState::Healthy, None),
                    AdminState::Cordoned => (NodeState::Cordoned, None),
                    AdminState::Draining => (NodeState::Draining, None),
                    AdminState::Drained => (NodeState::Drained, None),
                }
            };
            self.inner
                .watcher
                .set_cordoned(n.index, !state.takes_placements());
            states.insert(id, (state, detail));
        }
        *self.inner.states.write().unwrap_or_else(|p| p.into_inner()) = states;
    }

    /// Stops the sandboxes of lost node `id` that answers again, once (in the background).
    fn evict(&self, id: String, endpoint: EdgeEndpoint) {
        {
            let mut e = self
                .inner
                .evicting
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if !e.insert(id.clone()) {
                return;
            }
        }
        let me = self.clone();
        tokio::spawn(async move {
            loss::evict(&me, &id, &endpoint).await;
            me.inner
                .evicting
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
        });
    }

    /// Re-judges now (after a join, cordon or drain), so the caller's next request sees it.
    pub async fn refresh(&self) {
        self.tick().await;
    }

    /// Runs [`Membership::tick`] every `membership_sync_ms`.
    pub fn spawn(&self) -> JoinHandle<()> {
        let me = self.clone();
        let period = Duration::from_millis(self.inner.config.membership_sync_ms);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                me.tick().await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_wire::api::{JoinRequest, NodeStatus};

    #[tokio::test]
    async fn joins_reach_the_watcher_and_only_healthy_nodes_take_placements() {
        let dir = tempfile::tempdir().unwrap();
        let db = Db::open(&dir.path().join("iam.db")).unwrap();
        db.bootstrap().unwrap();
        registry::ensure_schema(&db).unwrap();
        let ledger = Ledger::open(&db).unwrap();
        let watcher = Watcher::new(&[]);
        let config = Arc::new(ApiConfig {
            join_token: Some("x".repeat(16)),
            ..Default::default()
        });
        let m = Membership::new(
            db.clone(),
            watcher.clone(),
            reqwest::Client::new(),
            ledger,
            config,
        );
        let join = JoinRequest {
            node_id: "j1".into(),
            url: "http://j1.dsec.test:9".into(),
            token: "t".into(),
            capacity: 4,
            ..Default::default()
        };
        registry::join(&db, join, now_ms()).await.unwrap();
        m.tick().await;
        let v = watcher.snapshot();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].node_id.as_deref(), Some("j1"));
        // Not polled yet: suspect, no placements.
        assert!(v[0].cordoned);
        assert_eq!(m.state("j1").unwrap().0, NodeState::Suspect);
        let healthy = NodeStatus {
            node: "j1".into(),
            healthy: true,
            capacity_sandboxes: 4,
            ..Default::default()
        };
        watcher.record_ok(0, healthy.clone());
        m.tick().await;
        assert_eq!(m.state("j1").unwrap().0, NodeState::Healthy);
        assert!(!watcher.snapshot()[0].cordoned);
        // A second tick does not add the node twice.
        assert_eq!(watcher.snapshot().len(), 1);
        registry::set_admin(
            &db,
            "j1".into(),
            String::new(),
            String::new(),
            AdminState::Cordoned,
        )
        .await
        .unwrap();
        m.tick().await;
        assert_eq!(m.state("j1").unwrap().0, NodeState::Cordoned);
        assert!(watcher.snapshot()[0].cordoned);
        registry::set_admin(
            &db,
            "j1".into(),
            String::new(),
            String::new(),
            AdminState::Active,
        )
        .await
        .unwrap();
        // Heartbeats stop: suspect although the last poll answered.
        registry::heartbeat(&db, "j1".into(), now_ms() - 60_000)
            .await
            .unwrap();
        m.tick().await;
        let (state, detail) = m.state("j1").unwrap();
        assert_eq!(state, NodeState::Suspect);
        assert!(detail.unwrap().contains("no heartbeat"));
        assert!(watcher.snapshot()[0].cordoned);
        // Recorded lost (by this or another replica): lost until its sandboxes are stopped.
        registry::heartbeat(&db, "j1".into(), now_ms())
            .await
            .unwrap();
        registry::set_lost(&db, "j1".into(), String::new(), String::new(), now_ms())
            .await
            .unwrap();
        m.tick().await;
        assert!(m.is_lost("j1"));
        assert_eq!(m.state("j1").unwrap().0, NodeState::Lost);
        assert!(watcher.snapshot()[0].cordoned);
    }
}
