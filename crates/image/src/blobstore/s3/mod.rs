//! A blob store in an S3-compatible object store (`s3://bucket/prefix`; AWS S3, Ceph's
//! radosgw, MinIO, ...).
//!
//! Objects are `<prefix>/<key>`. Puts of data blobs upload with multipart (parts of
//! [`PART_SIZE`]; a failed upload is aborted, and one that could not be aborted — the store
//! was unreachable, or the edge died — is recorded in `<images root>/s3-uploads/` and aborted
//! at the next open) and also write the blob's chunk manifest (`<digest>.chunks`: a SHA-256 per
//! fixed-size chunk). Metadata images are fetched whole to the node's disk as with the other
//! stores; data blobs are read on demand through the node's [`ChunkCache`] exposed by FUSE
//! ([`crate::chunkcache::fuse`]), which `mount_source` returns a path into.
//!
//! Settings come from `[edge.image_s3]` ([`S3Config`]), each falling back to the environment:
//! `DSEC_S3_ENDPOINT` (or `AWS_ENDPOINT_URL`), `DSEC_S3_REGION` (or `AWS_REGION`),
//! `DSEC_S3_ACCESS_KEY` (or `AWS_ACCESS_KEY_ID`), `DSEC_S3_SECRET_KEY` (or
//! `AWS_SECRET_ACCESS_KEY`).

pub(crate) mod client;
mod sigv4;

use std::fs;
use std::future::Future;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{check_key, BlobStore};
use crate::chunkcache::fuse::{BlobMount, BlobTable};
use crate::chunkcache::{CacheConfig, CachedBlob, ChunkCache, ChunkCacheStats, Manifest};
use client::Client;
use sigv4::Credentials;

/// Multipart part size (S3's minimum is 5 MiB).
pub const PART_SIZE: u64 = 16 << 20;

/// `[edge.image_s3]`: where the `s3://` blob store is and how its chunk cache behaves.
#[derive(Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct S3Config {
    /// `http(s)://host:port` of the S3 service (path-style requests).
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub access_key: Option<String>,
    #[serde(skip_serializing)]
    pub secret_key: Option<String>,
    /// Bound of the node's chunk cache in MiB.
    pub cache_mb: u64,
    /// Chunk size recorded for blobs imported by this node, in KiB (a multiple of 4).
    pub chunk_kib: u64,
    /// Longest wait for one request to the store, in milliseconds.
    pub timeout_ms: u64,
    /// Extra attempts of a failed chunk fetch before the read fails with EIO.
    pub retries: u32,
}

impl Default for S3Config {
    fn default() -> Self {
        S3Config {
            endpoint: None,
            region: None,
            access_key: None,
            secret_key: None,
            cache_mb: 4096,
            chunk_kib: 1024,
            timeout_ms: 5000,
            retries: 2,
        }
    }
}

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Config")
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("access_key", &self.access_key)
            .field("secret_key", &self.secret_key.as_ref().map(|_| "<set>"))
            .field("cache_mb", &self.cache_mb)
            .field("chunk_kib", &self.chunk_kib)
            .field("timeout_ms", &self.timeout_ms)
            .field("retries", &self.retries)
            .finish()
    }
}

