//! Wire types shared by every dsec component.
//!
//! Owns the serialised shapes and stable error codes, nothing else: it must not do I/O, hold
//! behaviour beyond (de)serialisation and small parsers, or depend on any other dsec crate.
//!
//! * [`api`] — the HTTP/JSON API (the apiserver's public API; the edge serves the same
//!   sandbox routes under `/edge/v1`).
//! * [`aether`] — the framed protocol between an edge and the aether agent inside a sandbox.
//!   It runs over any byte stream: an inherited unix socket for containers, virtio-serial or
//!   vsock for VMs.
//! * [`admin`] — the apiserver's admin routes: projects, quotas, keys, the cluster view.
//! * [`id`] — sandbox ids, which encode the node that owns the sandbox.

pub mod admin;
pub mod aether;
pub mod api;
pub mod id;
