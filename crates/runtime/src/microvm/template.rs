//! Restore-from-template boots of microVMs.
//!
//! The first create of a VM *shape* (kernel + base initramfs + aether, layer set, memory,
//! vCPUs, writable-disk size, pmem/balloon, machine/accelerator, sandbox env and init user:
//! everything that shapes the QEMU command line and the guest's state) boots cold; the edge
//! then builds a template of that shape in the background: one VM of the shape boots to
//! aether's `Ready`, `sync`s, and is snapshotted with the pause machinery (QMP `stop` +
//! `migrate` to a file, [`super::vm`]). The template keeps the snapshot, its initramfs and a
//! copy of its writable disk as it was at the snapshot; it is never written again.
//!
//! Later creates of the shape copy the template's disk (sparse/reflink), start QEMU with
//! `-incoming` from the template's snapshot, attach a fresh aether channel, `cont`, and give
//! the guest its own identity over the aether protocol (`SetIdentity`: hostname, wall clock,
//! host randomness + CRNG reseed; QEMU's `vmgenid` device also tells a guest kernel that has
//! the driver that it was cloned).
//!
//! Templates live in `<edge dir>/microvm-templates/<key>/`, where the key is a SHA-256 (first
//! 96 bits) over the shape, with content digests of the guest artefacts (layer files are named by their digest),
//! so a changed kernel, initramfs, aether or layer never matches an old template. They are
//! capped in number (least recently used goes first), re-used by a restarted edge when their
//! key still matches, and removed when the edge stops. A template that fails to restore is
//! dropped and the create falls back to a cold boot.

use super::error::{TemplateError, ToolError};
use std::collections::{HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use sha2::{Digest, Sha256};

/// File names inside a template's directory.
pub const TPL_SNAPSHOT: &str = "snapshot";
pub const TPL_DISK: &str = "upper.img";
pub const TPL_INITRD: &str = "initrd.img";
pub const TPL_META: &str = "template.json";
/// Prefix of directories of templates being built (removed at start). Paths stay short: the
/// VM's unix sockets live in the directory (`sun_path` holds 108 bytes).
const BUILDING_PREFIX: &str = ".b-";

/// How templates are used.
#[derive(Debug, Clone)]
pub struct TemplateConfig {
    /// Restore-from-template boots on (`[edge.microvm] templates`).
    pub enabled: bool,
    /// Where templates are kept.
    pub dir: PathBuf,
    /// At most this many templates (least recently used removed first).
    pub max: usize,
}

impl TemplateConfig {
    /// The defaults: on, at most 4 templates, kept in `dir`.
    pub fn new(dir: PathBuf) -> Self {
        TemplateConfig {
            enabled: true,
            dir,
            max: 4,
        }
    }
}

/// How a microVM was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootKind {
    /// Booted its kernel (no template of its shape yet, templates off, or a networked VM).
    Cold,
    /// Restored from a template snapshot.
    Template,
    /// A template of its shape existed but failed to restore (it was dropped): booted cold.
    ColdFallback,
}

impl BootKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BootKind::Cold => "cold",
            BootKind::Template => "template",
            BootKind::ColdFallback => "cold-fallback",
        }
    }
}

/// What is recorded next to a template.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TemplateMeta {
    pub key: String,
    /// The shape, human-readable (what the key hashes).
    pub shape: String,
    /// Unix seconds.
    pub created: u64,
}

/// A template on disk.
#[derive(Debug, Clone)]
pub struct Template {
    pub key: String,
    pub dir: PathBuf,
}

impl Template {
    pub fn snapshot(&self) -> PathBuf {
        self.dir.join(TPL_SNAPSHOT)
    }
    pub fn disk(&self) -> PathBuf {
        self.dir.join(TPL_DISK)
    }
    pub fn initrd(&self) -> PathBuf {
        self.dir.join(TPL_INITRD)
    }
}

/// One template as listed.
#[derive(Debug, Clone, serde::Serialize)]
pub struct TemplateInfo {
    pub key: String,
    pub shape: String,
    /// Bytes on disk (snapshot + allocated disk blocks + initramfs).
    pub bytes: u64,
    pub uses: u64,
}

/// Counters for logs and metrics.
#[derive(Debug, Default)]
pub struct TemplateStats {
    pub cold: AtomicU64,
    pub templated: AtomicU64,
    pub fallbacks: AtomicU64,
    pub built: AtomicU64,
    pub build_failures: AtomicU64,
}

#[derive(Default)]
struct State {
    /// key → (last use sequence number, uses).
    ready: HashMap<String, (u64, u64)>,
    building: HashSet<String>,
    seq: u64,
}

