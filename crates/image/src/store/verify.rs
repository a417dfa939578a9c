//! Verifying a layer before its first mount on this node (metadata sha256, blob size and samples).

use std::fs;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use super::{blob_key, meta_key, Inner, StoreReader};
use crate::import::{self};
use crate::index::LayerRecord;

impl Inner {
    /// Before the first mount of a layer on this node: fetches its metadata image from the
    /// blob store if it is not on local disk, checks the metadata image's sha256, and checks
    /// the data blob's size and the digest of its first and last 64 KiB. Returns the blob's
    /// path for `device=`. A layer that fails is reported, never mounted: a truncated or
    /// replaced blob cannot leave a sandbox hanging on reads of missing blocks.
    pub(super) fn verify_layer(&self, rec: &LayerRecord) -> std::io::Result<Option<PathBuf>> {
        use std::io::{Error, ErrorKind};
        let digest = &rec.digest;
        let file = self.layer_path(digest);
        if !file.exists() {
            let tmp = self.tmp_path("meta");
            match self.blobs.fetch(&meta_key(digest), &tmp) {
                Ok(n) => {
                    self.stats.meta_fetches.fetch_add(1, Ordering::Relaxed);
                    self.stats.meta_fetch_bytes.fetch_add(n, Ordering::Relaxed);
                    fs::rename(&tmp, &file)?
                }
                Err(e) => {
                    let _ = fs::remove_file(&tmp);
                    return Err(Error::new(
                        e.kind(),
                        format!(
                            "layer {digest}: metadata image is neither on local disk nor in the blob store {} ({e}); re-import the image",
                            self.blobs.describe()
                        ),
                    ));
                }
            }
        }
        if let Some(want) = &rec.meta_sha256 {
            let (got, _) = import::sha256_file(&file)?;
            if &got != want {
                return Err(Error::new(
                    ErrorKind::InvalidData,
                    format!(
                        "layer {digest}: metadata image {} is corrupt (sha256 {got}, expected {want}); remove and re-import the image",
                        file.display()
                    ),
                ));
            }
        }
        if rec.blob_bytes == 0 {
            return Ok(None);
        }
        let key = blob_key(digest);
        let corrupt = |what: String| {
            Error::new(
                ErrorKind::InvalidData,
                format!(
                    "layer {digest}: data blob {key} in {} is {what}; restore it or re-import the image",
                    self.blobs.describe()
                ),
            )
        };
        match self.blobs.size(&key)? {
            None => return Err(corrupt("missing".into())),
            Some(n) if n != rec.blob_bytes => {
                return Err(corrupt(format!(
                    "truncated or wrong ({n} bytes, expected {})",
                    rec.blob_bytes
                )))
            }
            Some(_) => {}
        }
        self.stats
            .blob_verifications
            .fetch_add(1, Ordering::Relaxed);
        if let Some(want) = &rec.blob_sample {
            let mut reader = StoreReader {
                store: self.blobs.as_ref(),
                key: &key,
            };
            let got = import::sample_digest(&mut reader, rec.blob_bytes)?;
            if &got != want {
                return Err(corrupt(
                    "corrupt (its first/last 64 KiB do not match)".into(),
                ));
            }
        }
        Ok(Some(self.blobs.mount_source(&key)?))
    }
}
