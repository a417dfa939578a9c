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
//! | POST | `/v1/sandboxes/{id}/pause` | | [`SandboxInfo`] (state `paused`, `last_pause` memory report) |
//! | POST | `/v1/sandboxes/{id}/resume` | | [`SandboxInfo`] (state `running`) |
//! | POST | `/v1/jobs/pause`, `/v1/jobs/resume`, `/v1/jobs/stop` | [`LabelSelector`] | [`JobOpResult`] (every matching sandbox on every node) |
//! | POST | `/v1/sandboxes/{id}/shell` | [`RunShellRequest`] | [`CommandResult`], or NDJSON [`StreamEvent`]s when `stream` |
//! | POST | `/v1/sandboxes/{id}/exec` | [`ExecRequest`] | [`CommandResult`], or NDJSON [`StreamEvent`]s when `stream` |
//! | DELETE | `/v1/sandboxes/{id}/sessions/{name}` | | 204 |
//! | PUT | `/v1/sandboxes/{id}/files?path=P&mode=0644` | raw bytes | [`FileInfo`] |
//! | GET | `/v1/sandboxes/{id}/files?path=P` | | raw bytes; headers `x-dsec-mode`, `content-length` |
//! | GET | `/v1/sandboxes/{id}/files/list?path=P` | | [`FileList`] |
//! | GET | `/v1/sandboxes/{id}/files/stat?path=P` | | [`FileInfo`] |
//! | DELETE | `/v1/sandboxes/{id}/files?path=P&recursive=B` | | 204 |
//! | POST | `/v1/sandboxes/{id}/files/mkdir?path=P&mode=0755&parents=B` | | [`FileInfo`] |
//! | GET | `/v1/sandboxes/{id}/trajectory?from=&to=&kind=&since=&until=&path=` | | JSONL of [`TrajectoryRecord`] |
//! | GET | `/v1/sandboxes/{id}/trajectory/last_step` | | [`LastStep`] |
//! | GET | `/v1/sandboxes/{id}/network` | | [`NetworkStatus`] (mode, rules, addresses, denied counters) |
//! | PUT | `/v1/sandboxes/{id}/network` | [`NetworkSpec`] | [`NetworkStatus`]; effective for new connections at once |
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    /// What `ttl_running_stop` does when it fires: `stop` (default) or `pause`.
    #[serde(default)]
    pub ttl_action: Option<TtlAction>,
    /// Named domain groups to allow or deny (stored; enforced by the network policy).
    #[serde(default)]
    pub network_rules: BTreeMap<String, bool>,
    /// Network mode and IP/CIDR/port/protocol rules (default: `none`, or `allowlist` when
    /// `network_rules` enables a group). See [`NetworkSpec`].
    #[serde(default)]
    pub network: Option<NetworkSpec>,
    /// Paths inside the sandbox that stay read-only even to root (Landlock), e.g. `/tests`.
    #[serde(default)]
    pub protected_paths: Vec<String>,
    /// Size limit of the sandbox's writable layer in MiB (ENOSPC past it; default: edge config).
    #[serde(default)]
    pub disk_limit_mb: Option<u64>,
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
    /// Keep a trajectory log for this sandbox (default: the edge's `trajectory.enabled`, on).
    /// `false` turns off logging and client fast-forward for it.
    #[serde(default)]
    pub trajectory: Option<bool>,
    /// Project charged for the sandbox (quotas); default: the caller's home project.
    /// Read by the apiserver only.
    #[serde(default)]
    pub project: Option<String>,
    /// May go to the overflow pool when the primary pool is above its utilisation threshold.
    /// Read by the apiserver only.
    #[serde(default)]
    pub overflow_eligible: Option<bool>,
    /// CPU/memory QoS class (default: the project's, else the edge's `qos.default_class`).
    #[serde(default)]
    pub qos: Option<QosClass>,
}

/// Quality-of-service class of a sandbox (DESIGN.md §7).
///
/// `latency_sensitive` sandboxes are protected: normal CPU weight, a core-scheduling cookie where
/// the kernel has one, never reclaimed or paused under node memory pressure. `best_effort`
/// sandboxes run with SCHED_IDLE and the lowest CPU weight, and are the first whose cold memory
/// is reclaimed and the first paused when the node runs short.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum QosClass {
    #[default]
    LatencySensitive,
    BestEffort,
}

