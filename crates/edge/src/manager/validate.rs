//! Checking a create request against the node's configuration and its substrate (pure).

use dsec_runtime::substrate::ImageSource;
use dsec_wire::api::CreateSandboxRequest;

use crate::config::EdgeConfig;
use crate::error::EdgeError;
use crate::names::{validate_hostname, validate_user};
use crate::substrates::Substrates;

/// Limits of a create request after defaults were applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Validated {
    pub image: String,
    /// Canonical workspace image name, if any.
    pub workspace: Option<String>,
    /// Canonical toolkit image names, bottom-most first.
    pub toolkits: Vec<String>,
    pub memory_mb: u64,
    pub cpu: f64,
    pub pids: u64,
    pub user: String,
    pub hostname: Option<String>,
    /// The request's QoS class, else the edge's default.
    pub qos: dsec_wire::api::QosClass,
}

fn check_map(
    key: &str,
    m: &std::collections::BTreeMap<String, impl AsRef<str>>,
    max_key: usize,
    max_val: usize,
) -> Result<(), EdgeError> {
    if m.len() > 128 {
        return Err(EdgeError::BadRequest(format!("{key}: at most 128 entries")));
    }
    for (k, v) in m {
        if k.is_empty()
            || k.len() > max_key
            || k.contains('\0')
            || v.as_ref().len() > max_val
            || v.as_ref().contains('\0')
        {
            return Err(EdgeError::BadRequest(format!(
                "{key}: entry {k:?} must have a 1..={max_key}-byte name and a value of at most {max_val} bytes, without NUL"
            )));
        }
    }
    Ok(())
}

/// Validates a create request against the node's configuration and the substrate it asks
/// for (pure; no admission).
pub fn validate_create(
    cfg: &EdgeConfig,
    substrates: &Substrates,
    req: &CreateSandboxRequest,
) -> Result<Validated, EdgeError> {
    let substrate = substrates.get(req.substrate)?;
    substrate
        .check_request(req)
        .map_err(|e| EdgeError::BadRequest(e.0))?;
    let image = match substrate.capabilities().image_source {
        ImageSource::Layers => dsec_image::canonical_name(&req.image).map_err(EdgeError::Image)?,
        // Checked by the substrate; resolved to its file when the sandbox is built.
        ImageSource::DiskImage => req.image.clone(),
    };
    let workspace = match &req.workspace {
        Some(w) => Some(dsec_image::canonical_name(w).map_err(EdgeError::Image)?),
        None => None,
    };
    if req.toolkits.len() > 16 {
        return Err(EdgeError::BadRequest(
            "at most 16 toolkits per sandbox".into(),
        ));
    }
    let toolkits = req
        .toolkits
        .iter()
        .map(|t| dsec_image::canonical_name(t).map_err(EdgeError::Image))
        .collect::<Result<Vec<_>, _>>()?;
    let memory_mb = req.memory_limit_mb.unwrap_or(cfg.default_memory_mb);
    if memory_mb < 16 || memory_mb > cfg.max_memory_mb {
        return Err(EdgeError::BadRequest(format!(
            "memory_limit_mb {memory_mb} must be between 16 and this node's maximum of {}",
            cfg.max_memory_mb
        )));
    }
    let cpu = req.cpu_cores_limit.unwrap_or(cfg.default_cpu_cores);
    if !(cpu.is_finite() && cpu >= 0.01 && cpu <= cfg.max_cpu_cores) {
        return Err(EdgeError::BadRequest(format!(
            "cpu_cores_limit {cpu} must be between 0.01 and this node's maximum of {}",
            cfg.max_cpu_cores
        )));
    }
    let pids = req.pids_limit.unwrap_or(cfg.default_pids);
    if pids < 8 || pids > cfg.max_pids {
        return Err(EdgeError::BadRequest(format!(
            "pids_limit {pids} must be between 8 and this node's maximum of {}",
            cfg.max_pids
        )));
    }
    let user = req.init_user.clone().unwrap_or_else(|| "root".to_string());
    validate_user("init_user", &user)?;
    if let Some(h) = &req.hostname {
        validate_hostname(h)?;
    }
    for (key, v) in [
        ("ttl_running_stop", req.ttl_running_stop),
        ("ttl_total", req.ttl_total),
    ] {
        if v == Some(0) {
            return Err(EdgeError::BadRequest(format!(
                "{key} must be at least 1 second (omit it for no limit)"
            )));
        }
    }
    check_map("env", &req.env, 256, 128 * 1024)?;
    if req.env.keys().any(|k| k.contains('=')) {
        return Err(EdgeError::BadRequest(
            "env: variable names must not contain '='".into(),
        ));
    }
    check_map("labels", &req.labels, 128, 1024)?;
    let rules: std::collections::BTreeMap<String, String> = req
        .network_rules
        .iter()
        .map(|(k, v)| (k.clone(), v.to_string()))
        .collect();
    check_map("network_rules", &rules, 64, 8)?;
    if let Some(k) = &req.idempotency_key {
        if k.is_empty() || k.len() > 256 {
            return Err(EdgeError::BadRequest(
                "idempotency_key must be 1..=256 bytes".into(),
            ));
        }
    }
    Ok(Validated {
        image,
        workspace,
        toolkits,
        memory_mb,
        cpu,
        pids,
        user,
        hostname: req.hostname.clone(),
        qos: dsec_node::qos::resolve(req.qos, &cfg.qos),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manager::tests::NoDriver;
    use dsec_wire::api::Substrate;
    use std::sync::Arc;

    /// [`validate_create`] on a node that runs containers only.
    fn validate(cfg: &EdgeConfig, req: &CreateSandboxRequest) -> Result<Validated, EdgeError> {
        validate_create(cfg, &Substrates::only("n0", Arc::new(NoDriver)), req)
    }

    fn req(image: &str) -> CreateSandboxRequest {
        CreateSandboxRequest {
            image: image.into(),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_applied() {
        let cfg = EdgeConfig::default();
        let v = validate(&cfg, &req("busybox")).unwrap();
        assert_eq!(v.image, "busybox:latest");
        assert_eq!(v.memory_mb, 1024);
        assert_eq!(v.cpu, 1.0);
        assert_eq!(v.pids, 1024);
        assert_eq!(v.user, "root");
    }

    #[test]
    fn rejections() {
        let cfg = EdgeConfig::default();
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                substrate: Substrate::Function,
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert_eq!(e.status().as_u16(), 501);
        assert!(e.to_string().contains("container"));
        assert_eq!(
            validate(&cfg, &req("Bad Name"))
                .unwrap_err()
                .status()
                .as_u16(),
            400
        );
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                memory_limit_mb: Some(1 << 30),
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("memory_limit_mb"));
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                cpu_cores_limit: Some(f64::INFINITY),
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("cpu_cores_limit"));
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                pids_limit: Some(1),
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("pids_limit"));
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                init_user: Some("ro ot".into()),
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("init_user"));
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                hostname: Some("-bad".into()),
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("hostname"));
        let e = validate(
            &cfg,
            &CreateSandboxRequest {
                ttl_total: Some(0),
                ..req("busybox")
            },
        )
        .unwrap_err();
        assert!(e.to_string().contains("ttl_total"));
    }
}
