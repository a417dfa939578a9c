//! One `#[utoipa::path]` per operation of the public API. These functions are never called:
//! they carry the description of the route that `crate::routes` registers (several routes share
//! one forwarding handler, so the descriptions cannot sit on the handlers themselves).

#![allow(dead_code)]

use dsec_wire::api::{
    CommandResult, CreateSandboxRequest, ErrorBody, ExecRequest, FileInfo, FileList,
    FunctionBatchRequest, FunctionBatchResult, FunctionCallRequest, FunctionCallResult,
    FunctionPoolList, ImageActionEvent, ImageActionRequest, ImageInfo, ImageList, JobOpResult,
    LabelSelector, LastStep, NetworkSpec, NetworkStatus, NodeList, PackDiffRequest,
    RunShellRequest, SandboxInfo, SandboxList, StreamEvent, TrajectoryRecord,
};
use serde::Serialize;
use utoipa::openapi::schema::{KnownFormat, ObjectBuilder, SchemaFormat, Type};
use utoipa::openapi::{RefOr, Schema};
use utoipa::{IntoParams, PartialSchema, ToSchema};

use crate::iam::http::ClusterView;
use crate::iam::{
    CreateKeyRequest, CreateProjectRequest, CreatedKey, ProjectList, ProjectView, Quota,
};

/// Description of every error answer.
pub(super) const ERRORS: &str = "Error (4xx: the caller must fix something; 5xx: server side). \
    `error.code` is one of ErrorCode.";

/// Raw bytes (file contents, tar streams, blobs).
pub struct RawBytes;

impl PartialSchema for RawBytes {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
            .into()
    }
}