/// What the idle TTL (`ttl_running_stop`) does when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum TtlAction {
    #[default]
    Stop,
    Pause,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    #[default]
    Creating,
    Running,
    Paused,
    Stopping,
    Stopped,
    Failed,
}

/// What the platform knows about one sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    /// What the idle TTL does when it fires.
    #[serde(default)]
    pub ttl_action: TtlAction,
    /// RFC 3339 UTC time of the last request that touched the sandbox (the idle clock).
    #[serde(default)]
    pub last_request_at: Option<String>,
    /// RFC 3339 UTC time the sandbox was paused, while it is paused.
    #[serde(default)]
    pub paused_at: Option<String>,
    /// Memory report of the most recent pause.
    #[serde(default)]
    pub last_pause: Option<PauseReport>,
    /// QoS class the sandbox runs in.
    #[serde(default)]
    pub qos: QosClass,
    /// How a VM sandbox started: `cold` (booted its kernel), `template` (restored from a
    /// template snapshot of its shape) or `cold-fallback` (its template failed to restore and
    /// was dropped); `None` for containers.
    #[serde(default)]
    pub boot: Option<String>,
}

/// What a pause did: memory before and after, and how it was reclaimed.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PauseReport {
    /// Memory charged to the sandbox before the pause (page cache + anonymous + kernel).
    pub memory_before_bytes: u64,
    pub memory_after_bytes: u64,
    pub page_cache_before_bytes: u64,
    pub page_cache_after_bytes: u64,
    pub anon_before_bytes: u64,
    pub anon_after_bytes: u64,
    /// How memory was given back, e.g. `memory.force_empty (v1, no swap: page cache only)`.
    pub method: String,
    /// Wall time of the whole pause (freeze + reclaim) in milliseconds.
    pub pause_ms: f64,
    /// Size of the memory + device snapshot written to disk (microVMs and full VMs); `None`
    /// for containers, whose memory stays in the (frozen) processes.
    #[serde(default)]
    pub snapshot_bytes: Option<u64>,
}

/// Body of `POST /v1/jobs/{pause,resume,stop}`: every sandbox whose labels include all of
/// these (an empty selector matches nothing).
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct LabelSelector {
    pub labels: BTreeMap<String, String>,
}

/// One sandbox a job operation could not act on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobOpFailure {
    pub id: String,
    pub error: ErrorDetail,
}

/// Answer of `POST /v1/jobs/{pause,resume,stop}`.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobOpResult {
    /// Sandboxes whose labels matched.
    pub matched: u64,
    /// Sandboxes the operation succeeded on (already in the wanted state counts).
    pub succeeded: u64,
    pub failed: Vec<JobOpFailure>,
    /// Ids of the matched sandboxes.
    #[serde(default)]
    pub sandboxes: Vec<String>,
    /// Nodes that did not answer (their sandboxes are not counted).
    #[serde(default)]
    pub unreachable_nodes: Vec<String>,
    pub duration_ms: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SandboxList {
    pub sandboxes: Vec<SandboxInfo>,
}

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

/// One entry of a sandbox's trajectory log (`GET /v1/sandboxes/{id}/trajectory`, one per line).
///
/// Calls that carry a client `step` are fast-forwarded: repeating a completed step answers its
/// recorded result (response header `x-dsec-replayed: true`) without running it again.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TrajectoryRecord {
    /// Position in the sandbox's log, from 1, without gaps.
    pub seq: u64,
    /// The client's step id, when the call carried one.
    #[serde(default)]
    pub step: Option<u64>,
    /// `create`, `shell`, `exec`, `write_file`, `read_file`, `list_files`, `stat`, `remove`,
    /// `mkdir`, `close_session`, `stop`, `died`, and state changes such as `pause`, `resume`,
    /// `network_rules`, `ttl`.
    pub kind: String,
    /// The request as the edge understood it (defaults applied).
    #[serde(default)]
    pub request: serde_json::Value,
    /// What makes two calls "the same" for fast-forward: a step repeated with another key is
    /// refused with `conflict`.
    #[serde(default)]
    pub key: serde_json::Value,
    /// Unix time in milliseconds.
    pub start_ms: f64,
    pub end_ms: f64,
    pub ok: bool,
    #[serde(default)]
    pub exit_code: Option<i32>,
    /// The answer (e.g. a [`CommandResult`], a [`FileInfo`]); outputs above the edge's inline
    /// limit are left empty here and kept by digest in `blobs`.
    #[serde(default)]
    pub result: serde_json::Value,
    #[serde(default)]
    pub error: Option<ErrorDetail>,
    /// Output kept out of line: field name (`stdout`, `stderr`, `content`) → sha256 hex.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub blobs: BTreeMap<String, String>,
    /// Files this call wrote (through the file API), with their content digests.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub files_written: Vec<FileDigest>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileDigest {
    pub path: String,
    pub sha256: String,
    pub size: u64,
}

