//! aether: the agent inside every sandbox.
//!
//! Owns everything that runs inside a sandbox: building the container root, seccomp, users,
//! sessions, processes, files, TTYs and the trajectory-visible clock. It must not trust the
//! sandbox's contents, must not link any other dsec crate than `dsec-wire` (it is a static
//! binary copied into every guest), and must not reach the network or the host on its own.
//!
//! Started as PID 1 of a container with the edge channel on fd 3 (an inherited socket, never a
//! path inside the sandbox). Reads `Setup`, builds the sandbox ([`setup`]), answers `Ready`, then
//! serves requests until the channel closes or `Shutdown` arrives.
//!
//! `--mode bare [--fd N] [--reattach-grace-ms MS] [--user SPEC] [--env-file PATH]` skips setup
//! (tests on the host, VM guests): it sends `Ready` with id 0 unsolicited and serves as the
//! current user, or as `--user` (a name or uid of this root's /etc/passwd; needs root) — a VM
//! guest's `init_user`. `--env-file` holds the sandbox-wide environment (`setup.env` of a
//! container): `KEY=VALUE` entries each ended by a NUL byte, like /proc/PID/environ.
//!
//! Threads: the main thread reads frames and dispatches; quick requests (file chunks, cancel,
//! TTY input, ping) are handled inline, everything that can block gets its own small-stack
//! thread; one reaper thread waits for every child. An idle sandbox has two threads.

mod channel;
mod chronus;
mod command;
mod exec;
mod files;
mod handles;
mod output;
mod procs;
mod reaper;
mod server;
mod setup;
mod stats;
mod sys;
mod tty;
mod users;
mod watch;

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dsec_wire::aether::{AetherErrorKind, Reply, Request};

use channel::{Incoming, ReadError, Writer};
use server::Server;

const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The edge's listener for reattaching (container mode, optional).
const REATTACH_FD: RawFd = 4;

#[derive(Debug, PartialEq, Eq)]
enum Mode {
    Container,
    Bare,
}

#[derive(Debug, PartialEq, Eq)]
struct Args {
    mode: Mode,
    fd: RawFd,
    /// Bare mode only (containers take it from `Setup`).
    reattach_grace_ms: u64,
    /// Bare mode only: the sandbox user (containers take it from `Setup`).
    user: Option<String>,
    /// Bare mode only: the sandbox-wide environment (containers take it from `Setup`).
    env_file: Option<PathBuf>,
}

fn parse_args(args: &[String]) -> Result<Args, String> {
    let mut a = Args {
        mode: Mode::Container,
        fd: 3,
        reattach_grace_ms: 0,
        user: None,
        env_file: None,
    };
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--mode" => match it.next().map(String::as_str) {
                Some("container") => a.mode = Mode::Container,
                Some("bare") => a.mode = Mode::Bare,
                other => return Err(format!("--mode must be container or bare, not {other:?}")),
            },
            "--fd" => {
                a.fd = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&fd| fd >= 0)
                    .ok_or("--fd needs a file descriptor number")?;
            }
            "--reattach-grace-ms" => {
                a.reattach_grace_ms = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or("--reattach-grace-ms needs a number of milliseconds")?;
            }
            "--user" => {
                a.user = Some(
                    it.next()
                        .filter(|v| !v.is_empty())
                        .ok_or("--user needs a user name or uid")?
                        .clone(),
                );
            }
            "--env-file" => {
                a.env_file = Some(PathBuf::from(it.next().ok_or("--env-file needs a path")?));
            }
            "--version" => {
                println!("dsec-aether {VERSION}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if a.mode == Mode::Container
        && (a.fd != 3 || a.reattach_grace_ms != 0 || a.user.is_some() || a.env_file.is_some())
    {
        return Err(
            "--fd, --reattach-grace-ms, --user and --env-file are only for --mode bare".into(),
        );
    }
    if a.fd == REATTACH_FD && a.reattach_grace_ms != 0 {
        return Err(format!(
            "fd {REATTACH_FD} is the reattach listener, not the channel"
        ));
    }
    Ok(a)
}

/// Exits the whole process (any thread may call it).
pub fn exit(code: i32) -> ! {
    std::process::exit(code)
}

/// Where a container's per-call command files go: a dir in the sandbox's /dev, the tmpfs aether
/// mounted itself. Every `run_shell` writes and removes one file there; on the overlay's upper
/// dir each was an inode allocated and freed on the host's disk (and the dir itself a copy-up
/// of /run plus a mkdir before the default shell could start).
const CONTAINER_CMD_DIR: &str = "/dev/.dsec-aether";
/// Where a container's per-call stdin files go (they may be large: on disk, not in /dev's
/// 64 MiB tmpfs); made on the first call that has stdin.
const CONTAINER_INPUT_DIR: &str = "/run/dsec-aether";

/// Creates (or takes over) a dir for per-call files: 0711 so that the sandbox user can open
/// its own files there by name but cannot list it.
pub fn make_call_dir(dir: &std::path::Path, may_exist: bool) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    match std::fs::DirBuilder::new().mode(0o711).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && may_exist => {}
        Err(e) => return Err(e),
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
}

