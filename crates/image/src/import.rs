//! Turning a directory or a tar stream into an EROFS layer file.
//!
//! - [`build_layer`] runs `mkfs.erofs` (which keeps owners, modes, mtimes and xattrs when run as
//!   root) into the store's `tmp/`, then hashes the result.
//! - [`unpack_tar`] unpacks a (possibly gzip'd) tar stream into a directory, preserving owners,
//!   modes, mtimes, symlinks, hard links, device nodes, fifos and xattrs, refusing entries that
//!   would land outside the directory and turning OCI whiteouts into overlayfs whiteouts.

use std::ffi::CString;
use std::fs;
use std::io::{self, BufRead, BufReader, Read};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use nix::sys::stat::{self, Mode, SFlag};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid};
use sha2::{Digest, Sha256};

use crate::ImageError;

/// How layers are built.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImportOptions {
    /// `mkfs.erofs -z` compressor (`lz4`, `lz4hc`, `lz4hc,9`, ...). `None`: uncompressed,
    /// which is the fastest to read.
    pub compression: Option<String>,
    /// Recorded as the image's `source` (`dir` when unset).
    pub source: Option<String>,
}

/// Removes a temporary path (file or tree) when dropped, so every exit path — success, error,
/// or a cancelled future — cleans up. [`TempPath::cleanup`] does it off the async executor.
pub struct TempPath {
    path: Option<PathBuf>,
}

impl TempPath {
    pub fn new(path: PathBuf) -> Self {
        TempPath { path: Some(path) }
    }

    pub fn path(&self) -> &Path {
        self.path.as_deref().unwrap_or(Path::new(""))
    }

    /// Removes the path now, on the blocking pool.
    pub async fn cleanup(mut self) {
        if let Some(p) = self.path.take() {
            let _ = tokio::task::spawn_blocking(move || remove_any(&p)).await;
        }
    }

    /// Forgets the path without removing it (it was moved into place).
    pub fn keep(mut self) {
        self.path = None;
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            // Dropped without `cleanup` (error or cancellation): remove it in the background
            // when a runtime is around, otherwise right here.
            match tokio::runtime::Handle::try_current() {
                Ok(h) => {
                    h.spawn_blocking(move || remove_any(&p));
                }
                Err(_) => remove_any(&p),
            }
        }
    }
}

fn remove_any(p: &Path) {
    match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => {
            if let Err(e) = fs::remove_dir_all(p) {
                tracing::warn!(path = %p.display(), error = %e, "remove temporary directory");
            }
        }
        Ok(_) => {
            let _ = fs::remove_file(p);
        }
        Err(_) => {}
    }
}

/// A layer built in `tmp/`: its metadata image, its data blob (absent when the layer has no
/// chunked data or was built compressed), and the digests that identify and verify it.
pub struct BuiltLayer {
    pub file: TempPath,
    pub blob: Option<TempPath>,
    /// Layer id: sha256 of the metadata image alone, or of `"<meta sha256>:<blob sha256>"`.
    pub digest: String,
    pub meta_sha256: String,
    pub meta_bytes: u64,
    pub blob_bytes: u64,
    /// sha256 of the blob's first and last [`SAMPLE_BYTES`] (see [`sample_digest`]).
    pub blob_sample: Option<String>,
}

/// Chunk size of the data blob (`mkfs.erofs --chunksize`).
pub const CHUNK_SIZE: u32 = 64 * 1024;
/// Bytes hashed at each end of a blob for the cheap acquire-time check.
pub const SAMPLE_BYTES: u64 = 64 * 1024;

/// Builds an EROFS layer of `dir`: a metadata image at `out` plus, unless compression is
/// asked for, a data blob next to it (`mkfs.erofs --chunksize --blobdev`).
pub async fn build_layer(
    name: &str,
    dir: &Path,
    out: PathBuf,
    opts: &ImportOptions,
) -> Result<BuiltLayer, ImageError> {
    build_layer_excluding(name, dir, out, opts, &[]).await
}