/// `GET /v1/sandboxes/{id}/trajectory/last_step`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LastStep {
    pub sandbox: String,
    /// Highest step id whose call completed (`null` when none).
    #[serde(default)]
    pub last_completed_step: Option<u64>,
    /// Step ids still running.
    #[serde(default)]
    pub running_steps: Vec<u64>,
    /// Records in the log.
    pub records: u64,
    /// False when the sandbox was created with `trajectory: false`.
    pub enabled: bool,
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FileList {
    pub path: String,
    pub entries: Vec<FileInfo>,
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

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImageLayerInfo {
    pub digest: String,
    pub size_bytes: u64,
    /// Size of the layer's EROFS metadata image (kept on the node's local disk).
    #[serde(default)]
    pub meta_bytes: u64,
    /// Size of the layer's data blob (kept in the blob store, read on demand).
    #[serde(default)]
    pub blob_bytes: u64,
    /// Sandboxes on this node whose root uses this layer.
    #[serde(default)]
    pub users: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImageInfo {
    /// `name:tag`.
    pub name: String,
    pub layers: Vec<ImageLayerInfo>,
    pub size_bytes: u64,
    pub created_at: String,
    /// Sandboxes on this node currently using the image.
    #[serde(default)]
    pub in_use: u64,
    /// The image this one was derived from (`pack_diff`: parent layers + diff).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Where the image came from (`dir`, `tar`, `docker-archive`, `oci`, `registry REF`,
    /// `pack_diff SANDBOX`, `fold`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// Body of `POST /v1/sandboxes/{id}/pack_diff`: turn the sandbox's writable layer into a new
/// layer and register `name` = the sandbox's layers + that diff.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PackDiffRequest {
    /// Name of the new image (`name` or `name:tag`).
    pub name: String,
    /// Paths (absolute, inside the sandbox) left out of the diff, with everything below them.
    #[serde(default)]
    pub exclude: Vec<String>,
}

/// Body of `POST /v1/images/{name}`: an operation on the image store.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "action", rename_all = "snake_case", deny_unknown_fields)]
pub enum ImageActionRequest {
    /// Merge consecutive layers of the image smaller than `max_layer_bytes` into one layer.
    Fold {
        #[serde(default)]
        max_layer_bytes: Option<u64>,
        /// Register the folded image under this name instead of replacing `name`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        into: Option<String>,
    },
    /// Pull `reference` (`host[:port]/repo[:tag]`) from an OCI registry into the image `name`.
    Pull {
        reference: String,
        /// Use plain HTTP instead of HTTPS.
        #[serde(default)]
        insecure: bool,
        #[serde(default)]
        username: Option<String>,
        #[serde(default)]
        password: Option<String>,
        /// PEM CA certificate(s) to trust for the registry's TLS, besides the system's roots
        /// (the CLI's `--ca-file`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ca_pem: Option<String>,
    },
}

/// One line of the `application/x-ndjson` answer to `POST /v1/images/{name}` when the
/// request says `accept: application/x-ndjson` (progress of a pull); the last line is `done`
/// or `error`. Without that header the answer is a plain 201 [`ImageInfo`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ImageActionEvent {
    /// The manifest was resolved.
    Manifest {
        digest: String,
        layers: u64,
        bytes: u64,
    },
    /// Bytes of layer `layer` (1-based) downloaded so far.
    Download {
        layer: u64,
        digest: String,
        done: u64,
        total: u64,
    },
    /// Layer `layer` is being unpacked and built.
    Build {
        layer: u64,
    },
    Done {
        image: ImageInfo,
    },
    Error {
        error: ErrorDetail,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImageList {
    pub images: Vec<ImageInfo>,
}

/// An edge's view of itself (`GET /edge/v1/status`), polled by the watcher.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
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
    /// Kernel features for QoS and reclaim, detected at edge start (issue 10).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<NodeCapabilities>,
    /// Admission by measured usage (issue 10): what the node would still admit per class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<AdmissionStatus>,
}

/// One kernel feature: present or not, and what was seen (`EINVAL`, the file checked, ...).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Capability {
    pub available: bool,
    #[serde(default)]
    pub detail: String,
}

/// Kernel features the edge found at start.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default)]
pub struct NodeCapabilities {
    /// `v1` or `v2`.
    pub cgroup_version: String,
    /// `cpu.idle` on the cpu controller (SCHED_IDLE cgroups).
    pub cpu_idle: Capability,
    /// `prctl(PR_SCHED_CORE)` core-scheduling cookies.
    pub core_scheduling: Capability,
    /// The SCHED_IDLE scheduling policy for tasks.
    pub sched_idle: Capability,
    /// Simultaneous multithreading (sibling hardware threads).
    pub smt: Capability,
    /// Pressure stall information (`/proc/pressure`).
    pub psi: Capability,
    /// DAMON through sysfs.
    pub damon: Capability,
    /// zram compressed block devices.
    pub zram: Capability,
    /// Kernel same-page merging.
    pub ksm: Capability,
    /// cgroup `favordynmods` held on (cheap `cgroup.procs` moves: no RCU grace period per move).
    pub cgroup_favordynmods: Capability,
}

/// Admission figures of one node (memory in MiB, CPU in cores). `used` is the measured
/// working set / CPU use of the node's sandboxes plus reservations of those still starting;
/// `free_*` is the largest request of that class the node admits now.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(default)]
pub struct AdmissionStatus {
    pub memory_mb_used: u64,
    pub cpu_cores_used: f64,
    pub memory_mb_committed_ls: u64,
    pub cpu_cores_committed_ls: f64,
    pub memory_mb_committed_be: u64,
    pub cpu_cores_committed_be: f64,
    pub memory_mb_free_ls: u64,
    pub cpu_cores_free_ls: f64,
    pub memory_mb_free_be: u64,
    pub cpu_cores_free_be: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeList {
    pub nodes: Vec<NodeStatus>,
}

/// Every error answer: `{"error": {"code": "...", "message": "..."}}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorDetail {
    /// Stable machine-readable code, one of [`ErrorCode`] (kept a string on the wire so that a
    /// client reading a code it does not know yet still gets the message).
    #[cfg_attr(feature = "openapi", schema(value_type = ErrorCode))]
    pub code: String,
    /// What was wrong and what to do about it.
    pub message: String,
}

/// Every stable error code. 4xx codes mean the caller must fix something, 5xx the server side
/// (or the node) failed; [`ErrorCode::status`] gives the HTTP status of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 400: the request is malformed or a value is out of range.
    BadRequest,
    /// 401: no API key, or not a valid one.
    Unauthorized,
    /// 403: the key may not do this (e.g. admin routes).
    Forbidden,
    /// 404: no such sandbox.
    SandboxNotFound,
    /// 404: no such image.
    ImageNotFound,
    /// 404: no such file inside the sandbox.
    FileNotFound,
    /// 404: no such route or resource.
    NotFound,
    /// 409: the resource is in the wrong state (image in use, sandbox not running, step reused
    /// with another request, ...).
    Conflict,
    /// 413: the body is over the size limit.
    PayloadTooLarge,
    /// 429: a project quota (count, CPU, memory, creation rate) would be exceeded.
    QuotaExceeded,
    /// 503: no node has room for the sandbox; retry later.
    NodeFull,
    /// 503: the node owning the sandbox does not answer.
    NodeUnavailable,
    /// 503: the sandbox is at its process limit; retry.
    SandboxBusy,
    /// 410: the sandbox died (its reason is in the sandbox's `reason`).
    SandboxDead,
    /// 501: the substrate or node does not support this operation.
    Unsupported,
    /// 500: a server-side failure (logged with its cause).
    Internal,
}

