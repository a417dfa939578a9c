//! Rollback of a create that failed halfway: a guard that records an undo step for each thing
//! built, and runs them in reverse order unless the create is committed.
//!
//! ```ignore
//! let mut rb = Rollback::new("sb-n0-...");
//! make_dir(&dir)?;
//! rb.push("remove the sandbox dir", move || async move { remove_dir(&dir) });
//! let sandbox = substrate.create(spec).await?;   // a `?` here: the guard undoes on drop
//! rb.commit();                                      // built: nothing is undone
//! ```
//!
//! On an error path the caller awaits [`Rollback::run`], which answers the problems of the
//! undo steps (to be reported with the create's error). A guard dropped without `commit` or
//! `run` (an early return, or the create's future cancelled because its client went away)
//! runs the remaining steps in a task of its own, so nothing is leaked either way.

use std::future::Future;
use std::pin::Pin;

/// What an undo step can fail with.
pub(super) type UndoError = Box<dyn std::error::Error + Send + Sync>;

type UndoFuture = Pin<Box<dyn Future<Output = Result<(), UndoError>> + Send>>;

struct Step {
    what: &'static str,
    undo: Box<dyn FnOnce() -> UndoFuture + Send>,
}

/// The undo steps of one create, run last-in first-out.
pub(super) struct Rollback {
    sandbox: String,
    steps: Vec<Step>,
}

impl Rollback {
    pub(super) fn new(sandbox: &str) -> Self {
        Rollback {
            sandbox: sandbox.to_string(),
            steps: Vec::new(),
        }
    }

    /// Records how to undo what was just built (`what` names it in problems and logs).
    pub(super) fn push<F, Fut>(&mut self, what: &'static str, undo: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), UndoError>> + Send + 'static,
    {
        self.steps.push(Step {
            what,
            undo: Box::new(move || Box::pin(undo())),
        });
    }

    /// The create succeeded: nothing is undone.
    pub(super) fn commit(mut self) {
        self.steps.clear();
    }

    /// Undoes every recorded step, the last one first; answers the steps that failed
    /// (`"<what>: <error>"`), empty when the rollback was clean.
    pub(super) async fn run(mut self) -> Vec<String> {
        run_steps(&self.sandbox, std::mem::take(&mut self.steps)).await
    }
}

async fn run_steps(sandbox: &str, steps: Vec<Step>) -> Vec<String> {
    let mut problems = Vec::new();
    for step in steps.into_iter().rev() {
        if let Err(e) = (step.undo)().await {
            tracing::warn!(sandbox = %sandbox, step = step.what, error = %e, "roll back a failed create");
            problems.push(format!("{}: {e}", step.what));
        }
    }
    problems
}

impl Drop for Rollback {
    fn drop(&mut self) {
        if self.steps.is_empty() {
            return;
        }
        let steps = std::mem::take(&mut self.steps);
        let sandbox = std::mem::take(&mut self.sandbox);
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                tracing::warn!(sandbox = %sandbox, steps = steps.len(), "create abandoned halfway: rolling back in the background");
                rt.spawn(async move {
                    run_steps(&sandbox, steps).await;
                });
            }
            Err(_) => {
                tracing::error!(sandbox = %sandbox, steps = steps.len(), "create abandoned outside a runtime: cannot roll back");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn recorder(rb: &mut Rollback, log: &Arc<Mutex<Vec<&'static str>>>, what: &'static str) {
        let log = log.clone();
        rb.push(what, move || async move {
            log.lock().unwrap().push(what);
            if what == "network" {
                return Err("veth busy".into());
            }
            Ok(())
        });
    }

    #[tokio::test]
    async fn undoes_in_reverse_order_and_reports_failures() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut rb = Rollback::new("sb-n0-0000000000000001");
        for what in ["dir", "network", "sandbox"] {
            recorder(&mut rb, &log, what);
        }
        let problems = rb.run().await;
        assert_eq!(*log.lock().unwrap(), ["sandbox", "network", "dir"]);
        assert_eq!(problems, ["network: veth busy"]);
    }

    #[tokio::test]
    async fn committed_undoes_nothing() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut rb = Rollback::new("sb-n0-0000000000000001");
        recorder(&mut rb, &log, "dir");
        rb.commit();
        tokio::task::yield_now().await;
        assert!(log.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn dropped_rolls_back_in_the_background() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        {
            let mut rb = Rollback::new("sb-n0-0000000000000001");
            rb.push("done", move || async move {
                let _ = tx.send(());
                Ok(())
            });
            recorder(&mut rb, &log, "dir");
            recorder(&mut rb, &log, "sandbox");
        }
        tokio::time::timeout(std::time::Duration::from_secs(5), rx)
            .await
            .expect("the rollback ran")
            .unwrap();
        assert_eq!(*log.lock().unwrap(), ["sandbox", "dir"]);
    }
}
