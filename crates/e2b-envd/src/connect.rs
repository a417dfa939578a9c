//! The Connect protocol's framing and codecs, as far as a server needs them.
//!
//! Unary calls carry one bare message (`application/json` or `application/proto`) and answer
//! errors as an HTTP status plus a JSON body `{"code", "message"}`. Streaming calls
//! (`application/connect+json` / `application/connect+proto`) carry envelopes: one flags byte
//! (`0x01` compressed, `0x02` end of stream), a big-endian `u32` length and the payload; the
//! server's last envelope is the end-of-stream message (always JSON), which carries the error
//! of a failed stream, so a streaming answer's HTTP status is 200 once it has begun.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Envelope flag: the payload is compressed (we never compress, and refuse compressed input).
pub const FLAG_COMPRESSED: u8 = 0x01;
/// Envelope flag: the end-of-stream message.
pub const FLAG_END_STREAM: u8 = 0x02;
/// Largest message accepted in one envelope or unary body.
pub const MAX_MESSAGE: usize = 64 * 1024 * 1024;

/// How messages are encoded on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    /// proto3 JSON mapping (camelCase names, 64-bit integers as strings, bytes as base64).
    Json,
    /// Binary protobuf.
    Proto,
}

/// Whether a call is unary or streaming, as its content type says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Unary,
    Streaming,
}

impl Codec {
    /// The codec and kind of a request's `Content-Type` (parameters such as `charset` ignored);
    /// `None` when it is not a Connect content type.
    pub fn parse_content_type(content_type: &str) -> Option<(Codec, Kind)> {
        let base = content_type
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        match base.as_str() {
            "application/json" => Some((Codec::Json, Kind::Unary)),
            "application/proto" => Some((Codec::Proto, Kind::Unary)),
            "application/connect+json" => Some((Codec::Json, Kind::Streaming)),
            "application/connect+proto" => Some((Codec::Proto, Kind::Streaming)),
            _ => None,
        }
    }

    /// The codec of a content type, unary or streaming.
    pub fn from_content_type(content_type: &str) -> Option<Codec> {
        Self::parse_content_type(content_type).map(|(c, _)| c)
    }

    /// The content type an answer of this codec and kind carries.
    pub fn content_type(self, kind: Kind) -> &'static str {
        match (self, kind) {
            (Codec::Json, Kind::Unary) => "application/json",
            (Codec::Proto, Kind::Unary) => "application/proto",
            (Codec::Json, Kind::Streaming) => "application/connect+json",
            (Codec::Proto, Kind::Streaming) => "application/connect+proto",
        }
    }
}

/// A message of the envd protocol: binary protobuf (prost) and JSON (pbjson serde).
pub trait Msg: prost::Message + Default + Serialize + DeserializeOwned {}
impl<T: prost::Message + Default + Serialize + DeserializeOwned> Msg for T {}

/// Why a message could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeMessageError {
    #[error("invalid JSON message: {0}")]
    Json(#[from] serde_json::Error),
    #[error("invalid protobuf message: {0}")]
    Proto(#[from] prost::DecodeError),
}

/// Encodes one message (no envelope).
pub fn encode<M: Msg>(codec: Codec, msg: &M) -> Bytes {
    match codec {
        Codec::Proto => Bytes::from(msg.encode_to_vec()),
        // Serializing generated messages into a Vec cannot fail (string keys, no I/O).
        Codec::Json => Bytes::from(serde_json::to_vec(msg).unwrap_or_else(|_| b"{}".to_vec())),
    }
}

/// Decodes one message (no envelope). An empty JSON body reads as the default message.
pub fn decode<M: Msg>(codec: Codec, bytes: &[u8]) -> Result<M, DecodeMessageError> {
    match codec {
        Codec::Proto => Ok(M::decode(bytes)?),
        Codec::Json if bytes.iter().all(|b| b.is_ascii_whitespace()) => Ok(M::default()),
        Codec::Json => Ok(serde_json::from_slice(bytes)?),
    }
}

/// One envelope: flags, length, payload.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + payload.len());
    out.put_u8(flags);
    out.put_u32(payload.len() as u32);
    out.put_slice(payload);
    out.freeze()
}

/// A message in its streaming envelope.
pub fn encode_frame<M: Msg>(codec: Codec, msg: &M) -> Bytes {
    envelope(0, &encode(codec, msg))
}

/// The end-of-stream envelope: `{}` on success, `{"error": {...}}` on failure.
pub fn end_stream(error: Option<&ConnectError>) -> Bytes {
    let body = match error {
        None => serde_json::json!({}),
        Some(e) => serde_json::json!({ "error": e.to_json() }),
    };
    envelope(FLAG_END_STREAM, body.to_string().as_bytes())
}

