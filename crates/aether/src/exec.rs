//! `Exec`: run an argv directly (no shell) in its own session.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::time::{Duration, Instant};

use dsec_wire::aether::{AetherErrorKind, CommandOutcome, Reply};

use crate::command::{feed_stdin, Collector, Stop};
use crate::server::Server;
use crate::sys::{self, SpawnSpec, Stage};
use crate::{procs, users};

pub struct ExecArgs {
    pub argv: Vec<String>,
    pub timeout_ms: u64,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub user: Option<String>,
    pub max_output: u64,
    pub stream: bool,
}

/// Replies with a finished command that never started (shell-style 126/127).
fn not_started(srv: &Server, id: u64, code: i32, msg: String, started: Instant) {
    let msg = msg.into_bytes();
    let outcome = CommandOutcome {
        exit_code: code,
        stderr_len: msg.len() as u64,
        stderr_total: msg.len() as u64,
        duration_ms: started.elapsed().as_secs_f64() * 1000.0,
        ..Default::default()
    };
    srv.w.send(id, Reply::CommandDone(outcome), &msg);
}

pub fn run(srv: &Server, id: u64, a: ExecArgs, body: Vec<u8>) {
    let started = Instant::now();
    let Some(argv0) = a.argv.first() else {
        srv.w
            .error(id, AetherErrorKind::BadRequest, "exec: argv is empty");
        return;
    };
    let user = match &a.user {
        None => srv.user.clone(),
        Some(u) => match users::resolve_here(u) {
            Ok(u) => u,
            Err(e) => {
                srv.w
                    .error(id, AetherErrorKind::BadRequest, format!("exec: {e}"));
                return;
            }
        },
    };
    let env = srv.env_map(&user, &a.env, false);
    let path_var = env.get("PATH").cloned().unwrap_or_default();
    let Some(path) = sys::resolve_in_path(argv0, &path_var) else {
        not_started(
            srv,
            id,
            127,
            format!("dsec-aether: {argv0}: command not found\n"),
            started,
        );
        return;
    };
    let cwd = srv.start_dir(&user, a.cwd.as_deref());
    let cargs: Result<Vec<_>, _> = a.argv.iter().map(|s| sys::cstr(s)).collect();
    let (Ok(argv), Ok(cpath), Ok(ccwd)) = (
        cargs,
        sys::cstr(&path),
        std::ffi::CString::new(cwd.as_os_str().as_bytes()),
    ) else {
        srv.w.error(
            id,
            AetherErrorKind::BadRequest,
            "exec: argv, path or cwd contains a NUL byte",
        );
        return;
    };
    let guard = match srv.cancellable(id) {
        Ok(g) => g,
        Err(e) => {
            srv.w
                .error(id, AetherErrorKind::Internal, format!("exec: eventfd: {e}"));
            return;
        }
    };
    let pipes = (|| -> std::io::Result<_> { Ok((sys::pipe()?, sys::pipe()?, sys::pipe()?)) })();
    let ((in_r, in_w), (out_r, out_w), (err_r, err_w)) = match pipes {
        Ok(p) => p,
        Err(e) => {
            srv.w
                .error(id, AetherErrorKind::Internal, format!("exec: pipes: {e}"));
            return;
        }
    };
    let spec = SpawnSpec {
        path: cpath,
        argv,
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
            let errno = e.err.raw_os_error();
            match (e.stage, errno) {
                (Stage::Exec, Some(libc::ENOENT)) => not_started(
                    srv,
                    id,
                    127,
                    format!("dsec-aether: {argv0}: No such file or directory\n"),
                    started,
                ),
                (Stage::Exec, _) => not_started(
                    srv,
                    id,
                    126,
                    format!("dsec-aether: {argv0}: {}\n", e.err),
                    started,
                ),
                (Stage::Cwd, Some(libc::ENOENT | libc::ENOTDIR)) => {
                    srv.w.error(
                        id,
                        AetherErrorKind::NotFound,
                        format!("exec: cwd {}: {}", cwd.display(), e.err),
                    );
                }
                (Stage::Cwd, _) => {
                    srv.w.error(
                        id,
                        AetherErrorKind::PermissionDenied,
                        format!("exec: cwd {}: {}", cwd.display(), e.err),
                    );
                }
                _ => {
                    srv.w
                        .error(id, AetherErrorKind::Internal, format!("exec {argv0}: {e}"));
                }
            }
            return;
        }
    };
    if body.is_empty() {
        drop(in_w);
    } else {
        feed_stdin(in_w, body);
    }
    let pidfd = sys::pidfd_open(pid).ok();
    let mut col = Collector::new(
        &srv.w,
        id,
        a.stream,
        a.max_output,
        [out_r.as_raw_fd(), err_r.as_raw_fd()],
        None,
    );
    let deadline = (a.timeout_ms > 0).then(|| started + Duration::from_millis(a.timeout_ms));
    let mut killed = false;
    let mut timed_out = false;
    let stop = col.pump(
        pidfd.as_ref().map(|f| f.as_raw_fd()),
        Some(guard.cancel.fd()),
        deadline,
    );
    if matches!(stop, Stop::Deadline | Stop::Cancelled) {
        timed_out = stop == Stop::Deadline;
        killed = true;
        procs::kill_session(pid);
        col.pump(
            pidfd.as_ref().map(|f| f.as_raw_fd()),
            None,
            Some(Instant::now() + Duration::from_secs(2)),
        );
    }
    col.drain(Instant::now() + Duration::from_millis(250));
    let status = srv.reaper.wait(pid, Some(Duration::from_secs(5)));
    let mut outcome = CommandOutcome {
        timed_out,
        ..Default::default()
    };
    match (killed, status) {
        (true, _) => {
            outcome.exit_code = -1;
            outcome.signal = Some(libc::SIGKILL);
        }
        (false, Some(st)) => {
            outcome.exit_code = st.code;
            outcome.signal = st.signal;
        }
        (false, None) => {
            srv.reaper.forget(pid);
            outcome.exit_code = -1;
        }
    }
    drop(guard);
    col.finish(outcome, started);
}
