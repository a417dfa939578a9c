//! The seccomp filter every process in a container runs under (aether installs it on itself;
//! commands inherit it).
//!
//! An allowlist modelled on Docker's default profile, stricter where it matters: every syscall
//! not listed fails with `EPERM`. Argument filters: `clone` may not create namespaces,
//! `personality` only takes the harmless personas, `socket` may not open `AF_VSOCK` (vsock
//! ignores network namespaces), `ioctl` may not inject terminal input (`TIOCSTI`, `TIOCLINUX`).
//! A second filter turns `clone3` into `ENOSYS` (its flags live in memory, out of reach of BPF),
//! so libc falls back to `clone`. The allowlist is installed as [`compact_allowlist`]'s binary
//! search; [`allowlist`] (seccompiler's linear program) is its reference in the tests and the
//! fallback on architectures without a compact form.
//!
//! Deliberately absent (so denied): mount, umount2, pivot_root, chroot is allowed (CAP_SYS_CHROOT),
//! unshare, setns, ptrace, process_vm_readv/writev, pidfd_getfd, kexec_*, init_module,
//! finit_module, delete_module, bpf, perf_event_open, keyctl, add_key, request_key,
//! userfaultfd, open_by_handle_at, name_to_handle_at, syslog, reboot, swapon, swapoff, acct,
//! settimeofday, clock_settime, clock_adjtime, adjtimex, iopl, ioperm, quotactl, quotactl_fd,
//! fsopen, fsconfig, fsmount, move_mount, open_tree, fspick, mount_setattr, kcmp,
//! lookup_dcookie, vm86, uselib, io_uring_*, fanotify_init, modify_ldt, nfsservctl.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