/// [`build_layer`] leaving out `excluded` (paths relative to `dir`, with everything below).
pub async fn build_layer_excluding(
    name: &str,
    dir: &Path,
    out: PathBuf,
    opts: &ImportOptions,
    excluded: &[String],
) -> Result<BuiltLayer, ImageError> {
    let user_err = |message: String| ImageError::Import {
        name: name.to_string(),
        message,
    };
    let file = TempPath::new(out.clone());
    let blob_path = out.with_extension("blob");
    let blob = TempPath::new(blob_path.clone());
    let mut cmd = tokio::process::Command::new("mkfs.erofs");
    cmd.arg("--quiet");
    let split = opts.compression.is_none();
    if let Some(z) = &opts.compression {
        let valid = !z.is_empty()
            && z.bytes()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b',');
        if !valid {
            return Err(user_err(format!(
                "bad compression {z:?}: use a mkfs.erofs compressor such as lz4 or lz4hc[,LEVEL]"
            )));
        }
        cmd.arg(format!("-z{z}"));
    } else {
        cmd.arg(format!("--chunksize={CHUNK_SIZE}"));
        cmd.arg(format!("--blobdev={}", blob_path.display()));
    }
    for e in excluded {
        // mkfs.erofs matches paths relative to the source directory (checked on
        // erofs-utils 1.5: absolute paths are silently ignored).
        cmd.arg(format!("--exclude-path={e}"));
    }
    cmd.arg(&out).arg(dir);
    cmd.stdin(std::process::Stdio::null());
    cmd.kill_on_drop(true);
    let output = cmd.output().await.map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            io::Error::new(
                e.kind(),
                "mkfs.erofs not found; install it with `apt-get install erofs-utils`",
            )
        } else {
            io::Error::new(e.kind(), format!("run mkfs.erofs: {e}"))
        }
    })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let stdout = String::from_utf8_lossy(&output.stdout);
        // mkfs.erofs may have left partial output; remove it before reporting.
        file.cleanup().await;
        blob.cleanup().await;
        return Err(user_err(format!(
            "mkfs.erofs failed ({}): {}",
            output.status,
            format!("{} {}", stderr.trim(), stdout.trim()).trim()
        )));
    }
    let (meta_path, bpath) = (out.clone(), blob_path.clone());
    let hashed = tokio::task::spawn_blocking(move || -> io::Result<_> {
        let (meta_sha, meta_bytes) = sha256_file(&meta_path)
            .map_err(|e| io::Error::new(e.kind(), format!("hash {}: {e}", meta_path.display())))?;
        let blob = if split && fs::metadata(&bpath).map(|m| m.len()).unwrap_or(0) > 0 {
            let (sha, len) = sha256_file(&bpath)
                .map_err(|e| io::Error::new(e.kind(), format!("hash {}: {e}", bpath.display())))?;
            let sample = sample_digest(&mut fs::File::open(&bpath)?, len)?;
            Some((sha, len, sample))
        } else {
            None
        };
        Ok((meta_sha, meta_bytes, blob))
    })
    .await
    .map_err(|e| io::Error::other(format!("hash layer: {e}")))??;
    let (meta_sha256, meta_bytes, blob_info) = hashed;
    Ok(match blob_info {
        Some((blob_sha, blob_bytes, sample)) => BuiltLayer {
            file,
            blob: Some(blob),
            digest: hex::encode(Sha256::digest(format!("{meta_sha256}:{blob_sha}"))),
            meta_sha256,
            meta_bytes,
            blob_bytes,
            blob_sample: Some(sample),
        },
        None => {
            blob.cleanup().await;
            BuiltLayer {
                file,
                blob: None,
                digest: meta_sha256.clone(),
                meta_sha256,
                meta_bytes,
                blob_bytes: 0,
                blob_sample: None,
            }
        }
    })
}

/// sha256 over the first and the last [`SAMPLE_BYTES`] of an object of `len` bytes (read
/// with `read_at`-style positioned reads), plus its length: a cheap check that a blob in the
/// store is the one the layer was built with (catches truncation, replacement, and damage at
/// either end) without reading all of it.
pub fn sample_digest<R: std::os::unix::fs::FileExt>(f: &mut R, len: u64) -> io::Result<String> {
    let mut h = Sha256::new();
    h.update(len.to_le_bytes());
    let head = SAMPLE_BYTES.min(len);
    let tail_start = len.saturating_sub(SAMPLE_BYTES).max(head);
    for (start, end) in [(0, head), (tail_start, len)] {
        let mut buf = vec![0u8; (end - start) as usize];
        f.read_exact_at(&mut buf, start)?;
        h.update(&buf);
    }
    Ok(hex::encode(h.finalize()))
}

/// sha256 (lowercase hex) and length of a file; fsyncs it as well, since it is about to be
/// moved into the store.
pub fn sha256_file(path: &Path) -> io::Result<(String, u64)> {
    let mut f = fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n_total = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        n_total += n as u64;
    }
    f.sync_all()?;
    Ok((hex::encode(h.finalize()), n_total))
}

// ---------------------------------------------------------------------------------------------
// tar unpacking
// ---------------------------------------------------------------------------------------------

