//! Sandbox networking on one node: modes `none | allowlist | open`, allow rules by CIDR, port
//! range and protocol, named domain groups resolved through the node's DNS proxy, live rule
//! changes and denied-packet counters.
//!
//! # What this crate owns
//!
//! Everything a sandbox's network is made of on the host, and its whole life: the named network
//! namespace and routed veth pair with their addresses ([`netns`]), spare namespaces built ahead
//! of demand ([`pool`]), the nftables table that enforces each sandbox's policy ([`nft`], run
//! in-process through [`libnft`] where the library loads), the DNS proxy that answers only
//! allowed names and opens the addresses it hands out ([`dns`]), the pure policy logic
//! ([`policy`]), the claim that keeps two edges on one host off each other's names ([`owner`]),
//! the typed `[edge.network]` config ([`config`]) and the errors ([`error`]). [`Network`] is the
//! one entry point: attach, wait for rules, update, status, detach, re-adopt, reap, shut down.
//!
//! # What it must not do
//!
//! It knows nothing about sandbox lifecycle, substrates, records or HTTP: the edge decides when
//! a sandbox is attached or detached (its `network` module is that glue) and maps
//! [`NetError`]/[`PolicyError`] onto wire codes in its one error module. It depends only on the
//! wire types, never on the edge, and it never touches the host's network configuration until
//! the first sandbox with networking is attached, so edges that never use networking leave the
//! host alone. It persists nothing itself: [`SavedNetwork`] is what the caller stores beside its
//! record so that a restarted edge can [`Network::readopt`] a live sandbox.

pub mod config;
pub mod dns;
pub mod error;
pub mod libnft;
pub mod netns;
pub mod nft;
pub mod owner;
pub mod policy;
pub mod pool;

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dsec_wire::api::{DnsGrant, NetworkMode, NetworkSpec, NetworkStatus};
use serde::{Deserialize, Serialize};

pub use config::{NetworkConfig, NetworkConfigError};
pub use error::{NetError, PolicyError};
use policy::Policy;

