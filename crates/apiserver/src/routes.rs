//! The `/v1` router. Handlers parse, call one forwarder/watcher method, map the result.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{MatchedPath, Path, Request, State};
use axum::handler::Handler;
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post, put};
use axum::Router;
use dsec_wire::api::{limits, SandboxList};
use tracing::Instrument;

use crate::auth::{bearer, KeyVerifier};
use crate::error::{error_response, ApiError};
use crate::forward::{pump_ws, ForwardBody, Forwarder};
use crate::metrics::Metrics;

/// Shared state of every handler.
#[derive(Clone)]
pub struct AppState {
    pub forwarder: Forwarder,
    pub verifier: Arc<KeyVerifier>,
    pub metrics: Arc<Metrics>,
    pub db: crate::db::Db,
    pub ledger: crate::iam::ledger::Ledger,
    pub config: Arc<crate::config::ApiConfig>,
    pub membership: crate::membership::Membership,

    /// Creates with `wait_s` waiting for capacity (issue 22).
    pub queue: Arc<crate::queue::BurstQueue>,
    /// `create_many` batches of this apiserver.
    pub batches: Arc<crate::batch::Batches>,
}

/// HTTP method of a registered route; `Any` is the edge pass-through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Get,
    Post,
    Put,
    Delete,
    /// Every method (the pass-through of sandbox routes added to the edge later).
    Any,
}

impl Verb {
    /// Lower-case name, as an OpenAPI path item keys its operations.
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Get => "get",
            Verb::Post => "post",
            Verb::Put => "put",
            Verb::Delete => "delete",
            Verb::Any => "*",
        }
    }
}

/// The router under construction and every (method, path) registered on it. Routes are only
/// added through [`Routes::on`], so the list is exactly what the router serves; the OpenAPI
/// test checks the generated document against it (a route cannot be added undescribed).
pub struct Routes<S = AppState> {
    router: Router<S>,
    table: Vec<(Verb, &'static str)>,
}

impl<S: Clone + Send + Sync + 'static> Routes<S> {
    fn new() -> Self {
        Routes {
            router: Router::new(),
            table: Vec::new(),
        }
    }

