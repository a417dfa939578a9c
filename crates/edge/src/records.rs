//! Sandbox records on local disk: `<data>/edge/sandboxes/<id>/record.json`, written atomically
//! (temp file, rename) whenever a sandbox's state changes.
//!
//! No fsync: the records exist so that a restarted *edge process* finds its sandboxes, and a
//! process crash loses nothing that reached the page cache. A crash of the machine ends every
//! sandbox anyway (their processes and mount namespaces are gone), and the recovery at start
//! treats a missing or stale record as "clean up whatever is left". Two fsyncs per state change
//! cost ~5 ms of every create on this disk, which is half the create budget.
//!
//! After a crash of the edge the records say what might be left behind (see
//! [`crate::manager`] for what the edge does with them at start).

use std::io::Write;
use std::path::{Path, PathBuf};

use dsec_wire::api::SandboxInfo;
use serde::{Deserialize, Serialize};

pub const RECORD_FILE: &str = "record.json";

/// What the edge persists about one sandbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub info: SandboxInfo,
    /// Host pid of the sandbox's aether (0 while the sandbox is being created).
    pub pid: i32,
    /// The image the sandbox holds a lease on.
    pub image: String,
    /// Environment given to every command (part of the create request, not of `SandboxInfo`).
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// When the sandbox was created (epoch ms; `ttl_total` counts from here).
    #[serde(default)]
    pub created_ms: u64,
    /// The idle clock when the record was last written (epoch ms).
    #[serde(default)]
    pub last_request_ms: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("write record {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("read record {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("parse record {path}: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// Atomically writes `<dir>/record.json`.
pub fn write(dir: &Path, record: &SandboxRecord) -> Result<(), RecordError> {
    let path = dir.join(RECORD_FILE);
    let tmp = dir.join(".record.json.tmp");
    let werr = |source| RecordError::Write {
        path: path.clone(),
        source,
    };
    let json = serde_json::to_vec_pretty(record).map_err(|e| werr(std::io::Error::other(e)))?;
    {
        let mut f = std::fs::File::create(&tmp).map_err(werr)?;
        f.write_all(&json).map_err(werr)?;
    }
    std::fs::rename(&tmp, &path).map_err(werr)?;
    Ok(())
}

/// Writes the first `<dir>/record.json` of a sandbox straight into place (no temp file and
/// rename: there is nothing to replace). A torn write (the edge crashed inside it) reads as an
/// unreadable record, which the recovery at start cleans up like a sandbox it cannot re-adopt.
/// An empty file is taken over (a reused directory keeps its emptied record file, see
/// [`SPARE_DIR`]: an empty record reads like a torn one); a record with content is never
/// overwritten.
pub fn write_new(dir: &Path, record: &SandboxRecord) -> Result<(), RecordError> {
    let path = dir.join(RECORD_FILE);
    let werr = |source| RecordError::Write {
        path: path.clone(),
        source,
    };
    let json = serde_json::to_vec(record).map_err(|e| werr(std::io::Error::other(e)))?;
    let mut f = std::fs::File::options()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(werr)?;
    if f.metadata().map_err(werr)?.len() > 0 {
        return Err(werr(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "a record exists already",
        )));
    }
    f.write_all(&json).map_err(werr)?;
    Ok(())
}

/// Where the directories of ended sandboxes wait for their removal: `<edge>/trash`.
pub const TRASH_DIR: &str = "trash";

/// Directories handed to [`retire`] whose removal has not finished.
static RETIRING: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Takes an ended sandbox's directory out of `sandboxes/` with one rename into `trash` and
/// removes it on a blocking thread: the stop answers without waiting for the file system (each
/// unlink and rmdir of the tree can wait milliseconds for the journal on a busy host). Falls
/// back to removing in place when the rename fails. [`flush_retired`] waits for the removals;
/// [`empty_trash`] at start removes what a crash left. A missing `dir` is fine.
pub fn retire(dir: &Path, trash: &Path) -> std::io::Result<()> {
    match move_to_trash(dir, trash) {
        Some(moved) => {
            remove_in_background(moved);
            Ok(())
        }
        None => remove_tree(dir),
    }
}

/// The first half of [`retire`]: renames `dir` into `trash` and returns where it is now;
/// `None` when it is missing or could not be moved (then it is still at `dir`).
pub fn move_to_trash(dir: &Path, trash: &Path) -> Option<PathBuf> {
    let dest = trash.join(dir.file_name()?);
    match rename_into(dir, &dest) {
        Ok(()) => Some(dest),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !dir.exists() => None,
        Err(e) => {
            tracing::warn!(dir = %dir.display(), error = %e, "move sandbox dir to the trash");
            None
        }
    }
}

/// The second half of [`retire`]: removes `dir` (a tree in the trash) on a blocking thread
/// (inline without a tokio runtime).
pub fn remove_in_background(dir: PathBuf) {
    in_background(move || remove_retired(&dir));
}

fn remove_retired(dir: &Path) {
    if let Err(e) = remove_tree(dir) {
        tracing::error!(dir = %dir.display(), error = %e, "remove retired sandbox dir");
    }
}

/// Runs `job` (a retired directory's removal or recycling) on a blocking thread, inline without
/// a tokio runtime, counted in [`RETIRING`] until it ends.
fn in_background(job: impl FnOnce() + Send + 'static) {
    RETIRING.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let job = move || {
        job();
        RETIRING.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    };
    match tokio::runtime::Handle::try_current() {
        Ok(h) => {
            h.spawn_blocking(job);
        }
        Err(_) => job(),
    }
}

/// Renames `src` to `dest`; when `dest`'s parent is missing (removed by hand), makes it and
/// retries once.
fn rename_into(src: &Path, dest: &Path) -> std::io::Result<()> {
    match std::fs::rename(src, dest) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && src.exists() => {
            if let Some(parent) = dest.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::rename(src, dest)
        }
        other => other,
    }
}

/// Waits (up to `limit`) until every [`retire`]d directory is removed; true when none is left.
pub async fn flush_retired(limit: std::time::Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while RETIRING.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    true
}

/// Where cleaned directories of ended containers wait to be reused: `<edge>/spare`.
///
/// Why: the host's root file system here is ext4 without a journal, where the inode allocator
/// skips every inode freed in the last 60–360 s (`recently_deleted`) by looking each one up in
/// the buffer cache. A node ending 100 sandboxes a second frees thousands a minute, and every
/// `mkdir` then walks them: 150–250 µs per inode instead of ≈ 30 µs, measured during a
/// sustained run. A sandbox directory and its `upper/`, `work/` and `rootfs/` are four of
/// them; a spare skeleton renamed into place costs one rename.
pub const SPARE_DIR: &str = "spare";

/// The subdirectories a spare holds, empty: those the container runtime would create
/// (`dsec_runtime::container`'s `upper`, `work` and `rootfs`).
pub const SKELETON: [&str; 3] = ["upper", "work", "rootfs"];

/// Most spares kept per edge (the pool refills as containers end).
const MAX_SPARES: usize = 16;

/// Spare skeletons ready for reuse, by full path (edges of one process have their own dirs).
static SPARES: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
static SPARE_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn spares() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    SPARES.lock().unwrap_or_else(|p| p.into_inner())
}