/// What the caller persists next to a sandbox's record so that [`Network::readopt`] can take
/// the sandbox back after a restart.
#[derive(Debug, Serialize, Deserialize)]
pub struct SavedNetwork {
    pub spec: NetworkSpec,
    pub host_no: u32,
    /// Namespace and host veth names (absent in records of older edges: derived from the id).
    #[serde(default)]
    pub ns: Option<String>,
    #[serde(default)]
    pub veth: Option<String>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a sandbox with networking has on the host.
struct SbNet {
    key: String,
    veth: String,
    ns: String,
    host_no: u32,
    ipv4: Ipv4Addr,
    ipv6: Ipv6Addr,
    policy: Mutex<Policy>,
    dns_refused: AtomicU64,
    dns_answered: AtomicU64,
    grants: Mutex<Vec<(String, IpAddr, Instant)>>,
    /// Outcome of the transaction that adds the sandbox's chains and map entries: `None` while
    /// it runs (the task applying it holds the lock), then its result.
    rules: RulesGate,
}

type RulesGate = Arc<tokio::sync::Mutex<Option<Result<(), NetError>>>>;

/// A gate for rules that are already in the kernel (re-adopted sandboxes).
fn rules_in_place() -> RulesGate {
    Arc::new(tokio::sync::Mutex::new(Some(Ok(()))))
}

/// What the substrate needs from an attached sandbox.
pub struct Attachment {
    pub netns: Arc<OwnedFd>,
    /// Contents of the sandbox's `/etc/resolv.conf`.
    pub resolv_conf: String,
}

/// Everything resolved from the config once.
struct Resolved {
    base: nft::Base,
    hosts: Vec<(String, Vec<IpAddr>)>,
}

/// The node's networking: per-sandbox state, the nftables table and the DNS proxy.
pub struct Network {
    cfg: NetworkConfig,
    resolved: Resolved,
    alloc: Mutex<netns::Allocator>,
    sandboxes: Mutex<HashMap<String, Arc<SbNet>>>,
    by_addr: Mutex<HashMap<IpAddr, Arc<SbNet>>>,
    init: tokio::sync::OnceCell<()>,
    dns_refused_total: AtomicU64,
    /// Spare namespaces ([`pool`]).
    pool: Mutex<Vec<pool::Spare>>,
    pool_kick: Arc<tokio::sync::Notify>,
    pool_started: std::sync::atomic::AtomicBool,
    pool_closed: std::sync::atomic::AtomicBool,
    /// This edge's claim on the names (taken before any of them is touched).
    owned: Mutex<Option<owner::Ownership>>,
}

/// The short key of a sandbox id (its last 12 hex digits) naming chains, sets and the veth.
pub fn key_of(id: &str) -> String {
    let tail = id.rsplit('-').next().unwrap_or(id);
    tail[tail.len().saturating_sub(12)..].to_string()
}

impl Network {
    /// Builds the (inactive) network from a validated config.
    pub fn new(cfg: NetworkConfig) -> Arc<Self> {
        let v4 = policy::parse_cidr(&cfg.subnet_v4)
            .unwrap_or_else(|_| policy::parse_cidr("10.201.0.0/16").expect("literal"));
        let v6 = policy::parse_cidr(&cfg.subnet_v6)
            .unwrap_or_else(|_| policy::parse_cidr("fd00:d5ec::/64").expect("literal"));
        let gateway_v4 = match v4.addr {
            IpAddr::V4(a) => Ipv4Addr::from(u32::from(a) + 1),
            _ => Ipv4Addr::new(10, 201, 0, 1),
        };
        let hosts = cfg
            .hosts
            .iter()
            .filter_map(|(n, a)| {
                dns::parse_addrs(a)
                    .ok()
                    .map(|a| (n.to_ascii_lowercase(), a))
            })
            .collect();
        Arc::new(Network {
            resolved: Resolved {
                base: nft::Base {
                    table: cfg.table.clone(),
                    veth_prefix: cfg.veth_prefix.clone(),
                    subnet_v4: v4,
                    subnet_v6: v6,
                    gateway_v4,
                },
                hosts,
            },
            alloc: Mutex::new(netns::Allocator::new(v4, v6)),
            cfg,
            sandboxes: Mutex::new(HashMap::new()),
            by_addr: Mutex::new(HashMap::new()),
            init: tokio::sync::OnceCell::new(),
            dns_refused_total: AtomicU64::new(0),
            pool: Mutex::new(Vec::new()),
            pool_kick: Arc::new(tokio::sync::Notify::new()),
            pool_started: std::sync::atomic::AtomicBool::new(false),
            pool_closed: std::sync::atomic::AtomicBool::new(false),
            owned: Mutex::new(None),
        })
    }

    pub fn config(&self) -> &NetworkConfig {
        &self.cfg
    }

    /// The policy a create request asks for.
    pub fn policy_for(
        &self,
        spec: Option<&NetworkSpec>,
        groups: &BTreeMap<String, bool>,
    ) -> Result<Policy, NetError> {
        policy::from_request(spec, groups, &self.cfg.groups).map_err(NetError::Policy)
    }

    /// Claims the network names for this edge (once; see [`owner`]).
    fn own(&self) -> Result<(), NetError> {
        let mut owned = lock(&self.owned);
        if owned.is_none() {
            *owned = Some(owner::claim(&self.cfg.table)?);
        }
        Ok(())
    }

    /// Host setup, base table and DNS proxy, once.
    async fn ensure_init(self: &Arc<Self>) -> Result<(), NetError> {
        self.own()?;
        let me = self.clone();
        self.init
            .get_or_try_init(|| async move {
                let base = me.resolved.base.clone();
                let dummy = me.cfg.gateway_interface.clone();
                blocking(move || {
                    netns::host_setup(&dummy, base.gateway_v4)?;
                    nft::apply(&nft::base_script(&base))
                })
                .await?;
                let addr = SocketAddr::from((me.resolved.base.gateway_v4, 53));
                let sock = tokio::net::UdpSocket::bind(addr)
                    .await
                    .map_err(|e| NetError::Dns(format!("bind {addr}: {e}")))?;
                let weak = Arc::downgrade(&me);
                tokio::spawn(serve_dns(weak, sock));
                tracing::info!(table = %me.cfg.table, gateway = %addr, "sandbox networking ready");
                Ok(())
            })
            .await
            .map(|_| ())
    }

