//! Server-side burst queueing (issue 22, item 3): a create with `wait_s` waits here for
//! capacity instead of being refused with `node_full`.
//!
//! **Owns** the order in which waiting creates are let through: per project FIFO, projects in
//! turn ([`fair::FairQueue`]), at most [`MAX_IN_FLIGHT`] attempts at once and no more than the
//! watcher's view has room for ([`room::room_for`], minus the attempts already out), so an
//! attempt rarely finds no room. Capacity that frees — a stop through this apiserver
//! ([`BurstQueue::capacity_freed`]) or what the periodic poll ([`spawn_ticker`]) sees freed
//! elsewhere (other apiservers, sandboxes that ended by themselves) — lets the next ones go.
//! An attempt that finds no room although the view had it ([`Slot::no_room`]: a stale view)
//! puts its create back in its place and *blocks* the queue until capacity may have freed;
//! then one create goes as a probe, and when it is placed the queue opens again. **Must not** place anything
//! itself or touch the quota ledger: attempts are [`crate::create::create_with`]'s
//! ([`create::create_queued`]).
//!
//! A waiter whose caller goes away (client disconnect: the handler's future is dropped) or
//! whose `wait_s` passes is removed at once; a grant it had not yet picked up is handed back.

pub mod create;
pub mod fair;
pub mod room;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dsec_wire::api::CreateSandboxRequest;
use tokio::sync::oneshot;

use fair::FairQueue;

/// Most attempts let through at once (the rest wait in order).
pub const MAX_IN_FLIGHT: usize = 512;

/// How often a blocked queue probes for capacity freed elsewhere.
pub const POLL_EVERY: Duration = Duration::from_millis(100);

/// Why a waiter stopped waiting without a turn.
#[derive(Debug, thiserror::Error)]
pub enum WaitTurnError {
    /// `wait_s` passed.
    #[error("waited {waited:?} without a turn; {ahead} create(s) of the project still ahead")]
    TimedOut { waited: Duration, ahead: usize },
}

/// How many more sandboxes of a request's shape there is room for (the watcher's view).
pub type RoomFn = Arc<dyn Fn(&CreateSandboxRequest) -> usize + Send + Sync>;

#[derive(Default)]
struct Inner {
    waiting: FairQueue<(oneshot::Sender<Turn>, Arc<CreateSandboxRequest>)>,
    /// Next ticket per project.
    tickets: HashMap<String, u64>,
    in_flight: usize,
    /// The last attempt found no room: let through only probes until one is placed.
    blocked: bool,
    /// A probe is in flight.
    probing: bool,
    /// Capacity may have freed while the probe was in flight: probe again if it fails.
    freed_during_probe: bool,
    /// Turns given so far (the `dispatched` number of the next).
    dispatched: u64,
    /// Why the last attempt found no room (for refusals of creates that never got a turn).
    last_no_room: Option<String>,
}

/// The per-apiserver burst queue.
pub struct BurstQueue {
    inner: Mutex<Inner>,
    room: RoomFn,
    max_in_flight: usize,
    metrics: Arc<crate::metrics::Metrics>,
}

/// What a waiter receives: its turn number.
struct Turn {
    dispatched: u64,
    probe: bool,
}

impl BurstQueue {
    pub fn new(metrics: Arc<crate::metrics::Metrics>, room: RoomFn) -> Arc<Self> {
        Self::with_limit(metrics, room, MAX_IN_FLIGHT)
    }

