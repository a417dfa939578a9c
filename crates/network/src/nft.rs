//! Host-side enforcement with nftables: one table (`inet <table>`) owned by the edge.
//!
//! Base chains hook `forward` (sandbox to anywhere off the node) and `input` (sandbox to the
//! host itself) and dispatch on the incoming veth through verdict maps to a per-sandbox chain;
//! a veth without an entry is dropped. A sandbox's chain drops spoofed source addresses, lets
//! established flows through, refuses every node-internal address (the edge, other sandboxes)
//! and then accepts only what its allow rules name; everything else hits the sandbox's named
//! counter and is dropped. Static allows are one rule each (`ip daddr <cidr> meta l4proto <p>
//! th dport <range> accept`); DNS grants live in two sets (`addr . port` with per-element
//! timeouts, filled by the DNS proxy). Every change is one nftables transaction (in-process
//! through [`crate::libnft`], else `nft -f`), so a rule update is atomic and applies to the next
//! packet of a new connection.
//!
//! No interval sets, named or anonymous: before every transaction that adds a rule or an
//! element, libnftables 1.0.6 refreshes its cache of the whole ruleset and dumps the elements
//! of every interval set of every table, one netlink dump per set. With four interval sets per
//! sandbox a networked create cost 14 ms of nftables time with 200 sandboxes on the node and
//! 94 ms with 500 (superlinear), and so did every DNS grant. Allow lists are short and only the
//! first packet of a connection walks them (established flows are accepted before), so plain
//! rules cost nothing measurable on the data path.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::{Command, Stdio};
use std::time::Duration;

use dsec_wire::api::NetworkMode;

use crate::policy::{Allow, Cidr, Proto};
use crate::NetError;

/// Names and addresses the base table is built from.
#[derive(Debug, Clone)]
pub struct Base {
    pub table: String,
    pub veth_prefix: String,
    pub subnet_v4: Cidr,
    pub subnet_v6: Cidr,
    pub gateway_v4: Ipv4Addr,
}

/// What one sandbox's chains are built from.
#[derive(Debug, Clone)]
pub struct SandboxRules<'a> {
    /// Short hex key (chain/set names).
    pub key: &'a str,
    pub veth: &'a str,
    pub ipv4: Ipv4Addr,
    pub ipv6: Ipv6Addr,
    pub mode: NetworkMode,
    pub allows: &'a [Allow],
}

/// The base table, created once (idempotent: `add` does not fail on existing objects).
pub fn base_script(b: &Base) -> String {
    let t = &b.table;
    let p = &b.veth_prefix;
    format!(
        "add table inet {t}\n\
         add map inet {t} veth_fwd {{ type ifname : verdict; }}\n\
         add map inet {t} veth_inp {{ type ifname : verdict; }}\n\
         add chain inet {t} forward {{ type filter hook forward priority -10; policy accept; }}\n\
         add chain inet {t} input {{ type filter hook input priority -10; policy accept; }}\n\
         add chain inet {t} post {{ type nat hook postrouting priority 100; policy accept; }}\n\
         flush chain inet {t} forward\n\
         flush chain inet {t} input\n\
         flush chain inet {t} post\n\
         add rule inet {t} forward tcp flags syn tcp option maxseg size set rt mtu\n\
         add rule inet {t} forward iifname vmap @veth_fwd\n\
         add rule inet {t} forward iifname \"{p}*\" drop\n\
         add rule inet {t} input iifname vmap @veth_inp\n\
         add rule inet {t} input iifname \"{p}*\" drop\n\
         add rule inet {t} post ip saddr {v4} ip daddr != {v4} masquerade\n\
         add rule inet {t} post ip6 saddr {v6} ip6 daddr != {v6} masquerade\n",
        v4 = b.subnet_v4,
        v6 = b.subnet_v6,
    )
}

fn counter_name(key: &str) -> String {
    format!("sb_{key}_denied")
}

