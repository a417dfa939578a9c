//! `POST /sandboxes` and `/v2/sandboxes` (create), `GET /sandboxes`, `/v2/sandboxes` (list with
//! state, metadata and template filters, paginated by `x-next-token`), `GET` and `DELETE
//! /sandboxes/{id}`.
//!
//! A create is [`crate::create::create_with`], the native create: the same quota ledger,
//! placement and admission. templateID names a dsec image (or an alias made with
//! `dsec image alias`); `timeout` is the idle TTL (`ttl_running_stop`); `autoPause` makes the
//! TTL pause instead of stop; `metadata` becomes labels; `envVars` the sandbox environment;
//! `allow_internet_access` / `network` the network mode and allow rules.

use std::collections::{BTreeMap, HashMap};

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use dsec_wire::api::{
    CreateSandboxRequest, NetworkMode, NetworkRule, NetworkSpec, SandboxInfo, TtlAction,
};
use serde::Deserialize;
use serde_json::Value;

use super::errors::E2bError;
use super::{
    created, detail, edge_raw, list_all, listed, live_sandbox, not_found_as, state_of, template_of,
    DEFAULT_TIMEOUT_S, LABEL_E2B, LABEL_PUBLIC_TRAFFIC, LABEL_TEMPLATE,
};
use crate::create::Extras;
use crate::db::Principal;
use crate::routes::AppState;

/// Label: `true` / `false`, what `allow_internet_access` resolved to.
pub const LABEL_INTERNET: &str = "dsec.e2b.internet";

/// Most sandboxes one list page holds.
pub const MAX_PAGE: usize = 1000;
/// Page size when the caller gives none (the SDK's default).
pub const DEFAULT_PAGE: usize = 100;

/// E2B's `SandboxNetworkConfig`, the parts dsec can honour.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkConfig {
    pub allow_public_traffic: Option<bool>,
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub dns_servers: Option<Vec<String>>,
    pub egress_proxy: Option<Value>,
    pub mask_request_host: Option<Value>,
    pub https_ports: Option<Vec<u16>>,
    pub rules: Option<Value>,
}

/// E2B's `NewSandbox` / `NewSandboxV2`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: Option<String>,
    pub timeout: Option<i64>,
    pub auto_pause: Option<bool>,
    pub auto_pause_memory: Option<Value>,
    pub auto_resume: Option<Value>,
    pub secure: Option<bool>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    pub network: Option<NetworkConfig>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub env_vars: Option<BTreeMap<String, String>>,
    pub mcp: Option<Value>,
    pub iam: Option<Value>,
    pub volume_mounts: Option<Vec<Value>>,
}

fn is_set(v: &Option<Value>) -> bool {
    v.as_ref().is_some_and(|v| !v.is_null())
}

/// The network of a create: `allow_internet_access` (E2B's default: allowed) and
/// `network.allowOut` / `denyOut`. dsec has allow-lists only, so a deny list other than
/// "everything" (`0.0.0.0/0`) is refused rather than ignored.
pub fn network_of(
    allow_internet: Option<bool>,
    net: Option<&NetworkConfig>,
) -> Result<(NetworkSpec, bool), E2bError> {
    let unsupported = |what: &str| {
        E2bError::bad_request(format!(
            "network.{what} is not supported by dsec's E2B API: use allowOut with IP addresses or CIDRs, with denyOut [\"0.0.0.0/0\"] to block the rest"
        ))
    };
    let mut deny_all = false;
    let mut allow = Vec::new();
    if let Some(n) = net {
        if n.dns_servers.as_ref().is_some_and(|d| !d.is_empty()) {
            return Err(unsupported("dnsServers"));
        }
        if is_set(&n.egress_proxy) {
            return Err(unsupported("egressProxy"));
        }
        if is_set(&n.mask_request_host) {
            return Err(unsupported("maskRequestHost"));
        }
        if is_set(&n.rules) {
            return Err(unsupported("rules"));
        }
        if n.https_ports.as_ref().is_some_and(|p| !p.is_empty()) {
            return Err(unsupported("httpsPorts"));
        }
        for d in n.deny_out.iter().flatten() {
            if d == "0.0.0.0/0" || d == "::/0" {
                deny_all = true;
            } else {
                return Err(unsupported(&format!("denyOut entry {d:?}")));
            }
        }
        for a in n.allow_out.iter().flatten() {
            if a.parse::<std::net::IpAddr>().is_err() && !a.contains('/') {
                return Err(E2bError::bad_request(format!(
                    "network.allowOut entry {a:?}: dsec allows IP addresses and CIDRs only (domain names: ask the operator for a named domain group)"
                )));
            }
            allow.push(NetworkRule {
                cidr: a.clone(),
                ports: None,
                protocol: None,
            });
        }
    }
    let internet = allow_internet.unwrap_or(true) && !deny_all;
    let mode = if internet {
        NetworkMode::Open
    } else if allow.is_empty() {
        NetworkMode::None
    } else {
        NetworkMode::Allowlist
    };
    let rules = if internet { Vec::new() } else { allow };
    Ok((
        NetworkSpec {
            mode: Some(mode),
            rules,
            groups: None,
        },
        internet,
    ))
}

