//! The node-local chunk cache of data blobs kept in an object store (S3).
//!
//! Owns: the cache directory (`<images root>/chunkcache/`, wiped at open) with one sparse
//! file per blob in which each cached chunk sits at its own offset (so a fully cached blob
//! reads like a local file: contiguous extents, the disk's own read-ahead — one file per
//! chunk read at 0.17× of the local disk), eviction punching the chunk's hole back, its size bound and LRU order, the fetching of chunks by ranged GET with bounded
//! retries, the check of every fetched chunk against the digest recorded at import (the
//! blob's chunk manifest, `<digest>.chunks` in the store), and single-flight fetches (the
//! first reader of a chunk fetches it, concurrent readers wait for that fetch). It is shared
//! by every sandbox on the node: the FUSE file system in [`fuse`] serves each blob as a file
//! that EROFS mounts with `device=`, and reads of it come here.
//!
//! Failure behaviour: a chunk that cannot be fetched within `retries + 1` attempts of at most
//! `timeout` each fails the read with EIO (a warning per failed attempt, an error line and the
//! `fetch_errors`/`read_errors` counters); chunks already cached keep being served; the next
//! read of a failed chunk tries the store again. A chunk whose bytes do not match its digest
//! (changed in the bucket behind dsec's back) is refused and refetched, and counted.

pub mod fuse;

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::blobstore::s3::client::Client;

const MANIFEST_MAGIC: &[u8; 8] = b"DSECCK01";

/// Per-chunk digests of one data blob, recorded at import.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    pub chunk_size: u64,
    pub blob_size: u64,
    pub digests: Vec<[u8; 32]>,
}

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("chunk manifest: {0}")]
    Malformed(String),
    #[error("chunk manifest: read {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
}

impl Manifest {
    /// Hashes `path` in chunks of `chunk_size`.
    pub fn of_file(path: &Path, chunk_size: u64) -> Result<Self, ManifestError> {
        let read_err = |source| ManifestError::Read {
            path: path.to_path_buf(),
            source,
        };
        let f = fs::File::open(path).map_err(read_err)?;
        let blob_size = f.metadata().map_err(read_err)?.len();
        let mut buf = vec![0u8; chunk_size as usize];
        let mut digests = Vec::new();
        let mut off = 0u64;
        while off < blob_size {
            let len = chunk_size.min(blob_size - off) as usize;
            f.read_exact_at(&mut buf[..len], off).map_err(read_err)?;
            digests.push(Sha256::digest(&buf[..len]).into());
            off += len as u64;
        }
        Ok(Manifest {
            chunk_size,
            blob_size,
            digests,
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(24 + 32 * self.digests.len());
        out.extend_from_slice(MANIFEST_MAGIC);
        out.extend_from_slice(&self.chunk_size.to_le_bytes());
        out.extend_from_slice(&self.blob_size.to_le_bytes());
        for d in &self.digests {
            out.extend_from_slice(d);
        }
        out
    }

    pub fn decode(b: &[u8]) -> Result<Self, ManifestError> {
        let bad = |m: &str| ManifestError::Malformed(m.to_string());
        if b.len() < 24 || &b[..8] != MANIFEST_MAGIC {
            return Err(bad("bad header"));
        }
        let chunk_size = u64::from_le_bytes(b[8..16].try_into().map_err(|_| bad("size"))?);
        let blob_size = u64::from_le_bytes(b[16..24].try_into().map_err(|_| bad("size"))?);
        if chunk_size == 0 || chunk_size > 64 << 20 {
            return Err(bad("chunk size out of range"));
        }
        let n = blob_size.div_ceil(chunk_size) as usize;
        if b.len() != 24 + 32 * n {
            return Err(bad("digest count does not match the blob size"));
        }
        let digests = b[24..]
            .chunks_exact(32)
            .map(|c| c.try_into().expect("32-byte chunk"))
            .collect();
        Ok(Manifest {
            chunk_size,
            blob_size,
            digests,
        })
    }

    fn chunk_len(&self, idx: u64) -> u64 {
        self.chunk_size
            .min(self.blob_size.saturating_sub(idx * self.chunk_size))
    }
}

/// One blob the cache serves: its object name in the bucket and its manifest.
#[derive(Debug)]
pub struct CachedBlob {
    /// `<digest>.blob`: the file name under the FUSE mount.
    pub name: String,
    /// The full object name in the bucket (prefix included).
    pub object: String,
    pub manifest: Manifest,
}

/// Tunables of the cache (from `[edge.image_s3]`).
#[derive(Debug, Clone)]
pub struct CacheConfig {
    pub cap_bytes: u64,
    pub timeout: Duration,
    pub retries: u32,
}

/// A read the cache could not serve.
#[derive(Debug, thiserror::Error)]
pub enum ChunkReadError {
    #[error("chunk {chunk} of {blob}: store unavailable after {attempts} attempts: {last}")]
    Unavailable {
        blob: String,
        chunk: u64,
        attempts: u32,
        last: String,
    },
    #[error("chunk {chunk} of {blob}: local cache: {source}")]
    Local {
        blob: String,
        chunk: u64,
        source: io::Error,
    },
}

/// Counters (monotonic unless said otherwise).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ChunkCacheStats {
    /// Chunks fetched from the store and bytes of them.
    pub fetched_chunks: u64,
    pub fetched_bytes: u64,
    /// Chunk lookups served from the cache / that had to fetch (or wait for a fetch).
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// Fetched chunks refused because their digest did not match the manifest.
    pub digest_mismatches: u64,
    /// Failed fetch attempts (timeouts, connection errors, HTTP errors, bad digests).
    pub fetch_errors: u64,
    /// Reads answered with EIO because a chunk stayed unavailable.
    pub read_errors: u64,
    /// Bytes in the cache now (gauge) and the bound.
    pub cached_bytes: u64,
    pub cap_bytes: u64,
}

#[derive(Default)]
struct Counters {
    fetched_chunks: AtomicU64,
    fetched_bytes: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    digest_mismatches: AtomicU64,
    fetch_errors: AtomicU64,
    read_errors: AtomicU64,
}

type ChunkId = (Arc<str>, u64);

struct Entry {
    len: u64,
    tick: u64,
    /// Unique per insertion: a reader that saw this entry before its read and after it knows
    /// the bytes it read were not evicted (hole punched) meanwhile.
    born: u64,
    /// Offset of the chunk in the blob (and in its cache file).
    off: u64,
}

#[derive(Default)]
struct State {
    entries: HashMap<ChunkId, Entry>,
    lru: BTreeMap<u64, ChunkId>,
    tick: u64,
    bytes: u64,
    /// The open cache file of each blob with cached chunks.
    files: HashMap<Arc<str>, Arc<fs::File>>,
    /// Fetches in progress: followers wait on the receiver for the leader's outcome.
    inflight: HashMap<ChunkId, tokio::sync::watch::Receiver<Option<Result<(), String>>>>,
}

/// The node's chunk cache. Cheap to share (`Arc`).
pub struct ChunkCache {
    dir: PathBuf,
    cfg: CacheConfig,
    client: Client,
    state: Mutex<State>,
    stats: Counters,
}

impl std::fmt::Debug for ChunkCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkCache")
            .field("dir", &self.dir)
            .field("cap_bytes", &self.cfg.cap_bytes)
            .finish_non_exhaustive()
    }
}

