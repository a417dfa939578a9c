//! Process handles: processes that outlive the request that started them.
//!
//! `ProcStart` spawns an argv in its own session (pid = pgid = sid) with pipes for stdin,
//! stdout and stderr, answers its pid at once and leaves one small pump thread per process
//! that moves output into a bounded [`Ring`] (combined stdout+stderr, addressed by byte offset)
//! until the process exits. Readers (`ProcRead`) copy from the ring under its lock and send
//! outside it, so a slow reader never stalls the pump. Exited handles are kept (at most
//! [`KEEP_EXITED`]) so that a client that reconnects after the exit still gets the rest of the
//! output and the exit status.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use dsec_wire::aether::{AetherErrorKind, Reply, Stream, CHUNK};
use dsec_wire::api::{ProcessInfo, ProcessList, MAX_PROCESS_BUFFER};

use crate::reaper::ExitStatus;
use crate::server::{lock, Server};
use crate::sys::{self, SpawnSpec, Stage};
use crate::{procs, users};

/// Exited handles kept for late readers; the oldest is dropped beyond this.
pub const KEEP_EXITED: usize = 16;
/// How long the pump keeps reading after the process exited (its children may hold the pipes).
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(250);
/// How often a following reader re-checks whether its request was cancelled.
const READER_TICK: Duration = Duration::from_millis(200);

/// Bounded output of one process: chunks tagged with their stream and start offset.
#[derive(Debug)]
pub struct Ring {
    chunks: VecDeque<(Stream, u64, Vec<u8>)>,
    cap: usize,
    kept: usize,
    /// Offset of the next byte.
    end: u64,
}

impl Ring {
    pub fn new(cap: usize) -> Self {
        Ring {
            chunks: VecDeque::new(),
            cap: cap.max(1),
            kept: 0,
            end: 0,
        }
    }

    /// Total bytes ever pushed (the offset the next byte gets).
    pub fn end(&self) -> u64 {
        self.end
    }

    /// The first offset still kept.
    pub fn start(&self) -> u64 {
        self.chunks.front().map_or(self.end, |c| c.1)
    }

    pub fn push(&mut self, stream: Stream, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        match self.chunks.back_mut() {
            // Coalesce small pieces of the same stream (one chunk per read otherwise).
            Some((s, _, buf)) if *s == stream && buf.len() + data.len() <= CHUNK => {
                buf.extend_from_slice(data)
            }
            _ => self.chunks.push_back((stream, self.end, data.to_vec())),
        }
        self.end += data.len() as u64;
        self.kept += data.len();
        while self.kept > self.cap {
            let excess = self.kept - self.cap;
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            if front.2.len() <= excess {
                self.kept -= front.2.len();
                self.chunks.pop_front();
            } else {
                front.2.drain(..excess);
                front.1 += excess as u64;
                self.kept -= excess;
            }
        }
    }

    /// Copies of the kept output at or after `offset`, each at most [`CHUNK`] bytes, with the
    /// offset each starts at.
    pub fn read_from(&self, offset: u64) -> Vec<(Stream, u64, Vec<u8>)> {
        let mut out = Vec::new();
        for (stream, start, buf) in &self.chunks {
            let stop = start + buf.len() as u64;
            if stop <= offset {
                continue;
            }
            let skip = offset.saturating_sub(*start) as usize;
            let mut at = *start + skip as u64;
            for piece in buf[skip..].chunks(CHUNK) {
                out.push((*stream, at, piece.to_vec()));
                at += piece.len() as u64;
            }
        }
        out
    }
}

struct State {
    ring: Ring,
    exit: Option<ExitStatus>,
    /// Shared so that a blocked write does not hold the state lock.
    stdin: Option<Arc<OwnedFd>>,
}

pub struct Handle {
    pid: i32,
    tag: Option<String>,
    argv: Vec<String>,
    cwd: String,
    started_ms: u64,
    state: Mutex<State>,
    changed: Condvar,
}