    /// Prepares the namespace, veth, addresses and rules of a sandbox (mode ≠ none).
    pub async fn attach(
        self: &Arc<Self>,
        id: &str,
        policy: Policy,
    ) -> Result<Attachment, NetError> {
        self.ensure_init().await?;
        let key = key_of(id);
        // A spare namespace when one is ready, else this sandbox's own (named after it).
        let spare = self.claim_spare();
        let (host_no, ipv4, ipv6, ns, veth, ready) = match spare {
            Some(s) => (s.host_no, s.ipv4, s.ipv6, s.ns, s.veth, Some(s.fd)),
            None => {
                let (n, v4, v6) = lock(&self.alloc)
                    .take()
                    .ok_or_else(|| NetError::Exhausted(self.cfg.subnet_v4.clone()))?;
                (
                    n,
                    v4,
                    v6,
                    format!("{}-{id}", self.cfg.table),
                    format!("{}{key}", self.cfg.veth_prefix),
                    None,
                )
            }
        };
        let sb = Arc::new(SbNet {
            veth,
            ns,
            key,
            host_no,
            ipv4,
            ipv6,
            policy: Mutex::new(policy),
            dns_refused: AtomicU64::new(0),
            dns_answered: AtomicU64::new(0),
            grants: Mutex::new(Vec::new()),
            rules: Arc::new(tokio::sync::Mutex::new(None)),
        });
        let base = self.resolved.base.clone();
        let s2 = sb.clone();
        let mtu = self.cfg.mtu;
        let built = blocking(move || match ready {
            Some(fd) => Ok(netns::Prepared { fd }),
            None => netns::create(
                &s2.ns,
                &s2.veth,
                netns::Link {
                    gateway: base.gateway_v4,
                    ipv4: s2.ipv4,
                    ipv6: s2.ipv6,
                    mtu,
                },
            ),
        })
        .await;
        let prepared = match built {
            Ok(p) => p,
            Err(e) => {
                lock(&self.alloc).give_back(host_no);
                return Err(e);
            }
        };
        // The chains go in while the substrate starts the sandbox (the nftables transaction
        // refreshes libnftables' view of the whole ruleset first, which grows with the node's
        // sandboxes). Until they are in, the veth has no verdict-map entry and the base chains
        // drop everything that comes from it; [`Network::rules_ready`] waits for them before
        // the create answers, and [`Network::detach`] before it removes them.
        let Ok(gate) = sb.rules.clone().try_lock_owned() else {
            unreachable!("nobody else holds the lock of a sandbox that is not registered yet")
        };
        let s2 = sb.clone();
        let base = self.resolved.base.clone();
        let sandbox = id.to_string();
        tokio::spawn(async move {
            let mut gate = gate;
            let applied = blocking(move || {
                let p = lock(&s2.policy).clone();
                nft::apply(&nft::attach_script(
                    &base,
                    &nft::SandboxRules {
                        key: &s2.key,
                        veth: &s2.veth,
                        ipv4: s2.ipv4,
                        ipv6: s2.ipv6,
                        mode: p.mode,
                        allows: &p.allows,
                    },
                ))
            })
            .await;
            if let Err(e) = &applied {
                tracing::error!(sandbox = %sandbox, error = %e, "add the sandbox's nftables chains");
            }
            *gate = Some(applied);
        });
        lock(&self.sandboxes).insert(id.to_string(), sb.clone());
        lock(&self.by_addr).insert(IpAddr::V4(ipv4), sb.clone());
        lock(&self.by_addr).insert(IpAddr::V6(ipv6), sb);
        tracing::info!(sandbox = %id, %ipv4, %ipv6, "sandbox network attached");
        Ok(Attachment {
            netns: Arc::new(prepared.fd),
            resolv_conf: format!(
                "# written by the dsec edge: its DNS proxy answers only allowed names\nnameserver {}\noptions attempts:1 timeout:1\n",
                self.resolved.base.gateway_v4
            ),
        })
    }

    /// Waits until the chains of a sandbox attached by [`Network::attach`] are in the kernel;
    /// their transaction's error otherwise. Unknown ids (no networking) are fine.
    pub async fn rules_ready(&self, id: &str) -> Result<(), NetError> {
        let Some(sb) = lock(&self.sandboxes).get(id).cloned() else {
            return Ok(());
        };
        let outcome = sb.rules.lock().await;
        match &*outcome {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(e.clone()),
            None => Err(NetError::Tool {
                tool: "nft",
                message: "the task adding the sandbox's chains ended without an answer".into(),
            }),
        }
    }

