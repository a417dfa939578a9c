//! The seccomp filter every process in a container runs under (aether installs it on itself;
//! commands inherit it).
//!
//! An allowlist modelled on Docker's default profile, stricter where it matters: every syscall
//! not listed fails with `EPERM`. Argument filters: `clone` may not create namespaces,
//! `personality` only takes the harmless personas, `socket` may not open `AF_VSOCK` (vsock
//! ignores network namespaces), `ioctl` may not inject terminal input (`TIOCSTI`, `TIOCLINUX`).
//! A second filter turns `clone3` into `ENOSYS` (its flags live in memory, out of reach of BPF),
//! so libc falls back to `clone`.
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
            allow: allowlist()?,
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

    #[test]
    fn filters_compile() {
        assert!(allowlist().unwrap().len() > 100);
        assert!(!clone3_enosys().unwrap().is_empty());
    }
}