/// Allowed without conditions, on every architecture.
const ALLOWED: &[libc::c_long] = &[
    libc::SYS_accept,
    libc::SYS_accept4,
    libc::SYS_bind,
    libc::SYS_brk,
    libc::SYS_capget,
    libc::SYS_capset,
    libc::SYS_chdir,
    libc::SYS_chroot,
    libc::SYS_clock_getres,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_close,
    libc::SYS_close_range,
    libc::SYS_connect,
    libc::SYS_copy_file_range,
    libc::SYS_dup,
    libc::SYS_dup3,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_pwait2,
    libc::SYS_eventfd2,
    libc::SYS_execve,
    libc::SYS_execveat,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_fadvise64,
    libc::SYS_fallocate,
    libc::SYS_fanotify_mark,
    libc::SYS_fchdir,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_fchmodat2,
    libc::SYS_fchown,
    libc::SYS_fchownat,
    libc::SYS_fcntl,
    libc::SYS_fdatasync,
    libc::SYS_fgetxattr,
    libc::SYS_flistxattr,
    libc::SYS_flock,
    libc::SYS_fremovexattr,
    libc::SYS_fsetxattr,
    libc::SYS_fstat,
    libc::SYS_fstatfs,
    libc::SYS_fsync,
    libc::SYS_ftruncate,
    libc::SYS_futex,
    libc::SYS_futex_waitv,
    libc::SYS_get_mempolicy,
    libc::SYS_get_robust_list,
    libc::SYS_getcpu,
    libc::SYS_getcwd,
    libc::SYS_getdents64,
    libc::SYS_getegid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getgroups,
    libc::SYS_getitimer,
    libc::SYS_getpeername,
    libc::SYS_getpgid,
    libc::SYS_getpid,
    libc::SYS_getppid,
    libc::SYS_getpriority,
    libc::SYS_getrandom,
    libc::SYS_getresgid,
    libc::SYS_getresuid,
    libc::SYS_getrlimit,
    libc::SYS_getrusage,
    libc::SYS_getsid,
    libc::SYS_getsockname,
    libc::SYS_getsockopt,
    libc::SYS_gettid,
    libc::SYS_gettimeofday,
    libc::SYS_getuid,
    libc::SYS_getxattr,
    libc::SYS_inotify_add_watch,
    libc::SYS_inotify_init1,
    libc::SYS_inotify_rm_watch,
    libc::SYS_io_cancel,
    libc::SYS_io_destroy,
    libc::SYS_io_getevents,
    libc::SYS_io_setup,
    libc::SYS_io_submit,
    libc::SYS_ioprio_get,
    libc::SYS_ioprio_set,
    libc::SYS_kill,
    libc::SYS_landlock_add_rule,
    libc::SYS_landlock_create_ruleset,
    libc::SYS_landlock_restrict_self,
    libc::SYS_lgetxattr,
    libc::SYS_linkat,
    libc::SYS_listen,
    libc::SYS_listxattr,
    libc::SYS_llistxattr,
    libc::SYS_lremovexattr,
    libc::SYS_lseek,
    libc::SYS_lsetxattr,
    libc::SYS_madvise,
    libc::SYS_membarrier,
    libc::SYS_memfd_create,
    libc::SYS_mincore,
    libc::SYS_mkdirat,
    libc::SYS_mknodat,
    libc::SYS_mlock,
    libc::SYS_mlock2,
    libc::SYS_mlockall,
    libc::SYS_mmap,
    libc::SYS_mprotect,
    libc::SYS_mq_getsetattr,
    libc::SYS_mq_notify,
    libc::SYS_mq_open,
    libc::SYS_mq_timedreceive,
    libc::SYS_mq_timedsend,
    libc::SYS_mq_unlink,
    libc::SYS_mremap,
    libc::SYS_mseal,
    libc::SYS_msgctl,
    libc::SYS_msgget,
    libc::SYS_msgrcv,
    libc::SYS_msgsnd,
    libc::SYS_msync,
    libc::SYS_munlock,
    libc::SYS_munlockall,
    libc::SYS_munmap,
    libc::SYS_nanosleep,
    libc::SYS_newfstatat,
    libc::SYS_openat,
    libc::SYS_openat2,
    libc::SYS_pidfd_open,
    libc::SYS_pidfd_send_signal,
    libc::SYS_pipe2,
    libc::SYS_pkey_alloc,
    libc::SYS_pkey_free,
    libc::SYS_pkey_mprotect,
    libc::SYS_ppoll,
    libc::SYS_prctl,
    libc::SYS_pread64,
    libc::SYS_preadv,
    libc::SYS_preadv2,
    libc::SYS_prlimit64,
    libc::SYS_process_mrelease,
    libc::SYS_pselect6,
    libc::SYS_pwrite64,
    libc::SYS_pwritev,
    libc::SYS_pwritev2,
    libc::SYS_read,
    libc::SYS_readahead,
    libc::SYS_readlinkat,
    libc::SYS_readv,
    libc::SYS_recvfrom,
    libc::SYS_recvmmsg,
    libc::SYS_recvmsg,
    libc::SYS_remap_file_pages,
    libc::SYS_removexattr,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_restart_syscall,
    libc::SYS_rseq,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigpending,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigqueueinfo,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigsuspend,
    libc::SYS_rt_sigtimedwait,
    libc::SYS_rt_tgsigqueueinfo,
    libc::SYS_sched_get_priority_max,
    libc::SYS_sched_get_priority_min,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_getattr,
    libc::SYS_sched_getparam,
    libc::SYS_sched_getscheduler,
    libc::SYS_sched_rr_get_interval,
    libc::SYS_sched_setaffinity,
    libc::SYS_sched_setattr,
    libc::SYS_sched_setparam,
    libc::SYS_sched_setscheduler,
    libc::SYS_sched_yield,
    libc::SYS_seccomp,
    libc::SYS_semctl,
    libc::SYS_semget,
    libc::SYS_semop,
    libc::SYS_semtimedop,
    libc::SYS_sendfile,
    libc::SYS_sendmmsg,
    libc::SYS_sendmsg,
    libc::SYS_sendto,
    libc::SYS_set_robust_list,
    libc::SYS_set_tid_address,
    libc::SYS_setfsgid,
    libc::SYS_setfsuid,
    libc::SYS_setgid,
    libc::SYS_setgroups,
    libc::SYS_setitimer,
    libc::SYS_setpgid,
    libc::SYS_setpriority,
    libc::SYS_setregid,
    libc::SYS_setresgid,
    libc::SYS_setresuid,
    libc::SYS_setreuid,
    libc::SYS_setrlimit,
    libc::SYS_setsid,
    libc::SYS_setsockopt,
    libc::SYS_setuid,
    libc::SYS_setxattr,
    libc::SYS_shmat,
    libc::SYS_shmctl,
    libc::SYS_shmdt,
    libc::SYS_shmget,
    libc::SYS_shutdown,
    libc::SYS_sigaltstack,
    libc::SYS_signalfd4,
    libc::SYS_socketpair,
    libc::SYS_splice,
    libc::SYS_statfs,
    libc::SYS_statx,
    libc::SYS_symlinkat,
    libc::SYS_sync,
    libc::SYS_sync_file_range,
    libc::SYS_syncfs,
    libc::SYS_sysinfo,
    libc::SYS_tee,
    libc::SYS_tgkill,
    libc::SYS_timer_create,
    libc::SYS_timer_delete,
    libc::SYS_timer_getoverrun,
    libc::SYS_timer_gettime,
    libc::SYS_timer_settime,
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_gettime,
    libc::SYS_timerfd_settime,
    libc::SYS_times,
    libc::SYS_tkill,
    libc::SYS_truncate,
    libc::SYS_umask,
    libc::SYS_uname,
    libc::SYS_unlinkat,
    libc::SYS_utimensat,
    libc::SYS_vmsplice,
    libc::SYS_wait4,
    libc::SYS_waitid,
    libc::SYS_write,
    libc::SYS_writev,
    // Allowed here so that the second filter's ENOSYS is what callers see.
    libc::SYS_clone3,
];

