//! Forwarding to edges: path rewriting, streaming bodies both ways, WebSocket pumping.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::ws::{self, WebSocket};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite;

use crate::config::EdgeEndpoint;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::watcher::Watcher;

/// Rewrites a public path (with query) to the edge's: `/v1/...` → `/edge/v1/...`.
pub fn edge_path(path_and_query: &str) -> Option<String> {
    let rest = path_and_query.strip_prefix("/v1")?;
    if !(rest.is_empty() || rest.starts_with('/') || rest.starts_with('?')) {
        return None;
    }
    Some(format!("/edge/v1{rest}"))
}

/// The edge's WebSocket URL for an http(s) base URL and an edge path.
pub fn ws_url(base: &str, edge_path: &str) -> Option<String> {
    if let Some(rest) = base.strip_prefix("http://") {
        Some(format!("ws://{rest}{edge_path}"))
    } else {
        base.strip_prefix("https://")
            .map(|rest| format!("wss://{rest}{edge_path}"))
    }
}

/// Request headers passed on to the edge (authorization is replaced by the edge token).
const REQUEST_HEADERS: &[HeaderName] =
    &[header::CONTENT_TYPE, header::CONTENT_LENGTH, header::ACCEPT];
/// Response headers passed back to the caller.
const RESPONSE_HEADERS: &[HeaderName] = &[
    header::CONTENT_TYPE,
    header::CONTENT_LENGTH,
    // 429 answers (a full function-call queue) carry their retry hint through.
    header::RETRY_AFTER,
];

fn is_dsec_header(name: &HeaderName) -> bool {
    name.as_str().starts_with("x-dsec-")
}

/// A request body to forward.
pub enum ForwardBody {
    Empty,
    Bytes(Bytes),
    /// Streamed as it arrives, never buffered.
    Stream(Body),
}

#[derive(Clone)]
pub struct Forwarder {
    http: reqwest::Client,
    watcher: Watcher,
    metrics: Arc<Metrics>,
}

impl Forwarder {
    pub fn new(http: reqwest::Client, watcher: Watcher, metrics: Arc<Metrics>) -> Self {
        Forwarder {
            http,
            watcher,
            metrics,
        }
    }

    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    pub fn watcher(&self) -> &Watcher {
        &self.watcher
    }

    /// The edge owning sandbox `id`.
    pub fn edge_for_sandbox(&self, id: &str) -> Result<EdgeEndpoint, ApiError> {
        let node =
            dsec_wire::id::node_of(id).ok_or_else(|| ApiError::SandboxNotFound(id.to_string()))?;
        let Some((edge, healthy, last_error)) = self.watcher.endpoint_for(node) else {
            // Every configured edge has said who it is and none is `node`: to this cluster
            // the sandbox does not exist. Otherwise it may belong to an edge not heard yet.
            if self
                .watcher
                .with(|ns| ns.iter().all(|n| n.node_id.is_some()))
            {
                return Err(ApiError::SandboxNotFound(id.to_string()));
            }
            return Err(ApiError::NodeUnavailable(format!(
                "node {node:?} of sandbox {id} is not known to this apiserver yet (an edge has not answered since it started); retry shortly"
            )));
        };
        if !healthy {
            // Fail fast: the watcher will notice when it answers again.
            return Err(ApiError::NodeUnavailable(format!(
                "node {node} of sandbox {id} is unhealthy or unreachable ({}); its sandboxes cannot be reached until it rejoins",
                last_error.unwrap_or_else(|| "not answering".into())
            )));
        }
        Ok(edge)
    }