    /// Serves `verb path` with `handler` (several verbs on one path merge into one route).
    fn on<H, T>(mut self, verb: Verb, path: &'static str, handler: H) -> Self
    where
        H: Handler<T, S>,
        T: 'static,
    {
        let method_router = match verb {
            Verb::Get => get(handler),
            Verb::Post => post(handler),
            Verb::Put => put(handler),
            Verb::Delete => delete(handler),
            Verb::Any => any(handler),
        };
        self.router = self.router.route(path, method_router);
        self.table.push((verb, path));
        self
    }

    /// Every (method, path) registered, in registration order.
    pub fn table(&self) -> &[(Verb, &'static str)] {
        &self.table
    }
}

/// The `/v1` routes (behind an API key).
pub fn v1_routes() -> Routes {
    use crate::iam::http as iam;
    use Verb::*;
    Routes::new()
        .on(Post, "/v1/sandboxes", create_sandbox)
        .on(Get, "/v1/sandboxes", list_sandboxes)
        .on(Get, "/v1/sandboxes/{id}", get_sandbox)
        .on(Delete, "/v1/sandboxes/{id}", stop_sandbox)
        .on(Post, "/v1/sandboxes/{id}/shell", sandbox_json)
        .on(Post, "/v1/sandboxes/{id}/exec", sandbox_json)
        .on(
            Delete,
            "/v1/sandboxes/{id}/sessions/{name}",
            sandbox_simple2,
        )
        .on(Put, "/v1/sandboxes/{id}/files", sandbox_stream)
        .on(Get, "/v1/sandboxes/{id}/files", sandbox_simple)
        .on(Delete, "/v1/sandboxes/{id}/files", sandbox_simple)
        .on(Get, "/v1/sandboxes/{id}/files/list", sandbox_simple)
        .on(Get, "/v1/sandboxes/{id}/files/stat", sandbox_simple)
        .on(Post, "/v1/sandboxes/{id}/files/mkdir", sandbox_simple)
        .on(Get, "/v1/sandboxes/{id}/tty", tty)
        .on(Post, "/v1/sandboxes/{id}/fork", crate::fork::fork)
        // Exposed ports: the proxy itself is `crate::ports::router` (its own access checks).
        .on(Post, "/v1/sandboxes/{id}/port_urls", crate::ports::port_url)
        // Routes added to the edge later (pause, network rules, trajectory, ...) pass through;
        // the document lists them (`openapi::EDGE_PASS_THROUGH`).
        .on(Any, "/v1/sandboxes/{id}/{*rest}", sandbox_stream_rest)
        .on(Get, "/v1/images", images_simple)
        .on(Put, "/v1/images/{*name}", images_stream)
        .on(Post, "/v1/images/{*name}", images_stream)
        .on(Delete, "/v1/images/{*name}", images_simple)
        // microVM templates (issue 9) of the first edge, like images: an operator's view.
        .on(Get, "/v1/microvm/templates", images_simple)
        .on(Delete, "/v1/microvm/templates", images_simple)
        .on(Get, "/v1/nodes", crate::membership::http::list)
        .on(
            Post,
            "/v1/nodes/tokens",
            crate::membership::http::create_token,
        )
        .on(
            Post,
            "/v1/nodes/{id}/cordon",
            crate::membership::http::cordon,
        )
        .on(
            Post,
            "/v1/nodes/{id}/uncordon",
            crate::membership::http::uncordon,
        )
        .on(Post, "/v1/nodes/{id}/drain", crate::membership::http::drain)
        .on(Post, "/v1/volumes", crate::volumes::create)
        .on(Get, "/v1/volumes", crate::volumes::list)
        .on(Get, "/v1/volumes/{name}", crate::volumes::get)
        .on(Delete, "/v1/volumes/{name}", crate::volumes::delete)
        .on(Get, "/v1/cluster", iam::cluster)
        .on(Get, "/v1/projects", iam::list_projects)
        .on(Post, "/v1/projects", iam::create_project)
        .on(Put, "/v1/projects/{name}/quota", iam::set_quota)
        .on(Post, "/v1/keys", iam::create_key)
        .on(Delete, "/v1/keys/{id}", iam::revoke_key)
        .on(Post, "/v1/jobs/{op}", crate::jobs::job)
        .on(Post, "/v1/batches", crate::batch::create)
        .on(Get, "/v1/batches/{id}", crate::batch::get)
        .on(Delete, "/v1/batches/{id}", crate::batch::cancel)
        .on(Post, "/v1/functions/call", functions_forward)
        .on(Post, "/v1/functions/batch", functions_forward)
        .on(Get, "/v1/functions/pools", functions_forward)
}

/// The unauthenticated service routes.
pub fn public_routes() -> Routes {
    use Verb::*;
    Routes::new()
        .on(Get, "/openapi.json", openapi)
        .on(Get, "/healthz", || async { "ok\n" })
        .on(Get, "/metrics", metrics)
        // Membership (issue 22): authorized by a cluster join token, not an API key.
        .on(Post, "/v1/nodes/join", crate::membership::http::join)
        .on(
            Post,
            "/v1/nodes/{id}/heartbeat",
            crate::membership::http::heartbeat,
        )
        // SandboxFusion-compatible (issue 20): the API key is in the path.
        .on(
            Post,
            "/sandboxfusion/{key}/run_code",
            crate::compat::sandboxfusion::run_code,
        )
        .on(
            Post,
            "/sandboxfusion/{key}/run_jupyter",
            crate::compat::sandboxfusion::run_jupyter,
        )
}

/// Builds the whole router.
pub fn router(state: AppState) -> Router {
    let v1 = v1_routes()
        .router
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Router::new()
        .merge(v1)
        .merge(public_routes().router)
        .merge(crate::ports::router())
        // E2B-compatible API (issue 19).
        .merge(crate::compat::e2b::router(state.clone()))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::ports::by_host,
        ))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::compat::e2b::by_host,
        ))
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

async fn not_found(uri: Uri) -> Response {
    error_response(
        dsec_wire::api::codes::NOT_FOUND,
        format!("no route {}; see GET /openapi.json", uri.path()),
    )
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let mut r = error_response(
        dsec_wire::api::codes::BAD_REQUEST,
        format!(
            "method {method} is not allowed on {}; see GET /openapi.json",
            uri.path()
        ),
    );
    *r.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
    r
}

/// The sandbox id in a `/v1/sandboxes/{id}...` path, for spans.
fn sandbox_id_of(path: &str) -> &str {
    path.strip_prefix("/v1/sandboxes/")
        .map(|r| r.split('/').next().unwrap_or(""))
        .unwrap_or("")
}

