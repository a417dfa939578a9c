//! Tests of the log as a whole: fast-forward across reopen, waiting for a running step,
//! group commit, retention.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use dsec_wire::api::{codes, CommandResult, ErrorDetail, FileInfo};
use serde_json::json;

use crate::*;

/// A call error as the edge's would be: a wire code and a message.
#[derive(Debug)]
struct CallFailed(ErrorDetail);

impl CallFailed {
    fn new(code: &str, message: &str) -> Self {
        CallFailed(ErrorDetail {
            code: code.into(),
            message: message.into(),
        })
    }
    fn code(&self) -> &str {
        &self.0.code
    }
}

impl From<TrajectoryError> for CallFailed {
    fn from(e: TrajectoryError) -> Self {
        match e {
            TrajectoryError::Recorded(d) => CallFailed(d),
            TrajectoryError::StepConflict { .. } => {
                CallFailed::new(codes::CONFLICT, &e.to_string())
            }
            e => CallFailed::new(codes::INTERNAL, &e.to_string()),
        }
    }
}

impl CallError for CallFailed {
    fn detail(&self) -> ErrorDetail {
        self.0.clone()
    }
}

fn traj(dir: &Path) -> Arc<Trajectories<CallFailed>> {
    Arc::new(Trajectories::new(
        TrajectoryConfig {
            inline_output_bytes: 8,
            ..Default::default()
        },
        dir.to_path_buf(),
    ))
}

const ID: &str = "sb-n0-00000000000000aa";

#[tokio::test]
async fn steps_fast_forward_and_survive_reopen() {
    let d = tempfile::tempdir().unwrap();
    let t = traj(d.path());
    t.begin(ID, None).unwrap();
    let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let call = |t: Arc<Trajectories<CallFailed>>, cmd: &'static str| {
        let runs = runs.clone();
        async move {
            t.call(
                ID,
                Some(1),
                "shell",
                json!({"cmd": cmd}),
                json!({"cmd": cmd}),
                move || async move {
                    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    Ok(CommandResult {
                        stdout: "a long output, kept out of line".into(),
                        ..Default::default()
                    })
                },
            )
            .await
        }
    };
    let a = call(t.clone(), "x").await.unwrap();
    assert!(!a.replayed);
    let b = call(t.clone(), "x").await.unwrap();
    assert!(b.replayed);
    assert_eq!(a.value, b.value, "blob-stored output restored");
    assert_eq!(call(t.clone(), "y").await.unwrap_err().code(), "conflict");
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    // A new edge (same directory) rebuilds the step index from the log.
    let t2 = traj(d.path());
    let c = call(t2.clone(), "x").await.unwrap();
    assert!(c.replayed);
    assert_eq!(c.value, a.value);
    assert_eq!(t2.last_step(ID).unwrap().last_completed_step, Some(1));
    let recs = t2.read(ID).unwrap();
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].blobs.len(), 1);
}

