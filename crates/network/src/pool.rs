//! Spare network namespaces, built ahead of demand.
//!
//! Creating a veth pair costs the kernel ≈ 5 ms (device registration waits for RCU grace
//! periods) and configuring both ends takes several netlink round trips; a networked create
//! should not wait for any of it. After the first networked sandbox, the edge keeps up to
//! `network.pool_size` spares: a named namespace `<table>-pool<n>` holding `eth0` with its
//! addresses and routes, and the routed host end `<veth_prefix>p<n>`, where `n` is the host
//! number the addresses come from. A create claims a spare and only adds its nftables chains
//! (one in-process transaction); a background task builds the replacement. With the pool
//! empty (a burst larger than the pool) a create builds its own namespace as before.
//!
//! A spare carries no rules: its veth has no entry in the verdict maps, so the base chains drop
//! anything that came from it. Spares are removed when the edge shuts down, and those of a
//! crashed edge are reaped with every other leftover at the next start (same name prefixes).

use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::{blocking, lock, netns, nft, NetError, Network};

/// How long a refill waits after a spare was taken (the claiming create is still running).
const REFILL_DELAY: Duration = Duration::from_millis(100);

/// A namespace with a configured veth pair that no sandbox uses yet.
pub struct Spare {
    pub ns: String,
    pub veth: String,
    pub host_no: u32,
    pub ipv4: Ipv4Addr,
    pub ipv6: Ipv6Addr,
    pub fd: OwnedFd,
}

/// Namespace name of the spare with host number `n`.
pub fn ns_name(table: &str, n: u32) -> String {
    format!("{table}-pool{n}")
}

/// Host-side veth name of the spare with host number `n` (sandbox veths end in hex digits,
/// so the `p` keeps the two apart; at most 3 + 1 + 8 characters).
pub fn veth_name(prefix: &str, n: u32) -> String {
    format!("{prefix}p{n}")
}

impl Network {
    /// Takes a spare, if one is ready, and asks for its replacement.
    pub(crate) fn claim_spare(self: &Arc<Self>) -> Option<Spare> {
        if self.cfg.pool_size == 0 {
            return None;
        }
        self.start_pool();
        let spare = lock(&self.pool).pop();
        self.pool_kick.notify_one();
        spare
    }

    /// Starts the refill task once (at the first networked create).
    fn start_pool(self: &Arc<Self>) {
        if self.pool_started.swap(true, Ordering::SeqCst) {
            return;
        }
        tokio::spawn(refill(Arc::downgrade(self)));
    }

    /// Builds one spare; None when the node is out of addresses or the kernel refused.
    async fn build_spare(&self) -> Result<Spare, NetError> {
        let (host_no, ipv4, ipv6) = lock(&self.alloc)
            .take()
            .ok_or_else(|| NetError::Exhausted(self.cfg.subnet_v4.clone()))?;
        let ns = ns_name(&self.cfg.table, host_no);
        let veth = veth_name(&self.cfg.veth_prefix, host_no);
        let link = netns::Link {
            gateway: self.resolved.base.gateway_v4,
            ipv4,
            ipv6,
            mtu: self.cfg.mtu,
        };
        let (n2, v2) = (ns.clone(), veth.clone());
        match blocking(move || netns::create(&n2, &v2, link)).await {
            Ok(p) => Ok(Spare {
                ns,
                veth,
                host_no,
                ipv4,
                ipv6,
                fd: p.fd,
            }),
            Err(e) => {
                lock(&self.alloc).give_back(host_no);
                Err(e)
            }
        }
    }

    /// Removes a spare's namespace and veth and frees its addresses.
    pub(crate) async fn discard_spare(&self, s: Spare) {
        let (ns, veth) = (s.ns.clone(), s.veth.clone());
        let _ = blocking(move || {
            netns::remove(&ns, &veth);
            Ok(())
        })
        .await;
        lock(&self.alloc).give_back(s.host_no);
    }

    /// Stops refilling and removes every spare (edge shutdown). With no sandbox left attached
    /// (a clean shutdown stops them all first), the table and the gateway interface go too
    /// (a restarted edge makes them again): every table's base chains
    /// run for every forwarded packet on the host, and libnftables reads every table before
    /// each transaction, so tables of stopped edges must not pile up.
    pub async fn shutdown(&self) {
        self.pool_closed.store(true, Ordering::SeqCst);
        self.pool_kick.notify_one();
        let spares: Vec<Spare> = lock(&self.pool).drain(..).collect();
        for s in spares {
            self.discard_spare(s).await;
        }
        if self.init.initialized() && lock(&self.sandboxes).is_empty() {
            let table = self.cfg.table.clone();
            let dummy = self.cfg.gateway_interface.clone();
            let _ = blocking(move || {
                nft::delete_table(&table);
                netns::host_teardown(&dummy);
                Ok(())
            })
            .await;
        }
    }

    /// Names of spares, so that leftover reaping leaves them alone.
    pub(crate) fn spare_names(&self) -> Vec<(String, String)> {
        lock(&self.pool)
            .iter()
            .map(|s| (s.ns.clone(), s.veth.clone()))
            .collect()
    }
}

/// Keeps the pool at `pool_size` until the edge shuts down.
async fn refill(weak: Weak<Network>) {
    loop {
        let Some(net) = weak.upgrade() else {
            return;
        };
        if net.pool_closed.load(Ordering::SeqCst) {
            return;
        }
        if lock(&net.pool).len() >= net.cfg.pool_size {
            let kick = net.pool_kick.clone();
            drop(net);
            kick.notified().await;
            // Let the create that took the spare finish before competing with it for the CPU.
            tokio::time::sleep(REFILL_DELAY).await;
            continue;
        }
        match net.build_spare().await {
            Ok(spare) => {
                let mut pool = lock(&net.pool);
                if net.pool_closed.load(Ordering::SeqCst) {
                    drop(pool);
                    net.discard_spare(spare).await;
                    return;
                }
                pool.push(spare);
            }
            Err(e) => {
                tracing::warn!(error = %e, "build a spare sandbox network; retrying in 1 s");
                drop(net);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spare_names_fit_and_differ_from_sandbox_names() {
        let v = veth_name("dsv", 16_777_214);
        assert!(v.len() <= 15, "{v}");
        // Sandbox veths are `<prefix><12 hex digits>`: never a `p` after the prefix.
        assert!(!crate::key_of("sb-n1-00000000000000ab").contains('p'));
        assert_eq!(ns_name("dsec", 7), "dsec-pool7");
    }
}
