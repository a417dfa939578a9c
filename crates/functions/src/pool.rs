//! A pool of warm workers for one (image, toolkits, language).
//!
//! At most `max` calls run at once (a fair semaphore); each takes an idle worker or starts one.
//! A worker goes back to the idle list after a clean call and is destroyed after a call that
//! broke it (or after `recycle_after` calls). The service's background task keeps `min` workers
//! while the pool is in use and destroys every idle worker once the pool has been idle for
//! `idle_shrink_s` (shrink to zero).
//!
//! A call answered before its worker's cleanup (see `ServerRequest::early`) keeps the worker
//! "settling" until the cleanup is confirmed. A new call takes an idle worker if there is one;
//! else it waits briefly for a settling worker rather than start a container for a worker that
//! is about to come back. (So a pool of one worker serves a sequential client on that worker,
//! and a pool of several lets one worker clean up while another serves the next call.)

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dsec_wire::api::FunctionPoolInfo;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::admission::{self, Admission};
use super::worker::{Worker, WorkerFactory};
use super::{FunctionConfig, FunctionError, PoolKey};

#[derive(Default)]
struct State {
    idle: Vec<Worker>,
    busy: usize,
    /// Of `busy`: calls answered whose worker is still being cleaned.
    settling: usize,
    starting: usize,
    ids: BTreeSet<String>,
    last_used: Option<Instant>,
    closed: bool,
    /// Background refills that failed in a row (e.g. the pool's image is gone), and when the
    /// next may be tried: failures back off instead of retrying (and logging) every tick.
    refill_failures: u32,
    refill_after: Option<Instant>,
}

/// How long the background refill waits after `failures` failed starts in a row: 1 s, doubling,
/// at most a minute.
fn refill_backoff(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(6)).min(Duration::from_secs(60))
}

pub struct Pool {
    pub key: PoolKey,
    cfg: Arc<FunctionConfig>,
    factory: Arc<WorkerFactory>,
    state: Mutex<State>,
    slots: Arc<Semaphore>,
    admission: Admission,
    calls: AtomicU64,
    created: AtomicU64,
    destroyed: AtomicU64,
    /// Exponential moving average of call time in µs, for the retry hint.
    avg_us: AtomicU64,
    /// Woken whenever a worker comes back (or is given up).
    returned: Notify,
}

/// Longest a call with no idle worker waits for a settling one before it starts a worker. A
/// cleanup takes ~1–3 ms, one that needs a sweep (leftover processes killed from outside)
/// tens of ms; a worker start takes longer, and a worker given up wakes the waiters at once.
const SETTLE_WAIT: Duration = Duration::from_secs(1);