const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_MARKER: &str = ".wh..wh..opq";

/// Unpacks a tar or gzip'd tar stream into `root` (an existing, empty directory).
/// Errors are human-readable messages naming the offending entry.
/// Why a layer tar could not be unpacked; names the offending entry where there is one.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("read archive: {0}")]
    Read(io::Error),
    #[error("the archive is empty; expected a tar or tar.gz stream")]
    Empty,
    #[error("unpack directory {}: {source}", path.display())]
    Root { path: PathBuf, source: io::Error },
    #[error("not a tar archive: {0}")]
    NotTar(String),
    #[error("corrupt tar archive after {entries} entries: {reason}")]
    Corrupt { entries: usize, reason: String },
    #[error("entry {index}: bad path: {source}")]
    BadPath { index: usize, source: io::Error },
    #[error("entry {0:?} escapes the image root (contains `..`)")]
    DotDot(String),
    #[error("entry {0:?} escapes the image root")]
    Escapes(String),
    /// A step on one entry failed; `step` is empty or ends in `": "`.
    #[error("entry {entry:?}: {step}{source}")]
    Entry {
        entry: String,
        step: &'static str,
        source: io::Error,
    },
    #[error("entry {entry:?}: {reason}")]
    Unpack { entry: String, reason: String },
    #[error("directory {}: {source}", path.display())]
    DirMeta { path: PathBuf, source: io::Error },
}

pub fn unpack_tar<R: Read>(reader: R, root: &Path) -> Result<(), UnpackError> {
    let mut buf = BufReader::with_capacity(1 << 16, reader);
    let magic = buf.fill_buf().map_err(UnpackError::Read)?;
    if magic.is_empty() {
        return Err(UnpackError::Empty);
    }
    let gz = magic.len() >= 2 && magic[0] == 0x1f && magic[1] == 0x8b;
    if gz {
        unpack_plain_tar(flate2::read::MultiGzDecoder::new(buf), root)
    } else {
        unpack_plain_tar(buf, root)
    }
}

struct Meta {
    mode: u32,
    uid: u64,
    gid: u64,
    mtime: u64,
    xattrs: Vec<(String, Vec<u8>)>,
}