impl ErrorCode {
    /// Every code, in the order of the enum.
    pub const ALL: [ErrorCode; 16] = [
        ErrorCode::BadRequest,
        ErrorCode::Unauthorized,
        ErrorCode::Forbidden,
        ErrorCode::SandboxNotFound,
        ErrorCode::ImageNotFound,
        ErrorCode::FileNotFound,
        ErrorCode::NotFound,
        ErrorCode::Conflict,
        ErrorCode::PayloadTooLarge,
        ErrorCode::QuotaExceeded,
        ErrorCode::NodeFull,
        ErrorCode::NodeUnavailable,
        ErrorCode::SandboxBusy,
        ErrorCode::SandboxDead,
        ErrorCode::Unsupported,
        ErrorCode::Internal,
    ];

    /// The code as it appears in [`ErrorDetail::code`].
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::SandboxNotFound => "sandbox_not_found",
            ErrorCode::ImageNotFound => "image_not_found",
            ErrorCode::FileNotFound => "file_not_found",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::QuotaExceeded => "quota_exceeded",
            ErrorCode::NodeFull => "node_full",
            ErrorCode::NodeUnavailable => "node_unavailable",
            ErrorCode::SandboxBusy => "sandbox_busy",
            ErrorCode::SandboxDead => "sandbox_dead",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::Internal => "internal",
        }
    }

    /// The HTTP status answered with this code.
    pub const fn status(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 400,
            ErrorCode::Unauthorized => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::SandboxNotFound
            | ErrorCode::ImageNotFound
            | ErrorCode::FileNotFound
            | ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::SandboxDead => 410,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::QuotaExceeded => 429,
            ErrorCode::Unsupported => 501,
            ErrorCode::NodeFull | ErrorCode::NodeUnavailable | ErrorCode::SandboxBusy => 503,
            ErrorCode::Internal => 500,
        }
    }

    /// The code named `code`, if it is one.
    pub fn parse(code: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|c| c.as_str() == code)
    }
}