/// Syscalls newer than the libc crate knows; these numbers are shared by every architecture.
const ALLOWED_NEW: &[libc::c_long] = &[
    451, // cachestat
    453, // map_shadow_stack
    454, // futex_wake
    455, // futex_wait
    456, // futex_requeue
    457, // statmount
    458, // listmount
    463, // setxattrat
    464, // getxattrat
    465, // listxattrat
    466, // removexattrat
];

/// Legacy syscalls that exist only on x86_64 (other 64-bit ABIs have only the *at forms).
#[cfg(target_arch = "x86_64")]
const ALLOWED_ARCH: &[libc::c_long] = &[
    libc::SYS_access,
    libc::SYS_alarm,
    libc::SYS_arch_prctl,
    libc::SYS_chmod,
    libc::SYS_chown,
    libc::SYS_creat,
    libc::SYS_dup2,
    libc::SYS_epoll_create,
    libc::SYS_epoll_wait,
    libc::SYS_eventfd,
    libc::SYS_fork,
    libc::SYS_futimesat,
    libc::SYS_getdents,
    libc::SYS_getpgrp,
    libc::SYS_inotify_init,
    libc::SYS_lchown,
    libc::SYS_link,
    libc::SYS_lstat,
    libc::SYS_mkdir,
    libc::SYS_mknod,
    libc::SYS_open,
    libc::SYS_pause,
    libc::SYS_pipe,
    libc::SYS_poll,
    libc::SYS_readlink,
    libc::SYS_rename,
    libc::SYS_rmdir,
    libc::SYS_select,
    libc::SYS_signalfd,
    libc::SYS_stat,
    libc::SYS_symlink,
    libc::SYS_time,
    libc::SYS_unlink,
    libc::SYS_utime,
    libc::SYS_utimes,
    libc::SYS_vfork,
    333, // io_pgetevents
];
#[cfg(not(target_arch = "x86_64"))]
const ALLOWED_ARCH: &[libc::c_long] = &[];

/// Namespace-creating clone flags (`CLONE_NEWTIME` shares bits with the exit signal in
/// `clone`, so it is only reachable through clone3/unshare, which are denied).
pub const CLONE_NS_FLAGS: u64 = (libc::CLONE_NEWNS
    | libc::CLONE_NEWCGROUP
    | libc::CLONE_NEWUTS
    | libc::CLONE_NEWIPC
    | libc::CLONE_NEWUSER
    | libc::CLONE_NEWPID
    | libc::CLONE_NEWNET) as u64;

/// Personas `personality(2)` may set (plus the 0xffffffff query).
const PERSONAS: &[u64] = &[0x0, 0x0008, 0x20000, 0x20008, 0xffff_ffff];

const AF_VSOCK: u64 = 40;
const TIOCSTI: u64 = 0x5412;
const TIOCLINUX: u64 = 0x541C;

/// Why the filter could not be built or installed.
#[derive(Debug)]
pub struct SeccompError(pub String);

impl std::fmt::Display for SeccompError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn err(what: &str, e: impl std::fmt::Display) -> SeccompError {
    SeccompError(format!("{what}: {e}"))
}

fn cond(
    arg: u8,
    len: SeccompCmpArgLen,
    op: SeccompCmpOp,
    value: u64,
) -> Result<SeccompCondition, SeccompError> {
    SeccompCondition::new(arg, len, op, value).map_err(|e| err("seccomp condition", e))
}