/// An S3 request or setting that failed.
#[derive(Debug, thiserror::Error)]
pub enum S3Error {
    #[error("s3 blob store: {key}: {message}")]
    Config { key: &'static str, message: String },
    #[error("s3 {what}: store unreachable: {message}")]
    Unreachable { what: String, message: String },
    #[error("s3 {what}: HTTP {status} {code}")]
    Status {
        what: String,
        status: u16,
        code: String,
    },
    #[error("s3: {0}")]
    Protocol(String),
    #[error("s3: {0}")]
    Http(String),
    #[error("s3: {0}")]
    Local(String),
}

impl From<S3Error> for io::Error {
    fn from(e: S3Error) -> Self {
        let kind = match &e {
            S3Error::Config { .. } => io::ErrorKind::InvalidInput,
            S3Error::Status { status: 404, .. } => io::ErrorKind::NotFound,
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, e)
    }
}

fn setting(cfg: &Option<String>, env: &[&str]) -> Option<String> {
    cfg.clone().filter(|s| !s.is_empty()).or_else(|| {
        env.iter()
            .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    })
}

pub struct S3Store {
    rt: Option<tokio::runtime::Runtime>,
    client: Client,
    bucket: String,
    /// `""` or `dir/` (with the slash).
    prefix: String,
    chunk_size: u64,
    cache: Arc<ChunkCache>,
    table: Arc<BlobTable>,
    mount: Mutex<Option<BlobMount>>,
    mount_dir: PathBuf,
    journal: PathBuf,
    direct_get_bytes: AtomicU64,
}

impl std::fmt::Debug for S3Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Store")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl S3Store {
    /// Opens `s3://bucket/prefix` (`loc` is `//bucket/prefix`) with its cache and FUSE mount
    /// point under `root` (the image store's root).
    pub fn open(loc: &str, root: &Path, cfg: &S3Config) -> Result<Self, S3Error> {
        let bad = |key, message: String| S3Error::Config { key, message };
        let rest = loc.strip_prefix("//").ok_or_else(|| {
            bad(
                "image_blob_store",
                format!("s3:{loc:?}: use s3://bucket or s3://bucket/prefix"),
            )
        })?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if !bucket_ok {
            return Err(bad(
                "image_blob_store",
                format!("bucket {bucket:?} must be 3-63 characters of [a-z0-9.-]"),
            ));
        }
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|s| s == "..") {
            return Err(bad(
                "image_blob_store",
                format!("prefix {prefix:?} contains `..`"),
            ));
        }
        let prefix = if prefix.is_empty() {
            String::new()
        } else {
            format!("{prefix}/")
        };
        let endpoint = setting(&cfg.endpoint, &["DSEC_S3_ENDPOINT", "AWS_ENDPOINT_URL"])
            .ok_or_else(|| {
                bad(
                    "image_s3.endpoint",
                    "not set; set [edge.image_s3] endpoint or DSEC_S3_ENDPOINT".into(),
                )
            })?;
        let region = setting(&cfg.region, &["DSEC_S3_REGION", "AWS_REGION"])
            .unwrap_or_else(|| "us-east-1".to_string());
        let access_key = setting(
            &cfg.access_key,
            &["DSEC_S3_ACCESS_KEY", "AWS_ACCESS_KEY_ID"],
        )
        .ok_or_else(|| {
            bad(
                "image_s3.access_key",
                "not set; set [edge.image_s3] access_key or DSEC_S3_ACCESS_KEY".into(),
            )
        })?;
        let secret_key = setting(
            &cfg.secret_key,
            &["DSEC_S3_SECRET_KEY", "AWS_SECRET_ACCESS_KEY"],
        )
        .ok_or_else(|| {
            bad(
                "image_s3.secret_key",
                "not set; set [edge.image_s3] secret_key or DSEC_S3_SECRET_KEY".into(),
            )
        })?;
        if cfg.chunk_kib == 0 || !cfg.chunk_kib.is_multiple_of(4) || cfg.chunk_kib > 64 * 1024 {
            return Err(bad(
                "image_s3.chunk_kib",
                format!(
                    "{} must be a multiple of 4 between 4 and 65536",
                    cfg.chunk_kib
                ),
            ));
        }
        if cfg.timeout_ms == 0 {
            return Err(bad("image_s3.timeout_ms", "must be above 0".into()));
        }
        let timeout = Duration::from_millis(cfg.timeout_ms);
        let client = Client::new(
            &endpoint,
            bucket,
            Credentials {
                access_key,
                secret_key,
                region,
            },
            timeout,
        )?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("dsec-s3")
            .enable_all()
            .build()
            .map_err(|e| S3Error::Local(format!("start the S3 runtime: {e}")))?;
        let local = |what: &str, e: io::Error| S3Error::Local(format!("{what}: {e}"));
        let cache = ChunkCache::open(
            &root.join("chunkcache"),
            CacheConfig {
                cap_bytes: cfg.cache_mb << 20,
                timeout,
                retries: cfg.retries,
            },
            client.clone(),
        )
        .map_err(|e| local("open the chunk cache", e))?;
        let journal = root.join("s3-uploads");
        fs::create_dir_all(&journal).map_err(|e| local("create s3-uploads", e))?;
        let store = S3Store {
            rt: Some(rt),
            client,
            bucket: bucket.to_string(),
            prefix,
            chunk_size: cfg.chunk_kib << 10,
            cache: Arc::new(cache),
            table: Arc::new(BlobTable::default()),
            mount: Mutex::new(None),
            mount_dir: root.join("blobfs"),
            journal,
            direct_get_bytes: AtomicU64::new(0),
        };
        // A crashed run's FUSE mount answers ENOTCONN: detach it now.
        crate::chunkcache::fuse::detach_stale(&store.mount_dir);
        store.abort_journaled_uploads();
        Ok(store)
    }

    fn rt(&self) -> &tokio::runtime::Runtime {
        self.rt.as_ref().expect("runtime lives until drop")
    }

    /// Runs `fut` on the store's runtime and waits for it (from any thread, async or not).
    fn run<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        self.rt().spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv().expect("the S3 task ran to completion")
    }

    fn object(&self, key: &str) -> io::Result<String> {
        check_key(key)?;
        Ok(format!("{}{key}", self.prefix))
    }

    fn manifest_key(key: &str) -> Option<String> {
        key.strip_suffix(".blob").map(|d| format!("{d}.chunks"))
    }

    /// Aborts multipart uploads this node started and could not finish or abort.
    fn abort_journaled_uploads(&self) {
        let Ok(entries) = fs::read_dir(&self.journal) else {
            return;
        };
        for e in entries.flatten() {
            let Ok(text) = fs::read_to_string(e.path()) else {
                continue;
            };
            let Some((object, id)) = text.split_once('\n') else {
                let _ = fs::remove_file(e.path());
                continue;
            };
            let c = self.client.clone();
            let (o, i) = (object.to_string(), id.trim().to_string());
            match self.run(async move { c.abort_multipart(&o, &i).await }) {
                Ok(()) => {
                    tracing::info!(
                        object,
                        "s3: aborted a multipart upload left by a failed import"
                    );
                    let _ = fs::remove_file(e.path());
                }
                Err(err) => {
                    tracing::warn!(object, error = %err, "s3: abort a multipart upload left by a failed import (retried at next open)")
                }
            }
        }
    }

    fn put_multipart(&self, object: &str, src: &Path, size: u64) -> Result<(), S3Error> {
        let c = self.client.clone();
        let o = object.to_string();
        let upload_id = self.run(async move { c.create_multipart(&o).await })?;
        let jpath = self.journal.join(hex::encode(Sha256::digest(format!(
            "{object}\n{upload_id}"
        ))));
        fs::write(&jpath, format!("{object}\n{upload_id}"))
            .map_err(|e| S3Error::Local(format!("record upload {}: {e}", jpath.display())))?;
        let res = (|| {
            let mut f = fs::File::open(src)
                .map_err(|e| S3Error::Local(format!("open {}: {e}", src.display())))?;
            let mut etags = Vec::new();
            let mut done = 0u64;
            let mut n = 0u32;
            while done < size {
                let len = PART_SIZE.min(size - done) as usize;
                let mut part = vec![0u8; len];
                f.read_exact(&mut part)
                    .map_err(|e| S3Error::Local(format!("read {}: {e}", src.display())))?;
                n += 1;
                let (c, o, id) = (self.client.clone(), object.to_string(), upload_id.clone());
                etags.push(self.run(async move { c.upload_part(&o, &id, n, part).await })?);
                done += len as u64;
            }
            let (c, o, id) = (self.client.clone(), object.to_string(), upload_id.clone());
            self.run(async move { c.complete_multipart(&o, &id, &etags).await })
        })();
        match &res {
            Ok(()) => {
                let _ = fs::remove_file(&jpath);
            }
            Err(e) => {
                tracing::warn!(object, error = %e, "s3: multipart upload failed; aborting it");
                let (c, o, id) = (self.client.clone(), object.to_string(), upload_id.clone());
                match self.run(async move { c.abort_multipart(&o, &id).await }) {
                    Ok(()) => {
                        let _ = fs::remove_file(&jpath);
                    }
                    Err(e) => {
                        tracing::warn!(object, error = %e, "s3: abort multipart upload (retried at next open)")
                    }
                }
            }
        }
        res
    }

    fn put_object(&self, object: &str, src: &Path) -> Result<(), S3Error> {
        let size = fs::metadata(src)
            .map_err(|e| S3Error::Local(format!("stat {}: {e}", src.display())))?
            .len();
        if size > PART_SIZE {
            return self.put_multipart(object, src, size);
        }
        let body =
            fs::read(src).map_err(|e| S3Error::Local(format!("read {}: {e}", src.display())))?;
        let (c, o) = (self.client.clone(), object.to_string());
        self.run(async move { c.put(&o, body).await })
    }

    fn head(&self, object: &str) -> Result<Option<u64>, S3Error> {
        let (c, o) = (self.client.clone(), object.to_string());
        self.run(async move { c.head(&o).await })
    }

    /// The multipart uploads in progress under this store's prefix (for leak checks).
    pub fn uploads_in_progress(&self) -> io::Result<Vec<(String, String)>> {
        let (c, p) = (self.client.clone(), self.prefix.clone());
        Ok(self.run(async move { c.list_uploads(&p).await })?)
    }

    fn ensure_mounted(&self) -> io::Result<PathBuf> {
        let mut m = self.mount.lock().unwrap_or_else(|p| p.into_inner());
        if m.is_none() {
            *m = Some(BlobMount::mount(
                &self.mount_dir,
                self.table.clone(),
                self.cache.clone(),
                self.rt().handle().clone(),
            )?);
        }
        Ok(self.mount_dir.clone())
    }
}