/// Span per request; request counter by route and status.
async fn observe(State(st): State<AppState>, req: Request, next: Next) -> Response {
    // A shared handle, not a copy: this runs on every request.
    let matched = req.extensions().get::<MatchedPath>().cloned();
    let route = matched.as_ref().map_or("unmatched", |m| m.as_str());
    let method = req.method().clone();
    // Fields are only formatted when the span is enabled (info level).
    let span = tracing::info_span!(
        "request",
        %method,
        route = %route,
        sandbox_id = %sandbox_id_of(req.uri().path())
    );
    let started = Instant::now();
    let resp = next.run(req).instrument(span.clone()).await;
    let status = resp.status();
    st.metrics
        .requests
        .with_label_values(&[method.as_str(), route, status.as_str()])
        .inc();
    span.in_scope(|| {
        tracing::debug!(
            status = status.as_u16(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "answered"
        )
    });
    resp
}

/// Requires a valid API key on every `/v1` route.
async fn require_key(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let value = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match st.verifier.verify(bearer(value)).await {
        Ok(principal) => {
            let mut req = req;
            req.extensions_mut().insert(principal);
            next.run(req).await
        }
        Err(e) => e.into_response(),
    }
}

fn path_and_query(uri: &Uri) -> &str {
    uri.path_and_query()
        .map(|p| p.as_str())
        .unwrap_or(uri.path())
}

fn route_of(m: &Option<MatchedPath>) -> String {
    m.as_ref()
        .map(|m| m.as_str().to_string())
        .unwrap_or_default()
}

fn sandbox_id(p: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    p.map(|Path(id)| id)
        .map_err(|e| ApiError::BadRequest(e.body_text()))
}

/// Most bytes of an oversized body read and discarded before answering 413, so that a
/// client still sending gets to read the answer instead of a reset connection.
const DRAIN_LIMIT: u64 = 64 * 1024 * 1024;

/// Reads a JSON body up to `limits::MAX_JSON_BODY` (413 past it).
async fn read_json_body(headers: &HeaderMap, body: Body) -> Result<bytes::Bytes, ApiError> {
    use futures::StreamExt;
    let too_large = || {
        ApiError::PayloadTooLarge(format!(
            "request body is larger than the {} byte limit for JSON requests",
            limits::MAX_JSON_BODY
        ))
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let mut over = declared.is_some_and(|len| len > limits::MAX_JSON_BODY as u64);
    if declared.is_some_and(|len| len > DRAIN_LIMIT) {
        return Err(too_large());
    }
    let mut buf = bytes::BytesMut::new();
    let mut seen = 0u64;
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::BadRequest(format!("read request body: {e}")))?;
        seen += chunk.len() as u64;
        if seen > limits::MAX_JSON_BODY as u64 {
            over = true;
        }
        if over {
            buf.clear();
            if seen > DRAIN_LIMIT {
                break;
            }
        } else {
            buf.extend_from_slice(&chunk);
        }
    }
    if over {
        return Err(too_large());
    }
    Ok(buf.freeze())
}

async fn create_sandbox(
    State(st): State<AppState>,
    axum::Extension(principal): axum::Extension<crate::db::Principal>,
    req: Request,
) -> Result<Response, ApiError> {
    // The request itself rather than a `HeaderMap` extractor, which would copy the headers.
    let (parts, body) = req.into_parts();
    let bytes = read_json_body(&parts.headers, body).await?;
    crate::create::create(&st, &principal, bytes).await
}

/// `DELETE /v1/sandboxes/{id}`: forwarded; the quota it held is given back once the edge
/// confirms (or says it does not know the sandbox).
async fn stop_sandbox(
    State(st): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    matched: Option<MatchedPath>,
    req: Request,
) -> Result<Response, ApiError> {
    let id = sandbox_id(id)?;
    if let Some(info) = crate::node_lost::lost(&st, &id) {
        st.ledger.release_sandbox(&id);
        return Ok(axum::Json(info).into_response());
    }
    // The edge's stop takes an `end_reason` from the platform only: a caller's query is
    // dropped (a client's stop is `stopped_by_user`).
    let uri: Uri = req
        .uri()
        .path()
        .parse()
        .map_err(|_| ApiError::BadRequest("bad sandbox path".into()))?;
    let resp = forward_sandbox(
        &st,
        &id,
        &matched,
        req.method().clone(),
        &uri,
        req.headers(),
        ForwardBody::Empty,
    )
    .await?;
    if resp.status().is_success() || resp.status() == StatusCode::NOT_FOUND {
        st.ledger.release_sandbox(&id);
        crate::queue::capacity_freed_by_stop(&st, &id);
    }
    Ok(resp)
}

