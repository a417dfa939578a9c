//! Client fast-forward: which step ids of a sandbox are done, running or free, and what a call
//! carrying a step id must do.
//!
//! - step done with the same key → answer the recorded result (nothing runs);
//! - step running with the same key → wait for it and answer its result;
//! - step done or running with another key → `conflict` (never answered with another result);
//! - step free → the caller runs the call and records it.
//!
//! The index keeps only the key and the record's position in the log; results are read back
//! from the log when a step is fast-forwarded.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use dsec_wire::api::{ErrorDetail, TrajectoryRecord};
use serde_json::Value;
use tokio::sync::watch;

use super::log::Position;

/// How a running step ended, for the callers waiting on it.
#[derive(Debug, Clone)]
pub enum Finished {
    /// Recorded (successfully or with a user error); the step is done.
    Recorded(Arc<TrajectoryRecord>),
    /// Failed before it could be recorded as done (an internal error): the step is free again.
    Failed(ErrorDetail),
}

/// Receives the end of a running step.
pub type Waiter = watch::Receiver<Option<Finished>>;
/// Announces the end of a running step.
pub type Notifier = watch::Sender<Option<Finished>>;

enum Slot {
    Running {
        kind: String,
        key: Value,
        done: Waiter,
    },
    Done {
        kind: String,
        key: Value,
        pos: Position,
    },
}

/// What a call with a step id must do.
pub enum Claim {
    Replay(Position),
    Wait(Waiter),
    Conflict(String),
    /// The step is now running; report its end through the notifier.
    Run(Notifier),
}

/// The step index of one sandbox.
#[derive(Default)]
pub struct Steps {
    slots: HashMap<u64, Slot>,
    done: BTreeSet<u64>,
}

