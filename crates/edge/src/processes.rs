//! Process handles: API requests → aether `Proc*` requests, aether output → NDJSON
//! [`ProcessEvent`] lines.
//!
//! A process started here belongs to the sandbox, not to the HTTP call: it keeps running when
//! the client goes away, and any client can find it again by pid (or tag) and read its output
//! from an offset. An output stream whose client goes away cancels only the read, never the
//! process. Starts, input and signals are noted in the sandbox's trajectory log.

use std::collections::BTreeMap;

use base64::Engine as _;
use bytes::Bytes;
use dsec_runtime::aether_client::{AetherClient, Call};
use dsec_wire::aether::{Reply, Request, Stream};
use dsec_wire::api::{
    ProcessEvent, ProcessInfo, ProcessInputRequest, ProcessList, SignalProcessRequest,
    StartProcessRequest, DEFAULT_PROCESS_BUFFER, MAX_PROCESS_BUFFER,
};
use futures::stream::BoxStream;
use futures::StreamExt as _;

use crate::commands::{cancel_in_background, text_and_b64};
use crate::error::{EdgeError, Subject};
pub use crate::manager::AgentLease;

/// Longest `wait` a caller may ask for, in seconds (a client waits longer by calling again).
pub const MAX_WAIT_S: f64 = 3600.0;
/// Largest command or argv accepted, in bytes.
const MAX_CMD_BYTES: usize = 256 * 1024;

async fn ask_info(lease: &AgentLease, req: Request, body: Bytes) -> Result<ProcessInfo, EdgeError> {
    match lease.ask(req, body).await? {
        Reply::Proc(info) => Ok(info),
        other => Err(unexpected(&other)),
    }
}

fn note(
    lease: &AgentLease,
    kind: &str,
    request: serde_json::Value,
    result: &Result<ProcessInfo, EdgeError>,
) {
    let value = result
        .as_ref()
        .map(|i| serde_json::to_value(i).unwrap_or_default());
    lease.note_value(kind, request, value);
}

fn unexpected(reply: &Reply) -> EdgeError {
    EdgeError::Internal(format!(
        "sandbox agent answered a process call with {reply:?}"
    ))
}

fn check_env(env: &BTreeMap<String, String>) -> Result<(), EdgeError> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(EdgeError::BadRequest(format!(
                "env: invalid variable {k:?}: names must be non-empty without '=' or NUL, values without NUL"
            )));
        }
    }
    Ok(())
}

/// The argv a start request runs: `argv`, else `/bin/sh -c cmd`.
pub fn start_argv(req: &StartProcessRequest) -> Result<Vec<String>, EdgeError> {
    let argv = match (&req.argv, &req.cmd) {
        (Some(argv), _) => argv.clone(),
        (None, Some(cmd)) => vec!["/bin/sh".into(), "-c".into(), cmd.clone()],
        (None, None) => {
            return Err(EdgeError::BadRequest(
                "give `cmd` (a shell command) or `argv` (a program and its arguments)".into(),
            ))
        }
    };
    if argv.first().is_none_or(|a| a.is_empty()) {
        return Err(EdgeError::BadRequest(
            "argv must name a program in its first element".into(),
        ));
    }
    if argv.iter().map(|a| a.len() + 1).sum::<usize>() > MAX_CMD_BYTES {
        return Err(EdgeError::PayloadTooLarge(format!(
            "the command is above {MAX_CMD_BYTES} bytes: put long scripts in a file and run that"
        )));
    }
    if argv.iter().any(|a| a.contains('\0')) {
        return Err(EdgeError::BadRequest(
            "cmd and argv must not contain NUL bytes".into(),
        ));
    }
    Ok(argv)
}

/// The ring size a start request asks for.
pub fn buffer_bytes(req: &StartProcessRequest) -> Result<u64, EdgeError> {
    match req.buffer_bytes {
        None => Ok(DEFAULT_PROCESS_BUFFER),
        Some(b) if (1..=MAX_PROCESS_BUFFER).contains(&b) => Ok(b),
        Some(b) => Err(EdgeError::BadRequest(format!(
            "buffer_bytes {b} must be between 1 and {MAX_PROCESS_BUFFER}"
        ))),
    }
}

