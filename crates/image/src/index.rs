//! The on-disk image index (`<root>/index.json`): image name → layers.
//!
//! The file is rewritten atomically (temporary file, fsync, rename, fsync of the directory),
//! so a crash leaves either the old or the new index.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::name;
use crate::ImageError;

pub const INDEX_FILE: &str = "index.json";
const INDEX_VERSION: u32 = 1;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerRecord {
    /// Layer id, 64 lowercase hex characters: sha256 of the metadata image, or of
    /// `"<meta sha256>:<blob sha256>"` when the layer has a data blob.
    pub digest: String,
    /// Metadata image plus data blob.
    pub size_bytes: u64,
    /// sha256 of the metadata image (verified before the first mount on this node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta_sha256: Option<String>,
    #[serde(default)]
    pub meta_bytes: u64,
    /// Size of the data blob in the blob store; 0: no blob (all data in the metadata image).
    #[serde(default)]
    pub blob_bytes: u64,
    /// sha256 of the blob's length and its first and last 64 KiB (checked before mounting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blob_sample: Option<String>,
    /// Another node put it in the shared blob store (the layer came with an adopted image, see
    /// `store::publish`, or with an image derived from one): deleting it here deletes this
    /// node's copies, never the blob store's objects.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub foreign: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRecord {
    /// Bottom-most layer first.
    pub layers: Vec<LayerRecord>,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// The image this one was derived from (pack_diff).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// Where it came from (`dir`, `tar`, `docker-archive`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

impl ImageRecord {
    pub fn size_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.size_bytes).sum()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Index {
    pub version: u32,
    /// Keyed by canonical `name:tag`.
    pub images: BTreeMap<String, ImageRecord>,
}

/// Why the store's index file is not a valid index.
#[derive(Debug, thiserror::Error)]
pub enum IndexParseError {
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error("unsupported index version {0}")]
    Version(u32),
    #[error("bad image name {0:?}")]
    BadName(String),
    #[error("image {0} has no layers")]
    NoLayers(String),
    #[error("image {image} has a bad layer digest {digest:?}")]
    BadDigest { image: String, digest: String },
}

impl Index {
    pub fn new() -> Self {
        Index {
            version: INDEX_VERSION,
            images: BTreeMap::new(),
        }
    }

    /// Loads the index in `root`; a missing file is an empty index.
    pub fn load(root: &Path) -> Result<Self, ImageError> {
        let path = root.join(INDEX_FILE);
        let bytes = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Index::new()),
            Err(e) => return Err(e.into()),
        };
        Self::parse(&bytes).map_err(|msg| ImageError::Corrupt {
            path: path.clone(),
            message: msg.to_string(),
        })
    }

    /// Parses and validates an index (names canonical, digests well-formed).
    pub fn parse(bytes: &[u8]) -> Result<Self, IndexParseError> {
        let idx: Index = serde_json::from_slice(bytes)?;
        if idx.version != INDEX_VERSION {
            return Err(IndexParseError::Version(idx.version));
        }
        for (image, rec) in &idx.images {
            match name::canonical(image) {
                Ok(c) if &c == image => {}
                _ => return Err(IndexParseError::BadName(image.clone())),
            }
            if rec.layers.is_empty() {
                return Err(IndexParseError::NoLayers(image.clone()));
            }
            if let Some(l) = rec.layers.iter().find(|l| !name::is_digest(&l.digest)) {
                return Err(IndexParseError::BadDigest {
                    image: image.clone(),
                    digest: l.digest.clone(),
                });
            }
        }
        Ok(idx)
    }

    /// Writes the index to `root/index.json` atomically.
    pub fn save(&self, root: &Path) -> Result<(), ImageError> {
        let data = serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?;
        let tmp = root.join(format!("{INDEX_FILE}.tmp"));
        {
            let mut f = fs::File::create(&tmp)?;
            f.write_all(&data)?;
            f.sync_all()?;
        }
        fs::rename(&tmp, root.join(INDEX_FILE))?;
        fs::File::open(root)?.sync_all()?;
        Ok(())
    }

    /// The record of layer `digest` in any image.
    pub fn layer(&self, digest: &str) -> Option<&LayerRecord> {
        self.images
            .values()
            .flat_map(|r| r.layers.iter())
            .find(|l| l.digest == digest)
    }

    /// True if some image other than `except` uses `digest`.
    pub fn references(&self, digest: &str, except: Option<&str>) -> bool {
        self.images
            .iter()
            .filter(|(n, _)| Some(n.as_str()) != except)
            .any(|(_, r)| r.layers.iter().any(|l| l.digest == digest))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Index {
        let mut idx = Index::new();
        idx.images.insert(
            "debian:latest".into(),
            ImageRecord {
                layers: vec![
                    LayerRecord {
                        digest: "a".repeat(64),
                        size_bytes: 10,
                        ..LayerRecord::default()
                    },
                    LayerRecord {
                        digest: "b".repeat(64),
                        size_bytes: 5,
                        ..LayerRecord::default()
                    },
                ],
                created_at: "2025-01-01T00:00:00Z".into(),
                ..ImageRecord::default()
            },
        );
        idx.images.insert(
            "tool:v1".into(),
            ImageRecord {
                layers: vec![LayerRecord {
                    digest: "b".repeat(64),
                    size_bytes: 5,
                    ..LayerRecord::default()
                }],
                created_at: "2025-01-02T00:00:00Z".into(),
                ..ImageRecord::default()
            },
        );
        idx
    }

    #[test]
    fn round_trip_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Index::load(dir.path()).unwrap(), Index::new());
        let idx = sample();
        idx.save(dir.path()).unwrap();
        assert_eq!(Index::load(dir.path()).unwrap(), idx);
        assert!(!dir.path().join("index.json.tmp").exists());
        assert_eq!(idx.images["debian:latest"].size_bytes(), 15);
    }

    #[test]
    fn references() {
        let idx = sample();
        let b = "b".repeat(64);
        assert!(idx.references(&b, Some("debian:latest")));
        assert!(!idx.references(&"a".repeat(64), Some("debian:latest")));
        assert!(idx.references(&"a".repeat(64), None));
    }

    #[test]
    fn rejects_tampered_index() {
        let mut idx = sample();
        idx.images.get_mut("tool:v1").unwrap().layers[0].digest = "../../etc/passwd".into();
        let bytes = serde_json::to_vec(&idx).unwrap();
        assert!(Index::parse(&bytes)
            .unwrap_err()
            .to_string()
            .contains("bad layer digest"));

        let mut idx = sample();
        let rec = idx.images.remove("tool:v1").unwrap();
        idx.images.insert("tool".into(), rec);
        let bytes = serde_json::to_vec(&idx).unwrap();
        assert!(Index::parse(&bytes)
            .unwrap_err()
            .to_string()
            .contains("bad image name"));

        assert!(Index::parse(b"{not json").is_err());
    }
}