impl Handle {
    fn info_locked(&self, st: &State) -> ProcessInfo {
        ProcessInfo {
            pid: self.pid,
            tag: self.tag.clone(),
            argv: self.argv.clone(),
            cwd: Some(self.cwd.clone()),
            started_ms: self.started_ms,
            running: st.exit.is_none(),
            exit_code: st.exit.map(|e| e.code),
            signal: st.exit.and_then(|e| e.signal),
            stdin_open: st.stdin.is_some(),
            output_bytes: st.ring.end(),
            kept_from: st.ring.start(),
        }
    }

    pub fn info(&self) -> ProcessInfo {
        self.info_locked(&lock(&self.state))
    }

    fn running(&self) -> bool {
        lock(&self.state).exit.is_none()
    }
}

/// Every handle of this aether, by pid.
#[derive(Default)]
pub struct Handles {
    map: Mutex<HashMap<i32, Arc<Handle>>>,
    /// Pids of exited handles, oldest first.
    exited: Mutex<VecDeque<i32>>,
}

impl Handles {
    fn get(&self, pid: i32) -> Option<Arc<Handle>> {
        lock(&self.map).get(&pid).cloned()
    }

    fn exited(&self, pid: i32) {
        let mut q = lock(&self.exited);
        q.push_back(pid);
        while q.len() > KEEP_EXITED {
            if let Some(old) = q.pop_front() {
                lock(&self.map).remove(&old);
            }
        }
    }
}

