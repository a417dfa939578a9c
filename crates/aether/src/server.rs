//! Request dispatch and the state shared by all request threads.

use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};

use dsec_wire::aether::{AetherErrorKind, Reply, Request};

use crate::channel::Writer;
use crate::reaper::Reaper;
use crate::users::User;
use crate::{chronus, exec, files, handles, procs, stats, sys, tty, watch};

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Stack size of request threads: enough for our code, small for density.
pub const THREAD_STACK: usize = 256 * 1024;

/// Locks a mutex, ignoring poisoning (a panicked request thread must not wedge the others).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Spare request threads started with the server.
pub const SPARE_THREADS: usize = 2;
/// What a request thread runs.
pub type Job = Box<dyn FnOnce() + Send + 'static>;
/// The answer when neither a new thread nor a spare can take a request.
pub const BUSY_MESSAGE: &str = "the sandbox is at its process limit; kill processes or retry";

/// Threads started at boot that take a request when no new thread can be started (EAGAIN:
/// the pids limit is exhausted by a fork bomb). Each goes back to waiting after its job.
pub struct Spares {
    tx: Mutex<mpsc::Sender<Job>>,
    idle: Arc<AtomicUsize>,
}

impl Spares {
    /// Starts up to `n` spare threads (fewer if threads cannot be started).
    pub fn start(n: usize) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let idle = Arc::new(AtomicUsize::new(0));
        for _ in 0..n {
            let (rx, idle2) = (rx.clone(), idle.clone());
            let started = std::thread::Builder::new()
                .name("spare".into())
                .stack_size(THREAD_STACK)
                .spawn(move || loop {
                    let job = lock(&rx).recv();
                    let Ok(job) = job else { return };
                    job();
                    sys::trim_heap();
                    idle2.fetch_add(1, Ordering::SeqCst);
                });
            if started.is_ok() {
                idle.fetch_add(1, Ordering::SeqCst);
            }
        }
        Spares {
            tx: Mutex::new(tx),
            idle,
        }
    }

    /// Hands `job` to an idle spare; gives it back when none is idle.
    pub fn run(&self, job: Job) -> Result<(), Job> {
        let claimed = self
            .idle
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if claimed.is_err() {
            return Err(job);
        }
        lock(&self.tx).send(job).map_err(|e| {
            self.idle.fetch_add(1, Ordering::SeqCst);
            e.0
        })
    }

    #[cfg(test)]
    pub fn idle(&self) -> usize {
        self.idle.load(Ordering::SeqCst)
    }
}

/// Runs `job` on a thread made by `spawn`, or on a spare when that fails. On failure returns
/// the error of `spawn` (the job is dropped).
pub fn start_job(
    spares: &Spares,
    job: Job,
    spawn: impl FnOnce(Job) -> std::io::Result<()>,
) -> Result<(), std::io::Error> {
    // `spawn` consumes its closure even when it fails: keep the job in a slot we can take back.
    let slot = Arc::new(Mutex::new(Some(job)));
    let theirs = slot.clone();
    let err = match spawn(Box::new(move || {
        if let Some(job) = lock(&theirs).take() {
            job();
        }
    })) {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    let Some(job) = lock(&slot).take() else {
        return Ok(());
    };
    match spares.run(job) {
        Ok(()) => Ok(()),
        Err(_) => Err(err),
    }
}

/// Starts a request thread (small stack).
fn spawn_thread(job: Job) -> std::io::Result<()> {
    std::thread::Builder::new()
        .stack_size(THREAD_STACK)
        .spawn(job)
        .map(drop)
}

/// Lets `Cancel{target}` interrupt a running request.
pub struct Cancel {
    pub fired: AtomicBool,
    pub efd: OwnedFd,
}

impl Cancel {
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.efd.as_raw_fd()
    }
}

/// Removes a request's cancel handle when the request ends.
pub struct CancelGuard<'a> {
    srv: &'a Server,
    id: u64,
    pub cancel: Arc<Cancel>,
}

