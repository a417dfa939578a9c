//! Sandbox networking: mode, allow rules, DNS grants and status (`/v1/sandboxes/{id}/network`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Network mode of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum NetworkMode {
    /// Loopback only.
    #[default]
    None,
    /// Only what the rules and the enabled domain groups allow.
    Allowlist,
    /// Everything outside the node (the edge, other sandboxes and the host stay unreachable).
    Open,
}

/// One allow rule: destination address or CIDR, optional port range, optional protocol.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NetworkRule {
    /// IPv4 or IPv6 address or CIDR: `192.0.2.7`, `10.0.0.0/8`, `fd00::/64`.
    pub cidr: String,
    /// `443` or `8000-8100`; absent means every port. Not allowed with `icmp`.
    #[serde(default)]
    pub ports: Option<String>,
    /// `tcp`, `udp`, `icmp` or `any` (default).
    #[serde(default)]
    pub protocol: Option<String>,
}

/// Body part of a create (`network`) and of `PUT /v1/sandboxes/{id}/network`.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// Absent: `allowlist` if rules or enabled groups are given, else `none` (on PUT: unchanged).
    #[serde(default)]
    pub mode: Option<NetworkMode>,
    #[serde(default)]
    pub rules: Vec<NetworkRule>,
    /// Domain groups (as `network_rules`); on PUT, absent keeps the current groups.
    #[serde(default)]
    pub groups: Option<BTreeMap<String, bool>>,
}

/// A name the DNS proxy answered for a sandbox, and the address it allowed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DnsGrant {
    pub name: String,
    pub address: String,
    /// Seconds left before the address leaves the allow set.
    pub expires_in_s: u64,
}

/// `GET /v1/sandboxes/{id}/network` (and the answer of `PUT`).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NetworkStatus {
    pub mode: NetworkMode,
    pub rules: Vec<NetworkRule>,
    pub groups: BTreeMap<String, bool>,
    /// The sandbox's addresses (absent in mode `none`).
    #[serde(default)]
    pub ipv4: Option<String>,
    #[serde(default)]
    pub ipv6: Option<String>,
    /// The resolver the sandbox uses (the edge's DNS proxy).
    #[serde(default)]
    pub resolver: Option<String>,
    /// Packets the host dropped for this sandbox (connection attempts to non-allowed places).
    pub denied_packets: u64,
    /// DNS questions refused (name not allowed) and answered.
    pub dns_refused: u64,
    pub dns_answered: u64,
    #[serde(default)]
    pub dns_grants: Vec<DnsGrant>,
}