    /// The host number (address index), namespace and host veth names of an attached sandbox.
    pub fn placement_of(&self, id: &str) -> Option<(u32, String, String)> {
        lock(&self.sandboxes)
            .get(id)
            .map(|s| (s.host_no, s.ns.clone(), s.veth.clone()))
    }

    /// The current policy of an attached sandbox.
    pub fn policy_of(&self, id: &str) -> Option<Policy> {
        lock(&self.sandboxes)
            .get(id)
            .map(|s| lock(&s.policy).clone())
    }

    /// Takes back a sandbox that survived an edge restart: its namespace, veth and chains
    /// still exist; only the edge's memory of them is rebuilt.
    pub async fn readopt(self: &Arc<Self>, id: &str, saved: &SavedNetwork) -> Result<(), NetError> {
        self.ensure_init().await?;
        let policy = policy::from_request(Some(&saved.spec), &BTreeMap::new(), &self.cfg.groups)
            .map_err(NetError::Policy)?;
        let (ipv4, ipv6) = lock(&self.alloc)
            .take_specific(saved.host_no)
            .ok_or(PolicyError::AddressTaken(saved.host_no))?;
        let key = key_of(id);
        let sb = Arc::new(SbNet {
            veth: saved
                .veth
                .clone()
                .unwrap_or_else(|| format!("{}{key}", self.cfg.veth_prefix)),
            ns: saved
                .ns
                .clone()
                .unwrap_or_else(|| format!("{}-{id}", self.cfg.table)),
            key,
            host_no: saved.host_no,
            ipv4,
            ipv6,
            policy: Mutex::new(policy),
            dns_refused: AtomicU64::new(0),
            dns_answered: AtomicU64::new(0),
            grants: Mutex::new(Vec::new()),
            rules: rules_in_place(),
        });
        lock(&self.sandboxes).insert(id.to_string(), sb.clone());
        lock(&self.by_addr).insert(IpAddr::V4(ipv4), sb.clone());
        lock(&self.by_addr).insert(IpAddr::V6(ipv6), sb);
        Ok(())
    }

    /// Removes everything a sandbox had. Idempotent; unknown ids are fine.
    pub async fn detach(&self, id: &str) -> Result<(), NetError> {
        let Some(sb) = lock(&self.sandboxes).remove(id) else {
            return Ok(());
        };
        lock(&self.by_addr).retain(|_, v| !Arc::ptr_eq(v, &sb));
        // After the attach transaction (never concurrently with it); a failed one left nothing.
        let in_place = matches!(&*sb.rules.lock().await, Some(Ok(())));
        let base = self.resolved.base.clone();
        let s2 = sb.clone();
        let r = blocking(move || {
            let r = if in_place {
                nft::apply(&nft::detach_script(&base, &s2.key, &s2.veth))
            } else {
                Ok(())
            };
            netns::remove(&s2.ns, &s2.veth);
            r
        })
        .await;
        lock(&self.alloc).give_back(sb.host_no);
        r
    }

    /// The sandbox's network status (mode `none` for sandboxes without networking).
    pub async fn status(
        &self,
        id: &str,
        fallback_groups: &BTreeMap<String, bool>,
    ) -> NetworkStatus {
        let Some(sb) = lock(&self.sandboxes).get(id).cloned() else {
            return NetworkStatus {
                mode: NetworkMode::None,
                groups: fallback_groups.clone(),
                ..Default::default()
            };
        };
        let base = self.resolved.base.clone();
        let key = sb.key.clone();
        let denied = blocking(move || nft::denied_packets(&base, &key))
            .await
            .unwrap_or(0);
        let p = lock(&sb.policy).clone();
        let now = Instant::now();
        let grants = {
            let mut g = lock(&sb.grants);
            g.retain(|(_, _, exp)| *exp > now);
            g.iter()
                .map(|(n, a, exp)| DnsGrant {
                    name: n.clone(),
                    address: a.to_string(),
                    expires_in_s: exp.saturating_duration_since(now).as_secs(),
                })
                .collect()
        };
        NetworkStatus {
            mode: p.mode,
            rules: p.rules,
            groups: p.groups,
            ipv4: Some(sb.ipv4.to_string()),
            ipv6: Some(sb.ipv6.to_string()),
            resolver: Some(self.resolved.base.gateway_v4.to_string()),
            denied_packets: denied,
            dns_refused: sb.dns_refused.load(Ordering::Relaxed),
            dns_answered: sb.dns_answered.load(Ordering::Relaxed),
            dns_grants: grants,
        }
    }

