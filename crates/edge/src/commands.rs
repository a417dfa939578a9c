//! Shell and exec: API requests → aether `RunShell`/`Exec`, aether output → [`CommandResult`]
//! or a stream of NDJSON [`StreamEvent`] lines.
//!
//! A streamed command whose HTTP client goes away is cancelled: dropping the stream sends
//! `Request::Cancel` for the call, and aether kills the command's processes.

use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use dsec_runtime::aether_client::{AetherClient, Call, CommandOutput};
use dsec_wire::aether::{CommandOutcome, Reply, Request, Stream};
use dsec_wire::api::{limits, CommandResult, ExecRequest, RunShellRequest, StreamEvent};
use futures::stream::BoxStream;
use futures::StreamExt as _;

use crate::error::{EdgeError, Subject};
use crate::names::validate_user;

/// What a shell/exec call answers: one result, or a stream of NDJSON lines.
pub enum CommandReply {
    Done(CommandResult),
    /// A result answered from the trajectory log (the step had already run).
    Replayed(CommandResult),
    Stream(BoxStream<'static, Bytes>),
}

/// Limits that apply to every command.
#[derive(Debug, Clone, Copy)]
pub struct CommandDefaults {
    pub default_timeout_s: f64,
    pub max_timeout_s: f64,
}

/// Grace the edge gives aether beyond a command's own timeout before giving up on it.
pub const AGENT_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// The timeout in milliseconds of a translated `RunShell`/`Exec` request.
pub fn request_timeout_ms(r: &Request) -> u64 {
    match r {
        Request::RunShell { timeout_ms, .. } | Request::Exec { timeout_ms, .. } => *timeout_ms,
        _ => 0,
    }
}

fn timeout_ms(t: Option<f64>, d: CommandDefaults) -> Result<u64, EdgeError> {
    let s = t.unwrap_or(d.default_timeout_s);
    if !(s.is_finite() && s > 0.0) {
        return Err(EdgeError::BadRequest(format!(
            "timeout must be a positive number of seconds, got {s}"
        )));
    }
    if s > d.max_timeout_s {
        return Err(EdgeError::BadRequest(format!(
            "timeout {s}s is above this node's maximum of {}s",
            d.max_timeout_s
        )));
    }
    Ok((s * 1000.0).ceil() as u64)
}

fn max_output(m: Option<u64>) -> u64 {
    m.unwrap_or(limits::DEFAULT_MAX_OUTPUT)
        .min(limits::MAX_MAX_OUTPUT)
}

fn check_env(env: &std::collections::BTreeMap<String, String>) -> Result<(), EdgeError> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(EdgeError::BadRequest(format!(
                "env: invalid variable {k:?}: names must be non-empty without '=' or NUL, values without NUL"
            )));
        }
    }
    Ok(())
}

