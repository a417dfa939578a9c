//! chronus: persistent shell sessions.
//!
//! Each session is one long-lived `bash --noprofile --norc` (or `/bin/sh`) in its own session
//! (setsid), running as the sandbox user, reading commands from a pipe. A call does not start a
//! new process for the shell: it writes one wrapper line that sources the command from a per-call
//! file *in the shell process itself*, so `cd`, `export`, functions, aliases and background jobs
//! persist between calls. The wrapper then prints `\x1eDSEC<nonce>:<status>\n` on stdout and on
//! stderr; output up to those markers is the command's output (the markers are stripped, output
//! without a trailing newline comes back exactly).
//!
//! Semantics worth knowing:
//! * `cwd` is applied with `cd` before the command and *stays* the session's cwd afterwards
//!   (like typing `cd X` first). If `cd` fails the command does not run and the status is 1.
//! * Per-call `env` is a temporary assignment prefix (`K=V . file`): under bash the variables
//!   are visible to the command only; under a POSIX `/bin/sh` they may persist in the session.
//! * stdin of the command is the request body (via a per-call file), `/dev/null` when empty.
//! * On timeout (or `Cancel`) every process of the session that did not exist before the call
//!   is SIGKILLed (background jobs of earlier calls survive); the result is `exit_code: -1,
//!   signal: 9, timed_out: true`. If the shell itself does not finish within 1 s more (a builtin
//!   loop), it is killed with its whole session and a fresh shell replaces it
//!   (`session_restarted: true`; cwd, env and jobs are lost).
//! * If the shell exited (the user ran `exit`), the call reports the shell's exit status and the
//!   next call starts a fresh shell with `session_restarted: true`.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsec_wire::aether::{AetherErrorKind, CommandOutcome};

use crate::command::{Collector, Stop};
use crate::procs;
use crate::server::{lock, Server};
use crate::sys::{self, SpawnSpec};

pub struct RunArgs {
    pub session: String,
    pub cmd: String,
    pub timeout_ms: u64,
    pub env: BTreeMap<String, String>,
    pub cwd: Option<String>,
    pub max_output: u64,
    pub stream: bool,
}

struct Shell {
    pid: i32,
    pidfd: OwnedFd,
    stdin: OwnedFd,
    stdout: OwnedFd,
    stderr: OwnedFd,
    bash: bool,
}

#[derive(Default)]
struct Slot {
    shell: Option<Shell>,
    /// A shell was started before (so a new one is a restart).
    started: bool,
}

pub struct Session {
    slot: Mutex<Slot>,
    /// Pid of the current shell (0 when none), readable without waiting for a running call.
    leader: AtomicI32,
}

impl Session {
    pub fn leader(&self) -> i32 {
        self.leader.load(Ordering::SeqCst)
    }
}

/// Quotes a string for the shell: `'...'` with embedded quotes escaped.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn valid_name(k: &str) -> bool {
    let mut chars = k.chars();
    matches!(chars.next(), Some(c) if c == '_' || c.is_ascii_alphabetic())
        && chars.all(|c| c == '_' || c.is_ascii_alphanumeric())
}

/// Signal that makes the session's shell abandon the running command (see [`wrapper_line`]).
/// A user trap on this signal is replaced for the duration of each call.
pub const ABORT_SIGNAL: &str = "USR2";