fn unpack_plain_tar<R: Read>(reader: R, root: &Path) -> Result<(), UnpackError> {
    let root = root.canonicalize().map_err(|source| UnpackError::Root {
        path: root.to_path_buf(),
        source,
    })?;
    let mut ar = tar::Archive::new(reader);
    ar.set_preserve_permissions(true);
    ar.set_preserve_ownerships(true);
    ar.set_preserve_mtime(true);
    ar.set_unpack_xattrs(true);
    ar.set_overwrite(true);
    let entries = ar
        .entries()
        .map_err(|e| UnpackError::NotTar(error_chain(&e)))?;
    // Directory metadata is applied last, deepest first, so creating children neither
    // changes their mtimes nor trips over read-only modes.
    let mut dirs: Vec<(PathBuf, Meta)> = Vec::new();
    for (count, entry) in entries.enumerate() {
        let count = count + 1;
        let mut e = entry.map_err(|e| UnpackError::Corrupt {
            entries: count - 1,
            reason: error_chain(&e),
        })?;
        let raw_path = e
            .path()
            .map_err(|source| UnpackError::BadPath {
                index: count,
                source,
            })?
            .into_owned();
        let shown = raw_path.display().to_string();
        let rel = safe_relative(&raw_path).ok_or_else(|| UnpackError::DotDot(shown.clone()))?;
        let at = |step: &'static str| {
            let entry = shown.clone();
            move |source: io::Error| UnpackError::Entry {
                entry,
                step,
                source,
            }
        };
        let kind = e.header().entry_type();
        if rel.as_os_str().is_empty() {
            // "./" or "/": the root itself.
            if kind.is_dir() {
                let meta = entry_meta(&mut e).map_err(at(""))?;
                dirs.push((root.clone(), meta));
            }
            continue;
        }
        let file_name = rel.file_name().map(|n| n.as_bytes()).unwrap_or_default();
        let parent_rel = rel.parent().unwrap_or(Path::new(""));

        // OCI whiteouts → overlayfs whiteouts.
        if file_name.starts_with(WHITEOUT_PREFIX.as_bytes()) {
            let parent = ensure_dir(&root, parent_rel).map_err(at(""))?;
            if file_name == OPAQUE_MARKER.as_bytes() {
                set_xattr(&parent, OPAQUE_XATTR, b"y").map_err(at("mark directory opaque: "))?;
            } else {
                let target = parent.join(std::ffi::OsStr::from_bytes(
                    &file_name[WHITEOUT_PREFIX.len()..],
                ));
                replace_non_dir(&target).map_err(at(""))?;
                stat::mknod(&target, SFlag::S_IFCHR, Mode::empty(), stat::makedev(0, 0))
                    .map_err(|e| at("create whiteout: ")(e.into()))?;
            }
            continue;
        }

        if kind.is_dir() {
            let dir = ensure_dir(&root, &rel).map_err(at(""))?;
            let meta = entry_meta(&mut e).map_err(at(""))?;
            dirs.push((dir, meta));
        } else if kind.is_character_special() || kind.is_block_special() || kind.is_fifo() {
            let parent = ensure_dir(&root, parent_rel).map_err(at(""))?;
            let target = parent.join(rel.file_name().unwrap_or_default());
            let meta = entry_meta(&mut e).map_err(at(""))?;
            let (sflag, dev) = if kind.is_fifo() {
                (SFlag::S_IFIFO, 0)
            } else {
                let major = e.header().device_major().ok().flatten().unwrap_or(0);
                let minor = e.header().device_minor().ok().flatten().unwrap_or(0);
                let flag = if kind.is_block_special() {
                    SFlag::S_IFBLK
                } else {
                    SFlag::S_IFCHR
                };
                (flag, stat::makedev(major.into(), minor.into()))
            };
            replace_non_dir(&target).map_err(at(""))?;
            stat::mknod(&target, sflag, Mode::from_bits_truncate(0o600), dev)
                .map_err(|e| at("mknod: ")(e.into()))?;
            apply_meta(&target, &meta).map_err(at(""))?;
        } else {
            // Regular files, symlinks, hard links (and anything else the tar crate knows).
            // Pre-create the parent with our own checks; the tar crate then validates again.
            ensure_dir(&root, parent_rel).map_err(at(""))?;
            let xattrs = if kind.is_symlink() {
                entry_meta(&mut e).map_err(at(""))?.xattrs
            } else {
                Vec::new()
            };
            let unpacked = e.unpack_in(&root).map_err(|err| UnpackError::Unpack {
                entry: shown.clone(),
                reason: error_chain(&err),
            })?;
            if !unpacked {
                return Err(UnpackError::Escapes(shown));
            }
            // The tar crate sets xattrs on regular files only.
            for (k, v) in &xattrs {
                let _ = set_xattr(&root.join(&rel), k, v);
            }
        }
    }
    dirs.sort_by(|a, b| b.0.cmp(&a.0));
    for (dir, meta) in &dirs {
        apply_meta(dir, meta).map_err(|source| UnpackError::DirMeta {
            path: dir.clone(),
            source,
        })?;
    }
    Ok(())
}

/// `err: source: source ...` — the tar crate puts the useful part in the source.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        let s = e.to_string();
        if !out.contains(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = e.source();
    }
    out
}

/// Strips leading `/` and `.` components; `None` if the path has a `..` component.
fn safe_relative(p: &Path) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Prefix(_) | Component::RootDir | Component::CurDir => {}
            Component::ParentDir => return None,
            Component::Normal(n) => out.push(n),
        }
    }
    Some(out)
}

fn entry_meta<R: Read>(e: &mut tar::Entry<'_, R>) -> io::Result<Meta> {
    let h = e.header();
    let meta = Meta {
        mode: h.mode()?,
        uid: h.uid()?,
        gid: h.gid()?,
        mtime: h.mtime().unwrap_or(0),
        xattrs: Vec::new(),
    };
    let mut xattrs = Vec::new();
    if let Some(exts) = e.pax_extensions()? {
        for ext in exts {
            let ext = ext?;
            if let Ok(key) = ext.key() {
                if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
                    xattrs.push((name.to_string(), ext.value_bytes().to_vec()));
                }
            }
        }
    }
    Ok(Meta { xattrs, ..meta })
}