async fn list_sandboxes(
    State(st): State<AppState>,
    q: Result<
        axum::extract::Query<dsec_wire::api::ListSandboxesQuery>,
        axum::extract::rejection::QueryRejection,
    >,
    uri: Uri,
) -> Result<Response, ApiError> {
    // Checked here so that a bad query is the caller's 400, not every edge's refusal.
    q.map_err(|e| {
        ApiError::BadRequest(format!(
            "bad list query ({e}); use ended=true|false and end_reason=<reason>"
        ))
    })?;
    let endpoints = st.forwarder.watcher().endpoints();
    let query = uri.query().map(|q| format!("?{q}")).unwrap_or_default();
    let http = st.forwarder.http().clone();
    let calls = endpoints.iter().map(|e| {
        let http = http.clone();
        let url = format!("{}/edge/v1/sandboxes{query}", e.url);
        async move {
            let r = http.get(&url).bearer_auth(&e.token).send().await;
            match r {
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
    let mut failed = Vec::new();
    for (e, r) in endpoints.iter().zip(results) {
        match r {
            Ok(list) => all.extend(list.sandboxes),
            Err(err) => {
                tracing::warn!(error = %err, "list sandboxes on edge");
                failed.push(e.node_id.clone().unwrap_or_else(|| e.url.clone()));
            }
        }
    }
    if !endpoints.is_empty() && failed.len() == endpoints.len() {
        return Err(ApiError::NodeUnavailable(format!(
            "no edge answered the list ({})",
            failed.join(", ")
        )));
    }
    let mut resp = axum::Json(SandboxList { sandboxes: all }).into_response();
    if !failed.is_empty() {
        if let Ok(v) = failed.join(",").parse() {
            resp.headers_mut().insert("x-dsec-partial", v);
        }
    }
    Ok(resp)
}

/// The edge owning sandbox `id`; a sandbox of a node silent past `node_lost_after_ms` is
/// 410 `sandbox_dead` (see [`crate::node_lost`]).
fn edge_for(st: &AppState, id: &str) -> Result<crate::config::EdgeEndpoint, ApiError> {
    match st.forwarder.edge_for_sandbox(id) {
        Err(ApiError::NodeUnavailable(m)) => Err(crate::node_lost::lost(st, id)
            .map_or(ApiError::NodeUnavailable(m), |i| crate::node_lost::dead(&i))),
        other => other,
    }
}

/// `GET /v1/sandboxes/{id}`: forwarded; a sandbox of a lost node answers its ended view.
async fn get_sandbox(
    State(st): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    matched: Option<MatchedPath>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let id = sandbox_id(id)?;
    if let Some(info) = crate::node_lost::lost(&st, &id) {
        return Ok(axum::Json(info).into_response());
    }
    forward_sandbox(
        &st,
        &id,
        &matched,
        method,
        &uri,
        &headers,
        ForwardBody::Empty,
    )
    .await
}

async fn forward_sandbox(
    st: &AppState,
    id: &str,
    matched: &Option<MatchedPath>,
    method: Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: ForwardBody,
) -> Result<Response, ApiError> {
    let edge = edge_for(st, id)?;
    st.forwarder
        .forward(
            &edge,
            method,
            path_and_query(uri),
            headers,
            body,
            &route_of(matched),
        )
        .await
}

/// GET/DELETE-style sandbox routes with no request body.
async fn sandbox_simple(
    State(st): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    matched: Option<MatchedPath>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let id = sandbox_id(id)?;
    forward_sandbox(
        &st,
        &id,
        &matched,
        method,
        &uri,
        &headers,
        ForwardBody::Empty,
    )
    .await
}

async fn sandbox_simple2(
    State(st): State<AppState>,
    p: Result<Path<(String, String)>, PathRejection>,
    matched: Option<MatchedPath>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Path((id, _)) = p.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    forward_sandbox(
        &st,
        &id,
        &matched,
        method,
        &uri,
        &headers,
        ForwardBody::Empty,
    )
    .await
}

/// Shell and exec: JSON bodies, size-limited here.
async fn sandbox_json(
    State(st): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    matched: Option<MatchedPath>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let id = sandbox_id(id)?;
    // Route first so a malformed id is a 404 whatever the body.
    edge_for(&st, &id)?;
    let bytes = read_json_body(&headers, body).await?;
    forward_sandbox(
        &st,
        &id,
        &matched,
        method,
        &uri,
        &headers,
        ForwardBody::Bytes(bytes),
    )
    .await
}

/// File uploads: streamed.
async fn sandbox_stream(
    State(st): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    matched: Option<MatchedPath>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let id = sandbox_id(id)?;
    forward_sandbox(
        &st,
        &id,
        &matched,
        method,
        &uri,
        &headers,
        ForwardBody::Stream(body),
    )
    .await
}

async fn sandbox_stream_rest(
    State(st): State<AppState>,
    p: Result<Path<(String, String)>, PathRejection>,
    matched: Option<MatchedPath>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let Path((id, _)) = p.map_err(|e| ApiError::BadRequest(e.body_text()))?;
    forward_sandbox(
        &st,
        &id,
        &matched,
        method,
        &uri,
        &headers,
        ForwardBody::Stream(body),
    )
    .await
}

async fn tty(
    State(st): State<AppState>,
    id: Result<Path<String>, PathRejection>,
    uri: Uri,
    upgrade: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let id = match sandbox_id(id) {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    let edge = match st.forwarder.edge_for_sandbox(&id) {
        Ok(e) => e,
        Err(e) => return e.into_response(),
    };
    let upgrade = match upgrade {
        Ok(u) => u,
        Err(e) => {
            return ApiError::BadRequest(format!(
                "the tty route needs a WebSocket upgrade: {}",
                e.body_text()
            ))
            .into_response()
        }
    };
    // Connect to the edge first so its refusal (unknown sandbox, ...) reaches the caller as is.
    let edge_socket = match st.forwarder.connect_tty(&edge, path_and_query(&uri)).await {
        Ok(s) => s,
        Err(resp) => return resp,
    };
    let span = tracing::info_span!("tty", sandbox_id = %id);
    upgrade.on_upgrade(move |socket| pump_ws(socket, edge_socket).instrument(span))
}

async fn images_simple(
    State(st): State<AppState>,
    matched: Option<MatchedPath>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let edge = image_edge(&st)?;
    st.forwarder
        .forward(
            &edge,
            method,
            path_and_query(&uri),
            &headers,
            ForwardBody::Empty,
            &route_of(&matched),
        )
        .await
}

async fn images_stream(
    State(st): State<AppState>,
    matched: Option<MatchedPath>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let edge = image_edge(&st)?;
    st.forwarder
        .forward(
            &edge,
            method,
            path_and_query(&uri),
            &headers,
            ForwardBody::Stream(body),
            &route_of(&matched),
        )
        .await
}

/// Function calls (issue 4) go to the least loaded healthy edge.
async fn functions_forward(
    State(st): State<AppState>,
    matched: Option<MatchedPath>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let edge = st
        .forwarder
        .watcher()
        .snapshot()
        .into_iter()
        .filter(|n| n.healthy)
        .min_by(|a, b| crate::placement::load(a).total_cmp(&crate::placement::load(b)))
        .map(|n| n.endpoint)
        .ok_or_else(|| ApiError::NodeUnavailable("no healthy edge to run function calls".into()))?;
    st.forwarder
        .forward(
            &edge,
            method,
            path_and_query(&uri),
            &headers,
            ForwardBody::Stream(body),
            &route_of(&matched),
        )
        .await
}

/// Images live on the (single) first edge until the cluster issue distributes them.
fn image_edge(st: &AppState) -> Result<crate::config::EdgeEndpoint, ApiError> {
    st.forwarder
        .watcher()
        .first_endpoint()
        .ok_or_else(|| ApiError::NodeUnavailable("no edge is configured".into()))
}

async fn openapi() -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        crate::openapi::document_json(),
    )
        .into_response()
}

async fn metrics(State(st): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_id_from_path() {
        assert_eq!(sandbox_id_of("/v1/sandboxes/sb-n0-1/files"), "sb-n0-1");
        assert_eq!(sandbox_id_of("/v1/sandboxes/sb-n0-1"), "sb-n0-1");
        assert_eq!(sandbox_id_of("/v1/images"), "");
    }
}
