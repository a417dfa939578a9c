//! CPU QoS classes and overcommit admission (issue 10, DESIGN.md §7).
//!
//! Every sandbox has a [`QosClass`]: the create request's, else the edge's
//! `qos.default_class`. It is recorded in [`SandboxInfo::qos`] (and so in the sandbox record:
//! it survives an edge restart). The reclaim side lists best-effort sandboxes with
//! [`class_of`] over [`crate::Manager::list`].

use dsec_wire::api::{QosClass, SandboxInfo};
use serde::{Deserialize, Serialize};

/// `[edge.qos]`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QosConfig {
    /// Class of a sandbox whose create request names none.
    pub default_class: QosClass,
}

impl Default for QosConfig {
    fn default() -> Self {
        Self {
            default_class: QosClass::LatencySensitive,
        }
    }
}

impl QosConfig {
    /// Checks the values; `Err((key, message))` names the bad key.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        Ok(())
    }
}

/// The class a create request gets on this edge.
pub fn resolve(requested: Option<QosClass>, cfg: &QosConfig) -> QosClass {
    requested.unwrap_or(cfg.default_class)
}

/// The QoS class of a sandbox (what the reclaim policy filters on).
pub fn class_of(info: &SandboxInfo) -> QosClass {
    info.qos
}

/// True for a best-effort sandbox.
pub fn is_best_effort(info: &SandboxInfo) -> bool {
    class_of(info) == QosClass::BestEffort
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_and_requested() {
        let cfg = QosConfig::default();
        assert_eq!(resolve(None, &cfg), QosClass::LatencySensitive);
        assert_eq!(
            resolve(Some(QosClass::BestEffort), &cfg),
            QosClass::BestEffort
        );
        let be = QosConfig {
            default_class: QosClass::BestEffort,
        };
        assert_eq!(resolve(None, &be), QosClass::BestEffort);
        assert_eq!(
            resolve(Some(QosClass::LatencySensitive), &be),
            QosClass::LatencySensitive
        );
        let info = SandboxInfo {
            qos: QosClass::BestEffort,
            ..Default::default()
        };
        assert!(is_best_effort(&info));
        let t: QosConfig = toml::from_str("default_class = \"best_effort\"").unwrap();
        assert_eq!(t.default_class, QosClass::BestEffort);
    }
}