/// The line written to the shell's stdin for one call.
///
/// The command is sourced in the shell process itself, so `cd`, `export`, functions and
/// background jobs persist. Per-call `env` and `cwd` do not: each variable is saved before and
/// restored (or unset) after the command, and the shell returns to its previous directory
/// unless the command itself changed directory. This works the same under bash and POSIX sh.
pub fn wrapper_line(
    bash: bool,
    nonce: &str,
    cmd_file: &Path,
    in_file: Option<&Path>,
    cwd: Option<&str>,
    env: &BTreeMap<String, String>,
) -> String {
    // Backslash-prefixed words are never alias-expanded; `builtin` skips user functions.
    let b = if bash { r"\builtin " } else { r"\command " };
    let mut line = String::new();
    let env: Vec<(&String, &String)> = env.iter().filter(|(k, _)| valid_name(k)).collect();
    for (i, (k, v)) in env.iter().enumerate() {
        line.push_str(&format!(
            "__dsec_s{i}=${{{k}+x}}; __dsec_v{i}=${{{k}-}}; {b}export {k}={}; ",
            sh_quote(v)
        ));
    }
    let input = in_file.map_or_else(
        || "/dev/null".to_string(),
        |p| sh_quote(&p.to_string_lossy()),
    );
    // On timeout aether sends SIGUSR2 to the shell before killing the command's processes: the
    // trap returns from the sourced command, so the rest of the command line is abandoned
    // (also inside a builtin loop) while the shell and its state survive.
    let source = format!(
        "{b}trap '{b}trap - {ABORT_SIGNAL}; return 124' {ABORT_SIGNAL}; \\. {} < {input}",
        sh_quote(&cmd_file.to_string_lossy())
    );
    match cwd {
        Some(c) => line.push_str(&format!(
            "__dsec_owd=$PWD; if {b}cd -- {}; then __dsec_cwd=$PWD; {source}; __dsec_rc=$?; \
             if [ \"$PWD\" = \"$__dsec_cwd\" ]; then {b}cd -- \"$__dsec_owd\"; fi; \
             else __dsec_rc=$?; fi; ",
            sh_quote(c)
        )),
        None => line.push_str(&format!("{source}; __dsec_rc=$?; ")),
    }
    for (i, (k, _)) in env.iter().enumerate() {
        line.push_str(&format!(
            "if [ -n \"$__dsec_s{i}\" ]; then {k}=$__dsec_v{i}; else {b}unset {k}; fi; \
             {b}unset __dsec_s{i} __dsec_v{i}; "
        ));
    }
    line.push_str(&format!("{b}trap - {ABORT_SIGNAL}; "));
    line.push_str(&format!(
        "{b}printf '\\036DSEC%s:%d\\n' {nonce} \"$__dsec_rc\"; "
    ));
    line.push_str(&format!(
        "{b}printf '\\036DSEC%s:%d\\n' {nonce} \"$__dsec_rc\" >&2\n"
    ));
    line
}

fn start_shell(srv: &Server) -> std::io::Result<Shell> {
    let bash = Path::new("/bin/bash").exists();
    let (path, argv) = if bash {
        ("/bin/bash", vec!["bash", "--noprofile", "--norc"])
    } else {
        ("/bin/sh", vec!["sh"])
    };
    let env = srv.env_map(&srv.user, &BTreeMap::new(), false);
    let cwd = srv.start_dir(&srv.user, None);
    let (in_r, in_w) = sys::pipe()?;
    let (out_r, out_w) = sys::pipe()?;
    let (err_r, err_w) = sys::pipe()?;
    let spec = SpawnSpec {
        path: sys::cstr(path)?,
        argv: argv
            .iter()
            .map(|a| sys::cstr(a))
            .collect::<Result<_, _>>()?,
        envp: Server::env_vec(&env),
        cwd: Some(sys::cstr(&cwd.to_string_lossy())?),
        creds: srv.creds_for(&srv.user),
        stdio: [in_r.as_raw_fd(), out_w.as_raw_fd(), err_w.as_raw_fd()],
        ctty: false,
    };
    let pid = sys::spawn(&srv.reaper, &spec)
        .map_err(|e| std::io::Error::new(e.err.kind(), format!("start shell {path}: {e}")))?;
    let pidfd = sys::pidfd_open(pid)?;
    if bash {
        sys::write_all(in_w.as_raw_fd(), b"\\builtin shopt -s expand_aliases\n")?;
    }
    Ok(Shell {
        pid,
        pidfd,
        stdin: in_w,
        stdout: out_r,
        stderr: err_r,
        bash,
    })
}

/// Ends a shell and everything in its session.
fn end_shell(srv: &Server, sh: Shell) {
    procs::kill_session(sh.pid);
    srv.reaper.wait(sh.pid, Some(Duration::from_secs(2)));
    srv.reaper.forget(sh.pid);
}

fn session(srv: &Server, name: &str) -> Arc<Session> {
    lock(&srv.sessions)
        .entry(name.to_string())
        .or_insert_with(|| {
            Arc::new(Session {
                slot: Mutex::new(Slot::default()),
                leader: AtomicI32::new(0),
            })
        })
        .clone()
}

/// Starts session `name`'s shell ahead of its first call, so that the sandbox's first
/// `run_shell` does not wait for the shell to start. A call that arrives meanwhile waits for
/// this one (it holds the session's slot); a failure is left for that call to report.
pub fn prestart(srv: &Server, name: &str) {
    let sess = session(srv, name);
    let mut slot = lock(&sess.slot);
    if slot.shell.is_some() {
        return;
    }
    if let Ok(sh) = start_shell(srv) {
        slot.started = true;
        sess.leader.store(sh.pid, Ordering::SeqCst);
        slot.shell = Some(sh);
    }
}

