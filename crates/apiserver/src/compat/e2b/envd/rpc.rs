//! Connect RPC on the apiserver: reading a call's message(s) and answering unary calls and
//! streams (envelopes, end-of-stream message with the error, the caller's deadline).

use std::future::Future;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dsec_e2b_envd::connect::{self, Code, Codec, ConnectError, FrameReader, Kind, Msg};
use futures::channel::mpsc;
use futures::{SinkExt, StreamExt};

/// One Connect call: how it is encoded, its deadline, its headers and body.
pub struct Call {
    pub codec: Codec,
    pub kind: Kind,
    /// `Connect-Timeout-Ms`.
    pub timeout: Option<Duration>,
    pub headers: HeaderMap,
    pub body: Body,
}

/// A Connect call from an HTTP request; a request that is not one answers 415.
pub fn call_of(req: Request) -> Result<Call, Box<Response>> {
    let (parts, body) = req.into_parts();
    let ct = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let Some((codec, kind)) = Codec::parse_content_type(ct) else {
        let e = ConnectError::new(
            Code::InvalidArgument,
            format!("content type {ct:?} is not a Connect content type (application/json, application/proto, application/connect+json, application/connect+proto)"),
        );
        let mut r = unary_error(&e);
        *r.status_mut() = StatusCode::UNSUPPORTED_MEDIA_TYPE;
        return Err(Box::new(r));
    };
    if let Some(enc) = parts
        .headers
        .get("connect-content-encoding")
        .or_else(|| parts.headers.get(header::CONTENT_ENCODING))
        .and_then(|v| v.to_str().ok())
    {
        if !enc.eq_ignore_ascii_case("identity") {
            return Err(Box::new(error_for(
                kind,
                &ConnectError::new(
                    Code::Unimplemented,
                    format!("compression {enc:?} is not supported; send uncompressed messages"),
                ),
            )));
        }
    }
    let timeout = parts
        .headers
        .get("connect-timeout-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms > 0)
        .map(Duration::from_millis);
    Ok(Call {
        codec,
        kind,
        timeout,
        headers: parts.headers,
        body,
    })
}

fn bad_message(e: impl std::fmt::Display) -> ConnectError {
    ConnectError::new(
        Code::InvalidArgument,
        format!("malformed request message: {e}"),
    )
}

impl Call {
    /// The one request message of a unary or server-streaming call.
    pub async fn message<M: Msg>(&mut self) -> Result<M, ConnectError> {
        let body = std::mem::take(&mut self.body);
        let bytes = axum::body::to_bytes(body, connect::MAX_MESSAGE)
            .await
            .map_err(|e| {
                ConnectError::new(Code::InvalidArgument, format!("read request body: {e}"))
            })?;
        match self.kind {
            Kind::Unary => connect::decode(self.codec, &bytes).map_err(bad_message),
            Kind::Streaming => {
                let mut r = FrameReader::new();
                r.push(&bytes);
                let frame = r
                    .next_frame()
                    .map_err(bad_message)?
                    .ok_or_else(|| bad_message("no message envelope in the request"))?;
                connect::decode(self.codec, &frame.payload).map_err(bad_message)
            }
        }
    }

    /// The messages of a client-streaming call, as they arrive.
    pub fn messages<M: Msg + Send + 'static>(
        &mut self,
    ) -> impl futures::Stream<Item = Result<M, ConnectError>> + Send + 'static {
        let codec = self.codec;
        let body = std::mem::take(&mut self.body).into_data_stream();
        futures::stream::unfold(
            (body, FrameReader::new(), false),
            move |(mut body, mut reader, done)| async move {
                if done {
                    return None;
                }
                loop {
                    match reader.next_frame() {
                        Err(e) => return Some((Err(bad_message(e)), (body, reader, true))),
                        Ok(Some(f)) if f.is_end_stream() => return None,
                        Ok(Some(f)) => {
                            let m = connect::decode(codec, &f.payload).map_err(bad_message);
                            return Some((m, (body, reader, false)));
                        }
                        Ok(None) => {}
                    }
                    match body.next().await {
                        Some(Ok(chunk)) => reader.push(&chunk),
                        Some(Err(e)) => {
                            let e =
                                ConnectError::new(Code::Canceled, format!("request stream: {e}"));
                            return Some((Err(e), (body, reader, true)));
                        }
                        None => {
                            return match reader.finish() {
                                Ok(()) => None,
                                Err(e) => Some((Err(bad_message(e)), (body, reader, true))),
                            }
                        }
                    }
                }
            },
        )
    }
}

/// A unary error answer: the code's HTTP status and `{"code", "message"}`.
pub fn unary_error(e: &ConnectError) -> Response {
    let status =
        StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        e.unary_body(),
    )
        .into_response()
}

/// An error answered the way the call's kind requires (a stream: 200 and end-of-stream).
pub fn error_for(kind: Kind, e: &ConnectError) -> Response {
    match kind {
        Kind::Unary => unary_error(e),
        Kind::Streaming => stream_body(Codec::Json, Body::from(connect::end_stream(Some(e)))),
    }
}

/// A unary answer.
pub fn unary<M: Msg>(codec: Codec, result: Result<M, ConnectError>) -> Response {
    match result {
        Ok(m) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(codec.content_type(Kind::Unary)),
            )],
            connect::encode(codec, &m),
        )
            .into_response(),
        Err(e) => unary_error(&e),
    }
}

/// The answer of a client-streaming call: one message, then the end of the stream.
pub fn client_stream_answer<M: Msg>(codec: Codec, result: Result<M, ConnectError>) -> Response {
    let bytes = match result {
        Ok(m) => {
            let mut b = connect::encode_frame(codec, &m).to_vec();
            b.extend_from_slice(&connect::end_stream(None));
            Bytes::from(b)
        }
        Err(e) => connect::end_stream(Some(&e)),
    };
    stream_body(codec, Body::from(bytes))
}

fn stream_body(codec: Codec, body: Body) -> Response {
    let mut r = Response::new(body);
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(codec.content_type(Kind::Streaming)),
    );
    r
}

/// Sends the messages of a server stream.
pub struct Sink {
    codec: Codec,
    tx: mpsc::Sender<Bytes>,
}

impl Sink {
    /// Sends one message; false once the caller has gone away.
    pub async fn send<M: Msg>(&mut self, m: &M) -> bool {
        self.tx
            .send(connect::encode_frame(self.codec, m))
            .await
            .is_ok()
    }

    /// Whether the caller has gone away.
    pub fn closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// A server-streaming answer: `produce` sends messages through its `Sink`; its result (or the
/// caller's deadline passing) becomes the end-of-stream message.
pub fn server_stream<F, Fut>(codec: Codec, timeout: Option<Duration>, produce: F) -> Response
where
    F: FnOnce(Sink) -> Fut,
    Fut: Future<Output = Result<(), ConnectError>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel::<Bytes>(32);
    let mut end_tx = tx.clone();
    let fut = produce(Sink { codec, tx });
    tokio::spawn(async move {
        let result = match timeout {
            Some(t) => match tokio::time::timeout(t, fut).await {
                Ok(r) => r,
                Err(_) => Err(ConnectError::new(
                    Code::DeadlineExceeded,
                    format!("the call's deadline of {} ms passed", t.as_millis()),
                )),
            },
            None => fut.await,
        };
        let _ = end_tx
            .send(connect::end_stream(result.err().as_ref()))
            .await;
    });
    stream_body(
        codec,
        Body::from_stream(rx.map(Ok::<_, std::convert::Infallible>)),
    )
}
