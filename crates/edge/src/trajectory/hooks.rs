//! Glue between the manager's calls and the log: request keys, replayed answers, recording a
//! streamed command, and buffering bodies of stepped file calls. Keeps the hooks in
//! `manager.rs` to a few lines each.

use std::sync::{Arc, Mutex};

use base64::Engine as _;
use bytes::Bytes;
use dsec_wire::api::{CommandResult, ExecRequest, RunShellRequest, StreamEvent};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt as _};
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

use super::{now_ms, Answer, Content, Trajectories};
use crate::commands::{ndjson, text_and_b64, CommandReply};
use crate::error::EdgeError;
use crate::files::Download;

/// What makes two shell calls the same step (the SDK compares the same fields).
pub fn shell_key(r: &RunShellRequest) -> Value {
    json!({"cmd": r.cmd, "session": r.session, "cwd": r.cwd, "env": r.env, "stdin": r.stdin})
}

/// What makes two exec calls the same step; `stdin` is the bytes given (base64, `null` if none).
pub fn exec_key(r: &ExecRequest, stdin: &Bytes) -> Value {
    let stdin =
        (!stdin.is_empty()).then(|| base64::engine::general_purpose::STANDARD.encode(stdin));
    json!({"argv": r.argv, "cwd": r.cwd, "env": r.env, "stdin_b64": stdin, "user": r.user})
}

/// A command answer; a replayed one is flagged (HTTP header `x-dsec-replayed: true`), or sent
/// as stream events when the request asked for a stream.
pub fn command_reply(a: Answer<CommandResult>, stream: bool) -> CommandReply {
    if !stream {
        return if a.replayed {
            CommandReply::Replayed(a.value)
        } else {
            CommandReply::Done(a.value)
        };
    }
    let mut r = a.value;
    let mut lines = Vec::new();
    if !r.stdout.is_empty() {
        lines.push(ndjson(&StreamEvent::Stdout {
            data: std::mem::take(&mut r.stdout),
            data_b64: r.stdout_b64.take(),
        }));
    }
    if !r.stderr.is_empty() {
        lines.push(ndjson(&StreamEvent::Stderr {
            data: std::mem::take(&mut r.stderr),
            data_b64: r.stderr_b64.take(),
        }));
    }
    lines.push(ndjson(&StreamEvent::Exit { result: r }));
    CommandReply::Stream(futures::stream::iter(lines).boxed())
}

struct Tee {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    pending: Vec<u8>,
    recorded: bool,
}

/// Records an unstepped streamed command when its `exit` (or `error`) line passes by; output
/// is kept up to `limit` bytes per stream (flagged truncated beyond).
pub fn record_stream(
    traj: &Arc<Trajectories>,
    id: &str,
    kind: &'static str,
    request: Value,
    key: Value,
    lines: BoxStream<'static, Bytes>,
    limit: usize,
) -> BoxStream<'static, Bytes> {
    let Some(log) = traj.get(id) else {
        return lines;
    };
    let start = now_ms();
    let traj = traj.clone();
    let tee = Arc::new(Mutex::new(Tee {
        stdout: Vec::new(),
        stderr: Vec::new(),
        pending: Vec::new(),
        recorded: false,
    }));
    lines
        .map(move |chunk| {
            let mut t = tee.lock().unwrap_or_else(|p| p.into_inner());
            t.pending.extend_from_slice(&chunk);
            while let Some(nl) = t.pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = t.pending.drain(..=nl).collect();
                let Ok(ev) = serde_json::from_slice::<StreamEvent>(&line) else {
                    continue;
                };
                let done: Option<Result<CommandResult, EdgeError>> = match ev {
                    StreamEvent::Stdout { data, data_b64 } => {
                        let b = super::bytes_of(&data, &data_b64);
                        let room = limit.saturating_sub(t.stdout.len());
                        t.stdout.extend_from_slice(&b[..b.len().min(room)]);
                        None
                    }
                    StreamEvent::Stderr { data, data_b64 } => {
                        let b = super::bytes_of(&data, &data_b64);
                        let room = limit.saturating_sub(t.stderr.len());
                        t.stderr.extend_from_slice(&b[..b.len().min(room)]);
                        None
                    }
                    StreamEvent::Exit { mut result } => {
                        (result.stdout, result.stdout_b64) = text_and_b64(&t.stdout);
                        (result.stderr, result.stderr_b64) = text_and_b64(&t.stderr);
                        result.stdout_truncated |=
                            result.stdout_total_bytes > t.stdout.len() as u64;
                        result.stderr_truncated |=
                            result.stderr_total_bytes > t.stderr.len() as u64;
                        Some(Ok(result))
                    }
                    StreamEvent::Error { error } => Some(Err(EdgeError::from_detail(&error))),
                };
                if let (Some(r), false) = (done, t.recorded) {
                    t.recorded = true;
                    let (traj, log, request, key) =
                        (traj.clone(), log.clone(), request.clone(), key.clone());
                    tokio::spawn(async move {
                        traj.record_async(log, None, kind, request, key, start, &r)
                            .await;
                    });
                }
            }
            chunk
        })
        .boxed()
}

