//! Turning aether's fresh namespaces into the sandbox (container substrate).
//!
//! `container::apply` runs once, as PID 1 in new mount/pid/net/ipc/uts/cgroup namespaces with
//! full privileges, before aether serves any request. On return the root is the sandbox's
//! overlay, /proc /sys /dev are mounted and masked, the hostname is set, and aether itself has
//! dropped to the sandbox's capability set with no_new_privs and seccomp (inherited by every
//! command), and is non-dumpable.
//!
//! * [`mounts`] — overlay root, /proc, /sys, /dev, pivot_root, masks, read-only paths;
//! * [`caps`] — capability bounding/effective sets, no_new_privs, dumpable;
//! * [`seccomp`] — the syscall allowlist;
//! * [`binds`] — volumes bound into the root before the pivot;
//! * [`sys`] — the privileged calls behind a trait (a recording fake tests the mount order).

pub mod binds;
pub mod caps;
pub mod container;
pub mod landlock;
pub mod mounts;
pub mod seccomp;
pub mod sys;
