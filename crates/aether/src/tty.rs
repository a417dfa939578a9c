//! Interactive terminals: a pty whose slave is the controlling terminal of a login shell (or
//! `cmd`) in a new session. Output goes out as `Output{stream: Tty}` frames on the `TtyOpen` id;
//! the request ends with `TtyExit{code}` when the shell exits.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_wire::aether::{AetherErrorKind, Reply, Stream, CHUNK};

use crate::procs;
use crate::server::{lock, Server};
use crate::sys::{self, SpawnSpec};

pub struct Tty {
    master: OwnedFd,
    /// Keystrokes go to a writer thread so a program that stops reading cannot block the
    /// channel's reader.
    input: Mutex<mpsc::Sender<Vec<u8>>>,
}

pub fn input(srv: &Server, id: u64, target: u64, body: Vec<u8>) {
    let tty = lock(&srv.ttys).get(&target).cloned();
    match tty {
        Some(t) => {
            let _ = lock(&t.input).send(body);
            srv.w.send(id, Reply::Done, &[]);
        }
        None => {
            srv.w.error(
                id,
                AetherErrorKind::NotFound,
                format!("no open tty for request {target}"),
            );
        }
    }
}

pub fn resize(srv: &Server, id: u64, target: u64, rows: u16, cols: u16) {
    let tty = lock(&srv.ttys).get(&target).cloned();
    match tty.map(|t| sys::set_winsize(t.master.as_raw_fd(), rows, cols)) {
        Some(Ok(())) => {
            srv.w.send(id, Reply::Done, &[]);
        }
        Some(Err(e)) => {
            srv.w.error(
                id,
                AetherErrorKind::Internal,
                format!("resize tty {target}: {e}"),
            );
        }
        None => {
            srv.w.error(
                id,
                AetherErrorKind::NotFound,
                format!("no open tty for request {target}"),
            );
        }
    }
}

fn spawn_shell(
    srv: &Server,
    slave: &OwnedFd,
    cmd: Option<Vec<String>>,
    env: &BTreeMap<String, String>,
) -> Result<i32, String> {
    let user = &srv.user;
    let env = srv.env_map(user, env, true);
    let (path, argv) = match cmd {
        Some(argv) if !argv.is_empty() => {
            let path_var = env.get("PATH").cloned().unwrap_or_default();
            let path = sys::resolve_in_path(&argv[0], &path_var)
                .ok_or_else(|| format!("{}: command not found", argv[0]))?;
            (path, argv)
        }
        _ => {
            let shell = if !user.shell.is_empty() && Path::new(&user.shell).exists() {
                user.shell.clone()
            } else if Path::new("/bin/bash").exists() {
                "/bin/bash".to_string()
            } else {
                "/bin/sh".to_string()
            };
            let base = shell.rsplit('/').next().unwrap_or("sh").to_string();
            // A leading '-' in argv[0] makes it a login shell.
            (shell, vec![format!("-{base}")])
        }
    };
    let cwd = srv.start_dir(user, None);
    let spec = SpawnSpec {
        path: sys::cstr(&path).map_err(|e| e.to_string())?,
        argv: argv
            .iter()
            .map(|a| sys::cstr(a))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?,
        envp: Server::env_vec(&env),
        cwd: Some(sys::cstr(&cwd.to_string_lossy()).map_err(|e| e.to_string())?),
        creds: srv.creds_for(user),
        stdio: [slave.as_raw_fd(); 3],
        ctty: true,
    };
    sys::spawn(&srv.reaper, &spec).map_err(|e| format!("start {path}: {e}"))
}

