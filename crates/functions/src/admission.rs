//! Admission: a bounded queue in front of each pool. A call that finds the queue full is
//! rejected at once (HTTP 429 `quota_exceeded` with a retry hint) and never runs; an admitted
//! call runs exactly once (it is never retried on another worker after it started).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

/// Counts calls waiting for a worker.
#[derive(Debug, Default)]
pub struct Admission {
    limit: usize,
    waiting: Arc<AtomicUsize>,
    pub rejected: AtomicU64,
}

/// A place in the queue; leaving it (drop) frees the place.
#[derive(Debug)]
pub struct Ticket {
    waiting: Arc<AtomicUsize>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The queue was full.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Full {
    pub waiting: usize,
    pub limit: usize,
}

impl Admission {
    pub fn new(limit: usize) -> Self {
        Admission {
            limit,
            waiting: Arc::new(AtomicUsize::new(0)),
            rejected: AtomicU64::new(0),
        }
    }

    /// Takes a place in the queue, or says it is full.
    pub fn enter(&self) -> Result<Ticket, Full> {
        let mut cur = self.waiting.load(Ordering::SeqCst);
        loop {
            if cur >= self.limit {
                self.rejected.fetch_add(1, Ordering::Relaxed);
                return Err(Full {
                    waiting: cur,
                    limit: self.limit,
                });
            }
            match self
                .waiting
                .compare_exchange(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => {
                    return Ok(Ticket {
                        waiting: self.waiting.clone(),
                    })
                }
                Err(now) => cur = now,
            }
        }
    }

    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }
}

/// Seconds a rejected caller should wait: the time the queue ahead needs to drain with
/// `workers` workers at `avg_ms` per call, at least 1 s.
pub fn retry_after_s(waiting: usize, workers: usize, avg_ms: f64) -> u64 {
    let per = if avg_ms.is_finite() && avg_ms > 0.0 {
        avg_ms
    } else {
        100.0
    };
    let secs = waiting as f64 * per / workers.max(1) as f64 / 1000.0;
    (secs.ceil() as u64).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded() {
        let a = Admission::new(2);
        let t1 = a.enter().unwrap();
        let _t2 = a.enter().unwrap();
        assert_eq!(
            a.enter().unwrap_err(),
            Full {
                waiting: 2,
                limit: 2
            }
        );
        drop(t1);
        assert!(a.enter().is_ok());
        assert_eq!(a.rejected.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn retry_hint() {
        assert_eq!(retry_after_s(0, 2, 5.0), 1);
        assert_eq!(retry_after_s(1000, 2, 10.0), 5);
    }
}
