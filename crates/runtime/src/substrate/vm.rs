//! The half of the substrate interface both QEMU substrates (microVM, full VM) share: a VM
//! sandbox pauses by snapshot, resumes, dies and is re-adopted the same way.

use std::path::Path;

use dsec_wire::api::PauseReport;

use super::{BoxFut, DestroySandboxError, LiveSandbox, Usage, WritableLayer, WritableLayerError};
use crate::aether_client::AetherClient;
use crate::error::{AdoptError, PauseError};
use crate::qemu::vm::{destroy_vm, kill_leftover_qemu, VmSandbox};

/// What a VM substrate's sandbox offers beyond its [`VmSandbox`] machinery.
pub trait VmGuest: VmSandbox + 'static {
    fn id(&self) -> &str;
    /// QEMU's resident memory: the guest's RAM as far as it was touched, plus QEMU itself
    /// (0 while paused: the snapshot is on disk).
    fn usage(&self) -> Usage {
        Usage {
            memory_bytes: crate::qemu::vm::rss_of(self.vm().pid()).0,
            pids: 1,
            oom_kills: 0,
        }
    }
    /// The guest's writable layer as host files (for `pack_diff`), if the substrate has one.
    fn writable_layer(&self) -> BoxFut<'_, Result<Option<WritableLayer>, WritableLayerError>> {
        Box::pin(async { Ok(None) })
    }
    /// How the VM started (`cold`, `template`, `cold-fallback`), if the substrate has templates.
    fn boot_kind(&self) -> Option<&'static str> {
        None
    }
}

/// A sandbox of either VM substrate as a [`LiveSandbox`].
pub struct VmLive<T>(pub T);

impl<T: VmGuest> LiveSandbox for VmLive<T> {
    fn id(&self) -> &str {
        self.0.id()
    }

    fn aether(&self) -> &AetherClient {
        self.0.vm().aether()
    }

    fn pid(&self) -> i32 {
        self.0.vm().pid()
    }

    fn usage(&self) -> Usage {
        self.0.usage()
    }

    fn destroy(&self) -> BoxFut<'_, Result<(), DestroySandboxError>> {
        Box::pin(destroy_vm(self.0.id(), self.0.vm(), self.0.vm_dir()))
    }

    fn exited(&self) -> BoxFut<'_, ()> {
        // The channel of a VM outlives its QEMU processes (pause ends one); it closes only
        // when the VM is gone, or when aether in the guest ended (a full VM's aether, started
        // by a systemd unit, is not the guest's PID 1, so the guest would not stop with it).
        Box::pin(async move {
            tokio::select! {
                _ = self.0.vm().dead() => {}
                _ = self.0.vm().aether().closed() => {}
            }
        })
    }

    fn pause(&self, _reclaim_memory: bool) -> BoxFut<'_, Result<PauseReport, PauseError>> {
        // Always "reclaims": the whole QEMU process ends.
        Box::pin(self.0.vm().pause())
    }

    fn resume(&self) -> BoxFut<'_, Result<(), PauseError>> {
        Box::pin(self.0.vm().resume())
    }

    fn is_paused(&self) -> bool {
        self.0.vm().is_paused()
    }

    fn writable_layer(&self) -> BoxFut<'_, Result<Option<WritableLayer>, WritableLayerError>> {
        VmGuest::writable_layer(&self.0)
    }

    fn boot_kind(&self) -> Option<&'static str> {
        VmGuest::boot_kind(&self.0)
    }
}

/// The re-adoption of both VM substrates after an edge restart: a paused VM (`adopted`: taken
/// over from its snapshot on disk) is live again; any other is gone — its QEMU, if the old edge
/// left one running (a guest ends on its own when the old channel closes, but not at once: a
/// loaded TCG guest may take seconds), is ended by its pidfile, then the directory is removed.
pub async fn adopt_paused_vm<T: VmGuest>(
    kind: &str,
    adopted: Result<T, crate::qemu::VmError>,
    id: String,
    dir: &Path,
    pid: i32,
) -> Result<Box<dyn LiveSandbox>, AdoptError> {
    match adopted {
        Ok(sandbox) => Ok(Box::new(VmLive(sandbox)) as Box<dyn LiveSandbox>),
        Err(why) => {
            tracing::info!(sandbox = %id, reason = %why, "{kind} not re-adoptable (only paused ones are)");
            let vm_dir = dir.join("vm");
            if kill_leftover_qemu(&vm_dir) {
                tracing::info!(sandbox = %id, "ended the QEMU of a {kind} the old edge left running");
            }
            let _ = tokio::fs::remove_dir_all(&vm_dir).await;
            Err(AdoptError::Gone { id, pid })
        }
    }
}

/// Whether `bin` (a path, or a name looked up in `PATH`) is an installed file.
pub fn installed(bin: &Path) -> bool {
    if bin.is_absolute() {
        return bin.is_file();
    }
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
        .unwrap_or(false)
}
