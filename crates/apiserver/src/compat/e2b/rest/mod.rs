//! The E2B control plane (REST), split by resource. Handlers parse E2B's JSON, call the same
//! apiserver code paths `/v1` uses (create with quotas and placement, the edges' lifecycle
//! routes, fork, snapshot, metrics) and answer E2B's JSON. This module must not keep state of
//! its own: everything an answer says comes from the edges (labels carry what E2B adds).

pub mod errors;
pub mod lifecycle;
pub mod metrics;
pub mod sandboxes;
pub mod snapshots;
pub mod templates;
pub mod volumes;

use std::collections::BTreeMap;
use std::time::Duration;

use axum::http::{Method, StatusCode};
use dsec_wire::api::{SandboxInfo, SandboxList, SandboxState};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

use self::errors::E2bError;
use super::time;
use crate::routes::AppState;

/// Label: the template id the caller asked for (an image name or alias).
pub const LABEL_TEMPLATE: &str = "dsec.e2b.template";
/// Label: `false` when the sandbox's ports need the traffic access token.
pub const LABEL_PUBLIC_TRAFFIC: &str = "dsec.e2b.public_traffic";
/// Label: the sandbox was created through the E2B API.
pub const LABEL_E2B: &str = "dsec.e2b";

/// Idle TTL of a sandbox created without `timeout` (the SDK's documented default).
pub const DEFAULT_TIMEOUT_S: u64 = 300;
/// The lifetime shown as `endAt` for a sandbox without any TTL: a year.
const NO_TTL_S: i64 = 365 * 86_400;

/// The signing secret shared with the envd side and the port proxy.
pub fn secret(st: &AppState) -> Vec<u8> {
    crate::ports::secret(st)
}

/// One call to the edge owning `id`, decoded; a refusal becomes the E2B error.
pub async fn edge_call<T: DeserializeOwned>(
    st: &AppState,
    method: Method,
    id: &str,
    suffix: &str,
    body: Option<&Value>,
) -> Result<T, E2bError> {
    let (status, bytes) = edge_raw(st, method, id, suffix, body).await?;
    if !status.is_success() {
        return Err(E2bError::from_dsec(status, &bytes));
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        E2bError::new(
            StatusCode::BAD_GATEWAY,
            format!("the node of sandbox {id} answered something unexpected: {e}"),
        )
    })
}

/// One call to the edge owning `id`: status and body.
pub async fn edge_raw(
    st: &AppState,
    method: Method,
    id: &str,
    suffix: &str,
    body: Option<&Value>,
) -> Result<(StatusCode, bytes::Bytes), E2bError> {
    let edge = st.forwarder.edge_for_sandbox(id).map_err(E2bError::from)?;
    let url = format!("{}/edge/v1/sandboxes/{id}{suffix}", edge.url);
    let mut call = st
        .forwarder
        .http()
        .request(method, &url)
        .bearer_auth(&edge.token)
        .timeout(Duration::from_secs(120));
    if let Some(b) = body {
        call = call.json(b);
    }
    let resp = call.send().await.map_err(|e| {
        E2bError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the node of sandbox {id} is unreachable: {e}"),
        )
    })?;
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let bytes = resp.bytes().await.map_err(|e| {
        E2bError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("reading the answer of sandbox {id}'s node failed: {e}"),
        )
    })?;
    Ok((status, bytes))
}

/// Whether E2B sees the sandbox (running or paused; an ended one is gone).
pub fn is_live(info: &SandboxInfo) -> bool {
    matches!(
        info.state,
        SandboxState::Creating | SandboxState::Running | SandboxState::Paused
    )
}

/// The sandbox, or 404 when it ended or never existed.
pub async fn live_sandbox(st: &AppState, id: &str) -> Result<SandboxInfo, E2bError> {
    let info: SandboxInfo = edge_call(st, Method::GET, id, "", None)
        .await
        .map_err(|e| not_found_as(e, id))?;
    if !is_live(&info) {
        return Err(E2bError::not_found(format!(
            "sandbox {id} not found (it ended: {})",
            info.reason.as_deref().unwrap_or("stopped")
        )));
    }
    Ok(info)
}

/// A 404 of the edge phrased for E2B.
pub fn not_found_as(e: E2bError, id: &str) -> E2bError {
    if e.status == StatusCode::NOT_FOUND {
        E2bError::not_found(format!("sandbox {id} not found"))
    } else {
        e
    }
}

/// Every sandbox on every edge that answers (an edge that does not is logged and skipped,
/// unless none answers).
pub async fn list_all(st: &AppState) -> Result<Vec<SandboxInfo>, E2bError> {
    let endpoints = st.forwarder.watcher().endpoints();
    let http = st.forwarder.http().clone();
    let calls = endpoints.iter().map(|e| {
        let http = http.clone();
        let url = format!("{}/edge/v1/sandboxes", e.url);
        async move {
            match http.get(&url).bearer_auth(&e.token).send().await {
                Ok(r) if r.status().is_success() => r
                    .json::<SandboxList>()
                    .await
                    .map_err(|err| format!("decode {url}: {err}")),
                Ok(r) => Err(format!("{url}: {}", r.status())),
                Err(err) => Err(format!("{url}: {err}")),
            }
        }
    });
    let results = futures::future::join_all(calls).await;
    let mut all = Vec::new();
    let mut failed = 0;
    for r in results {
        match r {
            Ok(list) => all.extend(list.sandboxes),
            Err(err) => {
                tracing::warn!(error = %err, "list sandboxes on edge (e2b)");
                failed += 1;
            }
        }
    }
    if !endpoints.is_empty() && failed == endpoints.len() {
        return Err(E2bError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no node answered the list; retry shortly",
        ));
    }
    Ok(all)
}

