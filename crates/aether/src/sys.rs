//! Thin wrappers over the raw syscalls aether needs. Each unsafe call is wrapped once here and
//! returns `io::Result`.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};

use crate::reaper::Reaper;

/// Returns `Err(last_os_error)` when `ret` is negative.
fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// A close-on-exec pipe: (read end, write end).
pub fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(io::Error::from)
}

/// A non-blocking, close-on-exec eventfd used to wake a poll loop.
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes no pointers; the returned fd is owned by nobody else.
    let fd =
        check(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) } as libc::c_long)?;
    // SAFETY: `fd` is a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Signals an eventfd.
pub fn eventfd_signal(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64; errors (counter overflow) are harmless.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// A pidfd for `pid`: becomes readable when the process exits (even if already reaped).
pub fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags, no pointers.
    let fd = check(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })?;
    // SAFETY: fresh descriptor we own. pidfds are close-on-exec by default.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// poll(2), retrying on EINTR. `timeout_ms` < 0 waits forever.
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<usize> {
    loop {
        // SAFETY: `fds` is a valid slice of pollfd for its whole length.
        let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// True if `fd` is readable right now (or hung up).
pub fn readable_now(fd: RawFd) -> bool {
    let mut p = [libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }];
    matches!(poll(&mut p, 0), Ok(1))
}

/// read(2), retrying on EINTR.
pub fn read(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        // SAFETY: `buf` is valid for writes of its length.
        let r = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Writes all of `buf` to `fd` (blocking), retrying on EINTR/EAGAIN.
pub fn write_all(fd: RawFd, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        // SAFETY: `buf` is valid for reads of its length.
        let r = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
        if r < 0 {
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => {
                    let mut p = [libc::pollfd {
                        fd,
                        events: libc::POLLOUT,
                        revents: 0,
                    }];
                    poll(&mut p, 1000)?;
                    continue;
                }
                _ => return Err(e),
            }
        }
        buf = &buf[r as usize..];
    }
    Ok(())
}

/// kill(2); a process that is already gone is not an error.
pub fn kill(pid: i32, sig: i32) {
    // SAFETY: kill takes no pointers. Callers never pass 0 or -1 by accident: see kill_everything.
    unsafe { libc::kill(pid, sig) };
}

/// Whether `pid` still exists (a zombie counts until it is reaped).
pub fn pid_alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence; no pointers.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// rename(2) that fails with EEXIST instead of replacing `dst` (renameat2 RENAME_NOREPLACE).
pub fn rename_noreplace(src: &std::ffi::CStr, dst: &std::ffi::CStr) -> io::Result<()> {
    // SAFETY: both paths are valid NUL-terminated strings that outlive the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_renameat2,
            libc::AT_FDCWD,
            src.as_ptr(),
            libc::AT_FDCWD,
            dst.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Fills `buf` with random bytes from the kernel.
pub fn random_bytes(buf: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `buf`.
        let r = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        done += r as usize;
    }
    Ok(())
}

/// 32 random hex digits.
pub fn nonce() -> io::Result<String> {
    let mut b = [0u8; 16];
    random_bytes(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Makes sure fds 0, 1 and 2 are open (on /dev/null if they were closed), so that pipes and
/// sockets we create later never land on them.
pub fn ensure_std_fds() {
    for fd in 0..3 {
        // SAFETY: F_GETFD takes no pointers.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            // SAFETY: the path is a valid NUL-terminated string; the lowest free fd (this one)
            // is returned and deliberately leaked for the life of the process.
            unsafe { libc::open(c"/dev/null".as_ptr(), libc::O_RDWR) };
        }
    }
}

/// Ignores the signals aether itself must survive, and SIGPIPE (we want EPIPE instead).
pub fn ignore_signals() {
    for sig in [
        libc::SIGTERM,
        libc::SIGINT,
        libc::SIGHUP,
        libc::SIGPIPE,
        libc::SIGQUIT,
        libc::SIGTTOU,
        libc::SIGTTIN,
    ] {
        // SAFETY: SIG_IGN is a valid disposition for these catchable signals.
        unsafe { libc::signal(sig, libc::SIG_IGN) };
    }
}

/// Process-wide malloc tuning for a small, steady footprint: one arena, and big buffers (frame
/// bodies, output) from mmap so they go back to the kernel when freed.
pub fn tune_malloc() {
    // SAFETY: mallopt only changes allocator parameters.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 128 * 1024);
    }
}

