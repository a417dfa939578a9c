//! Pause and resume of a QEMU guest (both VM substrates): the guest is migrated to a file
//! (`<vm dir>/snapshot`) and QEMU ends, so the paused VM holds no memory; resume starts QEMU
//! paused for an incoming migration and restores the file into it. Template clones
//! ([`Vm::restore_clone`]) restore the same way from a template's snapshot.

use super::error::VmError;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dsec_wire::api::PauseReport;
use tokio::net::UnixStream;

use super::qmp::{Qmp, QmpError};
use super::relay::{outq, Relay};
use super::vm::*;
use crate::aether_client::AetherClient;
use crate::error::PauseError;

impl Vm {
    pub fn snapshot_path(&self) -> PathBuf {
        self.vm_dir.join(SNAPSHOT)
    }

    /// Snapshots the guest to `<vm_dir>/snapshot` and ends QEMU.
    pub async fn pause(&self) -> Result<PauseReport, PauseError> {
        let started = Instant::now();
        let mut phase = self.phase.lock().await;
        let proc = match std::mem::replace(&mut *phase, Phase::Gone) {
            Phase::Running(p) => p,
            other => {
                let paused = matches!(other, Phase::Paused(_));
                *phase = other;
                return if paused {
                    Err(PauseError::AlreadyPaused {
                        id: self.id.clone(),
                    })
                } else {
                    Err(PauseError::Gone {
                        id: self.id.clone(),
                    })
                };
            }
        };
        let (before, anon, file) = rss_of(proc.pid);
        // Dirty guest pages of the writable disk reach the image file (pack reads it there).
        self.sync_guest().await;
        match self.snapshot(proc).await {
            Ok((parked, snap_bytes)) => {
                *phase = Phase::Paused(parked);
                self.pid.store(0, Ordering::SeqCst);
                self.paused.store(true, Ordering::SeqCst);
                Ok(PauseReport {
                    memory_before_bytes: before,
                    memory_after_bytes: 0,
                    page_cache_before_bytes: file,
                    page_cache_after_bytes: 0,
                    anon_before_bytes: anon,
                    anon_after_bytes: 0,
                    method: format!(
                        "snapshot: QMP stop + migrate to {} ({snap_bytes} bytes), QEMU ended",
                        self.snapshot_path().display()
                    ),
                    pause_ms: started.elapsed().as_secs_f64() * 1000.0,
                    snapshot_bytes: Some(snap_bytes),
                })
            }
            Err((proc, e)) => {
                let _ = std::fs::remove_file(self.vm_dir.join(format!("{SNAPSHOT}.tmp")));
                *phase = match proc {
                    Some(p) => Phase::Running(p),
                    None => {
                        let _ = self.dead_tx.send(true);
                        Phase::Gone
                    }
                };
                Err(e)
            }
        }
    }