/// One decoded envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub flags: u8,
    pub payload: Bytes,
}

impl Frame {
    pub fn is_end_stream(&self) -> bool {
        self.flags & FLAG_END_STREAM != 0
    }
}

/// Why a stream of envelopes is malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("envelope of {0} bytes exceeds the {MAX_MESSAGE}-byte limit")]
    TooLarge(usize),
    #[error("compressed envelopes are not supported (send with identity encoding)")]
    Compressed,
    #[error("the stream ended inside an envelope ({0} bytes left over)")]
    Truncated(usize),
}

/// Splits a byte stream into envelopes as its chunks arrive.
#[derive(Debug, Default)]
pub struct FrameReader {
    buf: BytesMut,
}

impl FrameReader {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a chunk of the stream.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete envelope, if one has arrived.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if self.buf.len() < 5 {
            return Ok(None);
        }
        let flags = self.buf[0];
        let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
        if len > MAX_MESSAGE {
            return Err(FrameError::TooLarge(len));
        }
        if flags & FLAG_COMPRESSED != 0 {
            return Err(FrameError::Compressed);
        }
        if self.buf.len() < 5 + len {
            return Ok(None);
        }
        self.buf.advance(5);
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(Frame { flags, payload }))
    }

    /// Call at the end of the stream: an error if bytes of an unfinished envelope remain.
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(FrameError::Truncated(self.buf.len()))
        }
    }
}

/// Connect's error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

impl Code {
    /// The code's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status a unary error of this code answers with (the Connect spec's table).
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::Unknown => 500,
            Code::InvalidArgument => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::FailedPrecondition => 400,
            Code::Aborted => 409,
            Code::OutOfRange => 400,
            Code::Unimplemented => 501,
            Code::Internal => 500,
            Code::Unavailable => 503,
            Code::DataLoss => 500,
            Code::Unauthenticated => 401,
        }
    }

    /// The code for an HTTP error status of a native (non-Connect) answer, e.g. the edge's.
    pub fn from_http_status(status: u16) -> Code {
        match status {
            400 | 413 | 422 => Code::InvalidArgument,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 | 410 => Code::NotFound,
            409 => Code::AlreadyExists,
            408 | 504 => Code::DeadlineExceeded,
            429 => Code::ResourceExhausted,
            499 => Code::Canceled,
            501 => Code::Unimplemented,
            502 | 503 => Code::Unavailable,
            _ => Code::Unknown,
        }
    }
}

/// An RPC's failure: a code and a message for the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct ConnectError {
    pub code: Code,
    pub message: String,
}