/// The dirs for per-call files: (command files, stdin files). In bare mode both are one fresh
/// temp dir; in a container the command dir is made now and the stdin dir when first needed.
fn make_run_dirs(bare: bool) -> std::io::Result<(PathBuf, PathBuf)> {
    if bare {
        let n = sys::nonce()?;
        let dir = std::env::temp_dir().join(format!("dsec-aether.{}.{}", sys::getpid(), &n[..8]));
        make_call_dir(&dir, false)?;
        return Ok((dir.clone(), dir));
    }
    let cmd = PathBuf::from(CONTAINER_CMD_DIR);
    make_call_dir(&cmd, true)?;
    Ok((cmd, PathBuf::from(CONTAINER_INPUT_DIR)))
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse_args(&argv) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("dsec-aether: {e}");
            exit(2);
        }
    };
    sys::tune_malloc();
    sys::ignore_signals();
    sys::ensure_std_fds();
    // SAFETY: F_GETFD takes no pointers.
    if unsafe { libc::fcntl(args.fd, libc::F_GETFD) } < 0 {
        eprintln!("dsec-aether: channel fd {} is not open", args.fd);
        exit(2);
    }
    // SAFETY: the channel fd was inherited for us alone and is checked open above; from here
    // on it is owned by the reader (and a dup by the writer).
    let chan = unsafe { OwnedFd::from_raw_fd(args.fd) };
    // SAFETY: F_SETFD with an int flag: commands must never inherit the channel.
    unsafe { libc::fcntl(chan.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
    let wfd = match chan.try_clone() {
        Ok(fd) => fd,
        Err(e) => {
            eprintln!("dsec-aether: dup channel: {e}");
            exit(2);
        }
    };
    let w = Writer::new(wfd);

    let (user, env, grace) = match args.mode {
        Mode::Bare => {
            sys::set_child_subreaper();
            let (user, env) = match bare_setup(&args) {
                Ok(v) => v,
                Err((kind, msg)) => {
                    // Said on the channel (the edge is waiting for Ready) and on stderr (a
                    // VM guest's console).
                    eprintln!("dsec-aether: {msg}");
                    w.error(0, kind, msg);
                    exit(1);
                }
            };
            w.send(
                0,
                Reply::Ready {
                    pid_in_host: None,
                    aether_version: VERSION.into(),
                },
                &[],
            );
            (user, env, args.reattach_grace_ms)
        }
        Mode::Container => match container_setup(chan.as_raw_fd(), &w) {
            Ok(v) => v,
            Err(code) => exit(code),
        },
    };
    let (run_dir, input_dir) = match make_run_dirs(args.mode == Mode::Bare) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("dsec-aether: create run dir: {e}");
            exit(1);
        }
    };
    let reaper = match reaper::Reaper::start() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("dsec-aether: start reaper: {e}");
            exit(1);
        }
    };
    let srv = Arc::new(Server::new(
        w,
        reaper,
        user,
        env,
        run_dir.clone(),
        input_dir,
        args.mode == Mode::Container,
    ));
    let bare_dir = (args.mode == Mode::Bare).then_some(run_dir);
    if args.mode == Mode::Container {
        // The `default` session's shell starts while the edge answers the create.
        let s2 = srv.clone();
        std::thread::spawn(move || chronus::prestart(&s2, "default"));
    }
    serve(&srv, chan, grace);
    srv.kill_everything();
    if let Some(d) = bare_dir {
        let _ = std::fs::remove_dir_all(d);
    }
    exit(0);
}

