//! `dsec bench create-load`: an open-loop load generator for creates (and deletes).

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use dsec_client::{Client, ClientError};
use dsec_wire::api::CreateSandboxRequest;
use serde::Serialize;

use crate::Global;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Create (and optionally delete) sandboxes at a fixed rate; prints a JSON summary.
    CreateLoad(CreateLoadArgs),
}

#[derive(Args, Debug)]
pub struct CreateLoadArgs {
    /// Creates per second to offer (0: as fast as --concurrency allows).
    #[arg(long, default_value_t = 0.0)]
    pub rate: f64,
    /// How many creates to send in total.
    #[arg(long)]
    pub total: u64,
    /// Most requests in flight.
    #[arg(long, default_value_t = 256)]
    pub concurrency: usize,
    /// Image named in every create.
    #[arg(long, default_value = "busybox")]
    pub image: String,
    /// Delete each sandbox right after it was created (steady state instead of growth).
    #[arg(long)]
    pub delete: bool,
    /// Memory asked per sandbox, MiB.
    #[arg(long)]
    pub memory_mb: Option<u64>,
    /// CPU asked per sandbox, cores.
    #[arg(long)]
    pub cpus: Option<f64>,
    /// Project to charge.
    #[arg(long)]
    pub project: Option<String>,
    /// Mark creates eligible for the overflow pool.
    #[arg(long)]
    pub overflow_eligible: bool,
    /// Give every create a unique idempotency key with this prefix.
    #[arg(long)]
    pub idempotency_prefix: Option<String>,
    /// Label KEY=VALUE on every sandbox.
    #[arg(long = "label", value_parser = crate::parse::parse_kv)]
    pub labels: Vec<(String, String)>,
    /// Write every created sandbox id here, one per line.
    #[arg(long)]
    pub ids_out: Option<std::path::PathBuf>,
    /// Let every create wait up to this many seconds in the apiserver's queue for capacity.
    #[arg(long)]
    pub wait_s: Option<f64>,
    /// With --wait-s: write one JSON line per placed create here (its id and queue report).
    #[arg(long)]
    pub queue_out: Option<std::path::PathBuf>,
}

#[derive(Debug, Serialize, Default)]
pub struct LoadSummary {
    pub offered_rate: f64,
    pub sent: u64,
    pub created: u64,
    pub deleted: u64,
    /// Error code → count (`transport` for requests that got no answer).
    pub refused: BTreeMap<String, u64>,
    pub unique_ids: u64,
    pub duplicate_ids: u64,
    pub seconds: f64,
    pub achieved_creates_per_s: f64,
    pub create_p50_ms: f64,
    pub create_p90_ms: f64,
    pub create_p99_ms: f64,
    pub create_max_ms: f64,
    /// Creates per node id.
    pub per_node: BTreeMap<String, u64>,
    /// With --wait-s: time placed creates waited in the apiserver's queue.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_wait_p50_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue_wait_p99_ms: Option<f64>,
}

