//! HTTP/JSON API types.
//!
//! Public routes (apiserver, `Authorization: Bearer <api key>`), all under `/v1`:
//!
//! | method | path | body | answer |
//! |---|---|---|---|
//! | POST | `/v1/sandboxes` | [`CreateSandboxRequest`] | 201 [`SandboxInfo`] |
//! | GET | `/v1/sandboxes` | | [`SandboxList`] |
//! | GET | `/v1/sandboxes/{id}` | | [`SandboxInfo`] |
//! | DELETE | `/v1/sandboxes/{id}` | | [`SandboxInfo`] (state `stopped`) |
//! | POST | `/v1/sandboxes/{id}/shell` | [`RunShellRequest`] | [`CommandResult`], or NDJSON [`StreamEvent`]s when `stream` |
//! | POST | `/v1/sandboxes/{id}/exec` | [`ExecRequest`] | [`CommandResult`], or NDJSON [`StreamEvent`]s when `stream` |
//! | DELETE | `/v1/sandboxes/{id}/sessions/{name}` | | 204 |
//! | PUT | `/v1/sandboxes/{id}/files?path=P&mode=0644` | raw bytes | [`FileInfo`] |
//! | GET | `/v1/sandboxes/{id}/files?path=P` | | raw bytes; headers `x-dsec-mode`, `content-length` |
//! | GET | `/v1/sandboxes/{id}/files/list?path=P` | | [`FileList`] |
//! | GET | `/v1/sandboxes/{id}/files/stat?path=P` | | [`FileInfo`] |
//! | DELETE | `/v1/sandboxes/{id}/files?path=P&recursive=B` | | 204 |
//! | POST | `/v1/sandboxes/{id}/files/mkdir?path=P&mode=0755&parents=B` | | [`FileInfo`] |
//! | GET (WebSocket) | `/v1/sandboxes/{id}/tty?rows=R&cols=C&session=S` | binary frames = terminal bytes; text frames = [`TtyControl`] | |
//! | GET | `/v1/images` | | [`ImageList`] |
//! | PUT | `/v1/images/{name}` | a tar stream (`content-type: application/x-tar`, gzip accepted) | 201 [`ImageInfo`] |
//! | DELETE | `/v1/images/{name}` | | 204 |
//! | GET | `/v1/nodes` | | [`NodeList`] |
//! | GET | `/openapi.json`, `/healthz`, `/metrics` | | unauthenticated |
//!
//! The edge serves the same sandbox, image and node-status routes under `/edge/v1`
//! (authenticated with the node's edge token), plus `GET /edge/v1/status` ([`NodeStatus`]).
//! Every error is an [`ErrorBody`] with a 4xx (the caller must fix something) or 5xx status.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Which kind of isolation a sandbox gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Substrate {
    #[default]
    Container,
    Microvm,
    Vm,
    Function,
}

/// Body of `POST /v1/sandboxes`.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    /// Image name (`name` or `name:tag`). The SDK calls it `container_image`.
    #[serde(alias = "container_image")]
    pub image: String,
    #[serde(default)]
    pub substrate: Substrate,
    /// Memory limit in MiB (default: edge config, 1024).
    #[serde(default)]
    pub memory_limit_mb: Option<u64>,
    /// CPU limit in cores, fractional allowed (default: edge config, 1.0).
    #[serde(default)]
    pub cpu_cores_limit: Option<f64>,
    /// Maximum number of processes/threads (default: edge config, 1024).
    #[serde(default)]
    pub pids_limit: Option<u64>,
    /// Seconds without a request before the sandbox is stopped (stored; enforced by the TTL reaper).
    #[serde(default)]
    pub ttl_running_stop: Option<u64>,
    /// Hard lifetime in seconds (stored; enforced by the TTL reaper).
    #[serde(default)]
    pub ttl_total: Option<u64>,
    /// Named domain groups to allow or deny (stored; enforced by the network policy).
    #[serde(default)]
    pub network_rules: BTreeMap<String, bool>,
    /// User the sandbox's commands run as: `root` or a user of the image (name or uid).
    #[serde(default)]
    pub init_user: Option<String>,
    /// Hostname inside the sandbox (default: the short sandbox id).
    #[serde(default)]
    pub hostname: Option<String>,
    /// Environment given to every command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Free-form labels (job, rollout, ...).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Optional workspace layer (images issue).
    #[serde(default)]
    pub workspace: Option<String>,
    /// Optional toolkit layers (images issue).
    #[serde(default)]
    pub toolkits: Vec<String>,
    /// Idempotency key: a retried create with the same key returns the same sandbox.
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    Creating,
    Running,
    Paused,
    Stopping,
    Stopped,
    Failed,
}

/// What the platform knows about one sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxInfo {
    pub id: String,
    pub node: String,
    pub state: SandboxState,
    pub substrate: Substrate,
    pub image: String,
    pub memory_limit_mb: u64,
    pub cpu_cores_limit: f64,
    pub pids_limit: u64,
    pub init_user: String,
    pub hostname: String,
    #[serde(default)]
    pub ttl_running_stop: Option<u64>,
    #[serde(default)]
    pub ttl_total: Option<u64>,
    #[serde(default)]
    pub network_rules: BTreeMap<String, bool>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// Milliseconds from request arrival at the edge to aether reporting ready.
    #[serde(default)]
    pub create_ms: Option<f64>,
    /// Why the sandbox stopped or failed, when it did.
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxList {
    pub sandboxes: Vec<SandboxInfo>,
}

