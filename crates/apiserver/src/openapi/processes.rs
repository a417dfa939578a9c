//! OpenAPI descriptions of the process-handle routes and file rename (issue 18). The edge serves
//! them; they reach it through the `/v1/sandboxes/{id}/{*rest}` pass-through.

#![allow(dead_code)]

use dsec_wire::api::{
    ErrorBody, FileInfo, FsEvent, ProcessEvent, ProcessInfo, ProcessInputRequest, ProcessList,
    SandboxMetrics, SignalProcessRequest, StartProcessRequest,
};
use utoipa::IntoParams;

const ERRORS: &str = "Error (4xx: the caller must fix something; 5xx: server side). \
    `error.code` is one of ErrorCode.";

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct ProcessPath {
    /// Sandbox id; encodes the owning node.
    #[param(pattern = r"^sb-[a-z0-9]{1,16}-[0-9a-f]{16}$")]
    id: String,
    /// The process's pid inside the sandbox, or its tag.
    pid: String,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Path)]
struct SandboxOnly {
    /// Sandbox id; encodes the owning node.
    #[param(pattern = r"^sb-[a-z0-9]{1,16}-[0-9a-f]{16}$")]
    id: String,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct ListQuery {
    /// Also list exited processes whose output is still kept.
    all: Option<bool>,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct OutputQuery {
    /// Combined stdout+stderr offset to read from (default 0).
    offset: Option<u64>,
    /// Keep streaming until the process exits (default false: what is kept now).
    follow: Option<bool>,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct WaitQuery {
    /// Seconds to wait at most (default 60, at most 3600; 0 answers at once).
    timeout: Option<f64>,
}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct RenameQuery {
    /// Absolute path to move.
    src: String,
    /// Absolute destination path.
    dst: String,
    /// Replace `dst` if it exists (default false: 400 when it exists).
    overwrite: Option<bool>,
}

/// Start a process that outlives this call (a process handle).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes", tag = "commands",
    operation_id = "startProcess",
    params(SandboxOnly),
    request_body = StartProcessRequest,
    responses(
        (status = 201, description = "Started", body = ProcessInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn start_process() {}

/// List process handles.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes", tag = "commands",
    operation_id = "listProcesses",
    params(SandboxOnly, ListQuery),
    responses(
        (status = 200, description = "OK", body = ProcessList),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn list_processes() {}

/// A process handle's state (by pid or tag).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes/{pid}", tag = "commands",
    operation_id = "getProcess",
    params(ProcessPath),
    responses(
        (status = 200, description = "OK", body = ProcessInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn get_process() {}

/// Read a process's output from an offset, optionally following it until it exits.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes/{pid}/output", tag = "commands",
    operation_id = "processOutput",
    params(ProcessPath, OutputQuery),
    responses(
        (status = 200, description = "NDJSON ProcessEvent lines: `stdout`/`stderr` chunks with \
            their offsets, `truncated` for output dropped from the ring buffer, then `end` \
            (or `error`).",
            content((ProcessEvent = "application/x-ndjson"))),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn process_output() {}

/// Wait for a process to exit.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{pid}/wait", tag = "commands",
    operation_id = "waitProcess",
    params(ProcessPath, WaitQuery),
    responses(
        (status = 200, description = "The state after the wait (`running` is still true after \
            a timeout)", body = ProcessInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn wait_process() {}

/// Write to a process's stdin (and optionally close it).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{pid}/stdin", tag = "commands",
    operation_id = "processStdin",
    params(ProcessPath),
    request_body = ProcessInputRequest,
    responses(
        (status = 200, description = "Written", body = ProcessInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn process_stdin() {}

/// Send a signal to a process (its whole process group by default).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{pid}/signal", tag = "commands",
    operation_id = "signalProcess",
    params(ProcessPath),
    request_body = SignalProcessRequest,
    responses(
        (status = 200, description = "Signalled", body = ProcessInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn signal_process() {}

/// SIGKILL a process's whole process group (and session).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{pid}/kill", tag = "commands",
    operation_id = "killProcess",
    params(ProcessPath),
    responses(
        (status = 200, description = "Killed", body = ProcessInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn kill_process() {}

/// Rename (move) a file or directory.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/rename", tag = "files",
    operation_id = "renameFile",
    params(SandboxOnly, RenameQuery),
    responses(
        (status = 200, description = "The destination's info", body = FileInfo),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn rename_file() {}

#[derive(IntoParams)]
#[into_params(parameter_in = Query)]
struct WatchQuery {
    /// Absolute path of the directory to watch.
    path: String,
    /// Also every directory below it, including ones created later (default true).
    recursive: Option<bool>,
}

/// Watch a directory: filesystem events as they happen, until the client closes.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/watch", tag = "files",
    operation_id = "watchFiles",
    params(SandboxOnly, WatchQuery),
    responses(
        (status = 200, description = "NDJSON FsEvent lines: first `ready` (the watch is in \
            place), then create/write/remove/rename/chmod (and `overflow` when the kernel \
            dropped events) in order; closing the connection ends the watch.",
            content((FsEvent = "application/x-ndjson"))),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn watch_files() {}

/// The sandbox's recent resource samples (CPU, memory, disk, network, pids), taken by its edge
/// every few seconds; the newest is also on the edge's `/metrics` with a `sandbox` label.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/metrics", tag = "sandboxes",
    operation_id = "sandboxMetrics",
    params(SandboxOnly),
    responses(
        (status = 200, description = "Samples, oldest first", body = SandboxMetrics),
        (status = "default", description = ERRORS, body = ErrorBody),
    ))]
pub fn sandbox_metrics() {}
