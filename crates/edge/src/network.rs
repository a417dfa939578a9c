//! The few calls the sandbox manager makes into networking at create, stop
//! and recovery, so that the manager's own code changes by a line per step. (The container disk
//! limit is the container substrate's: `dsec_runtime::container::disk`.)
//!
//! This is the glue between the sandbox lifecycle and [`dsec_network`] (which owns namespaces,
//! veths, nftables, the DNS proxy and policy): it validates the request, persists
//! [`SavedNetwork`] beside the sandbox's record, hands the substrate the sandbox's
//! `resolv.conf` to write into its writable layer, and attaches, waits for, releases and
//! re-adopts the sandbox's network at the right steps.

use std::path::Path;
use std::sync::Arc;

use dsec_network::{Network, SavedNetwork};
use dsec_runtime::substrate::LayerFile;
use dsec_wire::api::{CreateSandboxRequest, NetworkMode, NetworkSpec};

use crate::config::EdgeConfig;
use crate::error::EdgeError;

/// What a create gets beyond the plain spec.
#[derive(Default)]
pub struct Extras {
    pub netns: Option<Arc<std::os::fd::OwnedFd>>,
    /// `etc/resolv.conf`, for the substrate to write into the writable layer.
    pub layer_files: Vec<LayerFile>,
}

/// Where [`SavedNetwork`] is persisted, in the sandbox's directory, so that a re-adopted
/// sandbox keeps its network.
const SAVED: &str = "network.json";

/// Largest disk limit a request may ask for (MiB).
const MAX_DISK_MB: u64 = 1 << 20;

/// Validates the request's network, protected paths and disk limit, then builds what the
/// network needs: the namespace with its rules, `/etc/resolv.conf`.
pub async fn prepare(
    net: &Arc<Network>,
    cfg: &EdgeConfig,
    id: &str,
    dir: &Path,
    req: &CreateSandboxRequest,
) -> Result<Extras, EdgeError> {
    let policy = net.policy_for(req.network.as_ref(), &req.network_rules)?;
    for p in &req.protected_paths {
        if !p.starts_with('/')
            || p.contains('\0')
            || p.split('/').any(|c| c == "..")
            || p.len() > 4096
        {
            return Err(EdgeError::BadRequest(format!(
                "protected path {p:?} must be an absolute path without `..`"
            )));
        }
    }
    if req.protected_paths.len() > 64 {
        return Err(EdgeError::BadRequest("at most 64 protected_paths".into()));
    }
    let disk_mb = req.disk_limit_mb.unwrap_or(cfg.default_disk_limit_mb);
    if req.disk_limit_mb == Some(0) || disk_mb > MAX_DISK_MB || (disk_mb > 0 && disk_mb < 16) {
        return Err(EdgeError::BadRequest(format!(
            "disk_limit_mb must be 16..={MAX_DISK_MB} (MiB)"
        )));
    }
    if policy.mode == NetworkMode::None {
        return Ok(Extras::default());
    }
    let spec = NetworkSpec {
        mode: Some(policy.mode),
        rules: policy.rules.clone(),
        groups: Some(policy.groups.clone()),
    };
    let att = net.attach(id, policy).await?;
    save(net, id, dir, spec);
    Ok(Extras {
        netns: Some(att.netns),
        layer_files: vec![LayerFile {
            path: "etc/resolv.conf".to_string(),
            contents: att.resolv_conf.into(),
        }],
    })
}

fn save(net: &Network, id: &str, dir: &Path, spec: NetworkSpec) {
    let Some((host_no, ns, veth)) = net.placement_of(id) else {
        return;
    };
    let saved = SavedNetwork {
        spec,
        host_no,
        ns: Some(ns),
        veth: Some(veth),
    };
    match serde_json::to_vec(&saved) {
        Ok(b) => {
            if let Err(e) = std::fs::write(dir.join(SAVED), b) {
                tracing::warn!(sandbox = %id, error = %e, "persist network policy");
            }
        }
        Err(e) => tracing::warn!(sandbox = %id, error = %e, "encode network policy"),
    }
}

/// Persists the current policy after a live change.
pub fn saved(net: &Network, id: &str, dir: &Path) {
    if let Some(p) = net.policy_of(id) {
        save(
            net,
            id,
            dir,
            NetworkSpec {
                mode: Some(p.mode),
                rules: p.rules,
                groups: Some(p.groups),
            },
        );
    }
}

/// Once the substrate started the sandbox: waits until its nftables chains are in (they were
/// added while it started; an error fails the create).
pub async fn started(
    net: &Arc<Network>,
    _cfg: &EdgeConfig,
    id: &str,
    _dir: &Path,
) -> Result<(), EdgeError> {
    net.rules_ready(id).await?;
    Ok(())
}

/// Removes the sandbox's network objects. Idempotent; problems are logged. (The container
/// substrate releases a disk limit's file system itself, in its destroy.)
pub async fn release(net: &Arc<Network>, id: &str, _dir: &Path) {
    if let Err(e) = net.detach(id).await {
        tracing::error!(sandbox = %id, error = %e, "remove sandbox network");
    }
}

/// After a restart: re-registers the networks of re-adopted sandboxes, then removes every
/// other namespace, veth (and the table when nothing is left) an earlier run made.
pub async fn recover(net: &Arc<Network>, cfg: &EdgeConfig, adopted: &[String]) {
    for id in adopted {
        let dir = cfg.sandboxes_dir().join(id);
        let Ok(bytes) = std::fs::read(dir.join(SAVED)) else {
            continue;
        };
        match serde_json::from_slice::<SavedNetwork>(&bytes) {
            Ok(s) => {
                if let Err(e) = net.readopt(id, &s).await {
                    tracing::error!(sandbox = %id, error = %e, "re-adopt sandbox network");
                }
            }
            Err(e) => tracing::error!(sandbox = %id, error = %e, "unreadable network.json"),
        }
    }
    let reaped = net.reap_orphans().await;
    if !reaped.is_empty() {
        tracing::warn!(count = reaped.len(), names = ?reaped, "removed leftover sandbox network objects");
    }
}