/// A worker lent to one call; give it back with [`Pool::release`].
pub struct Lent {
    pub worker: Worker,
    _permit: OwnedSemaphorePermit,
    pub queue_ms: f64,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pool {
    pub fn new(key: PoolKey, cfg: Arc<FunctionConfig>, factory: Arc<WorkerFactory>) -> Arc<Self> {
        Arc::new(Pool {
            slots: Arc::new(Semaphore::new(cfg.max_workers)),
            admission: Admission::new(cfg.queue_limit),
            key,
            cfg,
            factory,
            state: Mutex::new(State::default()),
            calls: AtomicU64::new(0),
            created: AtomicU64::new(0),
            destroyed: AtomicU64::new(0),
            avg_us: AtomicU64::new(0),
            returned: Notify::new(),
        })
    }

    /// Waits for a worker (or rejects at once when the queue is full).
    pub async fn acquire(self: &Arc<Self>) -> Result<Lent, FunctionError> {
        let started = Instant::now();
        let ticket = self.admission.enter().map_err(|full| FunctionError::QueueFull {
            message: format!(
                "the function pool for {} is saturated: {} calls are waiting (limit {}); retry later",
                self.key, full.waiting, full.limit
            ),
            retry_after_s: admission::retry_after_s(
                full.waiting,
                self.cfg.max_workers,
                self.avg_us.load(Ordering::Relaxed) as f64 / 1000.0,
            ),
        })?;
        // The wait is bounded: a call still queued after `queue_wait_s` is refused (it did
        // not run) with the same retry hint as a full queue.
        let bound = Duration::from_secs_f64(self.cfg.queue_wait_s);
        let permit = match tokio::time::timeout(bound, self.slots.clone().acquire_owned()).await {
            Ok(p) => p.map_err(|_| {
                FunctionError::Unavailable("the function pool is shutting down".into())
            })?,
            Err(_) => {
                self.admission.rejected.fetch_add(1, Ordering::Relaxed);
                let waiting = self.admission.waiting();
                return Err(FunctionError::QueueFull {
                    message: format!(
                        "the function pool for {} is saturated: this call waited {:.0} s for a \
                         worker (the bound, functions.queue_wait_s) behind {waiting} others; \
                         retry later",
                        self.key, self.cfg.queue_wait_s
                    ),
                    retry_after_s: admission::retry_after_s(
                        waiting,
                        self.cfg.max_workers,
                        self.avg_us.load(Ordering::Relaxed) as f64 / 1000.0,
                    ),
                });
            }
        };
        drop(ticket);
        let wait_until = tokio::time::Instant::now() + SETTLE_WAIT;
        let taken = loop {
            // Created before the state is looked at: a worker returned after the look wakes it.
            let returned = self.returned.notified();
            {
                let mut st = lock(&self.state);
                if st.closed {
                    return Err(FunctionError::Unavailable(
                        "the function pool is shutting down".into(),
                    ));
                }
                if !st.idle.is_empty()
                    || st.settling == 0
                    || tokio::time::Instant::now() >= wait_until
                {
                    st.last_used = Some(Instant::now());
                    st.busy += 1;
                    break st.idle.pop();
                }
            }
            let _ = tokio::time::timeout_at(wait_until, returned).await;
        };
        let worker = match taken {
            Some(w) => w,
            None => match self.start_worker().await {
                Ok(w) => w,
                Err(e) => {
                    lock(&self.state).busy -= 1;
                    return Err(e);
                }
            },
        };
        Ok(Lent {
            worker,
            _permit: permit,
            queue_ms: started.elapsed().as_secs_f64() * 1000.0,
        })
    }

    async fn start_worker(&self) -> Result<Worker, FunctionError> {
        lock(&self.state).starting += 1;
        let made = self.factory.create(&self.key).await;
        let mut st = lock(&self.state);
        st.starting -= 1;
        if let Ok(w) = &made {
            st.ids.insert(w.id.clone());
            self.created.fetch_add(1, Ordering::Relaxed);
            tracing::info!(worker = %w.id, pool = %self.key, "function worker started");
        }
        made
    }

    /// Marks a lent worker as settling: its call is answered, its cleanup is running; give it
    /// back with [`Pool::release_settled`].
    pub fn settling(&self) {
        lock(&self.state).settling += 1;
    }

    /// [`Pool::release`] of a worker marked with [`Pool::settling`].
    pub fn release_settled(self: &Arc<Self>, lent: Lent, healthy: bool, took: Duration) {
        {
            let mut st = lock(&self.state);
            st.settling = st.settling.saturating_sub(1);
        }
        self.release(lent, healthy, took);
    }

    /// Gives a worker back: to the idle list when `healthy`, else it is destroyed.
    pub fn release(self: &Arc<Self>, lent: Lent, healthy: bool, took: Duration) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let us = took.as_micros() as u64;
        let old = self.avg_us.load(Ordering::Relaxed);
        self.avg_us.store(
            if old == 0 { us } else { (old * 7 + us) / 8 },
            Ordering::Relaxed,
        );
        let Lent {
            worker, _permit, ..
        } = lent;
        let recycle = self.cfg.recycle_after > 0 && worker.calls >= self.cfg.recycle_after;
        let mut st = lock(&self.state);
        st.busy -= 1;
        st.last_used = Some(Instant::now());
        if healthy && !recycle && !st.closed && worker.alive() {
            st.idle.push(worker);
            drop(st);
            self.returned.notify_waiters();
        } else {
            drop(st);
            self.returned.notify_waiters();
            if !healthy {
                tracing::warn!(worker = %worker.id, pool = %self.key, "function worker broken by a call; replacing it");
            }
            self.destroy(worker);
        }
    }