/// Returns freed heap memory to the kernel.
pub fn trim_heap() {
    // SAFETY: malloc_trim has no preconditions.
    unsafe { libc::malloc_trim(0) };
}

/// Marks the process as a child subreaper (bare mode: orphans of our commands come to us).
pub fn set_child_subreaper() {
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
}

/// The fd the runtime passes the user cgroup's `cgroup.procs` on (container mode).
pub const USER_CGROUP_FD: RawFd = 5;

/// The user cgroup's `cgroup.procs` fd once adopted, else -1. Every child [`spawn`] forks
/// writes "0" to it, so that the sandbox's pids limit applies to the commands while aether (in
/// the parent cgroup) keeps a reserve for its threads.
static USER_CGROUP: AtomicI32 = AtomicI32::new(-1);

/// The `oom_score_adj` every child [`spawn`] forks writes for itself before exec, or -1 for
/// none (bare mode: the child keeps aether's). See [`set_child_oom_score_adj`].
static CHILD_OOM_SCORE_ADJ: AtomicI32 = AtomicI32::new(-1);

/// What a command's `oom_score_adj` should be, given whether aether could lower its own to
/// -1000: then commands go back to the default 0 (they would inherit -1000 and be unkillable);
/// when it could not (a host without CAP_SYS_RESOURCE) aether stays at 0 and commands go to
/// 1000, so that the OOM killer picks any command before aether, whatever aether holds
/// (e.g. a command's captured output). Raising needs no privilege.
pub fn child_oom_score_adj(aether_protected: bool) -> i32 {
    if aether_protected {
        0
    } else {
        1000
    }
}

/// Makes every later [`spawn`] write `adj` (0 or 1000, see [`child_oom_score_adj`]) to the
/// child's `/proc/self/oom_score_adj` before exec. Call once, in container mode, during setup.
pub fn set_child_oom_score_adj(adj: i32) {
    CHILD_OOM_SCORE_ADJ.store(adj, Ordering::SeqCst);
}

/// The bytes a child writes for `adj` (prepared before fork: the child may not allocate).
fn oom_score_adj_text(adj: i32) -> Option<&'static [u8]> {
    match adj {
        0 => Some(b"0"),
        1000 => Some(b"1000"),
        _ => None,
    }
}

/// Adopts [`USER_CGROUP_FD`] if it is a file on a cgroup file system (when the runtime passed
/// none, fd 5 may be anything aether opened itself): marks it close-on-exec and makes [`spawn`]
/// move every child into it. Returns whether it was adopted. Call once, in container mode,
/// after setup and before any command starts.
pub fn adopt_user_cgroup_fd() -> bool {
    if !is_cgroup_file(USER_CGROUP_FD) {
        return false;
    }
    // SAFETY: F_SETFD with an int flag on an fd we own for the life of the process.
    unsafe { libc::fcntl(USER_CGROUP_FD, libc::F_SETFD, libc::FD_CLOEXEC) };
    USER_CGROUP.store(USER_CGROUP_FD, Ordering::SeqCst);
    true
}

/// True if `fd` is open on cgroupfs (v1 or v2).
fn is_cgroup_file(fd: RawFd) -> bool {
    const CGROUP_SUPER_MAGIC: i64 = 0x0027_e0eb;
    const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
    // SAFETY: fstatfs writes into a statfs buffer we own; a closed fd fails with EBADF.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: see above; `st` is valid for writes.
    if unsafe { libc::fstatfs(fd, &mut st) } != 0 {
        return false;
    }
    let t = st.f_type as i64;
    t == CGROUP_SUPER_MAGIC || t == CGROUP2_SUPER_MAGIC
}

