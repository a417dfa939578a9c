//! The edge's driver for the microVM substrate ([`dsec_runtime::microvm`]).
//!
//! Sandboxes with `substrate: "microvm"` are routed here by the manager when the guest
//! artefacts exist (`scripts/vm/build-guest.sh`); otherwise the create answers 501 with the
//! reason. Pause snapshots the guest to disk and ends QEMU, resume restores it; a paused
//! microVM is re-adopted after an edge restart (its snapshot is on disk), a running one is not
//! (its channel closed with the old edge, which ends the guest).

use std::path::PathBuf;
use std::sync::Arc;

use dsec_runtime::aether_client::AetherClient;
use dsec_runtime::container::adopt::AdoptError;
use dsec_runtime::container::pause::PauseError;
use dsec_runtime::microvm::vm::{destroy_vm, VmSandbox};
use dsec_runtime::microvm::{MicroVmSandbox, MicroVmSubstrate};
use dsec_runtime::substrate::{
    CreateSandboxError, DestroySandboxError, SandboxSpec, Substrate as _, Usage,
};
use dsec_wire::api::PauseReport;

use crate::substrate::{BoxFut, Driver, LiveSandbox, WritableLayer};
use crate::vm_config::MicroVmSection;

/// Whether `bin` (a path, or a name looked up in `PATH`) is an installed file.
pub fn installed(bin: &std::path::Path) -> bool {
    if bin.is_absolute() {
        return bin.is_file();
    }
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(bin).is_file()))
        .unwrap_or(false)
}

/// The driver if the guest is built and QEMU is installed, else why not (for the 501).
///
/// `section` is the validated `[edge.microvm]` of the edge config; `blob_dir` the image store's
/// blob directory. microVM templates (restore-from-template boots, `templates = false` turns
/// them off) live in `<edge dir>/microvm-templates`.
pub fn driver(
    aether_path: PathBuf,
    blob_dir: Option<PathBuf>,
    edge_dir: &std::path::Path,
    section: &MicroVmSection,
) -> Result<Arc<dyn Driver>, String> {
    let config = section
        .runtime_config(aether_path, blob_dir.into_iter().collect())
        .map_err(|e| e.to_string())?;
    config.check_guest()?;
    let qemu = &config.qemu_binary;
    if !installed(qemu) {
        return Err(format!(
            "{} is not installed: run scripts/install-deps.sh (qemu-system-x86)",
            qemu.display()
        ));
    }
    tracing::info!(
        guest = %config.guest_dir.display(), accel = config.accel.as_str(),
        machine = config.machine.as_str(), "microVM substrate available"
    );
    let templates = section.template_config(&edge_dir.join("microvm-templates"));
    tracing::info!(
        enabled = templates.enabled, max = templates.max,
        dir = %templates.dir.display(), "microVM templates"
    );
    let inner = Arc::new(MicroVmSubstrate::new(config).with_templates(templates));
    // Copies left by image removals while this edge was down, or by other edges.
    let (sweep, dir) = (inner.clone(), edge_dir.to_path_buf());
    std::thread::spawn(move || MicroVmDriver::sweep_pmem(&sweep, &dir));
    Ok(Arc::new(MicroVmDriver {
        inner,
        edge_dir: edge_dir.to_path_buf(),
    }))
}

/// [`Driver`] for the microVM substrate.
pub struct MicroVmDriver {
    inner: Arc<MicroVmSubstrate>,
    /// The edge's directory: its sandboxes may name virtio-pmem copies in use.
    edge_dir: PathBuf,
}

impl MicroVmDriver {
    /// Removes the virtio-pmem layer copies no image or VM needs (blocking).
    fn sweep_pmem(inner: &MicroVmSubstrate, edge_dir: &std::path::Path) {
        // Paused VMs' qemu.args; templates need none (a create re-makes its copies first).
        let protect = [edge_dir.join("sandboxes")];
        if let Err(e) = inner.sweep_pmem(&protect) {
            tracing::warn!(error = %e, "sweep the virtio-pmem layer copies");
        }
    }
}

impl Driver for MicroVmDriver {
    fn kind(&self) -> dsec_wire::api::Substrate {
        dsec_wire::api::Substrate::Microvm
    }

    fn create(
        &self,
        spec: SandboxSpec,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, CreateSandboxError>> {
        Box::pin(async move {
            let sandbox = self.inner.create(spec).await?;
            Ok(Box::new(VmLive(sandbox)) as Box<dyn LiveSandbox>)
        })
    }

    fn reap_orphans(&self, known_live: Vec<String>) -> BoxFut<'_, Vec<String>> {
        Box::pin(async move { self.inner.reap_orphans(&known_live).await })
    }

