//! `GET /sandboxes/{id}/metrics`, `GET /sandboxes/metrics?sandbox_ids=`, `GET
//! /sandboxes/{id}/logs` and `/v2/sandboxes/{id}/logs`: the edge's metric samples and the
//! sandbox's trajectory log, in E2B's shapes.

use std::collections::{BTreeMap, HashMap};

use axum::extract::{Path, Query, State};
use axum::http::{Method, StatusCode};
use axum::Json;
use dsec_wire::api::{MetricsSample, SandboxMetrics, TrajectoryRecord};
use serde_json::{json, Value};

use super::errors::E2bError;
use super::{edge_raw, live_sandbox, not_found_as, time};
use crate::routes::AppState;

/// Most sandboxes one `GET /sandboxes/metrics` asks about.
pub const MAX_METRICS_IDS: usize = 100;

/// One E2B `SandboxMetric`.
pub fn metric(s: &MetricsSample) -> Value {
    let cpus = (s.cpu_limit_cores.ceil() as u64).max(1);
    let secs = (s.time_ms / 1000) as i64;
    json!({
        "timestamp": time::format(secs),
        "timestampUnix": secs,
        "cpuCount": cpus,
        // E2B: percent of the sandbox's CPUs; dsec samples percent of one core.
        "cpuUsedPct": s.cpu_percent / cpus as f64,
        "memUsed": s.memory_bytes,
        "memTotal": s.memory_limit_bytes,
        "memCache": 0,
        "diskUsed": s.disk_used_bytes,
        "diskTotal": s.disk_limit_bytes,
    })
}

async fn samples(st: &AppState, id: &str) -> Result<SandboxMetrics, E2bError> {
    super::edge_call(st, Method::GET, id, "/metrics", None)
        .await
        .map_err(|e| not_found_as(e, id))
}

fn secs_param(q: &HashMap<String, String>, key: &str) -> Result<Option<i64>, E2bError> {
    q.get(key)
        .filter(|v| !v.is_empty())
        .map(|v| {
            v.parse::<i64>()
                .map_err(|_| E2bError::bad_request(format!("{key} {v:?}: use Unix seconds")))
        })
        .transpose()
}

/// `GET /sandboxes/{id}/metrics?start=&end=` (Unix seconds).
pub async fn sandbox(
    State(st): State<AppState>,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Json<Vec<Value>>, E2bError> {
    let (start, end) = (secs_param(&q, "start")?, secs_param(&q, "end")?);
    live_sandbox(&st, &id).await?;
    let m = samples(&st, &id).await?;
    Ok(Json(
        m.samples
            .iter()
            .filter(|s| {
                let t = (s.time_ms / 1000) as i64;
                start.is_none_or(|a| t >= a) && end.is_none_or(|b| t <= b)
            })
            .map(metric)
            .collect(),
    ))
}

/// `GET /sandboxes/metrics?sandbox_ids=a,b`: the newest sample of each.
pub async fn many(
    State(st): State<AppState>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Json<Value>, E2bError> {
    let ids: Vec<&str> = q
        .get("sandbox_ids")
        .map(|s| s.split(',').filter(|s| !s.is_empty()).collect())
        .unwrap_or_default();
    if ids.is_empty() || ids.len() > MAX_METRICS_IDS {
        return Err(E2bError::bad_request(format!(
            "sandbox_ids must list 1..={MAX_METRICS_IDS} sandbox ids, comma-separated"
        )));
    }
    let got = futures::future::join_all(ids.iter().map(|id| samples(&st, id))).await;
    let mut out = BTreeMap::new();
    for (id, m) in ids.iter().zip(got) {
        if let Some(s) = m.ok().and_then(|m| m.samples.last().cloned()) {
            out.insert(id.to_string(), metric(&s));
        }
    }
    Ok(Json(json!({ "sandboxes": out })))
}

/// One trajectory record as an E2B log line.
pub fn log_line(r: &TrajectoryRecord) -> (String, String, &'static str) {
    let ts = time::format((r.start_ms / 1000.0) as i64);
    let mut line = format!("#{} {}", r.seq, r.kind);
    if let Some(c) = r.exit_code {
        line.push_str(&format!(" exit={c}"));
    }
    if let Some(e) = &r.error {
        line.push_str(&format!(" error={}: {}", e.code, e.message));
    }
    line.push_str(&format!(" ({:.0} ms)", r.end_ms - r.start_ms));
    (ts, line, if r.ok { "info" } else { "error" })
}

/// `GET /sandboxes/{id}/logs`: the trajectory log, one line per call.
pub async fn logs(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, E2bError> {
    let (logs, entries) = log_lines(&st, &id).await?;
    Ok(Json(json!({"logs": logs, "logEntries": entries})))
}

/// `GET /v2/sandboxes/{id}/logs`: the same as structured entries.
pub async fn logs_v2(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, E2bError> {
    let (_, entries) = log_lines(&st, &id).await?;
    Ok(Json(json!({"logs": entries})))
}

async fn log_lines(st: &AppState, id: &str) -> Result<(Vec<Value>, Vec<Value>), E2bError> {
    let (status, bytes) = edge_raw(st, Method::GET, id, "/trajectory", None)
        .await
        .map_err(|e| not_found_as(e, id))?;
    if !status.is_success() {
        return Err(not_found_as(E2bError::from_dsec(status, &bytes), id));
    }
    if status == StatusCode::NO_CONTENT {
        return Ok((Vec::new(), Vec::new()));
    }
    let mut logs = Vec::new();
    let mut entries = Vec::new();
    for l in bytes.split(|b| *b == b'\n').filter(|l| !l.is_empty()) {
        let Ok(r) = serde_json::from_slice::<TrajectoryRecord>(l) else {
            continue;
        };
        let (ts, line, level) = log_line(&r);
        logs.push(json!({"timestamp": ts, "line": line}));
        entries.push(
            json!({"timestamp": ts, "message": line, "level": level, "fields": {"kind": r.kind}}),
        );
    }
    Ok((logs, entries))
}
