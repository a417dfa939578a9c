//! Per-sandbox network namespace and routed veth pair, and address allocation.
//!
//! Layout: the edge owns a dummy interface holding the gateway address (the DNS proxy listens
//! there). Each sandbox gets a named namespace `<table>-<sandbox id>` (named so that crash
//! recovery finds leftovers by prefix), a veth pair `<prefix><key>` (host) / `eth0` (inside),
//! one IPv4 /32 from the configured /16 and one IPv6 /128 from the ULA /64. The veth is routed,
//! not bridged: sandboxes share no L2 segment, so every packet of theirs crosses the host's
//! forward/input hooks where nftables decides. Inside: default routes via the gateway (v4)
//! and `fe80::1` (v6, the host end's link-local address).

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};

use crate::policy::Cidr;
use crate::NetError;

/// Hands out host numbers 2.. within the subnets (1 is the gateway).
#[derive(Debug)]
pub struct Allocator {
    v4_base: u32,
    v6_base: u128,
    max: u32,
    used: BTreeSet<u32>,
    next: u32,
}

impl Allocator {
    pub fn new(v4: Cidr, v6: Cidr) -> Self {
        let v4_base = match v4.addr {
            std::net::IpAddr::V4(a) => u32::from(a),
            _ => 0,
        };
        let v6_base = match v6.addr {
            std::net::IpAddr::V6(a) => u128::from(a),
            _ => 0,
        };
        let host_bits = 32 - u32::from(v4.prefix);
        let max = if host_bits >= 31 {
            u32::MAX - 1
        } else {
            (1u32 << host_bits) - 2
        };
        Allocator {
            v4_base,
            v6_base,
            max,
            used: BTreeSet::new(),
            next: 2,
        }
    }

    /// The next free host number and its addresses.
    pub fn take(&mut self) -> Option<(u32, Ipv4Addr, Ipv6Addr)> {
        let span = self.max.saturating_sub(1);
        for i in 0..span {
            let n = 2 + (self.next - 2 + i) % span;
            if self.used.insert(n) {
                self.next = if n + 1 > self.max { 2 } else { n + 1 };
                return Some((
                    n,
                    Ipv4Addr::from(self.v4_base + n),
                    Ipv6Addr::from(self.v6_base + u128::from(n)),
                ));
            }
        }
        None
    }

    /// Marks `n` as used (re-adoption); None when it is out of range or taken.
    pub fn take_specific(&mut self, n: u32) -> Option<(Ipv4Addr, Ipv6Addr)> {
        if n < 2 || n > self.max || !self.used.insert(n) {
            return None;
        }
        Some((
            Ipv4Addr::from(self.v4_base + n),
            Ipv6Addr::from(self.v6_base + u128::from(n)),
        ))
    }

    pub fn give_back(&mut self, n: u32) {
        self.used.remove(&n);
    }
}

/// Runs `ip [-n ns] -batch -` with `lines`.
fn ip_batch(ns: Option<&str>, lines: &str) -> Result<(), NetError> {
    let mut args = Vec::new();
    if let Some(ns) = ns {
        args.extend(["-n", ns]);
    }
    args.extend(["-batch", "-"]);
    crate::run_fed("ip", &args, lines)
        .map_err(|e| with_context(e, format!("(commands: {})", lines.replace('\n', "; "))))
}

/// Appends `ctx` to a tool error's message.
fn with_context(e: NetError, ctx: String) -> NetError {
    match e {
        NetError::Tool { tool, message } => NetError::Tool {
            tool,
            message: format!("{message} {ctx}"),
        },
        other => other,
    }
}

