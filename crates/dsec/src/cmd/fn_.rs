//! `dsec fn run --lang python FILE` (one function call on a warm worker) and `dsec fn pools`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand};
use dsec_client::Client;
use dsec_wire::api::{FunctionCallRequest, FunctionStatus};

#[derive(Subcommand, Debug)]
pub enum FnCommand {
    /// Run a program once on a pre-warmed worker and print its output.
    Run(RunArgs),
    /// Show the node's warm pools.
    Pools,
}

#[derive(Args, Debug)]
pub struct RunArgs {
    /// python, bash, c, cpp or command.
    #[arg(long = "lang", short = 'l')]
    pub lang: String,
    /// The program's source file (`-` for standard input).
    pub file: PathBuf,
    /// Arguments for the program.
    #[arg(last = true)]
    pub args: Vec<String>,
    /// File whose content is the program's standard input.
    #[arg(long)]
    pub stdin: Option<PathBuf>,
    /// Wall-clock limit in seconds.
    #[arg(long)]
    pub timeout: Option<f64>,
    /// Memory limit in MiB.
    #[arg(long)]
    pub memory: Option<u64>,
    /// Worker image (default: the edge's function image).
    #[arg(long)]
    pub image: Option<String>,
    /// Print the whole result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// The wire name of a status (`compile_error`, ...), as the API and the SDK spell it.
fn status_name(s: FunctionStatus) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{s:?}"))
}

fn read(p: &Path) -> anyhow::Result<String> {
    if p == Path::new("-") {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).context("read stdin")?;
        return Ok(s);
    }
    std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))
}

pub async fn run(c: &Client, cmd: FnCommand) -> anyhow::Result<()> {
    match cmd {
        FnCommand::Pools => {
            let l = c.function_pools().await.context("list function pools")?;
            super::print_json(&l)
        }
        FnCommand::Run(a) => {
            let req = FunctionCallRequest {
                language: a.lang.clone(),
                code: read(&a.file)?,
                stdin: match &a.stdin {
                    Some(p) => read(p)?,
                    None => String::new(),
                },
                args: a.args.clone(),
                timeout: a.timeout,
                memory_limit_mb: a.memory,
                image: a.image.clone(),
                ..Default::default()
            };
            let r = c
                .function_call(&req)
                .await
                .with_context(|| format!("run {} on a {} worker", a.file.display(), a.lang))?;
            if a.json {
                super::print_json(&r)?;
            } else {
                print!("{}", r.run.stdout);
                eprint!("{}", r.run.stderr);
                eprintln!(
                    "[{} exit {} wall {:.1} ms cpu {:.1} ms peak {:.1} MiB worker {}]",
                    status_name(r.run.status),
                    r.run.exit_code,
                    r.run.wall_ms,
                    r.run.cpu_ms,
                    r.run.peak_memory_bytes as f64 / (1u64 << 20) as f64,
                    r.worker
                );
            }
            if r.run.status != FunctionStatus::Ok {
                anyhow::bail!(
                    "the function ended with status {}",
                    status_name(r.run.status)
                );
            }
            Ok(())
        }
    }
}
