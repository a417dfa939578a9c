//! Function calls (issue 4): `POST /v1/functions/call`, `POST /v1/functions/batch`, `GET /v1/functions/pools`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::ErrorDetail;

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
    /// Wall/CPU limit of the compile step in seconds (default: the edge's
    /// `compile_timeout_s`).
    #[serde(default)]
    pub compile_timeout: Option<f64>,
    /// Extra files given base64-encoded (binary content), by relative path in the scratch dir
    /// or absolute path under /tmp, /var/tmp or /dev/shm (wiped after the call).
    #[serde(default)]
    pub files_base64: BTreeMap<String, String>,
    /// Files to read back after the run (same path rules as `files_base64`), answered in
    /// `FunctionCallResult.files`; one that does not exist is left out.
    #[serde(default)]
    pub fetch_files: Vec<String>,
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
    /// `fetch_files` that existed after the run: path → base64 content.
    #[serde(default)]
    pub files: BTreeMap<String, String>,
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
