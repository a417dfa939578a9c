//! Process handles: long-running processes that outlive the HTTP call that started them
//! (`/v1/sandboxes/{id}/processes...`).
//!
//! A process's stdout and stderr are kept by the sandbox's agent in one bounded ring buffer,
//! addressed by byte offset in the process's combined output (stdout and stderr interleaved in
//! the order they arrived). A client that lost its connection resumes with `offset=` the end of
//! what it had read; output that already fell out of the ring is reported as a
//! [`ProcessEvent::Truncated`] gap instead of being silently skipped.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::ErrorDetail;

/// Default bytes of output kept per process.
pub const DEFAULT_PROCESS_BUFFER: u64 = 1024 * 1024;
/// Largest per-process buffer a caller may ask for.
pub const MAX_PROCESS_BUFFER: u64 = 64 * 1024 * 1024;

/// Body of `POST /v1/sandboxes/{id}/processes`.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct StartProcessRequest {
    /// A shell command, run as `/bin/sh -c CMD` (give `argv` instead for no shell).
    #[serde(default)]
    pub cmd: Option<String>,
    /// The argv to run directly (wins over `cmd`).
    #[serde(default)]
    pub argv: Option<Vec<String>>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Run as this user (name or uid of the image's /etc/passwd) instead of `init_user`.
    #[serde(default)]
    pub user: Option<String>,
    /// A name to find the process by later (listed, and accepted by `connect`).
    #[serde(default)]
    pub tag: Option<String>,
    /// Keep stdin open for `send_stdin` (else the process reads EOF at once).
    #[serde(default)]
    pub stdin: bool,
    /// Bytes of output kept for late readers (default 1 MiB, at most 64 MiB).
    #[serde(default)]
    pub buffer_bytes: Option<u64>,
}

/// A process handle's state.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessInfo {
    /// The pid inside the sandbox (the leader of its own process group and session).
    pub pid: i32,
    #[serde(default)]
    pub tag: Option<String>,
    pub argv: Vec<String>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// Start time, milliseconds since the Unix epoch.
    pub started_ms: u64,
    pub running: bool,
    /// Exit code once exited (-1 when ended by a signal).
    #[serde(default)]
    pub exit_code: Option<i32>,
    #[serde(default)]
    pub signal: Option<i32>,
    /// Whether stdin still accepts input.
    pub stdin_open: bool,
    /// Bytes of output produced so far (the offset the next output byte will have).
    pub output_bytes: u64,
    /// The first offset still kept; output before it was dropped from the ring buffer.
    pub kept_from: u64,
}

/// `GET /v1/sandboxes/{id}/processes`.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessList {
    pub processes: Vec<ProcessInfo>,
}

/// Body of `POST /v1/sandboxes/{id}/processes/{pid}/signal`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SignalProcessRequest {
    /// A signal name or number (`SIGTERM`, `TERM`, `15`).
    pub signal: String,
    /// Signal the whole process group (default true), not just the leader.
    #[serde(default = "yes")]
    pub group: bool,
}

fn yes() -> bool {
    true
}

/// Body of `POST /v1/sandboxes/{id}/processes/{pid}/stdin`.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ProcessInputRequest {
    #[serde(default)]
    pub data: Option<String>,
    /// Exact bytes as base64 (wins over `data`).
    #[serde(default)]
    pub data_b64: Option<String>,
    /// Close stdin after writing.
    #[serde(default)]
    pub close: bool,
}

/// One NDJSON line of `GET /v1/sandboxes/{id}/processes/{pid}/output`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ProcessEvent {
    /// Output starting at combined offset `offset`; `data` is UTF-8 (lossy), `data_b64` carries
    /// the exact bytes when they are not UTF-8.
    Stdout {
        offset: u64,
        data: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
    },
    Stderr {
        offset: u64,
        data: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
    },
    /// Output in `[from, to)` was dropped from the ring buffer before it was read.
    Truncated { from: u64, to: u64 },
    /// The end of the stream: the process exited (`info.running` false), or it is still
    /// running and the request did not `follow`. `offset` is where to resume.
    End { offset: u64, info: ProcessInfo },
    /// The read failed; nothing follows.
    Error { error: ErrorDetail },
}