/// The DNS-grant sets of a sandbox (exact `addr . port` elements with timeouts: no intervals).
const GRANT_SETS: [(&str, &str); 2] = [
    ("d4", "ipv4_addr . inet_service; flags timeout;"),
    ("d6", "ipv6_addr . inet_service; flags timeout;"),
];

/// Interval sets that sandboxes attached by earlier edges have (static allows and ICMP
/// destinations); [`detach_script`] removes them when present.
const LEGACY_SETS: [(&str, &str); 4] = [
    (
        "a4",
        "ipv4_addr . inet_proto . inet_service; flags interval;",
    ),
    (
        "a6",
        "ipv6_addr . inet_proto . inet_service; flags interval;",
    ),
    ("i4", "ipv4_addr; flags interval;"),
    ("i6", "ipv6_addr; flags interval;"),
];

/// Creates the sandbox's sets, counter and chains and hooks them into the maps.
pub fn attach_script(b: &Base, r: &SandboxRules<'_>) -> String {
    let t = &b.table;
    let k = r.key;
    let mut s = String::new();
    let _ = writeln!(s, "add counter inet {t} {}", counter_name(k));
    for (name, ty) in GRANT_SETS {
        let _ = writeln!(s, "add set inet {t} sb_{k}_{name} {{ type {ty} }}");
    }
    let _ = writeln!(s, "add chain inet {t} sb_{k}");
    let _ = writeln!(s, "add chain inet {t} sb_{k}_in");
    s.push_str(&rules_script(b, r));
    let _ = writeln!(
        s,
        "add element inet {t} veth_fwd {{ \"{}\" : jump sb_{k} }}",
        r.veth
    );
    let _ = writeln!(
        s,
        "add element inet {t} veth_inp {{ \"{}\" : jump sb_{k}_in }}",
        r.veth
    );
    s
}

/// The match of one static allow (without the verdict).
fn allow_match(a: &Allow) -> String {
    let (family, icmp) = if a.cidr.is_v4() {
        ("ip", "icmp")
    } else {
        ("ip6", "ipv6-icmp")
    };
    match a.proto {
        Proto::Icmp => format!("meta l4proto {icmp} {family} daddr {}", a.cidr),
        p => {
            let ports = if a.ports.0 == a.ports.1 {
                a.ports.0.to_string()
            } else {
                format!("{}-{}", a.ports.0, a.ports.1)
            };
            format!(
                "{family} daddr {} meta l4proto {} th dport {ports}",
                a.cidr,
                p.as_str()
            )
        }
    }
}

/// Replaces the sandbox's rules (one transaction with the rest of the script).
pub fn rules_script(b: &Base, r: &SandboxRules<'_>) -> String {
    let t = &b.table;
    let k = r.key;
    let c = counter_name(k);
    let mut s = String::new();
    // Forward (and the tail of input): to anywhere.
    let ch = format!("inet {t} sb_{k}");
    let _ = writeln!(s, "flush chain {ch}");
    let _ = writeln!(
        s,
        "add rule {ch} meta nfproto ipv4 ip saddr != {} counter name {c} drop",
        r.ipv4
    );
    let _ = writeln!(
        s,
        "add rule {ch} meta nfproto ipv6 ip6 saddr != {} ip6 saddr != fe80::/64 counter name {c} drop",
        r.ipv6
    );
    let _ = writeln!(s, "add rule {ch} ct state established,related accept");
    let _ = writeln!(
        s,
        "add rule {ch} ip daddr {} counter name {c} drop",
        b.subnet_v4
    );
    let _ = writeln!(
        s,
        "add rule {ch} ip6 daddr {} counter name {c} drop",
        b.subnet_v6
    );
    match r.mode {
        NetworkMode::Open => {
            let _ = writeln!(s, "add rule {ch} accept");
        }
        _ => {
            for a in r.allows {
                let _ = writeln!(s, "add rule {ch} {} accept", allow_match(a));
            }
            let _ = writeln!(s, "add rule {ch} ip daddr . tcp dport @sb_{k}_d4 accept");
            let _ = writeln!(s, "add rule {ch} ip6 daddr . tcp dport @sb_{k}_d6 accept");
        }
    }
    let _ = writeln!(s, "add rule {ch} counter name {c} drop");
    // Input: the host itself. Only the DNS proxy and neighbour discovery; in `open` mode
    // nothing else either (the edge, the apiserver and host services stay unreachable).
    let ci = format!("inet {t} sb_{k}_in");
    let _ = writeln!(s, "flush chain {ci}");
    let _ = writeln!(
        s,
        "add rule {ci} ip saddr {} ip daddr {} udp dport 53 accept",
        r.ipv4, b.gateway_v4
    );
    let _ = writeln!(s, "add rule {ci} icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert, nd-router-solicit }} accept");
    match r.mode {
        NetworkMode::Open => {
            let _ = writeln!(s, "add rule {ci} ct state established,related accept");
            let _ = writeln!(s, "add rule {ci} counter name {c} drop");
        }
        _ => {
            let _ = writeln!(s, "add rule {ci} jump sb_{k}");
        }
    }
    s
}

