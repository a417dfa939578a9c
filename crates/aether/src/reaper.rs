//! The central zombie reaper.
//!
//! One thread calls `waitpid(-1)` for ever (aether is PID 1 of its pid namespace, or a child
//! subreaper in bare mode, so every orphan ends up here). Code that wants an exit status
//! registers the pid *while holding the reaper's lock across fork*, so the reaper can never reap
//! a child before its waiter is known; statuses of unregistered pids (orphans) are dropped.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    /// Exit code, or -1 when killed by a signal.
    pub code: i32,
    pub signal: Option<i32>,
}

impl ExitStatus {
    pub fn from_raw(status: i32) -> Self {
        if libc::WIFSIGNALED(status) {
            ExitStatus {
                code: -1,
                signal: Some(libc::WTERMSIG(status)),
            }
        } else {
            ExitStatus {
                code: libc::WEXITSTATUS(status),
                signal: None,
            }
        }
    }

    /// Shell-style code: 128+signal when killed.
    pub fn shell_code(&self) -> i32 {
        match self.signal {
            Some(s) => 128 + s,
            None => self.code,
        }
    }
}

#[derive(Default)]
struct Inner {
    /// Registered pids and, once reaped, their status.
    waiting: HashMap<i32, Option<ExitStatus>>,
    /// Bumped on every spawn so the reaper thread wakes from "no children".
    generation: u64,
}

pub struct Reaper {
    inner: Mutex<Inner>,
    cv: Condvar,
}

impl Reaper {
    /// Creates the reaper and starts its thread.
    pub fn start() -> io::Result<Arc<Reaper>> {
        let r = Arc::new(Reaper {
            inner: Mutex::new(Inner::default()),
            cv: Condvar::new(),
        });
        let r2 = r.clone();
        std::thread::Builder::new()
            .name("reaper".into())
            .stack_size(64 * 1024)
            .spawn(move || r2.run())?;
        Ok(r)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn run(&self) {
        loop {
            let gen = self.lock().generation;
            let mut status = 0;
            // SAFETY: waitpid writes the status into a valid int.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::__WALL) };
            if pid > 0 {
                let mut g = self.lock();
                if let Some(slot) = g.waiting.get_mut(&pid) {
                    *slot = Some(ExitStatus::from_raw(status));
                    self.cv.notify_all();
                }
                continue;
            }
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ECHILD) {
                // No children: sleep until someone spawns one.
                let mut g = self.lock();
                while g.generation == gen {
                    g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }

    /// Runs `fork` (which returns the child's pid in the parent) with the lock held and
    /// registers the pid before the lock is released.
    pub fn spawn_registered<F>(&self, fork: F) -> io::Result<i32>
    where
        F: FnOnce() -> io::Result<i32>,
    {
        let mut g = self.lock();
        let pid = fork()?;
        g.waiting.insert(pid, None);
        g.generation += 1;
        self.cv.notify_all();
        Ok(pid)
    }

    /// Waits up to `timeout` (forever if None) for `pid` to be reaped; on success the
    /// registration is removed.
    pub fn wait(&self, pid: i32, timeout: Option<Duration>) -> Option<ExitStatus> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut g = self.lock();
        loop {
            match g.waiting.get(&pid) {
                Some(Some(st)) => {
                    let st = *st;
                    g.waiting.remove(&pid);
                    return Some(st);
                }
                Some(None) => {}
                None => return None,
            }
            match deadline {
                None => g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    g = self
                        .cv
                        .wait_timeout(g, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
    }

    /// Drops interest in `pid`.
    pub fn forget(&self, pid: i32) {
        self.lock().waiting.remove(&pid);
    }
}
