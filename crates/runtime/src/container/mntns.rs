//! The runtime holds each container's mount namespace from outside (an nsfs fd of
//! `/proc/<aether>/ns/mnt`), so that the namespace's teardown leaves the stop path.
//!
//! Without the hold, the last process of the sandbox to exit (aether, or a command it started)
//! tears the namespace down inside its own exit: `umount_tree` of every mount, an expedited RCU
//! grace period in `namespace_unlock`, then the shutdown of each superblock (overlay, /proc,
//! /sys, the /dev tmpfs, devpts, shm, mqueue, the mask tmpfs's). aether is reaped only after
//! that, so the stop waited for it: `kill_ms` 5–7 ms p50 on a loaded 2-core machine, 0.5 ms
//! with the namespace held (same run, interleaved).
//!
//! With the hold, the stop still answers only once every process of the sandbox is dead (the
//! pid namespace's init is reaped after all of them), and no process can enter the namespace
//! (nothing is left in it and only the runtime has the fd). The fd is then closed on a blocking
//! thread: that thread does the teardown. Anything that reuses what the mounts pinned (the
//! sandbox's upper and work dirs) waits for it with [`wait_released`]. An edge that crashes
//! holding fds has them closed by the kernel at its exit, which tears the namespaces down the
//! same way: nothing is left behind either way.

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Ids whose namespace is being released.
static RELEASING: Mutex<Option<HashSet<String>>> = Mutex::new(None);
static RELEASED: Condvar = Condvar::new();

fn releasing() -> MutexGuard<'static, Option<HashSet<String>>> {
    RELEASING.lock().unwrap_or_else(|p| p.into_inner())
}

/// A container's mount namespace, held open.
#[derive(Debug)]
pub struct MountNsHold {
    id: String,
    fd: OwnedFd,
}

impl MountNsHold {
    /// Opens the mount namespace of `pid` (aether, right after its clone made the namespace).
    /// `None` (logged) when it cannot be opened: the sandbox then works as before, its
    /// namespace torn down by its last process.
    pub fn open(pid: i32, id: &str) -> Option<MountNsHold> {
        match std::fs::File::open(format!("/proc/{pid}/ns/mnt")) {
            Ok(f) => Some(MountNsHold {
                id: id.to_string(),
                fd: f.into(),
            }),
            Err(e) => {
                tracing::warn!(sandbox = %id, pid, error = %e, "hold the sandbox's mount namespace");
                None
            }
        }
    }

    /// Closes the fd on a blocking thread (inline without a tokio runtime); the namespace's
    /// mounts go away there. Call it once every process of the sandbox is dead.
    pub fn release_in_background(self) {
        releasing()
            .get_or_insert_with(HashSet::new)
            .insert(self.id.clone());
        let job = move || {
            let MountNsHold { id, fd } = self;
            drop(fd);
            if let Some(set) = releasing().as_mut() {
                set.remove(&id);
            }
            RELEASED.notify_all();
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn_blocking(job);
            }
            Err(_) => job(),
        }
    }
}

/// Blocks until the mount namespace of sandbox `id` is released (true), or `limit` passed
/// (false). True at once when it is not being released.
pub fn wait_released(id: &str, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    let mut g = releasing();
    loop {
        if !g.as_ref().is_some_and(|s| s.contains(id)) {
            return true;
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        g = RELEASED
            .wait_timeout(g, deadline - now)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn release_and_wait() {
        // Our own mount namespace stands in for a sandbox's: holding and closing an fd to it
        // changes nothing for us.
        let h = MountNsHold::open(std::process::id() as i32, "sb-t0-0000000000000001")
            .expect("open own mount namespace");
        assert!(wait_released("sb-t0-0000000000000001", Duration::ZERO));
        h.release_in_background();
        assert!(wait_released(
            "sb-t0-0000000000000001",
            Duration::from_secs(5)
        ));
        assert!(MountNsHold::open(-1, "sb-t0-0000000000000002").is_none());
    }
}