/// `CloseSession`: kills the shell and everything in its session.
pub fn close(srv: &Server, name: &str) {
    let Some(s) = lock(&srv.sessions).remove(name) else {
        return;
    };
    let leader = s.leader();
    if leader > 0 {
        // Kill first: a running call holds the slot and ends when its shell dies.
        procs::kill_session(leader);
    }
    let mut slot = lock(&s.slot);
    if let Some(sh) = slot.shell.take() {
        end_shell(srv, sh);
    }
    s.leader.store(0, Ordering::SeqCst);
}

/// Writes a per-call file readable by the sandbox user only.
fn write_call_file(srv: &Server, path: &Path, data: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    if let Some(owner) = srv.owner() {
        if owner != sys::getuid_gid() {
            sys::own_and_mode(f.as_raw_fd(), Some(owner), 0o600)?;
        }
    }
    f.write_all(data)
}

struct CallFiles(Vec<PathBuf>);

impl Drop for CallFiles {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

pub fn run(srv: &Server, id: u64, a: RunArgs, body: Vec<u8>) {
    let started = Instant::now();
    if let Some(bad) = a.env.keys().find(|k| !valid_name(k)) {
        srv.w.error(
            id,
            AetherErrorKind::BadRequest,
            format!("run_shell: invalid environment variable name {bad:?}"),
        );
        return;
    }
    let guard = match srv.cancellable(id) {
        Ok(g) => g,
        Err(e) => {
            srv.w.error(
                id,
                AetherErrorKind::Internal,
                format!("run_shell: eventfd: {e}"),
            );
            return;
        }
    };
    let sess = session(srv, &a.session);
    let mut slot = lock(&sess.slot);
    let mut restarted = false;
    if slot
        .shell
        .as_ref()
        .is_some_and(|sh| sys::readable_now(sh.pidfd.as_raw_fd()))
    {
        if let Some(sh) = slot.shell.take() {
            end_shell(srv, sh);
        }
    }
    if slot.shell.is_none() {
        match start_shell(srv) {
            Ok(sh) => {
                restarted = slot.started;
                slot.started = true;
                sess.leader.store(sh.pid, Ordering::SeqCst);
                slot.shell = Some(sh);
            }
            Err(e) => {
                srv.w.error(
                    id,
                    AetherErrorKind::Internal,
                    format!("session {}: {e}", a.session),
                );
                return;
            }
        }
    }
    let nonce = match sys::nonce() {
        Ok(n) => n,
        Err(e) => {
            srv.w
                .error(id, AetherErrorKind::Internal, format!("random nonce: {e}"));
            return;
        }
    };
    let cmd_file = srv.run_dir.join(format!("c.{nonce}"));
    let mut in_file = PathBuf::new();
    let mut files = CallFiles(Vec::new());
    let mut cmd = a.cmd.clone().into_bytes();
    cmd.push(b'\n');
    if let Err(e) = write_call_file(srv, &cmd_file, &cmd) {
        srv.w.error(
            id,
            AetherErrorKind::Internal,
            format!("write {}: {e}", cmd_file.display()),
        );
        return;
    }
    files.0.push(cmd_file.clone());
    if !body.is_empty() {
        in_file = match srv.input_dir() {
            Ok(d) => d.join(format!("i.{nonce}")),
            Err(e) => {
                srv.w.error(
                    id,
                    AetherErrorKind::Internal,
                    format!("create the dir for stdin files: {e}"),
                );
                return;
            }
        };
        if let Err(e) = write_call_file(srv, &in_file, &body) {
            srv.w.error(
                id,
                AetherErrorKind::Internal,
                format!("write {}: {e}", in_file.display()),
            );
            return;
        }
        files.0.push(in_file.clone());
    }
    drop(body);
    let Some(sh) = slot.shell.as_ref() else {
        return;
    };
    let before = procs::snapshot(sh.pid);
    let line = wrapper_line(
        sh.bash,
        &nonce,
        &cmd_file,
        (files.0.len() > 1).then_some(in_file.as_path()),
        a.cwd.as_deref(),
        &a.env,
    );
    // A write error means the shell is gone: the pump below sees its pidfd.
    let _ = sys::write_all(sh.stdin.as_raw_fd(), line.as_bytes());
    let marker = format!("\x1eDSEC{nonce}:");
    let mut col = Collector::new(
        &srv.w,
        id,
        a.stream,
        a.max_output,
        [sh.stdout.as_raw_fd(), sh.stderr.as_raw_fd()],
        Some(marker.as_bytes()),
    );
    let pidfd = sh.pidfd.as_raw_fd();
    let shell_pid = sh.pid;
    let deadline = (a.timeout_ms > 0).then(|| started + Duration::from_millis(a.timeout_ms));
    let mut outcome = CommandOutcome::default();
    let mut stop = col.pump(Some(pidfd), Some(guard.cancel.fd()), deadline);
    if matches!(stop, Stop::Deadline | Stop::Cancelled) {
        outcome.timed_out = stop == Stop::Deadline;
        outcome.exit_code = -1;
        outcome.signal = Some(libc::SIGKILL);
        // Abandon the rest of the command line first (the trap runs once the foreground
        // process is gone), then kill every process the call started.
        sys::kill(shell_pid, libc::SIGUSR2);
        procs::kill_new_members(shell_pid, &before);
        stop = col.pump(
            Some(pidfd),
            None,
            Some(Instant::now() + Duration::from_secs(1)),
        );
        if stop == Stop::Deadline {
            // The shell itself is stuck (a builtin loop): replace it.
            if let Some(old) = slot.shell.take() {
                end_shell(srv, old);
            }
            sess.leader.store(0, Ordering::SeqCst);
            match start_shell(srv) {
                Ok(sh) => {
                    sess.leader.store(sh.pid, Ordering::SeqCst);
                    slot.shell = Some(sh);
                }
                Err(e) => eprintln!("aether: restart session {}: {e}", a.session),
            }
            restarted = true;
            drop(guard);
            col.finish(
                CommandOutcome {
                    session_restarted: restarted,
                    ..outcome
                },
                started,
            );
            return;
        }
    }
    match stop {
        Stop::Markers => {
            if !outcome.timed_out && outcome.signal.is_none() {
                outcome.exit_code = col.marker_status.unwrap_or(-1);
            }
        }
        _ => {
            // The shell exited (e.g. `exit 3`): collect what it wrote, report its status.
            col.drain(Instant::now() + Duration::from_millis(250));
            if let Some(old) = slot.shell.take() {
                let st = srv.reaper.wait(old.pid, Some(Duration::from_secs(2)));
                if !outcome.timed_out && outcome.signal.is_none() {
                    if let Some(st) = st {
                        outcome.exit_code = st.code;
                        outcome.signal = st.signal;
                    }
                }
                end_shell(srv, old);
            }
            sess.leader.store(0, Ordering::SeqCst);
        }
    }
    outcome.session_restarted = restarted;
    drop(slot);
    drop(guard);
    drop(files);
    col.finish(outcome, started);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(sh_quote("a b"), "'a b'");
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
        assert!(valid_name("_A1"));
        assert!(!valid_name("1A"));
        assert!(!valid_name("A-B"));
        assert!(!valid_name(""));
    }

