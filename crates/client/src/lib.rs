//! Rust client for the dsec HTTP API.
