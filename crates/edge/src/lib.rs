//! The edge: one per node. Admission, sandbox lifecycle, layers and the edge HTTP API.
//!
//! Owns the lifecycle of sandboxes on one node (admission, create, stop, pause, recovery, TTL)
//! and maps every crate's errors to wire codes in one place. It must not branch on the kind of
//! substrate outside its registry (ask the substrate's capabilities), and must not reimplement
//! what the subsystem crates own (network, node policies, trajectory, functions, images).
//!
//! ```ignore
//! let edge = Edge::start(config).await?;          // recovers, mounts nothing yet
//! println!("edge token: {}", edge.token());
//! let listener = tokio::net::TcpListener::bind(edge.config().listen).await?;
//! axum::serve(listener, edge.router()).with_graceful_shutdown(signal).await?;
//! edge.shutdown().await;                           // stops every sandbox, unmounts layers
//! ```
//!
//! Layout: [`config`] (typed config + `validate`), [`manager`] (lifecycle and admission, the
//! one place with business logic), [`records`] (persisted sandbox records), [`commands`],
//! [`files`], [`tty`] (API ↔ aether protocol translation), [`http`] (routes, one file per
//! resource), [`error`] (the one place errors become HTTP codes), [`metrics`], [`substrate`]
//! (the registry of `dsec_runtime` substrates, keyed by name; the manager asks their
//! capabilities instead of branching on the kind), [`network`] (when the lifecycle
//! attaches, waits for and releases a sandbox's network; the networking itself is the
//! `dsec_network` crate).
//!
//! # Restart after a crash
//!
//! Each sandbox's aether outlives a dead edge for `reattach_grace_ms` (default 60 s), keeping
//! its sessions and processes, and listens on `<data>/edge/sandboxes/<id>/aether.sock`. At start
//! the edge reads every `<data>/edge/sandboxes/*/record.json` and re-adopts each sandbox whose
//! aether is still alive (see [`manager::Manager::recover`]): it reconnects, re-takes the image
//! lease and restores the state from the record (a paused sandbox stays paused: the freezer
//! state lives in the kernel). A sandbox that cannot be re-adopted is killed and cleaned, and
//! reported in [`Edge::reaped`]; the substrate then reaps any cgroup no record accounts for.

pub mod commands;
pub mod config;
pub mod end_reason;
pub mod error;
pub mod files;
pub mod http;
pub mod manager;
pub mod metrics;
pub mod metrics_sampler;
pub mod names;
pub mod network;
pub mod pack;
pub mod ports;
pub mod processes;
pub mod records;
pub mod snapshot;
pub mod substrates;
pub mod trajectory;
pub mod ttl;
pub mod tty;
pub mod vm_config;
pub mod volumes;
pub mod watch;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsec_image::ImageStore;
use dsec_runtime::container::substrate::ContainerDriver;
use dsec_runtime::substrate::OpenContext;

pub use config::EdgeConfig;
pub use error::EdgeError;
pub use manager::Manager;

use crate::metrics::Metrics;
use crate::substrates::Substrates;

/// The node's cache directory (`${DSEC_CACHE:-/var/cache/dsec}`): guest kernels, built VM
/// disk images.
fn cache_dir() -> PathBuf {
    std::env::var_os("DSEC_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/dsec"))
}

/// Why the edge could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartEdgeError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error("aether binary not found (build it with `cargo build --release -p dsec-aether` or set DSEC_AETHER); looked at: {0}")]
    AetherNotFound(String),
    #[error("prepare {path}: {source}")]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("edge token file {path}: {source}")]
    Token {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("image store: {0}")]
    Images(#[from] dsec_image::ImageError),
    #[error("container substrate: {0}")]
    Substrate(String),
}

/// A running edge.
pub struct Edge {
    cfg: Arc<EdgeConfig>,
    token: String,
    manager: Arc<Manager>,
    reaped: Vec<String>,
    /// The function-call pools (container substrate only).
    functions: Option<Arc<dsec_functions::Functions>>,
    /// Cold-memory reclaim and node memory pressure (container substrate, when enabled).
    reclaim: Option<Arc<dsec_node::reclaim::Reclaim>>,
}

