//! `dsec trajectory ID` (export, filters, "which step last wrote this file") and
//! `dsec replay TRAJECTORY.jsonl` (re-execute in a fresh sandbox, report differing steps).

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use dsec_client::{Client, ClientError};
use dsec_trajectory::reader::{parse_jsonl, to_jsonl};
use dsec_trajectory::replay::{diff, is_replayable, Observed};
use dsec_wire::api::{
    CreateSandboxRequest, ErrorDetail, ExecRequest, RunShellRequest, SandboxInfo, TrajectoryRecord,
};

#[derive(Args, Debug)]
pub struct TrajectoryArgs {
    /// Sandbox id (its log is kept after it stops, for the node's retention period).
    pub id: String,
    /// Lowest step id.
    #[arg(long)]
    pub from: Option<u64>,
    /// Highest step id.
    #[arg(long)]
    pub to: Option<u64>,
    /// Only these kinds (comma-separated: shell,exec,write_file,read_file,...).
    #[arg(long)]
    pub kind: Option<String>,
    /// Records that started at or after this Unix time (seconds).
    #[arg(long)]
    pub since: Option<f64>,
    /// Records that started before this Unix time (seconds).
    #[arg(long)]
    pub until: Option<f64>,
    /// Which call last wrote this path in the sandbox.
    #[arg(long)]
    pub path: Option<String>,
    /// Print the records as JSONL (the input of `dsec replay`) instead of a table.
    #[arg(long)]
    pub json: bool,
}

fn summary(r: &TrajectoryRecord) -> String {
    let what = match r.kind.as_str() {
        "shell" => r
            .request
            .get("cmd")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        "exec" => r.request.get("argv").map(|v| v.to_string()),
        _ => r
            .request
            .get("path")
            .and_then(|v| v.as_str())
            .map(str::to_string),
    }
    .unwrap_or_default();
    let mut what: String = what.replace('\n', "⏎");
    if what.chars().count() > 60 {
        what = what.chars().take(59).collect::<String>() + "…";
    }
    let status = match (&r.error, r.exit_code) {
        (Some(e), _) => e.code.clone(),
        (None, Some(c)) => format!("exit {c}"),
        (None, None) => "ok".into(),
    };
    format!(
        "{:>5} {:>5} {:<12} {:>9.1} {:<14} {}",
        r.seq,
        r.step.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
        r.kind,
        r.end_ms - r.start_ms,
        status,
        what
    )
}