impl ConnectError {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        ConnectError {
            code,
            message: message.into(),
        }
    }

    /// The error's JSON object, as a unary error body or inside an end-of-stream message.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.as_str(), "message": self.message })
    }

    /// The unary error body.
    pub fn unary_body(&self) -> Bytes {
        Bytes::from(self.to_json().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::filesystem::{EntryInfo, FileType, ListDirRequest};
    use crate::pb::process::{
        process_event, process_selector, ProcessEvent, ProcessSelector, StartRequest, StartResponse,
    };

    #[test]
    fn content_types() {
        assert_eq!(
            Codec::parse_content_type("application/json; charset=utf-8"),
            Some((Codec::Json, Kind::Unary))
        );
        assert_eq!(
            Codec::parse_content_type("Application/Connect+Proto"),
            Some((Codec::Proto, Kind::Streaming))
        );
        assert_eq!(Codec::parse_content_type("text/plain"), None);
        assert_eq!(
            Codec::Json.content_type(Kind::Streaming),
            "application/connect+json"
        );
    }

    #[test]
    fn json_requests_use_camel_case_and_ignore_unknown_fields() {
        let body = br#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],
            "envs":{"A":"1"},"cwd":"/tmp"},"tag":"t1","stdin":false,"someNewField":3}"#;
        let req: StartRequest = decode(Codec::Json, body).unwrap();
        let p = req.process.unwrap();
        assert_eq!(p.cmd, "/bin/bash");
        assert_eq!(p.args, ["-l", "-c", "echo hi"]);
        assert_eq!(p.envs.get("A").map(String::as_str), Some("1"));
        assert_eq!(p.cwd.as_deref(), Some("/tmp"));
        assert_eq!(req.tag.as_deref(), Some("t1"));
        assert_eq!(req.stdin, Some(false));
        // An empty unary JSON body is the default message.
        let empty: ListDirRequest = decode(Codec::Json, b"").unwrap();
        assert_eq!(empty.depth, 0);
        assert!(decode::<ListDirRequest>(Codec::Json, b"{\"depth\":\"x\"}").is_err());
    }

    #[test]
    fn json_answers_follow_the_proto3_mapping() {
        let ev = StartResponse {
            event: Some(ProcessEvent {
                event: Some(process_event::Event::Data(process_event::DataEvent {
                    output: Some(process_event::data_event::Output::Stdout(b"hi\n".to_vec())),
                })),
            }),
        };
        let v: serde_json::Value = serde_json::from_slice(&encode(Codec::Json, &ev)).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"event": {"data": {"stdout": "aGkK"}}})
        );

        let end = StartResponse {
            event: Some(ProcessEvent {
                event: Some(process_event::Event::End(process_event::EndEvent {
                    exit_code: -2,
                    exited: true,
                    status: "exit status 254".into(),
                    error: None,
                })),
            }),
        };
        let v: serde_json::Value = serde_json::from_slice(&encode(Codec::Json, &end)).unwrap();
        assert_eq!(v["event"]["end"]["exitCode"], -2);
        assert_eq!(v["event"]["end"]["exited"], true);

        let entry = EntryInfo {
            name: "a".into(),
            r#type: FileType::File as i32,
            size: 12,
            ..Default::default()
        };
        let v: serde_json::Value = serde_json::from_slice(&encode(Codec::Json, &entry)).unwrap();
        assert_eq!(v["type"], "FILE_TYPE_FILE");
        // int64 is a string in proto3 JSON.
        assert_eq!(v["size"], "12");
    }

    #[test]
    fn binary_round_trip() {
        let sel = ProcessSelector {
            selector: Some(process_selector::Selector::Tag("web".into())),
        };
        let bytes = encode(Codec::Proto, &sel);
        assert_eq!(
            decode::<ProcessSelector>(Codec::Proto, &bytes).unwrap(),
            sel
        );
        assert!(decode::<ProcessSelector>(Codec::Proto, &[0xff, 0xff]).is_err());
    }

    #[test]
    fn frames_split_across_chunks() {
        let a = encode_frame(
            Codec::Json,
            &ListDirRequest {
                path: "/a".into(),
                depth: 2,
            },
        );
        let end = end_stream(None);
        let mut all = a.to_vec();
        all.extend_from_slice(&end);
        let mut r = FrameReader::new();
        let mut frames = vec![];
        for chunk in all.chunks(3) {
            r.push(chunk);
            while let Some(f) = r.next_frame().unwrap() {
                frames.push(f);
            }
        }
        r.finish().unwrap();
        assert_eq!(frames.len(), 2);
        assert!(!frames[0].is_end_stream());
        let m: ListDirRequest = decode(Codec::Json, &frames[0].payload).unwrap();
        assert_eq!((m.path.as_str(), m.depth), ("/a", 2));
        assert!(frames[1].is_end_stream());
        assert_eq!(&frames[1].payload[..], b"{}");

        let mut r = FrameReader::new();
        r.push(&envelope(FLAG_COMPRESSED, b"x"));
        assert_eq!(r.next_frame(), Err(FrameError::Compressed));
        let mut r = FrameReader::new();
        r.push(&[0, 0, 0, 0, 9, 1]);
        assert_eq!(r.next_frame(), Ok(None));
        assert_eq!(r.finish(), Err(FrameError::Truncated(6)));
        let mut r = FrameReader::new();
        r.push(&[0, 0xff, 0xff, 0xff, 0xff]);
        assert!(matches!(r.next_frame(), Err(FrameError::TooLarge(_))));
    }

    #[test]
    fn errors_in_end_stream_and_unary_bodies() {
        let e = ConnectError::new(Code::NotFound, "process with pid 7 not found");
        let f = end_stream(Some(&e));
        assert_eq!(f[0], FLAG_END_STREAM);
        let v: serde_json::Value = serde_json::from_slice(&f[5..]).unwrap();
        assert_eq!(v["error"]["code"], "not_found");
        assert_eq!(v["error"]["message"], "process with pid 7 not found");
        let v: serde_json::Value = serde_json::from_slice(&e.unary_body()).unwrap();
        assert_eq!(v["code"], "not_found");
    }

    #[test]
    fn codes_map_to_statuses_and_back() {
        for (code, status) in [
            (Code::InvalidArgument, 400),
            (Code::Unauthenticated, 401),
            (Code::PermissionDenied, 403),
            (Code::NotFound, 404),
            (Code::AlreadyExists, 409),
            (Code::ResourceExhausted, 429),
            (Code::Unimplemented, 501),
            (Code::DeadlineExceeded, 504),
        ] {
            assert_eq!(code.http_status(), status);
            assert_eq!(Code::from_http_status(status), code);
        }
        assert_eq!(Code::Unavailable.http_status(), 503);
        assert_eq!(Code::from_http_status(502), Code::Unavailable);
        assert_eq!(Code::from_http_status(500), Code::Unknown);
    }
}
