//! SandboxFusion-compatible code execution (issue 20): `POST /sandboxfusion/{key}/run_code`.
//!
//! RL trainers score rollouts through SandboxFusion's HTTP API, whose clients take only a base
//! URL; so the base URL carries the API key: `http://HOST:7480/sandboxfusion/<API key>`, and
//! the client posts to `…/run_code`. A request is checked field by field (400 naming the
//! field), translated into one native function call (`/v1/functions/call`: the same pools,
//! queue, limits and placement as the native API), and the answer translated back into
//! SandboxFusion's shape: `status` Success / Failed / SandboxError, `message`,
//! `compile_result` / `run_result` (`status` Finished / Error / TimeLimitExceeded,
//! `execution_time` in seconds, `return_code`, `stdout`, `stderr`), `files` fetched back as
//! base64. Fields of our own are added (`queue_ms`, `truncated`, `cpu_time`); SandboxFusion's
//! clients ignore unknown fields.
//!
//! A missing or unknown key answers 401 (counted in `dsec_api_sandboxfusion_unauthorized_total`).
//! A full or saturated pool answers 429 with `Retry-After`, as the native API does.
//! `…/run_jupyter` answers 501: no Jupyter kernel is part of the python toolkit.

use std::collections::BTreeMap;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use dsec_wire::api::{codes, FunctionCallRequest, FunctionCallResult, FunctionStatus, RunResult};
use serde::Serialize;
use serde_json::{Map, Value};

use crate::error::{error_response, ApiError};
use crate::forward::ForwardBody;
use crate::routes::AppState;

/// Largest request body (code plus base64 files).
pub const MAX_BODY: usize = 32 * 1024 * 1024;

/// The route label of the endpoint (never the key itself).
const ROUTE: &str = "/sandboxfusion/{key}/run_code";

/// SandboxFusion's `CommandRunResult`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CommandRunResult {
    /// `Finished` (the program ran and exited), `Error` (it could not be run) or
    /// `TimeLimitExceeded`.
    pub status: &'static str,
    /// Wall-clock seconds.
    pub execution_time: f64,
    /// CPU seconds (our addition).
    pub cpu_time: f64,
    /// Exit status; null when the program was stopped by the time limit or did not run.
    pub return_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// The output exceeded the kept size and was cut (our addition).
    pub truncated: bool,
}

/// SandboxFusion's `RunCodeResponse`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RunCodeResponse {
    /// `Success` (every step finished with status 0), `Failed` or `SandboxError`.
    pub status: &'static str,
    pub message: String,
    pub compile_result: Option<CommandRunResult>,
    pub run_result: Option<CommandRunResult>,
    /// The worker that ran the call.
    pub executor_pod_name: Option<String>,
    /// `fetch_files` that existed after the run: path → base64 content.
    pub files: BTreeMap<String, String>,
    /// Time the call waited for a worker, in ms (our addition).
    pub queue_ms: f64,
}

/// Why a `run_code` body was refused (the message names the field to fix).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct RunCodeRequestError(pub String);

/// A request's fields that shape the answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub call: FunctionCallRequest,
    pub compile_timeout: f64,
}

fn field_err(field: &str, what: &str) -> RunCodeRequestError {
    RunCodeRequestError(format!("field `{field}`: {what}"))
}

fn opt_number(
    o: &Map<String, Value>,
    field: &str,
    default: f64,
) -> Result<f64, RunCodeRequestError> {
    match o.get(field) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Number(n)) => {
            let v = n.as_f64().unwrap_or(f64::NAN);
            if v.is_finite() && v > 0.0 {
                Ok(v)
            } else {
                Err(field_err(field, "must be a number of seconds > 0"))
            }
        }
        Some(_) => Err(field_err(field, "must be a number of seconds")),
    }
}

