//! `process.Process` onto dsec's process handles (`/v1/sandboxes/{id}/processes...`):
//! Start and Connect stream the handle's output (start, data, end and keep-alive events),
//! List, SendInput, StreamInput, CloseStdin and SendSignal map one to one. PTYs (Start with
//! `pty`, Update) are refused with `unimplemented`: dsec's process handles have none yet.

use std::time::Duration;

use axum::http::Method;
use axum::response::Response;
use base64::Engine as _;
use dsec_e2b_envd::connect::{Code, ConnectError};
use dsec_e2b_envd::pb::process as pb;
use dsec_wire::api::{ProcessEvent, ProcessInfo, ProcessList};
use futures::StreamExt;
use serde_json::json;

use super::native::{q, Native};
use super::rpc::{self, Call, Sink};
use super::Ctx;

/// How often a quiet stream carries a keep-alive event.
const KEEPALIVE: Duration = Duration::from_secs(15);

fn no_pty() -> ConnectError {
    ConnectError::new(
        Code::Unimplemented,
        "PTYs are not supported by dsec's E2B compatibility yet (commands with pty, pty.create, pty.resize); run the command without a PTY or use dsec's own `tty`",
    )
}

/// The native pid-or-tag of a selector.
pub fn selector(s: Option<pb::ProcessSelector>) -> Result<String, ConnectError> {
    match s.and_then(|s| s.selector) {
        Some(pb::process_selector::Selector::Pid(p)) => Ok(p.to_string()),
        Some(pb::process_selector::Selector::Tag(t)) if !t.is_empty() => Ok(t),
        _ => Err(ConnectError::new(
            Code::InvalidArgument,
            "process selector is missing: give a pid or a tag",
        )),
    }
}

/// The E2B exit status text for a native process state.
pub fn end_event(info: &ProcessInfo) -> pb::process_event::EndEvent {
    let (code, status) = match (info.exit_code, info.signal) {
        (_, Some(sig)) => (-1, format!("signal: {}", signal_name(sig))),
        (Some(c), None) => (c, format!("exit status {c}")),
        (None, None) => (-1, "unknown".to_string()),
    };
    pb::process_event::EndEvent {
        exit_code: code,
        exited: info.exit_code.is_some() || info.signal.is_some(),
        status,
        error: None,
    }
}

fn signal_name(sig: i32) -> String {
    match sig {
        9 => "killed".into(),
        15 => "terminated".into(),
        2 => "interrupt".into(),
        1 => "hangup".into(),
        n => format!("signal {n}"),
    }
}

fn event(e: pb::process_event::Event) -> pb::ProcessEvent {
    pb::ProcessEvent { event: Some(e) }
}

/// The data event of one native output event, if it carries output.
pub fn data_event(ev: &ProcessEvent) -> Option<pb::process_event::DataEvent> {
    use pb::process_event::data_event::Output;
    let bytes = |data: &str, b64: &Option<String>| match b64 {
        Some(b) => base64::engine::general_purpose::STANDARD
            .decode(b)
            .unwrap_or_else(|_| data.as_bytes().to_vec()),
        None => data.as_bytes().to_vec(),
    };
    let out = match ev {
        ProcessEvent::Stdout { data, data_b64, .. } => Output::Stdout(bytes(data, data_b64)),
        ProcessEvent::Stderr { data, data_b64, .. } => Output::Stderr(bytes(data, data_b64)),
        _ => return None,
    };
    Some(pb::process_event::DataEvent { output: Some(out) })
}

/// Streams a handle's output from `offset` as E2B events, `wrap` making the response message.
async fn pump<M: dsec_e2b_envd::connect::Msg>(
    native: &Native<'_>,
    pid: i32,
    offset: u64,
    sink: &mut Sink,
    wrap: fn(pb::ProcessEvent) -> M,
) -> Result<(), ConnectError> {
    let mut lines = Box::pin(
        native
            .ndjson::<ProcessEvent>(&format!(
                "/processes/{pid}/output?offset={offset}&follow=true"
            ))
            .await?,
    );
    loop {
        let next = tokio::select! {
            n = lines.next() => n,
            _ = tokio::time::sleep(KEEPALIVE) => {
                let ka = event(pb::process_event::Event::Keepalive(pb::process_event::KeepAlive {}));
                if !sink.send(&wrap(ka)).await {
                    return Ok(());
                }
                continue;
            }
        };
        let Some(ev) = next else {
            return Err(ConnectError::new(
                Code::Unavailable,
                format!("the output of process {pid} ended before it exited"),
            ));
        };
        let ev = ev?;
        if let Some(d) = data_event(&ev) {
            if !sink
                .send(&wrap(event(pb::process_event::Event::Data(d))))
                .await
            {
                return Ok(());
            }
            continue;
        }
        match ev {
            ProcessEvent::End { info, .. } if !info.running => {
                sink.send(&wrap(event(pb::process_event::Event::End(end_event(
                    &info,
                )))))
                .await;
                return Ok(());
            }
            ProcessEvent::End { .. } => {
                return Err(ConnectError::new(
                    Code::Unavailable,
                    format!("the output stream of process {pid} ended while it runs"),
                ))
            }
            ProcessEvent::Error { error } => {
                return Err(ConnectError::new(Code::Unavailable, error.message))
            }
            _ => {}
        }
    }
}

