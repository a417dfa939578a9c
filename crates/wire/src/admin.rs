//! Wire types of the apiserver's admin routes: projects and quotas (`/v1/projects`), API keys
//! (`/v1/keys`) and the cluster view (`GET /v1/cluster`, what `dsec top` shows).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Limits of one project; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Quota {
    #[serde(default)]
    pub max_sandboxes: Option<u64>,
    #[serde(default)]
    pub max_cpu_cores: Option<f64>,
    #[serde(default)]
    pub max_memory_mb: Option<u64>,
    #[serde(default)]
    pub max_creates_per_s: Option<u64>,
}

/// What a project (with its descendants) uses now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Usage {
    pub sandboxes: u64,
    pub cpu_cores: f64,
    pub memory_mb: u64,
}

/// A project as the admin API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProjectView {
    pub name: String,
    pub parent: Option<String>,
    pub quota: Quota,
    pub usage: Usage,
}

/// `GET /v1/projects`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProjectList {
    pub projects: Vec<ProjectView>,
}

/// `POST /v1/projects`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateProjectRequest {
    pub name: String,
    /// Parent project (default `root`).
    #[serde(default)]
    pub parent: Option<String>,
    #[serde(default)]
    pub quota: Option<Quota>,
}

/// `POST /v1/keys`: a key for a (new or existing) principal.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateKeyRequest {
    /// Principal name; created when it does not exist.
    pub principal: String,
    /// Home project of a new principal (default `default`).
    #[serde(default)]
    pub project: Option<String>,
    /// `user` (default) or `admin`.
    #[serde(default)]
    pub kind: Option<String>,
}

/// Answer of `POST /v1/keys`: the only time the plaintext key exists outside its holder.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CreatedKey {
    pub principal: String,
    pub project: String,
    pub kind: String,
    /// Public id of the key (first 16 hex characters of its hash), for `revoke`.
    pub key_id: String,
    pub key: String,
}

/// Answer of `DELETE /v1/keys/{id}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RevokedKey {
    /// The key id (or key) as given.
    pub revoked: String,
    /// Sandboxes stopped with it (`?stop_sandboxes=true`; end reason `quota_revoked`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stopped_sandboxes: Vec<String>,
}

/// How placement chooses among filtered nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    #[default]
    PowerOfK,
    Random,
    LeastLoaded,
}

/// A placement strategy name that is not one of [`Strategy`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown placement strategy {0:?}: use power_of_k, random or least_loaded")]
pub struct UnknownStrategy(pub String);

impl std::str::FromStr for Strategy {
    type Err = UnknownStrategy;
    fn from_str(s: &str) -> Result<Self, UnknownStrategy> {
        match s {
            "power_of_k" | "power-of-k" | "pok" => Ok(Strategy::PowerOfK),
            "random" => Ok(Strategy::Random),
            "least_loaded" | "least-loaded" => Ok(Strategy::LeastLoaded),
            _ => Err(UnknownStrategy(s.to_string())),
        }
    }
}

/// One node in the cluster view.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClusterNode {
    pub node: String,
    pub url: String,
    pub healthy: bool,
    pub sandboxes: u64,
    pub capacity: u64,
    pub load: f64,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub last_error: Option<String>,
    /// Milliseconds since the node last answered a poll.
    #[serde(default)]
    pub last_seen_ms_ago: Option<u64>,
}

/// `GET /v1/cluster`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClusterView {
    pub nodes: Vec<ClusterNode>,
    pub sandboxes: u64,
    pub capacity: u64,
    pub healthy_nodes: u64,
    pub primary_utilisation: f64,
    pub overflow_threshold: f64,
    pub placement: Strategy,
    /// Counters of this apiserver replica since it started.
    pub created_total: u64,
    pub quota_refusals_total: u64,
    pub placement_refusals_total: u64,
    pub overflow_placements_total: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strategy_names() {
        assert_eq!("pok".parse::<Strategy>(), Ok(Strategy::PowerOfK));
        assert_eq!(
            "least-loaded".parse::<Strategy>(),
            Ok(Strategy::LeastLoaded)
        );
        let e = "fastest".parse::<Strategy>().unwrap_err();
        assert!(e.to_string().contains("power_of_k"), "{e}");
        assert_eq!(
            serde_json::to_value(Strategy::PowerOfK).unwrap(),
            serde_json::json!("power_of_k")
        );
    }

    #[test]
    fn quota_refuses_unknown_fields() {
        assert!(serde_json::from_str::<Quota>(r#"{"max_cpus": 2}"#).is_err());
        let q: Quota = serde_json::from_str(r#"{"max_cpu_cores": 2}"#).unwrap();
        assert_eq!(q.max_cpu_cores, Some(2.0));
    }
}