impl Drop for CancelGuard<'_> {
    fn drop(&mut self) {
        lock(&self.srv.cancels).remove(&self.id);
    }
}

pub struct Server {
    pub w: Writer,
    pub reaper: Arc<Reaper>,
    /// The sandbox user.
    pub user: User,
    /// `setup.env`: given to every command.
    pub base_env: BTreeMap<String, String>,
    pub hostname: Mutex<String>,
    /// Root-only (0711) dir for per-call command files (exists from the start).
    pub run_dir: PathBuf,
    /// Root-only (0711) dir for per-call stdin files, made on first use (see
    /// [`Server::input_dir`]); the same as `run_dir` in bare mode.
    input_dir: PathBuf,
    input_dir_made: Mutex<bool>,
    /// PID 1 of a container's pid namespace (kill(-1) kills the sandbox).
    pub pid1: bool,
    pub sessions: Mutex<HashMap<String, Arc<chronus::Session>>>,
    pub cancels: Mutex<HashMap<u64, Arc<Cancel>>>,
    pub uploads: Mutex<HashMap<u64, files::Upload>>,
    pub ttys: Mutex<HashMap<u64, Arc<tty::Tty>>>,
    /// Process handles (`ProcStart`).
    pub handles: handles::Handles,
    /// Request threads of last resort.
    pub spares: Spares,
}

impl Server {
    pub fn new(
        w: Writer,
        reaper: Arc<Reaper>,
        user: User,
        base_env: BTreeMap<String, String>,
        run_dir: PathBuf,
        input_dir: PathBuf,
        pid1: bool,
    ) -> Self {
        // Commands join the user cgroup the runtime passed (container mode only: in bare mode
        // fd 5 belongs to whoever started us).
        if pid1 && !sys::adopt_user_cgroup_fd() {
            eprintln!("dsec-aether: no user cgroup on fd 5; commands stay in aether's cgroup");
        }
        Server {
            w,
            reaper,
            user,
            base_env,
            hostname: Mutex::new(sys::hostname()),
            input_dir_made: Mutex::new(input_dir == run_dir),
            run_dir,
            input_dir,
            pid1,
            sessions: Mutex::new(HashMap::new()),
            cancels: Mutex::new(HashMap::new()),
            uploads: Mutex::new(HashMap::new()),
            ttys: Mutex::new(HashMap::new()),
            handles: handles::Handles::default(),
            spares: Spares::start(SPARE_THREADS),
        }
    }

    /// Runs `job` on its own thread (or a spare one); answers `id` with an error if neither
    /// can be had. Returns whether the job was started.
    pub fn run_request(&self, id: u64, job: Job) -> bool {
        match start_job(&self.spares, job, spawn_thread) {
            Ok(()) => true,
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {
                self.w.error(
                    id,
                    AetherErrorKind::Busy,
                    format!("{BUSY_MESSAGE} (start a thread for request {id}: {e})"),
                );
                false
            }
            Err(e) => {
                self.w.error(
                    id,
                    AetherErrorKind::Internal,
                    format!("start a thread for request {id}: {e}"),
                );
                false
            }
        }
    }