/// The template store of one edge.
pub struct Templates {
    config: TemplateConfig,
    state: Mutex<State>,
    closing: AtomicBool,
    closing_tx: tokio::sync::watch::Sender<bool>,
    builds: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// File digests by (path, size, mtime).
    digests: Mutex<HashMap<PathBuf, (u64, SystemTime, String)>>,
    pub stats: TemplateStats,
}

impl std::fmt::Debug for Templates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Templates")
            .field("config", &self.config)
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Hex digits of a key: the first 96 bits of the shape's SHA-256 (the key names the
/// template's directory, which holds the VM's unix sockets while it is built).
const KEY_HEX: usize = 24;

/// Whether `name` can be a template key.
fn is_key(name: &str) -> bool {
    name.len() == KEY_HEX && name.bytes().all(|b| b.is_ascii_hexdigit())
}

impl Templates {
    /// Opens the store: leftovers of interrupted builds are removed, complete templates of an
    /// earlier run are kept for re-use (they only match creates whose key is the same).
    pub fn open(config: TemplateConfig) -> Self {
        let (closing_tx, _) = tokio::sync::watch::channel(false);
        let t = Templates {
            state: Mutex::new(State::default()),
            closing: AtomicBool::new(false),
            closing_tx,
            builds: Mutex::new(Vec::new()),
            digests: Mutex::new(HashMap::new()),
            stats: TemplateStats::default(),
            config,
        };
        if t.config.enabled {
            t.scan();
        }
        t
    }

