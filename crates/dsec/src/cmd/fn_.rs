//! `dsec fn run --lang python FILE` (one function call on a warm worker) and `dsec fn pools`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand};
use dsec_wire::api::{FunctionCallRequest, FunctionCallResult, FunctionPoolList, FunctionStatus};

use crate::Global;

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

/// The API URL and key, as `connect::client` finds them.
fn endpoint(g: &Global) -> anyhow::Result<(String, String)> {
    let (mut url, mut key) = (g.url.clone(), g.api_key.clone());
    if url.is_none() || key.is_none() {
        if let Ok(vars) = crate::envfile::read(Path::new(crate::connect::DEFAULT_ENV_FILE)) {
            url = url.or_else(|| vars.get(dsec_client::ENV_URL).cloned());
            key = key.or_else(|| vars.get(dsec_client::ENV_KEY).cloned());
        }
    }
    match (url, key) {
        (Some(u), Some(k)) => Ok((u.trim_end_matches('/').to_string(), k)),
        _ => Err(crate::UsageError(
            "no API URL or key: set DSEC_API_URL and DSEC_API_KEY (or run `dsec up`)".into(),
        )
        .into()),
    }
}

async fn send(
    g: &Global,
    method: reqwest::Method,
    path: &str,
    body: Option<&FunctionCallRequest>,
) -> anyhow::Result<bytes::Bytes> {
    let (url, key) = endpoint(g)?;
    let http = reqwest::Client::new();
    let mut req = http
        .request(method, format!("{url}{path}"))
        .bearer_auth(key);
    if let Some(b) = body {
        req = req.json(b);
    }
    let resp = req
        .send()
        .await
        .with_context(|| format!("call {url}{path}"))?;
    let status = resp.status();
    let bytes = resp.bytes().await.context("read the answer")?;
    if !status.is_success() {
        let msg = serde_json::from_slice::<dsec_wire::api::ErrorBody>(&bytes)
            .map(|e| format!("{}: {}", e.error.code, e.error.message))
            .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
        anyhow::bail!("{path}: {status}: {msg}");
    }
    Ok(bytes)
}

pub async fn run(g: &Global, c: FnCommand) -> anyhow::Result<()> {
    match c {
        FnCommand::Pools => {
            let b = send(g, reqwest::Method::GET, "/v1/functions/pools", None).await?;
            let l: FunctionPoolList = serde_json::from_slice(&b).context("parse pools")?;
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
            let b = send(g, reqwest::Method::POST, "/v1/functions/call", Some(&req)).await?;
            let r: FunctionCallResult = serde_json::from_slice(&b).context("parse result")?;
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