/// Translates an E2B create body into the native create and the platform labels it adds.
pub fn create_request(
    body: &[u8],
    idempotency_key: Option<String>,
    size: &crate::compat::e2b::config::E2bConfig,
) -> Result<(CreateSandboxRequest, BTreeMap<String, String>), E2bError> {
    let req: NewSandbox = serde_json::from_slice(body).map_err(|e| {
        E2bError::bad_request(format!(
            "invalid create body ({e}); send {{\"templateID\": \"base\", \"timeout\": 300, ...}}"
        ))
    })?;
    let template = req
        .template_id
        .filter(|t| !t.trim().is_empty())
        .ok_or_else(|| {
            E2bError::bad_request(
                "templateID is required (a dsec image name or alias, e.g. \"base\")",
            )
        })?;
    if is_set(&req.mcp) {
        return Err(E2bError::bad_request(
            "mcp is not supported by dsec's E2B API (no MCP gateway); create the sandbox without it",
        ));
    }
    if is_set(&req.iam) {
        return Err(E2bError::bad_request(
            "iam is not supported by dsec's E2B API (no workload tokens); create the sandbox without it",
        ));
    }
    if req.volume_mounts.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(E2bError::bad_request(
            "volumeMounts are not supported by dsec's E2B API yet; create the sandbox without them",
        ));
    }
    let timeout = match req.timeout {
        None => DEFAULT_TIMEOUT_S,
        Some(t) if t > 0 => t as u64,
        Some(t) => {
            return Err(E2bError::bad_request(format!(
                "timeout must be a positive number of seconds (got {t})"
            )))
        }
    };
    let meta = req.metadata.unwrap_or_default();
    if let Some(k) = meta.keys().find(|k| k.starts_with("dsec.")) {
        return Err(E2bError::bad_request(format!(
            "metadata key {k:?}: the dsec. prefix is the platform's; choose another key"
        )));
    }
    let (network, internet) = network_of(req.allow_internet_access, req.network.as_ref())?;
    let public = req
        .network
        .as_ref()
        .and_then(|n| n.allow_public_traffic)
        .unwrap_or(true);
    let mut labels = BTreeMap::new();
    labels.insert(LABEL_E2B.to_string(), "1".to_string());
    labels.insert(LABEL_TEMPLATE.to_string(), template.clone());
    labels.insert(LABEL_INTERNET.to_string(), internet.to_string());
    labels.insert(LABEL_PUBLIC_TRAFFIC.to_string(), public.to_string());
    let native = CreateSandboxRequest {
        image: template,
        cpu_cores_limit: size.cpu_cores,
        memory_limit_mb: size.memory_mb,
        ttl_running_stop: Some(timeout),
        ttl_action: Some(if req.auto_pause.unwrap_or(false) {
            TtlAction::Pause
        } else {
            TtlAction::Stop
        }),
        network: Some(network),
        env: req.env_vars.unwrap_or_default(),
        labels: meta,
        idempotency_key,
        ..Default::default()
    };
    Ok((native, labels))
}