/// Removes everything of one sandbox (map entries first, then chains, sets, counter).
pub fn detach_script(b: &Base, key: &str, veth: &str) -> String {
    let t = &b.table;
    let mut s = String::new();
    let _ = writeln!(s, "delete element inet {t} veth_fwd {{ \"{veth}\" }}");
    let _ = writeln!(s, "delete element inet {t} veth_inp {{ \"{veth}\" }}");
    let _ = writeln!(s, "flush chain inet {t} sb_{key}_in");
    let _ = writeln!(s, "flush chain inet {t} sb_{key}");
    let _ = writeln!(s, "delete chain inet {t} sb_{key}_in");
    let _ = writeln!(s, "delete chain inet {t} sb_{key}");
    for (set, _) in GRANT_SETS {
        let _ = writeln!(s, "delete set inet {t} sb_{key}_{set}");
    }
    // Sandboxes attached by an earlier edge may have the interval sets: declaring them first
    // makes their deletion succeed whether they exist or not.
    for (set, ty) in LEGACY_SETS {
        let _ = writeln!(s, "add set inet {t} sb_{key}_{set} {{ type {ty} }}");
        let _ = writeln!(s, "delete set inet {t} sb_{key}_{set}");
    }
    let _ = writeln!(s, "delete counter inet {t} {}", counter_name(key));
    s
}

/// Like [`detach_script`] for leftovers of a crashed run: map entries that may be missing are
/// added first so that their deletion cannot fail the transaction.
pub fn detach_orphan_script(b: &Base, key: &str, veth: &str) -> String {
    let t = &b.table;
    format!(
        "add element inet {t} veth_fwd {{ \"{veth}\" : jump sb_{key} }}\n\
         add element inet {t} veth_inp {{ \"{veth}\" : jump sb_{key}_in }}\n{}",
        detach_script(b, key, veth)
    )
}

/// Keys of the per-sandbox chains (`chain sb_<key> {`) in `nft list table` output.
pub fn chain_keys(text: &str) -> Vec<String> {
    let mut keys: Vec<String> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("chain sb_"))
        .filter_map(|rest| rest.split_whitespace().next())
        .filter(|k| !k.ends_with("_in") && k.bytes().all(|b| b.is_ascii_alphanumeric()))
        .map(str::to_string)
        .collect();
    keys.sort();
    keys.dedup();
    keys
}

/// `nft list table inet <table>` (empty when the table is absent).
pub fn list_table(table: &str) -> String {
    if let Some(r) = crate::libnft::run(&format!("list table inet {table}\n")) {
        return r.unwrap_or_default();
    }
    match Command::new("nft")
        .args(["list", "table", "inet", table])
        .stderr(Stdio::null())
        .output()
    {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
        _ => String::new(),
    }
}

/// The per-sandbox chain keys present in the table (empty when the table is absent).
pub fn list_keys(table: &str) -> Vec<String> {
    chain_keys(&list_table(table))
}

