//! A VM's network interface, on the sandbox's own network namespace (issue 9 with issue 8).
//!
//! The edge gives a networked sandbox a named network namespace holding `eth0`, the inner end
//! of a routed veth whose host end carries all enforcement (nftables chains and sets, denied
//! counters, the DNS proxy on the gateway address). A container uses `eth0` directly. For a VM
//! the namespace becomes a two-port switch instead:
//!
//! ```text
//!  host: nft on <veth> ── veth ── [netns: eth0 ─ br0 ─ tap0] ── QEMU virtio-net ── guest eth0
//! ```
//!
//! [`prepare`] reads `eth0`'s addresses and default gateway, removes them from `eth0`, makes a
//! bridge `br0` of `eth0` and a persistent tap `tap0`. The guest then carries the sandbox's
//! address itself (passed on the kernel command line as `dsec.net=`, applied by the guest's
//! `/init` with busybox `ip`), so every packet it sends reaches the host through the same veth
//! with the same source address as a container's would: the host-side rules, counters and DNS
//! proxy apply unchanged, and nothing the guest can touch (its own kernel, its own NIC) holds
//! any of them. The guest's MAC does not matter to the host (it routes by address).
//!
//! QEMU opens `tap0` by name, so it must run inside the namespace: the namespace's path is kept
//! in `<vm dir>/netns` ([`NETNS_FILE`]) and every QEMU start of the VM (boot, resume from a
//! snapshot, also after an edge restart) enters it first ([`enter_netns`]). The tap is
//! persistent: it stays (carrier down) while a paused VM has no QEMU, and the resumed QEMU
//! attaches to it again. Teardown needs nothing of its own: the bridge and the tap live in the
//! namespace and go with it when the edge deletes it (stop, failed create, orphan reaping).

use super::error::VmNetError;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::machine::Machine;
use crate::substrate::CreateSandboxError;

/// File in the VM directory holding the path of the network namespace QEMU runs in.
pub const NETNS_FILE: &str = "netns";
/// The tap device QEMU attaches to, inside the sandbox's namespace.
pub const TAP: &str = "tap0";
/// The bridge joining the veth's inner end and the tap.
pub const BRIDGE: &str = "br0";
/// The veth's inner end as the edge names it.
const INNER: &str = "eth0";

/// Where the named network namespaces are (`ip netns`).
pub(super) const NETNS_RUN_DIR: &str = "/run/netns";

/// The guest's network configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmNet {
    /// `/run/netns/<name>` of the sandbox's namespace.
    pub netns: PathBuf,
    pub ipv4: Ipv4Addr,
    pub gateway: Ipv4Addr,
    pub ipv6: Option<Ipv6Addr>,
    pub mtu: u32,
    /// Locally administered, derived from the IPv4 address (unique on the node).
    pub mac: String,
}

/// The path under `/run/netns` naming the namespace `fd` refers to (QEMU is started again on
/// resume, possibly by a later edge process: it needs a name, not an fd).
pub fn netns_path(fd: &OwnedFd) -> Result<PathBuf, VmNetError> {
    let want = std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|e| VmNetError::io("stat the sandbox's network namespace", e))?;
    let rd = std::fs::read_dir(NETNS_RUN_DIR)
        .map_err(|e| VmNetError::io(format!("list {NETNS_RUN_DIR}"), e))?;
    for e in rd.flatten() {
        if let Ok(m) = std::fs::metadata(e.path()) {
            if m.dev() == want.dev() && m.ino() == want.ino() {
                return Ok(e.path());
            }
        }
    }
    Err(VmNetError::Unnamed)
}

