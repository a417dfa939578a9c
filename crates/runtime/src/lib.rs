//! Sandbox substrates.
//!
//! * [`substrate`] — the one substrate interface ([`substrate::Substrate`], [`substrate::LiveSandbox`],
//!   [`substrate::Capabilities`]); each substrate implements it in its folder's `substrate.rs`.
//! * [`aether_client`] — the edge's end of the aether protocol (multiplexed calls over a stream).
//! * [`container`] — our own container runtime: clone into namespaces, cgroups, handing the
//!   channel to aether (which builds the root inside the new mount namespace).
//! * [`qemu`] — QEMU, shared by both VM substrates: process, snapshot (pause/resume), QMP,
//!   command-line parts, the channel relay, VM networking.
//! * [`cgroup`] — cgroup v1 and v2 drivers, one file per version; every cgroup file the
//!   project touches (limits, freezer, memory figures and reclaim, CPU weight) goes through it.
//! * [`qos`] — a QoS class applied to a sandbox's processes (SCHED_IDLE, core-scheduling
//!   cookie) and cgroup (CPU weight).
//! * [`microvm`] — QEMU guests with their own kernel, aether over virtio-serial.
//! * [`fullvm`] — QEMU PCs booting a whole disk image through the firmware (or direct kernel).
//! * [`error`] — the errors of pause/resume and adopt, shared by every substrate.
//!
//! Owns every way of running a sandbox's processes and the cgroup work for them. It must not
//! know about the HTTP API, records or admission (that is the edge), and every substrate must
//! be reachable through the one object-safe trait pair in [`substrate`], never by name.

pub mod aether_client;
pub mod cgroup;
pub mod container;
pub mod error;
pub mod fullvm;
pub mod microvm;
pub mod qemu;
pub mod qos;
pub mod substrate;