/// Bare mode: the sandbox user (`--user`, else whoever runs us) and the environment of
/// `--env-file` (else none).
fn bare_setup(
    args: &Args,
) -> Result<(users::User, BTreeMap<String, String>), (AetherErrorKind, String)> {
    let env = match &args.env_file {
        Some(p) => match std::fs::read(p) {
            Ok(raw) => parse_env_file(&raw),
            Err(e) => {
                return Err((
                    AetherErrorKind::Setup,
                    format!("read the env file {}: {e}", p.display()),
                ))
            }
        },
        None => BTreeMap::new(),
    };
    let user = match &args.user {
        None => users::current(),
        Some(spec) => {
            if sys::geteuid() != 0 {
                return Err((
                    AetherErrorKind::Setup,
                    format!("--user {spec}: serving as another user needs root"),
                ));
            }
            users::resolve_here(spec).map_err(|e| {
                (
                    AetherErrorKind::BadRequest,
                    format!("init_user: {e}; use root or a user listed in the image's /etc/passwd"),
                )
            })?
        }
    };
    Ok((user, env))
}

/// `KEY=VALUE\0...` (as /proc/PID/environ): entries without `=` or with an empty key are skipped,
/// a later key wins. Values may hold any byte but NUL; invalid UTF-8 is replaced.
fn parse_env_file(raw: &[u8]) -> BTreeMap<String, String> {
    raw.split(|&b| b == 0)
        .filter_map(|entry| {
            let entry = String::from_utf8_lossy(entry);
            let (k, v) = entry.split_once('=')?;
            (!k.is_empty()).then(|| (k.to_string(), v.to_string()))
        })
        .collect()
}

/// Container mode: the first frame must be `Setup`. Returns the sandbox user, `setup.env` and
/// the reattach grace, or the exit code after reporting the error.
fn container_setup(
    fd: RawFd,
    w: &Writer,
) -> Result<(users::User, BTreeMap<String, String>, u64), i32> {
    let (id, setup) = match channel::read_frame(fd) {
        Ok(Incoming::Request(id, Request::Setup(s), _)) => (id, s),
        Ok(Incoming::Request(id, _, _)) | Ok(Incoming::Bad(id, _)) => {
            w.error(
                id,
                AetherErrorKind::Setup,
                "the first request must be setup",
            );
            return Err(1);
        }
        Err(e) => {
            eprintln!("dsec-aether: reading setup: {e}");
            return Err(1);
        }
    };
    if let Err(e) = setup::container::apply(&setup) {
        let kind = if e.caller_mistake {
            AetherErrorKind::BadRequest
        } else {
            AetherErrorKind::Setup
        };
        w.error(id, kind, format!("sandbox setup: {e}"));
        return Err(1);
    }
    let user = match users::resolve_here(if setup.user.is_empty() {
        "0"
    } else {
        &setup.user
    }) {
        Ok(u) => u,
        Err(e) => {
            // The caller named a user the image does not have: their mistake, not ours.
            w.error(
                id,
                AetherErrorKind::BadRequest,
                format!("init_user: {e}; use root or a user listed in the image's /etc/passwd"),
            );
            return Err(1);
        }
    };
    w.send(
        id,
        Reply::Ready {
            pid_in_host: None,
            aether_version: VERSION.into(),
        },
        &[],
    );
    Ok((user, setup.env, setup.reattach_grace_ms))
}

