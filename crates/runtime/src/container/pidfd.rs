//! Process file descriptors: signalling and reaping aether without pid-reuse races.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

/// How aether ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AetherExit {
    /// Exited with this status code.
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
}

/// `P_PIDFD` for `waitid(2)` (not in every libc version).
const P_PIDFD: libc::idtype_t = 3;

/// `pidfd_send_signal(2)`. `ESRCH` (already exited) is reported as success.
pub fn send_signal(pidfd: BorrowedFd<'_>, sig: i32) -> io::Result<()> {
    // SAFETY: a valid pidfd, a signal number, no siginfo, no flags.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ESRCH) {
        Ok(())
    } else {
        Err(e)
    }
}

/// `waitid(P_PIDFD, fd, WEXITED | flags)`. Returns `None` when `WNOHANG` is given and the
/// process is still running.
fn waitid(pidfd: BorrowedFd<'_>, flags: i32) -> io::Result<Option<AetherExit>> {
    loop {
        // SAFETY: siginfo_t is plain data, zero is a valid initial value.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid writes into `info`, which we own; the id is a pidfd we hold.
        let rc = unsafe {
            libc::waitid(
                P_PIDFD,
                pidfd.as_raw_fd() as libc::id_t,
                &mut info,
                libc::WEXITED | flags,
            )
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        // SAFETY: waitid filled `info` for a child state change (or left si_pid 0 with WNOHANG).
        let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
        if pid == 0 {
            return Ok(None);
        }
        return Ok(Some(if info.si_code == libc::CLD_EXITED {
            AetherExit::Code(status)
        } else {
            AetherExit::Signal(status)
        }));
    }
}

/// Blocks until the process exits and reaps it.
pub fn wait_blocking(pidfd: BorrowedFd<'_>) -> io::Result<AetherExit> {
    waitid(pidfd, 0)?.ok_or_else(|| io::Error::other("waitid returned no child"))
}

/// Watches a pidfd on the tokio reactor, reaps the process when it exits and publishes how
/// it ended. Returns the receiver; the watcher task ends after the exit.
pub fn watch_exit(pidfd: &Arc<OwnedFd>) -> io::Result<watch::Receiver<Option<AetherExit>>> {
    let (tx, rx) = watch::channel(None);
    let owned = pidfd.try_clone()?;
    // SAFETY: `owned` is a valid fd owned by the AsyncFd for its whole life; OwnedFd always
    // returns the same fd.
    let async_fd = unsafe { AsyncFd::register_with_interest(owned, tokio::io::Interest::READABLE) }
        .map_err(|e| io::Error::other(e.to_string()))?;
    tokio::spawn(async move {
        loop {
            let ready = async_fd.readable().await;
            match waitid(std::os::fd::AsFd::as_fd(async_fd.get_ref()), libc::WNOHANG) {
                Ok(Some(exit)) => {
                    let _ = tx.send(Some(exit));
                    return;
                }
                Ok(None) => {
                    if let Ok(mut guard) = ready {
                        guard.clear_ready();
                    }
                }
                Err(e) => {
                    // Already reaped elsewhere (ECHILD): we cannot know the status.
                    tracing::warn!(error = %e, "reap sandbox init");
                    let _ = tx.send(Some(AetherExit::Signal(0)));
                    return;
                }
            }
        }
    });
    Ok(rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{AsFd, FromRawFd};

    fn pidfd_open(pid: i32) -> OwnedFd {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        assert!(fd >= 0, "pidfd_open: {}", io::Error::last_os_error());
        // SAFETY: a fresh fd we own.
        unsafe { OwnedFd::from_raw_fd(fd as i32) }
    }

    #[tokio::test]
    #[allow(clippy::zombie_processes)] // reaped through the pidfd by the watcher, not by Child::wait
    async fn watches_exit_code_and_signal() {
        let child = std::process::Command::new("/bin/sh")
            .args(["-c", "exit 7"])
            .spawn()
            .unwrap();
        let fd = Arc::new(pidfd_open(child.id() as i32));
        let mut rx = watch_exit(&fd).unwrap();
        let exit = *rx.wait_for(|e| e.is_some()).await.unwrap();
        assert_eq!(exit, Some(AetherExit::Code(7)));

        let child = std::process::Command::new("/bin/sleep")
            .arg("100")
            .spawn()
            .unwrap();
        let fd = Arc::new(pidfd_open(child.id() as i32));
        let mut rx = watch_exit(&fd).unwrap();
        send_signal(fd.as_fd(), libc::SIGKILL).unwrap();
        let exit = *rx.wait_for(|e| e.is_some()).await.unwrap();
        assert_eq!(exit, Some(AetherExit::Signal(libc::SIGKILL)));
        // Signalling an exited (reaped) process is not an error.
        send_signal(fd.as_fd(), libc::SIGKILL).unwrap();
    }
}