/// Checks a `run_code` body and translates it into a native function call.
pub fn parse_run_code(body: &[u8]) -> Result<Parsed, RunCodeRequestError> {
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        RunCodeRequestError(format!(
            "the body is not valid JSON ({e}); send a RunCodeRequest object"
        ))
    })?;
    let Value::Object(o) = v else {
        return Err(RunCodeRequestError(
            "the body must be a JSON object (a RunCodeRequest)".into(),
        ));
    };
    let code = match o.get("code") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => return Err(field_err("code", "is required (a string)")),
        Some(_) => return Err(field_err("code", "must be a string")),
    };
    let language = match o.get("language") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        None | Some(Value::Null) => {
            return Err(field_err(
                "language",
                "is required (e.g. \"python\", \"cpp\", \"java\")",
            ))
        }
        Some(_) => return Err(field_err("language", "must be a non-empty string")),
    };
    let stdin = match o.get("stdin") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(field_err("stdin", "must be a string or null")),
    };
    let compile_timeout = opt_number(&o, "compile_timeout", 10.0)?;
    let run_timeout = opt_number(&o, "run_timeout", 10.0)?;
    let mut files_base64 = BTreeMap::new();
    match o.get("files") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) => {
            for (path, content) in m {
                match content {
                    // SandboxFusion allows a null content: no file.
                    Value::Null => {}
                    Value::String(b64) => {
                        files_base64.insert(path.clone(), b64.clone());
                    }
                    _ => {
                        return Err(field_err(
                            &format!("files.{path}"),
                            "must be the file's content in base64 (a string)",
                        ))
                    }
                }
            }
        }
        Some(_) => {
            return Err(field_err(
                "files",
                "must be an object of path → base64 content",
            ))
        }
    }
    let fetch_files = match o.get("fetch_files") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| match x {
                Value::String(s) => Ok(s.clone()),
                _ => Err(field_err(
                    "fetch_files",
                    "must be a list of paths (strings)",
                )),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Some(_) => return Err(field_err("fetch_files", "must be a list of paths")),
    };
    Ok(Parsed {
        call: FunctionCallRequest {
            language,
            code,
            stdin,
            timeout: Some(run_timeout),
            compile_timeout: Some(compile_timeout),
            files_base64,
            fetch_files,
            ..Default::default()
        },
        compile_timeout,
    })
}

fn command(r: &RunResult, timed_out: bool) -> CommandRunResult {
    let (status, return_code) = match r.status {
        _ if timed_out => ("TimeLimitExceeded", None),
        FunctionStatus::SandboxError => ("Error", None),
        _ => ("Finished", Some(r.exit_code)),
    };
    CommandRunResult {
        status,
        execution_time: r.wall_ms / 1000.0,
        cpu_time: r.cpu_ms / 1000.0,
        return_code,
        stdout: r.stdout.clone(),
        stderr: r.stderr.clone(),
        truncated: r.status == FunctionStatus::OutputExceeded,
    }
}

/// Translates a native call's answer into SandboxFusion's.
pub fn to_run_code(r: FunctionCallResult, compile_timeout: f64) -> RunCodeResponse {
    let mut out = RunCodeResponse {
        status: "Success",
        message: String::new(),
        compile_result: None,
        run_result: None,
        executor_pod_name: (!r.worker.is_empty()).then(|| r.worker.clone()),
        files: r.files.clone(),
        queue_ms: r.queue_ms,
    };
    if let Some(c) = &r.compile {
        // A compile step is stopped by its limit with the same status as a failed compile.
        let timed_out = c.status == FunctionStatus::CompileError
            && c.wall_ms.max(c.cpu_ms) >= compile_timeout * 1000.0 * 0.98;
        out.compile_result = Some(command(c, timed_out));
        if c.status != FunctionStatus::Ok {
            out.status = "Failed";
            out.message = if timed_out {
                format!("compilation exceeded compile_timeout ({compile_timeout} s)")
            } else {
                "compilation failed".into()
            };
            return out;
        }
    }
    let run = &r.run;
    out.run_result = Some(command(run, run.status == FunctionStatus::Timeout));
    let (status, message) = match run.status {
        FunctionStatus::Ok => ("Success", String::new()),
        FunctionStatus::RuntimeError => ("Failed", String::new()),
        FunctionStatus::Timeout => ("Failed", "the run exceeded its time limit".into()),
        FunctionStatus::MemoryExceeded => (
            "Failed",
            "the run exceeded its memory limit and was killed".into(),
        ),
        FunctionStatus::OutputExceeded => (
            "Failed",
            format!(
                "the output exceeded the limit and was truncated (stdout {} bytes, stderr {} bytes kept)",
                run.stdout.len(),
                run.stderr.len()
            ),
        ),
        FunctionStatus::CompileError => ("Failed", "compilation failed".into()),
        FunctionStatus::SandboxError => ("SandboxError", run.stderr.clone()),
    };
    out.status = status;
    out.message = message;
    out
}