    /// Replaces a running sandbox's rules in one nftables transaction.
    pub async fn update(&self, id: &str, spec: &NetworkSpec) -> Result<(), NetError> {
        let Some(sb) = lock(&self.sandboxes).get(id).cloned() else {
            return Err(PolicyError::CreatedWithoutNetwork(id.to_string()).into());
        };
        self.rules_ready(id).await?;
        let current = lock(&sb.policy).clone();
        let next = policy::update(&current, spec, &self.cfg.groups).map_err(NetError::Policy)?;
        if next.mode == NetworkMode::None {
            return Err(PolicyError::BackToNone.into());
        }
        let base = self.resolved.base.clone();
        let s2 = sb.clone();
        let n2 = next.clone();
        blocking(move || {
            let rules = nft::SandboxRules {
                key: &s2.key,
                veth: &s2.veth,
                ipv4: s2.ipv4,
                ipv6: s2.ipv6,
                mode: n2.mode,
                allows: &n2.allows,
            };
            // Names no longer allowed lose their DNS grants in the same transaction.
            let mut script = nft::rules_script(&base, &rules);
            script.push_str(&format!(
                "flush set inet {t} sb_{k}_d4\nflush set inet {t} sb_{k}_d6\n",
                t = base.table,
                k = s2.key
            ));
            nft::apply(&script)
        })
        .await?;
        lock(&sb.grants).clear();
        *lock(&sb.policy) = next;
        tracing::info!(sandbox = %id, "network rules updated");
        Ok(())
    }

    /// Removes what an earlier run left: namespaces and veths with our prefixes, the table.
    pub async fn reap_orphans(&self) -> Vec<String> {
        if let Err(e) = self.own() {
            tracing::warn!(error = %e, "not reaping leftover sandbox networks");
            return Vec::new();
        }
        let ns_prefix = format!("{}-", self.cfg.table);
        let veth_prefix = self.cfg.veth_prefix.clone();
        let table = self.cfg.table.clone();
        let mut live: Vec<(String, String)> = lock(&self.sandboxes)
            .values()
            .map(|s| (s.ns.clone(), s.veth.clone()))
            .collect();
        live.extend(self.spare_names());
        let live_keys: Vec<String> = lock(&self.sandboxes)
            .values()
            .map(|s| s.key.clone())
            .collect();
        let base = self.resolved.base.clone();
        blocking(move || {
            let (nss, veths) = netns::leftovers(&ns_prefix, &veth_prefix);
            let mut reaped = Vec::new();
            for ns in nss.iter().filter(|n| !live.iter().any(|(l, _)| l == *n)) {
                netns::remove(ns, "");
                reaped.push(ns.clone());
            }
            for v in veths.iter().filter(|v| !live.iter().any(|(_, l)| l == *v)) {
                netns::remove("", v);
                reaped.push(v.clone());
            }
            if live.is_empty() {
                nft::delete_table(&table);
            } else {
                // Chains, sets and counters of sandboxes that were not re-adopted (their
                // veth may have been a spare's: the verdict maps say which).
                let text = nft::list_table(&table);
                let veth_of = nft::map_veths(&text);
                for key in nft::chain_keys(&text) {
                    if live_keys.contains(&key) {
                        continue;
                    }
                    let veth = veth_of
                        .iter()
                        .find(|(_, k)| *k == key)
                        .map(|(v, _)| v.clone())
                        .unwrap_or_else(|| format!("{}{key}", base.veth_prefix));
                    match nft::apply(&nft::detach_orphan_script(&base, &key, &veth)) {
                        Ok(()) => reaped.push(format!("nft:sb_{key}")),
                        Err(e) => {
                            tracing::warn!(key = %key, error = %e, "remove leftover sandbox chains")
                        }
                    }
                }
            }
            Ok(reaped)
        })
        .await
        .unwrap_or_default()
    }

