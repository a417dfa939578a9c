//! Starting aether in fresh namespaces: `clone3` straight into `execve`.
//!
//! The edge is a multi-threaded tokio process, so the child of `clone3` may only make
//! async-signal-safe calls: everything it needs (paths, argv, envp, the opened `cgroup.procs`
//! files) is prepared by the parent before the clone, and the child does nothing but join the
//! cgroups, unshare its cgroup namespace, put the channel on fd 3 (and the user cgroup's
//! `cgroup.procs` on fd 5: aether moves every command it forks there) and exec. Failures are
//! reported to the parent through a close-on-exec pipe (EOF there means the exec succeeded).

use std::ffi::CString;
use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::pidfd;

/// The fd number aether finds its channel on.
pub const CHANNEL_FD: RawFd = 3;
/// The fd number aether finds the edge's reattach listener on (optional).
pub const REATTACH_FD: RawFd = 4;
/// The fd number aether finds the user cgroup's `cgroup.procs` on (opened for writing).
pub const USER_CGROUP_FD: RawFd = 5;

/// `struct clone_args` of `clone3(2)` (the version-2 layout, 88 bytes).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// The steps of the child, reported with the errno when one fails.
const STEP_CGROUP: u8 = 1;
const STEP_UNSHARE: u8 = 2;
const STEP_CHANNEL: u8 = 3;
const STEP_SIGNALS: u8 = 4;
const STEP_EXEC: u8 = 5;
const STEP_USER_CGROUP: u8 = 6;
const STEP_NETNS: u8 = 7;

fn step_name(step: u8) -> &'static str {
    match step {
        STEP_CGROUP => "join cgroup",
        STEP_UNSHARE => "unshare cgroup namespace",
        STEP_CHANNEL => "move channel to fd 3",
        STEP_SIGNALS => "reset signal mask",
        STEP_EXEC => "exec aether",
        STEP_USER_CGROUP => "move the user cgroup to fd 5",
        STEP_NETNS => "join the prepared network namespace",
        _ => "unknown step",
    }
}

/// A started aether.
#[derive(Debug)]
pub struct Spawned {
    pub pid: i32,
    pub pidfd: OwnedFd,
}

/// Everything the child touches, built before the clone.
struct Plan {
    path: CString,
    _argv: Vec<CString>,
    argv_ptrs: Vec<*const libc::c_char>,
    _envp: Vec<CString>,
    envp_ptrs: Vec<*const libc::c_char>,
    cgroup_fds: Vec<OwnedFd>,
    /// The user cgroup's `cgroup.procs`, numbered above [`USER_CGROUP_FD`].
    user_cgroup: Option<OwnedFd>,
    sigset: libc::sigset_t,
}

fn cstring(s: &[u8]) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL byte in argument"))
}

