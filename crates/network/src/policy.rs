//! Network policy: modes, allow rules and domain groups, validated into the form the
//! enforcement (nftables) and the DNS proxy use. Pure logic, no kernel calls.

use std::collections::BTreeMap;
use std::net::IpAddr;

use dsec_wire::api::{NetworkMode, NetworkRule, NetworkSpec};

use crate::error::PolicyError;

/// A transport protocol a rule allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Proto {
    Tcp,
    Udp,
    Icmp,
}

impl Proto {
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Icmp => "icmp",
        }
    }
}

/// An address block: the network address (host bits cleared) and the prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn is_v4(&self) -> bool {
        self.addr.is_ipv4()
    }

    /// True when `ip` lies in this block.
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let m = mask_v4(self.prefix);
                u32::from(n) & m == u32::from(a) & m
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let m = mask_v6(self.prefix);
                u128::from(n) & m == u128::from(a) & m
            }
            _ => false,
        }
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

fn mask_v4(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - u32::from(prefix))
    }
}

fn mask_v6(prefix: u8) -> u128 {
    if prefix == 0 {
        0
    } else {
        u128::MAX << (128 - u32::from(prefix))
    }
}

/// Parses `192.0.2.7`, `10.0.0.0/8`, `fd00::/64`; host bits must be zero.
pub fn parse_cidr(s: &str) -> Result<Cidr, PolicyError> {
    let (a, p) = match s.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (s, None),
    };
    let addr: IpAddr = a
        .trim()
        .parse()
        .map_err(|_| PolicyError::NotAnAddress { input: s.into() })?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let prefix =
        match p {
            None => max,
            Some(p) => p.parse::<u8>().ok().filter(|p| *p <= max).ok_or_else(|| {
                PolicyError::PrefixLength {
                    input: s.into(),
                    max,
                }
            })?,
        };
    let c = Cidr { addr, prefix };
    let clean = match addr {
        IpAddr::V4(v) => u32::from(v) & !mask_v4(prefix) == 0,
        IpAddr::V6(v) => u128::from(v) & !mask_v6(prefix) == 0,
    };
    if !clean {
        return Err(PolicyError::HostBits {
            input: s.into(),
            prefix,
        });
    }
    Ok(c)
}

/// Parses `443` or `8000-8100` (inclusive, 1..=65535).
pub fn parse_ports(s: &str) -> Result<(u16, u16), PolicyError> {
    let one = |p: &str| {
        p.trim()
            .parse::<u16>()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| PolicyError::NotAPort {
                input: s.into(),
                port: p.into(),
            })
    };
    let (lo, hi) = match s.split_once('-') {
        Some((a, b)) => (one(a)?, one(b)?),
        None => {
            let p = one(s)?;
            (p, p)
        }
    };
    if lo > hi {
        return Err(PolicyError::ReversedPorts { input: s.into() });
    }
    Ok((lo, hi))
}

/// One validated allow rule.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Allow {
    pub cidr: Cidr,
    pub proto: Proto,
    /// Inclusive port range (always `(0, 0)` for icmp).
    pub ports: (u16, u16),
}

/// Expands a wire rule into one [`Allow`] per protocol.
pub fn parse_rule(r: &NetworkRule) -> Result<Vec<Allow>, PolicyError> {
    let cidr = parse_cidr(&r.cidr)?;
    let protos: Vec<Proto> = match r
        .protocol
        .as_deref()
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        None | Some("any") | Some("") => vec![Proto::Tcp, Proto::Udp, Proto::Icmp],
        Some("tcp") => vec![Proto::Tcp],
        Some("udp") => vec![Proto::Udp],
        Some("icmp") | Some("icmpv6") => vec![Proto::Icmp],
        Some(p) => return Err(PolicyError::Protocol(p.into())),
    };
    let ports = match &r.ports {
        None => None,
        Some(p) => Some(parse_ports(p)?),
    };
    if ports.is_some() && protos == [Proto::Icmp] {
        return Err(PolicyError::IcmpPorts(r.cidr.clone()));
    }
    Ok(protos
        .into_iter()
        .filter(|p| !(ports.is_some() && *p == Proto::Icmp))
        .map(|proto| Allow {
            cidr,
            proto,
            ports: if proto == Proto::Icmp {
                (0, 0)
            } else {
                ports.unwrap_or((1, 65535))
            },
        })
        .collect())
}

/// Most rules one sandbox may have.
pub const MAX_RULES: usize = 256;

/// The effective network policy of one sandbox.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Policy {
    pub mode: NetworkMode,
    /// The rules as the user gave them (echoed back by `GET .../network`).
    pub rules: Vec<NetworkRule>,
    pub allows: Vec<Allow>,
    /// Domain groups as asked (`{"pypi": true, "npm": false}`).
    pub groups: BTreeMap<String, bool>,
    /// Domain patterns of the enabled groups (`pypi.test`, `*.pypi.test`), lower case.
    pub patterns: Vec<String>,
}

