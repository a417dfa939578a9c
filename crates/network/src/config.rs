//! `[edge.network]` of the edge config: typed, with defaults and one `validate`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{dns, policy};

/// A `[edge.network]` value that cannot work; `key` is the TOML key below `edge`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct NetworkConfigError {
    pub key: &'static str,
    pub message: String,
}

/// `[edge.network]` of the config file.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetworkConfig {
    /// Private IPv4 block sandboxes get addresses from; its first address is the gateway and
    /// the DNS proxy's address.
    pub subnet_v4: String,
    /// ULA IPv6 block (a /64) for sandbox addresses.
    pub subnet_v6: String,
    /// nftables table (family `inet`) the edge owns; also the prefix of namespace names.
    pub table: String,
    /// Prefix of the host ends of sandbox veths (1-3 characters).
    pub veth_prefix: String,
    /// Dummy interface holding the gateway address.
    pub gateway_interface: String,
    /// Domain groups: `pypi = ["pypi.test", "*.pypi.test"]`.
    pub groups: BTreeMap<String, Vec<String>>,
    /// Static DNS table: `"pypi.test" = "192.0.2.10"` (several addresses comma-separated;
    /// `*.name` entries answer every name below).
    pub hosts: BTreeMap<String, String>,
    /// TTL of answers from `hosts`; a granted address leaves the allow set when it expires.
    pub dns_ttl_s: u32,
    /// TCP ports a name resolved through an enabled group may be reached on.
    pub domain_ports: Vec<u16>,
    /// MTU of sandbox veths. Large by default, like loopback: traffic between a sandbox and
    /// the node's or other local hosts' services moves in few packets, while TCP to the outside
    /// gets its MSS clamped to the outgoing route's MTU in the forward hook.
    pub mtu: u32,
    /// Spare namespaces with configured veths kept ready after the first networked create,
    /// so that a create only adds its rules (0: build each sandbox's namespace on demand).
    pub pool_size: usize,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        Self {
            subnet_v4: "10.201.0.0/16".into(),
            subnet_v6: "fd00:d5ec::/64".into(),
            table: "dsec".into(),
            veth_prefix: "dsv".into(),
            gateway_interface: "dsec0".into(),
            // The groups the SDK's examples name (`network_rules={"pypi": True, "npm": False}`)
            // exist out of the box, with made-up `.test` names: an operator points them at the
            // package mirrors of their site in `[edge.network.groups]`.
            groups: BTreeMap::from([
                (
                    "pypi".to_string(),
                    vec!["pypi.test".to_string(), "*.pypi.test".to_string()],
                ),
                (
                    "npm".to_string(),
                    vec!["npm.test".to_string(), "*.npm.test".to_string()],
                ),
            ]),
            hosts: BTreeMap::new(),
            dns_ttl_s: 60,
            domain_ports: vec![80, 443],
            pool_size: 8,
            mtu: 65520,
        }
    }
}

fn bad(key: &'static str, message: impl std::fmt::Display) -> NetworkConfigError {
    NetworkConfigError {
        key,
        message: message.to_string(),
    }
}

impl NetworkConfig {
    /// Checks every value; the error names the first bad key.
    pub fn validate(&self) -> Result<(), NetworkConfigError> {
        let v4 = policy::parse_cidr(&self.subnet_v4).map_err(|m| bad("network.subnet_v4", m))?;
        if !v4.is_v4() || !(8..=24).contains(&v4.prefix) {
            return Err(bad(
                "network.subnet_v4",
                "must be an IPv4 block from /8 to /24",
            ));
        }
        let v6 = policy::parse_cidr(&self.subnet_v6).map_err(|m| bad("network.subnet_v6", m))?;
        if v6.is_v4() || v6.prefix != 64 {
            return Err(bad("network.subnet_v6", "must be an IPv6 /64"));
        }
        let ident = |s: &str, max: usize| {
            !s.is_empty()
                && s.len() <= max
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        };
        if !ident(&self.table, 24) {
            return Err(bad("network.table", "must be 1-24 characters of [a-z0-9_]"));
        }
        if !ident(&self.veth_prefix, 3) {
            return Err(bad(
                "network.veth_prefix",
                "must be 1-3 characters of [a-z0-9_]",
            ));
        }
        if !ident(&self.gateway_interface, 15) {
            return Err(bad(
                "network.gateway_interface",
                "must be 1-15 characters of [a-z0-9_]",
            ));
        }
        for (g, patterns) in &self.groups {
            for p in patterns {
                policy::validate_pattern(p)
                    .map_err(|m| bad("network.groups", format!("{g}: {m}")))?;
            }
        }
        for (name, addrs) in &self.hosts {
            policy::validate_pattern(name).map_err(|m| bad("network.hosts", m))?;
            dns::parse_addrs(addrs).map_err(|m| bad("network.hosts", format!("{name}: {m}")))?;
        }
        if !(1280..=65535).contains(&self.mtu) {
            return Err(bad(
                "network.mtu",
                "must be 1280..=65535 (IPv6 needs at least 1280)",
            ));
        }
        if self.pool_size > 1024 {
            return Err(bad("network.pool_size", "must be 0..=1024"));
        }
        if self.domain_ports.contains(&0) {
            return Err(bad("network.domain_ports", "ports must be 1-65535"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validation() {
        assert!(NetworkConfig::default().validate().is_ok());
        let c = NetworkConfig {
            subnet_v4: "10.0.0.0/30".into(),
            ..Default::default()
        };
        assert_eq!(c.validate().unwrap_err().key, "network.subnet_v4");
        let c = NetworkConfig {
            veth_prefix: "toolong".into(),
            ..Default::default()
        };
        assert_eq!(c.validate().unwrap_err().key, "network.veth_prefix");
        let mut c = NetworkConfig::default();
        c.hosts.insert("pypi.test".into(), "not-an-ip".into());
        assert_eq!(c.validate().unwrap_err().key, "network.hosts");
        let mut c = NetworkConfig::default();
        c.groups.insert("pypi".into(), vec!["PyPI.test".into()]);
        assert_eq!(c.validate().unwrap_err().key, "network.groups");
    }
}