impl BlobStore for S3Store {
    fn describe(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.prefix.trim_end_matches('/'))
    }

    fn dir(&self) -> Option<&Path> {
        None
    }

    fn put(&self, key: &str, src: &Path) -> io::Result<()> {
        let object = self.object(key)?;
        let manifest = Self::manifest_key(key)
            .map(|k| self.object(&k))
            .transpose()?;
        let have_blob = self.head(&object)?.is_some();
        let have_manifest = match &manifest {
            Some(m) => self.head(m)?.is_some(),
            None => true,
        };
        if have_blob && have_manifest {
            return Ok(());
        }
        if let Some(mobj) = &manifest {
            let m = Manifest::of_file(src, self.chunk_size).map_err(io::Error::other)?;
            if !have_blob {
                self.put_object(&object, src)?;
            }
            let (c, o, body) = (self.client.clone(), mobj.clone(), m.encode());
            self.run(async move { c.put(&o, body).await })?;
            return Ok(());
        }
        Ok(self.put_object(&object, src)?)
    }

    fn mount_source(&self, key: &str) -> io::Result<PathBuf> {
        let object = self.object(key)?;
        let Some(mkey) = Self::manifest_key(key) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("only data blobs are mounted from S3, not {key}"),
            ));
        };
        let dir = self.ensure_mounted()?;
        let path = dir.join(key);
        if path.exists() {
            return Ok(path);
        }
        let (c, mobj) = (self.client.clone(), self.object(&mkey)?);
        let bytes = self.run(async move {
            let mut buf = Vec::new();
            c.get_to(&mobj, |b| {
                buf.extend_from_slice(b);
                Ok(())
            })
            .await
            .map(|_| buf)
        })?;
        let manifest = Manifest::decode(&bytes)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{mkey}: {e}")))?;
        let digest = key.trim_end_matches(".blob").to_string();
        self.table.register(
            &digest,
            CachedBlob {
                name: key.to_string(),
                object,
                manifest,
            },
        );
        Ok(path)
    }

    fn size(&self, key: &str) -> io::Result<Option<u64>> {
        Ok(self.head(&self.object(key)?)?)
    }

    fn read_at(&self, key: &str, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let (c, o, len) = (self.client.clone(), self.object(key)?, buf.len() as u64);
        let data = self.run(async move { c.get_range(&o, offset, len).await })?;
        let n = data.len().min(buf.len());
        buf[..n].copy_from_slice(&data[..n]);
        self.direct_get_bytes.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    fn fetch(&self, key: &str, dst: &Path) -> io::Result<u64> {
        let (c, o) = (self.client.clone(), self.object(key)?);
        let mut f = fs::File::create(dst)?;
        let (n, f) = self.run(async move {
            let n = c.get_to(&o, |b| f.write_all(b)).await;
            (n, f)
        });
        let n = n?;
        f.sync_all()?;
        self.direct_get_bytes.fetch_add(n, Ordering::Relaxed);
        Ok(n)
    }

    fn remove(&self, key: &str) -> io::Result<()> {
        let (c, o) = (self.client.clone(), self.object(key)?);
        self.run(async move { c.delete(&o).await })?;
        if let Some(mkey) = Self::manifest_key(key) {
            let (c, o) = (self.client.clone(), self.object(&mkey)?);
            self.run(async move { c.delete(&o).await })?;
            self.table.unregister(key);
            self.cache.forget(key.trim_end_matches(".blob"));
        }
        Ok(())
    }

    fn keys(&self) -> io::Result<Vec<String>> {
        let (c, p) = (self.client.clone(), self.prefix.clone());
        let all = self.run(async move { c.list(&p).await })?;
        let mut out: Vec<String> = all
            .into_iter()
            .filter_map(|o| o.strip_prefix(&self.prefix).map(str::to_string))
            .filter(|k| !k.contains('/') && check_key(k).is_ok())
            .collect();
        out.sort();
        Ok(out)
    }

    fn cache_stats(&self) -> Option<StoreCacheStats> {
        Some(StoreCacheStats {
            cache: self.cache.stats(),
            direct_get_bytes: self.direct_get_bytes.load(Ordering::Relaxed),
        })
    }

    fn shutdown(&self) {
        if let Some(mut m) = self.mount.lock().unwrap_or_else(|p| p.into_inner()).take() {
            m.unmount();
        }
    }
}