impl Edge {
    /// Starts an edge with the container substrate.
    pub async fn start(config: EdgeConfig) -> Result<Edge, StartEdgeError> {
        config.validate()?;
        let aether_path = config.resolve_aether_path().map_err(|tried| {
            StartEdgeError::AetherNotFound(
                tried
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
            )
        })?;
        let ctx = OpenContext {
            aether_path,
            cgroup_parent: config.cgroup_parent(),
            shm_mb: config.shm_mb,
            reattach_grace_ms: config.reattach_grace_ms,
            edge_dir: config.edge_dir(),
            data_dir: config.data_dir.clone(),
            cache_dir: cache_dir(),
            disk_bps_limit: config.disk_bps_limit_mb.saturating_mul(1 << 20),
            ..OpenContext::default()
        };
        // The function-call workers share the container substrate (and its pool of network
        // namespaces), without the reattach grace.
        let substrate = ContainerDriver::configured(&ctx);
        let fn_substrate = substrate.clone().with_reattach_grace(0);
        let container = Arc::new(ContainerDriver::new(substrate));
        let mut edge = Self::start_with_substrates(config, move |cfg, images| {
            // The VM substrates' typed configuration, from `[edge.microvm]` and `[edge.vm]`
            // (validated with the rest of the config); a guest reads blobs from the store.
            let edge_dir = cfg.edge_dir();
            let ctx = OpenContext {
                microvm: cfg
                    .microvm
                    .runtime_config(
                        ctx.aether_path.clone(),
                        images.blob_dir().into_iter().collect(),
                    )
                    .map(|c| {
                        (
                            c,
                            cfg.microvm
                                .template_config(&edge_dir.join("microvm-templates")),
                        )
                    })
                    .map_err(|e| dsec_runtime::substrate::Unavailable(e.to_string())),
                vm: cfg
                    .vm
                    .runtime_config(&cfg.microvm)
                    .map_err(|e| dsec_runtime::substrate::Unavailable(e.to_string())),
                ..ctx
            };
            Substrates::open(&cfg.node_id, &ctx, vec![container])
        })
        .await?;
        edge.reclaim = edge.manager.start_reclaim().await;
        if edge.cfg.functions.enabled {
            edge.functions = Some(dsec_functions::Functions::start(
                edge.cfg.functions.clone(),
                fn_substrate,
                edge.manager.image_store().clone(),
                edge.cfg.edge_dir().join("functions"),
                &edge.cfg.node_id,
            ));
        }
        Ok(edge)
    }

    /// Starts an edge on the substrates `substrates` opens (given the node id and the image
    /// store): opens the image store, reaps what a crashed earlier run left behind, cleans
    /// stale mounts and makes sure `busybox` exists. Every substrate is opened before
    /// [`Manager::recover`] runs, so paused VMs are re-adopted by their own substrate.
    pub async fn start_with_substrates(
        config: EdgeConfig,
        substrates: impl FnOnce(&EdgeConfig, &ImageStore) -> Substrates,
    ) -> Result<Edge, StartEdgeError> {
        config.validate()?;
        for dir in [
            config.edge_dir(),
            config.images_dir(),
            config.sandboxes_dir(),
        ] {
            std::fs::create_dir_all(&dir).map_err(|source| StartEdgeError::Dir {
                path: dir.clone(),
                source,
            })?;
        }
        let token = match &config.token {
            Some(t) => t.clone(),
            None => load_or_make_token(&config.edge_dir().join("token"))?,
        };
        let images = Arc::new(ImageStore::open_with_s3(
            config.images_dir(),
            &config.image_blob_store,
            &config.image_s3,
        )?);
        let cfg = Arc::new(config);
        let metrics = Arc::new(Metrics::new(&cfg.node_id));
        let substrates = substrates(&cfg, &images);
        let manager = Arc::new(Manager::new(
            cfg.clone(),
            substrates,
            images.clone(),
            metrics,
        ));
        // Stale host mounts first: re-adopted sandboxes re-take fresh leases (their own overlays
        // keep private references to the layers they were built on).
        images.cleanup_stale_mounts()?;
        let reaped = manager.recover().await;
        ttl::spawn(&manager, cfg.ttl_check_ms);
        metrics_sampler::spawn(&manager);
        dsec_node::qos::spawn_sampler(manager.view(), manager.qos().clone());
        manager.trajectory().spawn_background();
        images.ensure_busybox().await?;
        tracing::info!(node = %cfg.node_id, reaped = reaped.len(), "edge started");
        Ok(Edge {
            cfg,
            token,
            manager,
            reaped,
            functions: None,
            reclaim: None,
        })
    }

    /// The axum router serving `/edge/v1`, `/metrics` and `/healthz`.
    pub fn router(&self) -> axum::Router {
        http::router(self.manager.clone(), &self.token).merge(http::functions::router(
            self.manager.clone(),
            self.functions.clone(),
            &self.token,
        ))
    }

    /// The bearer token clients must present (configured or generated).
    pub fn token(&self) -> &str {
        &self.token
    }

    pub fn config(&self) -> &EdgeConfig {
        &self.cfg
    }

    pub fn manager(&self) -> &Arc<Manager> {
        &self.manager
    }

    /// The function-call service, when this edge runs one.
    pub fn functions(&self) -> Option<&Arc<dsec_functions::Functions>> {
        self.functions.as_ref()
    }

    /// Sandboxes of an earlier run that were cleaned at start.
    pub fn reaped(&self) -> &[String] {
        &self.reaped
    }

    /// Stops every sandbox and unmounts every layer.
    pub async fn shutdown(&self) {
        if let Some(f) = &self.functions {
            f.shutdown().await;
        }
        self.manager.shutdown().await;
        if let Some(r) = &self.reclaim {
            r.shutdown().await;
        }
    }

    /// The reclaim policy, when enabled.
    pub fn reclaim(&self) -> Option<&Arc<dsec_node::reclaim::Reclaim>> {
        self.reclaim.as_ref()
    }
}

/// Reads the token kept in `path`, or makes a new random one and keeps it there (mode 0600).
fn load_or_make_token(path: &Path) -> Result<String, StartEdgeError> {
    let err = |source| StartEdgeError::Token {
        path: path.to_path_buf(),
        source,
    };
    match std::fs::read_to_string(path) {
        Ok(t) if t.trim().len() >= 16 => return Ok(t.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let token = hex::encode(rand::random::<[u8; 24]>());
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(err)?;
    f.write_all(token.as_bytes()).map_err(err)?;
    Ok(token)
}
