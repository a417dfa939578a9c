//! Starting aether in fresh namespaces: a `posix_spawn`-style clone straight into `execve`.
//!
//! The child shares the edge's address space (`CLONE_VM | CLONE_VFORK`) and runs on a small
//! stack of its own until it execs: the kernel copies none of the big, multi-threaded edge's
//! page tables, and neither side takes copy-on-write faults or TLB-flush IPIs afterwards (a
//! plain fork-like clone of `dsec up` cost that on every create). The calling thread sleeps
//! until the child has exec'd or exited. The edge's other threads keep running, so the child
//! may only make async-signal-safe calls and must not write to memory the parent uses:
//! everything it needs (paths, argv, envp, the opened `cgroup.procs` files) is prepared before
//! the clone, and the child does nothing but join the cgroups, unshare its cgroup namespace,
//! put the channel on fd 3 (and the user cgroup's `cgroup.procs` on fd 5: aether moves every
//! command it forks there), for a best-effort sandbox switch itself to SCHED_IDLE with an
//! RLIMIT_NICE of 0/0 (so aether and everything it ever forks start idle, with no window for a
//! fork to escape), reset its signal handlers and mask, and exec. All signals are
//! blocked around the clone so that no handler of the edge runs on the child's stack.
//! Failures are reported to the parent through a close-on-exec pipe (EOF there means the exec
//! succeeded).

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

/// Size of the child's stack (it runs only [`child_main`] on it, then execs).
const CHILD_STACK: usize = 64 * 1024;

/// The steps of the child, reported with the errno when one fails.
const STEP_CGROUP: u8 = 1;
const STEP_UNSHARE: u8 = 2;
const STEP_CHANNEL: u8 = 3;
const STEP_SIGNALS: u8 = 4;
const STEP_EXEC: u8 = 5;
const STEP_USER_CGROUP: u8 = 6;
const STEP_NETNS: u8 = 7;
const STEP_SCHED: u8 = 8;
const STEP_RLIMIT: u8 = 9;

fn step_name(step: u8) -> &'static str {
    match step {
        STEP_CGROUP => "join cgroup",
        STEP_UNSHARE => "unshare cgroup namespace",
        STEP_CHANNEL => "move channel to fd 3",
        STEP_SIGNALS => "reset signal mask",
        STEP_EXEC => "exec aether",
        STEP_USER_CGROUP => "move the user cgroup to fd 5",
        STEP_NETNS => "join the prepared network namespace",
        STEP_SCHED => "sched_setscheduler(SCHED_IDLE)",
        STEP_RLIMIT => "setrlimit(RLIMIT_NICE, 0/0)",
        _ => "unknown step",
    }
}

/// How the container's processes are scheduled from their first instruction on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SchedClass {
    /// The edge's own policy (normally SCHED_OTHER), inherited.
    #[default]
    Inherit,
    /// SCHED_IDLE with RLIMIT_NICE pinned to 0/0, so that nothing inside (which keeps neither
    /// CAP_SYS_NICE nor CAP_SYS_RESOURCE) can switch back to SCHED_OTHER. Set by the spawn child
    /// before it execs aether: aether and all it forks inherit both.
    Idle,
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
const NS_FLAGS: libc::c_int = libc::CLONE_NEWNS
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUTS;