/// The function-call edge: the least loaded healthy one, as for native calls.
fn function_edge(st: &AppState) -> Result<crate::config::EdgeEndpoint, ApiError> {
    st.forwarder
        .watcher()
        .snapshot()
        .into_iter()
        .filter(|n| n.healthy)
        .min_by(|a, b| crate::placement::load(a).total_cmp(&crate::placement::load(b)))
        .map(|n| n.endpoint)
        .ok_or_else(|| ApiError::NodeUnavailable("no healthy edge to run function calls".into()))
}

async fn check_key(st: &AppState, key: &str) -> Result<(), Response> {
    match st.verifier.verify(Some(key)).await {
        Ok(_) => Ok(()),
        Err(e) => {
            if matches!(e, ApiError::Unauthorized) {
                st.metrics.sandboxfusion_unauthorized.inc();
                return Err(error_response(
                    codes::UNAUTHORIZED,
                    "the API key in the URL is missing or not valid: use \
                     http://HOST:PORT/sandboxfusion/<API key> as the endpoint",
                ));
            }
            Err(e.into_response())
        }
    }
}

/// `POST /sandboxfusion/{key}/run_code`.
pub async fn run_code(State(st): State<AppState>, Path(key): Path<String>, body: Body) -> Response {
    if let Err(r) = check_key(&st, &key).await {
        return r;
    }
    let bytes = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(_) => {
            return error_response(
                codes::PAYLOAD_TOO_LARGE,
                format!("the request body exceeds {MAX_BODY} bytes"),
            )
        }
    };
    let parsed = match parse_run_code(&bytes) {
        Ok(p) => p,
        Err(m) => return error_response(codes::BAD_REQUEST, m.0),
    };
    match forward_call(&st, &parsed).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn forward_call(st: &AppState, parsed: &Parsed) -> Result<Response, ApiError> {
    let edge = function_edge(st)?;
    let json = serde_json::to_vec(&parsed.call)
        .map_err(|e| ApiError::Internal(format!("encode a function call: {e}")))?;
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let resp = st
        .forwarder
        .send(
            &edge,
            Method::POST,
            "/v1/functions/call",
            &headers,
            ForwardBody::Bytes(json.into()),
            ROUTE,
        )
        .await?;
    let status = resp.status();
    let retry_after = resp.headers().get(header::RETRY_AFTER).cloned();
    let bytes = resp.bytes().await.map_err(|e| {
        ApiError::NodeUnavailable(format!(
            "edge: reading a function call's answer failed: {e}"
        ))
    })?;
    if status != reqwest::StatusCode::OK {
        // The edge's error (400 naming what to fix, 429 with its retry hint, ...) unchanged.
        let mut r = Response::new(Body::from(bytes));
        *r.status_mut() = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(v) = retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, v);
        }
        return Ok(r);
    }
    let result: FunctionCallResult = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::Internal(format!("decode the edge's function answer: {e}")))?;
    Ok(axum::Json(to_run_code(result, parsed.compile_timeout)).into_response())
}