/// `(veth, key)` of every `"<veth>" : jump sb_<key>` entry of the verdict maps in `nft list
/// table` output (each veth once).
pub fn map_veths(text: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(": jump sb_") {
        let before = rest[..i].trim_end();
        let after = &rest[i + ": jump sb_".len()..];
        let key: String = after
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .collect();
        if let Some(stripped) = before.strip_suffix('"') {
            if let Some(q) = stripped.rfind('"') {
                let veth = stripped[q + 1..].to_string();
                if !key.is_empty() && !out.iter().any(|(v, _)| *v == veth) {
                    out.push((veth, key));
                }
            }
        }
        rest = after;
    }
    out
}

/// Adds DNS-granted destinations (`addr . port`) with a timeout.
pub fn grant_script(b: &Base, key: &str, addr: IpAddr, ports: &[u16], ttl: Duration) -> String {
    let t = &b.table;
    let set = if addr.is_ipv4() { "d4" } else { "d6" };
    let secs = ttl.as_secs().max(1);
    let elems: Vec<String> = ports
        .iter()
        .map(|p| format!("{addr} . {p} timeout {secs}s"))
        .collect();
    // Re-adding an element does not refresh its timeout: delete first (ignored when absent
    // via `add` + `delete` in the same transaction).
    let plain: Vec<String> = ports.iter().map(|p| format!("{addr} . {p}")).collect();
    format!(
        "add element inet {t} sb_{key}_{set} {{ {} }}\ndelete element inet {t} sb_{key}_{set} {{ {} }}\nadd element inet {t} sb_{key}_{set} {{ {} }}\n",
        elems.join(", "),
        plain.join(", "),
        elems.join(", ")
    )
}

/// Runs `nft -f -` with `script` as one transaction.
pub fn apply(script: &str) -> Result<(), NetError> {
    let done = match crate::libnft::run(script) {
        Some(r) => r.map(drop),
        None => crate::run_fed("nft", &["-f", "-"], script),
    };
    done.map_err(|e| match e {
        NetError::Tool { tool, message } => NetError::Tool {
            tool,
            message: format!("{message}\nscript:\n{script}"),
        },
        other => other,
    })
}