impl Drop for S3Store {
    fn drop(&mut self) {
        self.shutdown();
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// What an object store's reads cost: the chunk cache's counters and the bytes read around
/// it (metadata images, verification samples).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StoreCacheStats {
    pub cache: ChunkCacheStats,
    pub direct_get_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_are_checked() {
        let d = tempfile::tempdir().unwrap();
        let cfg = S3Config {
            endpoint: Some("http://127.0.0.1:9".into()),
            access_key: Some("a".into()),
            secret_key: Some("s".into()),
            ..S3Config::default()
        };
        for bad in ["bucket", "//B", "//ab", "//bucket/../x"] {
            let e = S3Store::open(bad, d.path(), &cfg).unwrap_err();
            assert!(matches!(e, S3Error::Config { .. }), "{bad}: {e}");
        }
        let s = S3Store::open("//bucket/some/prefix/", d.path(), &cfg).unwrap();
        assert_eq!(s.describe(), "s3://bucket/some/prefix");
        assert_eq!(
            s.object(&format!("{}.blob", "a".repeat(64))).unwrap(),
            format!("some/prefix/{}.blob", "a".repeat(64))
        );
        let no_key = S3Config {
            access_key: None,
            ..cfg.clone()
        };
        if std::env::var_os("DSEC_S3_ACCESS_KEY").is_none()
            && std::env::var_os("AWS_ACCESS_KEY_ID").is_none()
        {
            let e = S3Store::open("//bucket", d.path(), &no_key).unwrap_err();
            assert!(e.to_string().contains("access_key"), "{e}");
        }
        let bad_chunk = S3Config {
            chunk_kib: 3,
            ..cfg
        };
        assert!(S3Store::open("//bucket", d.path(), &bad_chunk).is_err());
    }
}

#[cfg(test)]
mod live_tests;