impl Plan {
    fn new(aether: &Path, procs_files: &[PathBuf], user_procs: Option<&Path>) -> io::Result<Self> {
        let path = cstring(aether.as_os_str().as_bytes())?;
        let argv = vec![
            cstring(b"dsec-aether")?,
            cstring(b"--mode")?,
            cstring(b"container")?,
        ];
        let envp = vec![cstring(
            b"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )?];
        let ptrs = |v: &[CString]| {
            v.iter()
                .map(|c| c.as_ptr())
                .chain(std::iter::once(std::ptr::null()))
                .collect()
        };
        let argv_ptrs = ptrs(&argv);
        let envp_ptrs = ptrs(&envp);
        let open = |p: &Path| {
            OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open(p)
                .map(OwnedFd::from)
                .map_err(|e| io::Error::new(e.kind(), format!("open {}: {e}", p.display())))
        };
        let cgroup_fds = procs_files
            .iter()
            .map(|p| open(p))
            .collect::<io::Result<Vec<_>>>()?;
        let user_cgroup = match user_procs {
            Some(p) => Some(dup_above(open(p)?, USER_CGROUP_FD)?),
            None => None,
        };
        // SAFETY: sigset_t is plain data; sigemptyset initialises it fully.
        let sigset = unsafe {
            let mut s = std::mem::zeroed::<libc::sigset_t>();
            libc::sigemptyset(&mut s);
            s
        };
        Ok(Plan {
            path,
            _argv: argv,
            argv_ptrs,
            _envp: envp,
            envp_ptrs,
            cgroup_fds,
            user_cgroup,
            sigset,
        })
    }
}

/// Creates a close-on-exec pipe whose write end is above [`USER_CGROUP_FD`] (so that moving the
/// channel, listener and user cgroup onto fds 3, 4 and 5 in the child never clobbers it).
fn error_pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two fds into the array we own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: pipe2 succeeded, so both fds are open and owned by nobody else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    Ok((r, dup_above(w, USER_CGROUP_FD)?))
}

/// Returns `fd` renumbered to a close-on-exec fd greater than `min` if it is not already.
fn dup_above(fd: OwnedFd, min: RawFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() > min {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC on an fd we own returns a new fd or -1.
    let new = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, min + 1) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `new` is a freshly duplicated fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// Namespaces every container gets (the cgroup namespace is unshared by the child after it
/// joined its cgroups, so that its cgroup root is its own cgroup).
const NS_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUTS) as u64;

/// Starts `aether` in new namespaces, inside the cgroups whose `cgroup.procs` files are given,
/// with `channel` on fd 3 and, if given, the edge's reattach `listener` on fd 4. Blocks until the
/// exec happened (or failed); call it from a blocking context. `user_procs` (the user cgroup's
/// `cgroup.procs`), if given, is open for writing on fd 5.
pub fn spawn_aether(
    aether: &Path,
    procs_files: &[PathBuf],
    channel: BorrowedFd<'_>,
    listener: Option<BorrowedFd<'_>>,
    user_procs: Option<&Path>,
    netns: Option<BorrowedFd<'_>>,
) -> io::Result<Spawned> {
    let plan = Plan::new(aether, procs_files, user_procs)?;
    // Above fd 4, so that putting the channel on fd 3 cannot clobber it.
    let listener = listener
        .map(|l| {
            l.try_clone_to_owned()
                .and_then(|l| dup_above(l, REATTACH_FD))
        })
        .transpose()?;
    let listen_fd = listener.as_ref().map_or(-1, |l| l.as_raw_fd());
    let (err_r, err_w) = error_pipe()?;
    let mut pidfd_out: RawFd = -1;
    let args = CloneArgs {
        // With a prepared network namespace the child joins it instead of getting an empty one.
        flags: if netns.is_some() {
            NS_FLAGS & !(libc::CLONE_NEWNET as u64)
        } else {
            NS_FLAGS
        } | libc::CLONE_PIDFD as u64,
        pidfd: &mut pidfd_out as *mut RawFd as u64,
        exit_signal: libc::SIGCHLD as u64,
        ..CloneArgs::default()
    };
    let chan = channel.as_raw_fd();
    let err_fd = err_w.as_raw_fd();
    let netns_fd = netns.map_or(-1, |n| n.as_raw_fd());

    // SAFETY: clone3 without CLONE_VM gives the child a copy of this thread's memory; `args` is a
    // valid clone_args of the size passed. The child branch below only makes async-signal-safe
    // system calls on memory prepared before the clone, then execs or exits.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if ret == 0 {
        // SAFETY: we are the child; `child_main` never returns.
        unsafe { child_main(&plan, chan, listen_fd, netns_fd, err_fd) }
    }
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    let pid = ret as i32;
    // SAFETY: clone3 with CLONE_PIDFD stored a new pidfd (close-on-exec) that we now own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd_out) };
    drop(err_w);
    drop(plan);

    let mut report = [0u8; 5];
    let n = read_full(&err_r, &mut report)?;
    if n == 0 {
        return Ok(Spawned { pid, pidfd });
    }
    // The child failed and exits with 127: reap it before returning.
    let _ = pidfd::wait_blocking(pidfd.as_fd());
    if n < report.len() {
        return Err(io::Error::other(
            "aether's child exited with a short error report",
        ));
    }
    let errno = i32::from_ne_bytes([report[1], report[2], report[3], report[4]]);
    let e = io::Error::from_raw_os_error(errno);
    Err(io::Error::new(
        e.kind(),
        format!("{} ({}): {e}", step_name(report[0]), aether.display()),
    ))
}

/// Reads until `buf` is full or EOF; returns the count.
fn read_full(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: reading into the unfilled part of a buffer we own.
        let n = unsafe {
            libc::read(
                fd.as_raw_fd(),
                buf[got..].as_mut_ptr().cast(),
                buf.len() - got,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break;
        }
        got += n as usize;
    }
    Ok(got)
}