/// One line of `--queue-out`.
#[derive(Debug, Serialize)]
struct QueuedLine {
    id: String,
    /// Order in which this load generator sent the create.
    sent: u64,
    #[serde(flatten)]
    queue: dsec_wire::api::QueueReport,
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

struct Shared {
    lat_ms: Mutex<Vec<f64>>,
    ids: Mutex<Vec<String>>,
    queued: Mutex<Vec<QueuedLine>>,
    refused: Mutex<BTreeMap<String, u64>>,
    deleted: AtomicU64,
}

pub async fn bench(g: &Global, c: BenchCommand) -> anyhow::Result<()> {
    // A load generator talks to the apiserver directly, whatever proxy the shell names.
    let opts = dsec_client::ClientOptions { no_proxy: true };
    match c {
        BenchCommand::CreateLoad(a) => create_load(crate::connect::client_with(g, &opts)?, a).await,
    }
}

/// The refusal bucket of a failed call: the API's error code, or what went wrong locally.
fn refusal(e: &ClientError) -> String {
    match e {
        ClientError::Api { code, .. } => code.clone(),
        ClientError::Transport { .. } => "transport".into(),
        _ => "bad_answer".into(),
    }
}

async fn create_load(client: Client, a: CreateLoadArgs) -> anyhow::Result<()> {
    if a.concurrency == 0 {
        bail!(crate::UsageError("--concurrency must be >= 1".into()));
    }
    let client = Arc::new(client);
    let shared = Arc::new(Shared {
        lat_ms: Mutex::new(Vec::with_capacity(a.total as usize)),
        ids: Mutex::new(Vec::with_capacity(a.total as usize)),
        queued: Mutex::new(Vec::new()),
        refused: Mutex::new(BTreeMap::new()),
        deleted: AtomicU64::new(0),
    });
    let sem = Arc::new(tokio::sync::Semaphore::new(a.concurrency));
    let base = Arc::new(CreateSandboxRequest {
        image: a.image.clone(),
        labels: a.labels.iter().cloned().collect(),
        memory_limit_mb: a.memory_mb,
        cpu_cores_limit: a.cpus,
        project: a.project.clone(),
        overflow_eligible: a.overflow_eligible.then_some(true),
        ..Default::default()
    });
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..a.total {
        if a.rate > 0.0 {
            let due = started + Duration::from_secs_f64(i as f64 / a.rate);
            let now = Instant::now();
            if due > now {
                tokio::time::sleep_until(due.into()).await;
            }
        }
        let permit = sem
            .clone()
            .acquire_owned()
            .await
            .context("semaphore closed")?;
        let idempotency_key = a.idempotency_prefix.as_ref().map(|p| format!("{p}-{i}"));
        let (client, shared, delete, base, wait_s) = (
            client.clone(),
            shared.clone(),
            a.delete,
            base.clone(),
            a.wait_s,
        );
        tasks.spawn(async move {
            let _permit = permit;
            let t = Instant::now();
            let keyed = idempotency_key.map(|k| {
                let mut req = (*base).clone();
                req.idempotency_key = Some(k);
                req
            });
            let req = keyed.as_ref().unwrap_or(&base);
            // The shared body unless each create carries its own idempotency key.
            let r = match wait_s {
                Some(w) => client.create_waiting(req, w).await.map(|q| {
                    if let (Some(report), Ok(mut l)) = (q.queue, shared.queued.lock()) {
                        l.push(QueuedLine {
                            id: q.info.id.clone(),
                            sent: i,
                            queue: report,
                        });
                    }
                    q.info
                }),
                None => client.create(req).await,
            };
            match r {
                Ok(sb) => {
                    let ms = t.elapsed().as_secs_f64() * 1e3;
                    if let Ok(mut l) = shared.lat_ms.lock() {
                        l.push(ms);
                    }
                    if delete && !sb.id.is_empty() && client.stop(&sb.id).await.is_ok() {
                        shared.deleted.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Ok(mut ids) = shared.ids.lock() {
                        ids.push(sb.id);
                    }
                }
                Err(e) => {
                    if let Ok(mut m) = shared.refused.lock() {
                        *m.entry(refusal(&e)).or_default() += 1;
                    }
                }
            }
        });
        while let Some(r) = tasks.try_join_next() {
            r.context("load task")?;
        }
    }
    while let Some(r) = tasks.join_next().await {
        r.context("load task")?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let mut lat = shared.lat_ms.lock().map(|l| l.clone()).unwrap_or_default();
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let ids = shared.ids.lock().map(|l| l.clone()).unwrap_or_default();
    let unique: HashSet<&String> = ids.iter().collect();
    let mut per_node = BTreeMap::new();
    for id in &ids {
        if let Some(n) = dsec_wire::id::node_of(id) {
            *per_node.entry(n.to_string()).or_insert(0u64) += 1;
        }
    }
    if let Some(p) = &a.ids_out {
        std::fs::write(p, ids.join("\n")).with_context(|| format!("write {}", p.display()))?;
    }
    let refused = shared.refused.lock().map(|m| m.clone()).unwrap_or_default();
    let queued = shared
        .queued
        .lock()
        .map(|mut l| std::mem::take(&mut *l))
        .unwrap_or_default();
    let mut waits: Vec<f64> = queued.iter().map(|q| q.queue.waited_ms).collect();
    waits.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    if let Some(p) = &a.queue_out {
        let mut out = String::new();
        for q in &queued {
            out.push_str(&serde_json::to_string(q)?);
            out.push('\n');
        }
        std::fs::write(p, out).with_context(|| format!("write {}", p.display()))?;
    }
    let s = LoadSummary {
        offered_rate: a.rate,
        sent: a.total,
        created: ids.len() as u64,
        deleted: shared.deleted.load(Ordering::Relaxed),
        refused,
        unique_ids: unique.len() as u64,
        duplicate_ids: (ids.len() - unique.len()) as u64,
        seconds,
        achieved_creates_per_s: ids.len() as f64 / seconds.max(1e-9),
        create_p50_ms: pct(&lat, 0.5),
        create_p90_ms: pct(&lat, 0.9),
        create_p99_ms: pct(&lat, 0.99),
        create_max_ms: lat.last().copied().unwrap_or(0.0),
        per_node,
        queue_wait_p50_ms: a.wait_s.map(|_| pct(&waits, 0.5)),
        queue_wait_p99_ms: a.wait_s.map(|_| pct(&waits, 0.99)),
    };
    super::print_json(&s)
}