/// Stable error codes as strings (the values of [`ErrorCode`]).
pub mod codes {
    use super::ErrorCode;

    pub const BAD_REQUEST: &str = ErrorCode::BadRequest.as_str();
    pub const UNAUTHORIZED: &str = ErrorCode::Unauthorized.as_str();
    pub const FORBIDDEN: &str = ErrorCode::Forbidden.as_str();
    pub const SANDBOX_NOT_FOUND: &str = ErrorCode::SandboxNotFound.as_str();
    pub const IMAGE_NOT_FOUND: &str = ErrorCode::ImageNotFound.as_str();
    pub const FILE_NOT_FOUND: &str = ErrorCode::FileNotFound.as_str();
    pub const NOT_FOUND: &str = ErrorCode::NotFound.as_str();
    pub const CONFLICT: &str = ErrorCode::Conflict.as_str();
    pub const PAYLOAD_TOO_LARGE: &str = ErrorCode::PayloadTooLarge.as_str();
    pub const QUOTA_EXCEEDED: &str = ErrorCode::QuotaExceeded.as_str();
    pub const NODE_FULL: &str = ErrorCode::NodeFull.as_str();
    pub const NODE_UNAVAILABLE: &str = ErrorCode::NodeUnavailable.as_str();
    pub const SANDBOX_BUSY: &str = ErrorCode::SandboxBusy.as_str();
    pub const SANDBOX_DEAD: &str = ErrorCode::SandboxDead.as_str();
    pub const UNSUPPORTED: &str = ErrorCode::Unsupported.as_str();
    pub const INTERNAL: &str = ErrorCode::Internal.as_str();
}

/// Maps an error code to its HTTP status (500 for a code this build does not know).
pub fn status_for_code(code: &str) -> u16 {
    ErrorCode::parse(code).map_or(500, ErrorCode::status)
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

/// Network mode of a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum NetworkMode {
    /// Loopback only.
    #[default]
    None,
    /// Only what the rules and the enabled domain groups allow.
    Allowlist,
    /// Everything outside the node (the edge, other sandboxes and the host stay unreachable).
    Open,
}

/// One allow rule: destination address or CIDR, optional port range, optional protocol.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NetworkRule {
    /// IPv4 or IPv6 address or CIDR: `192.0.2.7`, `10.0.0.0/8`, `fd00::/64`.
    pub cidr: String,
    /// `443` or `8000-8100`; absent means every port. Not allowed with `icmp`.
    #[serde(default)]
    pub ports: Option<String>,
    /// `tcp`, `udp`, `icmp` or `any` (default).
    #[serde(default)]
    pub protocol: Option<String>,
}

