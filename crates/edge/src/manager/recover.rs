//! Recovery at start: re-adopting the sandboxes an earlier (crashed) edge run left behind,
//! cleaning up those that cannot be.

use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use dsec_runtime::substrate::ImageSource;
use dsec_wire::api::EndReason;
use dsec_wire::api::{SandboxInfo, SandboxState};
use dsec_wire::id::is_valid_sandbox_id;
use tokio::sync::OnceCell;

use crate::records::{self, SandboxRecord};

use super::{lock, now_ms, remove_dir, Entry, Manager};

impl Manager {
    /// Takes over what an earlier, crashed run of the edge left behind.
    ///
    /// For each record: if its aether is still alive (the pid is verified through a pidfd and
    /// its cgroup), the substrate reconnects to it (`Substrate::adopt`) and the sandbox is live
    /// again with its sessions, its image lease and its recorded state (paused stays paused).
    /// Otherwise it is killed, its directory removed and a tombstone (state `failed`, with the
    /// reason) left so `GET` tells what happened. The substrate then reaps every cgroup no
    /// adopted sandbox owns. Returns the ids cleaned up (not the adopted ones).
    pub async fn recover(self: &Arc<Self>) -> Vec<String> {
        let trash = self.cfg.edge_dir().join(records::TRASH_DIR);
        if let Err(e) = records::empty_trash(&trash) {
            tracing::error!(dir = %trash.display(), error = %e, "empty the trash of ended sandboxes");
        }
        let spare = self.cfg.edge_dir().join(records::SPARE_DIR);
        if let Err(e) = records::drop_spares(&spare) {
            tracing::error!(dir = %spare.display(), error = %e, "remove spare sandbox dirs");
        }
        let dir = self.cfg.sandboxes_dir();
        let found = match records::scan(&dir) {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(dir = %dir.display(), error = %e, "scan sandbox records");
                Vec::new()
            }
        };
        let mut reaped = Vec::new();
        let mut adopted = Vec::new();
        for f in found {
            let why = match &f.record {
                Ok(rec)
                    if (rec.pid > 1 && rec.info.state != SandboxState::Creating)
                        // A paused VM has no process, only its snapshot on disk (a substrate
                        // this node lacks says so in the readopt's error).
                        || (rec.info.state == SandboxState::Paused
                            && self
                                .substrates
                                .capabilities(rec.info.substrate)
                                .is_none_or(|c| c.pause_ends_process)) =>
                {
                    match self.readopt(&f.id, &f.dir, rec).await {
                        Ok(()) => {
                            adopted.push(f.id.clone());
                            continue;
                        }
                        Err(e) => e.to_string(),
                    }
                }
                Ok(rec) => format!(
                    "record in state {:?} without a running agent",
                    rec.info.state
                ),
                Err(e) => format!("unreadable record: {e}"),
            };
            if let Ok(rec) = &f.record {
                if rec.pid > 1 && records::pid_belongs_to(rec.pid, &f.id) {
                    // v1 freezer: a frozen task ignores SIGKILL until thawed.
                    if let Ok(cg) = dsec_runtime::cgroup::Cgroup::open(
                        &dsec_runtime::cgroup::CgroupRoot::detect(),
                        &self.cfg.cgroup_parent(),
                        &f.id,
                    ) {
                        let _ = cg.thaw();
                    }
                    let gone =
                        records::kill_and_wait(rec.pid, std::time::Duration::from_secs(5)).await;
                    tracing::warn!(sandbox = %f.id, pid = rec.pid, gone, "killed a sandbox agent that could not be re-adopted");
                }
            }
            tracing::warn!(sandbox = %f.id, reason = %why, "sandbox of an earlier edge run not re-adopted: cleaning it up");
            dsec_runtime::container::disk::release(&f.dir);
            if let Err(e) = remove_dir(&f.dir) {
                tracing::error!(sandbox = %f.id, dir = %f.dir.display(), error = %e, "remove leftover sandbox dir");
            }
            let mut info = match &f.record {
                Ok(rec) => rec.info.clone(),
                Err(_) => SandboxInfo {
                    id: f.id.clone(),
                    node: self.cfg.node_id.clone(),
                    ..Default::default()
                },
            };
            info.state = SandboxState::Failed;
            crate::end_reason::set(
                &mut info,
                EndReason::EdgeRestartNotAdopted,
                format!("lost in a restart of the edge and cleaned up: {why}"),
            );
            crate::trajectory::hooks::end(&self.traj, &info);
            self.tombstone(&mut lock(&self.state), info);
            self.metrics.sandboxes_failed.inc();
            reaped.push(f.id);
        }
        let mut by_substrate = Vec::new();
        for s in self.substrates.available() {
            by_substrate.extend(s.reap_orphans(adopted.clone()).await);
        }
        crate::network::recover(&self.net, &self.cfg, &adopted).await;
        {
            let (vols, adopted) = (self.volumes.clone(), adopted.clone());
            if let Err(e) = tokio::task::spawn_blocking(move || vols.recover(&adopted)).await {
                tracing::error!(error = %e, "recover volumes");
            }
        }
        for id in by_substrate {
            tracing::warn!(sandbox = %id, "substrate reaped leftovers");
            if !reaped.contains(&id) {
                reaped.push(id);
            }
        }
        tracing::info!(
            adopted = adopted.len(),
            cleaned = reaped.len(),
            "recovered sandboxes of an earlier edge run"
        );
        reaped
    }

    /// Re-adopts one recorded sandbox; on error nothing was registered.
    async fn readopt(
        self: &Arc<Self>,
        id: &str,
        dir: &Path,
        rec: &SandboxRecord,
    ) -> Result<(), ReadoptError> {
        if !is_valid_sandbox_id(id) || rec.info.id != id {
            return Err(ReadoptError::WrongId(rec.info.id.clone()));
        }
        let substrate = self
            .substrates
            .get(rec.info.substrate)
            .map_err(ReadoptError::Substrate)?;
        // A disk-image substrate (full VM) boots a disk image, not the layer store's image:
        // no lease.
        let lease = match substrate.capabilities().image_source {
            ImageSource::DiskImage => None,
            ImageSource::Layers => {
                Some(self.images.acquire(&rec.image).await.map_err(|source| {
                    ReadoptError::Lease {
                        image: rec.image.clone(),
                        source,
                    }
                })?)
            }
        };
        let sandbox: Arc<dyn dsec_runtime::substrate::LiveSandbox> = substrate
            .adopt(id.to_string(), dir.to_path_buf(), rec.pid)
            .await?
            .into();
        let mut info = rec.info.clone();
        let paused = sandbox.is_paused();
        info.state = if paused {
            SandboxState::Paused
        } else {
            SandboxState::Running
        };
        if !paused {
            info.paused_at = None;
        }
        let aether = sandbox.aether().clone();
        let now = now_ms();
        let entry = Arc::new(Entry {
            id: id.to_string(),
            dir: dir.to_path_buf(),
            memory_mb: info.memory_limit_mb,
            cpu: info.cpu_cores_limit,
            info: Mutex::new(info),
            sandbox,
            aether,
            lease: Mutex::new(lease),
            ended: OnceCell::new(),
            env: rec.env.clone(),
            created_ms: if rec.created_ms > 0 {
                rec.created_ms
            } else {
                now
            },
            // The idle clock restarts: time the edge was down does not count as idle.
            last_request_ms: AtomicU64::new(now),
            inflight: AtomicU64::new(0),
            op: tokio::sync::Mutex::new(()),
        });
        entry.persist();
        self.qos.adopt(id, rec.info.qos, entry.memory_mb, entry.cpu);
        {
            let mut st = lock(&self.state);
            st.count += 1;
            st.memory_mb += entry.memory_mb;
            st.cpu += entry.cpu;
            st.live.insert(id.to_string(), entry.clone());
        }
        self.metrics.sandboxes_running.inc();
        tracing::info!(sandbox = %id, paused, "re-adopted sandbox of an earlier edge run");
        self.watch(entry);
        Ok(())
    }
}

/// Why a recorded sandbox could not be re-adopted (the reason in its tombstone).
#[derive(Debug, thiserror::Error)]
enum ReadoptError {
    #[error("record names sandbox {0:?}")]
    WrongId(String),
    #[error(transparent)]
    Substrate(crate::error::EdgeError),
    #[error("re-take image lease on {image}: {source}")]
    Lease {
        image: String,
        #[source]
        source: dsec_image::ImageError,
    },
    #[error(transparent)]
    Adopt(#[from] dsec_runtime::error::AdoptError),
}