impl Policy {
    /// True when the DNS proxy may answer `name` for this sandbox.
    pub fn allows_name(&self, name: &str) -> bool {
        match self.mode {
            NetworkMode::None => false,
            NetworkMode::Open => true,
            NetworkMode::Allowlist => {
                let n = name.trim_end_matches('.').to_ascii_lowercase();
                self.patterns.iter().any(|p| pattern_matches(p, &n))
            }
        }
    }
}

/// `pypi.test` matches itself only; `*.pypi.test` matches every name below `pypi.test`.
pub fn pattern_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => {
            name.len() > suffix.len() + 1 && name.ends_with(suffix) && {
                name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
            }
        }
        None => pattern == name,
    }
}

/// Checks a domain pattern of the edge config: a name or `*.` + a name, lower case.
pub fn validate_pattern(p: &str) -> Result<(), PolicyError> {
    let name = p.strip_prefix("*.").unwrap_or(p);
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        });
    if ok {
        Ok(())
    } else {
        Err(PolicyError::Pattern(p.into()))
    }
}

/// Builds the policy of a create request: `network` (mode + rules) and the group map.
/// Unknown groups are an error so that a typo does not silently leave a sandbox offline.
pub fn from_request(
    spec: Option<&NetworkSpec>,
    network_rules: &BTreeMap<String, bool>,
    groups: &BTreeMap<String, Vec<String>>,
) -> Result<Policy, PolicyError> {
    let mut asked = network_rules.clone();
    if let Some(g) = spec.and_then(|s| s.groups.as_ref()) {
        asked.extend(g.iter().map(|(k, v)| (k.clone(), *v)));
    }
    let rules = spec.map(|s| s.rules.clone()).unwrap_or_default();
    let mode = match spec.and_then(|s| s.mode) {
        Some(m) => m,
        None if !rules.is_empty() || asked.values().any(|v| *v) => NetworkMode::Allowlist,
        None => NetworkMode::None,
    };
    build(mode, rules, asked, groups)
}

/// Applies a `PUT .../network` body to the current policy.
pub fn update(
    current: &Policy,
    spec: &NetworkSpec,
    groups: &BTreeMap<String, Vec<String>>,
) -> Result<Policy, PolicyError> {
    let mode = spec.mode.unwrap_or(current.mode);
    let asked = spec
        .groups
        .clone()
        .unwrap_or_else(|| current.groups.clone());
    build(mode, spec.rules.clone(), asked, groups)
}