    /// Sends one request to `edge` and returns its answer as a streaming response
    /// (status, content type, length and `x-dsec-*` headers kept; error bodies unchanged).
    pub async fn forward(
        &self,
        edge: &EdgeEndpoint,
        method: Method,
        path_and_query: &str,
        headers: &HeaderMap,
        body: ForwardBody,
        route: &str,
    ) -> Result<Response, ApiError> {
        let resp = self
            .send(edge, method, path_and_query, headers, body, route)
            .await?;
        // A small answer of known length (most JSON answers: a stop, a get, an error) is read
        // whole and answered in one piece: hyper then writes head and body in one syscall, and
        // no stream is set up. Anything longer or of unknown length is streamed as before.
        if resp.content_length().is_some_and(|n| n <= SMALL_ANSWER) {
            let (status, headers) = answer_head(&resp);
            let bytes = resp.bytes().await.map_err(|e| {
                let node = edge.node_id.clone().unwrap_or_else(|| edge.url.clone());
                ApiError::NodeUnavailable(format!(
                    "edge {node}: reading its answer failed: {}",
                    error_chain(&e)
                ))
            })?;
            let mut out = Response::new(Body::from(bytes));
            *out.status_mut() = status;
            *out.headers_mut() = headers;
            return Ok(out);
        }
        Ok(into_response(resp))
    }

    /// Like [`Forwarder::forward`] but returns the raw edge response.
    pub async fn send(
        &self,
        edge: &EdgeEndpoint,
        method: Method,
        path_and_query: &str,
        headers: &HeaderMap,
        body: ForwardBody,
        route: &str,
    ) -> Result<reqwest::Response, ApiError> {
        let path = edge_path(path_and_query)
            .ok_or_else(|| ApiError::Internal(format!("cannot forward path {path_and_query}")))?;
        let url = format!("{}{}", edge.url, path);
        let mut req = self.http.request(method, &url).bearer_auth(&edge.token);
        for (name, value) in headers.iter() {
            if REQUEST_HEADERS.contains(name) || is_dsec_header(name) {
                req = req.header(name, value);
            }
        }
        req = match body {
            ForwardBody::Empty => req,
            ForwardBody::Bytes(b) => req.body(b),
            ForwardBody::Stream(b) => req.body(reqwest::Body::wrap_stream(b.into_data_stream())),
        };
        let started = Instant::now();
        let result = req.send().await;
        self.metrics
            .forward_seconds
            .with_label_values(&[route])
            .observe(started.elapsed().as_secs_f64());
        result.map_err(|e| self.unreachable(edge, &url, e))
    }

    fn unreachable(&self, edge: &EdgeEndpoint, url: &str, e: reqwest::Error) -> ApiError {
        let node = edge.node_id.clone().unwrap_or_else(|| edge.url.clone());
        self.metrics
            .forward_errors
            .with_label_values(&[&node])
            .inc();
        let msg = format!("edge {node} is unreachable ({url}): {}", error_chain(&e));
        if e.is_connect() {
            self.watcher.mark_unreachable(&edge.url, &msg);
        }
        tracing::warn!("{msg}");
        ApiError::NodeUnavailable(msg)
    }

    /// Connects to the edge's TTY WebSocket; on an HTTP refusal returns the edge's answer.
    pub async fn connect_tty(
        &self,
        edge: &EdgeEndpoint,
        path_and_query: &str,
    ) -> Result<EdgeSocket, Response> {
        let path = edge_path(path_and_query).ok_or_else(|| {
            ApiError::Internal(format!("cannot forward path {path_and_query}")).into_response()
        })?;
        let url = ws_url(&edge.url, &path).ok_or_else(|| {
            ApiError::Internal(format!("edge url {} is not http(s)", edge.url)).into_response()
        })?;
        use tungstenite::client::IntoClientRequest;
        let mut req = url
            .as_str()
            .into_client_request()
            .map_err(|e| ApiError::Internal(format!("edge tty url {url}: {e}")).into_response())?;
        let auth = HeaderValue::from_str(&format!("Bearer {}", edge.token)).map_err(|_| {
            ApiError::Internal("edge token is not a valid header".into()).into_response()
        })?;
        req.headers_mut().insert(header::AUTHORIZATION, auth);
        match tokio_tungstenite::connect_async(req).await {
            Ok((socket, _)) => Ok(socket),
            Err(tungstenite::Error::Http(resp)) => {
                let status =
                    StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
                let body = resp.body().clone().unwrap_or_default();
                Err((status, [(header::CONTENT_TYPE, "application/json")], body).into_response())
            }
            Err(e) => {
                let node = edge.node_id.clone().unwrap_or_else(|| edge.url.clone());
                Err(
                    ApiError::NodeUnavailable(format!("edge {node} is unreachable ({url}): {e}"))
                        .into_response(),
                )
            }
        }
    }
}