fn describe(kind: &str, key: &Value) -> String {
    let mut s = format!("{kind} {key}");
    if s.len() > 300 {
        let mut cut = 300;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

impl Steps {
    /// Rebuilds the index from a log's records.
    pub fn from_records<'a>(
        records: impl IntoIterator<Item = (&'a TrajectoryRecord, Position)>,
    ) -> Steps {
        let mut s = Steps::default();
        for (rec, pos) in records {
            if let Some(step) = rec.step {
                if completes_step(rec) {
                    s.complete(step, &rec.kind, rec.key.clone(), pos);
                }
            }
        }
        s
    }

    /// Decides what a call `kind`/`key` with step `step` does.
    pub fn claim(&mut self, step: u64, kind: &str, key: &Value) -> Claim {
        match self.slots.get(&step) {
            Some(Slot::Done {
                kind: k,
                key: v,
                pos,
            }) => {
                if k == kind && v == key {
                    Claim::Replay(*pos)
                } else {
                    Claim::Conflict(format!(
                        "step {step} already completed as a different call ({}); this request is ({}): \
                         a repeated step must be the very same call; give new calls a new step id",
                        describe(k, v),
                        describe(kind, key)
                    ))
                }
            }
            Some(Slot::Running {
                kind: k,
                key: v,
                done,
            }) => {
                if k == kind && v == key {
                    Claim::Wait(done.clone())
                } else {
                    Claim::Conflict(format!(
                        "step {step} is running as a different call ({}); this request is ({}): \
                         a repeated step must be the very same call; give new calls a new step id",
                        describe(k, v),
                        describe(kind, key)
                    ))
                }
            }
            None => {
                let (tx, rx) = watch::channel(None);
                self.slots.insert(
                    step,
                    Slot::Running {
                        kind: kind.to_string(),
                        key: key.clone(),
                        done: rx,
                    },
                );
                Claim::Run(tx)
            }
        }
    }

    /// Marks `step` done at `pos`.
    pub fn complete(&mut self, step: u64, kind: &str, key: Value, pos: Position) {
        self.slots.insert(
            step,
            Slot::Done {
                kind: kind.to_string(),
                key,
                pos,
            },
        );
        self.done.insert(step);
    }

    /// Frees a running step (its call failed before being recorded as done).
    pub fn release(&mut self, step: u64) {
        if matches!(self.slots.get(&step), Some(Slot::Running { .. })) {
            self.slots.remove(&step);
        }
    }

    pub fn last_completed(&self) -> Option<u64> {
        self.done.last().copied()
    }

    pub fn running(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .slots
            .iter()
            .filter(|(_, s)| matches!(s, Slot::Running { .. }))
            .map(|(k, _)| *k)
            .collect();
        v.sort_unstable();
        v
    }
}

/// A recorded call completes its step unless it failed with an internal (5xx) error, which
/// may be transient: such a step runs again when repeated.
pub fn completes_step(rec: &TrajectoryRecord) -> bool {
    match &rec.error {
        None => true,
        Some(e) => dsec_wire::api::status_for_code(&e.code) < 500,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const P: Position = Position { offset: 0, len: 10 };

    #[test]
    fn claims() {
        let mut s = Steps::default();
        let k = json!({"cmd": "echo 1"});
        let tx = match s.claim(1, "shell", &k) {
            Claim::Run(tx) => tx,
            _ => panic!("free step must run"),
        };
        assert_eq!(s.running(), vec![1]);
        let w = match s.claim(1, "shell", &k) {
            Claim::Wait(w) => w,
            _ => panic!("running step must be waited for"),
        };
        assert!(
            matches!(s.claim(1, "shell", &json!({"cmd": "rm -rf /"})), Claim::Conflict(m) if m.contains("step 1 is running"))
        );
        assert!(matches!(s.claim(1, "exec", &k), Claim::Conflict(_)));
        s.complete(1, "shell", k.clone(), P);
        let _ = tx.send(Some(Finished::Failed(ErrorDetail {
            code: "x".into(),
            message: "y".into(),
        })));
        assert!(w.has_changed().unwrap());
        assert!(matches!(s.claim(1, "shell", &k), Claim::Replay(p) if p == P));
        assert!(
            matches!(s.claim(1, "shell", &json!({"cmd": "echo 2"})), Claim::Conflict(m) if m.contains("already completed"))
        );
        assert_eq!(s.last_completed(), Some(1));
        assert!(s.running().is_empty());
    }

    #[test]
    fn release_frees_only_running() {
        let mut s = Steps::default();
        let k = json!(1);
        assert!(matches!(s.claim(4, "shell", &k), Claim::Run(_)));
        s.release(4);
        assert!(matches!(s.claim(4, "shell", &json!(2)), Claim::Run(_)));
        s.complete(4, "shell", json!(2), P);
        s.release(4);
        assert!(matches!(s.claim(4, "shell", &json!(2)), Claim::Replay(_)));
    }

    #[test]
    fn rebuilt_from_records() {
        let ok = TrajectoryRecord {
            seq: 1,
            step: Some(3),
            kind: "shell".into(),
            key: json!("a"),
            ok: true,
            ..Default::default()
        };
        let internal = TrajectoryRecord {
            seq: 2,
            step: Some(4),
            kind: "shell".into(),
            key: json!("b"),
            error: Some(ErrorDetail {
                code: "internal".into(),
                message: "lost".into(),
            }),
            ..Default::default()
        };
        let user_err = TrajectoryRecord {
            seq: 3,
            step: Some(5),
            kind: "stat".into(),
            key: json!("c"),
            error: Some(ErrorDetail {
                code: "file_not_found".into(),
                message: "no".into(),
            }),
            ..Default::default()
        };
        let mut s = Steps::from_records([(&ok, P), (&internal, P), (&user_err, P)]);
        assert_eq!(s.last_completed(), Some(5));
        assert!(matches!(s.claim(3, "shell", &json!("a")), Claim::Replay(_)));
        assert!(matches!(s.claim(4, "shell", &json!("b")), Claim::Run(_)));
        assert!(matches!(s.claim(5, "stat", &json!("c")), Claim::Replay(_)));
    }
}
