//! File requests. They run as aether (root inside the sandbox); files and dirs they create are
//! given to the sandbox user and get exactly the requested mode (umask does not apply).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use dsec_wire::aether::{AetherErrorKind, Reply, CHUNK};
use dsec_wire::api::{FileInfo, FileKind, FileList};

use crate::server::{lock, Server};
use crate::sys;

/// An upload in progress (between `WriteBegin` and `WriteEnd`).
pub struct Upload {
    file: File,
    path: PathBuf,
}

/// Maps an I/O error on `path` to the wire error kind, with a message naming the path.
pub fn io_error(what: &str, path: &Path, e: &io::Error) -> (AetherErrorKind, String) {
    let kind = match e.raw_os_error() {
        Some(libc::ENOENT) | Some(libc::ENOTDIR) => AetherErrorKind::NotFound,
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => {
            AetherErrorKind::PermissionDenied
        }
        Some(libc::EISDIR) | Some(libc::ENOTEMPTY) => AetherErrorKind::WrongKind,
        Some(libc::EEXIST) | Some(libc::EINVAL) | Some(libc::ENAMETOOLONG) | Some(libc::ELOOP) => {
            AetherErrorKind::BadRequest
        }
        _ => AetherErrorKind::Internal,
    };
    (kind, format!("{what} {}: {e}", path.display()))
}

fn fail(srv: &Server, id: u64, what: &str, path: &Path, e: &io::Error) {
    let (kind, msg) = io_error(what, path, e);
    srv.w.error(id, kind, msg);
}

pub fn file_info(path: &Path, meta: &fs::Metadata) -> FileInfo {
    let ft = meta.file_type();
    let kind = if ft.is_symlink() {
        FileKind::Symlink
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_file() {
        FileKind::File
    } else {
        FileKind::Other
    };
    let link_target = if ft.is_symlink() {
        fs::read_link(path)
            .ok()
            .map(|t| t.to_string_lossy().into_owned())
    } else {
        None
    };
    FileInfo {
        path: path.to_string_lossy().into_owned(),
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        kind,
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        mtime: meta.mtime(),
        link_target,
    }
}

/// Creates missing parent dirs of `path`, owned by the sandbox user, mode 0755.
fn make_dirs(srv: &Server, dir: &Path, mode: u32) -> io::Result<()> {
    if dir.as_os_str().is_empty() || dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        make_dirs(srv, parent, 0o755)?;
    }
    make_one_dir(srv, dir, mode)
}

fn make_one_dir(srv: &Server, dir: &Path, mode: u32) -> io::Result<()> {
    fs::DirBuilder::new().mode(0o700).create(dir)?;
    let f = File::open(dir)?;
    sys::own_and_mode(f.as_raw_fd(), srv.owner(), mode)
}

pub fn write_begin(srv: &Server, id: u64, path: &str, mode: u32, make_parents: bool) {
    let path = srv.resolve_path(path);
    let opened = (|| -> io::Result<File> {
        if make_parents {
            if let Some(parent) = path.parent() {
                make_dirs(srv, parent, 0o755)?;
            }
        }
        let file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)?;
        sys::own_and_mode(file.as_raw_fd(), srv.owner(), mode)?;
        Ok(file)
    })();
    match opened {
        Ok(file) => {
            lock(&srv.uploads).insert(id, Upload { file, path });
        }
        Err(e) => fail(srv, id, "write", &path, &e),
    }
}

pub fn write_chunk(srv: &Server, id: u64, body: &[u8]) {
    let mut ups = lock(&srv.uploads);
    // Chunks of an upload that already failed (or never began) are dropped silently: that
    // request already got its terminal reply.
    let Some(up) = ups.get_mut(&id) else { return };
    if let Err(e) = up.file.write_all(body) {
        let up = ups.remove(&id);
        drop(ups);
        if let Some(up) = up {
            fail(srv, id, "write", &up.path, &e);
        }
    }
}

pub fn write_end(srv: &Server, id: u64) {
    let Some(up) = lock(&srv.uploads).remove(&id) else {
        return;
    };
    match up.file.metadata() {
        Ok(meta) => {
            srv.w
                .send(id, Reply::Written(file_info(&up.path, &meta)), &[]);
        }
        Err(e) => fail(srv, id, "write", &up.path, &e),
    }
}

