//! The few calls the sandbox manager makes into networking and disk limits at create, stop
//! and recovery, so that the manager's own code changes by a line per step.

use std::path::Path;
use std::sync::Arc;

use dsec_runtime::substrate::{Capabilities, DiskLimit};
use dsec_wire::api::{CreateSandboxRequest, NetworkMode, NetworkSpec};
use serde::{Deserialize, Serialize};

use super::Network;
use crate::config::EdgeConfig;
use crate::error::EdgeError;

/// What a create gets beyond the plain spec.
#[derive(Default)]
pub struct Extras {
    pub netns: Option<Arc<std::os::fd::OwnedFd>>,
}

/// Persisted next to the record so a re-adopted sandbox keeps its network.
#[derive(Debug, Serialize, Deserialize)]
pub struct SavedNetwork {
    pub spec: NetworkSpec,
    pub host_no: u32,
    /// Namespace and host veth names (absent in records of older edges: derived from the id).
    #[serde(default)]
    pub ns: Option<String>,
    #[serde(default)]
    pub veth: Option<String>,
}

const SAVED: &str = "network.json";

/// Largest disk limit a request may ask for (MiB).
const MAX_DISK_MB: u64 = 1 << 20;

/// Validates the request's network, protected paths and disk limit, then builds what they
/// need: the limited file system, the namespace with its rules, `/etc/resolv.conf`.
pub async fn prepare(
    net: &Arc<Network>,
    cfg: &EdgeConfig,
    id: &str,
    dir: &Path,
    req: &CreateSandboxRequest,
    caps: &Capabilities,
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
    // A VM's writable layer is its own disk image, sized from the same limit by the substrate;
    // the host-side loop file system is for substrates that ask for it (containers).
    if disk_mb > 0 && caps.disk_limit == DiskLimit::HostFileSystem {
        let d = dir.to_path_buf();
        let bps = cfg.disk_bps_limit_mb.saturating_mul(1 << 20);
        tokio::task::spawn_blocking(move || crate::disk::prepare(&d, disk_mb, bps))
            .await
            .map_err(|e| EdgeError::Internal(format!("disk limit task: {e}")))?
            .map_err(|e| EdgeError::Internal(e.to_string()))?;
    }
    if policy.mode == NetworkMode::None {
        return Ok(Extras::default());
    }
    let spec = NetworkSpec {
        mode: Some(policy.mode),
        rules: policy.rules.clone(),
        groups: Some(policy.groups.clone()),
    };
    let att = match net.attach(id, policy).await {
        Ok(a) => a,
        Err(e) => {
            crate::disk::release(dir);
            return Err(e.into());
        }
    };
    let etc = dir.join("upper").join("etc");
    let written = std::fs::create_dir_all(&etc)
        .and_then(|()| std::fs::write(etc.join("resolv.conf"), &att.resolv_conf));
    if let Err(e) = written {
        release(net, id, dir).await;
        return Err(EdgeError::internal("write the sandbox's resolv.conf", &e));
    }
    save(net, id, dir, spec);
    Ok(Extras {
        netns: Some(att.netns),
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
/// added while it started; an error fails the create), and on cgroup v2 caps its disk I/O with
/// `io.max` (on v1 [`crate::disk::prepare`] already capped the loop device).
pub async fn started(
    net: &Arc<Network>,
    cfg: &EdgeConfig,
    id: &str,
    dir: &Path,
) -> Result<(), EdgeError> {
    net.rules_ready(id).await?;
    io_cap(cfg, id, dir);
    Ok(())
}

fn io_cap(cfg: &EdgeConfig, id: &str, dir: &Path) {
    if cfg.disk_bps_limit_mb == 0 || !dir.join("disk.img").exists() {
        return;
    }
    let root = dsec_runtime::cgroup::CgroupRoot::detect();
    if root.version != dsec_runtime::cgroup::CgroupVersion::V2 {
        return;
    }
    match dsec_runtime::cgroup::Cgroup::open(&root, &cfg.cgroup_parent(), id) {
        Ok(cg) => crate::disk::throttle_v2(
            cg.path(),
            dir,
            cfg.disk_bps_limit_mb.saturating_mul(1 << 20),
        ),
        Err(e) => tracing::warn!(sandbox = %id, error = %e, "I/O cap: open the sandbox cgroup"),
    }
}

/// Removes the sandbox's network and disk objects. Idempotent; problems are logged.
pub async fn release(net: &Arc<Network>, id: &str, dir: &Path) {
    if let Err(e) = net.detach(id).await {
        tracing::error!(sandbox = %id, error = %e, "remove sandbox network");
    }
    let d = dir.to_path_buf();
    let _ = tokio::task::spawn_blocking(move || crate::disk::release(&d)).await;
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