/// Body of `POST /v1/sandboxes/{id}/shell`: run `cmd` in a persistent shell session.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
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
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    /// A chunk of output; `data` is UTF-8 (lossy) and `data_b64` carries exact bytes when not UTF-8.
    Stdout { data: String, #[serde(default, skip_serializing_if = "Option::is_none")] data_b64: Option<String> },
    Stderr { data: String, #[serde(default, skip_serializing_if = "Option::is_none")] data_b64: Option<String> },
    /// The final result (stdout/stderr in it are empty when streamed).
    Exit { result: CommandResult },
    /// The call failed; no `Exit` follows.
    Error { error: ErrorDetail },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FileInfo {
    pub path: String,
    pub name: String,
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits, e.g. 0o644 (serialized as a number).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Seconds since the epoch.
    pub mtime: i64,
    #[serde(default)]
    pub link_target: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileList {
    pub path: String,
    pub entries: Vec<FileInfo>,
}

/// Text frames on the TTY WebSocket.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TtyControl {
    Resize { rows: u16, cols: u16 },
    /// Sent by the server when the shell exits; the socket closes after it.
    Exit { code: i32 },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageLayerInfo {
    pub digest: String,
    pub size_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageInfo {
    /// `name:tag`.
    pub name: String,
    pub layers: Vec<ImageLayerInfo>,
    pub size_bytes: u64,
    pub created_at: String,
    /// Sandboxes on this node currently using the image.
    #[serde(default)]
    pub in_use: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImageList {
    pub images: Vec<ImageInfo>,
}

/// An edge's view of itself (`GET /edge/v1/status`), polled by the watcher.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct NodeStatus {
    pub node: String,
    pub url: String,
    pub healthy: bool,
    pub substrates: Vec<Substrate>,
    pub sandboxes_running: u64,
    pub sandboxes_paused: u64,
    pub capacity_sandboxes: u64,
    pub cpu_cores_total: f64,
    pub cpu_cores_allocated: f64,
    pub memory_mb_total: u64,
    pub memory_mb_allocated: u64,
    pub memory_mb_available: u64,
    pub images: Vec<String>,
    pub cgroup_version: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeList {
    pub nodes: Vec<NodeStatus>,
}

/// Every error answer: `{"error": {"code": "...", "message": "..."}}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorDetail {
    /// Stable machine-readable code, one of [`codes`].
    pub code: String,
    /// What was wrong and what to do about it.
    pub message: String,
}

/// Stable error codes and the HTTP status each maps to.
pub mod codes {
    pub const BAD_REQUEST: &str = "bad_request"; // 400
    pub const UNAUTHORIZED: &str = "unauthorized"; // 401
    pub const FORBIDDEN: &str = "forbidden"; // 403
    pub const SANDBOX_NOT_FOUND: &str = "sandbox_not_found"; // 404
    pub const IMAGE_NOT_FOUND: &str = "image_not_found"; // 404
    pub const FILE_NOT_FOUND: &str = "file_not_found"; // 404
    pub const NOT_FOUND: &str = "not_found"; // 404
    pub const CONFLICT: &str = "conflict"; // 409 (image in use, sandbox not running, ...)
    pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large"; // 413
    pub const QUOTA_EXCEEDED: &str = "quota_exceeded"; // 429
    pub const NODE_FULL: &str = "node_full"; // 503
    pub const NODE_UNAVAILABLE: &str = "node_unavailable"; // 503
    pub const SANDBOX_DEAD: &str = "sandbox_dead"; // 410
    pub const UNSUPPORTED: &str = "unsupported"; // 501
    pub const INTERNAL: &str = "internal"; // 500
}

/// Maps an error code to its HTTP status.
pub fn status_for_code(code: &str) -> u16 {
    match code {
        codes::BAD_REQUEST => 400,
        codes::UNAUTHORIZED => 401,
        codes::FORBIDDEN => 403,
        codes::SANDBOX_NOT_FOUND | codes::IMAGE_NOT_FOUND | codes::FILE_NOT_FOUND | codes::NOT_FOUND => 404,
        codes::CONFLICT => 409,
        codes::SANDBOX_DEAD => 410,
        codes::PAYLOAD_TOO_LARGE => 413,
        codes::QUOTA_EXCEEDED => 429,
        codes::UNSUPPORTED => 501,
        codes::NODE_FULL | codes::NODE_UNAVAILABLE => 503,
        _ => 500,
    }
}

/// Request size limits enforced by every server.
pub mod limits {
    /// Largest JSON request body (a 1 MB command string is rejected with 413).
    pub const MAX_JSON_BODY: usize = 512 * 1024;
    /// Largest `cmd` of a shell request.
    pub const MAX_CMD_BYTES: usize = 256 * 1024;
    /// Default and maximum bytes kept per output stream.
    pub const DEFAULT_MAX_OUTPUT: u64 = 1024 * 1024;
    pub const MAX_MAX_OUTPUT: u64 = 64 * 1024 * 1024;
    /// Default command timeout in seconds.
    pub const DEFAULT_TIMEOUT_S: f64 = 60.0;
}
