//! `Watch`: filesystem events with inotify, inside the sandbox.
//!
//! The inotify instance is made by aether in the sandbox's own mount namespace, so it sees
//! exactly the paths the sandbox sees. One instance per watch request; it is closed when the
//! request ends (the edge cancels it when its client goes away, or the channel closes), so no
//! fd outlives its watcher. Events are sent in the order the kernel queued them, one `FsEvents`
//! reply per read of the inotify fd.
//!
//! A recursive watch adds a watch for every new directory when it reads the directory's
//! create event, before it sends that event, and reports the entries the directory already has
//! then as creates: once a client has seen a directory's create, everything inside it is seen.
//! What is made and removed again inside a new directory before that can be missed (inotify has
//! no recursive mode).

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use dsec_wire::aether::{AetherErrorKind, Reply};
use dsec_wire::api::{FsEvent, FsEventKind};

use crate::server::Server;
use crate::sys;

/// Most directories one recursive watch may cover.
pub const MAX_WATCHED_DIRS: usize = 8192;

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_DELETE_SELF
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_MOVE_SELF
    | libc::IN_ATTRIB
    | libc::IN_ONLYDIR;

/// One inotify event as read from the fd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawEvent {
    pub wd: i32,
    pub mask: u32,
    pub cookie: u32,
    pub name: Vec<u8>,
}

/// Splits a buffer read from an inotify fd into events.
pub fn parse_events(buf: &[u8]) -> Vec<RawEvent> {
    let mut out = Vec::new();
    let mut at = 0;
    while buf.len() - at >= 16 {
        let word = |i: usize| {
            let b = &buf[at + i..at + i + 4];
            [b[0], b[1], b[2], b[3]]
        };
        let wd = i32::from_ne_bytes(word(0));
        let mask = u32::from_ne_bytes(word(4));
        let cookie = u32::from_ne_bytes(word(8));
        let len = u32::from_ne_bytes(word(12)) as usize;
        if buf.len() - at - 16 < len {
            break;
        }
        let raw = &buf[at + 16..at + 16 + len];
        let name = raw.split(|&b| b == 0).next().unwrap_or(&[]).to_vec();
        out.push(RawEvent {
            wd,
            mask,
            cookie,
            name,
        });
        at += 16 + len;
    }
    out
}

/// Turns raw events into API events: pairs `MOVED_FROM`/`MOVED_TO` by cookie into one
/// `rename`, folds repeated writes of one path, resolves watch descriptors into paths.
pub struct Translator {
    dirs: HashMap<i32, PathBuf>,
    /// A `MOVED_FROM` waiting for its `MOVED_TO`: (cookie, event).
    pending_move: Option<(u32, FsEvent)>,
}

impl Translator {
    pub fn new() -> Self {
        Translator {
            dirs: HashMap::new(),
            pending_move: None,
        }
    }

    pub fn add_dir(&mut self, wd: i32, path: PathBuf) {
        self.dirs.insert(wd, path);
    }

    pub fn dir_count(&self) -> usize {
        self.dirs.len()
    }

    fn flush_move(&mut self, out: &mut Vec<FsEvent>) {
        if let Some((_, ev)) = self.pending_move.take() {
            out.push(ev);
        }
    }