    fn shutdown(&self) -> BoxFut<'_, ()> {
        Box::pin(async move {
            if let Some(t) = self.inner.templates() {
                t.shutdown().await;
            }
        })
    }

    fn templates(&self) -> Option<serde_json::Value> {
        let t = self.inner.templates()?;
        let s = &t.stats;
        let n = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        Some(serde_json::json!({
            "dir": t.config().dir,
            "max": t.config().max,
            "templates": t.list(),
            "boots": {
                "cold": n(&s.cold),
                "template": n(&s.templated),
                "cold_fallback": n(&s.fallbacks),
            },
            "built": n(&s.built),
            "build_failures": n(&s.build_failures),
        }))
    }

    fn remove_templates(&self) -> Option<usize> {
        Some(self.inner.templates()?.remove_all())
    }

    fn images_removed(&self) -> BoxFut<'_, ()> {
        Box::pin(async move {
            let (inner, dir) = (self.inner.clone(), self.edge_dir.clone());
            let _ =
                tokio::task::spawn_blocking(move || MicroVmDriver::sweep_pmem(&inner, &dir)).await;
        })
    }

    fn adopt(
        &self,
        id: String,
        dir: PathBuf,
        pid: i32,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, AdoptError>> {
        Box::pin(async move {
            let adopted = self.inner.adopt_paused(&id, &dir);
            adopt_paused_vm("microVM", adopted, id, &dir, pid).await
        })
    }
}

/// The re-adoption of both VM substrates after an edge restart: a paused VM (`adopted`: taken
/// over from its snapshot on disk) is live again; any other is gone — its QEMU, if the old edge
/// left one running (a guest ends on its own when the old channel closes, but not at once: a
/// loaded TCG guest may take seconds), is ended by its pidfile, then the directory is removed.
pub(crate) async fn adopt_paused_vm<T: EdgeVm>(
    kind: &str,
    adopted: Result<T, String>,
    id: String,
    dir: &std::path::Path,
    pid: i32,
) -> Result<Box<dyn LiveSandbox>, AdoptError> {
    match adopted {
        Ok(sandbox) => Ok(Box::new(VmLive(sandbox)) as Box<dyn LiveSandbox>),
        Err(why) => {
            tracing::info!(sandbox = %id, reason = %why, "{kind} not re-adoptable (only paused ones are)");
            let vm_dir = dir.join("vm");
            if dsec_runtime::microvm::vm::kill_leftover_qemu(&vm_dir) {
                tracing::info!(sandbox = %id, "ended the QEMU of a {kind} the old edge left running");
            }
            let _ = tokio::fs::remove_dir_all(&vm_dir).await;
            Err(AdoptError::Gone { id, pid })
        }
    }
}

/// A sandbox of either VM substrate as the edge drives it (shared with [`crate::fullvm`]): its
/// [`Vm`](dsec_runtime::microvm::vm::Vm) pauses by snapshot, resumes and dies the same way.
pub(crate) struct VmLive<T>(pub(crate) T);

/// What the edge needs of a VM sandbox beyond its [`VmSandbox`] machinery.
pub(crate) trait EdgeVm: VmSandbox + 'static {
    /// The guest's writable layer as host files (for `pack_diff`), if the substrate has one.
    fn writable_layer(&self) -> BoxFut<'_, Result<Option<WritableLayer>, String>> {
        Box::pin(async { Ok(None) })
    }
    /// How the VM started (`cold`, `template`, `cold-fallback`), if the substrate has templates.
    fn boot_kind(&self) -> Option<&'static str> {
        None
    }
}

impl EdgeVm for MicroVmSandbox {
    fn boot_kind(&self) -> Option<&'static str> {
        Some(MicroVmSandbox::boot_kind(self).as_str())
    }

    fn writable_layer(&self) -> BoxFut<'_, Result<Option<WritableLayer>, String>> {
        Box::pin(async move {
            let m = self.expose_upper().await?;
            Ok(Some(WritableLayer {
                upper: m.upper.clone(),
                release: Box::new(move || Box::pin(m.release())),
            }))
        })
    }
}

impl<T: EdgeVm> LiveSandbox for VmLive<T> {
    fn id(&self) -> &str {
        self.0.id()
    }

    fn aether(&self) -> &AetherClient {
        self.0.aether()
    }

    fn pid(&self) -> i32 {
        self.0.pid()
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
                _ = self.0.aether().closed() => {}
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

    fn writable_layer(&self) -> BoxFut<'_, Result<Option<WritableLayer>, String>> {
        EdgeVm::writable_layer(&self.0)
    }

    fn boot_kind(&self) -> Option<&'static str> {
        EdgeVm::boot_kind(&self.0)
    }
}

/// `GET /edge/v1/microvm/templates`: the templates (key, shape, bytes on disk, uses) and how
/// creates started.
pub async fn list_templates(
    axum::extract::State(s): axum::extract::State<crate::http::AppState>,
) -> Result<axum::Json<serde_json::Value>, crate::error::EdgeError> {
    s.mgr.microvm_templates().map(axum::Json)
}

/// `DELETE /edge/v1/microvm/templates`: removes every template (later creates boot cold and
/// build them again).
pub async fn remove_templates(
    axum::extract::State(s): axum::extract::State<crate::http::AppState>,
) -> Result<axum::Json<serde_json::Value>, crate::error::EdgeError> {
    let removed = s.mgr.remove_microvm_templates()?;
    Ok(axum::Json(serde_json::json!({ "removed": removed })))
}
