//! Running commands: shell and exec requests, their results and streamed events, the terminal.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::ErrorDetail;

/// Body of `POST /v1/sandboxes/{id}/shell`: run `cmd` in a persistent shell session.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RunShellRequest {
    pub cmd: String,
    /// Session name; sessions are created on first use.
    #[serde(default = "default_session")]
    pub session: String,
    /// Seconds; default 60. On timeout the command's processes are killed, the session survives.
    #[serde(default)]
    pub timeout: Option<f64>,
    /// Variables set for this command only.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Directory to run in (the session's cwd changes only if the command itself cds).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Text given on the command's standard input (default: empty).
    #[serde(default)]
    pub stdin: Option<String>,
    /// Bytes kept per stream (default 1 MiB, max 64 MiB); the rest is dropped and flagged.
    #[serde(default)]
    pub max_output_bytes: Option<u64>,
    /// Stream output as NDJSON [`StreamEvent`]s instead of one [`CommandResult`].
    #[serde(default)]
    pub stream: bool,
    /// Client step id (trajectory issue).
    #[serde(default)]
    pub step: Option<u64>,
}

pub fn default_session() -> String {
    "default".to_string()
}

/// Body of `POST /v1/sandboxes/{id}/exec`: run an argv directly, no shell.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExecRequest {
    pub argv: Vec<String>,
    #[serde(default)]
    pub timeout: Option<f64>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub stdin: Option<String>,
    /// Standard input as base64, for binary input (wins over `stdin`).
    #[serde(default)]
    pub stdin_b64: Option<String>,
    /// Run as this user instead of the sandbox's `init_user`.
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub max_output_bytes: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub step: Option<u64>,
}

/// Result of a shell command or exec.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CommandResult {
    /// Exit code; `-1` when killed by a signal (see `signal`).
    pub exit_code: i32,
    /// Signal that killed the command, if any.
    #[serde(default)]
    pub signal: Option<i32>,
    /// Standard output, decoded as UTF-8 with invalid sequences replaced.
    pub stdout: String,
    pub stderr: String,
    /// Exact bytes as base64, present only when the output was not valid UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdout_b64: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stderr_b64: Option<String>,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    /// Total bytes the command wrote, including dropped ones.
    #[serde(default)]
    pub stdout_total_bytes: u64,
    #[serde(default)]
    pub stderr_total_bytes: u64,
    pub timed_out: bool,
    /// The command (or one of its processes) was killed by the sandbox's memory limit.
    #[serde(default)]
    pub oom_killed: bool,
    pub duration_ms: f64,
    /// The session's shell had to be restarted (e.g. a builtin loop that ignored the timeout).
    #[serde(default)]
    pub session_restarted: bool,
}

/// One line of a streamed command.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    /// A chunk of output; `data` is UTF-8 (lossy) and `data_b64` carries exact bytes when not UTF-8.
    Stdout {
        data: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
    },
    Stderr {
        data: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        data_b64: Option<String>,
    },
    /// The final result (stdout/stderr in it are empty when streamed).
    Exit { result: CommandResult },
    /// The call failed; no `Exit` follows.
    Error { error: ErrorDetail },
}

/// Text frames on the TTY WebSocket.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TtyControl {
    Resize {
        rows: u16,
        cols: u16,
    },
    /// Sent by the server when the shell exits; the socket closes after it.
    Exit {
        code: i32,
    },
}