fn rule(conds: Vec<SeccompCondition>) -> Result<SeccompRule, SeccompError> {
    SeccompRule::new(conds).map_err(|e| err("seccomp rule", e))
}

fn arch() -> Result<seccompiler::TargetArch, SeccompError> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|e| err("seccomp architecture", e))
}

/// The allowlist filter (EPERM for everything not allowed).
pub fn allowlist() -> Result<BpfProgram, SeccompError> {
    use SeccompCmpArgLen::{Dword, Qword};
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in ALLOWED.iter().chain(ALLOWED_NEW).chain(ALLOWED_ARCH) {
        rules.insert(*nr, Vec::new());
    }
    // clone: no namespace flags.
    rules.insert(
        libc::SYS_clone,
        vec![rule(vec![cond(
            0,
            Qword,
            SeccompCmpOp::MaskedEq(CLONE_NS_FLAGS),
            0,
        )?])?],
    );
    // personality: only the harmless personas.
    rules.insert(
        libc::SYS_personality,
        PERSONAS
            .iter()
            .map(|p| rule(vec![cond(0, Dword, SeccompCmpOp::Eq, *p)?]))
            .collect::<Result<_, _>>()?,
    );
    // socket: anything but vsock.
    rules.insert(
        libc::SYS_socket,
        vec![rule(vec![cond(0, Dword, SeccompCmpOp::Ne, AF_VSOCK)?])?],
    );
    // ioctl: no terminal input injection.
    rules.insert(
        libc::SYS_ioctl,
        vec![rule(vec![
            cond(1, Dword, SeccompCmpOp::Ne, TIOCSTI)?,
            cond(1, Dword, SeccompCmpOp::Ne, TIOCLINUX)?,
        ])?],
    );
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Errno(libc::EPERM as u32),
        SeccompAction::Allow,
        arch()?,
    )
    .map_err(|e| err("build seccomp filter", e))?;
    filter
        .try_into()
        .map_err(|e| err("compile seccomp filter", e))
}

/// What the allowlist decides for a range of syscall numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Allow,
    Deny,
    Clone,
    Personality,
    Socket,
    Ioctl,
}

// Classic BPF opcodes (linux/bpf_common.h) and seccomp return values (linux/seccomp.h).
/// BPF_LD | BPF_W | BPF_ABS.
const LD_W_ABS: u16 = 0x20;
/// BPF_JMP | BPF_JA.
const JMP_JA: u16 = 0x05;
/// BPF_JMP | BPF_JEQ | BPF_K.
const JMP_JEQ_K: u16 = 0x15;
/// BPF_JMP | BPF_JGE | BPF_K.
const JMP_JGE_K: u16 = 0x35;
/// BPF_JMP | BPF_JSET | BPF_K.
const JMP_JSET_K: u16 = 0x45;
/// BPF_RET | BPF_K.
const RET_K: u16 = 0x06;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;
const RET_ALLOW: u32 = 0x7fff_0000;
/// Offsets in `struct seccomp_data`: nr, arch, args[0] and args[1] (low words, little endian).
const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
const OFF_ARG0: u32 = 16;
const OFF_ARG1: u32 = 24;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: Option<u32> = Some(0xC000_003E);
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: Option<u32> = Some(0xC000_00B7);
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const AUDIT_ARCH: Option<u32> = None;