    fn scan(&self) {
        let Ok(rd) = std::fs::read_dir(&self.config.dir) else {
            return;
        };
        let mut st = lock(&self.state);
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            let complete = is_key(&name)
                && [TPL_SNAPSHOT, TPL_DISK, TPL_INITRD, TPL_META]
                    .iter()
                    .all(|f| path.join(f).is_file());
            if complete {
                st.ready.insert(name, (0, 0));
            } else {
                // A build the earlier edge did not finish: its QEMU may still run (stopped for
                // the snapshot, it would never end on its own).
                super::vm::kill_leftover_qemu(&path);
                tracing::info!(dir = %path.display(), "removing an incomplete microVM template");
                let _ = std::fs::remove_dir_all(&path);
            }
        }
        if !st.ready.is_empty() {
            tracing::info!(
                count = st.ready.len(),
                "microVM templates of an earlier run kept"
            );
        }
    }

    pub fn enabled(&self) -> bool {
        self.config.enabled && !self.closing.load(Ordering::SeqCst)
    }

    pub fn config(&self) -> &TemplateConfig {
        &self.config
    }

    /// SHA-256 of a file's content, cached by path, size and mtime.
    pub async fn file_digest(&self, path: &Path) -> io::Result<String> {
        let meta = tokio::fs::metadata(path)
            .await
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        let mtime = meta.modified()?;
        if let Some((len, t, d)) = lock(&self.digests).get(path) {
            if *len == meta.len() && *t == mtime {
                return Ok(d.clone());
            }
        }
        let p = path.to_path_buf();
        let d = tokio::task::spawn_blocking(move || -> io::Result<String> {
            let mut f = std::fs::File::open(&p)?;
            let mut h = Sha256::new();
            io::copy(&mut f, &mut h)?;
            Ok(hex_of(&h.finalize()))
        })
        .await
        .map_err(|e| io::Error::other(format!("digest task: {e}")))??;
        lock(&self.digests).insert(path.to_path_buf(), (meta.len(), mtime, d.clone()));
        Ok(d)
    }

    /// The ready template for `key`, marked as used.
    pub fn lookup(&self, key: &str) -> Option<Template> {
        if !self.enabled() {
            return None;
        }
        let mut st = lock(&self.state);
        st.seq += 1;
        let seq = st.seq;
        let e = st.ready.get_mut(key)?;
        e.0 = seq;
        e.1 += 1;
        Some(Template {
            key: key.to_string(),
            dir: self.config.dir.join(key),
        })
    }

    /// Forgets and removes a template (after it failed to restore).
    pub fn drop_template(&self, key: &str) {
        lock(&self.state).ready.remove(key);
        let dir = self.config.dir.join(key);
        if let Err(e) = std::fs::remove_dir_all(&dir) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(dir = %dir.display(), error = %e, "remove a microVM template");
            }
        }
    }

    /// Claims the build of `key`: `None` when it is ready, being built, or templates are off;
    /// else the directory to build it in (fresh).
    pub fn claim_build(&self, key: &str) -> Option<PathBuf> {
        if !self.enabled() {
            return None;
        }
        let mut st = lock(&self.state);
        if st.ready.contains_key(key) || st.building.contains(key) {
            return None;
        }
        st.building.insert(key.to_string());
        let dir = self.config.dir.join(format!("{BUILDING_PREFIX}{key}"));
        let _ = std::fs::remove_dir_all(&dir);
        Some(dir)
    }

    /// Ends a build: on success the build directory becomes the template (and the least
    /// recently used ones beyond the cap are removed); on failure it is removed.
    pub fn finish_build(
        &self,
        key: &str,
        build_dir: &Path,
        ok: Result<TemplateMeta, TemplateError>,
    ) {
        let result = ok.and_then(|meta| {
            if self.closing.load(Ordering::SeqCst) {
                return Err(TemplateError::Stopping);
            }
            let raw = serde_json::to_vec_pretty(&meta).map_err(TemplateError::Meta)?;
            std::fs::write(build_dir.join(TPL_META), raw)
                .map_err(|e| TemplateError::io(format!("write {TPL_META}"), e))?;
            let dst = self.config.dir.join(key);
            let _ = std::fs::remove_dir_all(&dst);
            std::fs::rename(build_dir, &dst)
                .map_err(|e| TemplateError::io("rename the template", e))
        });
        let mut st = lock(&self.state);
        st.building.remove(key);
        match result {
            Ok(()) => {
                st.seq += 1;
                let seq = st.seq;
                st.ready.insert(key.to_string(), (seq, 0));
                self.stats.built.fetch_add(1, Ordering::Relaxed);
                tracing::info!(key = %key, "microVM template ready");
                let mut evict = Vec::new();
                while st.ready.len() > self.config.max {
                    let Some(oldest) = st
                        .ready
                        .iter()
                        .min_by_key(|(_, (used, _))| *used)
                        .map(|(k, _)| k.clone())
                    else {
                        break;
                    };
                    st.ready.remove(&oldest);
                    evict.push(oldest);
                }
                drop(st);
                for k in evict {
                    tracing::info!(key = %k, "microVM template evicted (least recently used)");
                    let _ = std::fs::remove_dir_all(self.config.dir.join(&k));
                }
            }
            Err(e) => {
                drop(st);
                self.stats.build_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(key = %key, error = %e, "microVM template build failed");
                let _ = std::fs::remove_dir_all(build_dir);
            }
        }
    }

    /// Keeps the handle of a background build (awaited at shutdown).
    pub fn track(&self, h: tokio::task::JoinHandle<()>) {
        let mut b = lock(&self.builds);
        b.retain(|h| !h.is_finished());
        b.push(h);
    }

    /// Resolves when the store is shutting down (builds give up).
    pub async fn closing(&self) {
        let mut rx = self.closing_tx.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }

    /// Templates on disk.
    pub fn list(&self) -> Vec<TemplateInfo> {
        let ready: Vec<(String, u64)> = lock(&self.state)
            .ready
            .iter()
            .map(|(k, (_, uses))| (k.clone(), *uses))
            .collect();
        ready
            .into_iter()
            .map(|(key, uses)| {
                let dir = self.config.dir.join(&key);
                let shape = std::fs::read(dir.join(TPL_META))
                    .ok()
                    .and_then(|r| serde_json::from_slice::<TemplateMeta>(&r).ok())
                    .map(|m| m.shape)
                    .unwrap_or_default();
                let bytes = [TPL_SNAPSHOT, TPL_DISK, TPL_INITRD]
                    .iter()
                    .filter_map(|f| std::fs::metadata(dir.join(f)).ok())
                    .map(|m| {
                        use std::os::unix::fs::MetadataExt;
                        m.blocks() * 512
                    })
                    .sum();
                TemplateInfo {
                    key,
                    shape,
                    bytes,
                    uses,
                }
            })
            .collect()
    }

    /// Removes every ready template (on request); builds in flight carry on. Returns how many.
    pub fn remove_all(&self) -> usize {
        let keys: Vec<String> = lock(&self.state).ready.drain().map(|(k, _)| k).collect();
        for k in &keys {
            let _ = std::fs::remove_dir_all(self.config.dir.join(k));
        }
        keys.len()
    }

    /// Removes every template (the edge is stopping): running builds end their VM first.
    pub async fn shutdown(&self) {
        self.closing.store(true, Ordering::SeqCst);
        let _ = self.closing_tx.send(true);
        let builds: Vec<_> = std::mem::take(&mut *lock(&self.builds));
        for h in builds {
            let _ = h.await;
        }
        lock(&self.state).ready.clear();
        if let Err(e) = tokio::fs::remove_dir_all(&self.config.dir).await {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(dir = %self.config.dir.display(), error = %e, "remove microVM templates");
            }
        }
    }
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The key of a shape: SHA-256 over its description (its first 96 bits, in hex).
pub fn key_of(shape: &str) -> String {
    hex_of(&Sha256::digest(shape.as_bytes())[..KEY_HEX / 2])
}