    /// The snapshot steps; on error gives the process back when it still runs (and the guest
    /// was continued).
    async fn snapshot(&self, mut proc: Proc) -> Result<(Parked, u64), (Option<Proc>, PauseError)> {
        let end = match tokio::time::timeout(Duration::from_secs(10), proc.relay.detach()).await {
            Ok(Ok(end)) if !end.broken => end,
            Ok(Ok(_)) => return Err(fail_dead(proc, "the VM's channel broke")),
            Ok(Err(e)) => return Err(fail_dead(proc, &e.to_string())),
            Err(_) => {
                return Err(fail_dead(
                    proc,
                    "the guest did not take the bytes sent to it within 10 s",
                ))
            }
        };
        // Bytes for the guest that QEMU has not read yet would die with it: let the guest
        // (still running) take them first.
        let deadline = Instant::now() + Duration::from_secs(5);
        while outq(&end.qemu_w).unwrap_or(0) > 0 {
            if Instant::now() > deadline {
                proc.relay.reattach(end);
                return Err((
                    Some(proc),
                    vm_err("the guest did not read its channel within 5 s; not paused"),
                ));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let qmp_path = self.vm_dir.join("qmp.sock");
        let tmp = self.vm_dir.join(format!("{SNAPSHOT}.tmp"));
        let steps = async {
            let mut q = Qmp::connect_retry(&qmp_path, Duration::from_secs(5)).await?;
            q.stop().await?;
            Ok::<_, QmpError>(q)
        };
        let mut q = match steps.await {
            Ok(q) => q,
            Err(e) => {
                proc.relay.reattach(end);
                return Err((Some(proc), vm_err(format!("QMP stop: {e}"))));
            }
        };
        let uri = format!(
            "exec:cat > {}",
            super::args::shell_quote(&tmp.display().to_string())
        );
        let shared = self.launch.shared_memory();
        let migrated = async {
            if shared {
                q.set_capabilities(&[("x-ignore-shared", true)])
                    .await
                    .map_err(|e| e.to_string())?;
            }
            q.migrate(&uri).await.map_err(|e| e.to_string())?;
            q.wait_migration(Duration::from_secs(600))
                .await
                .map_err(|e| e.to_string())
        }
        .await;
        if let Err(e) = migrated {
            let _ = q.cont().await;
            proc.relay.reattach(end);
            return Err((Some(proc), vm_err(format!("snapshot: {e}"))));
        }
        if let Err(e) = std::fs::rename(&tmp, self.snapshot_path()) {
            let _ = q.cont().await;
            proc.relay.reattach(end);
            return Err((Some(proc), vm_err(format!("rename the snapshot: {e}"))));
        }
        proc.intentional.store(true, Ordering::SeqCst);
        let _ = q.quit().await;
        drop(q);
        let mut exited = proc.exited.clone();
        if tokio::time::timeout(Duration::from_secs(10), exited.wait_for(|e| *e))
            .await
            .is_err()
        {
            // SAFETY: kill(2) on QEMU's pid, which is not reaped yet (its waiter has not
            // reported the exit).
            unsafe { libc::kill(proc.pid, libc::SIGKILL) };
            let _ = tokio::time::timeout(Duration::from_secs(10), exited.wait_for(|e| *e)).await;
        }
        drop(end.qemu_w);
        let edge_w = match proc.relay.finish().await {
            Ok(Some(w)) => w,
            Ok(None) => return Err((None, vm_err("the channel to the edge closed"))),
            Err(e) => return Err((None, vm_err(e.to_string()))),
        };
        let size = std::fs::metadata(self.snapshot_path())
            .map(|m| m.len())
            .unwrap_or(0);
        Ok((
            Parked {
                edge_r: end.edge_r,
                edge_w,
                pending: Vec::new(),
            },
            size,
        ))
    }

    /// Restores the guest from its snapshot and continues it.
    pub async fn resume(&self) -> Result<(), PauseError> {
        let mut phase = self.phase.lock().await;
        match &*phase {
            Phase::Paused(_) => {}
            Phase::Running(_) => return Ok(()),
            Phase::Gone => {
                return Err(PauseError::Gone {
                    id: self.id.clone(),
                })
            }
        }
        let snap = self.snapshot_path();
        if !snap.is_file() {
            return Err(vm_err(format!("snapshot {} is missing", snap.display())));
        }
        let (child, pid, stream, mut q) = restore_process(&self.launch, &self.vm_dir, &snap)
            .await
            .map_err(|source| PauseError::Restore {
                id: self.id.clone(),
                source,
            })?;
        let Phase::Paused(parked) = std::mem::replace(&mut *phase, Phase::Gone) else {
            unreachable!("checked above under the same lock")
        };
        let intentional = Arc::new(AtomicBool::new(false));
        let relay = Relay::start(
            parked.edge_r,
            parked.edge_w,
            stream,
            parked.pending,
            intentional.clone(),
        );
        let exited = spawn_waiter(
            child,
            intentional.clone(),
            self.dead_tx.clone(),
            self.died.clone(),
        );
        *phase = Phase::Running(Proc {
            pid,
            exited,
            intentional,
            relay,
        });
        self.pid.store(pid, Ordering::SeqCst);
        self.paused.store(false, Ordering::SeqCst);
        if let Err(e) = q.cont().await {
            // The process runs but the guest does not: treat as dead.
            let _ = self.dead_tx.send(true);
            return Err(vm_err(format!("cont after restore: {e}")));
        }
        // The snapshot is consumed: the next pause writes a new one.
        if let Err(e) = std::fs::remove_file(&snap) {
            tracing::warn!(vm = %self.id, error = %e, "remove the used snapshot");
        }
        Ok(())
    }
}

/// Starts QEMU with `launch` paused for an incoming migration and restores `snap` into it:
/// returns the process (not yet continued), its aether channel stream and its QMP connection.
/// On error the process is ended.
async fn restore_process(
    launch: &Launch,
    vm_dir: &Path,
    snap: &Path,
) -> Result<(tokio::process::Child, i32, UnixStream, Qmp), VmError> {
    let Started {
        mut child,
        pid,
        stream,
        ..
    } = start_qemu(launch, vm_dir, &["-S", "-incoming", "defer"]).await?;
    let uri = format!(
        "exec:cat {}",
        super::args::shell_quote(&snap.display().to_string())
    );
    let restore = async {
        let mut q = Qmp::connect_retry(&vm_dir.join("qmp.sock"), Duration::from_secs(10)).await?;
        if launch.shared_memory() {
            q.set_capabilities(&[("x-ignore-shared", true)]).await?;
        }
        q.migrate_incoming(&uri).await?;
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let st = q.query_status().await?;
            if st != "inmigrate" {
                break;
            }
            if Instant::now() > deadline {
                return Err(VmError::RestoreTimeout);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let m = q.query_migrate().await?;
        if m.status == "failed" {
            return Err(VmError::RestoreFailed(
                m.error.unwrap_or_else(|| "unknown error".into()),
            ));
        }
        Ok(q)
    };
    let restored = tokio::select! {
        r = restore => r,
        st = child.wait() => Err(VmError::ExitedDuringRestore(format!("{st:?}"))),
    };
    match restored {
        Ok(q) => Ok((child, pid, stream, q)),
        Err(e) => {
            let _ = child.start_kill();
            let _ = child.wait().await;
            let log = std::fs::read_to_string(vm_dir.join("qemu.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(3).collect();
            Err(VmError::Restore {
                source: Box::new(e),
                log: tail.into_iter().rev().collect::<Vec<_>>().join(" | "),
            })
        }
    }
}

impl Vm {
    /// Starts a new guest as a clone of a template snapshot (`snap`, taken of a guest with the
    /// same command line shape, see [`crate::microvm::template`]): QEMU restores it, a fresh aether
    /// channel is attached before the guest runs, then `cont`. The guest's aether keeps serving
    /// as it did in the template; the caller gives it its own identity.
    pub async fn restore_clone(
        id: &str,
        vm_dir: &Path,
        launch: Launch,
        snap: &Path,
    ) -> Result<Vm, VmError> {
        let args_json = serde_json::to_vec(&launch).map_err(|source| VmError::Launch {
            what: "encode args".into(),
            source,
        })?;
        std::fs::write(vm_dir.join(ARGS_FILE), args_json)
            .map_err(|e| VmError::io(format!("write {ARGS_FILE}"), e))?;
        let (child, pid, stream, mut q) = restore_process(&launch, vm_dir, snap).await?;
        let (client_end, edge_end) =
            UnixStream::pair().map_err(|e| VmError::io("socketpair", e))?;
        let aether = AetherClient::new(client_end);
        let (edge_r, edge_w) = edge_end.into_split();
        let intentional = Arc::new(AtomicBool::new(false));
        let relay = Relay::start(edge_r, edge_w, stream, Vec::new(), intentional.clone());
        let vm = Vm::running(id, vm_dir, launch, aether, child, pid, intentional, relay);
        if let Err(e) = q.cont().await {
            let _ = vm.kill().await;
            return Err(VmError::Cont(e));
        }
        Ok(vm)
    }
}
