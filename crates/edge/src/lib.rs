//! The edge: one per node. Admission, sandbox lifecycle, layers and the edge HTTP API.