impl ToSchema for RawBytes {}

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct SandboxPath {
    /// Sandbox id; encodes the owning node.
    #[param(pattern = r"^sb-[a-z0-9]{1,16}-[0-9a-f]{16}$")]
    id: String,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct SessionPath {
    /// Sandbox id; encodes the owning node.
    #[param(pattern = r"^sb-[a-z0-9]{1,16}-[0-9a-f]{16}$")]
    id: String,
    /// Shell session name.
    name: String,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct BlobPath {
    /// Sandbox id; encodes the owning node.
    #[param(pattern = r"^sb-[a-z0-9]{1,16}-[0-9a-f]{16}$")]
    id: String,
    /// sha256 named in a record's `blobs`.
    #[param(pattern = r"^[0-9a-f]{64}$")]
    digest: String,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct ImagePath {
    /// `name` or `name:tag`, URL-encoded (may contain `/`).
    name: String,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct ProjectPath {
    /// Project name.
    name: String,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct KeyPath {
    /// `key_id` (hash prefix) or the key itself.
    id: String,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub(super) enum JobOp {
    Pause,
    Resume,
    Stop,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct JobPath {
    /// What to do with every matching sandbox.
    op: JobOp,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct PathQuery {
    /// Absolute path inside the sandbox.
    path: String,
    /// Client step id: a completed step answers its recorded result (header
    /// `x-dsec-replayed: true`), a running one is waited for, a reused one with another request
    /// is 409 conflict.
    step: Option<u64>,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct WriteQuery {
    /// Absolute path inside the sandbox.
    path: String,
    /// Octal permission bits.
    #[param(example = "0644")]
    mode: Option<String>,
    /// Client step id (see `readFile`).
    step: Option<u64>,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct RemoveQuery {
    /// Absolute path inside the sandbox.
    path: String,
    /// Remove a directory with everything below it.
    recursive: Option<bool>,
    /// Client step id (see `readFile`).
    step: Option<u64>,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct MkdirQuery {
    /// Absolute path inside the sandbox.
    path: String,
    /// Octal permission bits.
    #[param(example = "0755")]
    mode: Option<String>,
    /// Create missing parent directories.
    parents: Option<bool>,
    /// Client step id (see `readFile`).
    step: Option<u64>,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct TtyQuery {
    /// Terminal rows.
    rows: Option<u16>,
    /// Terminal columns.
    cols: Option<u16>,
    /// Shell session to attach to.
    session: Option<String>,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct TrajectoryQuery {
    /// Lowest step id.
    from: Option<u64>,
    /// Highest step id.
    to: Option<u64>,
    /// Comma-separated kinds (shell,exec,write_file,read_file,list_files,stat,remove,mkdir,
    /// create,stop,died,...).
    kind: Option<String>,
    /// Records that started at or after this Unix time (s).
    since: Option<f64>,
    /// Records that started before this Unix time (s).
    until: Option<f64>,
    /// Only the call(s) that last wrote this path.
    path: Option<String>,
}

#[derive(Serialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub(super) enum ImportFormat {
    Tar,
    DockerArchive,
    Oci,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct ImportQuery {
    /// `tar`: one layer; `docker-archive` / `oci`: one layer per image layer, OCI whiteouts
    /// converted to overlayfs whiteouts (default `tar`).
    format: Option<ImportFormat>,
}

/// One microVM template (a VM shape with its snapshot and disk).
#[derive(Serialize, ToSchema)]
struct MicrovmTemplate {
    /// SHA-256 prefix of the shape.
    key: String,
    /// The shape: guest kernel/initramfs/aether digests, layer digests, memory, vCPUs, disk
    /// size, pmem/balloon, init_user, env.
    shape: String,
    bytes: u64,
    uses: u64,
}

/// How creates started since the edge started.
#[derive(Serialize, ToSchema)]
struct MicrovmBoots {
    cold: u64,
    template: u64,
    cold_fallback: u64,
}

/// `GET /v1/microvm/templates`.
#[derive(Serialize, ToSchema)]
struct MicrovmTemplateList {
    dir: String,
    max: u64,
    templates: Vec<MicrovmTemplate>,
    boots: MicrovmBoots,
    built: u64,
    build_failures: u64,
}

/// `DELETE /v1/microvm/templates`.
#[derive(Serialize, ToSchema)]
struct RemovedTemplates {
    removed: u64,
}

/// `DELETE /v1/keys/{id}`.
#[derive(Serialize, ToSchema)]
struct RevokedKey {
    /// The id given.
    revoked: String,
}

/// A function call refused because the pool's queue is full.
#[derive(Serialize, ToSchema)]
struct QueueFull {
    error: dsec_wire::api::ErrorDetail,
    /// Seconds to wait before retrying (also the `Retry-After` header).
    retry_after_s: u64,
}

/// Create a sandbox (placed on a healthy edge). With `wait_s` it waits up to that long in
/// the apiserver's queue (FIFO per project, projects in turn) for a node with room; its answer
/// then also has `queue` (a `QueueReport`: how long it waited) and the header
/// `x-dsec-queue-wait-ms`; past `wait_s` it is refused `503 node_full` naming what was lacking.
#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", operation_id = "createSandbox",
    request_body = CreateSandboxRequest,
    responses(
        (status = 201, description = "Created (with `wait_s`: plus `queue`, a QueueReport)", body = SandboxInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn create_sandbox() {}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct ListQuery {
    /// Also list ended sandboxes the nodes still remember (with `end_reason`/`end_detail`).
    ended: Option<bool>,
    /// Only ended sandboxes that ended for this reason (implies `ended`).
    end_reason: Option<dsec_wire::api::EndReason>,
}

/// List sandboxes of every edge (header `x-dsec-partial` names edges that did not answer).
/// Live ones by default; ended ones too with `ended=true`, filtered by `end_reason`.
#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes", operation_id = "listSandboxes",
    params(ListQuery),
    responses(
        (status = 200, description = "OK", body = SandboxList,
            headers(("x-dsec-partial" = String, description = "Edges that did not answer"))),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn list_sandboxes() {}

/// Get one sandbox.
#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes", operation_id = "getSandbox",
    params(SandboxPath),
    responses(
        (status = 200, description = "OK", body = SandboxInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn get_sandbox() {}

/// Stop a sandbox and remove its state.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes", operation_id = "stopSandbox",
    params(SandboxPath),
    responses(
        (status = 200, description = "Stopped (state `stopped`)", body = SandboxInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn stop_sandbox() {}

/// Run a command in a persistent shell session.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/shell", tag = "commands", operation_id = "runShell",
    params(SandboxPath),
    request_body = RunShellRequest,
    responses(
        (status = 200, description = "A CommandResult, or (when `stream` is true) NDJSON \
            StreamEvent lines ending with an `exit` or `error` event.",
            content((CommandResult = "application/json"), (StreamEvent = "application/x-ndjson"))),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn run_shell() {}

/// Run an argv directly, without a shell.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/exec", tag = "commands", operation_id = "exec",
    params(SandboxPath),
    request_body = ExecRequest,
    responses(
        (status = 200, description = "A CommandResult, or (when `stream` is true) NDJSON \
            StreamEvent lines ending with an `exit` or `error` event.",
            content((CommandResult = "application/json"), (StreamEvent = "application/x-ndjson"))),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn exec() {}

/// End a shell session.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/sessions/{name}", tag = "commands",
    operation_id = "closeSession",
    params(SessionPath),
    responses(
        (status = 204, description = "Done"),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn close_session() {}

/// Write a file (body streamed).
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", tag = "files", operation_id = "writeFile",
    params(SandboxPath, WriteQuery),
    request_body(content = inline(RawBytes), content_type = "application/octet-stream"),
    responses(
        (status = 200, description = "Written", body = FileInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn write_file() {}

/// Read a file (body streamed).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", tag = "files", operation_id = "readFile",
    params(SandboxPath, PathQuery),
    responses(
        (status = 200, description = "File bytes",
            content((inline(RawBytes) = "application/octet-stream")),
            headers(
                ("x-dsec-mode" = String, description = "Octal permission bits"),
                ("content-length" = u64, description = "Size of the file"),
            )),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn read_file() {}

/// Remove a file or directory.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", tag = "files", operation_id = "removeFile",
    params(SandboxPath, RemoveQuery),
    responses(
        (status = 204, description = "Done"),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn remove_file() {}

/// List a directory.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", tag = "files", operation_id = "listFiles",
    params(SandboxPath, PathQuery),
    responses(
        (status = 200, description = "OK", body = FileList),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn list_files() {}

/// Stat a path.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/stat", tag = "files", operation_id = "statFile",
    params(SandboxPath, PathQuery),
    responses(
        (status = 200, description = "OK", body = FileInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn stat_file() {}

/// Create a directory.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/mkdir", tag = "files", operation_id = "mkdir",
    params(SandboxPath, MkdirQuery),
    responses(
        (status = 200, description = "Created", body = FileInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn mkdir() {}

/// Interactive terminal over WebSocket: binary frames are terminal bytes, text frames are
/// TtyControl JSON.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/tty", tag = "commands", operation_id = "tty",
    params(SandboxPath, TtyQuery),
    responses(
        (status = 101, description = "Switching to WebSocket; text frames are TtyControl"),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn tty() {}

/// Turn the sandbox's writable layer into a new layer; registers image `name` = the sandbox's
/// layers + the diff (the sandbox is frozen briefly).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pack_diff", tag = "images", operation_id = "packDiff",
    params(SandboxPath),
    request_body = PackDiffRequest,
    responses(
        (status = 201, description = "Packed", body = ImageInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn pack_diff() {}

/// Snapshot a container's files: its writable layer, taken while it is frozen, becomes a layer
/// on top of its layers, registered as an image (the snapshot id); the sandbox goes on. A
/// sandbox created from it starts new processes on those files.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshot", tag = "sandboxes", operation_id = "snapshot",
    params(SandboxPath),
    request_body = dsec_wire::api::SnapshotRequest,
    responses(
        (status = 201, description = "Taken", body = dsec_wire::api::SnapshotInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn snapshot() {}

/// Fork a sandbox into `n` (1..=100) new ones from one snapshot of its current files, each
/// a create (quotas, placement, admission) with its own id, writable layer, network and
/// trajectory, labelled `dsec.fork_of` and `dsec.fork_step`.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", tag = "sandboxes", operation_id = "fork",
    params(SandboxPath),
    request_body = dsec_wire::api::ForkRequest,
    responses(
        (status = 201, description = "Every child exists", body = dsec_wire::api::ForkResult),
        (status = 207, description = "Some children could not be made (`failed`); those made are in `children`", body = dsec_wire::api::ForkResult),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn fork() {}

/// Network mode, rules, addresses and denied counters.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/network", tag = "network", operation_id = "getNetwork",
    params(SandboxPath),
    responses(
        (status = 200, description = "Network status", body = NetworkStatus),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn get_network() {}

/// Replace the network rules live (effective for new connections at once).
#[utoipa::path(put, path = "/v1/sandboxes/{id}/network", tag = "network", operation_id = "setNetwork",
    params(SandboxPath),
    request_body = NetworkSpec,
    responses(
        (status = 200, description = "Network status", body = NetworkStatus),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn set_network() {}

/// Pause: freeze every process and give memory back (state kept). Any later request resumes
/// transparently.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", tag = "sandboxes", operation_id = "pauseSandbox",
    params(SandboxPath),
    responses(
        (status = 200, description = "Paused (state `paused`, `last_pause` memory report)",
            body = SandboxInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn pause() {}

/// Resume a paused sandbox.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", tag = "sandboxes", operation_id = "resumeSandbox",
    params(SandboxPath),
    responses(
        (status = 200, description = "Running", body = SandboxInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn resume() {}

/// Export the sandbox's trajectory log as JSONL (one TrajectoryRecord per line); kept after
/// the sandbox ends for the node's retention period.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/trajectory", tag = "trajectory",
    operation_id = "getTrajectory",
    params(SandboxPath, TrajectoryQuery),
    responses(
        (status = 200, description = "JSONL",
            content((TrajectoryRecord = "application/x-ndjson"))),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn get_trajectory() {}

/// Highest completed step id, running steps, record count.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/trajectory/last_step", tag = "trajectory",
    operation_id = "getLastStep",
    params(SandboxPath),
    responses(
        (status = 200, description = "OK", body = LastStep),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn get_last_step() {}

/// Output or upload content a record keeps by digest.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/trajectory/blobs/{digest}", tag = "trajectory",
    operation_id = "getTrajectoryBlob",
    params(BlobPath),
    responses(
        (status = 200, description = "Raw bytes",
            content((inline(RawBytes) = "application/octet-stream"))),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn get_trajectory_blob() {}

/// List images.
#[utoipa::path(get, path = "/v1/images", tag = "images", operation_id = "listImages",
    responses(
        (status = 200, description = "OK", body = ImageList),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn list_images() {}

/// Import an image from a tar stream: a root file system tar (gzip accepted), a `docker save`
/// archive or a tar of an OCI image layout.
#[utoipa::path(put, path = "/v1/images/{name}", tag = "images", operation_id = "importImage",
    params(ImagePath, ImportQuery),
    request_body(content = inline(RawBytes), content_type = "application/x-tar"),
    responses(
        (status = 201, description = "Imported", body = ImageInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn import_image() {}

/// Pull the image from an OCI registry (distribution API v2, bearer-token or basic auth; plain
/// HTTP: loopback registries, or any with `insecure`) or fold its small consecutive layers into
/// one. With `accept: application/x-ndjson` the answer is 200 with one ImageActionEvent per line
/// (progress, then `done` or `error`).
#[utoipa::path(post, path = "/v1/images/{name}", tag = "images", operation_id = "imageAction",
    params(ImagePath),
    request_body = ImageActionRequest,
    responses(
        (status = 201, description = "Done", body = ImageInfo),
        (status = 200, description = "Progress stream (accept: application/x-ndjson)",
            content((ImageActionEvent = "application/x-ndjson"))),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn image_action() {}

/// Remove an image (409 while in use).
#[utoipa::path(delete, path = "/v1/images/{name}", tag = "images", operation_id = "removeImage",
    params(ImagePath),
    responses(
        (status = 204, description = "Done"),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn remove_image() {}

/// List the microVM templates of the (first) edge.
///
/// Restore-from-template boots: each template is one VM shape (key = SHA-256 prefix of the
/// shape), its snapshot and disk; also how creates started (cold / template / cold-fallback).
/// 501 when templates are off or the node has no microVM substrate.
#[utoipa::path(get, path = "/v1/microvm/templates", tag = "images",
    operation_id = "listMicrovmTemplates",
    responses(
        (status = 200, description = "OK", body = MicrovmTemplateList),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn list_microvm_templates() {}

/// Remove every microVM template of the (first) edge (later creates boot cold and rebuild
/// them).
#[utoipa::path(delete, path = "/v1/microvm/templates", tag = "images",
    operation_id = "removeMicrovmTemplates",
    responses(
        (status = 200, description = "OK", body = RemovedTemplates),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn remove_microvm_templates() {}

/// Nodes as seen by the watcher.
#[utoipa::path(get, path = "/v1/nodes", tag = "cluster", operation_id = "listNodes",
    responses(
        (status = 200, description = "OK", body = NodeList),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn list_nodes() {}

/// Live cluster view: per-node load and health, primary-pool utilisation, this replica's
/// counters (`dsec top`).
#[utoipa::path(get, path = "/v1/cluster", tag = "cluster", operation_id = "clusterView",
    responses(
        (status = 200, description = "OK", body = ClusterView),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn cluster_view() {}

/// Projects with quota and usage (usage includes sub-projects).
#[utoipa::path(get, path = "/v1/projects", tag = "iam", operation_id = "listProjects",
    responses(
        (status = 200, description = "OK", body = ProjectList),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn list_projects() {}

/// Create a project under a parent (default `root`); admin only.
#[utoipa::path(post, path = "/v1/projects", tag = "iam", operation_id = "createProject",
    request_body = CreateProjectRequest,
    responses(
        (status = 201, description = "Created", body = ProjectView),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn create_project() {}

/// Replace a project's quota (must fit in the parent's and cover every child's); admin only.
#[utoipa::path(put, path = "/v1/projects/{name}/quota", tag = "iam", operation_id = "setProjectQuota",
    params(ProjectPath),
    request_body = Quota,
    responses(
        (status = 200, description = "The project with its new quota", body = ProjectView),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn set_project_quota() {}

/// Issue an API key for a principal (created if new, with a home project and kind
/// `user`|`admin`); the key is shown once; admin only.
#[utoipa::path(post, path = "/v1/keys", tag = "iam", operation_id = "createKey",
    request_body = CreateKeyRequest,
    responses(
        (status = 201, description = "Created", body = CreatedKey),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn create_key() {}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct RevokeQuery {
    /// Also stop every sandbox the key's principal created (end reason `quota_revoked`);
    /// the answer's `stopped_sandboxes` lists them.
    stop_sandboxes: Option<bool>,
}

/// Revoke a key by `key_id` (hash prefix) or the key itself; admin only.
#[utoipa::path(delete, path = "/v1/keys/{id}", tag = "iam", operation_id = "revokeKey",
    params(KeyPath, RevokeQuery),
    responses(
        (status = 200, description = "Revoked", body = RevokedKey),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn revoke_key() {}

/// Job-level operation on every sandbox (every node) whose labels include all of `labels`.
#[utoipa::path(post, path = "/v1/jobs/{op}", tag = "jobs", operation_id = "jobOp",
    params(JobPath),
    request_body = LabelSelector,
    responses(
        (status = 200, description = "OK", body = JobOpResult),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn job_op() {}

/// Run code once (or once per test case) on a pre-warmed worker.
#[utoipa::path(post, path = "/v1/functions/call", tag = "functions", operation_id = "functionCall",
    request_body = FunctionCallRequest,
    responses(
        (status = 200, description = "OK", body = FunctionCallResult),
        (status = 429, description = "`quota_exceeded`: the pool's queue is full; retry after \
            `retry_after_s` (also the Retry-After header). The call did not run.",
            body = QueueFull),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn function_call() {}

/// Run many calls with bounded concurrency; `results[i]` answers `calls[i]`.
#[utoipa::path(post, path = "/v1/functions/batch", tag = "functions", operation_id = "functionBatch",
    request_body = FunctionBatchRequest,
    responses(
        (status = 200, description = "OK", body = FunctionBatchResult),
        (status = 429, description = "`quota_exceeded`: the pool's queue is full; retry after \
            `retry_after_s` (also the Retry-After header). No call ran.",
            body = QueueFull),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn function_batch() {}

/// The node's warm pools.
#[utoipa::path(get, path = "/v1/functions/pools", tag = "functions", operation_id = "functionPools",
    responses(
        (status = 200, description = "OK", body = FunctionPoolList),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn function_pools() {}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "service", operation_id = "openapi",
    security(()),
    responses((status = 200, description = "OpenAPI document", content_type = "application/json")))]
pub fn openapi() {}

/// Liveness.
#[utoipa::path(get, path = "/healthz", tag = "service", operation_id = "healthz",
    security(()),
    responses((status = 200, description = "ok", body = String, content_type = "text/plain")))]
pub fn healthz() {}

/// Prometheus metrics.
#[utoipa::path(get, path = "/metrics", tag = "service", operation_id = "metrics",
    security(()),
    responses((status = 200, description = "Prometheus text format", body = String,
        content_type = "text/plain")))]
pub fn metrics() {}

/// SandboxFusion-compatible `run_code` (issue 20): the API key is part of the path, so that
/// SandboxFusion's clients, which take only a base URL, can use
/// `http://HOST:PORT/sandboxfusion/<API key>`. The body is SandboxFusion's RunCodeRequest
/// (`code`, `language`, `stdin`, `compile_timeout`, `run_timeout`, `files` as base64,
/// `fetch_files`); the answer its RunCodeResponse (`status` Success/Failed/SandboxError,
/// `message`, `compile_result`/`run_result` with `status` Finished/Error/TimeLimitExceeded,
/// `execution_time`, `return_code`, `stdout`, `stderr`, and `files` as base64).
#[utoipa::path(post, path = "/sandboxfusion/{key}/run_code", tag = "functions",
    operation_id = "sandboxFusionRunCode",
    security(()),
    params(("key" = String, Path, description = "API key (`dsk_...`)")),
    request_body(content = Object, description = "SandboxFusion RunCodeRequest"),
    responses(
        (status = 200, description = "SandboxFusion RunCodeResponse", body = Object),
        (status = 401, description = "`unauthorized`: no valid API key in the path", body = ErrorBody),
        (status = 429, description = "`quota_exceeded`: the pool is saturated; retry after the \
            Retry-After header. The call did not run.", body = QueueFull),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn sandboxfusion_run_code() {}

/// SandboxFusion-compatible `run_jupyter`: answers 501 `unsupported` (no Jupyter kernel in
/// the python toolkit).
#[utoipa::path(post, path = "/sandboxfusion/{key}/run_jupyter", tag = "functions",
    operation_id = "sandboxFusionRunJupyter",
    security(()),
    params(("key" = String, Path, description = "API key (`dsk_...`)")),
    responses(
        (status = 200, description = "SandboxFusion RunJupyterResponse (not offered by this \
            build: every call answers 501)", body = Object),
        (status = 501, description = "`unsupported`", body = ErrorBody),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn sandboxfusion_run_jupyter() {}
