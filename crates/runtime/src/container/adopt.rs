//! Re-adopting a running container after a restart of the edge.
//!
//! With a reattach grace (see [`ContainerSubstrate::with_reattach_grace`]) aether inherits a
//! listening unix socket bound at `<sandbox dir>/aether.sock` on fd 4. The path is on the host,
//! outside the sandbox's root, so nothing inside can reach it. When the edge dies, aether's
//! channel breaks; it keeps its sessions and waits up to the grace for a connection on that
//! listener, then sends `Ready` (id 0) on the new connection.
//!
//! [`ContainerSubstrate::adopt`] is the restarted edge's side: open a pidfd for the recorded
//! pid, check it is the sandbox's aether (its cgroup names the sandbox), connect, wait for
//! `Ready` and rebuild the [`ContainerSandbox`]. A frozen (paused) sandbox is not thawed: its
//! aether takes the connection and sends `Ready` when it is resumed, so nothing in it runs
//! during the adoption. The adopted aether is not the new edge's child: its exit is noticed
//! through the pidfd becoming readable, without a status.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

use super::{pause, AetherExit, ContainerSandbox, ContainerSubstrate, Process, SandboxDirs};
use crate::aether_client::AetherClient;

/// Name of the reattach socket in the sandbox dir.
pub const SOCKET_NAME: &str = "aether.sock";
/// How long a reattached aether may take to send `Ready`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(5);

pub use crate::error::AdoptError;

/// The reattach socket's path for a sandbox dir.
pub fn socket_path(dir: &Path) -> PathBuf {
    dir.join(SOCKET_NAME)
}

/// Binds the reattach listener at `<dir>/aether.sock` (mode 0600, replacing a stale file).
pub fn bind_listener(dir: &Path) -> io::Result<UnixListener> {
    let path = socket_path(dir);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let l = UnixListener::bind(&path)
        .map_err(|e| io::Error::new(e.kind(), format!("bind {}: {e}", path.display())))?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    Ok(l)
}

/// `pidfd_open(2)`.
fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh fd that nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// True when `/proc/<pid>/cgroup` text places the process in a cgroup named `id`.
pub fn cgroup_names(cgroup_text: &str, id: &str) -> bool {
    cgroup_text.lines().any(|l| {
        l.splitn(3, ':')
            .nth(2)
            .is_some_and(|p| p.split('/').any(|part| part == id))
    })
}

/// Watches a process that is not our child: resolves (with an unknown status) when its pidfd
/// becomes readable, i.e. when it exited.
fn watch_foreign_exit(pidfd: &Arc<OwnedFd>) -> io::Result<watch::Receiver<Option<AetherExit>>> {
    let (tx, rx) = watch::channel(None);
    let owned = pidfd.try_clone()?;
    // SAFETY: `owned` is a valid fd owned by the AsyncFd for its whole life; OwnedFd always
    // returns the same fd.
    let async_fd = unsafe { AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE) }
        .map_err(|e| io::Error::other(e.to_string()))?;
    tokio::spawn(async move {
        let _ = async_fd.readable().await;
        let _ = tx.send(Some(AetherExit::Signal(0)));
    });
    Ok(rx)
}

impl ContainerSubstrate {
    /// Re-adopts the running sandbox `id` whose aether has host pid `pid` and whose dir is
    /// `dir`. The sandbox is left exactly as it was (a paused one stays frozen). On error
    /// nothing was changed; the caller decides whether to clean the sandbox up.
    pub async fn adopt(
        &self,
        id: &str,
        dir: &Path,
        pid: i32,
    ) -> Result<ContainerSandbox, AdoptError> {
        let gone = || AdoptError::Gone {
            id: id.to_string(),
            pid,
        };
        if pid <= 1 {
            return Err(gone());
        }
        let pidfd = pidfd_open(pid).map_err(|_| gone())?;
        // Checked after the pidfd exists: if the pid is reused from here on, the pidfd still
        // refers to the process we checked.
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).map_err(|_| gone())?;
        if !cgroup_names(&text, id) {
            return Err(AdoptError::NotOurs {
                id: id.to_string(),
                pid,
            });
        }
        let cgroup = self.cgroup_of(id).map_err(|e| AdoptError::Io {
            id: id.to_string(),
            what: "open cgroup".into(),
            source: io::Error::other(e),
        })?;
        let path = socket_path(dir);
        let stream = tokio::net::UnixStream::connect(&path)
            .await
            .map_err(|source| AdoptError::Connect {
                id: id.to_string(),
                path: path.clone(),
                source,
            })?;
        let client = AetherClient::new(stream);
        // A frozen (paused) sandbox is adopted without the handshake: thawing it, even briefly,
        // would let its processes run (and be frozen again at an arbitrary point). Its aether
        // still sits in the read on the old, broken channel; the connection made above waits in
        // the listener's backlog, and at the resume aether sees the old channel's end, accepts
        // it, sends `Ready` and serves the requests queued meanwhile. The pidfd and cgroup
        // checks above already tie the pid to this sandbox.
        let frozen = pause::is_frozen(&cgroup);
        if !frozen {
            match tokio::time::timeout(READY_TIMEOUT, client.wait_ready()).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    return Err(AdoptError::NoReady {
                        id: id.to_string(),
                        reason: e.to_string(),
                    })
                }
                Err(_) => {
                    return Err(AdoptError::NoReady {
                        id: id.to_string(),
                        reason: format!("no Ready within {} s", READY_TIMEOUT.as_secs()),
                    })
                }
            }
        }
        let pidfd = Arc::new(pidfd);
        let exit = watch_foreign_exit(&pidfd).map_err(|source| AdoptError::Io {
            id: id.to_string(),
            what: "watch the agent's pidfd".into(),
            source,
        })?;
        tracing::info!(sandbox = %id, pid, fd = pidfd.as_raw_fd(), paused = frozen, "container re-adopted");
        Ok(ContainerSandbox {
            id: id.to_string(),
            process: Process { pid, pidfd, exit },
            client,
            cgroup,
            dirs: SandboxDirs::new(dir),
            mnt_ns: std::sync::Mutex::new(super::mntns::MountNsHold::open(pid, id)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_lines() {
        let id = "sb-n0-0000000000000001";
        assert!(cgroup_names(
            "4:memory:/dsec/n0/sb-n0-0000000000000001\n",
            id
        ));
        assert!(cgroup_names(
            "0::/dsec/n0/sb-n0-0000000000000001/agent\n",
            id
        ));
        assert!(!cgroup_names(
            "4:memory:/dsec/n0/sb-n0-0000000000000002\n",
            id
        ));
        assert!(!cgroup_names("0::/\n", id));
    }

    #[test]
    fn listener_replaces_stale_socket() {
        let d = tempfile::tempdir().unwrap();
        let a = bind_listener(d.path()).unwrap();
        drop(a);
        let b = bind_listener(d.path()).unwrap();
        assert!(socket_path(d.path()).exists());
        drop(b);
    }

    #[tokio::test]
    async fn foreign_exit_is_noticed() {
        let mut child = std::process::Command::new("/bin/sleep")
            .arg("0.1")
            .spawn()
            .unwrap();
        let fd = Arc::new(pidfd_open(child.id() as i32).unwrap());
        let mut rx = watch_foreign_exit(&fd).unwrap();
        let _ = child.wait();
        let got = tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|e| e.is_some()))
            .await
            .expect("exit noticed")
            .map(|v| *v)
            .unwrap();
        assert!(got.is_some());
    }
}