    /// Translates one read's events. Returns the events and the new directories (created or
    /// moved in) a recursive watch must add.
    pub fn translate(&mut self, raw: &[RawEvent]) -> (Vec<FsEvent>, Vec<PathBuf>) {
        let mut out: Vec<FsEvent> = Vec::new();
        let mut new_dirs = Vec::new();
        for e in raw {
            if e.mask & libc::IN_Q_OVERFLOW != 0 {
                self.flush_move(&mut out);
                out.push(FsEvent {
                    kind: FsEventKind::Overflow,
                    path: String::new(),
                    to: None,
                    is_dir: false,
                });
                continue;
            }
            if e.mask & libc::IN_IGNORED != 0 {
                self.dirs.remove(&e.wd);
                continue;
            }
            let Some(dir) = self.dirs.get(&e.wd) else {
                continue;
            };
            let path = if e.name.is_empty() {
                dir.clone()
            } else {
                dir.join(std::ffi::OsStr::from_bytes(&e.name))
            };
            let is_dir = e.mask & libc::IN_ISDIR != 0;
            let text = path.to_string_lossy().into_owned();
            let ev = |kind| FsEvent {
                kind,
                path: text.clone(),
                to: None,
                is_dir,
            };
            if e.mask & libc::IN_MOVED_TO != 0 {
                match self.pending_move.take() {
                    Some((cookie, mut from)) if cookie == e.cookie => {
                        from.to = Some(text.clone());
                        out.push(from);
                    }
                    other => {
                        if let Some((_, ev)) = other {
                            out.push(ev);
                        }
                        out.push(ev(FsEventKind::Create));
                    }
                }
                if is_dir {
                    new_dirs.push(path);
                }
                continue;
            }
            self.flush_move(&mut out);
            if e.mask & libc::IN_MOVED_FROM != 0 {
                self.pending_move = Some((e.cookie, ev(FsEventKind::Rename)));
                continue;
            }
            let kind = if e.mask & libc::IN_CREATE != 0 {
                if is_dir {
                    new_dirs.push(path.clone());
                }
                FsEventKind::Create
            } else if e.mask & libc::IN_MODIFY != 0 {
                FsEventKind::Write
            } else if e.mask & (libc::IN_DELETE | libc::IN_DELETE_SELF) != 0 {
                // A watched dir reports its own deletion after its parent reported it: once.
                if e.mask & libc::IN_DELETE_SELF != 0 {
                    continue;
                }
                FsEventKind::Remove
            } else if e.mask & libc::IN_ATTRIB != 0 {
                FsEventKind::Chmod
            } else {
                // IN_MOVE_SELF: the parent reports the move.
                continue;
            };
            let new = ev(kind);
            // Many write(2)s in a row to one file are one `write`.
            if kind == FsEventKind::Write && out.last() == Some(&new) {
                continue;
            }
            out.push(new);
        }
        self.flush_move(&mut out);
        (out, new_dirs)
    }
}

impl Default for Translator {
    fn default() -> Self {
        Self::new()
    }
}

fn inotify() -> std::io::Result<OwnedFd> {
    // SAFETY: inotify_init1 takes only flags.
    let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn add_watch(fd: RawFd, path: &Path) -> std::io::Result<i32> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    let wd = unsafe { libc::inotify_add_watch(fd, c.as_ptr(), MASK) };
    if wd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(wd)
}

/// Adds watches for `root` and (when `recursive`) every dir below it; dirs that vanish or
/// cannot be read meanwhile are skipped. Returns the dirs added.
fn watch_tree(fd: RawFd, t: &mut Translator, root: &Path, recursive: bool) -> Vec<PathBuf> {
    let mut added = Vec::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        if t.dir_count() >= MAX_WATCHED_DIRS {
            break;
        }
        let Ok(wd) = add_watch(fd, &dir) else {
            continue;
        };
        t.add_dir(wd, dir.clone());
        added.push(dir.clone());
        if !recursive {
            break;
        }
        if let Ok(rd) = std::fs::read_dir(&dir) {
            for entry in rd.flatten() {
                if entry.file_type().is_ok_and(|ft| ft.is_dir()) {
                    todo.push(entry.path());
                }
            }
        }
    }
    added
}

/// The entries already in a dir that was just created (made before its watch existed).
fn entries_of(dir: &Path) -> Vec<FsEvent> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    rd.flatten()
        .map(|e| FsEvent {
            kind: FsEventKind::Create,
            path: e.path().to_string_lossy().into_owned(),
            to: None,
            is_dir: e.file_type().is_ok_and(|ft| ft.is_dir()),
        })
        .collect()
}

