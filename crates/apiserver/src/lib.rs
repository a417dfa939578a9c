//! The apiserver: the public HTTP API of dsec.
//!
//! Owns authentication (API keys, projects, quotas), placement and forwarding. It must not run
//! sandboxes or touch node resources itself, and must not depend on the edge crate: it speaks to
//! edges only through the edge HTTP API (`dsec-client`, `dsec-wire`).
//!
//! It authenticates every `/v1` call with an API key (IAM in SQLite or PostgreSQL), places new
//! sandboxes on an edge, and forwards every later call to the edge named by the node id inside
//! the sandbox id (no lookup table). It reaches edges over HTTP only, even when they run in the
//! same process, streaming bodies both ways. A watcher polls every edge's status.
//!
//! ```ignore
//! let api = ApiServer::start(config).await?;
//! println!("{}", api.url());
//! if let Some(key) = api.bootstrap_key() { /* first start: the admin key, shown once */ }
//! api.shutdown().await;
//! ```

pub mod auth;
pub mod batch;
pub mod compat;
pub mod config;
pub mod create;
pub mod db;
pub mod error;
pub mod fork;
pub mod forward;
pub mod iam;
pub mod jobs;
pub mod membership;
pub mod metrics;
pub mod node_lost;
pub mod offered;
pub mod openapi;
pub mod placement;
pub mod ports;
pub mod queue;
pub mod reconcile;
pub mod revoke;
pub mod routes;
pub mod store;
pub mod time;
pub mod volumes;
pub mod watcher;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

pub use config::{ApiConfig, ConfigError, EdgeEndpoint};

#[derive(Debug, thiserror::Error)]
pub enum StartApiError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Db(#[from] db::DbError),
    #[error("quota ledger: {0}")]
    Ledger(#[from] iam::IamError),
    #[error("build HTTP client: {0}")]
    Http(#[from] reqwest::Error),
    #[error("listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// A running apiserver.
pub struct ApiServer {
    addr: SocketAddr,
    bootstrap_key: Option<String>,
    db: db::Db,
    verifier: Arc<auth::KeyVerifier>,
    watcher: watcher::Watcher,
    http: reqwest::Client,
    ledger: iam::ledger::Ledger,
    serve_task: JoinHandle<()>,
    watch_task: JoinHandle<()>,
    reconcile_task: JoinHandle<()>,
    membership_task: JoinHandle<()>,

    queue_task: JoinHandle<()>,
}

impl ApiServer {
    /// Validates the config, opens IAM (creating the admin key on an empty database), starts
    /// the watcher and serves on `config.listen`.
    pub async fn start(config: ApiConfig) -> Result<ApiServer, StartApiError> {
        config.validate()?;
        let db = db::Db::connect(store::Target::from_path(&config.db_path))?;
        let bootstrap_key = db.bootstrap()?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(config.edge_connect_timeout_ms))
            .tcp_nodelay(true)
            .no_proxy()
            .pool_max_idle_per_host(256)
            .build()?;
        let metrics = Arc::new(metrics::Metrics::new());
        let watcher = watcher::Watcher::new(&config.edges);
        let verifier = Arc::new(auth::KeyVerifier::new(
            db.clone(),
            Duration::from_millis(config.key_cache_ms),
        ));
        let ledger = iam::ledger::Ledger::open(&db)?;
        membership::registry::ensure_schema(&db)?;
        let config = Arc::new(config);
        let membership = membership::Membership::new(
            db.clone(),
            watcher.clone(),
            http.clone(),
            ledger.clone(),
            config.clone(),
        );

        let view = watcher.clone();
        let queue = queue::BurstQueue::new(
            metrics.clone(),
            Arc::new(move |req| view.with(|nodes| queue::room::room_for(nodes, req))),
        );
        let queue_task = queue::spawn_ticker(queue.clone());
        let state = routes::AppState {
            queue,
            batches: Arc::new(batch::Batches::default()),
            forwarder: forward::Forwarder::new(http.clone(), watcher.clone(), metrics.clone()),
            verifier: verifier.clone(),
            metrics,
            db: db.clone(),
            ledger: ledger.clone(),
            config: config.clone(),
            membership: membership.clone(),
        };
        let app = routes::router(state);
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| StartApiError::Bind {
                addr: config.listen,
                source,
            })?;
        let addr = listener
            .local_addr()
            .map_err(|source| StartApiError::Bind {
                addr: config.listen,
                source,
            })?;
        // First poll before serving, so node ids learned from edges are known right away.
        membership.tick().await;
        watcher.poll_once(&http).await;
        membership.tick().await;
        let membership_task = membership.spawn();
        let watch_task = watcher.spawn(http.clone(), config.watcher_period());
        let reconcile_task = reconcile::spawn(
            watcher.clone(),
            http.clone(),
            ledger.clone(),
            Duration::from_millis(config.reconcile_period_ms),
        );
        let serve_task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "apiserver stopped serving");
            }
        });
        tracing::info!(%addr, edges = config.edges.len(), "apiserver listening");
        Ok(ApiServer {
            addr,
            bootstrap_key,
            db,
            verifier,
            watcher,
            http,
            ledger,
            serve_task,
            watch_task,
            reconcile_task,
            membership_task,

            queue_task,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://<addr>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The admin key created on this start (first start on an empty database only).
    pub fn bootstrap_key(&self) -> Option<&str> {
        self.bootstrap_key.as_deref()
    }

    /// True when `key` is a valid, unrevoked key.
    pub async fn verify_key(&self, key: &str) -> bool {
        self.verifier.verify(Some(key)).await.is_ok()
    }

    /// Issues a new key for the admin principal (e.g. when the stored plaintext was lost).
    pub fn issue_admin_key(&self) -> Result<Option<String>, db::DbError> {
        self.db.issue_key("admin")
    }

    /// Polls every edge now and says whether all of them are healthy.
    pub async fn edges_healthy(&self) -> bool {
        self.watcher.poll_once(&self.http).await;
        self.watcher.snapshot().iter().all(|n| n.healthy)
    }

    /// Reconciles quota usage with the edges now; returns how many allocations changed.
    pub async fn reconcile_now(&self) -> u64 {
        reconcile::once(&self.watcher, &self.http, &self.ledger).await
    }

    /// Stops serving and polling.
    pub async fn shutdown(self) {
        self.serve_task.abort();
        self.watch_task.abort();
        self.reconcile_task.abort();
        self.membership_task.abort();

        self.queue_task.abort();
        let _ = self.queue_task.await;
        let _ = self.reconcile_task.await;
        let _ = self.membership_task.await;
        let _ = self.serve_task.await;
        let _ = self.watch_task.await;
    }
}
