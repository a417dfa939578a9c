//! Apiserver configuration: typed defaults, serde for TOML, one `validate()`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One edge the apiserver forwards to.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EdgeEndpoint {
    /// Node id (`[a-z0-9]{1,16}`). When absent it is learned from the edge's `/edge/v1/status`.
    #[serde(default)]
    pub node_id: Option<String>,
    /// Base URL of the edge, e.g. `http://127.0.0.1:7481`.
    pub url: String,
    /// Bearer token of the edge.
    pub token: String,
}

impl EdgeEndpoint {
    /// Parses `URL[#token]` (the `--edge` command-line form).
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        let (url, token) = match s.split_once('#') {
            Some((u, t)) => (u, t),
            None => (s, ""),
        };
        let e = EdgeEndpoint {
            node_id: None,
            url: url.trim_end_matches('/').to_string(),
            token: token.to_string(),
        };
        e.validate("edge")?;
        Ok(e)
    }

    fn validate(&self, key: &str) -> Result<(), ConfigError> {
        if !(self.url.starts_with("http://") || self.url.starts_with("https://")) {
            return Err(ConfigError::Invalid {
                key: format!("{key}.url"),
                message: format!("{:?} must start with http:// or https://", self.url),
            });
        }
        if let Some(node) = &self.node_id {
            if !valid_node_id(node) {
                return Err(ConfigError::Invalid {
                    key: format!("{key}.node_id"),
                    message: format!("{node:?} must match [a-z0-9]{{1,16}}"),
                });
            }
        }
        Ok(())
    }
}

/// Typed apiserver configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    /// Address the public API listens on.
    pub listen: SocketAddr,
    /// IAM and quota store (principals, API keys, projects, quotas, usage, idempotency keys):
    /// a SQLite path (or `sqlite:///path`), or a `postgres://user@host:port/db` URL.
    pub db_path: PathBuf,
    /// Edges to forward to.
    pub edges: Vec<EdgeEndpoint>,
    /// How often the watcher polls each edge, in milliseconds.
    pub watcher_period_ms: u64,
    /// How long a verified API key stays cached in memory, in milliseconds.
    pub key_cache_ms: u64,
    /// Timeout for connecting to an edge, in milliseconds.
    pub edge_connect_timeout_ms: u64,
    /// `[apiserver.placement]`: strategy, k, retries, overflow pool.
    pub placement: crate::placement::PlacementConfig,
    /// Memory charged to quotas when a create names no limit (the edges' default), MiB.
    pub default_memory_mb: u64,
    /// CPU charged to quotas when a create names no limit (the edges' default), cores.
    pub default_cpu_cores: f64,
    /// How often quota usage is reconciled with the sandboxes the edges really have, ms.
    pub reconcile_period_ms: u64,
    /// After how long without an answer from its node a sandbox counts as ended with
    /// `node_lost` (GET answers it `failed`, other calls 410), ms.
    pub node_lost_after_ms: u64,
    /// Exposed ports by host name: a request whose `Host` is `{port}-{sandbox id}.{domain}`
    /// goes to that sandbox port (point a wildcard DNS name at the apiserver). Unset: only the
    /// `/v1/sandboxes/{id}/ports/{port}/...` form.
    pub sandbox_domain: Option<String>,
    /// Secret that signs port URL tokens; every apiserver replica must share it. Unset: a
    /// random one per process (tokens then stop working when it restarts).
    pub port_url_secret: Option<String>,
    /// Cluster join token edges present to `POST /v1/nodes/join` (`dsec edge --join URL
    /// --token T`); tokens issued by `dsec node token create` are accepted too. With one set,
    /// the static `edges` list may be empty.
    pub join_token: Option<String>,
    /// How often a joined edge heartbeats, ms (told to it in the join answer).
    pub heartbeat_period_ms: u64,
    /// A joined edge without a heartbeat for this long is `suspect` (no placements), ms.
    pub heartbeat_timeout_ms: u64,
    /// How often membership rows are re-read and node states judged, ms.
    pub membership_sync_ms: u64,

    /// `[apiserver.e2b]`: the size of sandboxes created through the E2B API.
    pub e2b: crate::compat::e2b::config::E2bConfig,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 7480)),
            db_path: PathBuf::from("/var/lib/dsec/apiserver.db"),
            edges: Vec::new(),
            watcher_period_ms: 1000,
            key_cache_ms: 10_000,
            edge_connect_timeout_ms: 3000,
            placement: Default::default(),
            default_memory_mb: 1024,
            default_cpu_cores: 1.0,
            reconcile_period_ms: 10_000,
            node_lost_after_ms: 60_000,
            sandbox_domain: None,
            port_url_secret: None,
            join_token: None,
            heartbeat_period_ms: 1000,
            heartbeat_timeout_ms: 5000,
            membership_sync_ms: 500,

            e2b: Default::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid config key {key}: {message}")]
    Invalid { key: String, message: String },
}