    #[test]
    fn wrapper() {
        let mut env = BTreeMap::new();
        env.insert("X".to_string(), "1 2".to_string());
        env.insert("bad-name".to_string(), "v".to_string());
        let l = wrapper_line(true, "abc", Path::new("/r/c.abc"), None, Some("/tmp"), &env);
        assert!(
            l.ends_with('\n') && l.matches('\n').count() == 1,
            "one line: {l}"
        );
        assert!(l.contains("export X='1 2'"));
        assert!(!l.contains("bad-name"), "invalid names are dropped");
        assert!(l.contains("cd -- '/tmp'"));
        // The marker bytes themselves never appear in the line (so `set -v` cannot fake them).
        assert!(!l.contains('\x1e'));
    }

    /// Runs the wrapper in a real shell: per-call env and cwd do not leak into the session.
    #[test]
    fn wrapper_restores_env_and_cwd() {
        for (bash, shell) in [(true, "/bin/bash"), (false, "/bin/sh")] {
            if !Path::new(shell).exists() {
                continue;
            }
            let dir =
                std::env::temp_dir().join(format!("dsec-wrapper-{}-{bash}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let cmd = dir.join("cmd");
            std::fs::write(&cmd, "echo \"in=$PER:$PWD\"").unwrap();
            let mut env = BTreeMap::new();
            env.insert("PER".to_string(), "it's".to_string());
            let w = wrapper_line(bash, "n", &cmd, None, Some("/"), &env);
            let script = format!("cd /tmp; PER=old; {w}echo \"after=$PER:$PWD\"; unset PER; {w}echo \"unset=${{PER-none}}\"\n");
            let out = std::process::Command::new(shell)
                .arg("-c")
                .arg(&script)
                .output()
                .unwrap();
            let out = String::from_utf8_lossy(&out.stdout);
            let lines: Vec<&str> = out.lines().filter(|l| !l.contains('\x1e')).collect();
            assert_eq!(
                lines,
                ["in=it's:/", "after=old:/tmp", "in=it's:/", "unset=none"],
                "{shell}: {out}"
            );
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}
