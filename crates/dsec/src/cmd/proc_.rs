//! `dsec proc start|ls|logs|wait|kill|signal|stdin`: process handles in a sandbox.

use anyhow::Context;
use clap::{Args, Subcommand};
use dsec_client::Client;
use dsec_wire::api::{
    ProcessEvent, ProcessInputRequest, SignalProcessRequest, StartProcessRequest,
};
use futures::StreamExt as _;

#[derive(Subcommand, Debug)]
pub enum ProcCommand {
    /// Start CMD (a shell command line) in the background; prints its pid.
    Start(StartArgs),
    /// List the sandbox's process handles.
    Ls(LsArgs),
    /// Print a process's output from --offset; --follow streams until it exits.
    Logs(LogsArgs),
    /// Wait for a process to exit; exits with its exit code.
    Wait(TargetArgs),
    /// SIGKILL a process's whole process group.
    Kill(TargetArgs),
    /// Send a signal (name or number) to a process's group.
    Signal(SignalArgs),
    /// Send this command's stdin to a process's stdin, then close it.
    Stdin(TargetArgs),
}

#[derive(Args, Debug)]
pub struct StartArgs {
    pub sandbox: String,
    /// The shell command line.
    pub cmd: String,
    #[arg(long)]
    pub tag: Option<String>,
    #[arg(long)]
    pub cwd: Option<String>,
    #[arg(long)]
    pub user: Option<String>,
    /// Keep stdin open (for `dsec proc stdin`).
    #[arg(long)]
    pub stdin: bool,
    /// KEY=VALUE, repeatable.
    #[arg(long = "env", short = 'e')]
    pub env: Vec<String>,
}

#[derive(Args, Debug)]
pub struct LsArgs {
    pub sandbox: String,
    /// Also exited processes whose output is still kept.
    #[arg(long)]
    pub all: bool,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct LogsArgs {
    pub sandbox: String,
    /// Pid or tag.
    pub process: String,
    #[arg(long, default_value_t = 0)]
    pub offset: u64,
    #[arg(long, short = 'f')]
    pub follow: bool,
}

#[derive(Args, Debug)]
pub struct TargetArgs {
    pub sandbox: String,
    /// Pid or tag.
    pub process: String,
}

#[derive(Args, Debug)]
pub struct SignalArgs {
    pub sandbox: String,
    /// Pid or tag.
    pub process: String,
    /// SIGTERM, INT, 9, ...
    pub signal: String,
}

pub async fn run(c: &Client, cmd: ProcCommand) -> anyhow::Result<()> {
    match cmd {
        ProcCommand::Start(a) => {
            let mut env = std::collections::BTreeMap::new();
            for kv in &a.env {
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| crate::UsageError(format!("--env {kv:?} must be KEY=VALUE")))?;
                env.insert(k.to_string(), v.to_string());
            }
            let req = StartProcessRequest {
                cmd: Some(a.cmd),
                cwd: a.cwd,
                env,
                user: a.user,
                tag: a.tag,
                stdin: a.stdin,
                ..Default::default()
            };
            let info = c
                .start_process(&a.sandbox, &req)
                .await
                .context("start process")?;
            println!("{}", info.pid);
            Ok(())
        }
        ProcCommand::Ls(a) => {
            let list = c
                .processes(&a.sandbox, a.all)
                .await
                .context("list processes")?;
            if a.json {
                return super::print_json(&list);
            }
            let rows: Vec<Vec<String>> = list
                .processes
                .iter()
                .map(|p| {
                    vec![
                        p.pid.to_string(),
                        p.tag.clone().unwrap_or_default(),
                        match (p.running, p.exit_code, p.signal) {
                            (true, _, _) => "running".into(),
                            (false, _, Some(s)) => format!("signal {s}"),
                            (false, c, None) => format!("exit {}", c.unwrap_or(-1)),
                        },
                        p.output_bytes.to_string(),
                        p.argv.join(" "),
                    ]
                })
                .collect();
            print!(
                "{}",
                crate::table::render(&["PID", "TAG", "STATE", "OUTPUT", "CMD"], &rows)
            );
            Ok(())
        }
        ProcCommand::Logs(a) => {
            let mut events = c
                .process_output(&a.sandbox, &a.process, a.offset, a.follow)
                .await
                .context("read process output")?;
            while let Some(ev) = events.next().await {
                match ev? {
                    ProcessEvent::Stdout { data, data_b64, .. } => {
                        write_out(&mut std::io::stdout(), &data, data_b64.as_deref())?
                    }
                    ProcessEvent::Stderr { data, data_b64, .. } => {
                        write_out(&mut std::io::stderr(), &data, data_b64.as_deref())?
                    }
                    ProcessEvent::Truncated { from, to } => {
                        eprintln!("dsec: output {from}..{to} was dropped from the buffer");
                    }
                    ProcessEvent::End { offset, info } => {
                        if !info.running {
                            eprintln!(
                                "dsec: exited {} (resume at offset {offset})",
                                info.signal
                                    .map(|s| format!("by signal {s}"))
                                    .unwrap_or_else(|| info.exit_code.unwrap_or(-1).to_string())
                            );
                        }
                    }
                    ProcessEvent::Error { error } => {
                        anyhow::bail!("{}: {}", error.code, error.message)
                    }
                }
            }
            Ok(())
        }
        ProcCommand::Wait(a) => loop {
            let info = c
                .wait_process(&a.sandbox, &a.process, 60.0)
                .await
                .context("wait for process")?;
            if !info.running {
                let code = info
                    .signal
                    .map(|s| 128 + s)
                    .unwrap_or_else(|| info.exit_code.unwrap_or(1));
                return Err(crate::ExitCode(code).into());
            }
        },
        ProcCommand::Kill(a) => {
            c.kill_process(&a.sandbox, &a.process)
                .await
                .context("kill process")?;
            Ok(())
        }
        ProcCommand::Signal(a) => {
            let req = SignalProcessRequest {
                signal: a.signal,
                group: true,
            };
            c.signal_process(&a.sandbox, &a.process, &req)
                .await
                .context("signal process")?;
            Ok(())
        }
        ProcCommand::Stdin(a) => {
            use base64::Engine as _;
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut data).context("read stdin")?;
            let req = ProcessInputRequest {
                data: None,
                data_b64: Some(base64::engine::general_purpose::STANDARD.encode(&data)),
                close: true,
            };
            c.process_stdin(&a.sandbox, &a.process, &req)
                .await
                .context("send stdin")?;
            Ok(())
        }
    }
}

fn write_out(w: &mut dyn std::io::Write, data: &str, b64: Option<&str>) -> anyhow::Result<()> {
    use base64::Engine as _;
    match b64 {
        Some(b) => w.write_all(&base64::engine::general_purpose::STANDARD.decode(b)?)?,
        None => w.write_all(data.as_bytes())?,
    }
    w.flush()?;
    Ok(())
}