/// Makes a new sandbox's directory `dir`: with `reuse`, a spare skeleton from `spare` (already
/// holding the empty [`SKELETON`] dirs) renamed into place when there is one, else a new
/// directory.
pub fn make_sandbox_dir(dir: &Path, spare: &Path, reuse: bool) -> std::io::Result<()> {
    if !reuse {
        return std::fs::create_dir_all(dir);
    }
    loop {
        let taken = {
            let mut s = spares();
            let i = s.iter().position(|p| p.parent() == Some(spare));
            i.map(|i| s.swap_remove(i))
        };
        let Some(skeleton) = taken else { break };
        match std::fs::rename(&skeleton, dir) {
            Ok(()) => return Ok(()),
            Err(e) => {
                tracing::warn!(dir = %skeleton.display(), error = %e, "reuse a spare sandbox dir");
                let _ = remove_tree(&skeleton);
            }
        }
    }
    std::fs::create_dir_all(dir)
}

/// Like [`remove_in_background`], for a container whose every process is dead: once `released`
/// says its mounts are gone (false: they are not, after its own time limit), its directory is
/// emptied down to the [`SKELETON`] and kept in `spare` for the next create (up to a few), else
/// removed.
pub fn recycle_in_background<F>(dir: PathBuf, spare: PathBuf, released: F)
where
    F: FnOnce() -> bool + Send + 'static,
{
    in_background(move || {
        if released() {
            recycle(&dir, &spare);
        } else {
            remove_retired(&dir);
        }
    });
}