pub fn run(srv: &Server, id: u64, path: &str, recursive: bool) {
    let root = srv.resolve_path(path);
    match std::fs::metadata(&root) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            srv.w.error(
                id,
                AetherErrorKind::WrongKind,
                format!(
                    "watch {}: not a directory (watch its parent)",
                    root.display()
                ),
            );
            return;
        }
        Err(e) => {
            let kind = if e.kind() == std::io::ErrorKind::NotFound {
                AetherErrorKind::NotFound
            } else {
                AetherErrorKind::PermissionDenied
            };
            srv.w
                .error(id, kind, format!("watch {}: {e}", root.display()));
            return;
        }
    }
    let guard = match srv.cancellable(id) {
        Ok(g) => g,
        Err(e) => {
            srv.w.error(
                id,
                AetherErrorKind::Internal,
                format!("watch: eventfd: {e}"),
            );
            return;
        }
    };
    let fd = match inotify() {
        Ok(fd) => fd,
        Err(e) => {
            let kind = if e.raw_os_error() == Some(libc::EMFILE) {
                AetherErrorKind::Busy
            } else {
                AetherErrorKind::Internal
            };
            srv.w.error(id, kind, format!("watch: inotify: {e}"));
            return;
        }
    };
    let mut t = Translator::new();
    if watch_tree(fd.as_raw_fd(), &mut t, &root, recursive).is_empty() {
        srv.w.error(
            id,
            AetherErrorKind::PermissionDenied,
            format!("watch {}: cannot watch it", root.display()),
        );
        return;
    }
    // Empty: the watch is in place.
    if !srv.w.send(id, Reply::FsEvents { events: Vec::new() }, &[]) {
        return;
    }
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let mut pfds = [
            libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: guard.cancel.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        if sys::poll(&mut pfds, -1).is_err() {
            std::thread::sleep(std::time::Duration::from_millis(10));
            continue;
        }
        if pfds[1].revents != 0 {
            break;
        }
        if pfds[0].revents == 0 {
            continue;
        }
        let n = match sys::read(fd.as_raw_fd(), &mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                srv.w
                    .error(id, AetherErrorKind::Internal, format!("watch: read: {e}"));
                return;
            }
        };
        let raw = parse_events(&buf[..n]);
        let (mut events, new_dirs) = t.translate(&raw);
        if recursive {
            for d in new_dirs {
                for added in watch_tree(fd.as_raw_fd(), &mut t, &d, true) {
                    events.extend(entries_of(&added));
                }
            }
        }
        if events.is_empty() {
            continue;
        }
        if !srv.w.send(id, Reply::FsEvents { events }, &[]) {
            return;
        }
    }
    drop(fd);
    srv.w.send(id, Reply::Done, &[]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(wd: i32, mask: u32, cookie: u32, name: &str) -> RawEvent {
        RawEvent {
            wd,
            mask,
            cookie,
            name: name.as_bytes().to_vec(),
        }
    }

    fn encode(e: &RawEvent, pad: usize) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&e.wd.to_ne_bytes());
        v.extend_from_slice(&e.mask.to_ne_bytes());
        v.extend_from_slice(&e.cookie.to_ne_bytes());
        let mut name = e.name.clone();
        name.resize(e.name.len() + pad, 0);
        v.extend_from_slice(&(name.len() as u32).to_ne_bytes());
        v.extend_from_slice(&name);
        v
    }

    #[test]
    fn parses_padded_events() {
        let a = raw(1, libc::IN_CREATE, 0, "a.txt");
        let b = raw(2, libc::IN_DELETE, 0, "");
        let mut buf = encode(&a, 3);
        buf.extend(encode(&b, 0));
        buf.extend_from_slice(&[1, 2, 3]); // a torn tail is ignored
        assert_eq!(parse_events(&buf), vec![a, b]);
    }

    fn kinds(evs: &[FsEvent]) -> Vec<(FsEventKind, &str, Option<&str>)> {
        evs.iter()
            .map(|e| (e.kind, e.path.as_str(), e.to.as_deref()))
            .collect()
    }

    #[test]
    fn translates_in_order_and_pairs_renames() {
        let mut t = Translator::new();
        t.add_dir(1, PathBuf::from("/w"));
        let (evs, new_dirs) = t.translate(&[
            raw(1, libc::IN_CREATE, 0, "f"),
            raw(1, libc::IN_MODIFY, 0, "f"),
            raw(1, libc::IN_MODIFY, 0, "f"),
            raw(1, libc::IN_MOVED_FROM, 7, "f"),
            raw(1, libc::IN_MOVED_TO, 7, "g"),
            raw(1, libc::IN_ATTRIB, 0, "g"),
            raw(1, libc::IN_CREATE | libc::IN_ISDIR, 0, "d"),
            raw(1, libc::IN_MOVED_FROM, 9, "g"),
            raw(1, libc::IN_DELETE, 0, "x"),
            raw(5, libc::IN_CREATE, 0, "unknown-wd"),
        ]);
        use FsEventKind::*;
        assert_eq!(
            kinds(&evs),
            vec![
                (Create, "/w/f", None),
                (Write, "/w/f", None),
                (Rename, "/w/f", Some("/w/g")),
                (Chmod, "/w/g", None),
                (Create, "/w/d", None),
                (Rename, "/w/g", None),
                (Remove, "/w/x", None),
            ]
        );
        assert!(evs[4].is_dir);
        assert_eq!(new_dirs, vec![PathBuf::from("/w/d")]);
        // A move into the tree from outside is a create; IN_IGNORED forgets the dir.
        let (evs, _) = t.translate(&[
            raw(1, libc::IN_MOVED_TO, 3, "in"),
            raw(1, libc::IN_IGNORED, 0, ""),
            raw(1, libc::IN_CREATE, 0, "late"),
        ]);
        assert_eq!(kinds(&evs), vec![(Create, "/w/in", None)]);
    }
}
