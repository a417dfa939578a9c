//! What a call result keeps in its record, and how it is answered again from it.

use bytes::Bytes;
use dsec_wire::api::{CommandResult, FileDigest, FileInfo, FileList, TrajectoryRecord};
use serde_json::{json, Value};

use crate::blobs::BlobStore;
use crate::error::TrajectoryError;
use crate::sha256_hex;

/// What a finished call contributes to its record.
#[derive(Debug, Default)]
pub struct Outcome {
    pub exit_code: Option<i32>,
    pub result: Value,
    /// Output kept out of line: field → bytes (stored by sha256).
    pub blobs: Vec<(String, Vec<u8>)>,
    pub files_written: Vec<FileDigest>,
}

/// A call result that can be recorded and answered again from its record.
pub trait Recorded: Sized + Send + Sync + 'static {
    fn outcome(&self, inline: usize) -> Outcome;
    fn restore(rec: &TrajectoryRecord, blobs: &BlobStore) -> Result<Self, TrajectoryError>;
}

fn restore_json<T: serde::de::DeserializeOwned>(
    rec: &TrajectoryRecord,
) -> Result<T, TrajectoryError> {
    serde_json::from_value(rec.result.clone()).map_err(|e| TrajectoryError::UnreadableResult {
        seq: rec.seq,
        kind: rec.kind.clone(),
        reason: e.to_string(),
    })
}

/// The bytes of a wire text field and its optional base64 twin (set when not UTF-8).
pub fn bytes_of(text: &str, b64: &Option<String>) -> Vec<u8> {
    use base64::Engine as _;
    b64.as_ref()
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .unwrap_or_else(|| text.as_bytes().to_vec())
}

/// Wire form of output bytes: the text (lossy), and base64 when it is not UTF-8.
pub fn text_and_b64(bytes: &[u8]) -> (String, Option<String>) {
    use base64::Engine as _;
    match std::str::from_utf8(bytes) {
        Ok(s) => (s.to_string(), None),
        Err(_) => (
            String::from_utf8_lossy(bytes).into_owned(),
            Some(base64::engine::general_purpose::STANDARD.encode(bytes)),
        ),
    }
}

impl Recorded for CommandResult {
    fn outcome(&self, inline: usize) -> Outcome {
        let mut kept = self.clone();
        let mut blobs = Vec::new();
        let out = bytes_of(&self.stdout, &self.stdout_b64);
        if out.len() > inline {
            kept.stdout.clear();
            kept.stdout_b64 = None;
            blobs.push(("stdout".to_string(), out));
        }
        let err = bytes_of(&self.stderr, &self.stderr_b64);
        if err.len() > inline {
            kept.stderr.clear();
            kept.stderr_b64 = None;
            blobs.push(("stderr".to_string(), err));
        }
        Outcome {
            exit_code: Some(self.exit_code),
            result: serde_json::to_value(&kept).unwrap_or(Value::Null),
            blobs,
            files_written: Vec::new(),
        }
    }

    fn restore(rec: &TrajectoryRecord, blobs: &BlobStore) -> Result<Self, TrajectoryError> {
        let mut r: CommandResult = restore_json(rec)?;
        if let Some(d) = rec.blobs.get("stdout") {
            let (s, b) = text_and_b64(&blobs.get(d)?);
            r.stdout = s;
            r.stdout_b64 = b;
        }
        if let Some(d) = rec.blobs.get("stderr") {
            let (s, b) = text_and_b64(&blobs.get(d)?);
            r.stderr = s;
            r.stderr_b64 = b;
        }
        Ok(r)
    }
}

macro_rules! recorded_json {
    ($t:ty) => {
        impl Recorded for $t {
            fn outcome(&self, _inline: usize) -> Outcome {
                Outcome {
                    result: serde_json::to_value(self).unwrap_or(Value::Null),
                    ..Default::default()
                }
            }
            fn restore(
                rec: &TrajectoryRecord,
                _blobs: &BlobStore,
            ) -> Result<Self, TrajectoryError> {
                restore_json(rec)
            }
        }
    };
}
recorded_json!(FileInfo);
recorded_json!(FileList);
recorded_json!(());

/// The answer of a file upload, with the digest of what was written.
#[derive(Debug, Clone)]
pub struct Written {
    pub info: FileInfo,
    pub sha256: String,
    pub size: u64,
    /// The content, kept by digest so that `dsec replay` can write it again (stepped uploads).
    pub data: Option<Bytes>,
}

impl Recorded for Written {
    fn outcome(&self, _inline: usize) -> Outcome {
        Outcome {
            result: serde_json::to_value(&self.info).unwrap_or(Value::Null),
            files_written: vec![FileDigest {
                path: self.info.path.clone(),
                sha256: self.sha256.clone(),
                size: self.size,
            }],
            blobs: self
                .data
                .iter()
                .map(|d| ("content".to_string(), d.to_vec()))
                .collect(),
            ..Default::default()
        }
    }
    fn restore(rec: &TrajectoryRecord, _blobs: &BlobStore) -> Result<Self, TrajectoryError> {
        let info: FileInfo = restore_json(rec)?;
        let (sha256, size) = rec
            .files_written
            .first()
            .map(|f| (f.sha256.clone(), f.size))
            .unwrap_or_default();
        Ok(Written {
            info,
            sha256,
            size,
            data: None,
        })
    }
}

/// A whole file read, as a stepped `read_file` records it.
#[derive(Debug, Clone)]
pub struct Content {
    pub mode: u32,
    pub data: Bytes,
}

impl Recorded for Content {
    fn outcome(&self, inline: usize) -> Outcome {
        use base64::Engine as _;
        let mut result = json!({
            "mode": self.mode,
            "size": self.data.len(),
            "sha256": sha256_hex(&self.data),
        });
        let mut blobs = Vec::new();
        if self.data.len() > inline {
            blobs.push(("content".to_string(), self.data.to_vec()));
        } else {
            result["content_b64"] =
                Value::String(base64::engine::general_purpose::STANDARD.encode(&self.data));
        }
        Outcome {
            result,
            blobs,
            ..Default::default()
        }
    }
    fn restore(rec: &TrajectoryRecord, blobs: &BlobStore) -> Result<Self, TrajectoryError> {
        use base64::Engine as _;
        let mode = rec
            .result
            .get("mode")
            .and_then(Value::as_u64)
            .unwrap_or(0o644) as u32;
        let data = match (rec.blobs.get("content"), rec.result.get("content_b64")) {
            (Some(d), _) => blobs.get(d)?,
            (None, Some(Value::String(b))) => base64::engine::general_purpose::STANDARD
                .decode(b)
                .map_err(|e| TrajectoryError::UnreadableContent {
                seq: rec.seq,
                reason: e.to_string(),
            })?,
            (None, _) => Vec::new(),
        };
        Ok(Content {
            mode,
            data: Bytes::from(data),
        })
    }
}