fn recycle(dir: &Path, spare: &Path) {
    let room = spares()
        .iter()
        .filter(|p| p.parent() == Some(spare))
        .count()
        < MAX_SPARES;
    if room {
        match clean_to_skeleton(dir) {
            Ok(true) => {
                let n = SPARE_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let dest = spare.join(format!("s{n}"));
                match rename_into(dir, &dest) {
                    Ok(()) => {
                        spares().push(dest);
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(dir = %dir.display(), error = %e, "keep a spare sandbox dir")
                    }
                }
            }
            Ok(false) => {}
            Err(e) => {
                tracing::debug!(dir = %dir.display(), error = %e, "clean a sandbox dir for reuse")
            }
        }
    }
    remove_retired(dir);
}

/// Empties `dir` down to the [`SKELETON`]: everything else goes, the skeleton dirs are emptied
/// and get back the owner, mode and (no) extended attributes a fresh `mkdir` gives them, so a
/// sandbox's `chmod /` or the overlay's own attributes on `upper/` never reach the next one.
/// True when exactly the skeleton is left.
fn clean_to_skeleton(dir: &Path) -> std::io::Result<bool> {
    let mut kept = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let path = entry.path();
        let is_dir = entry.file_type()?.is_dir();
        let name = entry.file_name();
        if is_dir && name.to_str().is_some_and(|n| SKELETON.contains(&n)) {
            for child in std::fs::read_dir(&path)? {
                let child = child?;
                if child.file_type()?.is_dir() {
                    std::fs::remove_dir_all(child.path())?;
                } else {
                    std::fs::remove_file(child.path())?;
                }
            }
            reset_attributes(&path)?;
            kept += 1;
        } else if name == RECORD_FILE && entry.file_type()?.is_file() {
            // Kept, emptied: the next sandbox's first record is written into it (one inode
            // fewer to allocate; an empty record reads as "clean up" after a crash).
            std::fs::File::options()
                .write(true)
                .open(&path)?
                .set_len(0)?;
        } else if is_dir {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
    }
    Ok(kept == SKELETON.len())
}

/// Owner (this process's), mode 0755 and no extended attributes, as `create_dir_all` makes a
/// directory (under the usual umask 022).
fn reset_attributes(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let md = std::fs::symlink_metadata(dir)?;
    let (uid, gid) = (
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    );
    if md.uid() != uid || md.gid() != gid {
        std::os::unix::fs::lchown(dir, Some(uid), Some(gid))?;
    }
    if md.mode() & 0o7777 != 0o755 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    }
    dsec_image::clear_xattrs(dir)?;
    Ok(())
}

/// Removes the spare skeletons of `spare` (at start, after a crash, and at shutdown).
pub fn drop_spares(spare: &Path) -> std::io::Result<()> {
    spares().retain(|p| p.parent() != Some(spare));
    remove_tree(spare)
}

/// Removes whatever a crashed edge left in `trash` and makes sure the (empty) trash exists.
pub fn empty_trash(trash: &Path) -> std::io::Result<()> {
    remove_tree(trash)?;
    std::fs::create_dir_all(trash)
}