/// Parses a signal given by name (`SIGTERM`, `term`) or number (`15`).
pub fn parse_signal(s: &str) -> Result<i32, EdgeError> {
    const NAMES: &[(&str, i32)] = &[
        ("HUP", libc::SIGHUP),
        ("INT", libc::SIGINT),
        ("QUIT", libc::SIGQUIT),
        ("KILL", libc::SIGKILL),
        ("USR1", libc::SIGUSR1),
        ("USR2", libc::SIGUSR2),
        ("PIPE", libc::SIGPIPE),
        ("ALRM", libc::SIGALRM),
        ("TERM", libc::SIGTERM),
        ("CONT", libc::SIGCONT),
        ("STOP", libc::SIGSTOP),
        ("TSTP", libc::SIGTSTP),
        ("WINCH", libc::SIGWINCH),
    ];
    let t = s.trim();
    if let Ok(n) = t.parse::<i32>() {
        if (1..=64).contains(&n) {
            return Ok(n);
        }
    }
    let up = t.to_ascii_uppercase();
    let name = up.strip_prefix("SIG").unwrap_or(&up);
    NAMES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| *v)
        .ok_or_else(|| {
            EdgeError::BadRequest(format!(
                "signal {s:?} is not known: give a number 1-64 or a name like SIGTERM, SIGINT, SIGKILL"
            ))
        })
}

pub async fn start(lease: &AgentLease, req: StartProcessRequest) -> Result<ProcessInfo, EdgeError> {
    let argv = start_argv(&req)?;
    check_env(&req.env)?;
    if let Some(u) = &req.user {
        // The agent resolves it against the image's /etc/passwd and says when it is unknown.
        if u.is_empty() || u.len() > 64 || u.contains(['\0', ':', '/']) {
            return Err(EdgeError::BadRequest(format!(
                "user {u:?} must be a user name or uid of the image (at most 64 bytes)"
            )));
        }
    }
    if let Some(t) = &req.tag {
        if t.len() > 256 || t.contains('\0') {
            return Err(EdgeError::BadRequest(
                "tag must be at most 256 bytes without NUL".into(),
            ));
        }
    }
    let r = Request::ProcStart {
        argv: argv.clone(),
        env: req.env.clone(),
        cwd: req.cwd.clone(),
        user: req.user.clone(),
        tag: req.tag.clone(),
        stdin: req.stdin,
        buffer_bytes: buffer_bytes(&req)?,
    };
    let result = ask_info(lease, r, Bytes::new()).await;
    let env_keys: Vec<&String> = req.env.keys().collect();
    note(
        lease,
        "process_start",
        serde_json::json!({"argv": argv, "cwd": req.cwd, "user": req.user, "tag": req.tag,
            "stdin": req.stdin, "env_keys": env_keys}),
        &result,
    );
    result
}

pub async fn list(lease: &AgentLease, all: bool) -> Result<ProcessList, EdgeError> {
    match lease.ask(Request::ProcList { all }, Bytes::new()).await? {
        Reply::ProcList(l) => Ok(l),
        other => Err(unexpected(&other)),
    }
}

/// A pid, or the tag of a process (the most recently started one with that tag).
pub async fn resolve(lease: &AgentLease, pid_or_tag: &str) -> Result<i32, EdgeError> {
    if let Ok(pid) = pid_or_tag.parse::<i32>() {
        if pid > 0 {
            return Ok(pid);
        }
    }
    let l = list(lease, true).await?;
    l.processes
        .iter()
        .filter(|p| p.tag.as_deref() == Some(pid_or_tag))
        .max_by_key(|p| (p.running, p.started_ms))
        .map(|p| p.pid)
        .ok_or_else(|| {
            EdgeError::NotFound(format!(
                "no process with pid or tag {pid_or_tag:?} in sandbox {}",
                lease.sandbox
            ))
        })
}

pub async fn wait(lease: &AgentLease, pid: i32, timeout_s: f64) -> Result<ProcessInfo, EdgeError> {
    if !(timeout_s.is_finite() && (0.0..=MAX_WAIT_S).contains(&timeout_s)) {
        return Err(EdgeError::BadRequest(format!(
            "timeout must be between 0 and {MAX_WAIT_S} seconds, got {timeout_s}"
        )));
    }
    let r = Request::ProcWait {
        pid,
        timeout_ms: (timeout_s * 1000.0).ceil() as u64,
    };
    // Dropping this future (the client went away) cancels the wait in the agent.
    let call = lease
        .client
        .call(r, Bytes::new())
        .await
        .map_err(|e| lease.chan(e))?;
    let mut guard = ReadGuard {
        client: lease.client.clone(),
        target: call.id(),
        done: false,
    };
    let got = dsec_runtime::aether_client::collect(call).await;
    guard.done = true;
    match got.map_err(|e| lease.chan(e))?.0 {
        Reply::Proc(info) => Ok(info),
        other => Err(unexpected(&other)),
    }
}