    /// Answers one DNS message from `src`; returns the reply (None: drop silently).
    async fn answer(&self, msg: &[u8], src: IpAddr) -> Option<Vec<u8>> {
        let sb = lock(&self.by_addr).get(&src).cloned();
        let q = match dns::parse_query(msg) {
            Ok(q) => q,
            Err(Some(id)) => return Some(dns::build_formerr(id)),
            Err(None) => return None,
        };
        let Some(sb) = sb else {
            self.dns_refused_total.fetch_add(1, Ordering::Relaxed);
            return Some(dns::build_answer(&q, dns::RCODE_REFUSED, &[], 0));
        };
        let allowed = lock(&sb.policy).allows_name(&q.name);
        if !allowed || q.qclass != 1 {
            sb.dns_refused.fetch_add(1, Ordering::Relaxed);
            self.dns_refused_total.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(sandbox_addr = %src, name = %q.name, "DNS proxy refused a name the sandbox may not resolve");
            return Some(dns::build_answer(&q, dns::RCODE_REFUSED, &[], 0));
        }
        let Some(addrs) = dns::lookup(&self.resolved.hosts, &q.name).map(<[IpAddr]>::to_vec) else {
            sb.dns_answered.fetch_add(1, Ordering::Relaxed);
            return Some(dns::build_answer(&q, dns::RCODE_NXDOMAIN, &[], 0));
        };
        let ttl = self.cfg.dns_ttl_s;
        let wanted: Vec<IpAddr> = addrs
            .into_iter()
            .filter(|a| {
                matches!(
                    (a, q.qtype),
                    (IpAddr::V4(_), dns::TYPE_A) | (IpAddr::V6(_), dns::TYPE_AAAA)
                )
            })
            .collect();
        if !wanted.is_empty() && lock(&sb.policy).mode == NetworkMode::Allowlist {
            let base = self.resolved.base.clone();
            let key = sb.key.clone();
            let ports = self.cfg.domain_ports.clone();
            let w2 = wanted.clone();
            let granted = blocking(move || {
                let script: String = w2
                    .iter()
                    .map(|a| {
                        nft::grant_script(
                            &base,
                            &key,
                            *a,
                            &ports,
                            Duration::from_secs(u64::from(ttl)),
                        )
                    })
                    .collect();
                nft::apply(&script)
            })
            .await;
            if let Err(e) = granted {
                tracing::error!(name = %q.name, error = %e, "DNS proxy could not allow resolved addresses");
                return Some(dns::build_answer(&q, 2, &[], 0)); // SERVFAIL
            }
            let exp = Instant::now() + Duration::from_secs(u64::from(ttl));
            let mut g = lock(&sb.grants);
            for a in &wanted {
                g.retain(|(n, x, _)| !(n == &q.name && x == a));
                g.push((q.name.clone(), *a, exp));
            }
        }
        sb.dns_answered.fetch_add(1, Ordering::Relaxed);
        Some(dns::build_answer(&q, 0, &wanted, ttl))
    }
}

/// The DNS proxy loop; ends when the network is dropped.
async fn serve_dns(net: std::sync::Weak<Network>, sock: tokio::net::UdpSocket) {
    let mut buf = vec![0u8; 1500];
    loop {
        let (n, from) = match sock.recv_from(&mut buf).await {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "DNS proxy receive");
                continue;
            }
        };
        let Some(net) = net.upgrade() else { return };
        if let Some(reply) = net.answer(&buf[..n], from.ip()).await {
            let _ = sock.send_to(&reply, from).await;
        }
    }
}

/// Runs blocking tool invocations off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, NetError> + Send + 'static,
) -> Result<T, NetError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| NetError::Tool {
            tool: "task",
            message: e.to_string(),
        })?
}

/// Runs `tool args…` with `input` on its standard input (`ip -batch -`, `nft -f -`); a failure
/// becomes [`NetError::Tool`] carrying the tool's stderr.
fn run_fed(tool: &'static str, args: &[&str], input: &str) -> Result<(), NetError> {
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let err = |message: String| NetError::Tool { tool, message };
    let mut child = Command::new(tool)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| err(e.to_string()))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.as_bytes())
            .map_err(|e| err(e.to_string()))?;
    }
    let out = child.wait_with_output().map_err(|e| err(e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(err(String::from_utf8_lossy(&out.stderr).trim().to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert_eq!(key_of("sb-n0-0123456789abcdef"), "456789abcdef");
        assert_eq!(key_of("short"), "short");
    }
}