/// Creates `root/rel` as a directory (and its parents), refusing to leave `root`: existing
/// symlinks on the way are followed only if they resolve to a directory inside `root`.
/// Returns the resolved directory path.
fn ensure_dir(root: &Path, rel: &Path) -> io::Result<PathBuf> {
    let mut cur = root.to_path_buf();
    for c in rel.components() {
        let Component::Normal(part) = c else {
            return Err(io::Error::other("path component outside the image root"));
        };
        let next = cur.join(part);
        match fs::symlink_metadata(&next) {
            Ok(m) if m.is_dir() => cur = next,
            Ok(m) if m.file_type().is_symlink() => {
                let resolved = next.canonicalize()?;
                if !resolved.starts_with(root) || !resolved.is_dir() {
                    return Err(io::Error::other(format!(
                        "{} is a symlink leading outside the image root or to a non-directory",
                        next.display()
                    )));
                }
                cur = resolved;
            }
            Ok(_) => {
                return Err(io::Error::other(format!(
                    "{} exists and is not a directory",
                    next.display()
                )))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir(&next)?;
                fs::set_permissions(&next, fs::Permissions::from_mode(0o755))?;
                cur = next;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(cur)
}

/// Removes an existing non-directory at `p` (later tar entries replace earlier ones).
fn replace_non_dir(p: &Path) -> io::Result<()> {
    match fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => Err(io::Error::other(format!(
            "{} is a directory; refusing to replace it",
            p.display()
        ))),
        Ok(_) => fs::remove_file(p),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Owner, then mode (so set-id bits survive), then xattrs, then mtime. Never follows a
/// symlink at `p`.
fn apply_meta(p: &Path, m: &Meta) -> io::Result<()> {
    {
        let uid = u32::try_from(m.uid).map_err(|_| io::Error::other("uid out of range"))?;
        let gid = u32::try_from(m.gid).map_err(|_| io::Error::other("gid out of range"))?;
        nix::unistd::fchownat(
            None,
            p,
            Some(Uid::from_raw(uid)),
            Some(Gid::from_raw(gid)),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )?;
    }
    let md = fs::symlink_metadata(p)?;
    if !md.file_type().is_symlink() {
        fs::set_permissions(p, fs::Permissions::from_mode(m.mode & 0o7777))?;
    }
    for (k, v) in &m.xattrs {
        set_xattr(p, k, v)?;
    }
    let t = TimeSpec::new(i64::try_from(m.mtime).unwrap_or(0), 0);
    stat::utimensat(None, p, &t, &t, stat::UtimensatFlags::NoFollowSymlink)?;
    Ok(())
}

/// `lsetxattr(2)`.
pub fn set_xattr(p: &Path, name: &str, value: &[u8]) -> io::Result<()> {
    let cpath = CString::new(p.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let cname = CString::new(name).map_err(io::Error::other)?;
    // SAFETY: both strings are valid NUL-terminated C strings that outlive the call, and
    // `value` is a valid buffer of `value.len()` bytes.
    let rc = unsafe {
        libc::lsetxattr(
            cpath.as_ptr(),
            cname.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safe_relative_paths() {
        assert_eq!(
            safe_relative(Path::new("/a/./b")).unwrap(),
            Path::new("a/b")
        );
        assert_eq!(safe_relative(Path::new("./")).unwrap(), Path::new(""));
        assert!(safe_relative(Path::new("a/../../b")).is_none());
    }

    #[test]
    fn ensure_dir_refuses_symlink_escape() {
        let root = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let root_path = root.path().canonicalize().unwrap();
        std::os::unix::fs::symlink(outside.path(), root_path.join("evil")).unwrap();
        assert!(ensure_dir(&root_path, Path::new("evil/x")).is_err());
        assert!(!outside.path().join("x").exists());
        std::os::unix::fs::symlink("sub", root_path.join("good")).unwrap();
        fs::create_dir(root_path.join("sub")).unwrap();
        let d = ensure_dir(&root_path, Path::new("good/y")).unwrap();
        assert_eq!(d, root_path.join("sub/y"));
    }

    #[test]
    fn tar_with_parent_component_is_refused() {
        let mut data = Vec::new();
        {
            let mut b = tar::Builder::new(&mut data);
            let mut h = tar::Header::new_gnu();
            h.set_size(2);
            h.set_mode(0o644);
            h.set_entry_type(tar::EntryType::Regular);
            // set_path refuses `..`, so write the name bytes directly.
            let name = b"../evil";
            h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name);
            h.set_cksum();
            b.append(&h, &b"hi"[..]).unwrap();
            b.finish().unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let err = unpack_tar(&data[..], dir.path()).unwrap_err().to_string();
        assert!(err.contains("escapes the image root"), "{err}");
    }

    #[test]
    fn empty_and_garbage_streams() {
        let dir = tempfile::tempdir().unwrap();
        assert!(unpack_tar(&b""[..], dir.path())
            .unwrap_err()
            .to_string()
            .contains("empty"));
        let garbage = vec![0x42u8; 2000];
        assert!(unpack_tar(&garbage[..], dir.path()).is_err());
        let bad_gz = [0x1f, 0x8b, 0, 1, 2, 3, 4, 5, 6, 7, 8];
        assert!(unpack_tar(&bad_gz[..], dir.path()).is_err());
    }
}
