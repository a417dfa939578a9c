//! `dsec shell ID`: an interactive terminal over the TTY WebSocket.

use std::io::{IsTerminal, Read, Write};

use anyhow::Context;
use clap::Args;
use dsec_client::tokio_tungstenite::tungstenite::Message;
use dsec_client::Client;
use dsec_wire::api::TtyControl;
use futures::{SinkExt, StreamExt};

#[derive(Args, Debug)]
pub struct ShellArgs {
    /// Sandbox id.
    pub id: String,
    /// Session name (default: a fresh terminal session).
    #[arg(long)]
    pub session: Option<String>,
}

/// Puts the terminal in raw mode and restores it when dropped (also on error and panic unwind).
struct RawMode {
    active: bool,
}

impl RawMode {
    fn enter() -> anyhow::Result<RawMode> {
        if !std::io::stdin().is_terminal() {
            return Ok(RawMode { active: false });
        }
        crossterm::terminal::enable_raw_mode().context("put the terminal in raw mode")?;
        Ok(RawMode { active: true })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if self.active {
            let _ = crossterm::terminal::disable_raw_mode();
        }
    }
}

/// The terminal size, 80x24 when unknown (not a terminal, or a pty that reports 0x0).
fn terminal_size() -> (u16, u16) {
    match crossterm::terminal::size() {
        Ok((c, r)) if c > 0 && r > 0 => (c, r),
        _ => (80, 24),
    }
}

pub async fn shell(c: &Client, a: ShellArgs) -> anyhow::Result<()> {
    let (cols, rows) = terminal_size();
    let ws = c
        .tty(&a.id, rows, cols, a.session.as_deref())
        .await
        .with_context(|| format!("open a terminal in {}", a.id))?;
    let (mut tx, mut rx) = ws.split();
    let raw = RawMode::enter()?;

    // Standard input is read on a plain thread (blocking reads), bytes go through a channel.
    let (in_tx, mut in_rx) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin();
        let mut buf = [0u8; 4096];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if in_tx.blocking_send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            }
        }
    });
    let mut winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())
        .context("watch terminal resizes")?;
    let mut stdout = std::io::stdout();
    let mut stdin_open = true;
    let code = loop {
        tokio::select! {
            msg = rx.next() => match msg {
                Some(Ok(Message::Binary(b))) => {
                    stdout.write_all(&b).context("write to the terminal")?;
                    stdout.flush().context("write to the terminal")?;
                }
                Some(Ok(Message::Text(t))) => {
                    if let Ok(TtyControl::Exit { code }) = serde_json::from_str::<TtyControl>(t.as_str()) {
                        break code;
                    }
                }
                Some(Ok(Message::Close(_))) | None => break 0,
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    drop(raw);
                    return Err(anyhow::anyhow!("terminal connection lost: {e}"));
                }
            },
            input = in_rx.recv(), if stdin_open => match input {
                Some(bytes) => {
                    if tx.send(Message::binary(bytes)).await.is_err() {
                        break 0;
                    }
                }
                None => stdin_open = false,
            },
            _ = winch.recv() => {
                {
                    let (cols, rows) = terminal_size();
                    let ctl = serde_json::to_string(&TtyControl::Resize { rows, cols })?;
                    let _ = tx.send(Message::text(ctl)).await;
                }
            }
        }
    };
    let _ = tx.close().await;
    drop(raw);
    if code != 0 {
        return Err(crate::ExitCode(code).into());
    }
    Ok(())
}
