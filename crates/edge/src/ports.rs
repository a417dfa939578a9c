//! Exposed ports (issue 18): a TCP connection from the edge to a port inside a sandbox.
//!
//! The apiserver asks `GET /edge/v1/sandboxes/{id}/ports/{port}/tunnel` with
//! `Upgrade: dsec-tunnel`; the edge connects to the port first (so a dead port answers a 502
//! naming it, before any upgrade), then answers 101 and copies bytes both ways between the
//! upgraded connection and the sandbox socket. The apiserver speaks HTTP (keep-alive, chunked
//! bodies, WebSocket upgrades) over that byte stream.
//!
//! The socket is made inside the sandbox's network namespace: a short-lived thread enters the
//! namespace of the sandbox's agent (`/proc/<pid>/ns/net`), creates the socket there (a socket
//! stays in the namespace it was created in) and exits; the connect then runs on tokio. The
//! connection goes to the sandbox's loopback, so it needs no route, veth or nftables rule, and a
//! sandbox without egress keeps none. A namespace from the pool has its loopback down; the thread
//! brings it up (what any sandbox with networking already has).
//!
//! Nothing outlives the sandbox: a bridge checks every second that its sandbox is still live and
//! ends its connection when it is not (the socket would otherwise keep the namespace alive).

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpSocket, TcpStream};

use crate::error::EdgeError;

/// The `Upgrade` protocol name of a tunnel.
pub const TUNNEL_PROTOCOL: &str = "dsec-tunnel";
/// Header the apiserver sets when the caller showed no credentials: only public ports open.
pub const PUBLIC_ONLY_HEADER: &str = "x-dsec-public-only";

/// How long a connect to a sandbox port may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a bridge checks that its sandbox still lives.
const LIVENESS_PERIOD: Duration = Duration::from_secs(1);

/// What the edge needs to reach a sandbox's port.
#[derive(Debug, Clone)]
pub struct PortTarget {
    /// A process inside the sandbox's network namespace (the agent).
    pub pid: i32,
    /// Ports open without credentials.
    pub public_ports: Vec<u16>,
}

/// Failures of a connect to a sandbox port.
#[derive(Debug, thiserror::Error)]
pub enum ConnectPortError {
    #[error("enter the network namespace of sandbox {id}: {source}")]
    Namespace { id: String, source: io::Error },
    #[error("nothing listens on port {port} in sandbox {id} ({source}); start a server on that port (on 0.0.0.0 or 127.0.0.1) first")]
    NotListening {
        id: String,
        port: u16,
        source: io::Error,
    },
    #[error("port {port} in sandbox {id} did not accept a connection within {secs} s")]
    Timeout { id: String, port: u16, secs: u64 },
}

impl From<ConnectPortError> for EdgeError {
    fn from(e: ConnectPortError) -> Self {
        match e {
            ConnectPortError::Namespace { .. } => EdgeError::Internal(e.to_string()),
            ConnectPortError::NotListening { .. } | ConnectPortError::Timeout { .. } => {
                EdgeError::PortUnreachable(e.to_string())
            }
        }
    }
}

/// Checks that `port` may be opened by a caller without credentials.
pub fn check_public(
    id: &str,
    port: u16,
    target: &PortTarget,
    public_only: bool,
) -> Result<(), EdgeError> {
    if public_only && !target.public_ports.contains(&port) {
        return Err(EdgeError::Unauthorized(format!(
            "port {port} of sandbox {id} is not public: send the API key (Authorization: Bearer), \
             or use a signed URL (POST /v1/sandboxes/{id}/port_urls, sandbox.get_url), or create \
             the sandbox with public_ports=[{port}]"
        )));
    }
    Ok(())
}

/// Validates the `public_ports` of a create request.
pub fn validate_public_ports(ports: &[u16]) -> Result<(), EdgeError> {
    if ports.contains(&0) {
        return Err(EdgeError::BadRequest(
            "public_ports: 0 is not a TCP port (use 1..=65535)".into(),
        ));
    }
    if ports.len() > 64 {
        return Err(EdgeError::BadRequest("at most 64 public_ports".into()));
    }
    Ok(())
}

/// Connects to `port` on the loopback of the network namespace of `pid` (IPv4, then IPv6).
pub async fn connect(id: &str, pid: i32, port: u16) -> Result<TcpStream, ConnectPortError> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let spawned = std::thread::Builder::new()
        .name("port-connect".into())
        .spawn(move || {
            let _ = tx.send(sockets_in_netns(pid));
        });
    let ns_err = |source| ConnectPortError::Namespace {
        id: id.to_string(),
        source,
    };
    spawned.map_err(ns_err)?;
    let (v4, v6) = rx
        .await
        .map_err(|_| ns_err(io::Error::other("the namespace thread ended")))?
        .map_err(ns_err)?;
    let attempt = async {
        let first = connect_fd(v4, SocketAddr::from((Ipv4Addr::LOCALHOST, port))).await;
        match (first, v6) {
            (Ok(s), _) => Ok(s),
            (Err(e4), Some(v6)) => {
                match connect_fd(v6, SocketAddr::from((Ipv6Addr::LOCALHOST, port))).await {
                    Ok(s) => Ok(s),
                    Err(_) => Err(e4),
                }
            }
            (Err(e4), None) => Err(e4),
        }
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(source)) => Err(ConnectPortError::NotListening {
            id: id.to_string(),
            port,
            source,
        }),
        Err(_) => Err(ConnectPortError::Timeout {
            id: id.to_string(),
            port,
            secs: CONNECT_TIMEOUT.as_secs(),
        }),
    }
}