fn ip(args: &[&str]) -> Result<(), NetError> {
    let out = Command::new("ip")
        .args(args)
        .stdout(Stdio::null())
        .output()
        .map_err(|e| NetError::Tool {
            tool: "ip",
            message: e.to_string(),
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetError::Tool {
            tool: "ip",
            message: format!(
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        })
    }
}

/// Makes the gateway interface (idempotent) and turns on forwarding.
pub fn host_setup(dummy: &str, gateway: Ipv4Addr) -> Result<(), NetError> {
    if !std::path::Path::new("/sys/class/net").join(dummy).exists() {
        // A dummy device where the kernel has the module; else a port-less bridge, which
        // holds a local address just as well (some kernels are built without `dummy`).
        if let Err(e) = ip(&["link", "add", dummy, "type", "dummy"]) {
            ip(&["link", "add", dummy, "type", "bridge"]).map_err(|e2| NetError::Tool {
                tool: "ip",
                message: format!(
                    "neither a dummy ({e}) nor a bridge ({e2}) device can hold the gateway address"
                ),
            })?;
        }
    }
    let _ = ip(&["addr", "replace", &format!("{gateway}/32"), "dev", dummy]);
    ip(&["link", "set", dummy, "up"])?;
    for (path, v) in [
        ("/proc/sys/net/ipv4/ip_forward", "1"),
        ("/proc/sys/net/ipv6/conf/all/forwarding", "1"),
    ] {
        std::fs::write(path, v).map_err(|e| NetError::Tool {
            tool: "sysctl",
            message: format!("{path}: {e}"),
        })?;
    }
    Ok(())
}

/// Removes the gateway interface [`host_setup`] made (edge shutdown with no sandbox left).
pub fn host_teardown(dummy: &str) {
    if std::path::Path::new("/sys/class/net").join(dummy).exists() {
        if let Err(e) = ip(&["link", "del", dummy]) {
            tracing::warn!(interface = dummy, error = %e, "remove the gateway interface");
        }
    }
}

/// One sandbox's prepared namespace.
#[derive(Debug)]
pub struct Prepared {
    pub fd: OwnedFd,
}

/// Addresses and link settings of one sandbox's veth pair.
#[derive(Debug, Clone, Copy)]
pub struct Link {
    pub gateway: Ipv4Addr,
    pub ipv4: Ipv4Addr,
    pub ipv6: Ipv6Addr,
    /// MTU of both ends.
    pub mtu: u32,
}

/// Creates the named namespace and the veth pair, and configures both ends.
pub fn create(ns: &str, veth: &str, link: Link) -> Result<Prepared, NetError> {
    let Link {
        gateway,
        ipv4,
        ipv6,
        mtu,
    } = link;
    ip(&["netns", "add", ns])?;
    let host = format!(
        "link add {veth} mtu {mtu} type veth peer name eth0 mtu {mtu} netns {ns}\n\
         link set {veth} up\n\
         addr add fe80::1/64 dev {veth} nodad\n\
         route add {ipv4}/32 dev {veth}\n\
         route add {ipv6}/128 dev {veth}\n"
    );
    let inside = format!(
        "link set lo up\n\
         link set eth0 addrgenmode none\n\
         addr add {ipv4}/32 dev eth0\n\
         addr add {ipv6}/128 dev eth0 nodad\n\
         addr add fe80::2/64 dev eth0 nodad\n\
         link set eth0 up\n\
         route add {gateway}/32 dev eth0\n\
         route add default via {gateway} dev eth0\n\
         route add ::/0 via fe80::1 dev eth0\n"
    );
    let built = ip_batch(None, &host)
        .and_then(|()| ip_batch(Some(ns), &inside))
        .and_then(|()| {
            std::fs::File::open(format!("/run/netns/{ns}"))
                .map(OwnedFd::from)
                .map_err(|e| NetError::Tool {
                    tool: "open netns",
                    message: e.to_string(),
                })
        });
    match built {
        Ok(fd) => Ok(Prepared { fd }),
        Err(e) => {
            remove(ns, veth);
            Err(e)
        }
    }
}

/// Deletes the veth (its peer goes with it) and the namespace's name. Missing ones are fine.
pub fn remove(ns: &str, veth: &str) {
    if std::path::Path::new("/sys/class/net").join(veth).exists() {
        let _ = ip(&["link", "del", veth]);
    }
    if std::path::Path::new("/run/netns").join(ns).exists() {
        let _ = ip(&["netns", "del", ns]);
    }
}

/// Names of leftover namespaces (`/run/netns/<prefix>*`) and veths (`<veth_prefix>*`).
pub fn leftovers(ns_prefix: &str, veth_prefix: &str) -> (Vec<String>, Vec<String>) {
    let list = |dir: &str, prefix: &str| -> Vec<String> {
        std::fs::read_dir(dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter_map(|e| e.file_name().to_str().map(str::to_string))
                    .filter(|n| n.starts_with(prefix))
                    .collect()
            })
            .unwrap_or_default()
    };
    (
        list("/run/netns", ns_prefix),
        list("/sys/class/net", veth_prefix),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::parse_cidr;

    #[test]
    fn allocation() {
        let mut a = Allocator::new(
            parse_cidr("10.201.0.0/30").unwrap(),
            parse_cidr("fd00::/64").unwrap(),
        );
        let (n, v4, v6) = a.take().unwrap();
        assert_eq!(
            (n, v4.to_string(), v6.to_string()),
            (2, "10.201.0.2".into(), "fd00::2".into())
        );
        assert!(a.take().is_none(), "a /30 has one sandbox address");
        a.give_back(2);
        assert_eq!(a.take().unwrap().0, 2);
        let mut a = Allocator::new(
            parse_cidr("10.201.0.0/16").unwrap(),
            parse_cidr("fd00::/64").unwrap(),
        );
        let x = a.take().unwrap().0;
        let y = a.take().unwrap().0;
        a.give_back(x);
        // Round-robin: a freed number is not reused at once.
        assert_eq!(a.take().unwrap().0, y + 1);
        assert_eq!(
            Ipv4Addr::from(0x0ac9_0000u32 + 258).to_string(),
            "10.201.1.2"
        );
    }
}