fn build(
    mode: NetworkMode,
    rules: Vec<NetworkRule>,
    asked: BTreeMap<String, bool>,
    groups: &BTreeMap<String, Vec<String>>,
) -> Result<Policy, PolicyError> {
    if rules.len() > MAX_RULES {
        return Err(PolicyError::TooManyRules);
    }
    if mode == NetworkMode::None && (!rules.is_empty() || asked.values().any(|v| *v)) {
        return Err(PolicyError::NoneWithRules);
    }
    let mut allows = Vec::new();
    for r in &rules {
        allows.extend(parse_rule(r)?);
    }
    allows.sort();
    allows.dedup();
    let mut patterns = Vec::new();
    for (name, on) in &asked {
        let Some(ps) = groups.get(name) else {
            let known: Vec<&str> = groups.keys().map(String::as_str).collect();
            return Err(PolicyError::UnknownGroup {
                name: name.clone(),
                known: if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                },
            });
        };
        if *on {
            patterns.extend(ps.iter().map(|p| p.to_ascii_lowercase()));
        }
    }
    patterns.sort();
    patterns.dedup();
    Ok(Policy {
        mode,
        rules,
        allows,
        groups: asked,
        patterns,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(cidr: &str, ports: Option<&str>, proto: Option<&str>) -> NetworkRule {
        NetworkRule {
            cidr: cidr.into(),
            ports: ports.map(Into::into),
            protocol: proto.map(Into::into),
        }
    }

    fn groups() -> BTreeMap<String, Vec<String>> {
        [
            (
                "pypi".to_string(),
                vec!["pypi.test".to_string(), "*.pypi.test".to_string()],
            ),
            ("npm".to_string(), vec!["npm.test".to_string()]),
        ]
        .into()
    }

    #[test]
    fn cidrs() {
        assert_eq!(parse_cidr("10.0.0.0/8").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(parse_cidr("192.0.2.7").unwrap().prefix, 32);
        assert_eq!(parse_cidr("fd00::/64").unwrap().prefix, 64);
        assert_eq!(parse_cidr("::1").unwrap().prefix, 128);
        for bad in [
            "10.0.0.1/8",
            "10.0.0.0/33",
            "fd00::/129",
            "example.test",
            "",
            "1.2.3",
        ] {
            assert!(parse_cidr(bad).is_err(), "{bad}");
        }
        let c = parse_cidr("10.1.0.0/16").unwrap();
        assert!(c.contains("10.1.200.3".parse().unwrap()));
        assert!(!c.contains("10.2.0.1".parse().unwrap()));
        assert!(!c.contains("::1".parse().unwrap()));
        assert!(parse_cidr("0.0.0.0/0")
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
    }

    #[test]
    fn ports_and_protocols() {
        assert_eq!(parse_ports("443").unwrap(), (443, 443));
        assert_eq!(parse_ports("8000-8100").unwrap(), (8000, 8100));
        for bad in ["0", "70000", "9-1", "a", "1-", ""] {
            assert!(parse_ports(bad).is_err(), "{bad}");
        }
        let any = parse_rule(&rule("10.0.0.0/8", None, None)).unwrap();
        assert_eq!(any.len(), 3);
        let tcp = parse_rule(&rule("10.0.0.0/8", Some("80"), Some("TCP"))).unwrap();
        assert_eq!(
            tcp,
            vec![Allow {
                cidr: parse_cidr("10.0.0.0/8").unwrap(),
                proto: Proto::Tcp,
                ports: (80, 80)
            }]
        );
        // `any` with ports means tcp and udp on those ports.
        let two = parse_rule(&rule("fd00::/64", Some("53"), None)).unwrap();
        assert_eq!(
            two.iter().map(|a| a.proto).collect::<Vec<_>>(),
            vec![Proto::Tcp, Proto::Udp]
        );
        assert!(parse_rule(&rule("10.0.0.0/8", Some("1"), Some("icmp"))).is_err());
        assert!(parse_rule(&rule("10.0.0.0/8", None, Some("sctp"))).is_err());
    }

    #[test]
    fn patterns() {
        assert!(pattern_matches("pypi.test", "pypi.test"));
        assert!(!pattern_matches("pypi.test", "files.pypi.test"));
        assert!(pattern_matches("*.pypi.test", "files.pypi.test"));
        assert!(pattern_matches("*.pypi.test", "a.b.pypi.test"));
        assert!(!pattern_matches("*.pypi.test", "pypi.test"));
        assert!(!pattern_matches("*.pypi.test", "evilpypi.test"));
        assert!(validate_pattern("*.pypi.test").is_ok());
        assert!(validate_pattern("Pypi.test").is_err());
        assert!(validate_pattern("a..b").is_err());
        assert!(validate_pattern("*.").is_err());
    }

    #[test]
    fn modes_from_requests() {
        let g = groups();
        let p = from_request(None, &BTreeMap::new(), &g).unwrap();
        assert_eq!(p.mode, NetworkMode::None);
        let p = from_request(
            None,
            &[("pypi".to_string(), true), ("npm".to_string(), false)].into(),
            &g,
        )
        .unwrap();
        assert_eq!(p.mode, NetworkMode::Allowlist);
        assert_eq!(p.patterns, vec!["*.pypi.test", "pypi.test"]);
        assert!(p.allows_name("pypi.test") && p.allows_name("Files.PyPI.test."));
        assert!(!p.allows_name("npm.test") && !p.allows_name("evil.test"));
        // A denied group alone does not turn networking on.
        let p = from_request(None, &[("npm".to_string(), false)].into(), &g).unwrap();
        assert_eq!(p.mode, NetworkMode::None);
        assert!(from_request(None, &[("nope".to_string(), true)].into(), &g)
            .unwrap_err()
            .to_string()
            .contains("unknown domain group"));
        let spec = NetworkSpec {
            mode: Some(NetworkMode::None),
            rules: vec![rule("10.0.0.0/8", None, None)],
            groups: None,
        };
        assert!(from_request(Some(&spec), &BTreeMap::new(), &g).is_err());
        let spec = NetworkSpec {
            mode: None,
            rules: vec![rule("10.0.0.0/8", Some("80"), Some("tcp"))],
            groups: None,
        };
        let p = from_request(Some(&spec), &BTreeMap::new(), &g).unwrap();
        assert_eq!(p.mode, NetworkMode::Allowlist);
        let open = Policy {
            mode: NetworkMode::Open,
            ..Default::default()
        };
        assert!(open.allows_name("anything.test"));
    }

    #[test]
    fn updates_keep_what_is_not_named() {
        let g = groups();
        let cur = from_request(None, &[("pypi".to_string(), true)].into(), &g).unwrap();
        let next = update(
            &cur,
            &NetworkSpec {
                mode: None,
                rules: vec![rule("192.0.2.0/24", Some("443"), Some("tcp"))],
                groups: None,
            },
            &g,
        )
        .unwrap();
        assert_eq!(next.mode, NetworkMode::Allowlist);
        assert_eq!(next.groups, cur.groups);
        assert_eq!(next.allows.len(), 1);
        let off = update(
            &next,
            &NetworkSpec {
                mode: None,
                rules: vec![],
                groups: Some([("pypi".to_string(), false)].into()),
            },
            &g,
        )
        .unwrap();
        assert!(off.patterns.is_empty() && off.allows.is_empty());
    }
}
