//! Calls from the envd layer to dsec's native sandbox API on the sandbox's edge
//! (`/v1/sandboxes/{id}/...`, forwarded like any native call), with the edge's error answers
//! turned into Connect errors.

use axum::http::{header, HeaderMap, HeaderValue, Method};
use bytes::Bytes;
use dsec_e2b_envd::connect::{Code, ConnectError};
use dsec_wire::api::{ErrorBody, SandboxInfo};
use futures::{Stream, StreamExt};
use serde::de::DeserializeOwned;

use crate::config::EdgeEndpoint;
use crate::error::ApiError;
use crate::forward::ForwardBody;
use crate::routes::AppState;

/// The route label of envd traffic in the forwarding metrics.
const ROUTE: &str = "/e2b/envd";

/// The native API of one sandbox.
pub struct Native<'a> {
    st: &'a AppState,
    id: String,
    edge: EdgeEndpoint,
}

/// A Connect error for an apiserver error (unknown sandbox, node down, ...).
pub fn from_api_error(e: ApiError) -> ConnectError {
    let code = match &e {
        ApiError::SandboxNotFound(_) | ApiError::NotFound(_) => Code::NotFound,
        ApiError::NodeUnavailable(_) | ApiError::PortUnreachable(_) => Code::Unavailable,
        ApiError::SandboxDead(_) => Code::NotFound,
        ApiError::BadRequest(_) => Code::InvalidArgument,
        ApiError::Unauthorized | ApiError::TokenRefused(_) => Code::Unauthenticated,
        ApiError::Forbidden(_) => Code::PermissionDenied,
        ApiError::QuotaExceeded(_) => Code::ResourceExhausted,
        ApiError::Conflict(_) => Code::AlreadyExists,
        ApiError::PayloadTooLarge(_) => Code::ResourceExhausted,
        ApiError::Internal(_) => Code::Internal,
    };
    ConnectError::new(code, e.to_string())
}

/// A Connect error for an edge's non-success answer (its `{"error": {code, message}}` body).
pub fn from_edge_answer(status: u16, body: &[u8]) -> ConnectError {
    let (dsec_code, message) = match serde_json::from_slice::<ErrorBody>(body) {
        Ok(b) => (b.error.code, b.error.message),
        Err(_) => (
            String::new(),
            format!("HTTP {status}: {}", String::from_utf8_lossy(body).trim()),
        ),
    };
    let code = match dsec_code.as_str() {
        "file_not_found" | "sandbox_not_found" | "not_found" | "sandbox_dead" => Code::NotFound,
        "conflict" => Code::AlreadyExists,
        "unsupported" => Code::Unimplemented,
        "sandbox_busy" | "node_unavailable" => Code::Unavailable,
        "quota_exceeded" | "node_full" => Code::ResourceExhausted,
        _ => Code::from_http_status(status),
    };
    ConnectError::new(code, message)
}

fn json_headers() -> HeaderMap {
    let mut h = HeaderMap::new();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    h
}

