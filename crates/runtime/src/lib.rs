//! Sandbox substrates.
//!
//! * [`substrate`] — the [`substrate::Substrate`] trait every kind of sandbox implements.
//! * [`aether_client`] — the edge's end of the aether protocol (multiplexed calls over a stream).
//! * [`container`] — our own container runtime: clone into namespaces, cgroups, handing the
//!   channel to aether (which builds the root inside the new mount namespace).
//! * [`cgroup`] — cgroup v1 and v2 drivers, one file per version; every cgroup file the
//!   project touches (limits, freezer, memory figures and reclaim, CPU weight) goes through it.
//! * [`qos`] — a QoS class applied to a sandbox's processes (SCHED_IDLE, core-scheduling
//!   cookie) and cgroup (CPU weight).
//! * [`microvm`] — QEMU guests with their own kernel, aether over virtio-serial.
//! * [`fullvm`] — QEMU PCs booting a whole disk image through the firmware (or direct kernel).

pub mod aether_client;
pub mod cgroup;
pub mod container;
pub mod fullvm;
pub mod microvm;
pub mod qos;
pub mod substrate;