/// Reads a whole request body (a stepped upload is hashed before it is run or fast-forwarded).
pub async fn buffer_body<S>(mut body: S, max: u64) -> Result<Bytes, EdgeError>
where
    S: Stream<Item = Result<Bytes, axum::Error>> + Unpin,
{
    let mut buf = bytes::BytesMut::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk
            .map_err(|e| EdgeError::BadRequest(format!("reading the upload body failed: {e}")))?;
        if (buf.len() + chunk.len()) as u64 > max {
            return Err(EdgeError::PayloadTooLarge(format!(
                "a stepped upload is kept in the trajectory log and may be at most {max} bytes; \
                 send larger files without a step"
            )));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// The digest and size of what passed through [`hashing`].
#[derive(Clone, Default)]
pub struct Hashed(Arc<Mutex<(Sha256, u64)>>);

impl Hashed {
    pub fn finish(&self) -> (String, u64) {
        let g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        (hex::encode(g.0.clone().finalize()), g.1)
    }
}

/// Passes an upload body through, hashing it.
pub fn hashing<S>(
    body: S,
) -> (
    impl Stream<Item = Result<Bytes, axum::Error>> + Send + Unpin + 'static,
    Hashed,
)
where
    S: Stream<Item = Result<Bytes, axum::Error>> + Send + Unpin + 'static,
{
    let h = Hashed::default();
    let h2 = h.clone();
    let s = body.map(move |c| {
        if let Ok(b) = &c {
            let mut g = h2.0.lock().unwrap_or_else(|p| p.into_inner());
            g.0.update(b);
            g.1 += b.len() as u64;
        }
        c
    });
    (s, h)
}

/// Reads a download whole (stepped reads record the content).
pub async fn collect_download(d: Download, max: u64) -> Result<Content, EdgeError> {
    let mut body = d.body;
    let mut buf = bytes::BytesMut::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(EdgeError::BodyRead)?;
        if (buf.len() + chunk.len()) as u64 > max {
            return Err(EdgeError::PayloadTooLarge(format!(
                "a stepped read is kept in the trajectory log and may be at most {max} bytes; \
                 read larger files without a step"
            )));
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Content {
        mode: d.mode,
        data: buf.freeze(),
    })
}

/// A recorded or just-read content as a download.
pub fn content_download(c: Content) -> Download {
    let size = c.data.len() as u64;
    Download {
        mode: c.mode,
        size: Some(size),
        body: futures::stream::once(async move { Ok(c.data) }).boxed(),
    }
}

/// Starts the log of a created sandbox and records the create. A log that cannot be started
/// is reported (the sandbox then runs without fast-forward) rather than failing the create.
pub fn begin(
    traj: &Trajectories,
    id: &str,
    req: &dsec_wire::api::CreateSandboxRequest,
    info: &dsec_wire::api::SandboxInfo,
) {
    if let Err(e) = traj.begin(id, req.trajectory) {
        tracing::error!(sandbox = %id, error = %e, "start trajectory log; the sandbox runs unlogged");
        return;
    }
    let mut request = serde_json::to_value(req).unwrap_or(Value::Null);
    if let Some(m) = request.as_object_mut() {
        // Secrets may travel in env; keep names only.
        if let Some(env) = m.get_mut("env").and_then(Value::as_object_mut) {
            for v in env.values_mut() {
                *v = Value::String("<redacted>".into());
            }
        }
    }
    traj.note(
        id,
        "create",
        request,
        Ok(serde_json::to_value(info).unwrap_or(Value::Null)),
    );
}

/// Records how a sandbox ended (`stop` or `died`, with its `end_reason` and `end_detail`) and
/// closes its log.
pub fn end(traj: &Trajectories, info: &dsec_wire::api::SandboxInfo) {
    let kind = if info.state == dsec_wire::api::SandboxState::Failed {
        "died"
    } else {
        "stop"
    };
    traj.note(
        &info.id,
        kind,
        json!({
            "reason": info.reason,
            "end_reason": info.end_reason,
            "end_detail": info.end_detail,
        }),
        Ok(serde_json::to_value(info).unwrap_or(Value::Null)),
    );
    traj.close(&info.id);
}