/// Reads and dispatches frames until the channel ends (and no edge reattaches in time).
fn serve(srv: &Arc<Server>, mut chan: OwnedFd, grace_ms: u64) {
    loop {
        match channel::read_frame(chan.as_raw_fd()) {
            Ok(Incoming::Request(id, req, body)) => srv.dispatch(id, req, body),
            Ok(Incoming::Bad(id, msg)) => {
                srv.w.error(
                    id,
                    AetherErrorKind::BadRequest,
                    format!("cannot decode request: {msg}"),
                );
            }
            Err(e) => {
                if !matches!(e, ReadError::Eof) {
                    eprintln!("dsec-aether: channel: {e}");
                }
                match reattach(grace_ms) {
                    Some(fd) => match fd.try_clone() {
                        Ok(wfd) => {
                            // Requests of the old edge end now (their replies may still reach
                            // the new edge, which must use fresh ids); sessions survive.
                            srv.cancel_all();
                            srv.w.replace(wfd);
                            chan = fd;
                            srv.w.send(
                                0,
                                Reply::Ready {
                                    pid_in_host: None,
                                    aether_version: VERSION.into(),
                                },
                                &[],
                            );
                        }
                        Err(_) => return,
                    },
                    None => return,
                }
            }
        }
    }
}

/// Waits up to `grace_ms` for an edge to connect on the listener at fd 4.
fn reattach(grace_ms: u64) -> Option<OwnedFd> {
    if grace_ms == 0 {
        return None;
    }
    let mut ty: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    let mut listening: libc::c_int = 0;
    let mut llen = len;
    // SAFETY: getsockopt writes an int into valid out-pointers with their sizes.
    let ok = unsafe {
        libc::getsockopt(
            REATTACH_FD,
            libc::SOL_SOCKET,
            libc::SO_TYPE,
            (&mut ty as *mut libc::c_int).cast(),
            &mut len,
        ) == 0
            && libc::getsockopt(
                REATTACH_FD,
                libc::SOL_SOCKET,
                libc::SO_ACCEPTCONN,
                (&mut listening as *mut libc::c_int).cast(),
                &mut llen,
            ) == 0
    };
    if !ok || listening == 0 {
        return None;
    }
    let mut p = [libc::pollfd {
        fd: REATTACH_FD,
        events: libc::POLLIN,
        revents: 0,
    }];
    let timeout = Duration::from_millis(grace_ms)
        .as_millis()
        .min(i32::MAX as u128) as i32;
    if !matches!(sys::poll(&mut p, timeout), Ok(1)) {
        return None;
    }
    // SAFETY: accept4 on a listening socket with NULL address pointers.
    let fd = unsafe {
        libc::accept4(
            REATTACH_FD,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: accept4 returned a fresh descriptor we own.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn args() {
        assert_eq!(
            parse_args(&[]).unwrap(),
            Args {
                mode: Mode::Container,
                fd: 3,
                reattach_grace_ms: 0,
                user: None,
                env_file: None,
            }
        );
        assert_eq!(
            parse_args(&s(&["--mode", "bare", "--fd", "7"])).unwrap(),
            Args {
                mode: Mode::Bare,
                fd: 7,
                reattach_grace_ms: 0,
                user: None,
                env_file: None,
            }
        );
        assert_eq!(
            parse_args(&s(&[
                "--mode",
                "bare",
                "--user",
                "user",
                "--env-file",
                "/.dsec/env"
            ]))
            .unwrap(),
            Args {
                mode: Mode::Bare,
                fd: 3,
                reattach_grace_ms: 0,
                user: Some("user".into()),
                env_file: Some(PathBuf::from("/.dsec/env")),
            }
        );
        assert!(parse_args(&s(&["--user", "user"])).is_err());
        assert!(parse_args(&s(&["--env-file", "/x"])).is_err());
        assert!(parse_args(&s(&["--mode", "bare", "--user", ""])).is_err());
        assert!(parse_args(&s(&["--mode", "bare", "--user"])).is_err());
        assert!(parse_args(&s(&["--mode", "vm"])).is_err());
        assert!(parse_args(&s(&["--fd", "5"])).is_err());
        assert!(parse_args(&s(&["--mode", "bare", "--fd", "x"])).is_err());
    }

    #[test]
    fn env_file() {
        let env = parse_env_file(b"A=1\0B=x=y\nz\0\0noequals\0=v\0A=2\0C=\0D=\xff\0");
        let want: BTreeMap<String, String> =
            [("A", "2"), ("B", "x=y\nz"), ("C", ""), ("D", "\u{fffd}")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        assert_eq!(env, want);
        assert!(parse_env_file(b"").is_empty());
    }
}