/// True for a session name: `[A-Za-z0-9._-]{1,64}`.
pub fn is_valid_session(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Translates a shell request; the body is the stdin bytes.
pub fn shell_request(
    req: &RunShellRequest,
    d: CommandDefaults,
) -> Result<(Request, Bytes), EdgeError> {
    if req.cmd.len() > limits::MAX_CMD_BYTES {
        return Err(EdgeError::PayloadTooLarge(format!(
            "cmd is {} bytes; the limit is {} bytes: put long scripts in a file (PUT /files) and run that",
            req.cmd.len(),
            limits::MAX_CMD_BYTES
        )));
    }
    if req.cmd.contains('\0') {
        return Err(EdgeError::BadRequest(
            "cmd must not contain NUL bytes".into(),
        ));
    }
    if !is_valid_session(&req.session) {
        return Err(EdgeError::BadRequest(format!(
            "session {:?} must match [A-Za-z0-9._-]{{1,64}}",
            req.session
        )));
    }
    check_env(&req.env)?;
    let r = Request::RunShell {
        session: req.session.clone(),
        cmd: req.cmd.clone(),
        timeout_ms: timeout_ms(req.timeout, d)?,
        env: req.env.clone(),
        cwd: req.cwd.clone(),
        max_output: max_output(req.max_output_bytes),
        stream: req.stream,
    };
    let stdin = Bytes::from(req.stdin.clone().unwrap_or_default().into_bytes());
    Ok((r, stdin))
}

/// Translates an exec request; the body is the stdin bytes (`stdin_b64` wins over `stdin`).
pub fn exec_request(req: &ExecRequest, d: CommandDefaults) -> Result<(Request, Bytes), EdgeError> {
    match req.argv.first() {
        None => {
            return Err(EdgeError::BadRequest(
                "argv is empty: give at least the program to run".into(),
            ))
        }
        Some(p) if p.is_empty() => return Err(EdgeError::BadRequest("argv[0] is empty".into())),
        _ => {}
    }
    let total: usize = req.argv.iter().map(|a| a.len()).sum();
    if total > limits::MAX_CMD_BYTES {
        return Err(EdgeError::PayloadTooLarge(format!(
            "argv is {total} bytes; the limit is {} bytes",
            limits::MAX_CMD_BYTES
        )));
    }
    if req.argv.iter().any(|a| a.contains('\0')) {
        return Err(EdgeError::BadRequest(
            "argv must not contain NUL bytes".into(),
        ));
    }
    check_env(&req.env)?;
    if let Some(u) = &req.user {
        validate_user("user", u)?;
    }
    let stdin = match (&req.stdin_b64, &req.stdin) {
        (Some(b), _) => Bytes::from(
            base64::engine::general_purpose::STANDARD
                .decode(b)
                .map_err(|e| {
                    EdgeError::BadRequest(format!("stdin_b64 is not valid base64: {e}"))
                })?,
        ),
        (None, Some(s)) => Bytes::from(s.clone().into_bytes()),
        (None, None) => Bytes::new(),
    };
    let r = Request::Exec {
        argv: req.argv.clone(),
        timeout_ms: timeout_ms(req.timeout, d)?,
        env: req.env.clone(),
        cwd: req.cwd.clone(),
        user: req.user.clone(),
        max_output: max_output(req.max_output_bytes),
        stream: req.stream,
    };
    Ok((r, stdin))
}

/// Output bytes as lossy UTF-8 plus base64 of the exact bytes when they are not UTF-8.
pub use dsec_trajectory::text_and_b64;

/// The result of a finished command; output is empty when it was streamed.
pub fn command_result(
    outcome: &CommandOutcome,
    stdout: &[u8],
    stderr: &[u8],
    oom_killed: bool,
) -> CommandResult {
    let (stdout_s, stdout_b64) = text_and_b64(stdout);
    let (stderr_s, stderr_b64) = text_and_b64(stderr);
    CommandResult {
        exit_code: outcome.exit_code,
        signal: outcome.signal,
        stdout: stdout_s,
        stderr: stderr_s,
        stdout_b64,
        stderr_b64,
        stdout_truncated: outcome.stdout_truncated,
        stderr_truncated: outcome.stderr_truncated,
        stdout_total_bytes: outcome.stdout_total,
        stderr_total_bytes: outcome.stderr_total,
        timed_out: outcome.timed_out,
        oom_killed,
        duration_ms: outcome.duration_ms,
        session_restarted: outcome.session_restarted,
    }
}

/// The result of a non-streamed command.
pub fn output_result(out: &CommandOutput, oom_killed: bool) -> CommandResult {
    command_result(&out.outcome, &out.stdout, &out.stderr, oom_killed)
}

/// One NDJSON line (with its trailing newline).
pub fn ndjson(event: &StreamEvent) -> Bytes {
    let mut v = serde_json::to_vec(event).unwrap_or_else(|e| {
        format!("{{\"type\":\"error\",\"error\":{{\"code\":\"internal\",\"message\":\"encode event: {e}\"}}}}")
            .into_bytes()
    });
    v.push(b'\n');
    Bytes::from(v)
}

/// The stream event for an output chunk (`None` for TTY output, which commands never send).
pub fn output_event(stream: Stream, bytes: &[u8]) -> Option<StreamEvent> {
    let (data, data_b64) = text_and_b64(bytes);
    match stream {
        Stream::Stdout => Some(StreamEvent::Stdout { data, data_b64 }),
        Stream::Stderr => Some(StreamEvent::Stderr { data, data_b64 }),
        Stream::Tty => None,
    }
}

/// Sends `Cancel` for call `target` in the background (used when a client goes away).
pub fn cancel_in_background(client: AetherClient, target: u64) {
    if client.is_closed() {
        return;
    }
    tokio::spawn(async move {
        let fut = client.request(Request::Cancel { target }, Bytes::new());
        match tokio::time::timeout(std::time::Duration::from_secs(10), fut).await {
            Ok(Ok(_)) => tracing::debug!(target, "cancelled call"),
            Ok(Err(e)) => tracing::debug!(target, error = %e, "cancel call"),
            Err(_) => tracing::warn!(target, "cancel call: no answer within 10s"),
        }
    });
}

/// Cancels the call when dropped before `done` was set.
struct CancelGuard {
    client: AetherClient,
    target: u64,
    done: bool,
}

impl CancelGuard {
    fn disarm(&mut self) {
        self.done = true;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.done {
            tracing::info!(
                call = self.target,
                "client went away mid-stream; cancelling the command"
            );
            cancel_in_background(self.client.clone(), self.target);
        }
    }
}

/// Waits for a non-streamed command's result; dropping the future (or passing `deadline`)
/// cancels the command.
pub async fn collect_call(
    client: AetherClient,
    call: Call,
    sandbox: &str,
    deadline: std::time::Duration,
) -> Result<CommandOutput, EdgeError> {
    let mut guard = CancelGuard {
        client,
        target: call.id(),
        done: false,
    };
    // aether enforces the command's timeout; this only guards against an agent that hangs.
    let collected = tokio::time::timeout(deadline, dsec_runtime::aether_client::collect(call))
        .await
        .map_err(|_| {
            EdgeError::Internal(format!(
                "sandbox {sandbox}: its agent did not finish the command within {}s; cancelled it",
                deadline.as_secs()
            ))
        })?;
    guard.disarm();
    let (reply, body) =
        collected.map_err(|e| EdgeError::from_channel(sandbox, Subject::Other, e))?;
    match reply {
        Reply::CommandDone(outcome) => split_output(outcome, body),
        other => Err(EdgeError::Internal(format!(
            "sandbox agent answered a command with {other:?}"
        ))),
    }
}

/// Splits a `CommandDone` body into kept stdout and stderr.
pub fn split_output(outcome: CommandOutcome, body: Bytes) -> Result<CommandOutput, EdgeError> {
    let (o, e) = (outcome.stdout_len as usize, outcome.stderr_len as usize);
    if o.checked_add(e) != Some(body.len()) {
        return Err(EdgeError::Internal(format!(
            "sandbox agent sent {} output bytes but announced {o} + {e}",
            body.len()
        )));
    }
    let stdout = body.slice(..o);
    let stderr = body.slice(o..);
    Ok(CommandOutput {
        outcome,
        stdout,
        stderr,
    })
}

/// Reads the OOM-kill counter of the sandbox (before/after a command).
pub type OomProbe = Arc<dyn Fn() -> u64 + Send + Sync>;

struct StreamState {
    call: Call,
    guard: CancelGuard,
    sandbox: String,
    oom: OomProbe,
    oom_before: u64,
    finished: bool,
}

/// Turns a started streaming call into NDJSON lines: output events as they arrive, then `Exit`
/// (or `Error`). Dropping the stream early cancels the command.
pub fn stream_call(
    client: AetherClient,
    call: Call,
    sandbox: String,
    oom: OomProbe,
    oom_before: u64,
) -> BoxStream<'static, Bytes> {
    let target = call.id();
    let state = StreamState {
        call,
        guard: CancelGuard {
            client,
            target,
            done: false,
        },
        sandbox,
        oom,
        oom_before,
        finished: false,
    };
    futures::stream::unfold(state, |mut st| async move {
        loop {
            if st.finished {
                return None;
            }
            let event = match st.call.next().await {
                Ok(Some((Reply::Output { stream }, body))) => match output_event(stream, &body) {
                    Some(ev) => ev,
                    None => continue,
                },
                Ok(Some((Reply::CommandDone(outcome), _kept))) => {
                    st.finished = true;
                    st.guard.done = true;
                    let oom = (st.oom)() > st.oom_before;
                    StreamEvent::Exit {
                        result: command_result(&outcome, b"", b"", oom),
                    }
                }
                Ok(Some((Reply::Error(e), _))) => {
                    st.finished = true;
                    st.guard.done = true;
                    StreamEvent::Error {
                        error: EdgeError::from_aether(Subject::Other, e).detail(),
                    }
                }
                Ok(Some((other, _))) => {
                    if other.is_terminal() {
                        st.finished = true;
                        st.guard.done = true;
                        StreamEvent::Error {
                            error: EdgeError::Internal(format!(
                                "sandbox agent answered a command with {other:?}"
                            ))
                            .detail(),
                        }
                    } else {
                        continue;
                    }
                }
                Ok(None) => {
                    st.finished = true;
                    st.guard.done = true;
                    StreamEvent::Error {
                        error: EdgeError::Internal("the command ended without a result".into())
                            .detail(),
                    }
                }
                Err(e) => {
                    st.finished = true;
                    st.guard.done = true;
                    StreamEvent::Error {
                        error: EdgeError::from_channel(&st.sandbox, Subject::Other, e).detail(),
                    }
                }
            };
            return Some((ndjson(&event), st));
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: CommandDefaults = CommandDefaults {
        default_timeout_s: 60.0,
        max_timeout_s: 3600.0,
    };

    #[test]
    fn shell_defaults_and_clamps() {
        let req = RunShellRequest {
            cmd: "echo hi".into(),
            session: "default".into(),
            max_output_bytes: Some(u64::MAX),
            stdin: Some("in".into()),
            ..Default::default()
        };
        let (r, body) = shell_request(&req, D).unwrap();
        match r {
            Request::RunShell {
                timeout_ms,
                max_output,
                session,
                ..
            } => {
                assert_eq!(timeout_ms, 60_000);
                assert_eq!(max_output, limits::MAX_MAX_OUTPUT);
                assert_eq!(session, "default");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(&body[..], b"in");
    }

    #[test]
    fn shell_rejections() {
        let big = RunShellRequest {
            cmd: "x".repeat(limits::MAX_CMD_BYTES + 1),
            session: "s".into(),
            ..Default::default()
        };
        let e = shell_request(&big, D).unwrap_err();
        assert_eq!(e.status().as_u16(), 413);
        assert!(e.to_string().contains(&limits::MAX_CMD_BYTES.to_string()));
        let bad_session = RunShellRequest {
            cmd: "true".into(),
            session: "../x".into(),
            ..Default::default()
        };
        assert_eq!(
            shell_request(&bad_session, D)
                .unwrap_err()
                .status()
                .as_u16(),
            400
        );
        let bad_timeout = RunShellRequest {
            cmd: "true".into(),
            session: "s".into(),
            timeout: Some(-1.0),
            ..Default::default()
        };
        assert_eq!(
            shell_request(&bad_timeout, D)
                .unwrap_err()
                .status()
                .as_u16(),
            400
        );
        let long = RunShellRequest {
            cmd: "true".into(),
            session: "s".into(),
            timeout: Some(1e9),
            ..Default::default()
        };
        assert!(shell_request(&long, D)
            .unwrap_err()
            .to_string()
            .contains("maximum"));
    }

    #[test]
    fn exec_translation() {
        let e = exec_request(&ExecRequest::default(), D).unwrap_err();
        assert_eq!(e.status().as_u16(), 400);
        let req = ExecRequest {
            argv: vec!["cat".into()],
            stdin: Some("ignored".into()),
            stdin_b64: Some("/wA=".into()),
            timeout: Some(1.5),
            ..Default::default()
        };
        let (r, body) = exec_request(&req, D).unwrap();
        assert_eq!(&body[..], &[0xff, 0x00]);
        assert!(matches!(
            r,
            Request::Exec {
                timeout_ms: 1500,
                ..
            }
        ));
        let bad = ExecRequest {
            argv: vec!["x".into()],
            stdin_b64: Some("!!".into()),
            ..Default::default()
        };
        assert!(exec_request(&bad, D)
            .unwrap_err()
            .to_string()
            .contains("base64"));
        let bad_user = ExecRequest {
            argv: vec!["x".into()],
            user: Some("a b".into()),
            ..Default::default()
        };
        assert_eq!(
            exec_request(&bad_user, D).unwrap_err().status().as_u16(),
            400
        );
    }

    #[test]
    fn output_conversion() {
        let outcome = CommandOutcome {
            exit_code: 3,
            stdout_total: 3,
            stdout_len: 3,
            ..Default::default()
        };
        let r = command_result(&outcome, b"ok\n", &[0xff, 0xfe], true);
        assert_eq!(r.exit_code, 3);
        assert_eq!(r.stdout, "ok\n");
        assert_eq!(r.stdout_b64, None);
        assert_eq!(r.stderr, "\u{fffd}\u{fffd}");
        assert_eq!(r.stderr_b64.as_deref(), Some("//4="));
        assert!(r.oom_killed);
        let json = serde_json::to_value(&r).unwrap();
        assert!(json.get("stdout_b64").is_none());
    }

    #[test]
    fn output_split() {
        let outcome = CommandOutcome {
            stdout_len: 2,
            stderr_len: 1,
            ..Default::default()
        };
        let out = split_output(outcome.clone(), Bytes::from_static(b"abc")).unwrap();
        assert_eq!(&out.stdout[..], b"ab");
        assert_eq!(&out.stderr[..], b"c");
        assert!(split_output(outcome, Bytes::from_static(b"abcd")).is_err());
    }

    #[test]
    fn events() {
        let ev = output_event(Stream::Stdout, b"hi").unwrap();
        let line = ndjson(&ev);
        assert_eq!(&line[..], b"{\"type\":\"stdout\",\"data\":\"hi\"}\n");
        assert!(output_event(Stream::Tty, b"x").is_none());
        let ev = output_event(Stream::Stderr, &[0x80]).unwrap();
        assert!(matches!(
            ev,
            StreamEvent::Stderr {
                data_b64: Some(_),
                ..
            }
        ));
    }
}