/// Copies a template's disk for a clone: a reflink where the file system can, else a sparse
/// copy.
pub async fn copy_disk(src: &Path, dst: &Path) -> Result<(), ToolError> {
    let out = tokio::process::Command::new("cp")
        .arg("--reflink=auto")
        .arg("--sparse=always")
        .arg(src)
        .arg(dst)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|source| ToolError::Run {
            tool: "cp".into(),
            source,
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(ToolError::Failed {
            command: format!("cp {} {}", src.display(), dst.display()),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Fresh randomness from the host for a clone's kernel.
pub fn host_seed() -> io::Result<Vec<u8>> {
    use std::io::Read;
    let mut b = vec![0u8; 64];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b)
}

/// Shared handle.
pub type TemplatesRef = Arc<Templates>;

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(dir: &Path, max: usize) -> TemplateConfig {
        TemplateConfig {
            enabled: true,
            dir: dir.to_path_buf(),
            max,
        }
    }

    fn meta(key: &str) -> TemplateMeta {
        TemplateMeta {
            key: key.into(),
            shape: "s".into(),
            created: 0,
        }
    }

    fn build(t: &Templates, key: &str) {
        let d = t.claim_build(key).expect("claim");
        std::fs::create_dir_all(&d).unwrap();
        for f in [TPL_SNAPSHOT, TPL_DISK, TPL_INITRD] {
            std::fs::write(d.join(f), b"x").unwrap();
        }
        t.finish_build(key, &d, Ok(meta(key)));
    }

    #[test]
    fn keys_differ_by_shape() {
        assert_ne!(key_of("a"), key_of("b"));
        assert!(is_key(&key_of("a")));
    }

    #[test]
    fn lru_cap_and_claims() {
        let tmp = tempfile::tempdir().unwrap();
        let t = Templates::open(cfg(tmp.path(), 2));
        let (a, b, c) = (key_of("a"), key_of("b"), key_of("c"));
        build(&t, &a);
        assert!(t.claim_build(&a).is_none(), "ready: no second build");
        build(&t, &b);
        // a used after b: b is the least recently used when c arrives.
        assert!(t.lookup(&a).is_some());
        build(&t, &c);
        assert!(t.lookup(&b).is_none());
        assert!(!tmp.path().join(&b).exists());
        assert!(t.lookup(&a).is_some() && t.lookup(&c).is_some());
        // A failed build leaves nothing.
        let d = t.claim_build(&b).unwrap();
        std::fs::create_dir_all(&d).unwrap();
        t.finish_build(&b, &d, Err(TemplateError::Stopping));
        assert!(!d.exists() && t.lookup(&b).is_none());
        // Dropped templates are removed.
        t.drop_template(&a);
        assert!(!tmp.path().join(&a).exists() && t.lookup(&a).is_none());
        assert_eq!(t.list().len(), 1);
        assert_eq!(t.remove_all(), 1);
        assert!(t.list().is_empty() && !tmp.path().join(&c).exists());
    }

    #[test]
    fn reopen_keeps_complete_templates_only() {
        let tmp = tempfile::tempdir().unwrap();
        let a = key_of("a");
        {
            let t = Templates::open(cfg(tmp.path(), 4));
            build(&t, &a);
        }
        std::fs::create_dir_all(tmp.path().join(format!("{BUILDING_PREFIX}{a}"))).unwrap();
        std::fs::create_dir_all(tmp.path().join(key_of("half"))).unwrap();
        let t = Templates::open(cfg(tmp.path(), 4));
        assert!(t.lookup(&a).is_some());
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
    }

    #[tokio::test]
    async fn shutdown_removes_everything() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("tpl");
        let t = Templates::open(cfg(&dir, 4));
        build(&t, &key_of("a"));
        t.shutdown().await;
        assert!(!dir.exists());
        assert!(!t.enabled() && t.claim_build(&key_of("b")).is_none());
    }

    #[tokio::test]
    async fn digests_follow_content() {
        let tmp = tempfile::tempdir().unwrap();
        let t = Templates::open(cfg(tmp.path(), 1));
        let f = tmp.path().join("f");
        std::fs::write(&f, b"one").unwrap();
        let d1 = t.file_digest(&f).await.unwrap();
        std::fs::write(&f, b"two!").unwrap();
        assert_ne!(d1, t.file_digest(&f).await.unwrap());
    }
}