/// Reads a whole answer of ours (a create's) as status and body.
pub async fn body_of(resp: Response) -> (StatusCode, bytes::Bytes) {
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 16 * 1024 * 1024)
        .await
        .unwrap_or_default();
    (status, bytes)
}

/// A native create; the sandbox's info, or the E2B error.
pub async fn create_native(
    st: &AppState,
    principal: &Principal,
    req: CreateSandboxRequest,
    labels: BTreeMap<String, String>,
) -> Result<SandboxInfo, E2bError> {
    let extras = Extras {
        labels,
        only_node: None,
    };
    let resp = crate::create::create_with(st, principal, req, extras)
        .await
        .map_err(E2bError::from)?;
    let (status, bytes) = body_of(resp).await;
    if !status.is_success() {
        return Err(E2bError::from_dsec(status, &bytes));
    }
    serde_json::from_slice(&bytes).map_err(|e| {
        E2bError::new(
            StatusCode::BAD_GATEWAY,
            format!("decode the created sandbox: {e}"),
        )
    })
}

/// `POST /sandboxes`, `POST /v2/sandboxes`.
pub async fn create(
    State(st): State<AppState>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, E2bError> {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let (req, labels) = create_request(&body, key, &st.config.e2b)?;
    let info = create_native(&st, &principal, req, labels).await?;
    Ok((StatusCode::CREATED, Json(created(&st, &info))).into_response())
}

/// The list filters of `GET /sandboxes` and `/v2/sandboxes`.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ListFilter {
    pub metadata: BTreeMap<String, String>,
    /// Empty: running and paused.
    pub states: Vec<String>,
    pub template: Option<String>,
    pub started_after: Option<i64>,
    pub desc: bool,
    pub limit: usize,
    pub next_token: Option<String>,
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses the query (already URL-decoded once by the extractor).
pub fn parse_filter(q: &HashMap<String, String>) -> Result<ListFilter, E2bError> {
    let mut f = ListFilter {
        limit: DEFAULT_PAGE,
        ..Default::default()
    };
    if let Some(m) = q.get("metadata").filter(|m| !m.is_empty()) {
        // `k=v&k2=v2`, each key and value percent-encoded (the SDK quotes them, then encodes
        // the whole string as one query value).
        for pair in m.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').ok_or_else(|| {
                E2bError::bad_request(format!(
                    "metadata filter {pair:?}: use key=value pairs joined by &"
                ))
            })?;
            f.metadata.insert(percent_decode(k), percent_decode(v));
        }
    }
    if let Some(s) = q.get("state").filter(|s| !s.is_empty()) {
        for st in s.split(',') {
            match st {
                "running" | "paused" => f.states.push(st.to_string()),
                other => {
                    return Err(E2bError::bad_request(format!(
                        "state {other:?}: use running and/or paused"
                    )))
                }
            }
        }
    }
    f.template = q.get("template").filter(|t| !t.is_empty()).cloned();
    if let Some(s) = q.get("startedAfter").filter(|s| !s.is_empty()) {
        f.started_after = Some(super::time::parse(s).ok_or_else(|| {
            E2bError::bad_request(format!("startedAfter {s:?}: use an RFC 3339 time"))
        })?);
    }
    match q.get("order").map(String::as_str) {
        None | Some("") | Some("asc") => {}
        Some("desc") => f.desc = true,
        Some(o) => {
            return Err(E2bError::bad_request(format!(
                "order {o:?}: use asc or desc"
            )))
        }
    }
    if let Some(l) = q.get("limit") {
        f.limit = l
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=MAX_PAGE).contains(l))
            .ok_or_else(|| E2bError::bad_request(format!("limit {l:?}: use 1..={MAX_PAGE}")))?;
    }
    f.next_token = q.get("nextToken").filter(|t| !t.is_empty()).cloned();
    Ok(f)
}

fn sort_key(i: &SandboxInfo) -> String {
    format!("{}|{}", i.created_at, i.id)
}

