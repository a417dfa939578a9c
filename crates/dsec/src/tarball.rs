//! Builds a tar stream of a directory tree on a blocking thread, preserving owners, modes,
//! times, symlinks, hard links, device nodes and extended attributes (PAX `SCHILY.xattr.*`).

use std::collections::HashMap;
use std::ffi::CString;
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use tokio::sync::mpsc;

/// A `Write` that sends full buffers down a channel (used from a blocking thread).
struct ChannelWriter {
    tx: mpsc::Sender<io::Result<Bytes>>,
    buf: Vec<u8>,
}

const BUF: usize = 256 * 1024;

impl ChannelWriter {
    fn send_buf(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(&mut self.buf, Vec::with_capacity(BUF)));
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| io::Error::new(io::ErrorKind::BrokenPipe, "upload stopped"))
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= BUF {
            self.send_buf()?;
        }
        Ok(data.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        self.send_buf()
    }
}

/// Starts archiving `dir`; the returned receiver yields the tar stream (an error ends it).
pub fn stream_dir(dir: PathBuf) -> mpsc::Receiver<io::Result<Bytes>> {
    let (tx, rx) = mpsc::channel(8);
    let err_tx = tx.clone();
    tokio::task::spawn_blocking(move || {
        let w = ChannelWriter {
            tx,
            buf: Vec::with_capacity(BUF),
        };
        if let Err(e) = write_tar(&dir, w) {
            let _ = err_tx.blocking_send(Err(io::Error::new(
                e.kind(),
                format!("archive {}: {e}", dir.display()),
            )));
        }
    });
    rx
}

/// Writes the tar of `dir` (entries relative to it) into `w`.
pub fn write_tar<W: Write>(dir: &Path, w: W) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.is_dir() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a directory", dir.display()),
        ));
    }
    let mut b = tar::Builder::new(w);
    b.follow_symlinks(false);
    let mut links: HashMap<(u64, u64), PathBuf> = HashMap::new();
    walk(&mut b, dir, Path::new(""), &mut links)?;
    b.finish()?;
    b.into_inner()?.flush()
}

fn walk<W: Write>(
    b: &mut tar::Builder<W>,
    root: &Path,
    rel: &Path,
    links: &mut HashMap<(u64, u64), PathBuf>,
) -> io::Result<()> {
    let mut names: Vec<_> = std::fs::read_dir(root.join(rel))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<io::Result<_>>()?;
    names.sort();
    for name in names {
        let rel_path = rel.join(&name);
        let full = root.join(&rel_path);
        let meta = std::fs::symlink_metadata(&full)?;
        let ft = meta.file_type();
        if ft.is_socket() {
            continue; // sockets cannot be archived
        }
        let xattrs = list_xattrs(&full)?;
        if !xattrs.is_empty() {
            let pax: Vec<(String, Vec<u8>)> = xattrs
                .into_iter()
                .map(|(k, v)| (format!("SCHILY.xattr.{k}"), v))
                .collect();
            b.append_pax_extensions(pax.iter().map(|(k, v)| (k.as_str(), v.as_slice())))?;
        }
        let mut h = tar::Header::new_gnu();
        h.set_metadata_in_mode(&meta, tar::HeaderMode::Complete);
        if ft.is_dir() {
            h.set_size(0);
            b.append_data(&mut h, &rel_path, io::empty())?;
            walk(b, root, &rel_path, links)?;
        } else if ft.is_symlink() {
            let target = std::fs::read_link(&full)?;
            h.set_size(0);
            b.append_link(&mut h, &rel_path, &target)?;
        } else if ft.is_file() {
            if meta.nlink() > 1 {
                let key = (meta.dev(), meta.ino());
                if let Some(first) = links.get(&key) {
                    h.set_entry_type(tar::EntryType::Link);
                    h.set_size(0);
                    b.append_link(&mut h, &rel_path, first)?;
                    continue;
                }
                links.insert(key, rel_path.clone());
            }
            let f = std::fs::File::open(&full)?;
            b.append_data(&mut h, &rel_path, f)?;
        } else {
            // fifo, char or block device: header only (major/minor set from metadata).
            h.set_size(0);
            b.append_data(&mut h, &rel_path, io::empty())?;
        }
    }
    Ok(())
}