pub type EdgeSocket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Pumps frames both ways until either side closes.
pub async fn pump_ws(client: WebSocket, edge: EdgeSocket) {
    let (mut c_tx, mut c_rx) = client.split();
    let (mut e_tx, mut e_rx) = edge.split();
    let up = async {
        while let Some(Ok(msg)) = c_rx.next().await {
            let out = match msg {
                ws::Message::Text(t) => tungstenite::Message::text(t.as_str()),
                ws::Message::Binary(b) => tungstenite::Message::binary(b),
                ws::Message::Ping(b) => tungstenite::Message::Ping(b),
                ws::Message::Pong(b) => tungstenite::Message::Pong(b),
                ws::Message::Close(_) => break,
            };
            if e_tx.send(out).await.is_err() {
                break;
            }
        }
        let _ = e_tx.close().await;
    };
    let down = async {
        while let Some(Ok(msg)) = e_rx.next().await {
            let out = match msg {
                tungstenite::Message::Text(t) => ws::Message::Text(t.as_str().into()),
                tungstenite::Message::Binary(b) => ws::Message::Binary(b),
                tungstenite::Message::Ping(b) => ws::Message::Ping(b),
                tungstenite::Message::Pong(b) => ws::Message::Pong(b),
                tungstenite::Message::Close(_) => break,
                tungstenite::Message::Frame(_) => continue,
            };
            if c_tx.send(out).await.is_err() {
                break;
            }
        }
        let _ = c_tx.close().await;
    };
    // When one direction ends, the other is dropped (closing its socket half).
    tokio::select! {
        _ = up => {}
        _ = down => {}
    }
}

/// Largest edge answer (by its `Content-Length`) read whole instead of streamed.
const SMALL_ANSWER: u64 = 64 * 1024;

/// Status and passed-on headers of an edge answer.
fn answer_head(resp: &reqwest::Response) -> (StatusCode, HeaderMap) {
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut headers = HeaderMap::new();
    for (name, value) in resp.headers().iter() {
        if RESPONSE_HEADERS.contains(name) || is_dsec_header(name) {
            headers.insert(name.clone(), value.clone());
        }
    }
    (status, headers)
}

/// Converts an edge answer into ours, streaming the body.
pub fn into_response(resp: reqwest::Response) -> Response {
    let (status, headers) = answer_head(&resp);
    let body = Body::from_stream(resp.bytes_stream());
    let mut out = Response::new(body);
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    out
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_paths() {
        assert_eq!(
            edge_path("/v1/sandboxes/sb-n0-0000000000000000/files?path=/a%20b").as_deref(),
            Some("/edge/v1/sandboxes/sb-n0-0000000000000000/files?path=/a%20b")
        );
        assert_eq!(edge_path("/v1/images").as_deref(), Some("/edge/v1/images"));
        assert_eq!(edge_path("/v1?x=1").as_deref(), Some("/edge/v1?x=1"));
        assert_eq!(edge_path("/v10/images"), None);
        assert_eq!(edge_path("/edge/v1/images"), None);
    }

    #[test]
    fn ws_urls() {
        assert_eq!(
            ws_url("http://127.0.0.1:1", "/edge/v1/x").as_deref(),
            Some("ws://127.0.0.1:1/edge/v1/x")
        );
        assert_eq!(ws_url("https://h", "/p").as_deref(), Some("wss://h/p"));
        assert_eq!(ws_url("ftp://h", "/p"), None);
    }
}