fn stmt(code: u16, k: u32) -> seccompiler::sock_filter {
    seccompiler::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> seccompiler::sock_filter {
    seccompiler::sock_filter { code, jt, jf, k }
}

/// The syscall-number line cut into maximal runs of one verdict: `(first number, verdict)`,
/// starting at 0; each run ends where the next begins (the last one at 2^32).
fn runs() -> Vec<(u32, Verdict)> {
    let mut special: BTreeMap<u32, Verdict> = BTreeMap::new();
    for nr in ALLOWED.iter().chain(ALLOWED_NEW).chain(ALLOWED_ARCH) {
        special.insert(*nr as u32, Verdict::Allow);
    }
    special.insert(libc::SYS_clone as u32, Verdict::Clone);
    special.insert(libc::SYS_personality as u32, Verdict::Personality);
    special.insert(libc::SYS_socket as u32, Verdict::Socket);
    special.insert(libc::SYS_ioctl as u32, Verdict::Ioctl);
    let mut out: Vec<(u32, Verdict)> = vec![(0, Verdict::Deny)];
    let push = |start: u32, v: Verdict, out: &mut Vec<(u32, Verdict)>| {
        match out.last_mut() {
            Some(last) if last.1 == v => {}
            Some(last) if last.0 == start => last.1 = v,
            _ => out.push((start, v)),
        }
        // Merge with the run before if the overwrite made them equal.
        let n = out.len();
        if n >= 2 && out[n - 2].1 == out[n - 1].1 {
            out.pop();
        }
    };
    for (&nr, &v) in &special {
        push(nr, v, &mut out);
        if let Some(next) = nr.checked_add(1) {
            if !special.contains_key(&next) {
                push(next, Verdict::Deny, &mut out);
            }
        }
    }
    out
}

/// Where an emitted jump goes before the program is laid out.
#[derive(Clone, Copy)]
enum Target {
    Verdict(Verdict),
    Index(usize),
}

/// The allowlist as a compact program: the same decisions as [`allowlist`] (a test checks every
/// syscall number and the argument cases), but a binary search over runs of syscall numbers
/// (≈ 2 × log2(runs) instructions per syscall) instead of seccompiler's linear chain of several
/// hundred instructions — which the kernel must also check, convert and JIT on every sandbox
/// start. `None` on an architecture without a known audit value.
pub fn compact_allowlist() -> Option<BpfProgram> {
    let arch = AUDIT_ARCH?;
    let runs = runs();
    // Body: the search tree, with symbolic targets.
    let mut body: Vec<(seccompiler::sock_filter, Option<Target>)> = Vec::new();
    fn tree(runs: &[(u32, Verdict)], body: &mut Vec<(seccompiler::sock_filter, Option<Target>)>) {
        if runs.len() == 1 {
            body.push((stmt(JMP_JA, 0), Some(Target::Verdict(runs[0].1))));
            return;
        }
        let mid = runs.len() / 2;
        // A >= first number of the right half: take the long jump to it; else the left half.
        body.push((jump(JMP_JGE_K, runs[mid].0, 0, 1), None));
        let ja = body.len();
        body.push((stmt(JMP_JA, 0), None));
        tree(&runs[..mid], body);
        let right = body.len();
        body[ja].1 = Some(Target::Index(right));
        tree(&runs[mid..], body);
    }
    tree(&runs, &mut body);
    let mut prog = vec![
        stmt(LD_W_ABS, OFF_ARCH),
        jump(JMP_JEQ_K, arch, 1, 0),
        stmt(RET_K, RET_KILL_PROCESS),
        stmt(LD_W_ABS, OFF_NR),
    ];
    let base = prog.len();
    let tail_start = base + body.len();
    // Tail: the verdict blocks, in this order (cBPF jumps only forward: each block returns).
    let allow = tail_start;
    let deny = allow + 1;
    let clone = deny + 1; // ld arg0; jset ns flags; ret deny; ret allow
    let personality = clone + 4; // ld arg0; jeq each persona -> ret allow; ret deny; ret allow
    let socket = personality + 1 + PERSONAS.len() + 2; // ld arg0; jeq vsock; ret deny; ret allow
    let ioctl = socket + 4; // ld arg1; jeq TIOCSTI; jeq TIOCLINUX; ret deny; ret allow
    let at = |v: Verdict| match v {
        Verdict::Allow => allow,
        Verdict::Deny => deny,
        Verdict::Clone => clone,
        Verdict::Personality => personality,
        Verdict::Socket => socket,
        Verdict::Ioctl => ioctl,
    };
    for (i, (mut ins, target)) in body.into_iter().enumerate() {
        if let Some(t) = target {
            let to = match t {
                Target::Verdict(v) => at(v),
                Target::Index(j) => base + j,
            };
            ins.k = (to - (base + i + 1)) as u32;
        }
        prog.push(ins);
    }
    debug_assert_eq!(prog.len(), allow);
    prog.push(stmt(RET_K, RET_ALLOW));
    prog.push(stmt(RET_K, RET_ERRNO | libc::EPERM as u32));
    let deny_ret = stmt(RET_K, RET_ERRNO | libc::EPERM as u32);
    let allow_ret = stmt(RET_K, RET_ALLOW);
    // clone: no namespace flag (all of them are in the low word).
    debug_assert_eq!(prog.len(), clone);
    prog.push(stmt(LD_W_ABS, OFF_ARG0));
    prog.push(jump(JMP_JSET_K, CLONE_NS_FLAGS as u32, 0, 1));
    prog.push(deny_ret.clone());
    prog.push(allow_ret.clone());
    // personality: one of the personas.
    debug_assert_eq!(prog.len(), personality);
    prog.push(stmt(LD_W_ABS, OFF_ARG0));
    let n = PERSONAS.len();
    for (i, p) in PERSONAS.iter().enumerate() {
        prog.push(jump(JMP_JEQ_K, *p as u32, (n - i) as u8, 0));
    }
    prog.push(deny_ret.clone());
    prog.push(allow_ret.clone());
    // socket: anything but vsock.
    debug_assert_eq!(prog.len(), socket);
    prog.push(stmt(LD_W_ABS, OFF_ARG0));
    prog.push(jump(JMP_JEQ_K, AF_VSOCK as u32, 0, 1));
    prog.push(deny_ret.clone());
    prog.push(allow_ret.clone());
    // ioctl: no terminal input injection.
    debug_assert_eq!(prog.len(), ioctl);
    prog.push(stmt(LD_W_ABS, OFF_ARG1));
    prog.push(jump(JMP_JEQ_K, TIOCSTI as u32, 1, 0));
    prog.push(jump(JMP_JEQ_K, TIOCLINUX as u32, 0, 1));
    prog.push(deny_ret);
    prog.push(allow_ret);
    Some(prog)
}

/// The second filter: `clone3` fails with ENOSYS, everything else passes on to the allowlist.
pub fn clone3_enosys() -> Result<BpfProgram, SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    rules.insert(libc::SYS_clone3, Vec::new());
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch()?,
    )
    .map_err(|e| err("build clone3 filter", e))?;
    filter
        .try_into()
        .map_err(|e| err("compile clone3 filter", e))
}