/// Extended attributes of `path` (not following symlinks).
fn list_xattrs(path: &Path) -> io::Result<Vec<(String, Vec<u8>)>> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path has a NUL byte"))?;
    // SAFETY: `c` is a valid NUL-terminated path; a null buffer of size 0 asks for the size.
    let size = unsafe { libc::llistxattr(c.as_ptr(), std::ptr::null_mut(), 0) };
    if size < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOTSUP) => Ok(Vec::new()),
            _ => Err(e),
        };
    }
    if size == 0 {
        return Ok(Vec::new());
    }
    let mut names = vec![0u8; size as usize];
    // SAFETY: `names` has `names.len()` writable bytes; `c` is a valid path.
    let size = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    if size < 0 {
        return Err(io::Error::last_os_error());
    }
    names.truncate(size as usize);
    let mut out = Vec::new();
    for name in names.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let cname = CString::new(name)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "xattr name has a NUL"))?;
        // SAFETY: valid NUL-terminated strings; size query with a null buffer.
        let len = unsafe { libc::lgetxattr(c.as_ptr(), cname.as_ptr(), std::ptr::null_mut(), 0) };
        if len < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut value = vec![0u8; len as usize];
        // SAFETY: `value` has `value.len()` writable bytes.
        let len = unsafe {
            libc::lgetxattr(
                c.as_ptr(),
                cname.as_ptr(),
                value.as_mut_ptr().cast(),
                value.len(),
            )
        };
        if len < 0 {
            return Err(io::Error::last_os_error());
        }
        value.truncate(len as usize);
        out.push((String::from_utf8_lossy(name).into_owned(), value));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn archives_links_modes_and_xattrs() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir(d.join("bin")).unwrap();
        std::fs::write(d.join("bin/tool"), b"#!/bin/sh\necho hi\n").unwrap();
        std::fs::set_permissions(d.join("bin/tool"), std::fs::Permissions::from_mode(0o4755))
            .unwrap();
        std::fs::hard_link(d.join("bin/tool"), d.join("bin/tool2")).unwrap();
        std::os::unix::fs::symlink("tool", d.join("bin/sym")).unwrap();
        let long = "x".repeat(150);
        std::fs::write(d.join(&long), b"long").unwrap();
        let c = CString::new(d.join("bin/tool").as_os_str().as_bytes()).unwrap();
        let k = CString::new("user.dsec").unwrap();
        // SAFETY: valid NUL-terminated strings and a 3-byte value buffer.
        let xattr_ok =
            unsafe { libc::lsetxattr(c.as_ptr(), k.as_ptr(), b"yes".as_ptr().cast(), 3, 0) } == 0;

        let mut out = Vec::new();
        write_tar(d, &mut out).unwrap();
        let mut ar = tar::Archive::new(&out[..]);
        let mut seen = HashMap::new();
        for e in ar.entries().unwrap() {
            let mut e = e.unwrap();
            let path = e.path().unwrap().into_owned();
            let kind = e.header().entry_type();
            let mode = e.header().mode().unwrap();
            let link = e.link_name().unwrap().map(|l| l.into_owned());
            let mut xattr = None;
            if let Some(exts) = e.pax_extensions().unwrap() {
                for ext in exts {
                    let ext = ext.unwrap();
                    if ext.key().unwrap() == "SCHILY.xattr.user.dsec" {
                        xattr = Some(ext.value_bytes().to_vec());
                    }
                }
            }
            seen.insert(path, (kind, mode, link, xattr));
        }
        let tool = &seen[Path::new("bin/tool")];
        assert_eq!(tool.0, tar::EntryType::Regular);
        assert_eq!(tool.1 & 0o7777, 0o4755);
        if xattr_ok {
            assert_eq!(tool.3.as_deref(), Some(&b"yes"[..]));
        }
        let tool2 = &seen[Path::new("bin/tool2")];
        assert_eq!(tool2.0, tar::EntryType::Link);
        assert_eq!(tool2.2.as_deref(), Some(Path::new("bin/tool")));
        let sym = &seen[Path::new("bin/sym")];
        assert_eq!(sym.0, tar::EntryType::Symlink);
        assert_eq!(sym.2.as_deref(), Some(Path::new("tool")));
        assert!(seen.contains_key(Path::new(&long)));
        assert_eq!(seen[Path::new("bin")].0, tar::EntryType::Directory);
    }
}