/// Percent-encodes a query parameter value.
pub fn q(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl<'a> Native<'a> {
    pub fn new(st: &'a AppState, id: &str) -> Result<Native<'a>, ConnectError> {
        let edge = st.forwarder.edge_for_sandbox(id).map_err(from_api_error)?;
        Ok(Native {
            st,
            id: id.to_string(),
            edge,
        })
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    /// Sends `method /v1/sandboxes/{id}{rest}`; a non-success answer is returned as an error.
    pub async fn send(
        &self,
        method: Method,
        rest: &str,
        headers: &HeaderMap,
        body: ForwardBody,
    ) -> Result<reqwest::Response, ConnectError> {
        let path = format!("/v1/sandboxes/{}{rest}", self.id);
        let resp = self
            .st
            .forwarder
            .send(&self.edge, method, &path, headers, body, ROUTE)
            .await
            .map_err(from_api_error)?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let body = resp.bytes().await.unwrap_or_default();
        Err(from_edge_answer(status, &body))
    }

    /// A JSON call: `body` (if any) sent as JSON, the answer decoded as `T`.
    pub async fn json<T: DeserializeOwned>(
        &self,
        method: Method,
        rest: &str,
        body: Option<serde_json::Value>,
    ) -> Result<T, ConnectError> {
        let body = match body {
            Some(v) => ForwardBody::Bytes(Bytes::from(v.to_string())),
            None => ForwardBody::Empty,
        };
        let resp = self.send(method, rest, &json_headers(), body).await?;
        let bytes = resp.bytes().await.map_err(|e| {
            ConnectError::new(
                Code::Unavailable,
                format!("reading the sandbox's answer failed: {e}"),
            )
        })?;
        serde_json::from_slice(&bytes).map_err(|e| {
            ConnectError::new(
                Code::Internal,
                format!("decoding the sandbox's answer failed: {e}"),
            )
        })
    }

    /// A call whose answer body is ignored.
    pub async fn call(
        &self,
        method: Method,
        rest: &str,
        body: Option<serde_json::Value>,
    ) -> Result<(), ConnectError> {
        let body = match body {
            Some(v) => ForwardBody::Bytes(Bytes::from(v.to_string())),
            None => ForwardBody::Empty,
        };
        self.send(method, rest, &json_headers(), body).await?;
        Ok(())
    }

    /// The sandbox's native description.
    pub async fn sandbox(&self) -> Result<SandboxInfo, ConnectError> {
        self.json(Method::GET, "", None).await
    }

    /// An NDJSON answer as a stream of decoded lines.
    pub async fn ndjson<T: DeserializeOwned + Send + 'static>(
        &self,
        rest: &str,
    ) -> Result<impl Stream<Item = Result<T, ConnectError>> + Send + 'static, ConnectError> {
        let resp = self
            .send(Method::GET, rest, &HeaderMap::new(), ForwardBody::Empty)
            .await?;
        Ok(ndjson_lines(resp.bytes_stream()))
    }
}

/// Splits a byte stream into NDJSON lines and decodes each.
pub fn ndjson_lines<T, S, E>(bytes: S) -> impl Stream<Item = Result<T, ConnectError>> + Send
where
    T: DeserializeOwned + Send + 'static,
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
    E: std::fmt::Display + Send + 'static,
{
    futures::stream::unfold(
        (bytes, Vec::<u8>::new(), false),
        |(mut bytes, mut buf, done)| async move {
            if done {
                return None;
            }
            loop {
                if let Some(i) = buf.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=i).collect();
                    let line = &line[..line.len() - 1];
                    if line.iter().all(|b| b.is_ascii_whitespace()) {
                        continue;
                    }
                    let item = serde_json::from_slice::<T>(line).map_err(|e| {
                        ConnectError::new(
                            Code::Internal,
                            format!("bad event from the sandbox: {e}"),
                        )
                    });
                    return Some((item, (bytes, buf, false)));
                }
                match bytes.next().await {
                    Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                    Some(Err(e)) => {
                        let err = ConnectError::new(
                            Code::Unavailable,
                            format!(
                                "the connection to sandbox ended before the stream completed: {e}"
                            ),
                        );
                        return Some((Err(err), (bytes, buf, true)));
                    }
                    None => return None,
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edge_errors_map_to_connect_codes() {
        let e = from_edge_answer(
            404,
            br#"{"error":{"code":"file_not_found","message":"no such file /x"}}"#,
        );
        assert_eq!(e.code, Code::NotFound);
        assert_eq!(e.message, "no such file /x");
        assert_eq!(
            from_edge_answer(400, br#"{"error":{"code":"bad_request","message":"m"}}"#).code,
            Code::InvalidArgument
        );
        let e = from_edge_answer(502, b"gateway");
        assert_eq!(e.code, Code::Unavailable);
        assert!(e.message.contains("gateway"));
        assert_eq!(q("/a b/c&d"), "/a%20b/c%26d");
    }

    #[tokio::test]
    async fn ndjson_lines_split_across_chunks() {
        let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
            Ok(Bytes::from_static(b"{\"a\":1}\n{\"a\"")),
            Ok(Bytes::from_static(b":2}\n\n")),
        ];
        let s = ndjson_lines::<serde_json::Value, _, _>(futures::stream::iter(chunks));
        let v: Vec<_> = s.collect().await;
        assert_eq!(v.len(), 2);
        assert_eq!(v[1].as_ref().unwrap()["a"], 2);
    }
}
