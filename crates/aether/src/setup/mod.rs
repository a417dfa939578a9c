//! Turning aether's fresh namespaces into the sandbox (container substrate).
//!
//! `container::apply` runs once, as PID 1 in new mount/pid/net/ipc/uts/cgroup namespaces with
//! full privileges, before aether serves any request. On return the root is the sandbox's
//! overlay, /proc /sys /dev are mounted and masked, the hostname is set, and aether itself has
//! dropped to the sandbox's capability set with no_new_privs and seccomp (inherited by every
//! command), and is non-dumpable.

pub mod container;
