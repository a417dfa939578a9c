//! Destroying a container: aether killed (and with it the sandbox's pid namespace), its
//! cgroup and directories removed, the disk limit released.

use super::*;

impl ContainerSubstrate {
    /// Kills everything in the container and removes its cgroup and directories. Idempotent.
    pub async fn destroy(&self, sb: &ContainerSandbox) -> Result<(), DestroySandboxError> {
        self.destroy_in(sb, sb.dirs.base.clone()).await
    }

    /// [`ContainerSubstrate::destroy`] after moving the sandbox's directory to `to` first (its
    /// mounts live only in its own mount namespace, which holds them by reference); the disk
    /// limit's file system, which moved with it, is released there. The directory's contents
    /// are left for the caller (removed or recycled in the background). Answers whether the
    /// directory is at `to` now.
    pub async fn destroy_moving_dir(
        &self,
        sb: &ContainerSandbox,
        to: &Path,
    ) -> (bool, Result<(), DestroySandboxError>) {
        let moved = match move_dir(&sb.dirs.base, to) {
            Ok(()) => true,
            Err(e) => {
                if sb.dirs.base.exists() {
                    tracing::warn!(sandbox = %sb.id, to = %to.display(), error = %e, "move sandbox dir before destroy");
                }
                false
            }
        };
        let base = if moved {
            to.to_path_buf()
        } else {
            sb.dirs.base.clone()
        };
        (moved, self.destroy_in(sb, base).await)
    }

    /// Destroys with the sandbox's directory at `base` (where the disk limit's file system is
    /// released).
    async fn destroy_in(
        &self,
        sb: &ContainerSandbox,
        base: PathBuf,
    ) -> Result<(), DestroySandboxError> {
        let p = &sb.process;
        let t0 = std::time::Instant::now();
        if sb.is_frozen() {
            // A frozen (paused) task does not die of SIGKILL under the v1 freezer.
            let _ = sb.resume().await;
        }
        // No polite `Shutdown` round trip: SIGKILL of aether, the pid namespace's init, makes
        // the kernel kill every process of the sandbox, and aether keeps nothing to flush.
        let io_err =
            |what: &str, e: Box<dyn std::error::Error + Send + Sync>| DestroySandboxError::Io {
                id: sb.id.clone(),
                what: what.to_string(),
                source: io::Error::other(e),
            };
        let exited = t0.elapsed();
        p.kill()
            .await
            .map_err(|e| io_err("kill aether", e.into()))?;
        let killed = t0.elapsed();
        // Every process of the sandbox is dead (aether, its pid namespace's init, is reaped
        // after all of them): its mounts go away on a blocking thread (see `mntns`).
        let held = sb.mnt_ns.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(h) = held {
            h.release_in_background();
        }
        teardown(sb.cgroup.clone(), sb.dirs.clone())
            .await
            .map_err(|e| io_err("remove cgroup and dirs", e.into()))?;
        // The disk limit's file system (if any) is unmounted once nothing runs on it.
        tokio::task::spawn_blocking(move || disk::release(&base))
            .await
            .map_err(|e| io_err("release disk limit", e.into()))?;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        // The edge logs "sandbox ended" (with the whole destroy's time) at INFO.
        tracing::debug!(
            sandbox = %sb.id,
            exit_ms = ms(exited),
            kill_ms = ms(killed - exited),
            teardown_ms = ms(t0.elapsed() - killed),
            "container destroyed"
        );
        Ok(())
    }
}

/// Removes the cgroup of a container whose aether was reaped. Its processes are all gone
/// (aether is the init of their pid namespace), so an empty cgroup is removed with plain
/// rmdirs; [`Cgroup::destroy`] freezes and thaws before it kills, and on v1 each freeze of a
/// cgroup turns the kernel's `freezer_active` static key on and each thaw off again: code
/// patching with IPIs to every CPU, twice per stop (`perf`: `arch_jump_label_transform_apply`
/// under `freezer_write`, ≈ 0.12 ms of CPU per sandbox at 100 stops/s). Anything left (a
/// process, or a directory still busy) goes through the full destroy.
pub(super) fn remove_dead_cgroup(cgroup: &Cgroup) -> Result<(), crate::cgroup::CgroupError> {
    if !cgroup.procs().is_ok_and(|p| p.is_empty()) {
        return cgroup.destroy();
    }
    let dirs = match cgroup {
        Cgroup::V1(c) => c.removal_order(),
        Cgroup::V2(c) => c.removal_order(),
    };
    for d in &dirs {
        match std::fs::remove_dir(d) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(_) => return cgroup.destroy(),
        }
    }
    Ok(())
}

/// Ending a container's processes or removing what it left (cgroup, directories) failed.
#[derive(Debug, thiserror::Error)]
pub enum TeardownError {
    #[error("kill aether (pid {pid}): {source}")]
    Kill { pid: i32, source: io::Error },
    #[error("aether (pid {0}) did not exit after SIGKILL")]
    KillTimeout(i32),
    #[error("destroy cgroup: {0}")]
    Cgroup(crate::cgroup::CgroupError),
    #[error("remove {}: {source}", path.display())]
    RemoveDir { path: PathBuf, source: io::Error },
    #[error("teardown task: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// Both the cgroup and the directories failed.
    #[error("{0}; {1}")]
    Both(Box<TeardownError>, Box<TeardownError>),
}

/// Destroys the cgroup (killing stragglers) and removes the sandbox's dirs.
pub(super) async fn teardown(cgroup: Cgroup, dirs: SandboxDirs) -> Result<(), TeardownError> {
    tokio::task::spawn_blocking(move || {
        let cg = remove_dead_cgroup(&cgroup).map_err(TeardownError::Cgroup);
        let d = dirs
            .remove()
            .map_err(|(path, source)| TeardownError::RemoveDir { path, source });
        match (cg, d) {
            (Ok(()), Ok(())) => Ok(()),
            (Err(e), Ok(())) | (Ok(()), Err(e)) => Err(e),
            (Err(a), Err(b)) => Err(TeardownError::Both(Box::new(a), Box::new(b))),
        }
    })
    .await?
}

/// Renames a sandbox's directory to `to`, making `to`'s parent when it is missing.
fn move_dir(from: &Path, to: &Path) -> io::Result<()> {
    match std::fs::rename(from, to) {
        Err(e) if e.kind() == io::ErrorKind::NotFound && from.exists() => {
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::rename(from, to)
        }
        other => other,
    }
}