/// Body part of a create (`network`) and of `PUT /v1/sandboxes/{id}/network`.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NetworkSpec {
    /// Absent: `allowlist` if rules or enabled groups are given, else `none` (on PUT: unchanged).
    #[serde(default)]
    pub mode: Option<NetworkMode>,
    #[serde(default)]
    pub rules: Vec<NetworkRule>,
    /// Domain groups (as `network_rules`); on PUT, absent keeps the current groups.
    #[serde(default)]
    pub groups: Option<BTreeMap<String, bool>>,
}

/// A name the DNS proxy answered for a sandbox, and the address it allowed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DnsGrant {
    pub name: String,
    pub address: String,
    /// Seconds left before the address leaves the allow set.
    pub expires_in_s: u64,
}

/// `GET /v1/sandboxes/{id}/network` (and the answer of `PUT`).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NetworkStatus {
    pub mode: NetworkMode,
    pub rules: Vec<NetworkRule>,
    pub groups: BTreeMap<String, bool>,
    /// The sandbox's addresses (absent in mode `none`).
    #[serde(default)]
    pub ipv4: Option<String>,
    #[serde(default)]
    pub ipv6: Option<String>,
    /// The resolver the sandbox uses (the edge's DNS proxy).
    #[serde(default)]
    pub resolver: Option<String>,
    /// Packets the host dropped for this sandbox (connection attempts to non-allowed places).
    pub denied_packets: u64,
    /// DNS questions refused (name not allowed) and answered.
    pub dns_refused: u64,
    pub dns_answered: u64,
    #[serde(default)]
    pub dns_grants: Vec<DnsGrant>,
}

// ---------------------------------------------------------------------------------------------
// Function calls (issue 4): `POST /v1/functions/call`, `POST /v1/functions/batch`,
// `GET /v1/functions/pools`.

/// Outcome of one run of a function (or of its compile step).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum FunctionStatus {
    #[default]
    Ok,
    RuntimeError,
    Timeout,
    MemoryExceeded,
    OutputExceeded,
    CompileError,
    SandboxError,
}

/// Judge's verdict for one test case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Accepted,
    WrongAnswer,
    TimeLimitExceeded,
    MemoryLimitExceeded,
    RuntimeError,
    CompileError,
    OutputLimitExceeded,
    SandboxError,
}

/// How a test case's output is compared with the expected one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum CompareMode {
    /// Byte for byte.
    Exact,
    /// Equal after splitting both on whitespace (trailing newlines and spaces never matter).
    #[default]
    Whitespace,
}

/// One (stdin, expected stdout) pair of the test-case mode.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TestCase {
    #[serde(default)]
    pub stdin: String,
    pub expected: String,
}

/// `POST /v1/functions/call`: run `code` once (or once per test case) in a pre-warmed worker.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct FunctionCallRequest {
    /// `python`, `bash`, `c`, `cpp` or `command` (run `command` in `image`; `code` is then
    /// written to `main` in the scratch dir, available to the command).
    pub language: String,
    #[serde(default)]
    pub code: String,
    #[serde(default)]
    pub stdin: String,
    /// Extra files (relative path → content) written into the call's scratch dir (its cwd).
    #[serde(default)]
    pub files: BTreeMap<String, String>,
    /// Arguments given to the program.
    #[serde(default)]
    pub args: Vec<String>,
    /// `command` language: the argv to run (e.g. `["node", "main"]`).
    #[serde(default)]
    pub command: Vec<String>,
    /// Environment of the program (on top of PATH, HOME, TMPDIR, LANG defaults).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Wall-clock limit per run in seconds (default 10).
    #[serde(default)]
    pub timeout: Option<f64>,
    /// CPU-time limit per run in seconds (default: the wall limit).
    #[serde(default)]
    pub cpu_time_limit: Option<f64>,
    /// Memory limit of the call in MiB (default 256).
    #[serde(default)]
    pub memory_limit_mb: Option<u64>,
    /// Bytes kept per output stream; more is `output_exceeded` (default 1 MiB).
    #[serde(default)]
    pub max_output: Option<u64>,
    /// Processes (and threads) the call may have at once (default 64).
    #[serde(default)]
    pub pids_limit: Option<u64>,
    /// Image of the worker pool (default: the edge's function image, `debian`).
    #[serde(default)]
    pub image: Option<String>,
    /// Toolkit layers on top of the image (e.g. a compiler layer).
    #[serde(default)]
    pub toolkits: Vec<String>,
    /// Test-case mode: run once per case and judge the output.
    #[serde(default)]
    pub test_cases: Option<Vec<TestCase>>,
    #[serde(default)]
    pub compare: CompareMode,
}