/// The caller's metadata: labels without the platform's `dsec.` ones.
pub fn metadata(info: &SandboxInfo) -> BTreeMap<String, String> {
    info.labels
        .iter()
        .filter(|(k, _)| !k.starts_with("dsec."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The template id of a sandbox: the one asked for through E2B, else its image.
pub fn template_of(info: &SandboxInfo) -> String {
    info.labels
        .get(LABEL_TEMPLATE)
        .cloned()
        .unwrap_or_else(|| info.image.clone())
}

/// `running` or `paused`.
pub fn state_of(info: &SandboxInfo) -> &'static str {
    if info.state == SandboxState::Paused {
        "paused"
    } else {
        "running"
    }
}

/// When the idle TTL (or the hard lifetime) ends the sandbox if nothing touches it.
pub fn end_at(info: &SandboxInfo) -> String {
    let started = time::parse(&info.created_at).unwrap_or_else(time::now);
    let last = info
        .last_request_at
        .as_deref()
        .and_then(time::parse)
        .unwrap_or(started);
    let idle = info.ttl_running_stop.map(|t| last + t as i64);
    let total = info.ttl_total.map(|t| started + t as i64);
    let end = match (idle, total) {
        (Some(a), Some(b)) => a.min(b),
        (Some(a), None) | (None, Some(a)) => a,
        (None, None) => started + NO_TTL_S,
    };
    time::format(end)
}

fn cpu_count(info: &SandboxInfo) -> u64 {
    (info.cpu_cores_limit.ceil() as u64).max(1)
}

fn domain(st: &AppState) -> Value {
    st.config
        .sandbox_domain
        .as_ref()
        .map_or(Value::Null, |d| Value::String(d.clone()))
}

fn traffic_token(st: &AppState, info: &SandboxInfo) -> Value {
    if info.labels.get(LABEL_PUBLIC_TRAFFIC).map(String::as_str) == Some("false") {
        Value::String(super::access::traffic_token(&secret(st), &info.id))
    } else {
        Value::Null
    }
}

/// E2B's `Sandbox` (the answer of create, connect, resume and fork).
pub fn created(st: &AppState, info: &SandboxInfo) -> Value {
    json!({
        "templateID": template_of(info),
        "sandboxID": info.id,
        "alias": template_of(info),
        "clientID": info.node,
        "envdVersion": super::ENVD_VERSION,
        "envdAccessToken": super::access::envd_token(&secret(st), &info.id),
        "trafficAccessToken": traffic_token(st, info),
        "domain": domain(st),
    })
}

/// E2B's `ListedSandbox`.
pub fn listed(info: &SandboxInfo) -> Value {
    json!({
        "templateID": template_of(info),
        "alias": template_of(info),
        "sandboxID": info.id,
        "clientID": info.node,
        "startedAt": info.created_at,
        "endAt": end_at(info),
        "cpuCount": cpu_count(info),
        "memoryMB": info.memory_limit_mb,
        "diskSizeMB": 0,
        "metadata": metadata(info),
        "state": state_of(info),
        "envdVersion": super::ENVD_VERSION,
    })
}

/// E2B's `SandboxDetail` (`GET /sandboxes/{id}`).
pub fn detail(st: &AppState, info: &SandboxInfo) -> Value {
    let mut v = listed(info);
    if let Value::Object(o) = &mut v {
        o.insert(
            "envdAccessToken".into(),
            Value::String(super::access::envd_token(&secret(st), &info.id)),
        );
        o.insert("domain".into(), domain(st));
        let internet = info
            .labels
            .get(sandboxes::LABEL_INTERNET)
            .map_or(Value::Null, |v| Value::Bool(v == "true"));
        o.insert("allowInternetAccess".into(), internet);
        o.insert(
            "lifecycle".into(),
            json!({
                "autoResume": true,
                "onTimeout": if info.ttl_action == dsec_wire::api::TtlAction::Pause { "pause" } else { "kill" },
            }),
        );
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> SandboxInfo {
        SandboxInfo {
            id: "sb-n0-1".into(),
            node: "n0".into(),
            state: SandboxState::Running,
            image: "debian".into(),
            created_at: "2026-12-02T02:00:00Z".into(),
            last_request_at: Some("2026-12-02T02:10:00Z".into()),
            ttl_running_stop: Some(60),
            cpu_cores_limit: 0.5,
            memory_limit_mb: 256,
            labels: [
                ("job".to_string(), "a".to_string()),
                (LABEL_TEMPLATE.to_string(), "base".to_string()),
                ("dsec.project".to_string(), "p".to_string()),
            ]
            .into(),
            ..Default::default()
        }
    }

    #[test]
    fn listed_shape() {
        let v = listed(&info());
        assert_eq!(v["sandboxID"], "sb-n0-1");
        assert_eq!(v["templateID"], "base");
        assert_eq!(v["state"], "running");
        assert_eq!(v["cpuCount"], 1);
        assert_eq!(v["endAt"], "2026-12-02T02:11:00Z");
        assert_eq!(v["metadata"], json!({"job": "a"}));
        let mut i = info();
        i.state = SandboxState::Paused;
        i.ttl_total = Some(30);
        assert_eq!(listed(&i)["state"], "paused");
        assert_eq!(end_at(&i), "2026-12-02T02:00:30Z");
        i.ttl_total = None;
        i.ttl_running_stop = None;
        assert_eq!(end_at(&i), "2027-12-02T02:00:00Z");
        i.state = SandboxState::Stopped;
        assert!(!is_live(&i));
    }
}