/// One page of the sandboxes matching `f`, and the token of the next page.
pub fn page(mut all: Vec<SandboxInfo>, f: &ListFilter) -> (Vec<SandboxInfo>, Option<String>) {
    all.retain(|i| {
        super::is_live(i)
            && (f.states.is_empty() || f.states.iter().any(|s| s == state_of(i)))
            && f.metadata.iter().all(|(k, v)| i.labels.get(k) == Some(v))
            && f.template
                .as_ref()
                .is_none_or(|t| *t == template_of(i) || *t == i.image)
            && f.started_after
                .is_none_or(|after| super::time::parse(&i.created_at).is_some_and(|s| s >= after))
    });
    all.sort_by_key(sort_key);
    if f.desc {
        all.reverse();
    }
    let after = f
        .next_token
        .as_ref()
        .and_then(|t| hex::decode(t).ok())
        .and_then(|b| String::from_utf8(b).ok());
    let start = match &after {
        None => 0,
        Some(a) => all
            .iter()
            .position(|i| {
                let k = sort_key(i);
                if f.desc {
                    k < *a
                } else {
                    k > *a
                }
            })
            .unwrap_or(all.len()),
    };
    let rest = all.split_off(start.min(all.len()));
    let more = rest.len() > f.limit;
    let items: Vec<SandboxInfo> = rest.into_iter().take(f.limit).collect();
    let next = more
        .then(|| items.last().map(|i| hex::encode(sort_key(i))))
        .flatten();
    (items, next)
}