pub struct StartArgs {
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
    pub tag: Option<String>,
    pub stdin: bool,
    pub buffer_bytes: u64,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn no_handle(srv: &Server, id: u64, pid: i32) {
    srv.w.error(
        id,
        AetherErrorKind::NotFound,
        format!(
            "no process handle with pid {pid} (it was not started with start, or ended long ago)"
        ),
    );
}

pub fn start(srv: &Arc<Server>, id: u64, a: StartArgs) {
    let Some(argv0) = a.argv.first() else {
        srv.w
            .error(id, AetherErrorKind::BadRequest, "start: argv is empty");
        return;
    };
    let user = match &a.user {
        None => srv.user.clone(),
        Some(u) => match users::resolve_here(u) {
            Ok(u) => u,
            Err(e) => {
                srv.w
                    .error(id, AetherErrorKind::BadRequest, format!("start: {e}"));
                return;
            }
        },
    };
    let env = srv.env_map(&user, &a.env, false);
    let path_var = env.get("PATH").cloned().unwrap_or_default();
    let Some(path) = sys::resolve_in_path(argv0, &path_var) else {
        srv.w.error(
            id,
            AetherErrorKind::NotFound,
            format!("start: {argv0}: command not found in PATH {path_var}"),
        );
        return;
    };
    let cwd = srv.start_dir(&user, a.cwd.as_deref());
    let cargs: Result<Vec<_>, _> = a.argv.iter().map(|s| sys::cstr(s)).collect();
    let (Ok(cargv), Ok(cpath), Ok(ccwd)) = (
        cargs,
        sys::cstr(&path),
        std::ffi::CString::new(cwd.as_os_str().as_bytes()),
    ) else {
        srv.w.error(
            id,
            AetherErrorKind::BadRequest,
            "start: argv, path or cwd contains a NUL byte",
        );
        return;
    };
    let pipes = (|| -> std::io::Result<_> { Ok((sys::pipe()?, sys::pipe()?, sys::pipe()?)) })();
    let ((in_r, in_w), (out_r, out_w), (err_r, err_w)) = match pipes {
        Ok(p) => p,
        Err(e) => {
            srv.w
                .error(id, AetherErrorKind::Internal, format!("start: pipes: {e}"));
            return;
        }
    };
    let spec = SpawnSpec {
        path: cpath,
        argv: cargv,
        envp: Server::env_vec(&env),
        cwd: Some(ccwd),
        creds: srv.creds_for(&user),
        stdio: [in_r.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd()],
        ctty: false,
    };
    let spawned = sys::spawn(&srv.reaper, &spec);
    drop((in_r, out_w, err_w));
    let pid = match spawned {
        Ok(pid) => pid,
        Err(e) => {
            let (kind, what) = match (e.stage, e.err.raw_os_error()) {
                (Stage::Exec | Stage::Cwd, Some(libc::ENOENT | libc::ENOTDIR)) => {
                    (AetherErrorKind::NotFound, "")
                }
                (Stage::Exec | Stage::Cwd, Some(libc::EACCES | libc::EPERM)) => {
                    (AetherErrorKind::PermissionDenied, "")
                }
                (Stage::Fork, Some(libc::EAGAIN)) => (AetherErrorKind::Busy, " (pids limit)"),
                _ => (AetherErrorKind::Internal, ""),
            };
            let at = if e.stage == Stage::Cwd {
                format!("cwd {}", cwd.display())
            } else {
                argv0.clone()
            };
            srv.w
                .error(id, kind, format!("start {at}: {}{what}", e.err));
            return;
        }
    };
    let pidfd = sys::pidfd_open(pid).ok();
    let cap = a.buffer_bytes.clamp(1, MAX_PROCESS_BUFFER) as usize;
    let h = Arc::new(Handle {
        pid,
        tag: a.tag.filter(|t| !t.is_empty()),
        argv: a.argv,
        cwd: cwd.display().to_string(),
        started_ms: now_ms(),
        state: Mutex::new(State {
            ring: Ring::new(cap),
            exit: None,
            stdin: a.stdin.then(|| Arc::new(in_w)),
        }),
        changed: Condvar::new(),
    });
    lock(&srv.handles.map).insert(pid, h.clone());
    let (srv2, h2) = (srv.clone(), h.clone());
    let pumped = std::thread::Builder::new()
        .name("proc".into())
        .stack_size(64 * 1024)
        .spawn(move || pump(&srv2, &h2, [out_r, err_r], pidfd));
    if let Err(e) = pumped {
        procs::kill_session(pid);
        let _ = srv.reaper.wait(pid, Some(Duration::from_secs(5)));
        lock(&srv.handles.map).remove(&pid);
        srv.w.error(
            id,
            AetherErrorKind::Busy,
            format!("start: a thread for the output of pid {pid}: {e}"),
        );
        return;
    }
    srv.w.send(id, Reply::Proc(h.info()), &[]);
}

/// Moves output into the ring until the process exited and its pipes are drained, then records
/// the exit status.
fn pump(srv: &Server, h: &Handle, pipes: [OwnedFd; 2], pidfd: Option<OwnedFd>) {
    let mut open: [Option<RawFd>; 2] = [Some(pipes[0].as_raw_fd()), Some(pipes[1].as_raw_fd())];
    let mut buf = vec![0u8; 64 * 1024];
    let mut exited_at: Option<Instant> = None;
    loop {
        let mut pfds = Vec::with_capacity(3);
        let mut idxs = Vec::with_capacity(2);
        for (i, fd) in open.iter().enumerate() {
            if let Some(fd) = fd {
                pfds.push(libc::pollfd {
                    fd: *fd,
                    events: libc::POLLIN,
                    revents: 0,
                });
                idxs.push(i);
            }
        }
        let npipes = pfds.len();
        if npipes == 0 {
            break;
        }
        let watch_pid = exited_at.is_none() && pidfd.is_some();
        if let (true, Some(p)) = (watch_pid, &pidfd) {
            pfds.push(libc::pollfd {
                fd: p.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let timeout = match exited_at {
            Some(t) => {
                let left = DRAIN_AFTER_EXIT.saturating_sub(t.elapsed());
                if left.is_zero() {
                    break;
                }
                left.as_millis() as i32 + 1
            }
            // Without a pidfd, poll the reaper now and then.
            None if pidfd.is_none() => 200,
            None => -1,
        };
        if sys::poll(&mut pfds, timeout).is_err() {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        for k in 0..npipes {
            if pfds[k].revents == 0 {
                continue;
            }
            let idx = idxs[k];
            let Some(fd) = open[idx] else { continue };
            match sys::read(fd, &mut buf) {
                Ok(0) | Err(_) => open[idx] = None,
                Ok(n) => {
                    let stream = if idx == 0 {
                        Stream::Stdout
                    } else {
                        Stream::Stderr
                    };
                    lock(&h.state).ring.push(stream, &buf[..n]);
                    h.changed.notify_all();
                }
            }
        }
        let leader_gone = if watch_pid {
            pfds[npipes].revents != 0
        } else {
            pidfd.is_none() && !sys::pid_alive(h.pid)
        };
        if leader_gone && exited_at.is_none() {
            exited_at = Some(Instant::now());
        }
    }
    drop(pipes);
    let status = srv
        .reaper
        .wait(h.pid, Some(Duration::from_secs(5)))
        .unwrap_or_else(|| {
            srv.reaper.forget(h.pid);
            ExitStatus::from_raw(-1)
        });
    {
        let mut st = lock(&h.state);
        st.exit = Some(status);
        st.stdin = None;
    }
    h.changed.notify_all();
    srv.handles.exited(h.pid);
}

/// Streams output from `offset`, then `ProcOutputEnd`.
pub fn read(srv: &Server, id: u64, pid: i32, offset: u64, follow: bool) {
    let Some(h) = srv.handles.get(pid) else {
        return no_handle(srv, id, pid);
    };
    let guard = match srv.cancellable(id) {
        Ok(g) => g,
        Err(e) => {
            srv.w
                .error(id, AetherErrorKind::Internal, format!("read: eventfd: {e}"));
            return;
        }
    };
    let mut cursor = offset;
    loop {
        let (pieces, info) = {
            let mut st = lock(&h.state);
            if follow
                && st.exit.is_none()
                && st.ring.end() <= cursor
                && !guard.cancel.fired.load(Ordering::SeqCst)
            {
                st = h
                    .changed
                    .wait_timeout(st, READER_TICK)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            (st.ring.read_from(cursor), h.info_locked(&st))
        };
        for (stream, at, data) in &pieces {
            if !srv.w.send(
                id,
                Reply::ProcOutput {
                    stream: *stream,
                    offset: *at,
                },
                data,
            ) {
                return;
            }
            cursor = at + data.len() as u64;
        }
        // Output that fell out of the ring before we read it: skip to what is kept.
        cursor = cursor.max(info.kept_from);
        let cancelled = guard.cancel.fired.load(Ordering::SeqCst);
        let drained = cursor >= info.output_bytes;
        if !follow || cancelled || (!info.running && drained) {
            srv.w.send(
                id,
                Reply::ProcOutputEnd {
                    offset: cursor,
                    info,
                },
                &[],
            );
            return;
        }
    }
}

pub fn input(srv: &Server, id: u64, pid: i32, close: bool, body: Vec<u8>) {
    let Some(h) = srv.handles.get(pid) else {
        return no_handle(srv, id, pid);
    };
    let fd = lock(&h.state).stdin.clone();
    let Some(fd) = fd else {
        if body.is_empty() && close {
            srv.w.send(id, Reply::Proc(h.info()), &[]);
        } else {
            srv.w.error(
                id,
                AetherErrorKind::BadRequest,
                format!(
                    "stdin of pid {pid} is closed (start it with stdin=true, and do not close stdin before sending)"
                ),
            );
        }
        return;
    };
    if !body.is_empty() {
        if let Err(e) = sys::write_all(fd.as_raw_fd(), &body) {
            let kind = if e.raw_os_error() == Some(libc::EPIPE) {
                AetherErrorKind::BadRequest
            } else {
                AetherErrorKind::Internal
            };
            srv.w.error(
                id,
                kind,
                format!("write stdin of pid {pid}: {e} (the process closed its stdin or exited)"),
            );
            return;
        }
    }
    drop(fd);
    if close {
        lock(&h.state).stdin = None;
    }
    srv.w.send(id, Reply::Proc(h.info()), &[]);
}

pub fn signal(srv: &Server, id: u64, pid: i32, sig: i32, group: bool) {
    let Some(h) = srv.handles.get(pid) else {
        return no_handle(srv, id, pid);
    };
    if sig <= 0 || sig > 64 {
        srv.w.error(
            id,
            AetherErrorKind::BadRequest,
            format!("signal {sig} is not a signal number (1-64)"),
        );
        return;
    }
    // An exited handle's pid may belong to someone else by now: never signal it.
    if h.running() {
        if group && sig == libc::SIGKILL {
            // The whole session: also members that made their own process group.
            procs::kill_session(pid);
        } else if group {
            sys::kill(-pid, sig);
        } else {
            sys::kill(pid, sig);
        }
    }
    srv.w.send(id, Reply::Proc(h.info()), &[]);
}

pub fn list(srv: &Server, id: u64, all: bool) {
    let handles: Vec<Arc<Handle>> = lock(&srv.handles.map).values().cloned().collect();
    let mut processes: Vec<ProcessInfo> = handles
        .iter()
        .map(|h| h.info())
        .filter(|i| all || i.running)
        .collect();
    processes.sort_by_key(|i| (i.started_ms, i.pid));
    srv.w
        .send(id, Reply::ProcList(ProcessList { processes }), &[]);
}

pub fn wait(srv: &Server, id: u64, pid: i32, timeout_ms: u64) {
    let Some(h) = srv.handles.get(pid) else {
        return no_handle(srv, id, pid);
    };
    let guard = match srv.cancellable(id) {
        Ok(g) => g,
        Err(e) => {
            srv.w
                .error(id, AetherErrorKind::Internal, format!("wait: eventfd: {e}"));
            return;
        }
    };
    let deadline = Instant::now() + Duration::from_millis(timeout_ms);
    let mut st = lock(&h.state);
    while st.exit.is_none() && !guard.cancel.fired.load(Ordering::SeqCst) {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        st = h
            .changed
            .wait_timeout(st, (deadline - now).min(READER_TICK))
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    let info = h.info_locked(&st);
    drop(st);
    srv.w.send(id, Reply::Proc(info), &[]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(r: &Ring, from: u64) -> (Vec<u64>, String) {
        let pieces = r.read_from(from);
        let offs = pieces.iter().map(|p| p.1).collect();
        let s = pieces
            .iter()
            .map(|p| String::from_utf8_lossy(&p.2).into_owned())
            .collect();
        (offs, s)
    }

    #[test]
    fn ring_keeps_everything_under_its_cap() {
        let mut r = Ring::new(100);
        r.push(Stream::Stdout, b"hello ");
        r.push(Stream::Stdout, b"world");
        r.push(Stream::Stderr, b"!");
        assert_eq!((r.start(), r.end()), (0, 12));
        assert_eq!(text(&r, 0), (vec![0, 11], "hello world!".into()));
        // Resuming in the middle of a chunk.
        assert_eq!(text(&r, 8), (vec![8, 11], "rld!".into()));
        assert_eq!(text(&r, 12), (vec![], String::new()));
        assert_eq!(text(&r, 99), (vec![], String::new()));
    }

    #[test]
    fn ring_drops_the_oldest_bytes_and_says_where_it_starts() {
        let mut r = Ring::new(10);
        r.push(Stream::Stdout, b"0123456789");
        r.push(Stream::Stderr, b"abcd");
        assert_eq!((r.start(), r.end()), (4, 14));
        assert_eq!(text(&r, 0), (vec![4, 10], "456789abcd".into()));
        r.push(Stream::Stdout, b"WXYZWXYZWXYZ");
        assert_eq!((r.start(), r.end()), (16, 26));
        assert_eq!(text(&r, 0).1, "YZWXYZWXYZ");
        // The streams stay apart.
        let pieces = r.read_from(0);
        assert!(pieces.iter().all(|p| p.0 == Stream::Stdout));
    }

    #[test]
    fn ring_pieces_are_at_most_a_chunk() {
        let mut r = Ring::new(3 * CHUNK);
        let big = vec![b'x'; 2 * CHUNK + 5];
        r.push(Stream::Stdout, &big);
        let pieces = r.read_from(1);
        assert!(pieces.iter().all(|p| p.2.len() <= CHUNK));
        assert_eq!(
            pieces.iter().map(|p| p.2.len()).sum::<usize>(),
            2 * CHUNK + 4
        );
        assert_eq!(pieces[1].1, 1 + CHUNK as u64);
    }
}
