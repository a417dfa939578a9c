//! A small pool of fresh, empty network namespaces for containers without networking.
//!
//! Creating a network namespace (`setup_net`: loopback device, per-namespace sysctl tables,
//! protocol state) costs ≈ 0.5 ms of kernel time, on the create path when the container's clone
//! asks for `CLONE_NEWNET`. A background thread keeps up to [`POOL_SIZE`] namespaces ready
//! instead (each one `unshare(CLONE_NEWNET)` on that thread, kept as an fd of
//! `/proc/thread-self/ns/net`), and the clone joins one with `setns`. A pooled namespace is
//! exactly what the clone would have made: new, never entered by anything, loopback down. The
//! pool holds only fds (no bind mount under `/run/netns`), so it cannot outlive the process; the
//! thread ends when the pool is dropped. When the pool is empty the clone makes its own as before.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, Weak};

/// How many namespaces are kept ready.
pub const POOL_SIZE: usize = 8;

#[derive(Debug, Default)]
struct State {
    ready: Vec<OwnedFd>,
    /// The refill thread gave up (the kernel refused a namespace): takes return `None`.
    failed: bool,
}

/// The pool (shared by clones of a substrate).
#[derive(Debug)]
pub struct NetnsPool {
    state: Mutex<State>,
    /// Signalled when a namespace is taken (the refill thread waits on it).
    taken: Condvar,
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl NetnsPool {
    /// Starts the pool and its refill thread.
    pub fn start() -> Arc<NetnsPool> {
        let pool = Arc::new(NetnsPool {
            state: Mutex::new(State::default()),
            taken: Condvar::new(),
        });
        let weak = Arc::downgrade(&pool);
        let spawned = std::thread::Builder::new()
            .name("netns-pool".into())
            .spawn(move || refill(weak));
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "start the network namespace pool");
            lock(&pool.state).failed = true;
        }
        pool
    }

    /// A ready namespace, if one is.
    pub fn take(&self) -> Option<OwnedFd> {
        let fd = lock(&self.state).ready.pop();
        self.taken.notify_one();
        fd
    }

    /// How many namespaces are ready.
    pub fn ready(&self) -> usize {
        lock(&self.state).ready.len()
    }
}

impl Drop for NetnsPool {
    fn drop(&mut self) {
        self.taken.notify_all();
    }
}

/// Makes one namespace on the calling thread and returns to `home`.
fn make_one(home: &OwnedFd) -> io::Result<OwnedFd> {
    // SAFETY: unshare(CLONE_NEWNET) changes only this thread's network namespace.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let path = c"/proc/thread-self/ns/net";
    // SAFETY: open(2) of a NUL-terminated literal; the fd is ours on success.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    let opened = if fd < 0 {
        Err(io::Error::last_os_error())
    } else {
        // SAFETY: a fresh fd owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    };
    // SAFETY: setns with an fd of the thread's original network namespace.
    if unsafe { libc::setns(home.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        // This thread must not keep making namespaces from inside one of them.
        return Err(io::Error::last_os_error());
    }
    opened
}

fn refill(weak: Weak<NetnsPool>) {
    let home = {
        let path = c"/proc/thread-self/ns/net";
        // SAFETY: open(2) of a NUL-terminated literal.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if fd < 0 {
            if let Some(p) = weak.upgrade() {
                lock(&p.state).failed = true;
            }
            return;
        }
        // SAFETY: a fresh fd owned by nobody else.
        unsafe { OwnedFd::from_raw_fd(fd) }
    };
    loop {
        let Some(pool) = weak.upgrade() else { return };
        let missing = POOL_SIZE.saturating_sub(lock(&pool.state).ready.len());
        if missing == 0 {
            // Wait for a take (or the pool's drop); re-check at least every second.
            let st = lock(&pool.state);
            let _ = pool
                .taken
                .wait_timeout(st, std::time::Duration::from_secs(1));
            continue;
        }
        drop(pool);
        match make_one(&home) {
            Ok(fd) => match weak.upgrade() {
                Some(pool) => lock(&pool.state).ready.push(fd),
                None => return,
            },
            Err(e) => {
                tracing::warn!(error = %e, "network namespace pool: creating a namespace failed; containers make their own");
                if let Some(p) = weak.upgrade() {
                    lock(&p.state).failed = true;
                }
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns_id(fd: &OwnedFd) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .unwrap()
            .ino()
    }

    #[test]
    fn fills_hands_out_distinct_namespaces_and_stops() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            println!("skipped: needs root");
            return;
        }
        let pool = NetnsPool::start();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while pool.ready() < POOL_SIZE && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(pool.ready(), POOL_SIZE);
        let host = std::fs::metadata("/proc/self/ns/net").unwrap();
        let a = pool.take().unwrap();
        let b = pool.take().unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_ne!(ns_id(&a), ns_id(&b));
        assert_ne!(ns_id(&a), host.ino());
        // The refill thread went back home: this process is still in the host namespace.
        assert_eq!(
            std::fs::metadata("/proc/self/ns/net").unwrap().ino(),
            host.ino()
        );
        drop(pool);
    }
}