pub async fn start(ctx: Ctx<'_>, mut call: Call) -> Response {
    let req: pb::StartRequest = match call.message().await {
        Ok(r) => r,
        Err(e) => return rpc::error_for(call.kind, &e),
    };
    if req.pty.is_some() {
        return rpc::error_for(call.kind, &no_pty());
    }
    let Some(p) = req.process else {
        return rpc::error_for(
            call.kind,
            &ConnectError::new(Code::InvalidArgument, "process config is missing"),
        );
    };
    if p.cmd.is_empty() {
        return rpc::error_for(
            call.kind,
            &ConnectError::new(Code::InvalidArgument, "process.cmd is empty"),
        );
    }
    let st = ctx.st.clone();
    let id = ctx.id.to_string();
    let user = ctx.user.clone();
    rpc::server_stream(call.codec, call.timeout, move |mut sink| async move {
        let native = Native::new(&st, &id)?;
        let user = super::effective_user(&native, user).await?;
        let cwd = p
            .cwd
            .filter(|c| !c.is_empty())
            .unwrap_or_else(|| super::home(&user));
        let mut argv = vec![p.cmd];
        argv.extend(p.args);
        let body = json!({
            "argv": argv,
            "cwd": cwd,
            "env": p.envs,
            "user": user,
            "tag": req.tag.filter(|t| !t.is_empty()),
            "stdin": req.stdin.unwrap_or(false),
        });
        let info: ProcessInfo = native.json(Method::POST, "/processes", Some(body)).await?;
        let wrap = |e| pb::StartResponse { event: Some(e) };
        let started = event(pb::process_event::Event::Start(
            pb::process_event::StartEvent {
                pid: info.pid as u32,
            },
        ));
        if !sink.send(&wrap(started)).await {
            return Ok(());
        }
        pump(&native, info.pid, 0, &mut sink, wrap).await
    })
}

pub async fn connect(ctx: Ctx<'_>, mut call: Call) -> Response {
    let req: pb::ConnectRequest = match call.message().await {
        Ok(r) => r,
        Err(e) => return rpc::error_for(call.kind, &e),
    };
    let sel = match selector(req.process) {
        Ok(s) => s,
        Err(e) => return rpc::error_for(call.kind, &e),
    };
    let st = ctx.st.clone();
    let id = ctx.id.to_string();
    rpc::server_stream(call.codec, call.timeout, move |mut sink| async move {
        let native = Native::new(&st, &id)?;
        let info: ProcessInfo = native
            .json(Method::GET, &format!("/processes/{}", q(&sel)), None)
            .await?;
        let wrap = |e| pb::ConnectResponse { event: Some(e) };
        let started = event(pb::process_event::Event::Start(
            pb::process_event::StartEvent {
                pid: info.pid as u32,
            },
        ));
        if !sink.send(&wrap(started)).await {
            return Ok(());
        }
        pump(&native, info.pid, info.output_bytes, &mut sink, wrap).await
    })
}

/// A native handle as E2B's `ProcessInfo`.
pub fn info(p: &ProcessInfo) -> pb::ProcessInfo {
    let mut argv = p.argv.iter();
    pb::ProcessInfo {
        config: Some(pb::ProcessConfig {
            cmd: argv.next().cloned().unwrap_or_default(),
            args: argv.cloned().collect(),
            envs: Default::default(),
            cwd: p.cwd.clone(),
        }),
        pid: p.pid as u32,
        tag: p.tag.clone(),
    }
}

pub async fn list(ctx: Ctx<'_>, mut call: Call) -> Response {
    let r = async {
        let _: pb::ListRequest = call.message().await?;
        let native = Native::new(ctx.st, ctx.id)?;
        let l: ProcessList = native.json(Method::GET, "/processes", None).await?;
        Ok(pb::ListResponse {
            processes: l.processes.iter().filter(|p| p.running).map(info).collect(),
        })
    }
    .await;
    rpc::unary(call.codec, r)
}

async fn send_stdin(
    native: &Native<'_>,
    sel: &str,
    input: Option<pb::ProcessInput>,
) -> Result<(), ConnectError> {
    let data = match input.and_then(|i| i.input) {
        Some(pb::process_input::Input::Stdin(b)) => b,
        Some(pb::process_input::Input::Pty(_)) => return Err(no_pty()),
        None => return Ok(()),
    };
    let b64 = base64::engine::general_purpose::STANDARD.encode(data);
    native
        .call(
            Method::POST,
            &format!("/processes/{}/stdin", q(sel)),
            Some(json!({ "data_b64": b64 })),
        )
        .await
}

pub async fn send_input(ctx: Ctx<'_>, mut call: Call) -> Response {
    let r = async {
        let req: pb::SendInputRequest = call.message().await?;
        let sel = selector(req.process)?;
        let native = Native::new(ctx.st, ctx.id)?;
        send_stdin(&native, &sel, req.input).await?;
        Ok(pb::SendInputResponse {})
    }
    .await;
    rpc::unary(call.codec, r)
}

