//! `dsec exec`: run a command, stream its output live, exit with its exit code.

use std::collections::BTreeMap;
use std::io::{Read, Write};

use anyhow::Context;
use base64::Engine;
use clap::Args;
use dsec_client::Client;
use dsec_wire::api::{CommandResult, ExecRequest, RunShellRequest, StreamEvent};
use futures::StreamExt;

use crate::parse::parse_kv;

#[derive(Args, Debug)]
pub struct ExecArgs {
    /// Sandbox id.
    pub id: String,
    /// Seconds before the command is killed (server default: 60).
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Run the joined words in this persistent shell session (cwd, env, jobs persist).
    #[arg(long, conflicts_with = "no_shell")]
    pub session: Option<String>,
    /// Run the argv directly, without a shell (the default).
    #[arg(long)]
    pub no_shell: bool,
    /// Extra environment for this command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Working directory.
    #[arg(long)]
    pub cwd: Option<String>,
    /// User to run as (argv mode only).
    #[arg(long, short = 'u', conflicts_with = "session")]
    pub user: Option<String>,
    /// Send this process's standard input to the command.
    #[arg(long, short = 'i')]
    pub interactive: bool,
    /// The command and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub cmd: Vec<String>,
}

pub async fn exec(c: &Client, a: ExecArgs) -> anyhow::Result<()> {
    let env: BTreeMap<String, String> = a.env.into_iter().collect();
    let stdin = if a.interactive {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .context("read standard input")?;
        Some(buf)
    } else {
        None
    };
    let mut events = if let Some(session) = a.session {
        let req = RunShellRequest {
            cmd: a.cmd.join(" "),
            session,
            timeout: a.timeout,
            env,
            cwd: a.cwd,
            stdin: stdin.map(|b| String::from_utf8_lossy(&b).into_owned()),
            stream: true,
            ..Default::default()
        };
        c.run_shell_stream(&a.id, &req)
            .await
            .with_context(|| format!("run in {}", a.id))?
    } else {
        let req = ExecRequest {
            argv: a.cmd,
            timeout: a.timeout,
            env,
            cwd: a.cwd,
            stdin_b64: stdin.map(|b| base64::engine::general_purpose::STANDARD.encode(b)),
            user: a.user,
            stream: true,
            ..Default::default()
        };
        c.exec_stream(&a.id, &req)
            .await
            .with_context(|| format!("exec in {}", a.id))?
    };
    let mut out = std::io::stdout();
    let mut err = std::io::stderr();
    while let Some(ev) = events.next().await {
        match ev.context("read command output")? {
            StreamEvent::Stdout { data, data_b64 } => {
                write_chunk(&mut out, &data, data_b64.as_deref())?
            }
            StreamEvent::Stderr { data, data_b64 } => {
                write_chunk(&mut err, &data, data_b64.as_deref())?
            }
            StreamEvent::Exit { result } => {
                let _ = out.flush();
                return Err(crate::ExitCode(exit_code(&result)).into());
            }
            StreamEvent::Error { error } => {
                anyhow::bail!("{} ({})", error.message, error.code);
            }
        }
    }
    anyhow::bail!("the output stream ended without an exit status (connection lost?)")
}

fn write_chunk(w: &mut impl Write, data: &str, b64: Option<&str>) -> anyhow::Result<()> {
    let bytes = match b64.map(|b| base64::engine::general_purpose::STANDARD.decode(b)) {
        Some(Ok(b)) => b,
        _ => data.as_bytes().to_vec(),
    };
    w.write_all(&bytes).context("write output")?;
    w.flush().context("write output")?;
    Ok(())
}

/// Shell conventions: 124 on timeout, 128+N when killed by signal N.
pub fn exit_code(r: &CommandResult) -> i32 {
    if r.timed_out {
        eprintln!(
            "dsec: command timed out after {:.1}s",
            r.duration_ms / 1000.0
        );
        return 124;
    }
    if r.oom_killed {
        eprintln!("dsec: command was killed by the sandbox's memory limit");
    }
    if r.stdout_truncated || r.stderr_truncated {
        eprintln!("dsec: output was truncated (raise max_output_bytes)");
    }
    match r.signal {
        Some(s) if r.exit_code < 0 => 128 + s,
        _ => r.exit_code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes() {
        let mut r = CommandResult {
            exit_code: 3,
            ..Default::default()
        };
        assert_eq!(exit_code(&r), 3);
        r.exit_code = -1;
        r.signal = Some(9);
        assert_eq!(exit_code(&r), 137);
        r.timed_out = true;
        assert_eq!(exit_code(&r), 124);
    }
}
