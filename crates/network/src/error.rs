//! What can go wrong in sandbox networking.
//!
//! [`PolicyError`] is the user's mistake (a rule, a group, a mode change that cannot work: the
//! message says what to fix); [`NetError`] is everything a network operation can fail with,
//! a policy error among them. The edge maps both onto wire codes and HTTP statuses in its one
//! error module; nothing here knows about HTTP.

use crate::policy::MAX_RULES;

/// A network policy (from a create request, a live change or the edge config) that cannot
/// work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error("{input:?} is not an IPv4/IPv6 address or CIDR")]
    NotAnAddress { input: String },
    #[error("{input:?}: prefix length must be 0..={max}")]
    PrefixLength { input: String, max: u8 },
    #[error("{input:?}: host bits are set beyond the /{prefix} prefix")]
    HostBits { input: String, prefix: u8 },
    #[error("ports {input:?}: {port:?} is not a port 1-65535")]
    NotAPort { input: String, port: String },
    #[error("ports {input:?}: the range is reversed")]
    ReversedPorts { input: String },
    #[error("protocol {0:?} must be tcp, udp, icmp or any")]
    Protocol(String),
    /// An icmp-only rule named ports; carries the rule's CIDR.
    #[error("rule for {0}: icmp has no ports")]
    IcmpPorts(String),
    #[error("at most {MAX_RULES} network rules")]
    TooManyRules,
    #[error("network mode `none` takes no rules and enables no groups")]
    NoneWithRules,
    /// `known` lists the groups this edge has, comma-separated (`none` when it has none).
    #[error("unknown domain group {name:?} (this edge knows: {known})")]
    UnknownGroup { name: String, known: String },
    #[error("domain pattern {0:?} must be a lower-case name or `*.` followed by one")]
    Pattern(String),
    /// A value of the static DNS table that is not an address.
    #[error("{0:?} is not an IP address")]
    HostAddress(String),
    /// A live change to a sandbox created without networking.
    #[error("sandbox {0} was created with network mode `none`; its network namespace has only loopback and cannot be opened later (create it with `network.mode` allowlist or open)")]
    CreatedWithoutNetwork(String),
    #[error("a running sandbox cannot go back to mode `none`; use allowlist with no rules to cut it off")]
    BackToNone,
    /// A re-adopted sandbox's saved address number is already in use.
    #[error("address #{0} is taken")]
    AddressTaken(u32),
}

/// Why a network operation failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NetError {
    /// The request's rules are wrong; the message says how.
    #[error("network policy: {0}")]
    Policy(#[from] PolicyError),
    /// A tool (`ip`, `nft`, libnftables, a blocking task, the lock file) failed; `message`
    /// carries its own error text.
    #[error("{tool}: {message}")]
    Tool { tool: &'static str, message: String },
    /// Every address of the subnet (carried) is in use.
    #[error("no free sandbox address left in {0}")]
    Exhausted(String),
    #[error("DNS proxy: {0}")]
    Dns(String),
    /// Another edge on this host holds the network names ([`crate::owner`]).
    #[error("{0}")]
    InUse(String),
}