/// Both compiled filters.
pub struct Filters {
    allow: BpfProgram,
    clone3: BpfProgram,
}

impl Filters {
    pub fn build() -> Result<Self, SeccompError> {
        Ok(Filters {
            allow: match compact_allowlist() {
                Some(p) => p,
                None => allowlist()?,
            },
            clone3: clone3_enosys()?,
        })
    }

    /// Installs both filters on every thread of the calling process (sets no_new_privs first).
    /// Allocation-free on success.
    pub fn install(&self) -> Result<(), SeccompError> {
        seccompiler::apply_filter_all_threads(&self.allow)
            .map_err(|e| err("install seccomp allowlist", e))?;
        seccompiler::apply_filter_all_threads(&self.clone3)
            .map_err(|e| err("install clone3 filter", e))
    }
}

/// Builds and installs both filters.
pub fn install() -> Result<(), SeccompError> {
    Filters::build()?.install()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn denied_syscalls_are_not_listed() {
        let all: Vec<libc::c_long> = ALLOWED
            .iter()
            .chain(ALLOWED_NEW)
            .chain(ALLOWED_ARCH)
            .copied()
            .collect();
        let mut denied = vec![
            libc::SYS_mount,
            libc::SYS_umount2,
            libc::SYS_pivot_root,
            libc::SYS_unshare,
            libc::SYS_setns,
            libc::SYS_ptrace,
            libc::SYS_process_vm_readv,
            libc::SYS_process_vm_writev,
            libc::SYS_pidfd_getfd,
            libc::SYS_kexec_load,
            libc::SYS_kexec_file_load,
            libc::SYS_init_module,
            libc::SYS_finit_module,
            libc::SYS_delete_module,
            libc::SYS_bpf,
            libc::SYS_perf_event_open,
            libc::SYS_keyctl,
            libc::SYS_add_key,
            libc::SYS_request_key,
            libc::SYS_userfaultfd,
            libc::SYS_open_by_handle_at,
            libc::SYS_name_to_handle_at,
            libc::SYS_syslog,
            libc::SYS_reboot,
            libc::SYS_swapon,
            libc::SYS_swapoff,
            libc::SYS_acct,
            libc::SYS_settimeofday,
            libc::SYS_clock_settime,
            libc::SYS_clock_adjtime,
            libc::SYS_adjtimex,
            libc::SYS_quotactl,
            libc::SYS_fsopen,
            libc::SYS_fsconfig,
            libc::SYS_fsmount,
            libc::SYS_move_mount,
            libc::SYS_open_tree,
            libc::SYS_fspick,
            libc::SYS_mount_setattr,
            libc::SYS_kcmp,
            libc::SYS_io_uring_setup,
            libc::SYS_fanotify_init,
            libc::SYS_personality,
            libc::SYS_clone,
        ];
        #[cfg(target_arch = "x86_64")]
        denied.extend([
            libc::SYS_iopl,
            libc::SYS_ioperm,
            libc::SYS_lookup_dcookie,
            libc::SYS_uselib,
            libc::SYS_modify_ldt,
        ]);
        for nr in denied {
            assert!(
                !all.contains(&nr),
                "syscall {nr} must not be unconditionally allowed"
            );
        }
    }

    /// A classic-BPF interpreter for the opcodes seccompiler and [`compact_allowlist`] emit.
    fn run(prog: &[seccompiler::sock_filter], data: &[u8; 64]) -> u32 {
        let word = |off: u32| {
            let o = off as usize;
            u32::from_le_bytes([data[o], data[o + 1], data[o + 2], data[o + 3]])
        };
        let (mut a, mut pc) = (0u32, 0usize);
        loop {
            let i = &prog[pc];
            pc += 1;
            match i.code {
                0x20 => a = word(i.k),
                0x54 => a &= i.k,
                0x05 => pc += i.k as usize,
                0x15 | 0x25 | 0x35 | 0x45 => {
                    let t = match i.code {
                        0x15 => a == i.k,
                        0x25 => a > i.k,
                        0x35 => a >= i.k,
                        _ => a & i.k != 0,
                    };
                    pc += if t { i.jt } else { i.jf } as usize;
                }
                0x06 => return i.k,
                other => panic!("opcode {other:#x} not interpreted"),
            }
        }
    }

    fn data(arch: u32, nr: u32, arg0: u64, arg1: u64) -> [u8; 64] {
        let mut d = [0u8; 64];
        d[0..4].copy_from_slice(&nr.to_le_bytes());
        d[4..8].copy_from_slice(&arch.to_le_bytes());
        d[16..24].copy_from_slice(&arg0.to_le_bytes());
        d[24..32].copy_from_slice(&arg1.to_le_bytes());
        d
    }

    #[test]
    fn compact_allowlist_decides_like_seccompiler() {
        let Some(compact) = compact_allowlist() else {
            println!("skipped: no compact filter on this architecture");
            return;
        };
        let reference = allowlist().unwrap();
        println!(
            "allowlist: seccompiler {} instructions, compact {}",
            reference.len(),
            compact.len()
        );
        assert!(compact.len() * 2 < reference.len());
        let arch = AUDIT_ARCH.unwrap();
        let args: Vec<u64> = [
            0,
            1,
            0x11,
            libc::SIGCHLD as u64,
            AF_VSOCK,
            AF_VSOCK + 1,
            TIOCSTI,
            TIOCLINUX,
            0x5413,
            0xffff_ffff,
            (AF_VSOCK << 32) | 1,
            1 << 40,
            u64::MAX,
        ]
        .into_iter()
        .chain(PERSONAS.iter().copied())
        .chain(PERSONAS.iter().map(|p| p + 1))
        .chain((0..64).map(|b| 1u64 << b))
        .chain([CLONE_NS_FLAGS, 0x0100_0000 | 0x0020_0000 | 0x11])
        .collect();
        let mut checked = 0;
        let nrs = (0..1024u32)
            .chain((0x4000_0000..0x4000_0400).step_by(7))
            .chain([u32::MAX, u32::MAX - 1, 0x8000_0000]);
        for nr in nrs {
            let special = [
                libc::SYS_clone,
                libc::SYS_personality,
                libc::SYS_socket,
                libc::SYS_ioctl,
            ]
            .contains(&(nr as libc::c_long));
            let arg_cases: &[u64] = if special { &args } else { &[0, u64::MAX] };
            for &a0 in arg_cases {
                for &a1 in if special { &args[..] } else { &[0][..] } {
                    for ar in [arch, 0x4000_0003, 0] {
                        let d = data(ar, nr, a0, a1);
                        assert_eq!(
                            run(&compact, &d),
                            run(&reference, &d),
                            "nr {nr} arch {ar:#x} arg0 {a0:#x} arg1 {a1:#x}"
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 3000);
    }

    #[test]
    fn filters_compile() {
        assert!(allowlist().unwrap().len() > 100);
        assert!(!clone3_enosys().unwrap().is_empty());
    }
}