#[tokio::test]
async fn running_step_is_waited_for_and_survives_the_caller() {
    let d = tempfile::tempdir().unwrap();
    let t = traj(d.path());
    t.begin(ID, None).unwrap();
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let t1 = t.clone();
    let first = tokio::spawn(async move {
        t1.call(
            ID,
            Some(7),
            "exec",
            json!(1),
            json!(1),
            move || async move {
                let _ = go_rx.await;
                Ok(CommandResult {
                    exit_code: 3,
                    ..Default::default()
                })
            },
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(t.last_step(ID).unwrap().running_steps, vec![7]);
    // The first caller goes away: the call still finishes and is recorded.
    first.abort();
    let t2 = t.clone();
    let waiter = tokio::spawn(async move {
        t2.call(ID, Some(7), "exec", json!(1), json!(1), || async {
            Err::<CommandResult, _>(CallFailed::new(codes::INTERNAL, "must not run"))
        })
        .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let _ = go_tx.send(());
    let got = waiter.await.unwrap().unwrap();
    assert!(got.replayed);
    assert_eq!(got.value.exit_code, 3);
    assert_eq!(t.read(ID).unwrap().len(), 1);
}

#[tokio::test]
async fn internal_errors_free_the_step_user_errors_complete_it() {
    let d = tempfile::tempdir().unwrap();
    let t = traj(d.path());
    t.begin(ID, None).unwrap();
    let e = t
        .call(ID, Some(1), "stat", json!(1), json!(1), || async {
            Err::<FileInfo, _>(CallFailed::new(codes::INTERNAL, "agent hiccup"))
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), "internal");
    let e = t
        .call(ID, Some(1), "stat", json!(1), json!(1), || async {
            Err::<FileInfo, _>(CallFailed::new(codes::FILE_NOT_FOUND, "no /x"))
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), "file_not_found");
    let e = t
        .call(ID, Some(1), "stat", json!(1), json!(1), || async {
            Err::<FileInfo, _>(CallFailed::new(codes::INTERNAL, "must not run"))
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), "file_not_found", "replayed user error");
    assert_eq!(t.read(ID).unwrap().len(), 2);
}

#[test]
fn closed_logs_are_synced_by_the_next_group_commit() {
    let d = tempfile::tempdir().unwrap();
    let t = traj(d.path());
    assert_eq!(t.config().fsync, FsyncPolicy::Batch);
    t.begin(ID, None).unwrap();
    t.note(ID, "stop", json!({}), Ok(json!({})));
    t.close(ID);
    assert!(!lock(&t.logs).contains_key(ID));
    assert_eq!(lock(&t.closing).len(), 1, "closed with a record pending");
    t.sync_all();
    assert!(lock(&t.closing).is_empty(), "synced and dropped");
    // A log closed with nothing pending is not queued.
    let other = "sb-n0-00000000000000dd";
    t.begin(other, None).unwrap();
    t.note(other, "stop", json!({}), Ok(json!({})));
    t.sync_all();
    t.close(other);
    assert!(lock(&t.closing).is_empty());
    assert_eq!(t.read(ID).unwrap().len(), 1);
}

#[test]
fn begin_on_an_existing_log_keeps_its_records() {
    let d = tempfile::tempdir().unwrap();
    let t = traj(d.path());
    t.begin(ID, None).unwrap();
    t.note(ID, "create", json!({}), Ok(json!({})));
    t.close(ID);
    let t2 = traj(d.path());
    t2.begin(ID, None).unwrap();
    t2.note(ID, "x", json!({}), Ok(json!({})));
    let seqs: Vec<u64> = t2.read(ID).unwrap().iter().map(|r| r.seq).collect();
    assert_eq!(seqs, vec![1, 2]);
}

#[test]
fn begin_makes_the_directory_on_demand() {
    let d = tempfile::tempdir().unwrap();
    let t = traj(&d.path().join("a/b"));
    t.begin(ID, None).unwrap();
    assert!(d.path().join(format!("a/b/{ID}.log")).is_file());
}

#[tokio::test]
async fn disabled_sandboxes_keep_no_log() {
    let d = tempfile::tempdir().unwrap();
    let t = traj(d.path());
    t.begin(ID, Some(false)).unwrap();
    for _ in 0..2 {
        let a = t
            .call(ID, Some(1), "shell", json!(1), json!(1), || async {
                Ok(CommandResult::default())
            })
            .await
            .unwrap();
        assert!(!a.replayed);
    }
    assert!(!t.last_step(ID).unwrap().enabled);
    assert!(matches!(t.read(ID), Err(TrajectoryError::NoLog(_))));
}

#[test]
fn reaper_keeps_open_and_recent_logs() {
    let d = tempfile::tempdir().unwrap();
    let t = traj(d.path());
    t.begin(ID, None).unwrap();
    let old = d.path().join("sb-n0-00000000000000bb.log");
    std::fs::write(&old, b"").unwrap();
    let f = std::fs::File::options().append(true).open(&old).unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(8 * 24 * 3600))
        .unwrap();
    let recent = d.path().join("sb-n0-00000000000000cc.log");
    std::fs::write(&recent, b"").unwrap();
    assert_eq!(t.reap(), vec!["sb-n0-00000000000000bb".to_string()]);
    assert!(recent.exists());
    assert!(t.log_path(ID).unwrap().exists());
}

#[test]
fn config_validation() {
    assert!(TrajectoryConfig::default().validate().is_ok());
    let c = TrajectoryConfig {
        retention_hours: 0,
        ..Default::default()
    };
    assert_eq!(c.validate().unwrap_err().0, "trajectory.retention_hours");
}