async fn connect_fd(fd: OwnedFd, addr: SocketAddr) -> io::Result<TcpStream> {
    // SAFETY: `fd` is an unconnected, non-blocking TCP socket we own; ownership moves here.
    let std = unsafe { std::net::TcpStream::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(fd)) };
    TcpSocket::from_std_stream(std).connect(addr).await
}

/// On a fresh thread (its namespace is discarded when it exits): enters the network namespace
/// of `pid`, brings its loopback up and creates an IPv4 and (where the namespace has it) an
/// IPv6 TCP socket there.
fn sockets_in_netns(pid: i32) -> io::Result<(OwnedFd, Option<OwnedFd>)> {
    let path = std::ffi::CString::new(format!("/proc/{pid}/ns/net"))
        .map_err(|_| io::Error::other("bad namespace path"))?;
    // SAFETY: open(2) of a NUL-terminated path; the fd is ours on success.
    let ns = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if ns < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd owned by nobody else.
    let ns = unsafe { OwnedFd::from_raw_fd(ns) };
    // SAFETY: setns changes only this thread's network namespace; the thread exits right after.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let v4 = tcp_socket(libc::AF_INET)?;
    loopback_up(&v4)?;
    let v6 = tcp_socket(libc::AF_INET6).ok();
    Ok((v4, v6))
}

fn tcp_socket(family: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the fd is ours on success.
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sets `IFF_UP` on `lo` of the socket's namespace if it is down.
fn loopback_up(sock: &OwnedFd) -> io::Result<()> {
    // SAFETY: an all-zero ifreq is a valid value of this plain C struct.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads into the ifreq we own.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS as _, &mut req) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: after SIOCGIFFLAGS the union holds the flags.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    if flags & libc::IFF_UP as libc::c_short != 0 {
        return Ok(());
    }
    req.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
    // SAFETY: SIOCSIFFLAGS reads the ifreq we own.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS as _, &req) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// After the 101 answer: copies bytes between the upgraded connection and the sandbox socket
/// until either side closes or the sandbox ends (`is_live` turns false); `gauge` counts the
/// open tunnels.
pub fn bridge(
    gauge: prometheus::IntGauge,
    is_live: impl Fn() -> bool + Send + Sync + 'static,
    id: String,
    port: u16,
    upgrade: OnUpgrade,
    mut sock: TcpStream,
) {
    tokio::spawn(async move {
        let upgraded = match upgrade.await {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!(sandbox = %id, port, error = %e, "port tunnel: the upgrade failed");
                return;
            }
        };
        let mut upgraded = TokioIo::new(upgraded);
        gauge.inc();
        let copy = tokio::io::copy_bidirectional(&mut upgraded, &mut sock);
        let ended = async {
            loop {
                tokio::time::sleep(LIVENESS_PERIOD).await;
                if !is_live() {
                    return;
                }
            }
        };
        tokio::select! {
            r = copy => match r {
                Ok((up, down)) => tracing::debug!(sandbox = %id, port, up, down, "port tunnel closed"),
                Err(e) => tracing::debug!(sandbox = %id, port, error = %e, "port tunnel ended"),
            },
            () = ended => tracing::debug!(sandbox = %id, port, "port tunnel closed: the sandbox ended"),
        }
        gauge.dec();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_ports() {
        let t = PortTarget {
            pid: 1,
            public_ports: vec![8000],
        };
        assert!(check_public("sb", 8000, &t, true).is_ok());
        assert!(check_public("sb", 8001, &t, false).is_ok());
        let e = check_public("sb", 8001, &t, true).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::UNAUTHORIZED);
        assert!(e.to_string().contains("port 8001"), "{e}");
        assert!(validate_public_ports(&[0]).is_err());
        assert!(validate_public_ports(&[1, 65535]).is_ok());
    }

    #[test]
    fn not_listening_is_a_502_naming_the_port() {
        let e: EdgeError = ConnectPortError::NotListening {
            id: "sb-n0-1".into(),
            port: 9,
            source: io::Error::from(io::ErrorKind::ConnectionRefused),
        }
        .into();
        assert_eq!(e.status(), axum::http::StatusCode::BAD_GATEWAY);
        assert!(e.to_string().contains("port 9"), "{e}");
    }

    /// Needs root (setns): connects into this process's own namespace through /proc.
    #[tokio::test]
    async fn connects_through_proc_ns() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP: needs root for setns");
            return;
        }
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let pid = std::process::id() as i32;
        let s = connect("self", pid, port).await.unwrap();
        drop(s);
        drop(l);
        let e = connect("self", pid, port).await.unwrap_err();
        assert!(matches!(e, ConnectPortError::NotListening { .. }), "{e}");
    }
}