impl ApiConfig {
    /// Checks every key; the error names the bad one.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.edges.is_empty() && self.join_token.is_none() {
            return Err(ConfigError::Invalid {
                key: "edges".into(),
                message: "at least one edge is required (or a join_token, so edges can join)"
                    .into(),
            });
        }
        if self.join_token.as_deref().is_some_and(|t| t.len() < 16) {
            return Err(ConfigError::Invalid {
                key: "join_token".into(),
                message: "must be at least 16 characters".into(),
            });
        }
        for (key, v) in [
            ("heartbeat_period_ms", self.heartbeat_period_ms),
            ("heartbeat_timeout_ms", self.heartbeat_timeout_ms),
            ("membership_sync_ms", self.membership_sync_ms),
        ] {
            if v == 0 {
                return Err(ConfigError::Invalid {
                    key: key.into(),
                    message: "must be > 0".into(),
                });
            }
        }
        if self.heartbeat_timeout_ms <= self.heartbeat_period_ms {
            return Err(ConfigError::Invalid {
                key: "heartbeat_timeout_ms".into(),
                message: format!(
                    "must be more than heartbeat_period_ms ({})",
                    self.heartbeat_period_ms
                ),
            });
        }
        for (i, e) in self.edges.iter().enumerate() {
            e.validate(&format!("edges[{i}]"))?;
        }
        if self.watcher_period_ms == 0 {
            return Err(ConfigError::Invalid {
                key: "watcher_period_ms".into(),
                message: "must be > 0".into(),
            });
        }
        self.placement.validate()?;
        if self.reconcile_period_ms == 0 {
            return Err(ConfigError::Invalid {
                key: "reconcile_period_ms".into(),
                message: "must be > 0".into(),
            });
        }
        if self.node_lost_after_ms == 0 {
            return Err(ConfigError::Invalid {
                key: "node_lost_after_ms".into(),
                message: "must be > 0".into(),
            });
        }
        if let Some(d) = &self.sandbox_domain {
            if !crate::ports::valid_domain(d) {
                return Err(ConfigError::Invalid {
                    key: "sandbox_domain".into(),
                    message: format!(
                        "{d:?} must be a DNS name of lower-case letters, digits, `-` and `.` (like sbx.example.test)"
                    ),
                });
            }
        }
        if self
            .port_url_secret
            .as_deref()
            .is_some_and(|s| s.len() < 16)
        {
            return Err(ConfigError::Invalid {
                key: "port_url_secret".into(),
                message: "must be at least 16 characters".into(),
            });
        }
        if let Some((key, message)) = self.e2b.invalid() {
            return Err(ConfigError::Invalid {
                key: key.into(),
                message,
            });
        }
        if self.db_path.as_os_str().is_empty() {
            return Err(ConfigError::Invalid {
                key: "db_path".into(),
                message: "must not be empty".into(),
            });
        }
        Ok(())
    }

    pub fn watcher_period(&self) -> Duration {
        Duration::from_millis(self.watcher_period_ms)
    }
}

/// `[a-z0-9]{1,16}`, the node part of a sandbox id.
pub fn valid_node_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 16
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_edge_with_token() {
        let e = EdgeEndpoint::parse("http://127.0.0.1:9/#tok").unwrap();
        assert_eq!(e.url, "http://127.0.0.1:9");
        assert_eq!(e.token, "tok");
        assert!(EdgeEndpoint::parse("127.0.0.1:9").is_err());
    }

    #[test]
    fn validate_names_key() {
        let c = ApiConfig::default();
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("edges"), "{err}");
        let mut c = ApiConfig::default();
        c.edges.push(EdgeEndpoint {
            node_id: Some("N0".into()),
            url: "http://x".into(),
            token: String::new(),
        });
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("edges[0].node_id"), "{err}");
    }
}