pub async fn trajectory(c: &Client, a: TrajectoryArgs) -> anyhow::Result<()> {
    let mut q = Vec::new();
    for (k, v) in [
        ("from", a.from.map(|v| v.to_string())),
        ("to", a.to.map(|v| v.to_string())),
        ("kind", a.kind.clone()),
        ("since", a.since.map(|v| v.to_string())),
        ("until", a.until.map(|v| v.to_string())),
        ("path", a.path.clone()),
    ] {
        if let Some(v) = v {
            q.push((k, v));
        }
    }
    let records = c
        .trajectory(&a.id, &q)
        .await
        .with_context(|| format!("read the trajectory of {}", a.id))?;
    if a.json {
        use std::io::Write as _;
        std::io::stdout().write_all(&to_jsonl(&records))?;
        return Ok(());
    }
    if let Some(p) = &a.path {
        if records.is_empty() {
            println!("{p}: no call in the log of {} wrote it (it comes from the image, or was never written)", a.id);
            return Ok(());
        }
    }
    println!(
        "{:>5} {:>5} {:<12} {:>9} {:<14} request",
        "seq", "step", "kind", "ms", "status"
    );
    for r in &records {
        println!("{}", summary(r));
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// A trajectory as JSONL (`dsec trajectory ID --json > t.jsonl`).
    pub file: PathBuf,
    /// Keep the replay sandbox instead of stopping it.
    #[arg(long)]
    pub keep: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

fn detail(e: ClientError) -> anyhow::Result<ErrorDetail> {
    match e {
        ClientError::Api { code, message, .. } => Ok(ErrorDetail { code, message }),
        other => Err(anyhow::Error::new(other)),
    }
}

fn param<T: serde::de::DeserializeOwned>(r: &TrajectoryRecord, key: &str) -> anyhow::Result<T> {
    let v = r
        .request
        .get(key)
        .cloned()
        .with_context(|| format!("record {} ({}) has no request.{key}", r.seq, r.kind))?;
    serde_json::from_value(v).with_context(|| format!("record {}: request.{key}", r.seq))
}

/// Re-executes one recorded call in sandbox `id`.
async fn rerun(c: &Client, id: &str, src: &str, r: &TrajectoryRecord) -> anyhow::Result<Observed> {
    let got = match r.kind.as_str() {
        "shell" => {
            let req: RunShellRequest = serde_json::from_value(r.request.clone())
                .with_context(|| format!("record {}: shell request", r.seq))?;
            c.run_shell(id, &req).await.map(Observed::Command)
        }
        "exec" => {
            let req: ExecRequest = serde_json::from_value(r.request.clone())
                .with_context(|| format!("record {}: exec request", r.seq))?;
            c.exec(id, &req).await.map(Observed::Command)
        }
        "write_file" => {
            let path: String = param(r, "path")?;
            let mode: u32 = param(r, "mode")?;
            let Some(digest) = r.blobs.get("content") else {
                bail!("record {} (write_file {path}) does not keep its content (an upload without a step): cannot replay it", r.seq);
            };
            let data = c.trajectory_blob(src, digest).await.with_context(|| {
                format!(
                    "fetch the content of record {} from sandbox {src}'s log",
                    r.seq
                )
            })?;
            let len = data.len() as u64;
            c.write_file(id, &path, Some(mode), std::io::Cursor::new(data), Some(len))
                .await
                .map(Observed::Info)
        }
        "read_file" => {
            let path: String = param(r, "path")?;
            c.read_file_bytes(id, &path).await.map(Observed::Content)
        }
        "list_files" => c
            .list_files(id, &param::<String>(r, "path")?)
            .await
            .map(Observed::List),
        "stat" => c
            .stat(id, &param::<String>(r, "path")?)
            .await
            .map(Observed::Info),
        "remove" => c
            .remove(id, &param::<String>(r, "path")?, param(r, "recursive")?)
            .await
            .map(|_| Observed::Done),
        "mkdir" => c
            .mkdir(
                id,
                &param::<String>(r, "path")?,
                Some(param(r, "mode")?),
                param(r, "parents")?,
            )
            .await
            .map(Observed::Info),
        other => bail!("record {}: kind {other} is not replayable", r.seq),
    };
    match got {
        Ok(o) => Ok(o),
        Err(e) => Ok(Observed::Error(detail(e)?)),
    }
}

#[derive(serde::Serialize)]
struct StepReport {
    seq: u64,
    step: Option<u64>,
    kind: String,
    differences: Vec<String>,
}

#[derive(serde::Serialize)]
struct Report {
    source: String,
    sandbox: String,
    replayed: usize,
    differing: Vec<StepReport>,
}

pub async fn replay(c: &Client, a: ReplayArgs) -> anyhow::Result<()> {
    let text =
        std::fs::read_to_string(&a.file).with_context(|| format!("read {}", a.file.display()))?;
    let mut records =
        parse_jsonl(&text).map_err(|e| anyhow::anyhow!("{}: {e}", a.file.display()))?;
    records.sort_by_key(|r| r.seq);
    let create = records
        .iter()
        .find(|r| r.kind == "create")
        .context("the trajectory has no create record: export it whole (no --from/--to/--kind)")?;
    let orig: SandboxInfo = serde_json::from_value(create.result.clone())
        .context("the create record's result is not a sandbox")?;
    let mut req: CreateSandboxRequest =
        serde_json::from_value(create.request.clone()).context("the create record's request")?;
    // Same layers and limits; the same hostname so `hostname` answers the same; no idempotency.
    req.image = orig.image.clone();
    req.hostname = Some(orig.hostname.clone());
    req.idempotency_key = None;
    if req.env.values().any(|v| v == "<redacted>") {
        eprintln!(
            "note: the recorded env values were redacted; the replay sandbox gets none of them"
        );
        req.env.clear();
    }
    let sb = c.create(&req).await.context("create the replay sandbox")?;
    eprintln!(
        "replaying {} in sandbox {} (image {})",
        orig.id, sb.id, sb.image
    );
    let mut report = Report {
        source: orig.id.clone(),
        sandbox: sb.id.clone(),
        replayed: 0,
        differing: Vec::new(),
    };
    let mut failure = None;
    for r in records.iter().filter(|r| is_replayable(&r.kind)) {
        match rerun(c, &sb.id, &orig.id, r).await {
            Ok(now) => {
                report.replayed += 1;
                let differences = diff(r, &now);
                if !differences.is_empty() {
                    report.differing.push(StepReport {
                        seq: r.seq,
                        step: r.step,
                        kind: r.kind.clone(),
                        differences,
                    });
                }
            }
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    if !a.keep {
        if let Err(e) = c.stop(&sb.id).await {
            eprintln!("warning: stop replay sandbox {}: {e}", sb.id);
        }
    }
    if let Some(e) = failure {
        return Err(e.context(format!("replay stopped after {} calls", report.replayed)));
    }
    if a.json {
        super::print_json(&report)?;
    } else {
        for d in &report.differing {
            println!(
                "step {} (seq {}, {}): {}",
                d.step.map(|s| s.to_string()).unwrap_or_else(|| "-".into()),
                d.seq,
                d.kind,
                d.differences.join("; ")
            );
        }
        println!(
            "{} calls replayed, {} differ from the record",
            report.replayed,
            report.differing.len()
        );
    }
    if !report.differing.is_empty() {
        std::process::exit(3);
    }
    Ok(())
}