pub async fn stream_input(ctx: Ctx<'_>, mut call: Call) -> Response {
    let codec = call.codec;
    let mut msgs = Box::pin(call.messages::<pb::StreamInputRequest>());
    let r = async {
        let native = Native::new(ctx.st, ctx.id)?;
        let mut sel: Option<String> = None;
        while let Some(m) = msgs.next().await {
            match m?.event {
                Some(pb::stream_input_request::Event::Start(s)) => {
                    sel = Some(selector(s.process)?);
                }
                Some(pb::stream_input_request::Event::Data(d)) => {
                    let Some(sel) = &sel else {
                        return Err(ConnectError::new(
                            Code::FailedPrecondition,
                            "the first message of StreamInput must be `start` with the process",
                        ));
                    };
                    send_stdin(&native, sel, d.input).await?;
                }
                Some(pb::stream_input_request::Event::Keepalive(_)) | None => {}
            }
        }
        Ok(pb::StreamInputResponse {})
    }
    .await;
    rpc::client_stream_answer(codec, r)
}

pub async fn close_stdin(ctx: Ctx<'_>, mut call: Call) -> Response {
    let r = async {
        let req: pb::CloseStdinRequest = call.message().await?;
        let sel = selector(req.process)?;
        let native = Native::new(ctx.st, ctx.id)?;
        native
            .call(
                Method::POST,
                &format!("/processes/{}/stdin", q(&sel)),
                Some(json!({ "close": true })),
            )
            .await?;
        Ok(pb::CloseStdinResponse {})
    }
    .await;
    rpc::unary(call.codec, r)
}

pub async fn send_signal(ctx: Ctx<'_>, mut call: Call) -> Response {
    let r = async {
        let req: pb::SendSignalRequest = call.message().await?;
        let sel = selector(req.process)?;
        let signal = match pb::Signal::try_from(req.signal) {
            Ok(pb::Signal::Sigkill) => "SIGKILL",
            Ok(pb::Signal::Sigterm) => "SIGTERM",
            _ => {
                return Err(ConnectError::new(
                    Code::InvalidArgument,
                    format!("signal {} is not one of SIGTERM, SIGKILL", req.signal),
                ))
            }
        };
        let native = Native::new(ctx.st, ctx.id)?;
        let info: ProcessInfo = native
            .json(Method::GET, &format!("/processes/{}", q(&sel)), None)
            .await?;
        if !info.running {
            return Err(ConnectError::new(
                Code::NotFound,
                format!("process {sel} has already exited"),
            ));
        }
        native
            .call(
                Method::POST,
                &format!("/processes/{}/signal", info.pid),
                Some(json!({ "signal": signal, "group": true })),
            )
            .await?;
        Ok(pb::SendSignalResponse {})
    }
    .await;
    rpc::unary(call.codec, r)
}

pub async fn update(_ctx: Ctx<'_>, mut call: Call) -> Response {
    let r = async {
        let req: pb::UpdateRequest = call.message().await?;
        selector(req.process)?;
        Err::<pb::UpdateResponse, _>(no_pty())
    }
    .await;
    rpc::unary(call.codec, r)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info_of(exit: Option<i32>, signal: Option<i32>) -> ProcessInfo {
        ProcessInfo {
            pid: 7,
            argv: vec![
                "/bin/bash".into(),
                "-l".into(),
                "-c".into(),
                "echo hi".into(),
            ],
            exit_code: exit,
            signal,
            ..Default::default()
        }
    }

    #[test]
    fn end_events_say_how_the_process_ended() {
        let e = end_event(&info_of(Some(3), None));
        assert_eq!(
            (e.exit_code, e.exited, e.status.as_str()),
            (3, true, "exit status 3")
        );
        let e = end_event(&info_of(Some(-1), Some(9)));
        assert_eq!((e.exit_code, e.status.as_str()), (-1, "signal: killed"));
        let i = info(&info_of(None, None));
        let c = i.config.unwrap();
        assert_eq!(c.cmd, "/bin/bash");
        assert_eq!(c.args, ["-l", "-c", "echo hi"]);
    }

    #[test]
    fn selectors_and_output() {
        use pb::process_selector::Selector;
        let s = |x| Some(pb::ProcessSelector { selector: Some(x) });
        assert_eq!(selector(s(Selector::Pid(12))).unwrap(), "12");
        assert_eq!(selector(s(Selector::Tag("web".into()))).unwrap(), "web");
        assert_eq!(selector(None).unwrap_err().code, Code::InvalidArgument);
        let ev = ProcessEvent::Stderr {
            offset: 0,
            data: "\u{fffd}".into(),
            data_b64: Some("/w==".into()),
        };
        let d = data_event(&ev).unwrap();
        assert_eq!(
            d.output,
            Some(pb::process_event::data_event::Output::Stderr(vec![0xff]))
        );
        assert!(data_event(&ProcessEvent::Truncated { from: 0, to: 1 }).is_none());
    }
}