/// Credentials a child switches to before exec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Creds {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// What to start.
pub struct SpawnSpec {
    /// Path to execute (already resolved, see [`resolve_in_path`]).
    pub path: CString,
    pub argv: Vec<CString>,
    pub envp: Vec<CString>,
    pub cwd: Option<CString>,
    pub creds: Option<Creds>,
    /// fds that become the child's 0, 1, 2 (must be >= 3).
    pub stdio: [RawFd; 3],
    /// Make stdin the controlling terminal (for TTYs).
    pub ctty: bool,
}

/// Where in the child a spawn failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Fork,
    Setsid,
    Stdio,
    Ctty,
    Creds,
    Cwd,
    Exec,
}

#[derive(Debug)]
pub struct SpawnError {
    pub stage: Stage,
    pub err: io::Error,
}

impl std::fmt::Display for SpawnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.stage, self.err)
    }
}

/// Converts a string into a CString, refusing interior NULs.
pub fn cstr(s: &str) -> io::Result<CString> {
    CString::new(s).map_err(|_| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{s:?} contains a NUL byte"),
        )
    })
}

/// Finds `name` the way a shell would: a name with a slash is used as is, else each PATH entry
/// is tried for an executable regular file. None when nothing matches.
pub fn resolve_in_path(name: &str, path_var: &str) -> Option<String> {
    if name.contains('/') {
        return Some(name.to_string());
    }
    if name.is_empty() {
        return None;
    }
    for dir in path_var.split(':') {
        let dir = if dir.is_empty() { "." } else { dir };
        let cand = format!("{dir}/{name}");
        if let Ok(meta) = std::fs::metadata(&cand) {
            use std::os::unix::fs::PermissionsExt;
            if meta.is_file() && meta.permissions().mode() & 0o111 != 0 {
                return Some(cand);
            }
        }
    }
    None
}