pub async fn input(
    lease: &AgentLease,
    pid: i32,
    req: ProcessInputRequest,
) -> Result<ProcessInfo, EdgeError> {
    let data = match (&req.data_b64, &req.data) {
        (Some(b), _) => base64::engine::general_purpose::STANDARD
            .decode(b)
            .map_err(|e| EdgeError::BadRequest(format!("data_b64 is not valid base64: {e}")))?,
        (None, Some(s)) => s.clone().into_bytes(),
        (None, None) => Vec::new(),
    };
    if data.len() > dsec_wire::aether::MAX_BODY as usize {
        return Err(EdgeError::PayloadTooLarge(format!(
            "stdin data is {} bytes; send at most {} bytes per call",
            data.len(),
            dsec_wire::aether::MAX_BODY
        )));
    }
    let n = data.len();
    let result = ask_info(
        lease,
        Request::ProcInput {
            pid,
            close: req.close,
        },
        Bytes::from(data),
    )
    .await;
    note(
        lease,
        "process_stdin",
        serde_json::json!({"pid": pid, "bytes": n, "close": req.close}),
        &result,
    );
    result
}

pub async fn signal(
    lease: &AgentLease,
    pid: i32,
    req: SignalProcessRequest,
) -> Result<ProcessInfo, EdgeError> {
    let sig = parse_signal(&req.signal)?;
    let result = ask_info(
        lease,
        Request::ProcSignal {
            pid,
            signal: sig,
            group: req.group,
        },
        Bytes::new(),
    )
    .await;
    note(
        lease,
        "process_signal",
        serde_json::json!({"pid": pid, "signal": sig, "group": req.group}),
        &result,
    );
    result
}

/// Cancels the agent-side read when the HTTP client goes away before its end.
struct ReadGuard {
    client: AetherClient,
    target: u64,
    done: bool,
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        if !self.done {
            cancel_in_background(self.client.clone(), self.target);
        }
    }
}

struct OutputState {
    call: Call,
    guard: ReadGuard,
    lease: AgentLease,
    /// The offset the next byte the client gets should have (to report gaps).
    expected: u64,
    finished: bool,
}

/// One NDJSON line (with its trailing newline).
pub fn ndjson_line(event: &ProcessEvent) -> Bytes {
    let mut v = serde_json::to_vec(event).unwrap_or_else(|e| {
        format!("{{\"type\":\"error\",\"error\":{{\"code\":\"internal\",\"message\":\"encode event: {e}\"}}}}")
            .into_bytes()
    });
    v.push(b'\n');
    Bytes::from(v)
}

/// Tracks what a reader has been sent, so that dropped output becomes a `Truncated` event.
pub fn gap(expected: u64, at: u64) -> Option<ProcessEvent> {
    (at > expected).then_some(ProcessEvent::Truncated {
        from: expected,
        to: at,
    })
}

/// Starts reading a process's output from `offset` (following it until it exits when
/// `follow`) and returns the NDJSON lines.
pub async fn output(
    lease: AgentLease,
    pid: i32,
    offset: u64,
    follow: bool,
) -> Result<BoxStream<'static, Bytes>, EdgeError> {
    let call = lease
        .client
        .call(
            Request::ProcRead {
                pid,
                offset,
                follow,
            },
            Bytes::new(),
        )
        .await
        .map_err(|e| lease.chan(e))?;
    let mut st = OutputState {
        guard: ReadGuard {
            client: lease.client.clone(),
            target: call.id(),
            done: false,
        },
        call,
        lease,
        expected: offset,
        finished: false,
    };
    // An unknown pid is an HTTP error, not a stream with an error in it: wait for the first
    // reply before answering.
    let reply = st.call.next().await;
    if let Ok(Some((Reply::Error(e), _))) = reply {
        st.guard.done = true;
        return Err(EdgeError::from_aether(Subject::Other, e));
    }
    let first = to_events(&mut st, reply);
    let head = futures::stream::iter(first.into_iter().map(|e| ndjson_line(&e)));
    let rest = futures::stream::unfold(st, |mut st| async move {
        if st.finished {
            return None;
        }
        let evs = next_events(&mut st).await;
        let bytes: Vec<u8> = evs.iter().flat_map(|e| ndjson_line(e).to_vec()).collect();
        Some((Bytes::from(bytes), st))
    });
    Ok(head.chain(rest).boxed())
}

