//! TTY: a WebSocket ↔ an aether terminal.
//!
//! Binary frames from the client become `TtyInput` bodies; text frames carry
//! [`TtyControl`] (`resize` → `TtyResize`). `Output{Tty}` replies become binary frames; when
//! the shell exits (`TtyExit`) the client gets a `TtyControl::Exit` text frame and the socket
//! closes. A client that disconnects first cancels the terminal (aether kills its shell).

use axum::extract::ws::{CloseFrame, Message, Utf8Bytes, WebSocket};
use bytes::Bytes;
use dsec_runtime::aether_client::AetherClient;
use dsec_wire::aether::{Reply, Request, Stream};
use dsec_wire::api::TtyControl;

use crate::commands::cancel_in_background;
use crate::error::{EdgeError, Subject};

/// Terminal size given when the client names none.
pub const DEFAULT_ROWS: u16 = 24;
pub const DEFAULT_COLS: u16 = 80;

/// Checks a requested terminal size.
pub fn check_size(rows: u16, cols: u16) -> Result<(), EdgeError> {
    if rows == 0 || cols == 0 || rows > 1000 || cols > 1000 {
        return Err(EdgeError::BadRequest(format!(
            "terminal size {rows}x{cols}: rows and cols must be 1..=1000"
        )));
    }
    Ok(())
}

/// What a text frame from the client asks for.
pub fn parse_control(text: &str) -> Result<TtyControl, BadControlFrame> {
    serde_json::from_str(text).map_err(BadControlFrame)
}

/// A text frame that is not a control message.
#[derive(Debug, thiserror::Error)]
#[error("bad control frame: {0}")]
pub struct BadControlFrame(#[source] serde_json::Error);

/// An open terminal in a sandbox, ready to be bridged to a WebSocket.
pub struct Tty {
    pub client: AetherClient,
    pub sandbox: String,
    pub call: dsec_runtime::aether_client::Call,
}

/// Opens a terminal (the session user's login shell) in the sandbox.
pub async fn open(
    client: AetherClient,
    sandbox: &str,
    rows: u16,
    cols: u16,
) -> Result<Tty, EdgeError> {
    check_size(rows, cols)?;
    let req = Request::TtyOpen {
        rows,
        cols,
        cmd: None,
        env: Default::default(),
    };
    let call = client
        .call(req, Bytes::new())
        .await
        .map_err(|e| EdgeError::from_channel(sandbox, Subject::Other, e))?;
    Ok(Tty {
        client,
        sandbox: sandbox.to_string(),
        call,
    })
}

enum FromSandbox {
    Output(Bytes),
    Exit(i32),
    Failed(String),
}

/// Runs the bridge until either side ends.
pub async fn bridge(mut ws: WebSocket, tty: Tty) {
    let Tty {
        client,
        sandbox,
        mut call,
    } = tty;
    let target = call.id();
    // Pump replies through a channel so the select below only waits on cancel-safe futures.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<FromSandbox>(64);
    let pump = tokio::spawn(async move {
        loop {
            let msg = match call.next().await {
                Ok(Some((
                    Reply::Output {
                        stream: Stream::Tty,
                    },
                    body,
                ))) => FromSandbox::Output(body),
                Ok(Some((Reply::Output { .. }, body))) => FromSandbox::Output(body),
                Ok(Some((Reply::TtyExit { code }, _))) => FromSandbox::Exit(code),
                Ok(Some((Reply::Error(e), _))) => FromSandbox::Failed(e.message),
                Ok(Some((other, _))) if other.is_terminal() => {
                    FromSandbox::Failed(format!("unexpected reply {other:?}"))
                }
                Ok(Some(_)) => continue,
                Ok(None) => FromSandbox::Exit(-1),
                Err(e) => FromSandbox::Failed(e.to_string()),
            };
            let last = !matches!(msg, FromSandbox::Output(_));
            if tx.send(msg).await.is_err() || last {
                break;
            }
        }
    });
    let mut shell_done = false;
    loop {
        tokio::select! {
            from_sandbox = rx.recv() => match from_sandbox {
                Some(FromSandbox::Output(b)) => {
                    if ws.send(Message::Binary(b)).await.is_err() {
                        break;
                    }
                }
                Some(FromSandbox::Exit(code)) => {
                    shell_done = true;
                    let text = serde_json::to_string(&TtyControl::Exit { code }).unwrap_or_default();
                    let _ = ws.send(Message::Text(Utf8Bytes::from(text))).await;
                    let _ = ws.send(Message::Close(Some(CloseFrame { code: 1000, reason: Utf8Bytes::from_static("shell exited") }))).await;
                    break;
                }
                Some(FromSandbox::Failed(why)) => {
                    shell_done = true;
                    tracing::info!(sandbox = %sandbox, error = %why, "tty failed");
                    let reason: String = why.chars().take(120).collect();
                    let _ = ws.send(Message::Close(Some(CloseFrame { code: 1011, reason: Utf8Bytes::from(reason) }))).await;
                    break;
                }
                None => break,
            },
            from_client = ws.recv() => match from_client {
                Some(Ok(Message::Binary(b))) => {
                    // A request of its own; its `Done` is not awaited (dropping the call
                    // discards it), so keystrokes are not delayed by round trips.
                    if client.call(Request::TtyInput { target }, b).await.is_err() {
                        break;
                    }
                }
                Some(Ok(Message::Text(t))) => match parse_control(t.as_str()) {
                    Ok(TtyControl::Resize { rows, cols }) => {
                        if check_size(rows, cols).is_ok()
                            && client.call(Request::TtyResize { target, rows, cols }, Bytes::new()).await.is_err()
                        {
                            break;
                        }
                    }
                    Ok(TtyControl::Exit { .. }) => break,
                    Err(e) => tracing::debug!(sandbox = %sandbox, error = %e, "ignoring tty control frame"),
                },
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => {}
            },
        }
    }
    if !shell_done {
        cancel_in_background(client, target);
    }
    pump.abort();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls() {
        assert!(matches!(
            parse_control(r#"{"type":"resize","rows":40,"cols":100}"#),
            Ok(TtyControl::Resize {
                rows: 40,
                cols: 100
            })
        ));
        assert!(parse_control("{").is_err());
        assert!(check_size(24, 80).is_ok());
        assert!(check_size(0, 80).is_err());
    }
}