pub fn read_file(srv: &Server, id: u64, path: &str) {
    let path = srv.resolve_path(path);
    let mut file = match File::open(&path) {
        Ok(f) => f,
        Err(e) => return fail(srv, id, "read", &path, &e),
    };
    let meta = match file.metadata() {
        Ok(m) => m,
        Err(e) => return fail(srv, id, "read", &path, &e),
    };
    if meta.is_dir() {
        srv.w.error(
            id,
            AetherErrorKind::WrongKind,
            format!("read {}: is a directory", path.display()),
        );
        return;
    }
    let mut buf = vec![0u8; CHUNK];
    let mut size = 0u64;
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                size += n as u64;
                if !srv.w.send(id, Reply::Data, &buf[..n]) {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return fail(srv, id, "read", &path, &e),
        }
    }
    srv.w.send(
        id,
        Reply::FileEnd {
            size,
            mode: meta.permissions().mode() & 0o7777,
        },
        &[],
    );
}

pub fn list_dir(srv: &Server, id: u64, path: &str) {
    let path = srv.resolve_path(path);
    let rd = match fs::read_dir(&path) {
        Ok(rd) => rd,
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
            srv.w.error(
                id,
                AetherErrorKind::WrongKind,
                format!("list {}: not a directory", path.display()),
            );
            return;
        }
        Err(e) => return fail(srv, id, "list", &path, &e),
    };
    let mut entries = Vec::new();
    for ent in rd.flatten() {
        let p = ent.path();
        if let Ok(meta) = fs::symlink_metadata(&p) {
            entries.push(file_info(&p, &meta));
        }
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    srv.w.send(
        id,
        Reply::Listed(FileList {
            path: path.to_string_lossy().into_owned(),
            entries,
        }),
        &[],
    );
}

pub fn stat(srv: &Server, id: u64, path: &str) {
    let path = srv.resolve_path(path);
    match fs::symlink_metadata(&path) {
        Ok(meta) => {
            srv.w.send(id, Reply::Stat(file_info(&path, &meta)), &[]);
        }
        Err(e) => fail(srv, id, "stat", &path, &e),
    }
}

pub fn remove(srv: &Server, id: u64, path: &str, recursive: bool) {
    let path = srv.resolve_path(path);
    let meta = match fs::symlink_metadata(&path) {
        Ok(m) => m,
        Err(e) => return fail(srv, id, "remove", &path, &e),
    };
    let res = if meta.is_dir() {
        if recursive {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_dir(&path)
        }
    } else {
        fs::remove_file(&path)
    };
    match res {
        Ok(()) => {
            srv.w.send(id, Reply::Done, &[]);
        }
        Err(e) => fail(srv, id, "remove", &path, &e),
    }
}

/// Renames (moves) `src` to `dst`; `dst` must not exist unless `overwrite`.
pub fn rename(srv: &Server, id: u64, src: &str, dst: &str, overwrite: bool) {
    use std::os::unix::ffi::OsStrExt;
    let (src, dst) = (srv.resolve_path(src), srv.resolve_path(dst));
    let res = if overwrite {
        fs::rename(&src, &dst)
    } else {
        match (
            std::ffi::CString::new(src.as_os_str().as_bytes()),
            std::ffi::CString::new(dst.as_os_str().as_bytes()),
        ) {
            (Ok(s), Ok(d)) => crate::sys::rename_noreplace(&s, &d),
            _ => Err(io::Error::from(io::ErrorKind::InvalidInput)),
        }
    };
    if let Err(e) = res {
        if e.raw_os_error() == Some(libc::EEXIST) {
            srv.w.error(
                id,
                AetherErrorKind::WrongKind,
                format!(
                    "rename {} to {}: the destination exists (pass overwrite=true to replace it)",
                    src.display(),
                    dst.display()
                ),
            );
            return;
        }
        // Which path the error is about is not known for every errno: name the source.
        return fail(srv, id, "rename", &src, &e);
    }
    match fs::symlink_metadata(&dst) {
        Ok(meta) => {
            srv.w.send(id, Reply::Stat(file_info(&dst, &meta)), &[]);
        }
        Err(e) => fail(srv, id, "stat", &dst, &e),
    }
}

pub fn mkdir(srv: &Server, id: u64, path: &str, mode: u32, parents: bool) {
    let path = srv.resolve_path(path);
    let res = if parents {
        if let Ok(m) = fs::symlink_metadata(&path) {
            if !m.is_dir() {
                srv.w.error(
                    id,
                    AetherErrorKind::WrongKind,
                    format!("mkdir {}: exists and is not a directory", path.display()),
                );
                return;
            }
        }
        make_dirs(srv, &path, mode)
    } else {
        make_one_dir(srv, &path, mode)
    };
    if let Err(e) = res {
        return fail(srv, id, "mkdir", &path, &e);
    }
    match fs::symlink_metadata(&path) {
        Ok(meta) => {
            srv.w.send(id, Reply::Stat(file_info(&path, &meta)), &[]);
        }
        Err(e) => fail(srv, id, "mkdir", &path, &e),
    }
}