/// The events for the next reply of a read.
async fn next_events(st: &mut OutputState) -> Vec<ProcessEvent> {
    let reply = st.call.next().await;
    to_events(st, reply)
}

type NextReply = Result<Option<(Reply, Bytes)>, dsec_runtime::aether_client::ChannelError>;

fn to_events(st: &mut OutputState, reply: NextReply) -> Vec<ProcessEvent> {
    let finish = |st: &mut OutputState| {
        st.finished = true;
        st.guard.done = true;
    };
    match reply {
        Ok(Some((Reply::ProcOutput { stream, offset }, body))) => {
            let mut evs: Vec<ProcessEvent> = gap(st.expected, offset).into_iter().collect();
            st.expected = st.expected.max(offset + body.len() as u64);
            let (data, data_b64) = text_and_b64(&body);
            evs.push(match stream {
                Stream::Stderr => ProcessEvent::Stderr {
                    offset,
                    data,
                    data_b64,
                },
                Stream::Stdout | Stream::Tty => ProcessEvent::Stdout {
                    offset,
                    data,
                    data_b64,
                },
            });
            evs
        }
        Ok(Some((Reply::ProcOutputEnd { offset, info }, _))) => {
            finish(st);
            let mut evs: Vec<ProcessEvent> = gap(st.expected, offset).into_iter().collect();
            evs.push(ProcessEvent::End { offset, info });
            evs
        }
        Ok(Some((Reply::Error(e), _))) => {
            finish(st);
            vec![ProcessEvent::Error {
                error: EdgeError::from_aether(Subject::Other, e).detail(),
            }]
        }
        Ok(Some((other, _))) => {
            finish(st);
            vec![ProcessEvent::Error {
                error: unexpected(&other).detail(),
            }]
        }
        Ok(None) => {
            finish(st);
            vec![ProcessEvent::Error {
                error: EdgeError::Internal("the output stream ended without its end".into())
                    .detail(),
            }]
        }
        Err(e) => {
            finish(st);
            vec![ProcessEvent::Error {
                error: st.lease.chan(e).detail(),
            }]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argv_from_cmd_or_argv() {
        let mut r = StartProcessRequest {
            cmd: Some("echo hi".into()),
            ..Default::default()
        };
        assert_eq!(start_argv(&r).unwrap(), vec!["/bin/sh", "-c", "echo hi"]);
        r.argv = Some(vec!["sleep".into(), "1".into()]);
        assert_eq!(start_argv(&r).unwrap(), vec!["sleep", "1"]);
        r.argv = Some(vec![]);
        assert!(matches!(start_argv(&r), Err(EdgeError::BadRequest(_))));
        r.argv = None;
        r.cmd = None;
        assert!(matches!(start_argv(&r), Err(EdgeError::BadRequest(_))));
        r.cmd = Some("a\0b".into());
        assert!(matches!(start_argv(&r), Err(EdgeError::BadRequest(_))));
    }

    #[test]
    fn signals_by_name_or_number() {
        assert_eq!(parse_signal("SIGTERM").unwrap(), libc::SIGTERM);
        assert_eq!(parse_signal("kill").unwrap(), libc::SIGKILL);
        assert_eq!(parse_signal(" 2 ").unwrap(), libc::SIGINT);
        assert!(parse_signal("0").is_err());
        assert!(parse_signal("SIGNOPE").is_err());
    }

    #[test]
    fn buffer_limits() {
        let mut r = StartProcessRequest::default();
        assert_eq!(buffer_bytes(&r).unwrap(), DEFAULT_PROCESS_BUFFER);
        r.buffer_bytes = Some(0);
        assert!(buffer_bytes(&r).is_err());
        r.buffer_bytes = Some(MAX_PROCESS_BUFFER + 1);
        assert!(buffer_bytes(&r).is_err());
    }

    #[test]
    fn gaps_are_reported() {
        assert_eq!(gap(10, 10), None);
        assert_eq!(gap(10, 4), None);
        assert_eq!(
            gap(0, 4096),
            Some(ProcessEvent::Truncated { from: 0, to: 4096 })
        );
    }
}