/// `GET /v2/sandboxes`.
pub async fn list_v2(
    State(st): State<AppState>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, E2bError> {
    let f = parse_filter(&q)?;
    let (items, next) = page(list_all(&st).await?, &f);
    let body: Vec<Value> = items.iter().map(listed).collect();
    let mut resp = Json(body).into_response();
    if let Some(t) = next.and_then(|t| HeaderValue::from_str(&t).ok()) {
        resp.headers_mut().insert("x-next-token", t);
    }
    Ok(resp)
}

/// `GET /sandboxes` (v1: running sandboxes, metadata filter, no pagination).
pub async fn list_v1(
    State(st): State<AppState>,
    Query(q): Query<HashMap<String, String>>,
) -> Result<Response, E2bError> {
    let mut f = parse_filter(&q)?;
    f.states = vec!["running".into()];
    f.limit = usize::MAX;
    let (items, _) = page(list_all(&st).await?, &f);
    Ok(Json(items.iter().map(listed).collect::<Vec<_>>()).into_response())
}

/// `GET /sandboxes/{id}`.
pub async fn get(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, E2bError> {
    let info = live_sandbox(&st, &id).await?;
    Ok(Json(detail(&st, &info)))
}

/// `DELETE /sandboxes/{id}`: the native stop; the quota is given back once the edge confirms.
/// A sandbox that already ended is a 404 (the SDK's `kill` then answers `False`).
pub async fn kill(
    State(st): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, E2bError> {
    live_sandbox(&st, &id).await?;
    let (status, bytes) = edge_raw(&st, Method::DELETE, &id, "", None)
        .await
        .map_err(|e| not_found_as(e, &id))?;
    if status.is_success() || status == StatusCode::NOT_FOUND {
        st.ledger.release_sandbox(&id);
    }
    if status.is_success() {
        return Ok(StatusCode::NO_CONTENT);
    }
    Err(not_found_as(E2bError::from_dsec(status, &bytes), &id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_wire::api::SandboxState;

    #[test]
    fn create_translation() {
        let (r, labels) = create_request(
            br#"{"templateID":"base","timeout":60,"autoPause":true,"metadata":{"job":"j1"},"envVars":{"A":"1"},"allow_internet_access":false}"#,
            Some("k1".into()),
            &Default::default(),
        )
        .unwrap();
        assert_eq!(r.image, "base");
        assert_eq!(r.ttl_running_stop, Some(60));
        assert_eq!(r.ttl_action, Some(TtlAction::Pause));
        assert_eq!(r.labels.get("job").map(String::as_str), Some("j1"));
        assert_eq!(r.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(r.network.as_ref().unwrap().mode, Some(NetworkMode::None));
        assert_eq!(r.idempotency_key.as_deref(), Some("k1"));
        assert_eq!(labels.get(LABEL_TEMPLATE).map(String::as_str), Some("base"));
        assert_eq!(
            labels.get(LABEL_INTERNET).map(String::as_str),
            Some("false")
        );
        let size = crate::compat::e2b::config::E2bConfig {
            cpu_cores: Some(0.25),
            memory_mb: Some(256),
        };
        let (r, _) = create_request(br#"{"templateID":"base"}"#, None, &size).unwrap();
        assert_eq!(r.cpu_cores_limit, Some(0.25));
        assert_eq!(r.memory_limit_mb, Some(256));
        assert_eq!(r.ttl_running_stop, Some(DEFAULT_TIMEOUT_S));
        assert_eq!(r.network.unwrap().mode, Some(NetworkMode::Open));
        let (r, _) = create_request(
            br#"{"templateID":"base","network":{"allowOut":["10.0.0.0/8"],"denyOut":["0.0.0.0/0"]}}"#,
            None,
            &Default::default(),
        )
        .unwrap();
        let n = r.network.unwrap();
        assert_eq!(n.mode, Some(NetworkMode::Allowlist));
        assert_eq!(n.rules[0].cidr, "10.0.0.0/8");
        for bad in [
            &br#"{}"#[..],
            br#"{"templateID":"base","timeout":-1}"#,
            br#"{"templateID":"base","mcp":{"x":{}}}"#,
            br#"{"templateID":"base","metadata":{"dsec.project":"x"}}"#,
            br#"{"templateID":"base","network":{"denyOut":["10.0.0.1"]}}"#,
            br#"{"templateID":"base","network":{"allowOut":["pypi.test"],"denyOut":["0.0.0.0/0"]}}"#,
            br#"not json"#,
        ] {
            let e = create_request(bad, None, &Default::default()).unwrap_err();
            assert_eq!(e.status, 400, "{}", String::from_utf8_lossy(bad));
        }
    }

    fn sb(id: &str, at: &str, state: SandboxState, job: &str) -> SandboxInfo {
        SandboxInfo {
            id: id.into(),
            created_at: at.into(),
            state,
            image: "debian".into(),
            labels: [("job".to_string(), job.to_string())].into(),
            ..Default::default()
        }
    }

    #[test]
    fn filters_and_pages() {
        let all = vec![
            sb("a", "2026-01-01T00:00:01Z", SandboxState::Running, "x"),
            sb("b", "2026-01-01T00:00:02Z", SandboxState::Paused, "x"),
            sb("c", "2026-01-01T00:00:03Z", SandboxState::Running, "y"),
            sb("d", "2026-01-01T00:00:04Z", SandboxState::Stopped, "x"),
        ];
        let q = |s: &str| -> HashMap<String, String> {
            s.split('&')
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once('=').unwrap();
                    (k.to_string(), v.replace("%26", "&").replace("%3D", "="))
                })
                .collect()
        };
        let f = parse_filter(&q("metadata=job%3Dx")).unwrap();
        let (items, next) = page(all.clone(), &f);
        assert_eq!(
            items.iter().map(|i| i.id.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert!(next.is_none());
        let f = parse_filter(&q("state=running")).unwrap();
        let (items, _) = page(all.clone(), &f);
        assert_eq!(
            items.iter().map(|i| i.id.as_str()).collect::<Vec<_>>(),
            ["a", "c"]
        );
        let mut f = parse_filter(&q("limit=1")).unwrap();
        let mut seen = Vec::new();
        loop {
            let (items, next) = page(all.clone(), &f);
            seen.extend(items.into_iter().map(|i| i.id));
            match next {
                Some(t) => f.next_token = Some(t),
                None => break,
            }
        }
        assert_eq!(seen, ["a", "b", "c"]);
        let f = parse_filter(&q("order=desc&limit=2")).unwrap();
        let (items, next) = page(all.clone(), &f);
        assert_eq!(
            items.iter().map(|i| i.id.as_str()).collect::<Vec<_>>(),
            ["c", "b"]
        );
        assert!(next.is_some());
        assert!(parse_filter(&q("state=dead")).is_err());
        assert!(parse_filter(&q("limit=0")).is_err());
        assert_eq!(percent_decode("a%20b%2F"), "a b/");
    }
}