    /// Registers a cancellable request.
    pub fn cancellable(&self, id: u64) -> std::io::Result<CancelGuard<'_>> {
        let cancel = Arc::new(Cancel {
            fired: AtomicBool::new(false),
            efd: sys::eventfd()?,
        });
        lock(&self.cancels).insert(id, cancel.clone());
        Ok(CancelGuard {
            srv: self,
            id,
            cancel,
        })
    }

    /// Cancels every running request and drops unfinished uploads (after a reattach).
    pub fn cancel_all(&self) {
        for c in lock(&self.cancels).values() {
            c.fired.store(true, Ordering::SeqCst);
            sys::eventfd_signal(c.fd());
        }
        lock(&self.uploads).clear();
    }

    /// Credentials for a child running as `user`; None when no switch is needed or possible.
    pub fn creds_for(&self, user: &User) -> Option<sys::Creds> {
        // As root we always set credentials, also for root itself: setgroups() drops aether's
        // own supplementary groups (the /proc viewer group) from every command.
        if sys::geteuid() != 0 {
            return None;
        }
        Some(sys::Creds {
            uid: user.uid,
            gid: user.gid,
            groups: user.groups.clone(),
        })
    }

    /// uid/gid new files are given to (None when we cannot chown).
    pub fn owner(&self) -> Option<(u32, u32)> {
        (sys::geteuid() == 0).then_some((self.user.uid, self.user.gid))
    }

    /// The dir for per-call stdin files, made (0711) by the first call that needs it.
    pub fn input_dir(&self) -> std::io::Result<&Path> {
        let mut made = lock(&self.input_dir_made);
        if !*made {
            if let Some(parent) = self.input_dir.parent() {
                let _ = std::fs::create_dir_all(parent);
            }
            crate::make_call_dir(&self.input_dir, true)?;
            *made = true;
        }
        Ok(&self.input_dir)
    }

    /// The environment of a command run as `user`: defaults, then `setup.env`, then `extra`.
    pub fn env_map(
        &self,
        user: &User,
        extra: &BTreeMap<String, String>,
        tty: bool,
    ) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        env.insert("PATH".to_string(), DEFAULT_PATH.to_string());
        env.insert("HOSTNAME".to_string(), lock(&self.hostname).clone());
        if tty {
            env.insert("TERM".to_string(), "xterm".to_string());
        }
        for (k, v) in &self.base_env {
            env.insert(k.clone(), v.clone());
        }
        // HOME/USER describe whoever runs the command, unless the image's env pins them for the
        // sandbox user.
        if user.uid != self.user.uid || !self.base_env.contains_key("HOME") {
            env.insert("HOME".to_string(), user.home.clone());
        }
        if user.uid != self.user.uid || !self.base_env.contains_key("USER") {
            env.insert("USER".to_string(), user.name.clone());
            env.insert("LOGNAME".to_string(), user.name.clone());
        }
        for (k, v) in extra {
            env.insert(k.clone(), v.clone());
        }
        env
    }

    pub fn env_vec(env: &BTreeMap<String, String>) -> Vec<CString> {
        env.iter()
            .filter(|(k, _)| !k.is_empty() && !k.contains('='))
            .filter_map(|(k, v)| CString::new(format!("{k}={v}")).ok())
            .collect()
    }

    /// Resolves a request path: relative paths are relative to the sandbox user's home.
    pub fn resolve_path(&self, p: &str) -> PathBuf {
        let path = Path::new(p);
        if path.is_absolute() {
            path.to_path_buf()
        } else {
            Path::new(&self.user.home).join(path)
        }
    }

    /// The cwd a command starts in: the given one (relative to home) or home, or / when home
    /// does not exist.
    pub fn start_dir(&self, user: &User, cwd: Option<&str>) -> PathBuf {
        match cwd {
            Some(c) if Path::new(c).is_absolute() => PathBuf::from(c),
            Some(c) => Path::new(&user.home).join(c),
            None if Path::new(&user.home).is_dir() => PathBuf::from(&user.home),
            None => PathBuf::from("/"),
        }
    }

    /// Kills every process aether started (PID 1: the whole pid namespace).
    pub fn kill_everything(&self) {
        if self.pid1 && sys::getpid() == 1 {
            // kill(-1) from PID 1 of a pid namespace signals every other process in it.
            sys::kill(-1, libc::SIGKILL);
            return;
        }
        let leaders: Vec<i32> = lock(&self.sessions).values().map(|s| s.leader()).collect();
        for l in leaders {
            procs::kill_session(l);
        }
        let me = sys::getpid();
        for _ in 0..3 {
            let all = procs::scan();
            let desc = procs::descendants(&all, me);
            let victims: Vec<procs::Proc> = all
                .iter()
                .filter(|p| desc.contains(&p.pid))
                .copied()
                .collect();
            if victims.is_empty() {
                break;
            }
            procs::kill_procs(&victims, 0);
        }
    }

    /// Handles one request. Quick ones run inline on the reader thread; anything that can
    /// block runs on its own thread.
    pub fn dispatch(self: &Arc<Self>, id: u64, req: Request, body: Vec<u8>) {
        match req {
            Request::Setup(_) => {
                self.w
                    .error(id, AetherErrorKind::BadRequest, "setup was already done");
            }
            Request::Ping => {
                let sessions = lock(&self.sessions).len() as u32;
                let all = procs::scan();
                let processes = procs::descendants(&all, sys::getpid()).len() as u32;
                self.w.send(
                    id,
                    Reply::Pong {
                        sessions,
                        processes,
                    },
                    &[],
                );
            }
            Request::Cancel { target } => {
                if let Some(c) = lock(&self.cancels).get(&target) {
                    c.fired.store(true, Ordering::SeqCst);
                    sys::eventfd_signal(c.fd());
                }
                self.w.send(id, Reply::Done, &[]);
            }
            Request::WriteBegin {
                path,
                mode,
                make_parents,
            } => files::write_begin(self, id, &path, mode, make_parents),
            Request::WriteChunk => files::write_chunk(self, id, &body),
            Request::WriteEnd => files::write_end(self, id),
            Request::TtyInput { target } => tty::input(self, id, target, body),
            Request::TtyResize { target, rows, cols } => tty::resize(self, id, target, rows, cols),
            Request::CloseSession { session } => {
                chronus::close(self, &session);
                self.w.send(id, Reply::Done, &[]);
            }
            Request::TtyOpen {
                rows,
                cols,
                cmd,
                env,
            } => {
                let Some(slave) = tty::prepare(self, id, rows, cols) else {
                    return;
                };
                let srv = self.clone();
                if !self.run_request(id, Box::new(move || tty::open(&srv, id, slave, cmd, env))) {
                    lock(&self.ttys).remove(&id);
                }
            }
            Request::SetIdentity {
                hostname,
                unix_secs,
                unix_nanos,
            } => {
                // A container's aether shares the host's clock: only a VM guest's aether
                // (bare mode and PID 1 of its own kernel) may set the clock and hostname.
                if self.pid1 || sys::getpid() != 1 {
                    self.w.error(
                        id,
                        AetherErrorKind::BadRequest,
                        "set_identity is for a VM guest's aether only",
                    );
                    return;
                }
                match sys::set_identity(&hostname, unix_secs, unix_nanos, &body) {
                    Ok(()) => {
                        *lock(&self.hostname) = hostname;
                        self.w.send(id, Reply::Done, &[]);
                    }
                    Err(e) => {
                        self.w.error(id, AetherErrorKind::Internal, e);
                    }
                }
            }
            Request::ProcSignal { pid, signal, group } => {
                handles::signal(self, id, pid, signal, group)
            }
            Request::ProcList { all } => handles::list(self, id, all),
            Request::Stats => {
                self.w.send(id, Reply::Stats(stats::collect()), &[]);
            }
            Request::Shutdown => {
                self.kill_everything();
                self.w.send(id, Reply::Done, &[]);
                crate::exit(0);
            }
            other => {
                let srv = self.clone();
                self.run_request(
                    id,
                    Box::new(move || {
                        srv.handle_slow(id, other, body);
                        sys::trim_heap();
                    }),
                );
            }
        }
    }

    fn handle_slow(self: &Arc<Self>, id: u64, req: Request, body: Vec<u8>) {
        match req {
            Request::RunShell {
                session,
                cmd,
                timeout_ms,
                env,
                cwd,
                max_output,
                stream,
            } => chronus::run(
                self,
                id,
                chronus::RunArgs {
                    session,
                    cmd,
                    timeout_ms,
                    env,
                    cwd,
                    max_output,
                    stream,
                },
                body,
            ),
            Request::Exec {
                argv,
                timeout_ms,
                env,
                cwd,
                user,
                max_output,
                stream,
            } => exec::run(
                self,
                id,
                exec::ExecArgs {
                    argv,
                    timeout_ms,
                    env,
                    cwd,
                    user,
                    max_output,
                    stream,
                },
                body,
            ),
            Request::ProcStart {
                argv,
                env,
                cwd,
                user,
                tag,
                stdin,
                buffer_bytes,
            } => handles::start(
                self,
                id,
                handles::StartArgs {
                    argv,
                    env,
                    cwd,
                    user,
                    tag,
                    stdin,
                    buffer_bytes,
                },
            ),
            Request::ProcRead {
                pid,
                offset,
                follow,
            } => handles::read(self, id, pid, offset, follow),
            Request::ProcInput { pid, close } => handles::input(self, id, pid, close, body),
            Request::ProcWait { pid, timeout_ms } => handles::wait(self, id, pid, timeout_ms),
            Request::Rename {
                src,
                dst,
                overwrite,
            } => files::rename(self, id, &src, &dst, overwrite),
            Request::Watch { path, recursive } => watch::run(self, id, &path, recursive),
            Request::ReadFile { path } => files::read_file(self, id, &path),
            Request::ListDir { path } => files::list_dir(self, id, &path),
            Request::Stat { path } => files::stat(self, id, &path),
            Request::Remove { path, recursive } => files::remove(self, id, &path, recursive),
            Request::Mkdir {
                path,
                mode,
                parents,
            } => files::mkdir(self, id, &path, mode, parents),
            _ => {
                self.w
                    .error(id, AetherErrorKind::BadRequest, "unexpected request");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn eagain() -> std::io::Error {
        std::io::Error::from_raw_os_error(libc::EAGAIN)
    }

    fn wait_for(mut f: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        false
    }

    #[test]
    fn jobs_run_on_new_threads_when_possible() {
        let spares = Spares::start(1);
        let (tx, rx) = mpsc::channel();
        start_job(&spares, Box::new(move || tx.send(7).unwrap()), spawn_thread).unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 7);
        assert!(wait_for(|| spares.idle() == 1));
    }

    #[test]
    fn spares_take_jobs_when_threads_cannot_start() {
        let spares = Spares::start(2);
        assert!(wait_for(|| spares.idle() == 2));
        // Two long jobs occupy both spares (the spawner always fails with EAGAIN).
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let release_rx = Arc::new(Mutex::new(release_rx));
        let (ran_tx, ran_rx) = mpsc::channel();
        for i in 0..2 {
            let (r, t) = (release_rx.clone(), ran_tx.clone());
            let job: Job = Box::new(move || {
                t.send(i).unwrap();
                let _ = lock(&r).recv();
            });
            start_job(&spares, job, |_| Err(eagain())).unwrap();
        }
        let mut got = vec![
            ran_rx.recv_timeout(Duration::from_secs(5)).unwrap(),
            ran_rx.recv_timeout(Duration::from_secs(5)).unwrap(),
        ];
        got.sort();
        assert_eq!(got, vec![0, 1]);
        assert_eq!(spares.idle(), 0);
        // A third is refused with the spawner's error.
        let err = start_job(&spares, Box::new(|| {}), |_| Err(eagain())).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EAGAIN));
        // Released, the spares are idle again and take more work.
        release_tx.send(()).unwrap();
        release_tx.send(()).unwrap();
        assert!(wait_for(|| spares.idle() == 2));
        let (tx, rx) = mpsc::channel();
        start_job(&spares, Box::new(move || tx.send(9).unwrap()), |_| {
            Err(eagain())
        })
        .unwrap();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), 9);
    }
}