/// Forks and execs `spec` in a new session, registering the child with `reaper` before it can be
/// reaped. On failure in the child, reports which step failed and its errno.
pub fn spawn(reaper: &Reaper, spec: &SpawnSpec) -> Result<i32, SpawnError> {
    let fork_err = |err| SpawnError {
        stage: Stage::Fork,
        err,
    };
    // Everything the child touches is prepared here: after fork it may not allocate.
    let mut argv: Vec<*const libc::c_char> = spec.argv.iter().map(|a| a.as_ptr()).collect();
    argv.push(std::ptr::null());
    let mut envp: Vec<*const libc::c_char> = spec.envp.iter().map(|a| a.as_ptr()).collect();
    envp.push(std::ptr::null());
    let groups: Vec<libc::gid_t> = spec
        .creds
        .as_ref()
        .map(|c| c.groups.clone())
        .unwrap_or_default();
    let (err_r, err_w) = pipe().map_err(fork_err)?;
    if spec.stdio.iter().any(|&fd| fd < 3) {
        return Err(fork_err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "stdio fds must be >= 3",
        )));
    }
    let child = ChildArgs {
        path: spec.path.as_ptr(),
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        cwd: spec.cwd.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
        creds: spec.creds.as_ref().map(|c| (c.uid, c.gid)),
        groups: groups.as_ptr(),
        ngroups: groups.len(),
        stdio: spec.stdio,
        ctty: spec.ctty,
        err_fd: err_w.as_raw_fd(),
        cgroup_fd: USER_CGROUP.load(Ordering::SeqCst),
        oom_score_adj: oom_score_adj_text(CHILD_OOM_SCORE_ADJ.load(Ordering::SeqCst)),
    };
    let pid = reaper.spawn_registered(|| {
        // SAFETY: fork has no memory-safety preconditions; the child only runs `child_main`,
        // which uses async-signal-safe calls and never returns.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: we are the freshly forked child; every pointer in `child` points into
            // buffers that the fork copied and that stay alive until exec or _exit.
            unsafe { child_main(&child) }
        }
        if pid < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(pid)
        }
    });
    let pid = pid.map_err(fork_err)?;
    drop(err_w);
    let mut buf = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        match read(err_r.as_raw_fd(), &mut buf[got..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    if got == 0 {
        return Ok(pid);
    }
    // The child failed before exec and exits 127; let the reaper drop its status.
    reaper.forget(pid);
    let stage = match buf[0] {
        1 => Stage::Setsid,
        2 => Stage::Stdio,
        3 => Stage::Ctty,
        4 => Stage::Creds,
        5 => Stage::Cwd,
        _ => Stage::Exec,
    };
    let errno = i32::from_ne_bytes([buf[4], buf[5], buf[6], buf[7]]);
    Err(SpawnError {
        stage,
        err: io::Error::from_raw_os_error(errno),
    })
}

struct ChildArgs {
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
    cwd: *const libc::c_char,
    creds: Option<(u32, u32)>,
    groups: *const libc::gid_t,
    ngroups: usize,
    stdio: [RawFd; 3],
    ctty: bool,
    err_fd: RawFd,
    /// `cgroup.procs` of the user cgroup, or -1.
    cgroup_fd: RawFd,
    /// Written to `/proc/self/oom_score_adj` before exec, if any.
    oom_score_adj: Option<&'static [u8]>,
}

/// Runs in the forked child: only async-signal-safe calls, no allocation.
///
/// # Safety
/// Must be called only in a freshly forked child, with every pointer in `a` valid.
unsafe fn child_main(a: &ChildArgs) -> ! {
    let fail = |stage: u8| -> ! {
        // SAFETY: __errno_location returns this thread's errno slot.
        let errno = unsafe { *libc::__errno_location() };
        let mut msg = [0u8; 8];
        msg[0] = stage;
        msg[4..8].copy_from_slice(&errno.to_ne_bytes());
        // SAFETY: writes 8 bytes from a stack buffer, then exits without running destructors.
        unsafe {
            libc::write(a.err_fd, msg.as_ptr().cast(), 8);
            libc::_exit(127)
        }
    };
    // SAFETY: all calls below are async-signal-safe and take pointers prepared by the parent.
    unsafe {
        // First, before anything can fork: join the user cgroup ("0" is the writer itself).
        // Best effort: failing to move must not stop the command (the limit still holds on
        // the sandbox's cgroup).
        if a.cgroup_fd >= 0 {
            libc::write(a.cgroup_fd, b"0".as_ptr().cast(), 1);
        }
        // Also best effort: the OOM killer must choose commands before aether (a failure
        // leaves the inherited score, as before).
        if let Some(adj) = a.oom_score_adj {
            let fd = libc::open(
                c"/proc/self/oom_score_adj".as_ptr(),
                libc::O_WRONLY | libc::O_CLOEXEC,
            );
            if fd >= 0 {
                libc::write(fd, adj.as_ptr().cast(), adj.len());
                libc::close(fd);
            }
        }
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        for sig in 1..32 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
        if libc::setsid() < 0 {
            fail(1);
        }
        for (i, &fd) in a.stdio.iter().enumerate() {
            if libc::dup2(fd, i as RawFd) < 0 {
                fail(2);
            }
        }
        if a.ctty && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
            fail(3);
        }
        if let Some((uid, gid)) = a.creds {
            if libc::setgroups(a.ngroups, a.groups) < 0 {
                fail(4);
            }
            if libc::setresgid(gid, gid, gid) < 0 || libc::setresuid(uid, uid, uid) < 0 {
                fail(4);
            }
        }
        if !a.cwd.is_null() && libc::chdir(a.cwd) < 0 {
            fail(5);
        }
        // Every inherited fd above 2 (including other requests' pipes) closes at exec.
        libc::syscall(
            libc::SYS_close_range,
            3u32,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        );
        libc::execve(a.path, a.argv, a.envp);
        fail(6)
    }
}

/// Opens a pseudo-terminal pair of the given size: (master, slave), both close-on-exec.
pub fn openpty(rows: u16, cols: u16) -> io::Result<(OwnedFd, OwnedFd)> {
    let mut master: libc::c_int = -1;
    let mut slave: libc::c_int = -1;
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: out-pointers are valid ints; name is NULL; termios NULL; winsize valid.
    let r = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            &ws,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: openpty returned two fresh descriptors that we now own.
    let (m, s) = unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
    for fd in [m.as_raw_fd(), s.as_raw_fd()] {
        // SAFETY: F_SETFD with an int flag.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    Ok((m, s))
}

/// Sets a terminal's window size.
pub fn set_winsize(fd: RawFd, rows: u16, cols: u16) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize from a valid pointer.
    check(unsafe { libc::ioctl(fd, libc::TIOCSWINSZ, &ws) } as libc::c_long)?;
    Ok(())
}