/// Starts `aether` in new namespaces, inside the cgroups whose `cgroup.procs` files are given,
/// with `channel` on fd 3 and, if given, the edge's reattach `listener` on fd 4. Blocks until the
/// exec happened (or failed); call it from a blocking context. `user_procs` (the user cgroup's
/// `cgroup.procs`), if given, is open for writing on fd 5. `sched` is applied before the exec.
pub fn spawn_aether(
    aether: &Path,
    procs_files: &[PathBuf],
    channel: BorrowedFd<'_>,
    listener: Option<BorrowedFd<'_>>,
    user_procs: Option<&Path>,
    netns: Option<BorrowedFd<'_>>,
    sched: SchedClass,
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
    // With a prepared network namespace the child joins it instead of getting an empty one.
    let ns = if netns.is_some() {
        NS_FLAGS & !libc::CLONE_NEWNET
    } else {
        NS_FLAGS
    };
    let flags = ns | libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PIDFD | libc::SIGCHLD;
    let child = ChildArgs {
        plan: &plan,
        chan: channel.as_raw_fd(),
        listen_fd,
        netns_fd: netns.map_or(-1, |n| n.as_raw_fd()),
        err_fd: err_w.as_raw_fd(),
        sched_idle: sched == SchedClass::Idle,
    };
    let mut stack = vec![0u8; CHILD_STACK];
    // SAFETY: the stack grows down on every Linux target we build for; one past the end of
    // the buffer is its top (glibc's clone aligns it).
    let stack_top = unsafe { stack.as_mut_ptr().add(stack.len()) };
    let ret = {
        let _blocked = BlockedSignals::all()?;
        // SAFETY: glibc's clone runs `child_entry(&child)` on `stack` in a child sharing our
        // memory; CLONE_VFORK suspends this thread until the child exec'd or exited, so
        // `child`, `plan` and `stack` outlive its use of them. The child only makes
        // async-signal-safe calls and writes nothing but its own stack (and errno). With
        // CLONE_PIDFD the kernel stores the pidfd through the parent-tid argument.
        unsafe {
            libc::clone(
                child_entry,
                stack_top.cast(),
                flags,
                &child as *const ChildArgs as *mut libc::c_void,
                &mut pidfd_out as *mut RawFd,
            )
        }
    };
    drop(stack);
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    let pid = ret as i32;
    // SAFETY: clone with CLONE_PIDFD stored a new pidfd (close-on-exec) that we now own.
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

/// What [`child_entry`] gets through glibc's `clone` argument.
struct ChildArgs<'a> {
    plan: &'a Plan,
    chan: RawFd,
    listen_fd: RawFd,
    netns_fd: RawFd,
    err_fd: RawFd,
    sched_idle: bool,
}

