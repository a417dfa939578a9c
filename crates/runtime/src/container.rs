//! The container substrate: our own runtime on namespaces, cgroups and overlayfs.
//!
//! Creating a container (host side, this module):
//! 1. create the sandbox's cgroups and apply limits ([`crate::cgroup`]);
//! 2. make `upper/`, `work/`, `rootfs/` under the sandbox dir;
//! 3. `clone3` a child into new mount, pid, net, ipc, uts namespaces (with a pidfd); the child
//!    joins the cgroups, unshares its cgroup namespace, puts the channel socket on fd 3 and
//!    execs the static aether binary — nothing else runs between clone and exec;
//! 4. send `Setup` over the channel; aether (now PID 1) mounts the overlay, pivots, masks,
//!    drops privileges and answers `Ready`.

use std::path::PathBuf;

/// Configuration of the container substrate.
#[derive(Debug, Clone)]
pub struct ContainerConfig {
    /// Path of the static aether binary on the host.
    pub aether_path: PathBuf,
    /// cgroup path below each controller's root, e.g. `dsec/n0`.
    pub cgroup_parent: String,
    /// Size of the sandbox's /dev/shm in MiB.
    pub shm_mb: u64,
}
