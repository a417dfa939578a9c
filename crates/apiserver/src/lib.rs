//! The apiserver: the public HTTP API.