fn ip(ns: &str, args: &[&str]) -> Result<String, VmNetError> {
    let out = Command::new("ip")
        .args(["-n", ns])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| VmNetError::io("run ip", e))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(VmNetError::Ip {
            ns: ns.to_string(),
            command: args.join(" "),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

fn ip_batch(ns: &str, lines: &str) -> Result<(), VmNetError> {
    use std::io::Write as _;
    let mut child = Command::new("ip")
        .args(["-n", ns, "-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| VmNetError::io("run ip", e))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(lines.as_bytes())
            .map_err(|e| VmNetError::io("ip -batch", e))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| VmNetError::io("ip -batch", e))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(VmNetError::Ip {
            ns: ns.to_string(),
            command: format!("-batch ({})", lines.trim().replace('\n', "; ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// `eth0`'s global addresses and MTU, and the default IPv4 gateway, from `ip -j` output.
fn parse_inner(
    addr_json: &str,
    route_json: &str,
) -> Result<(Ipv4Addr, Option<Ipv6Addr>, u32, Ipv4Addr), VmNetError> {
    let parse = |command| move |source| VmNetError::Parse { command, source };
    let links: serde_json::Value = serde_json::from_str(addr_json).map_err(parse("ip -j addr"))?;
    let link = links.get(0).ok_or(VmNetError::NoLink(INNER))?;
    let mtu = link.get("mtu").and_then(|m| m.as_u64()).unwrap_or(1500) as u32;
    let mut v4 = None;
    let mut v6 = None;
    for a in link
        .get("addr_info")
        .and_then(|a| a.as_array())
        .into_iter()
        .flatten()
    {
        let local = a.get("local").and_then(|l| l.as_str()).unwrap_or("");
        match a.get("family").and_then(|f| f.as_str()) {
            Some("inet") => v4 = v4.or(local.parse::<Ipv4Addr>().ok()),
            Some("inet6") => {
                if let Ok(x) = local.parse::<Ipv6Addr>() {
                    // Link-local addresses stay with the link, not the guest.
                    if x.segments()[0] & 0xffc0 != 0xfe80 {
                        v6 = v6.or(Some(x));
                    }
                }
            }
            _ => {}
        }
    }
    let v4 = v4.ok_or(VmNetError::NoIpv4(INNER))?;
    let routes: serde_json::Value =
        serde_json::from_str(route_json).map_err(parse("ip -j route"))?;
    let gw = routes
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|r| r.get("gateway")?.as_str()?.parse::<Ipv4Addr>().ok())
        .ok_or(VmNetError::NoGateway)?;
    Ok((v4, v6, mtu, gw))
}

/// The guest's MAC: locally administered (`02:`), the rest from its IPv4 address.
pub fn mac_for(ipv4: Ipv4Addr) -> String {
    let o = ipv4.octets();
    format!("02:d5:{:02x}:{:02x}:{:02x}:{:02x}", o[0], o[1], o[2], o[3])
}

/// Turns the sandbox's namespace into a switch between its veth and a new tap (see the module
/// documentation) and returns what the guest must configure. Blocking (runs `ip`).
pub fn prepare(fd: &OwnedFd) -> Result<VmNet, VmNetError> {
    let netns = netns_path(fd)?;
    let name = netns
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| VmNetError::BadPath(netns.clone()))?
        .to_string();
    let addrs = ip(&name, &["-j", "addr", "show", "dev", INNER])?;
    let routes = ip(&name, &["-j", "-4", "route", "show", "default"])?;
    let (ipv4, ipv6, mtu, gateway) = parse_inner(&addrs, &routes)?;
    ip_batch(&name, &switch_script(mtu))?;
    Ok(VmNet {
        netns,
        ipv4,
        gateway,
        ipv6,
        mtu,
        mac: mac_for(ipv4),
    })
}

/// `ip -batch` lines: addresses off `eth0`, a bridge of `eth0` and a persistent tap. No IPv6
/// address generation on either (the namespace itself takes no part in the traffic).
fn switch_script(mtu: u32) -> String {
    format!(
        "addr flush dev {INNER}\n\
         link add {BRIDGE} mtu {mtu} type bridge\n\
         link set {BRIDGE} addrgenmode none\n\
         tuntap add dev {TAP} mode tap\n\
         link set {TAP} addrgenmode none\n\
         link set {TAP} mtu {mtu} master {BRIDGE} up\n\
         link set {INNER} master {BRIDGE}\n\
         link set {BRIDGE} up\n"
    )
}

/// The virtio-net device of the machine type.
fn device(machine: Machine) -> String {
    machine.dev("virtio-net")
}

/// The QEMU arguments of the NIC: the tap (opened by name inside the namespace; vhost off,
/// there is no vhost-net in most sandboxes' hosts and TCG cannot use it) and a virtio-net
/// device telling the guest the MTU.
pub fn qemu_args(net: &VmNet, device: &str) -> Vec<String> {
    vec![
        "-netdev".into(),
        format!("tap,id=net0,ifname={TAP},script=no,downscript=no,vhost=off"),
        "-device".into(),
        format!(
            "{device},netdev=net0,mac={},host_mtu={}",
            net.mac,
            net.mtu.min(65535)
        ),
    ]
}

/// `dsec.net=<ipv4>,<gateway>,<ipv6 or ->,<mtu>,<mac>`: what the guest's `/init` configures
/// (the DNS proxy is the gateway address).
pub fn kernel_arg(net: &VmNet) -> String {
    format!(
        "dsec.net={},{},{},{},{}",
        net.ipv4,
        net.gateway,
        net.ipv6
            .map(|a| a.to_string())
            .unwrap_or_else(|| "-".into()),
        net.mtu,
        net.mac
    )
}

/// Adds the NIC to a microVM command line: the device arguments, and `dsec.net=` appended to
/// the kernel command line (`-append`).
pub fn add_to_microvm(args: &mut Vec<String>, net: &VmNet, machine: Machine) {
    if let Some(i) = args.iter().position(|a| a == "-append") {
        if let Some(append) = args.get_mut(i + 1) {
            append.push(' ');
            append.push_str(&kernel_arg(net));
        }
    }
    args.extend(qemu_args(net, &device(machine)));
}

/// For a sandbox with networking (`netns` from the spec): [`prepare`]s its namespace and
/// records it in `<vm dir>/netns`, read by [`enter_netns`] at every QEMU start of the VM.
/// `None` for a sandbox without networking (the VM then gets no NIC at all).
pub async fn attach(
    netns: Option<std::sync::Arc<OwnedFd>>,
    vm_dir: &Path,
) -> Result<Option<VmNet>, CreateSandboxError> {
    let Some(fd) = netns else {
        return Ok(None);
    };
    let net = tokio::task::spawn_blocking(move || prepare(&fd))
        .await
        .map_err(|e| CreateSandboxError::Setup(format!("VM network task: {e}")))?
        .map_err(|e| CreateSandboxError::Setup(format!("VM network: {e}")))?;
    std::fs::write(
        vm_dir.join(NETNS_FILE),
        net.netns.as_os_str().as_encoded_bytes(),
    )
    .map_err(|e| CreateSandboxError::Setup(format!("write {NETNS_FILE}: {e}")))?;
    Ok(Some(net))
}

/// If the VM has a NIC (`<vm dir>/netns` exists), makes `cmd` enter that namespace before it
/// runs QEMU. Fails when the namespace is gone (the sandbox's network was removed).
pub fn enter_netns(cmd: &mut tokio::process::Command, vm_dir: &Path) -> Result<(), VmNetError> {
    let raw = match std::fs::read(vm_dir.join(NETNS_FILE)) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(VmNetError::io(format!("read {NETNS_FILE}"), e)),
    };
    let path = std::ffi::CString::new(raw).map_err(|_| VmNetError::Nul(NETNS_FILE))?;
    if !Path::new(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(path.as_bytes()))
        .exists()
    {
        return Err(VmNetError::Gone(path.to_string_lossy().into_owned()));
    }
    // SAFETY: the closure runs in the forked child before exec and only calls open(2),
    // setns(2) and close(2) (async-signal-safe) on a C string allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let fd = libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            let r = libc::setns(fd, libc::CLONE_NEWNET);
            let err = std::io::Error::last_os_error();
            libc::close(fd);
            if r != 0 {
                return Err(err);
            }
            Ok(())
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ADDRS: &str = r#"[{"ifindex":2,"ifname":"eth0","mtu":65520,"addr_info":[
        {"family":"inet","local":"10.201.0.7","prefixlen":32},
        {"family":"inet6","local":"fd00:d5ec::7","prefixlen":128},
        {"family":"inet6","local":"fe80::2","prefixlen":64}]}]"#;
    const ROUTES: &str = r#"[{"dst":"default","gateway":"10.201.0.1","dev":"eth0","flags":[]}]"#;

    #[test]
    fn inner_link_config_is_read_from_ip_json() {
        let (v4, v6, mtu, gw) = parse_inner(ADDRS, ROUTES).unwrap();
        assert_eq!(v4, Ipv4Addr::new(10, 201, 0, 7));
        assert_eq!(v6, Some("fd00:d5ec::7".parse().unwrap()));
        assert_eq!(mtu, 65520);
        assert_eq!(gw, Ipv4Addr::new(10, 201, 0, 1));
        assert!(parse_inner("[]", ROUTES).is_err());
        assert!(parse_inner(ADDRS, "[]").is_err());
        assert!(parse_inner("not json", ROUTES).is_err());
    }

    #[test]
    fn command_line_and_kernel_argument() {
        let net = VmNet {
            netns: "/run/netns/dsec-pool7".into(),
            ipv4: Ipv4Addr::new(10, 201, 0, 7),
            gateway: Ipv4Addr::new(10, 201, 0, 1),
            ipv6: None,
            mtu: 65520,
            mac: mac_for(Ipv4Addr::new(10, 201, 0, 7)),
        };
        assert_eq!(net.mac, "02:d5:0a:c9:00:07");
        let mut args: Vec<String> = ["-append", "console=ttyS0", "-m", "256M"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        add_to_microvm(&mut args, &net, Machine::Pc);
        assert_eq!(
            args[1],
            "console=ttyS0 dsec.net=10.201.0.7,10.201.0.1,-,65520,02:d5:0a:c9:00:07"
        );
        let s = args.join(" ");
        assert!(s.contains("-netdev tap,id=net0,ifname=tap0,script=no,downscript=no,vhost=off"));
        assert!(
            s.contains("-device virtio-net-pci,netdev=net0,mac=02:d5:0a:c9:00:07,host_mtu=65520")
        );
        assert!(switch_script(1500).contains("link set eth0 master br0"));
    }

    #[test]
    fn no_netns_file_means_no_namespace_change() {
        let t = tempfile::tempdir().unwrap();
        let mut cmd = tokio::process::Command::new("true");
        assert!(enter_netns(&mut cmd, t.path()).is_ok());
        std::fs::write(
            t.path().join(NETNS_FILE),
            "/run/netns/dsec-no-such-namespace",
        )
        .unwrap();
        let e = enter_netns(&mut cmd, t.path()).unwrap_err().to_string();
        assert!(e.contains("is gone"), "{e}");
    }
}