/// The child between clone3 and execve. Only async-signal-safe calls, no allocation, no locks.
///
/// # Safety
/// Must only be called in the child of a fork-like clone, with `plan` built before the clone.
unsafe fn child_main(
    plan: &Plan,
    chan: RawFd,
    listen_fd: RawFd,
    netns_fd: RawFd,
    err_fd: RawFd,
) -> ! {
    // SAFETY: every call is a raw system call or an async-signal-safe libc
    // function on memory that was fully prepared before the clone and is not mutated.
    unsafe {
        let fail = |step: u8| child_fail(err_fd, step);
        if netns_fd >= 0 && libc::setns(netns_fd, libc::CLONE_NEWNET) != 0 {
            fail(STEP_NETNS);
        }
        for fd in &plan.cgroup_fds {
            if libc::write(fd.as_raw_fd(), b"0".as_ptr().cast(), 1) != 1 {
                fail(STEP_CGROUP);
            }
        }
        if libc::unshare(libc::CLONE_NEWCGROUP) != 0 {
            fail(STEP_UNSHARE);
        }
        if chan == CHANNEL_FD {
            if libc::fcntl(CHANNEL_FD, libc::F_SETFD, 0) != 0 {
                fail(STEP_CHANNEL);
            }
        } else if libc::dup2(chan, CHANNEL_FD) != CHANNEL_FD {
            fail(STEP_CHANNEL);
        }
        if listen_fd >= 0 && libc::dup2(listen_fd, REATTACH_FD) != REATTACH_FD {
            fail(STEP_CHANNEL);
        }
        // Last: the channel or listener may have been fd 5. The user cgroup's fd is above 5,
        // so dup2 leaves a copy without close-on-exec exactly on fd 5.
        if let Some(fd) = &plan.user_cgroup {
            if libc::dup2(fd.as_raw_fd(), USER_CGROUP_FD) != USER_CGROUP_FD {
                fail(STEP_USER_CGROUP);
            }
        }
        // The edge's threads may block signals or ignore SIGPIPE; aether starts clean.
        if libc::sigprocmask(libc::SIG_SETMASK, &plan.sigset, std::ptr::null_mut()) != 0 {
            fail(STEP_SIGNALS);
        }
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        libc::execve(
            plan.path.as_ptr(),
            plan.argv_ptrs.as_ptr(),
            plan.envp_ptrs.as_ptr(),
        );
        fail(STEP_EXEC)
    }
}

/// Reports `step` and the current errno on the error pipe and exits the child.
fn child_fail(err_fd: RawFd, step: u8) -> ! {
    // SAFETY: errno location, write(2) and _exit(2) are async-signal-safe; `msg` is on the stack.
    unsafe {
        let e = (*libc::__errno_location()).to_ne_bytes();
        let msg = [step, e[0], e[1], e[2], e[3]];
        libc::write(err_fd, msg.as_ptr().cast(), msg.len());
        libc::_exit(127)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clone_args_layout() {
        // CLONE_ARGS_SIZE_VER2
        assert_eq!(std::mem::size_of::<CloneArgs>(), 88);
    }

    #[test]
    fn error_pipe_is_above_channel_fd() {
        let (r, w) = error_pipe().unwrap();
        assert!(w.as_raw_fd() > USER_CGROUP_FD);
        drop(r);
    }

    #[test]
    fn plan_rejects_nul() {
        assert!(Plan::new(Path::new("/bin/a\0b"), &[], None).is_err());
        let p = Plan::new(Path::new("/bin/true"), &[], None).unwrap();
        assert_eq!(p.argv_ptrs.len(), 4);
        assert!(p.argv_ptrs[3].is_null());
        assert!(p.envp_ptrs.last().unwrap().is_null());
    }

    #[test]
    fn user_cgroup_fd_is_above_its_target() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("cgroup.procs");
        std::fs::write(&f, "").unwrap();
        let p = Plan::new(Path::new("/bin/true"), &[], Some(&f)).unwrap();
        assert!(p.user_cgroup.as_ref().unwrap().as_raw_fd() > USER_CGROUP_FD);
        assert!(Plan::new(Path::new("/bin/true"), &[], Some(&d.path().join("no"))).is_err());
    }
}