/// The child's entry point on its own stack.
extern "C" fn child_entry(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `arg` is the `ChildArgs` the parent passed to clone; the parent is suspended
    // (CLONE_VFORK) until we exec or exit, so it is alive and unchanged.
    let a = unsafe { &*(arg as *const ChildArgs<'_>) };
    // SAFETY: we are the child of a vfork-like clone and `plan` was built before it.
    unsafe {
        child_main(
            a.plan,
            a.chan,
            a.listen_fd,
            a.netns_fd,
            a.err_fd,
            a.sched_idle,
        )
    }
}

/// All signals blocked on the calling thread until dropped (then the old mask is restored).
struct BlockedSignals(libc::sigset_t);

impl BlockedSignals {
    fn all() -> io::Result<Self> {
        // SAFETY: sigset_t is plain data, initialised by sigfillset / pthread_sigmask.
        unsafe {
            let mut all = std::mem::zeroed::<libc::sigset_t>();
            let mut old = std::mem::zeroed::<libc::sigset_t>();
            libc::sigfillset(&mut all);
            let rc = libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
            if rc != 0 {
                return Err(io::Error::from_raw_os_error(rc));
            }
            Ok(BlockedSignals(old))
        }
    }
}

impl Drop for BlockedSignals {
    fn drop(&mut self) {
        // SAFETY: restores the mask saved in `all`.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }
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

/// The child between clone and execve. Only async-signal-safe calls, no allocation, no locks,
/// no writes to memory outside its own stack (it shares the edge's address space).
///
/// # Safety
/// Must only be called in the child of a vfork-like clone, with `plan` built before the clone
/// and all signals blocked.
unsafe fn child_main(
    plan: &Plan,
    chan: RawFd,
    listen_fd: RawFd,
    netns_fd: RawFd,
    err_fd: RawFd,
    sched_idle: bool,
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
        // Both are plain system calls on locals of this stack; they act on this task only
        // (the edge keeps its policy and limits), and exec keeps them.
        if sched_idle {
            let param = libc::sched_param { sched_priority: 0 };
            if libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0 {
                fail(STEP_SCHED);
            }
            let zero = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            if libc::setrlimit(libc::RLIMIT_NICE, &zero) != 0 {
                fail(STEP_RLIMIT);
            }
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
        // The edge's handlers must not run here (this stack, the edge's memory): every caught
        // signal goes back to its default before the mask opens (the handler table is this
        // child's own copy). The edge may also ignore SIGPIPE; aether starts clean.
        for sig in 1..=libc::SIGRTMAX() {
            let mut old = std::mem::zeroed::<libc::sigaction>();
            if libc::sigaction(sig, std::ptr::null(), &mut old) == 0
                && (old.sa_sigaction != libc::SIG_DFL || sig == libc::SIGPIPE)
            {
                let mut dfl = std::mem::zeroed::<libc::sigaction>();
                dfl.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(sig, &dfl, std::ptr::null_mut());
            }
        }
        if libc::sigprocmask(libc::SIG_SETMASK, &plan.sigset, std::ptr::null_mut()) != 0 {
            fail(STEP_SIGNALS);
        }
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
    fn blocked_signals_are_restored() {
        let mask = || {
            // SAFETY: reads the calling thread's mask into a zeroed sigset_t.
            unsafe {
                let mut m = std::mem::zeroed::<libc::sigset_t>();
                libc::pthread_sigmask(libc::SIG_SETMASK, std::ptr::null(), &mut m);
                libc::sigismember(&m, libc::SIGTERM)
            }
        };
        let before = mask();
        {
            let _b = BlockedSignals::all().unwrap();
            assert_eq!(mask(), 1);
        }
        assert_eq!(mask(), before);
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

    /// The scheduling policy of `pid` (`sched_getscheduler`: 0 = OTHER, 5 = IDLE) and the soft
    /// and hard "Max nice priority" of `/proc/<pid>/limits`.
    fn policy_and_nice_limit(pid: i32) -> (i32, Vec<String>) {
        // SAFETY: sched_getscheduler takes a plain pid.
        let policy = unsafe { libc::sched_getscheduler(pid) };
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap_or_default();
        let nice = limits
            .lines()
            .find(|l| l.starts_with("Max nice priority"))
            .map(|l| {
                l.split_whitespace()
                    .skip(3)
                    .take(2)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        (policy, nice)
    }

    /// A spawned container's PID 1 is SCHED_IDLE (RLIMIT_NICE 0/0) from its exec on when asked,
    /// and keeps the edge's SCHED_OTHER otherwise.
    #[test]
    fn sched_class_is_set_before_exec() {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            println!("skipped: needs root (new namespaces)");
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let script = d.path().join("fake-aether");
        std::fs::write(&script, "#!/bin/sh\nexec sleep 30\n").unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        for (sched, want_policy, want_nice) in [
            (SchedClass::Idle, libc::SCHED_IDLE, Some(["0", "0"])),
            (SchedClass::Inherit, libc::SCHED_OTHER, None),
        ] {
            let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
            let sp = spawn_aether(&script, &[], theirs.as_fd(), None, None, None, sched).unwrap();
            // Read right after the exec, before the process could have changed anything.
            let (policy, nice) = policy_and_nice_limit(sp.pid);
            // SAFETY: kill on the pid we just spawned and still hold (unreaped) by its pidfd.
            unsafe { libc::kill(sp.pid, libc::SIGKILL) };
            let _ = pidfd::wait_blocking(sp.pidfd.as_fd());
            drop((ours, theirs));
            assert_eq!(policy, want_policy, "{sched:?}");
            if let Some(n) = want_nice {
                assert_eq!(nice, n, "{sched:?}");
            }
        }
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