/// Opens the pty and registers it, on the reader thread, so that `TtyInput`/`TtyResize` sent
/// right after `TtyOpen` find it. Returns the slave end for [`open`].
pub fn prepare(srv: &Server, id: u64, rows: u16, cols: u16) -> Option<OwnedFd> {
    let (master, slave) = match sys::openpty(rows.max(1), cols.max(1)) {
        Ok(p) => p,
        Err(e) => {
            srv.w
                .error(id, AetherErrorKind::Internal, format!("open a pty: {e}"));
            return None;
        }
    };
    let (tx, rx) = mpsc::channel::<Vec<u8>>();
    let writer_fd = match master.try_clone() {
        Ok(fd) => fd,
        Err(e) => {
            srv.w.error(
                id,
                AetherErrorKind::Internal,
                format!("tty: dup master: {e}"),
            );
            return None;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("tty-in".into())
        .stack_size(64 * 1024)
        .spawn(move || {
            for keys in rx {
                if sys::write_all(writer_fd.as_raw_fd(), &keys).is_err() {
                    break;
                }
            }
        });
    if let Err(e) = spawned {
        srv.w.error(
            id,
            AetherErrorKind::Internal,
            format!("tty: input thread: {e}"),
        );
        return None;
    }
    lock(&srv.ttys).insert(
        id,
        Arc::new(Tty {
            master,
            input: Mutex::new(tx),
        }),
    );
    Some(slave)
}

/// Starts the shell on the prepared pty and relays its output until it exits.
pub fn open(
    srv: &Server,
    id: u64,
    slave: OwnedFd,
    cmd: Option<Vec<String>>,
    env: BTreeMap<String, String>,
) {
    let Some(tty) = lock(&srv.ttys).get(&id).cloned() else {
        return;
    };
    let guard = match srv.cancellable(id) {
        Ok(g) => g,
        Err(e) => {
            lock(&srv.ttys).remove(&id);
            srv.w
                .error(id, AetherErrorKind::Internal, format!("tty: eventfd: {e}"));
            return;
        }
    };
    let pid = match spawn_shell(srv, &slave, cmd, &env) {
        Ok(pid) => pid,
        Err(msg) => {
            lock(&srv.ttys).remove(&id);
            srv.w
                .error(id, AetherErrorKind::BadRequest, format!("tty: {msg}"));
            return;
        }
    };
    drop(slave);
    let mfd = tty.master.as_raw_fd();
    let pidfd = sys::pidfd_open(pid).ok();
    let mut buf = vec![0u8; CHUNK.min(64 * 1024)];
    let mut exited_at: Option<Instant> = None;
    loop {
        let mut pfds = vec![
            libc::pollfd {
                fd: mfd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: guard.cancel.fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        if let (Some(p), None) = (&pidfd, exited_at) {
            pfds.push(libc::pollfd {
                fd: p.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        // After the shell exited, drain for a moment only (its children may keep the pty open).
        let timeout = match exited_at {
            Some(t) => 100i32.saturating_sub(t.elapsed().as_millis() as i32).max(0),
            None => -1,
        };
        if exited_at.is_some() && timeout == 0 {
            break;
        }
        if sys::poll(&mut pfds, timeout).is_err() {
            break;
        }
        if pfds[1].revents != 0 {
            procs::kill_session(pid);
            break;
        }
        if pfds.len() > 2 && pfds[2].revents != 0 {
            exited_at = Some(Instant::now());
        }
        if pfds[0].revents != 0 {
            match sys::read(mfd, &mut buf) {
                Ok(0) | Err(_) => break, // EIO: every slave fd is closed
                Ok(n) => {
                    if !srv.w.send(
                        id,
                        Reply::Output {
                            stream: Stream::Tty,
                        },
                        &buf[..n],
                    ) {
                        break;
                    }
                }
            }
        }
    }
    lock(&srv.ttys).remove(&id);
    // Closing the master (last reference) hangs up whatever still runs on the terminal.
    drop(tty);
    let st = srv.reaper.wait(pid, Some(Duration::from_secs(5)));
    if st.is_none() {
        procs::kill_session(pid);
    }
    let st = st.or_else(|| srv.reaper.wait(pid, Some(Duration::from_secs(2))));
    srv.reaper.forget(pid);
    let code = st.map_or(-1, |s| s.shell_code());
    drop(guard);
    srv.w.send(id, Reply::TtyExit { code }, &[]);
}