impl ChunkCache {
    /// Opens the cache in `dir`, discarding what a previous run left there.
    pub fn open(dir: &Path, cfg: CacheConfig, client: Client) -> io::Result<Self> {
        if dir.exists() {
            fs::remove_dir_all(dir)?;
        }
        fs::create_dir_all(dir)?;
        Ok(ChunkCache {
            dir: dir.to_path_buf(),
            cfg,
            client,
            state: Mutex::new(State::default()),
            stats: Counters::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn blob_path(&self, digest: &str) -> PathBuf {
        self.dir.join(digest)
    }

    /// The blob's cache file, created (sparse) on first use.
    fn blob_file(&self, st: &mut State, digest: &Arc<str>) -> io::Result<Arc<fs::File>> {
        if let Some(f) = st.files.get(digest) {
            return Ok(f.clone());
        }
        let f = Arc::new(
            fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(self.blob_path(digest))?,
        );
        st.files.insert(digest.clone(), f.clone());
        Ok(f)
    }

    /// Gives the disk space of an evicted chunk back (called with the state locked, so no
    /// fetch of the same chunk can write there meanwhile: it is fetched only while absent).
    fn punch(&self, st: &State, digest: &Arc<str>, e: &Entry) {
        let Some(f) = st.files.get(digest) else {
            return;
        };
        let flags = nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE;
        if let Err(err) = nix::fcntl::fallocate(f.as_raw_fd(), flags, e.off as i64, e.len as i64) {
            tracing::warn!(blob = %digest, error = %err, "blob cache: cannot punch an evicted chunk's hole (its space stays in use until the blob is forgotten)");
        }
    }

    pub fn stats(&self) -> ChunkCacheStats {
        let c = &self.stats;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ChunkCacheStats {
            fetched_chunks: l(&c.fetched_chunks),
            fetched_bytes: l(&c.fetched_bytes),
            hits: l(&c.hits),
            misses: l(&c.misses),
            evictions: l(&c.evictions),
            digest_mismatches: l(&c.digest_mismatches),
            fetch_errors: l(&c.fetch_errors),
            read_errors: l(&c.read_errors),
            cached_bytes: self.lock().bytes,
            cap_bytes: self.cfg.cap_bytes,
        }
    }

    /// Drops every cached chunk of the blob `digest` (its layer was deleted).
    pub fn forget(&self, digest: &str) {
        let mut st = self.lock();
        let gone: Vec<ChunkId> = st
            .entries
            .keys()
            .filter(|(d, _)| &**d == digest)
            .cloned()
            .collect();
        for id in gone {
            if let Some(e) = st.entries.remove(&id) {
                st.lru.remove(&e.tick);
                st.bytes -= e.len;
            }
        }
        st.files.remove(digest);
        let _ = fs::remove_file(self.blob_path(digest));
    }

    /// Reads `[off, off+len)` of a cached chunk; `None` if it is not cached (or was evicted
    /// meanwhile).
    fn read_hit(&self, digest: &Arc<str>, idx: u64, off: u64, buf: &mut [u8]) -> Option<()> {
        let id: ChunkId = (digest.clone(), idx);
        let (file, born, at) = {
            let mut st = self.lock();
            st.tick += 1;
            let tick = st.tick;
            let e = st.entries.get_mut(&id)?;
            let old = std::mem::replace(&mut e.tick, tick);
            let (born, at) = (e.born, e.off + off);
            st.lru.remove(&old);
            st.lru.insert(tick, id.clone());
            (st.files.get(digest)?.clone(), born, at)
        };
        file.read_exact_at(buf, at).ok()?;
        // Evicted while we read: the bytes may be the punched hole's zeros.
        let st = self.lock();
        (st.entries.get(&id)?.born == born).then_some(())
    }

    /// Serves a read entirely from cached chunks, or `None` when one of them is missing.
    pub fn read_cached(
        &self,
        blob: &CachedBlob,
        digest: &Arc<str>,
        off: u64,
        len: u64,
    ) -> Option<Vec<u8>> {
        let mut out = vec![0u8; len as usize];
        let cs = blob.manifest.chunk_size;
        let mut pos = off;
        while pos < off + len {
            let idx = pos / cs;
            let in_chunk = pos - idx * cs;
            let n = (cs - in_chunk).min(off + len - pos);
            let dst = &mut out[(pos - off) as usize..(pos - off + n) as usize];
            self.read_hit(digest, idx, in_chunk, dst)?;
            pos += n;
        }
        self.stats.hits.fetch_add(1, Ordering::Relaxed);
        Some(out)
    }

    /// Reads `[off, off+len)` of the blob (clamped by the caller to its size), fetching the
    /// chunks that are not cached.
    pub async fn read(
        &self,
        blob: &CachedBlob,
        digest: &Arc<str>,
        off: u64,
        len: u64,
    ) -> Result<Vec<u8>, ChunkReadError> {
        let mut out = vec![0u8; len as usize];
        let cs = blob.manifest.chunk_size;
        let mut pos = off;
        while pos < off + len {
            let idx = pos / cs;
            let in_chunk = pos - idx * cs;
            let n = (cs - in_chunk).min(off + len - pos);
            let dst = &mut out[(pos - off) as usize..(pos - off + n) as usize];
            let mut tries = 0;
            loop {
                if self.read_hit(digest, idx, in_chunk, dst).is_some() {
                    break;
                }
                tries += 1;
                if tries > 3 {
                    return Err(ChunkReadError::Local {
                        blob: blob.name.clone(),
                        chunk: idx,
                        source: io::Error::other("chunk evicted right after each fetch"),
                    });
                }
                self.stats.misses.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = self.ensure(blob, digest, idx).await {
                    self.stats.read_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(e);
                }
            }
            pos += n;
        }
        Ok(out)
    }

    /// Makes chunk `idx` cached: fetches it, or waits for the fetch already in progress.
    async fn ensure(
        &self,
        blob: &CachedBlob,
        digest: &Arc<str>,
        idx: u64,
    ) -> Result<(), ChunkReadError> {
        let id: ChunkId = (digest.clone(), idx);
        let (tx, mut rx) = {
            let mut st = self.lock();
            if st.entries.contains_key(&id) {
                return Ok(());
            }
            match st.inflight.get(&id) {
                Some(rx) => (None, rx.clone()),
                None => {
                    let (tx, rx) = tokio::sync::watch::channel(None);
                    st.inflight.insert(id.clone(), rx.clone());
                    (Some(tx), rx)
                }
            }
        };
        let Some(tx) = tx else {
            // Someone else fetches it: wait for their outcome.
            let outcome = rx
                .wait_for(|v| v.is_some())
                .await
                .map(|v| v.clone().unwrap_or(Ok(())))
                .unwrap_or_else(|_| Err("fetch abandoned".to_string()));
            return outcome.map_err(|last| ChunkReadError::Unavailable {
                blob: blob.name.clone(),
                chunk: idx,
                attempts: self.cfg.retries + 1,
                last,
            });
        };
        let res = self.fetch(blob, digest, idx).await;
        self.lock().inflight.remove(&id);
        let _ = tx.send(Some(res.as_ref().map(|_| ()).map_err(|e| e.to_string())));
        res
    }

    async fn fetch(
        &self,
        blob: &CachedBlob,
        digest: &Arc<str>,
        idx: u64,
    ) -> Result<(), ChunkReadError> {
        let len = blob.manifest.chunk_len(idx);
        let off = idx * blob.manifest.chunk_size;
        let want = blob.manifest.digests.get(idx as usize).copied();
        let attempts = self.cfg.retries + 1;
        let mut last = String::new();
        for attempt in 1..=attempts {
            let got = tokio::time::timeout(
                self.cfg.timeout,
                self.client.get_range(&blob.object, off, len),
            )
            .await;
            match got {
                Ok(Ok(data))
                    if data.len() as u64 == len && want == Some(Sha256::digest(&data).into()) =>
                {
                    self.stats.fetched_chunks.fetch_add(1, Ordering::Relaxed);
                    self.stats.fetched_bytes.fetch_add(len, Ordering::Relaxed);
                    return self.insert(digest, idx, off, &data).map_err(|source| {
                        ChunkReadError::Local {
                            blob: blob.name.clone(),
                            chunk: idx,
                            source,
                        }
                    });
                }
                Ok(Ok(data)) => {
                    self.stats.digest_mismatches.fetch_add(1, Ordering::Relaxed);
                    last = format!(
                        "got {} bytes that do not match the digest recorded at import (the object changed in the store)",
                        data.len()
                    );
                }
                Ok(Err(e)) => last = e.to_string(),
                Err(_) => last = format!("no answer within {:?}", self.cfg.timeout),
            }
            self.stats.fetch_errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(blob = %blob.name, chunk = idx, attempt, attempts, error = %last, "blob cache: chunk fetch failed");
            if attempt < attempts {
                tokio::time::sleep(Duration::from_millis(100 * u64::from(attempt))).await;
            }
        }
        tracing::error!(blob = %blob.name, chunk = idx, attempts, error = %last, "blob cache: chunk unavailable; the read fails with EIO");
        Err(ChunkReadError::Unavailable {
            blob: blob.name.clone(),
            chunk: idx,
            attempts,
            last,
        })
    }

    /// Stores a verified chunk and evicts least-recently-used chunks beyond the bound.
    fn insert(&self, digest: &Arc<str>, idx: u64, off: u64, data: &[u8]) -> io::Result<()> {
        // Written before the entry exists: no reader looks there until it does.
        let file = self.blob_file(&mut self.lock(), digest)?;
        file.write_all_at(data, off)?;
        let mut st = self.lock();
        st.tick += 1;
        let tick = st.tick;
        let id: ChunkId = (digest.clone(), idx);
        if let Some(old) = st.entries.insert(
            id.clone(),
            Entry {
                len: data.len() as u64,
                tick,
                born: tick,
                off,
            },
        ) {
            st.lru.remove(&old.tick);
            st.bytes -= old.len;
        }
        st.lru.insert(tick, id.clone());
        st.bytes += data.len() as u64;
        while st.bytes > self.cfg.cap_bytes {
            // Never the chunk just inserted (a cap below one chunk still serves reads).
            let Some((&t, victim)) = st.lru.iter().next() else {
                break;
            };
            if *victim == id {
                break;
            }
            let victim = victim.clone();
            st.lru.remove(&t);
            if let Some(e) = st.entries.remove(&victim) {
                st.bytes -= e.len;
                self.punch(&st, &victim.0, &e);
            }
            self.stats.evictions.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_round_trip_and_checks() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("b");
        fs::write(&p, vec![7u8; 2500]).unwrap();
        let m = Manifest::of_file(&p, 1024).unwrap();
        assert_eq!(m.digests.len(), 3);
        assert_eq!(m.chunk_len(2), 452);
        assert_eq!(m.digests[2], <[u8; 32]>::from(Sha256::digest([7u8; 452])));
        let enc = m.encode();
        assert_eq!(Manifest::decode(&enc).unwrap(), m);
        assert!(Manifest::decode(&enc[..enc.len() - 1]).is_err());
        assert!(Manifest::decode(b"nonsense").is_err());
    }
}