/// Removes a directory tree; a missing one is fine.
fn remove_tree(dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Reads `<dir>/record.json`.
pub fn read(dir: &Path) -> Result<SandboxRecord, RecordError> {
    let path = dir.join(RECORD_FILE);
    let bytes = std::fs::read(&path).map_err(|source| RecordError::Read {
        path: path.clone(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|source| RecordError::Parse { path, source })
}

/// One directory found under `sandboxes/`: its id (the directory name) and its record, if
/// readable.
pub struct Found {
    pub id: String,
    pub dir: PathBuf,
    pub record: Result<SandboxRecord, RecordError>,
}

/// Every sandbox directory under `sandboxes_dir` (a missing dir means none).
pub fn scan(sandboxes_dir: &Path) -> std::io::Result<Vec<Found>> {
    let entries = match std::fs::read_dir(sandboxes_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry?;
        if !entry.file_type()?.is_dir() {
            continue;
        }
        let id = entry.file_name().to_string_lossy().into_owned();
        let dir = entry.path();
        let record = read(&dir);
        out.push(Found { id, dir, record });
    }
    Ok(out)
}

/// True when host process `pid` still belongs to sandbox `id`: its cgroup path names the
/// sandbox, or it is a `dsec-aether` process. Guards against killing a reused pid.
pub fn pid_belongs_to(pid: i32, id: &str) -> bool {
    if pid <= 1 {
        return false;
    }
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    owned_by(&cgroup, &comm, id)
}

fn owned_by(cgroup: &str, comm: &str, id: &str) -> bool {
    cgroup.lines().any(|l| {
        l.rsplit(':')
            .next()
            .is_some_and(|p| p.split('/').any(|part| part == id))
    }) || comm.trim_end() == "dsec-aether"
}

/// Kills a leftover sandbox process and waits (up to `wait`) until it is gone.
/// Returns true when the process is gone.
pub async fn kill_and_wait(pid: i32, wait: std::time::Duration) -> bool {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if !Path::new(&format!("/proc/{pid}")).exists() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_wire::api::{SandboxState, Substrate};

    fn info(id: &str) -> SandboxInfo {
        SandboxInfo {
            id: id.into(),
            node: "n0".into(),
            state: SandboxState::Running,
            substrate: Substrate::Container,
            image: "busybox".into(),
            memory_limit_mb: 64,
            cpu_cores_limit: 0.5,
            pids_limit: 64,
            init_user: "root".into(),
            hostname: "h".into(),
            ttl_running_stop: Some(30),
            ttl_total: None,
            network_rules: [("pypi".to_string(), true)].into(),
            labels: Default::default(),
            created_at: "2026-01-01T00:00:00Z".into(),
            create_ms: Some(12.5),
            reason: None,
            ..Default::default()
        }
    }

    #[test]
    fn write_read_scan() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("sb-n0-0000000000000001");
        std::fs::create_dir_all(&dir).unwrap();
        let rec = SandboxRecord {
            info: info("sb-n0-0000000000000001"),
            pid: 42,
            image: "busybox".into(),
            env: Default::default(),
            created_ms: 1,
            last_request_ms: 2,
        };
        write(&dir, &rec).unwrap();
        let back = read(&dir).unwrap();
        assert_eq!(back.pid, 42);
        assert_eq!(back.info.network_rules.get("pypi"), Some(&true));
        std::fs::create_dir_all(tmp.path().join("sb-n0-0000000000000002")).unwrap();
        let mut found = scan(tmp.path()).unwrap();
        found.sort_by(|a, b| a.id.cmp(&b.id));
        assert_eq!(found.len(), 2);
        assert!(found[0].record.is_ok());
        assert!(matches!(found[1].record, Err(RecordError::Read { .. })));
        assert!(scan(&tmp.path().join("missing")).unwrap().is_empty());
    }

    #[test]
    fn first_record_and_retire() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("sandboxes/sb-n0-0000000000000003");
        let trash = tmp.path().join(TRASH_DIR);
        std::fs::create_dir_all(dir.join("upper/run")).unwrap();
        let rec = SandboxRecord {
            info: info("sb-n0-0000000000000003"),
            pid: 7,
            image: "busybox".into(),
            env: Default::default(),
            created_ms: 1,
            last_request_ms: 1,
        };
        write_new(&dir, &rec).unwrap();
        assert_eq!(read(&dir).unwrap().pid, 7);
        assert!(
            write_new(&dir, &rec).is_err(),
            "the first record must not exist yet"
        );
        // No trash yet: made on demand; no runtime: removed inline.
        retire(&dir, &trash).unwrap();
        assert!(!dir.exists());
        assert_eq!(std::fs::read_dir(&trash).unwrap().count(), 0);
        retire(&dir, &trash).unwrap();
        std::fs::create_dir_all(trash.join("left/over")).unwrap();
        empty_trash(&trash).unwrap();
        assert!(trash.is_dir() && std::fs::read_dir(&trash).unwrap().count() == 0);
    }

    #[tokio::test]
    async fn retire_in_the_background() {
        let tmp = tempfile::tempdir().unwrap();
        let trash = tmp.path().join(TRASH_DIR);
        empty_trash(&trash).unwrap();
        for i in 0..5 {
            let dir = tmp.path().join(format!("sb-n0-000000000000001{i}"));
            std::fs::create_dir_all(dir.join("upper/a/b")).unwrap();
            std::fs::write(dir.join("record.json"), "{}").unwrap();
            retire(&dir, &trash).unwrap();
            assert!(!dir.exists());
        }
        assert!(flush_retired(std::time::Duration::from_secs(10)).await);
        assert_eq!(std::fs::read_dir(&trash).unwrap().count(), 0);
    }

    #[test]
    fn ownership() {
        let id = "sb-n0-0000000000000001";
        assert!(owned_by(
            "4:memory:/dsec/n0/sb-n0-0000000000000001\n",
            "sh\n",
            id
        ));
        assert!(owned_by("0::/\n", "dsec-aether\n", id));
        assert!(!owned_by(
            "4:memory:/dsec/n0/sb-n0-0000000000000002\n",
            "bash\n",
            id
        ));
        assert!(!pid_belongs_to(1, id));
    }

    /// An ended container's directory becomes a clean skeleton (owner, mode, xattrs reset,
    /// contents and other files gone), which the next create takes; one that is not a
    /// container's shape is removed instead.
    #[test]
    fn recycles_to_a_clean_skeleton() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let spare = tmp.path().join(SPARE_DIR);
        let dir = tmp.path().join("sb-n0-0000000000000001");
        for d in SKELETON {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        std::fs::create_dir_all(dir.join("upper/etc/deep")).unwrap();
        std::fs::write(dir.join("upper/etc/deep/f"), "x").unwrap();
        std::fs::create_dir_all(dir.join("work/work")).unwrap();
        std::fs::write(dir.join("record.json"), "{}").unwrap();
        std::fs::create_dir_all(dir.join("fs/x")).unwrap();
        let upper = dir.join("upper");
        std::fs::set_permissions(&upper, std::fs::Permissions::from_mode(0o700)).unwrap();
        let cu = std::ffi::CString::new(upper.to_str().unwrap()).unwrap();
        // SAFETY: NUL-terminated strings and a 1-byte value that outlive the call.
        let xattr =
            unsafe { libc::lsetxattr(cu.as_ptr(), c"user.t".as_ptr(), b"1".as_ptr().cast(), 1, 0) }
                == 0;
        recycle(&dir, &spare);
        assert!(!dir.exists());
        let kept: Vec<PathBuf> = std::fs::read_dir(&spare)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(kept.len(), 1, "{kept:?}");
        let mut names: Vec<String> = std::fs::read_dir(&kept[0])
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["record.json", "rootfs", "upper", "work"]);
        assert_eq!(
            std::fs::metadata(kept[0].join(RECORD_FILE)).unwrap().len(),
            0
        );
        for d in SKELETON {
            let p = kept[0].join(d);
            assert_eq!(std::fs::read_dir(&p).unwrap().count(), 0, "{d} not empty");
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode, 0o755, "{d}");
        }
        if xattr {
            let cp = std::ffi::CString::new(kept[0].join("upper").to_str().unwrap()).unwrap();
            // SAFETY: a NULL buffer of size 0 only asks for the length.
            let n = unsafe { libc::llistxattr(cp.as_ptr(), std::ptr::null_mut(), 0) };
            assert_eq!(n, 0, "xattrs left on upper");
        }
        // The next create takes it; with none left it makes a fresh dir.
        let next = tmp.path().join("sb-n0-0000000000000002");
        make_sandbox_dir(&next, &spare, true).unwrap();
        assert!(next.join("upper").is_dir() && next.join("rootfs").is_dir());
        // Its emptied record reads as unreadable (cleanup after a crash) and takes the first.
        assert!(read(&next).is_err());
        let rec = SandboxRecord {
            info: info("sb-n0-0000000000000002"),
            pid: 9,
            image: "busybox".into(),
            env: Default::default(),
            created_ms: 1,
            last_request_ms: 1,
        };
        write_new(&next, &rec).unwrap();
        assert_eq!(read(&next).unwrap().pid, 9);
        assert!(write_new(&next, &rec).is_err());
        assert_eq!(std::fs::read_dir(&spare).unwrap().count(), 0);
        let fresh = tmp.path().join("sb-n0-0000000000000003");
        make_sandbox_dir(&fresh, &spare, true).unwrap();
        assert_eq!(std::fs::read_dir(&fresh).unwrap().count(), 0);
        // Not a container's shape (no rootfs): removed, not kept.
        let odd = tmp.path().join("sb-n0-0000000000000004");
        std::fs::create_dir_all(odd.join("upper")).unwrap();
        recycle(&odd, &spare);
        assert!(!odd.exists());
        assert_eq!(std::fs::read_dir(&spare).unwrap().count(), 0);
        drop_spares(&spare).unwrap();
        assert!(!spare.exists());
    }
}