    pub fn with_limit(
        metrics: Arc<crate::metrics::Metrics>,
        room: RoomFn,
        max_in_flight: usize,
    ) -> Arc<Self> {
        Arc::new(BurstQueue {
            inner: Mutex::new(Inner::default()),
            room,
            max_in_flight: max_in_flight.max(1),
            metrics,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Creates waiting now.
    pub fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// The reason the last attempt found no room.
    pub fn last_no_room(&self) -> Option<String> {
        self.lock().last_no_room.clone()
    }

    /// A new ticket of `project` (its arrival number).
    #[cfg(test)]
    fn ticket(&self, project: &str) -> u64 {
        let mut g = self.lock();
        let t = g.tickets.entry(project.to_string()).or_insert(0);
        let mine = *t;
        *t += 1;
        mine
    }

    /// Waits for the turn of `project`'s create `ticket` (in ticket order within the project,
    /// projects in turn) until `deadline`. `None`: a new arrival, whose ticket is taken under
    /// the same lock as its place in the queue (so arrival order is queue order); `Some`: the
    /// create already had a turn that found no room and goes back to its place.
    pub async fn wait_turn(
        self: &Arc<Self>,
        project: &str,
        ticket: Option<u64>,
        req: &Arc<CreateSandboxRequest>,
        deadline: Instant,
    ) -> Result<Slot, WaitTurnError> {
        let since = Instant::now();
        let put_back_ticket = ticket;
        let put_back = ticket.is_some();
        let ticket: u64;
        let rx = {
            let mut g = self.lock();
            ticket = match put_back_ticket {
                Some(t) => t,
                None => {
                    let t = g.tickets.entry(project.to_string()).or_insert(0);
                    let mine = *t;
                    *t += 1;
                    mine
                }
            };
            if g.waiting.is_empty()
                && !g.blocked
                && g.in_flight < self.max_in_flight
                && (self.room)(req) > g.in_flight
            {
                g.in_flight += 1;
                g.dispatched += 1;
                return Ok(self.slot(project, ticket, g.dispatched, false));
            }
            let (tx, rx) = oneshot::channel();
            g.waiting.push(project, ticket, (tx, req.clone()), put_back);
            self.metrics.queue_waiting.set(g.waiting.len() as i64);
            self.pump(&mut g);
            rx
        };
        // Removes the waiter however this future ends (timeout, or dropped by a caller that
        // went away) unless it got its turn.
        let mut guard = Waiting {
            queue: self,
            project,
            ticket,
            armed: true,
        };
        let got = tokio::time::timeout_at(deadline.into(), rx).await;
        match got {
            Ok(Ok(turn)) => {
                guard.armed = false;
                Ok(self.slot(project, ticket, turn.dispatched, turn.probe))
            }
            // The sender is only dropped by `pump` handing out the turn, which it never
            // fails to send while the receiver lives; treat it like a timeout.
            Ok(Err(_)) | Err(_) => {
                drop(guard);
                let ahead = self.lock().waiting.ahead_of(project, ticket);
                Err(WaitTurnError::TimedOut {
                    waited: since.elapsed(),
                    ahead,
                })
            }
        }
    }

    fn slot(self: &Arc<Self>, project: &str, ticket: u64, dispatched: u64, probe: bool) -> Slot {
        Slot {
            queue: self.clone(),
            project: project.to_string(),
            ticket,
            dispatched,
            probe,
            outcome: Outcome::Unknown,
        }
    }

    /// Capacity may have freed (a sandbox stopped through this apiserver, or the periodic
    /// poll): a blocked queue lets one create through to find out.
    pub fn capacity_freed(&self) {
        let mut g = self.lock();
        if g.probing {
            g.freed_during_probe = true;
        } else if g.blocked {
            g.blocked = false;
            self.pump_probe(&mut g);
        } else {
            self.pump(&mut g);
        }
    }

    /// Lets waiting creates through while there is room for them and for attempts.
    fn pump(&self, g: &mut Inner) {
        if g.blocked {
            return;
        }
        while g.in_flight < self.max_in_flight && self.head_has_room(g) {
            if !self.give_turn(g, false) {
                break;
            }
        }
        self.metrics.queue_waiting.set(g.waiting.len() as i64);
    }

    /// True when the view has room for the next waiter beside the attempts already out
    /// (waiters that went away are dropped first).
    fn head_has_room(&self, g: &mut Inner) -> bool {
        loop {
            let closed = match g.waiting.peek() {
                None => return false,
                Some((tx, _)) => tx.is_closed(),
            };
            if closed {
                g.waiting.pop();
                continue;
            }
            let Some((_, req)) = g.waiting.peek() else {
                return false;
            };
            return (self.room)(req) > g.in_flight;
        }
    }

    /// One probe while blocked (called with `blocked` cleared by the caller); stays blocked.
    fn pump_probe(&self, g: &mut Inner) {
        g.blocked = true;
        g.freed_during_probe = false;
        if g.in_flight < self.max_in_flight && self.head_has_room(g) && self.give_turn(g, true) {
            g.probing = true;
        }
        self.metrics.queue_waiting.set(g.waiting.len() as i64);
    }

    /// Gives the next waiter its turn; false when nobody waits.
    fn give_turn(&self, g: &mut Inner, probe: bool) -> bool {
        while let Some((_, _, (tx, _))) = g.waiting.pop() {
            if tx.is_closed() {
                continue;
            }
            g.dispatched += 1;
            g.in_flight += 1;
            let turn = Turn {
                dispatched: g.dispatched,
                probe,
            };
            if tx.send(turn).is_ok() {
                return true;
            }
            // The waiter went away between the check and the send.
            g.in_flight -= 1;
        }
        false
    }

    fn finish(&self, slot: &Slot) {
        let mut g = self.lock();
        g.in_flight = g.in_flight.saturating_sub(1);
        if slot.probe {
            g.probing = false;
        }
        match slot.outcome {
            Outcome::NoRoom => {
                g.blocked = true;
                if slot.probe && std::mem::take(&mut g.freed_during_probe) {
                    // Capacity freed while the probe was out: try again at once.
                    g.blocked = false;
                    self.pump_probe(&mut g);
                }
            }
            Outcome::Placed => {
                g.blocked = false;
                self.pump(&mut g);
            }
            // Another answer (a user error, a timeout): says nothing about room.
            Outcome::Unknown => {
                if slot.probe && g.blocked {
                    g.blocked = false;
                    self.pump_probe(&mut g);
                } else {
                    self.pump(&mut g);
                }
            }
        }
    }
}

struct Waiting<'a> {
    queue: &'a Arc<BurstQueue>,
    project: &'a str,
    ticket: u64,
    armed: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut g = self.queue.lock();
        // Not found: the turn was already sent; the receiver (dropped with this future)
        // drops the turn, and nothing else holds the in-flight count it took.
        if g.waiting.remove(self.project, self.ticket).is_none() {
            // The turn was sent but never picked up: give it back.
            g.in_flight = g.in_flight.saturating_sub(1);
            self.queue.pump(&mut g);
        }
        self.queue.metrics.queue_waiting.set(g.waiting.len() as i64);
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Outcome {
    Unknown,
    Placed,
    NoRoom,
}

/// A turn: one attempt at placing the create. Dropping it lets the next waiter through.
pub struct Slot {
    queue: Arc<BurstQueue>,
    pub project: String,
    pub ticket: u64,
    pub dispatched: u64,
    probe: bool,
    outcome: Outcome,
}

impl Slot {
    /// The attempt placed the sandbox: there is room, the queue opens.
    pub fn placed(mut self) {
        self.outcome = Outcome::Placed;
    }

    /// The attempt found no room (`why`): the queue blocks until capacity frees.
    pub fn no_room(mut self, why: &str) {
        self.outcome = Outcome::NoRoom;
        self.queue.lock().last_no_room = Some(why.to_string());
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.queue.clone().finish(self);
    }
}

/// A sandbox was stopped through this apiserver: its node has room for one more now.
pub fn capacity_freed_by_stop(st: &crate::routes::AppState, sandbox_id: &str) {
    if let Some(node) = dsec_wire::id::node_of(sandbox_id) {
        st.forwarder.watcher().note_stopped(node);
    }
    st.queue.capacity_freed();
}

/// Probes a blocked queue every [`POLL_EVERY`] (capacity freed where this apiserver does not
/// see it happen: other apiservers, sandboxes ending by themselves, the watcher's next poll).
pub fn spawn_ticker(queue: Arc<BurstQueue>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(POLL_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let waiting = {
                let g = queue.lock();
                !g.probing && !g.waiting.is_empty()
            };
            if waiting {
                queue.capacity_freed();
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(limit: usize) -> Arc<BurstQueue> {
        BurstQueue::with_limit(
            Arc::new(crate::metrics::Metrics::new()),
            Arc::new(|_: &CreateSandboxRequest| usize::MAX),
            limit,
        )
    }

    fn req() -> Arc<CreateSandboxRequest> {
        Arc::new(CreateSandboxRequest::default())
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    #[tokio::test]
    async fn no_room_blocks_until_capacity_frees_then_probes() {
        let q = queue(4);
        let t0 = q.ticket("a");
        let s = q.wait_turn("a", Some(t0), &req(), far()).await.unwrap();
        s.no_room("cpu: full");
        assert_eq!(q.last_no_room().as_deref(), Some("cpu: full"));
        // Blocked: the next create waits.
        let (q2, t1) = (q.clone(), q.ticket("a"));
        let waiter = tokio::spawn(async move { q2.wait_turn("a", Some(t1), &req(), far()).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(q.waiting(), 1);
        assert!(!waiter.is_finished());
        q.capacity_freed();
        let s = waiter.await.unwrap().unwrap();
        assert!(s.probe && s.ticket == t1);
        s.placed();
        // Open again: the fast path.
        let s = q.wait_turn("a", None, &req(), far()).await.unwrap();
        assert!(!s.probe);
    }

    #[tokio::test]
    async fn no_more_attempts_than_the_view_has_room_for() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let room = Arc::new(AtomicUsize::new(2));
        let r = room.clone();
        let q = BurstQueue::with_limit(
            Arc::new(crate::metrics::Metrics::new()),
            Arc::new(move |_: &CreateSandboxRequest| r.load(Ordering::SeqCst)),
            64,
        );
        let a = q.wait_turn("a", None, &req(), far()).await.unwrap();
        let b = q.wait_turn("a", None, &req(), far()).await.unwrap();
        let (q2, t) = (q.clone(), q.ticket("a"));
        let third = tokio::spawn(async move { q2.wait_turn("a", Some(t), &req(), far()).await });
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(
            !third.is_finished(),
            "two attempts out use the room for two"
        );
        // Both placed: the view now counts them (room 0 left); a stop frees one.
        room.store(0, Ordering::SeqCst);
        a.placed();
        b.placed();
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!third.is_finished());
        room.store(1, Ordering::SeqCst);
        q.capacity_freed();
        let s = third.await.unwrap().unwrap();
        assert_eq!(s.ticket, 2);
    }

    #[tokio::test]
    async fn a_waiter_that_times_out_or_goes_away_leaves_nothing() {
        let q = queue(1);
        let held = q.wait_turn("a", None, &req(), far()).await.unwrap();
        let t = q.ticket("a");
        let e = q
            .wait_turn(
                "a",
                Some(t),
                &req(),
                Instant::now() + Duration::from_millis(30),
            )
            .await
            .err()
            .unwrap();
        assert!(matches!(e, WaitTurnError::TimedOut { ahead: 0, .. }), "{e}");
        assert_eq!(q.waiting(), 0);
        let (q2, t) = (q.clone(), q.ticket("b"));
        let gone = tokio::spawn(async move { q2.wait_turn("b", Some(t), &req(), far()).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(q.waiting(), 1);
        gone.abort();
        let _ = gone.await;
        assert_eq!(q.waiting(), 0);
        drop(held);
        assert_eq!(q.lock().in_flight, 0);
    }

    #[tokio::test]
    async fn turns_follow_arrival_within_a_project_and_alternate_between_projects() {
        let q = queue(1);
        let held = q.wait_turn("x", None, &req(), far()).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        // a arrives with 6 before b's 3.
        for p in ["a", "a", "a", "a", "a", "a", "b", "b", "b"] {
            let (q, order) = (q.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let s = q.wait_turn(p, None, &req(), far()).await.unwrap();
                order.lock().unwrap().push((p, s.ticket, s.dispatched));
                tokio::task::yield_now().await;
                s.placed();
            }));
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        drop(held);
        for t in tasks {
            t.await.unwrap();
        }
        let order = order.lock().unwrap().clone();
        let names: String = order.iter().map(|o| o.0).collect();
        assert_eq!(names, "ababab aaa".replace(' ', ""));
        for p in ["a", "b"] {
            let mine: Vec<(u64, u64)> = order
                .iter()
                .filter(|o| o.0 == p)
                .map(|o| (o.1, o.2))
                .collect();
            assert!(
                mine.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1),
                "{mine:?}"
            );
        }
    }
}