    fn destroy(self: &Arc<Self>, worker: Worker) {
        let pool = self.clone();
        tokio::spawn(async move {
            let id = worker.id.clone();
            worker.destroy().await;
            lock(&pool.state).ids.remove(&id);
            pool.destroyed.fetch_add(1, Ordering::Relaxed);
        });
    }

    /// Background upkeep: refill to `min` while in use, shrink to zero when idle too long.
    pub async fn tick(self: &Arc<Self>) {
        let idle_for = Duration::from_secs_f64(self.cfg.idle_shrink_s);
        let (shrink, need) = {
            let mut st = lock(&self.state);
            let idle_long = st.last_used.is_none_or(|t| t.elapsed() >= idle_for);
            if st.closed {
                return;
            }
            if idle_long {
                (std::mem::take(&mut st.idle), 0)
            } else if st.refill_after.is_some_and(|t| Instant::now() < t) {
                (Vec::new(), 0)
            } else {
                let total = st.idle.len() + st.busy + st.starting;
                (
                    Vec::new(),
                    self.cfg
                        .min_workers
                        .min(self.cfg.max_workers)
                        .saturating_sub(total),
                )
            }
        };
        if !shrink.is_empty() {
            tracing::info!(pool = %self.key, workers = shrink.len(), "function pool idle: shrinking to zero");
        }
        for w in shrink {
            self.destroy(w);
        }
        if need > 0 {
            match self.start_worker().await {
                Ok(w) => {
                    let mut st = lock(&self.state);
                    st.refill_failures = 0;
                    st.refill_after = None;
                    if st.closed || st.idle.len() + st.busy >= self.cfg.max_workers {
                        drop(st);
                        self.destroy(w);
                    } else {
                        st.idle.push(w);
                    }
                }
                Err(e) => {
                    let mut st = lock(&self.state);
                    st.refill_failures = st.refill_failures.saturating_add(1);
                    let wait = refill_backoff(st.refill_failures);
                    st.refill_after = Some(Instant::now() + wait);
                    let failures = st.refill_failures;
                    drop(st);
                    tracing::warn!(pool = %self.key, error = %e, failures, retry_in_s = wait.as_secs(), "refill function pool");
                }
            }
        }
    }

    /// Destroys every idle worker and refuses new calls; busy workers are destroyed when they
    /// come back. Waits up to `grace` for every worker to be gone.
    pub async fn shutdown(self: &Arc<Self>, grace: Duration) {
        self.slots.close();
        let idle = {
            let mut st = lock(&self.state);
            st.closed = true;
            std::mem::take(&mut st.idle)
        };
        for w in idle {
            let id = w.id.clone();
            w.destroy().await;
            lock(&self.state).ids.remove(&id);
            self.destroyed.fetch_add(1, Ordering::Relaxed);
        }
        let until = Instant::now() + grace;
        while Instant::now() < until {
            if lock(&self.state).ids.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn info(&self) -> FunctionPoolInfo {
        let st = lock(&self.state);
        FunctionPoolInfo {
            image: self.key.image.clone(),
            toolkits: self.key.toolkits.clone(),
            language: self.key.language.clone(),
            min: self.cfg.min_workers,
            max: self.cfg.max_workers,
            idle: st.idle.len(),
            busy: st.busy,
            starting: st.starting,
            queued: self.admission.waiting(),
            workers: st.ids.iter().cloned().collect(),
            calls: self.calls.load(Ordering::Relaxed),
            workers_created: self.created.load(Ordering::Relaxed),
            workers_destroyed: self.destroyed.load(Ordering::Relaxed),
            rejected: self.admission.rejected.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refill_backoff_doubles_to_a_minute() {
        let secs: Vec<u64> = (1..=9).map(|n| refill_backoff(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(refill_backoff(0), Duration::from_secs(1));
        assert_eq!(refill_backoff(u32::MAX), Duration::from_secs(60));
    }
}
