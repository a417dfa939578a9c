//! Sandbox substrates.
//!
//! * [`substrate`] — the one substrate interface ([`substrate::Substrate`], [`substrate::LiveSandbox`],
//!   [`substrate::Capabilities`]); each substrate implements it in its folder's `substrate.rs`.
//! * [`aether_client`] — the edge's end of the aether protocol (multiplexed calls over a stream).
//! * [`container`] — our own container runtime: clone into namespaces, cgroups, handing the
//!   channel to aether (which builds the root inside the new mount namespace).
//! * [`cgroup`] — cgroup v1 and v2 drivers, one file per version.
//! * [`microvm`] — QEMU guests with their own kernel, aether over virtio-serial.
//! * [`fullvm`] — QEMU PCs booting a whole disk image through the firmware (or direct kernel).

pub mod aether_client;
pub mod cgroup;
pub mod container;
pub mod fullvm;
pub mod microvm;
pub mod substrate;