/// fchown + fchmod on an open file.
pub fn own_and_mode(fd: RawFd, uid: Option<(u32, u32)>, mode: u32) -> io::Result<()> {
    if let Some((u, g)) = uid {
        // SAFETY: fchown takes integers only.
        check(unsafe { libc::fchown(fd, u, g) } as libc::c_long)?;
    }
    // SAFETY: fchmod takes integers only. Done after chown, which may clear setuid bits.
    check(unsafe { libc::fchmod(fd, mode & 0o7777) } as libc::c_long)?;
    Ok(())
}

/// Current effective uid.
pub fn geteuid() -> u32 {
    // SAFETY: no preconditions.
    unsafe { libc::geteuid() }
}

/// Current real uid and gid.
pub fn getuid_gid() -> (u32, u32) {
    // SAFETY: no preconditions.
    unsafe { (libc::getuid(), libc::getgid()) }
}

/// This process's pid.
pub fn getpid() -> i32 {
    // SAFETY: no preconditions.
    unsafe { libc::getpid() }
}

/// The kernel hostname (of our UTS namespace).
pub fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_default()
}

/// `RNDADDENTROPY` (`_IOW('R', 0x03, int[2])`) and `RNDRESEEDCRNG` (`_IO('R', 0x07)`) of
/// `<linux/random.h>`.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// A guest restored from a template snapshot takes its own identity: hostname, wall clock, and
/// fresh kernel randomness (`seed` credited to the pool with `RNDADDENTROPY`, falling back to a
/// plain write, then `RNDRESEEDCRNG` so the CRNG stops producing the template's stream).
pub fn set_identity(hostname: &str, secs: i64, nanos: u32, seed: &[u8]) -> Result<(), String> {
    nix::unistd::sethostname(hostname).map_err(|e| format!("sethostname {hostname:?}: {e}"))?;
    let ts = libc::timespec {
        tv_sec: secs as libc::time_t,
        tv_nsec: nanos.min(999_999_999) as libc::c_long,
    };
    // SAFETY: clock_settime reads a valid timespec we own.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        return Err(format!(
            "clock_settime: {}",
            std::io::Error::last_os_error()
        ));
    }
    if seed.is_empty() {
        return Ok(());
    }
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")
        .map_err(|e| format!("open /dev/urandom: {e}"))?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + seed.len());
    let bits = (seed.len() * 8).min(i32::MAX as usize) as i32;
    info.extend_from_slice(&bits.to_ne_bytes());
    info.extend_from_slice(&(seed.len() as i32).to_ne_bytes());
    info.extend_from_slice(seed);
    info.resize(8 + seed.len().div_ceil(4) * 4, 0);
    // SAFETY: RNDADDENTROPY reads a rand_pool_info of 8 + buf_size bytes from `info`, which
    // holds that many (padded to whole u32 words).
    let added = unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) } == 0;
    if !added {
        f.write_all(seed)
            .map_err(|e| format!("write /dev/urandom: {e}"))?;
    }
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG as _) } != 0 {
        return Err(format!(
            "reseed the kernel CRNG: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_always_score_above_aether_for_the_oom_killer() {
        // aether at -1000: commands back to the default; aether left at 0: commands above it
        assert_eq!(child_oom_score_adj(true), 0);
        assert_eq!(child_oom_score_adj(false), 1000);
        for adj in [child_oom_score_adj(true), child_oom_score_adj(false)] {
            let text = oom_score_adj_text(adj).expect("every chosen score has its text");
            assert_eq!(
                std::str::from_utf8(text).unwrap().parse::<i32>().unwrap(),
                adj
            );
        }
        assert_eq!(oom_score_adj_text(-1), None);
    }
}