/// The result of one run.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunResult {
    pub status: FunctionStatus,
    pub exit_code: i32,
    #[serde(default)]
    pub signal: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub wall_ms: f64,
    pub cpu_ms: f64,
    /// Peak memory of the call in bytes (the worker's memory cgroup high-water mark above the
    /// warm runtime's own use).
    pub peak_memory_bytes: u64,
}

/// One judged test case.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CaseResult {
    pub verdict: Verdict,
    #[serde(flatten)]
    pub run: RunResult,
}

/// Answer of `POST /v1/functions/call`.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FunctionCallResult {
    /// The run (the first case's in test-case mode, or the compile step when it failed).
    #[serde(flatten)]
    pub run: RunResult,
    /// Compiler output for `c`/`cpp`.
    #[serde(default)]
    pub compile: Option<RunResult>,
    /// Test-case mode: one result per case, and the overall verdict (the first non-accepted).
    #[serde(default)]
    pub cases: Option<Vec<CaseResult>>,
    #[serde(default)]
    pub verdict: Option<Verdict>,
    /// Worker that ran the call (the same id means the same warm container).
    pub worker: String,
    /// Time spent waiting for a worker, in ms.
    pub queue_ms: f64,
}

/// `POST /v1/functions/batch`.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct FunctionBatchRequest {
    pub calls: Vec<FunctionCallRequest>,
    /// Calls run at once (default and maximum: the pool's size).
    #[serde(default)]
    pub concurrency: Option<usize>,
}

/// One entry of a batch answer: a result, or the error that call got.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FunctionBatchItem {
    #[serde(default)]
    pub result: Option<FunctionCallResult>,
    #[serde(default)]
    pub error: Option<ErrorDetail>,
}

/// Answer of `POST /v1/functions/batch`: `results[i]` belongs to `calls[i]`.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FunctionBatchResult {
    pub results: Vec<FunctionBatchItem>,
}

/// One pool of warm workers.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FunctionPoolInfo {
    pub image: String,
    pub toolkits: Vec<String>,
    pub language: String,
    pub min: usize,
    pub max: usize,
    pub idle: usize,
    pub busy: usize,
    pub starting: usize,
    pub queued: usize,
    pub workers: Vec<String>,
    pub calls: u64,
    pub workers_created: u64,
    pub workers_destroyed: u64,
    pub rejected: u64,
}

/// Answer of `GET /v1/functions/pools`.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FunctionPoolList {
    pub pools: Vec<FunctionPoolInfo>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_codes_serialize_as_their_strings_and_are_distinct() {
        let mut seen = std::collections::BTreeSet::new();
        for code in ErrorCode::ALL {
            assert_eq!(serde_json::to_value(code).unwrap(), code.as_str());
            assert_eq!(ErrorCode::parse(code.as_str()), Some(code));
            assert_eq!(status_for_code(code.as_str()), code.status());
            assert!(seen.insert(code.as_str()), "{code:?} listed twice in ALL");
            // Exhaustive on purpose: a new variant stops this from compiling until it is
            // looked at here (and added to `ALL`).
            match code {
                ErrorCode::BadRequest
                | ErrorCode::Unauthorized
                | ErrorCode::Forbidden
                | ErrorCode::SandboxNotFound
                | ErrorCode::ImageNotFound
                | ErrorCode::FileNotFound
                | ErrorCode::NotFound
                | ErrorCode::Conflict
                | ErrorCode::PayloadTooLarge
                | ErrorCode::QuotaExceeded
                | ErrorCode::NodeFull
                | ErrorCode::NodeUnavailable
                | ErrorCode::SandboxBusy
                | ErrorCode::SandboxDead
                | ErrorCode::Unsupported
                | ErrorCode::Internal => {}
            }
        }
        assert_eq!(status_for_code("no_such_code"), 500);
        assert_eq!(status_for_code(codes::QUOTA_EXCEEDED), 429);
    }
}