/// `POST /sandboxfusion/{key}/run_jupyter`: not offered (no kernel in the python toolkit).
pub async fn run_jupyter(State(st): State<AppState>, Path(key): Path<String>) -> Response {
    if let Err(r) = check_key(&st, &key).await {
        return r;
    }
    let mut r = error_response(
        codes::UNSUPPORTED,
        "run_jupyter is not available on this cluster: the python toolkit has no Jupyter \
         kernel; use run_code (language \"python\")",
    );
    *r.status_mut() = StatusCode::NOT_IMPLEMENTED;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> String {
        parse_run_code(body.as_bytes()).unwrap_err().0
    }

    #[test]
    fn requests_translate_and_bad_fields_are_named() {
        let p = parse_run_code(
            br#"{"code":"print(1)","language":"python","stdin":null,"run_timeout":3,
                 "compile_timeout":5,"files":{"a.txt":"aGk=","gone":null},
                 "fetch_files":["out.txt"],"memory_limit_MB":-1}"#,
        )
        .unwrap();
        assert_eq!(p.call.language, "python");
        assert_eq!(p.call.timeout, Some(3.0));
        assert_eq!(p.call.compile_timeout, Some(5.0));
        assert_eq!(p.call.files_base64.len(), 1);
        assert_eq!(p.call.files_base64["a.txt"], "aGk=");
        assert_eq!(p.call.fetch_files, vec!["out.txt".to_string()]);
        assert!(err(r#"{"language":"python"}"#).contains("`code`"));
        assert!(err(r#"{"code":"x"}"#).contains("`language`"));
        assert!(err(r#"{"code":1,"language":"python"}"#).contains("`code`"));
        assert!(
            err(r#"{"code":"","language":"python","run_timeout":"x"}"#).contains("`run_timeout`")
        );
        assert!(err(r#"{"code":"","language":"python","run_timeout":0}"#).contains("`run_timeout`"));
        assert!(err(r#"{"code":"","language":"python","files":{"a":1}}"#).contains("`files.a`"));
        assert!(
            err(r#"{"code":"","language":"python","fetch_files":"a"}"#).contains("`fetch_files`")
        );
        assert!(err(r#"{"code":"","language":"python","stdin":3}"#).contains("`stdin`"));
        assert!(err("[1]").contains("JSON object"));
        assert!(err("{").contains("not valid JSON"));
    }

    fn run(status: FunctionStatus, exit: i32) -> RunResult {
        RunResult {
            status,
            exit_code: exit,
            stdout: "out".into(),
            wall_ms: 1500.0,
            ..Default::default()
        }
    }

    #[test]
    fn answers_use_sandboxfusion_statuses() {
        let ok = to_run_code(
            FunctionCallResult {
                run: run(FunctionStatus::Ok, 0),
                worker: "sb-1".into(),
                ..Default::default()
            },
            10.0,
        );
        assert_eq!(ok.status, "Success");
        let rr = ok.run_result.unwrap();
        assert_eq!((rr.status, rr.return_code), ("Finished", Some(0)));
        assert_eq!(rr.execution_time, 1.5);
        assert!(ok.compile_result.is_none());
        assert_eq!(ok.executor_pod_name.as_deref(), Some("sb-1"));

        let failed = to_run_code(
            FunctionCallResult {
                run: run(FunctionStatus::RuntimeError, 1),
                ..Default::default()
            },
            10.0,
        );
        assert_eq!(failed.status, "Failed");
        assert_eq!(failed.run_result.unwrap().return_code, Some(1));

        let tle = to_run_code(
            FunctionCallResult {
                run: run(FunctionStatus::Timeout, 137),
                ..Default::default()
            },
            10.0,
        );
        let rr = tle.run_result.unwrap();
        assert_eq!(
            (tle.status, rr.status, rr.return_code),
            ("Failed", "TimeLimitExceeded", None)
        );

        let ce = run(FunctionStatus::CompileError, 1);
        let compile_failed = to_run_code(
            FunctionCallResult {
                run: ce.clone(),
                compile: Some(ce),
                ..Default::default()
            },
            10.0,
        );
        assert_eq!(compile_failed.status, "Failed");
        assert!(compile_failed.run_result.is_none());
        let c = compile_failed.compile_result.unwrap();
        assert_eq!((c.status, c.return_code), ("Finished", Some(1)));

        let mut slow = run(FunctionStatus::CompileError, 137);
        slow.wall_ms = 2000.0;
        let compile_tle = to_run_code(
            FunctionCallResult {
                run: slow.clone(),
                compile: Some(slow),
                ..Default::default()
            },
            2.0,
        );
        assert_eq!(
            compile_tle.compile_result.unwrap().status,
            "TimeLimitExceeded"
        );

        let big = to_run_code(
            FunctionCallResult {
                run: run(FunctionStatus::OutputExceeded, 153),
                ..Default::default()
            },
            10.0,
        );
        assert!(big.run_result.unwrap().truncated);
        assert!(big.message.contains("truncated"));

        let broken = to_run_code(
            FunctionCallResult {
                run: run(FunctionStatus::SandboxError, -1),
                ..Default::default()
            },
            10.0,
        );
        assert_eq!(broken.status, "SandboxError");
        assert_eq!(broken.run_result.unwrap().status, "Error");
    }
}