/// Packets counted by the sandbox's `denied` counter.
pub fn denied_packets(b: &Base, key: &str) -> Result<u64, NetError> {
    let cmd = format!("list counter inet {} {}\n", b.table, counter_name(key));
    if let Some(r) = crate::libnft::run(&cmd) {
        return r.map(|text| parse_packets(&text));
    }
    let out = Command::new("nft")
        .args(["list", "counter", "inet", &b.table, &counter_name(key)])
        .output()
        .map_err(|e| NetError::Tool {
            tool: "nft",
            message: e.to_string(),
        })?;
    if !out.status.success() {
        return Err(NetError::Tool {
            tool: "nft",
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(parse_packets(&String::from_utf8_lossy(&out.stdout)))
}

/// The `packets N` figure of `nft list counter` output.
fn parse_packets(text: &str) -> u64 {
    let mut words = text.split_whitespace();
    while let Some(w) = words.next() {
        if w == "packets" {
            return words.next().and_then(|n| n.parse().ok()).unwrap_or(0);
        }
    }
    0
}

/// Deletes the whole table (crash recovery, shutdown). A missing table is fine.
pub fn delete_table(table: &str) {
    let _ = Command::new("nft")
        .args(["delete", "table", "inet", table])
        .stderr(Stdio::null())
        .status();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::parse_cidr;

    fn base() -> Base {
        Base {
            table: "dsec".into(),
            veth_prefix: "dsv".into(),
            subnet_v4: parse_cidr("10.201.0.0/16").unwrap(),
            subnet_v6: parse_cidr("fd00:d5ec::/64").unwrap(),
            gateway_v4: "10.201.0.1".parse().unwrap(),
        }
    }

    /// A TCP range, a UDP port and an ICMP host, over IPv4 and IPv6.
    fn sample_allows() -> Vec<Allow> {
        vec![
            Allow {
                cidr: parse_cidr("192.0.2.0/24").unwrap(),
                proto: Proto::Tcp,
                ports: (80, 443),
            },
            Allow {
                cidr: parse_cidr("fd01::/64").unwrap(),
                proto: Proto::Udp,
                ports: (53, 53),
            },
            Allow {
                cidr: parse_cidr("198.51.100.1").unwrap(),
                proto: Proto::Icmp,
                ports: (0, 0),
            },
        ]
    }

    #[test]
    fn scripts() {
        let b = base();
        assert!(base_script(&b).contains("iifname \"dsv*\" drop"));
        let allows = sample_allows();
        let r = SandboxRules {
            key: "abc",
            veth: "dsvabc",
            ipv4: "10.201.0.2".parse().unwrap(),
            ipv6: "fd00:d5ec::2".parse().unwrap(),
            mode: NetworkMode::Allowlist,
            allows: &allows,
        };
        let s = attach_script(&b, &r);
        assert!(
            s.contains(
                "add rule inet dsec sb_abc ip daddr 192.0.2.0/24 meta l4proto tcp th dport 80-443 accept"
            ),
            "{s}"
        );
        assert!(
            s.contains(
                "add rule inet dsec sb_abc ip6 daddr fd01::/64 meta l4proto udp th dport 53 accept"
            ),
            "{s}"
        );
        assert!(
            s.contains(
                "add rule inet dsec sb_abc meta l4proto icmp ip daddr 198.51.100.1/32 accept"
            ),
            "{s}"
        );
        // No interval sets, named or anonymous (see the module comment): only `{ ... }` of
        // verdict map entries, ICMPv6 types and set declarations.
        assert!(!s.contains("interval"), "{s}");
        for l in s.lines().filter(|l| l.contains('{')) {
            assert!(
                l.starts_with("add set")
                    || l.contains(": jump sb_abc")
                    || l.contains("icmpv6 type {"),
                "{l}"
            );
        }
        assert!(s.contains("\"dsvabc\" : jump sb_abc }"));
        assert!(
            s.trim_end()
                .lines()
                .filter(|l| l.contains("counter name sb_abc_denied drop"))
                .count()
                >= 4
        );
        let open = rules_script(
            &b,
            &SandboxRules {
                mode: NetworkMode::Open,
                ..r.clone()
            },
        );
        assert!(open.contains("add rule inet dsec sb_abc accept"));
        // Open mode never reaches the host itself.
        assert!(!open.contains("jump sb_abc\n"));
        let d = detach_script(&b, "abc", "dsvabc");
        assert!(d.contains("delete chain inet dsec sb_abc"));
        let g = grant_script(
            &b,
            "abc",
            "192.0.2.9".parse().unwrap(),
            &[80, 443],
            Duration::from_secs(30),
        );
        assert!(
            g.contains("sb_abc_d4 { 192.0.2.9 . 80 timeout 30s, 192.0.2.9 . 443 timeout 30s }"),
            "{g}"
        );
    }

    /// The generated scripts against the real nftables (a scratch table, removed at the end).
    #[test]
    fn veths_of_map_entries() {
        let text = "map veth_fwd {\n\t\ttype ifname : verdict\n\t\telements = { \"dsvp7\" : jump sb_00ab, \"dsv00cd\" : jump sb_00cd }\n\t}\n\tmap veth_inp {\n\t\telements = { \"dsvp7\" : jump sb_00ab_in }\n}";
        assert_eq!(
            map_veths(text),
            vec![
                ("dsvp7".to_string(), "00ab".to_string()),
                ("dsv00cd".to_string(), "00cd".to_string())
            ]
        );
    }

    #[test]
    fn scripts_apply_to_the_kernel() {
        if !nix::unistd::geteuid().is_root()
            || Command::new("nft").arg("--version").output().is_err()
        {
            eprintln!("skip: needs root and nft");
            return;
        }
        let mut b = base();
        b.table = format!("dsec_unit{}", std::process::id());
        // Removes the scratch table even when an assertion below panics.
        struct Scratch(String);
        impl Drop for Scratch {
            fn drop(&mut self) {
                delete_table(&self.0);
            }
        }
        let _scratch = Scratch(b.table.clone());
        let mut allows = sample_allows();
        allows.push(Allow {
            cidr: parse_cidr("fd02::1").unwrap(),
            proto: Proto::Icmp,
            ports: (0, 0),
        });
        let r = SandboxRules {
            key: "0123abcd",
            veth: "dsv0123abcd",
            ipv4: "10.201.0.2".parse().unwrap(),
            ipv6: "fd00:d5ec::2".parse().unwrap(),
            mode: NetworkMode::Allowlist,
            allows: &allows,
        };
        let result = (|| -> Result<(), NetError> {
            apply(&base_script(&b))?;
            apply(&base_script(&b))?; // idempotent
            apply(&attach_script(&b, &r))?;
            apply(&grant_script(
                &b,
                r.key,
                "192.0.2.9".parse().unwrap(),
                &[80, 443],
                Duration::from_secs(30),
            ))?;
            apply(&grant_script(
                &b,
                r.key,
                "192.0.2.9".parse().unwrap(),
                &[80, 443],
                Duration::from_secs(30),
            ))?; // refresh
            apply(&grant_script(
                &b,
                r.key,
                "fd01::9".parse().unwrap(),
                &[80],
                Duration::from_secs(30),
            ))?;
            apply(&rules_script(
                &b,
                &SandboxRules {
                    mode: NetworkMode::Open,
                    ..r.clone()
                },
            ))?;
            apply(&rules_script(&b, &r))?;
            assert_eq!(denied_packets(&b, r.key)?, 0);
            assert_eq!(list_keys(&b.table), vec![r.key.to_string()]);
            apply(&detach_script(&b, r.key, r.veth))?;
            assert!(list_keys(&b.table).is_empty());
            // A crashed run's leftovers: attached, then removed by the orphan script.
            apply(&attach_script(&b, &r))?;
            apply(&detach_orphan_script(&b, r.key, r.veth))?;
            assert!(list_keys(&b.table).is_empty());
            // A sandbox attached by an earlier edge, with the interval sets and a rule using
            // one, is removed as well.
            apply(&attach_script(&b, &r))?;
            let (t, k) = (&b.table, r.key);
            let mut legacy: String = LEGACY_SETS
                .iter()
                .map(|(n, ty)| format!("add set inet {t} sb_{k}_{n} {{ type {ty} }}\n"))
                .collect();
            legacy.push_str(&format!(
                "add rule inet {t} sb_{k} ip daddr . meta l4proto . th dport @sb_{k}_a4 accept\n"
            ));
            apply(&legacy)?;
            apply(&detach_script(&b, r.key, r.veth))?;
            assert!(list_keys(&b.table).is_empty());
            assert!(!list_table(&b.table).contains("set sb_"));
            Ok(())
        })();
        result.unwrap();
    }

    #[test]
    fn orphans() {
        let text = "table inet dsec {\n\tset sb_abc_a4 {\n\t}\n\tchain forward {\n\t}\n\tchain sb_abc {\n\t\tjump sb_abc_in\n\t}\n\tchain sb_abc_in {\n\t}\n\tchain sb_0f1 {\n\t}\n}\n";
        assert_eq!(chain_keys(text), vec!["0f1".to_string(), "abc".to_string()]);
        let s = detach_orphan_script(&base(), "abc", "dsvabc");
        assert!(
            s.starts_with("add element inet dsec veth_fwd { \"dsvabc\" : jump sb_abc }"),
            "{s}"
        );
        assert!(s.contains("delete counter inet dsec sb_abc_denied"));
    }

    #[test]
    fn counter_output() {
        let text =
            "table inet dsec {\n\tcounter sb_abc_denied {\n\t\tpackets 7 bytes 420\n\t}\n}\n";
        assert_eq!(parse_packets(text), 7);
        assert_eq!(parse_packets(""), 0);
    }
}
