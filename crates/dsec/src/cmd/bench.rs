//! `dsec bench create-load`: an open-loop load generator for creates (and deletes), and the
//! small JSON-over-HTTP helper the admin commands share.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use serde::Serialize;

use crate::Global;

/// URL, key and an HTTP client for the admin routes.
pub struct Api {
    pub http: reqwest::Client,
    pub url: String,
    pub key: String,
}

impl Api {
    pub fn from_global(g: &Global) -> anyhow::Result<Api> {
        let (mut url, mut key) = (g.url.clone(), g.api_key.clone());
        if url.is_none() || key.is_none() {
            if let Ok(vars) = crate::envfile::read(Path::new(crate::connect::DEFAULT_ENV_FILE)) {
                url = url.or_else(|| vars.get(dsec_client::ENV_URL).cloned());
                key = key.or_else(|| vars.get(dsec_client::ENV_KEY).cloned());
            }
        }
        let url = url.ok_or_else(|| {
            crate::UsageError("no API URL: set DSEC_API_URL or pass --url".into())
        })?;
        let key = key.ok_or_else(|| {
            crate::UsageError("no API key: set DSEC_API_KEY or pass --api-key".into())
        })?;
        let http = reqwest::Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .pool_max_idle_per_host(1024)
            .build()
            .context("build HTTP client")?;
        Ok(Api {
            http,
            url: url.trim_end_matches('/').to_string(),
            key,
        })
    }

    /// Sends `method path` with an optional JSON body; returns the JSON answer or the API's
    /// error message.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> anyhow::Result<serde_json::Value> {
        let mut req = self
            .http
            .request(method.clone(), format!("{}{path}", self.url))
            .bearer_auth(&self.key);
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("{method} {path}"))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .with_context(|| format!("{method} {path}: read answer"))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
        if !status.is_success() {
            let msg = v["error"]["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| v.to_string());
            let code = v["error"]["code"].as_str().unwrap_or("");
            bail!("{status} {code}: {msg}");
        }
        Ok(v)
    }
}

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
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// The part of a create's answer the load generator needs.
#[derive(serde::Deserialize)]
struct Created {
    id: String,
}

struct Shared {
    lat_ms: Mutex<Vec<f64>>,
    ids: Mutex<Vec<String>>,
    refused: Mutex<BTreeMap<String, u64>>,
    deleted: AtomicU64,
}

pub async fn bench(g: &Global, c: BenchCommand) -> anyhow::Result<()> {
    match c {
        BenchCommand::CreateLoad(a) => create_load(&Api::from_global(g)?, a).await,
    }
}

async fn create_load(api: &Api, a: CreateLoadArgs) -> anyhow::Result<()> {
    if a.concurrency == 0 {
        bail!(crate::UsageError("--concurrency must be >= 1".into()));
    }
    let api = Arc::new(Api {
        http: api.http.clone(),
        url: api.url.clone(),
        key: api.key.clone(),
    });
    let shared = Arc::new(Shared {
        lat_ms: Mutex::new(Vec::with_capacity(a.total as usize)),
        ids: Mutex::new(Vec::with_capacity(a.total as usize)),
        refused: Mutex::new(BTreeMap::new()),
        deleted: AtomicU64::new(0),
    });
    let sem = Arc::new(tokio::sync::Semaphore::new(a.concurrency));
    let labels: BTreeMap<String, String> = a.labels.iter().cloned().collect();
    let mut base = serde_json::json!({"image": a.image, "labels": labels});
    if let Some(m) = a.memory_mb {
        base["memory_limit_mb"] = m.into();
    }
    if let Some(c) = a.cpus {
        base["cpu_cores_limit"] = c.into();
    }
    if let Some(p) = &a.project {
        base["project"] = p.clone().into();
    }
    if a.overflow_eligible {
        base["overflow_eligible"] = true.into();
    }
    let base_bytes = bytes::Bytes::from(serde_json::to_vec(&base).context("encode create body")?);
    let create_url = format!("{}/v1/sandboxes", api.url);
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
        // The same body for every create unless each carries its own idempotency key.
        let body = match &a.idempotency_prefix {
            Some(p) => {
                let mut b = base.clone();
                b["idempotency_key"] = format!("{p}-{i}").into();
                bytes::Bytes::from(serde_json::to_vec(&b).context("encode create body")?)
            }
            None => base_bytes.clone(),
        };
        let (api, shared, delete, create_url) =
            (api.clone(), shared.clone(), a.delete, create_url.clone());
        tasks.spawn(async move {
            let _permit = permit;
            let t = Instant::now();
            let r = api
                .http
                .post(create_url)
                .bearer_auth(&api.key)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body)
                .send()
                .await;
            let code = match r {
                Ok(resp) => {
                    let ok = resp.status().is_success();
                    // Only the id of a created sandbox is needed: no full JSON tree per answer.
                    let parsed = resp.bytes().await.ok().and_then(|b| {
                        if ok {
                            serde_json::from_slice::<Created>(&b).ok().map(Ok)
                        } else {
                            serde_json::from_slice::<serde_json::Value>(&b)
                                .ok()
                                .map(Err)
                        }
                    });
                    match parsed {
                        Some(Ok(Created { id })) => {
                            let ms = t.elapsed().as_secs_f64() * 1e3;
                            if let Ok(mut l) = shared.lat_ms.lock() {
                                l.push(ms);
                            }
                            if delete && !id.is_empty() {
                                let d = api
                                    .http
                                    .delete(format!("{}/v1/sandboxes/{id}", api.url))
                                    .bearer_auth(&api.key)
                                    .send()
                                    .await;
                                if d.is_ok_and(|d| d.status().is_success()) {
                                    shared.deleted.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                            if let Ok(mut ids) = shared.ids.lock() {
                                ids.push(id);
                            }
                            None
                        }
                        Some(Err(v)) => {
                            Some(v["error"]["code"].as_str().unwrap_or("unknown").to_string())
                        }
                        None => Some("bad_answer".to_string()),
                    }
                }
                Err(_) => Some("transport".to_string()),
            };
            if let Some(code) = code {
                if let Ok(mut m) = shared.refused.lock() {
                    *m.entry(code).or_default() += 1;
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
    };
    super::print_json(&s)
}
