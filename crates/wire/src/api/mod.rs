//! HTTP/JSON API types.
//!
//! Public routes (apiserver, `Authorization: Bearer <api key>`), all under `/v1`:
//!
//! | method | path | body | answer |
//! |---|---|---|---|
//! | POST | `/v1/sandboxes` | [`CreateSandboxRequest`] | 201 [`SandboxInfo`] |
//! | GET | `/v1/sandboxes?ended=B&end_reason=R` | | [`SandboxList`] (live ones; ended ones too with `ended`, only those ended for `R` with `end_reason`, see [`ListSandboxesQuery`]) |
//! | GET | `/v1/sandboxes/{id}` | | [`SandboxInfo`] |
//! | DELETE | `/v1/sandboxes/{id}` | | [`SandboxInfo`] (state `stopped`) |
//! | POST | `/v1/sandboxes/{id}/pause` | | [`SandboxInfo`] (state `paused`, `last_pause` memory report) |
//! | POST | `/v1/sandboxes/{id}/resume` | | [`SandboxInfo`] (state `running`) |
//! | POST | `/v1/sandboxes/{id}/snapshot` | [`SnapshotRequest`] | 201 [`SnapshotInfo`] (the id is an image name) |
//! | POST | `/v1/sandboxes/{id}/fork` | [`ForkRequest`] | 201 [`ForkResult`] (207 when some children failed) |
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
//! | PUT | `/v1/sandboxes/{id}/ttl` | [`TtlUpdate`] | [`SandboxInfo`] (TTLs changed, idle clock reset) |
//! | GET | `/v1/sandboxes/{id}/network` | | [`NetworkStatus`] (mode, rules, addresses, denied counters) |
//! | PUT | `/v1/sandboxes/{id}/network` | [`NetworkSpec`] | [`NetworkStatus`]; effective for new connections at once |
//! | GET (WebSocket) | `/v1/sandboxes/{id}/tty?rows=R&cols=C&session=S` | binary frames = terminal bytes; text frames = [`TtyControl`] | |
//! | POST | `/v1/sandboxes/{id}/processes` | [`StartProcessRequest`] | 201 [`ProcessInfo`] |
//! | GET | `/v1/sandboxes/{id}/processes?all=B` | | [`ProcessList`] (running ones; `all` adds exited ones still kept) |
//! | GET | `/v1/sandboxes/{id}/processes/{pid}` | | [`ProcessInfo`] (`pid` may also be a tag) |
//! | GET | `/v1/sandboxes/{id}/processes/{pid}/output?offset=N&follow=B` | | NDJSON [`ProcessEvent`]s |
//! | POST | `/v1/sandboxes/{id}/processes/{pid}/wait?timeout=S` | | [`ProcessInfo`] |
//! | POST | `/v1/sandboxes/{id}/processes/{pid}/stdin` | [`ProcessInputRequest`] | [`ProcessInfo`] |
//! | POST | `/v1/sandboxes/{id}/processes/{pid}/signal` | [`SignalProcessRequest`] | [`ProcessInfo`] |
//! | POST | `/v1/sandboxes/{id}/files/rename?src=A&dst=B&overwrite=B` | | [`FileInfo`] of `dst` |
//! | GET | `/v1/sandboxes/{id}/metrics` | | [`SandboxMetrics`] (the edge's recent samples) |
//! | GET | `/v1/sandboxes/{id}/watch?path=P&recursive=B` | | NDJSON [`FsEvent`]s (first `ready`), until the client closes |
//! | GET | `/v1/images` | | [`ImageList`] |
//! | PUT | `/v1/images/{name}` | a tar stream (`content-type: application/x-tar`, gzip accepted) | 201 [`ImageInfo`] |
//! | DELETE | `/v1/images/{name}` | | 204 |
//! | GET | `/v1/nodes` | | [`NodeList`] |
//! | POST, GET, DELETE | `/v1/volumes`, `/v1/volumes/{name}` | see [`VolumeInfo`] | |
//! | GET | `/openapi.json`, `/healthz`, `/metrics` | | unauthenticated |
//!
//! The edge serves the same sandbox, image and node-status routes under `/edge/v1`
//! (authenticated with the node's edge token), plus `GET /edge/v1/status` ([`NodeStatus`]).
//! Every error is an [`ErrorBody`] with a 4xx (the caller must fix something) or 5xx status.

mod end_reason;
mod error;
mod exec;
mod files;
mod function;
mod image;
mod membership;
mod metrics;
mod network;
mod node;
mod ports;
mod process;
mod queue;
mod snapshot;
mod trajectory;
mod volume;

mod ttl;
mod watch;

pub use end_reason::*;
pub use error::*;
pub use exec::*;
pub use files::*;
pub use function::*;
pub use image::*;
pub use membership::*;
pub use metrics::*;
pub use network::*;
pub use node::*;
pub use ports::*;
pub use process::*;
pub use queue::*;
pub use snapshot::*;
pub use trajectory::*;
pub use volume::*;

pub use ttl::*;
pub use watch::*;

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
    /// Sandbox TCP ports reachable through the apiserver without an API key or URL token
    /// (`/v1/sandboxes/{id}/ports/{port}/...`); every other port needs one of them.
    #[serde(default)]
    pub public_ports: Vec<u16>,
    /// Seconds the create may wait for capacity (in the apiserver's per-project fair queue,
    /// then in the edge's admission queue) instead of being refused with `node_full`; past
    /// it the refusal names the resource lacking. Unset: no apiserver queue, and the edge
    /// waits only for its own starting sandboxes (up to its `admission_wait_ms`).
    #[serde(default)]
    pub wait_s: Option<f64>,

    /// Volumes to mount: sandbox path → volume name (read-write) or `{"name", "read_only"}`
    /// (see [`VolumeMount`]). The apiserver resolves names in the sandbox's project and sends
    /// the node's volume ids on.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub volumes: BTreeMap<String, VolumeMount>,
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
    /// Why the sandbox ended (set once it is `stopped` or `failed`; see [`EndReason`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_reason: Option<EndReason>,
    /// What exactly happened, for people (the reason's details, e.g. an internal error's cause).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_detail: Option<String>,
    /// Ports reachable through the apiserver without credentials (from the create request).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub public_ports: Vec<u16>,
}

/// Query of `GET /v1/sandboxes`: without `ended`/`end_reason` only live sandboxes are listed.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ListSandboxesQuery {
    /// Also list ended sandboxes the nodes still remember (their last few hundred each).
    #[serde(default)]
    pub ended: Option<bool>,
    /// Only ended sandboxes that ended for this reason (implies `ended`).
    #[serde(default)]
    pub end_reason: Option<EndReason>,
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
                | ErrorCode::Internal
                | ErrorCode::PortUnreachable => {}
            }
        }
        assert_eq!(status_for_code("no_such_code"), 500);
        assert_eq!(status_for_code(codes::QUOTA_EXCEEDED), 429);
    }
}
