//! The microVM substrate behind the one substrate interface ([`crate::substrate`]).
//!
//! Available when the guest artefacts exist (`scripts/vm/build-guest.sh`) and QEMU is
//! installed; otherwise [`MicroVmDriver::open`] says why (the edge answers creates 501 with
//! it). Pause snapshots the guest to disk and ends QEMU, resume restores it; a paused microVM
//! is re-adopted after an edge restart (its snapshot is on disk), a running one is not (its
//! channel closed with the old edge, which ends the guest).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::{MicroVmSandbox, MicroVmSubstrate};
use crate::error::AdoptError;
use crate::substrate::vm::{adopt_paused_vm, installed, VmGuest, VmLive};
use crate::substrate::{
    BoxFut, Capabilities, CreateOptions, CreateSandboxError, DiskLimit, ImageSource, LiveSandbox,
    OpenContext, SandboxSpec, Substrate, Unavailable, WritableLayer, WritableLayerError,
};

/// What microVMs can do.
pub const CAPABILITIES: Capabilities = Capabilities {
    image_source: ImageSource::Layers,
    pack_diff: true,
    disk_limit: DiskLimit::OwnDisk,
    sched_idle_at_spawn: false,
    pause_ends_process: true,
    early_teardown: false,
    cgroup_reclaim: false,
    ports_in_netns: false,
    volume_binds: false,
};

/// The microVM substrate of an edge.
pub struct MicroVmDriver {
    inner: Arc<MicroVmSubstrate>,
    /// The edge's directory: its sandboxes may name virtio-pmem copies in use.
    edge_dir: PathBuf,
}

impl MicroVmDriver {
    /// The substrate if the guest is built and QEMU is installed, else why not.
    ///
    /// `ctx.microvm` is the configuration the edge built from its `[edge.microvm]` section,
    /// with the templates' (restore-from-template boots, in `<edge dir>/microvm-templates`).
    pub fn open(ctx: &OpenContext) -> Result<Arc<dyn Substrate>, Unavailable> {
        let (config, templates) = ctx.microvm.clone()?;
        config
            .check_guest()
            .map_err(|e| Unavailable(e.to_string()))?;
        let qemu = &config.qemu_binary;
        if !installed(qemu) {
            return Err(Unavailable(format!(
                "{} is not installed: run scripts/install-deps.sh (qemu-system-x86)",
                qemu.display()
            )));
        }
        tracing::info!(
            guest = %config.guest_dir.display(), accel = config.accel.as_str(),
            machine = config.machine.as_str(), "microVM substrate available"
        );
        tracing::info!(
            enabled = templates.enabled, max = templates.max,
            dir = %templates.dir.display(), "microVM templates"
        );
        let inner = Arc::new(MicroVmSubstrate::new(config).with_templates(templates));
        // Copies left by image removals while this edge was down, or by other edges.
        let (sweep, dir) = (inner.clone(), ctx.edge_dir.clone());
        std::thread::spawn(move || Self::sweep_pmem(&sweep, &dir));
        Ok(Arc::new(Self {
            inner,
            edge_dir: ctx.edge_dir.clone(),
        }))
    }

    /// Removes the virtio-pmem layer copies no image or VM needs (blocking).
    fn sweep_pmem(inner: &MicroVmSubstrate, edge_dir: &Path) {
        // Paused VMs' qemu.args; templates need none (a create re-makes its copies first).
        let protect = [edge_dir.join("sandboxes")];
        if let Err(e) = inner.sweep_pmem(&protect) {
            tracing::warn!(error = %e, "sweep the virtio-pmem layer copies");
        }
    }
}

impl Substrate for MicroVmDriver {
    fn kind(&self) -> dsec_wire::api::Substrate {
        dsec_wire::api::Substrate::Microvm
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn create(
        &self,
        spec: SandboxSpec,
        _opts: CreateOptions,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, CreateSandboxError>> {
        Box::pin(async move {
            let sandbox = self.inner.create(spec).await?;
            Ok(Box::new(VmLive(sandbox)) as Box<dyn LiveSandbox>)
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

    // reap_orphans: QEMU processes are children of the edge (killed on drop); a crashed
    // edge's guests die with their channel (aether exits, the kernel panics, -no-reboot ends
    // QEMU). The default (nothing to reap) applies.

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
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
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
            let _ = tokio::task::spawn_blocking(move || Self::sweep_pmem(&inner, &dir)).await;
        })
    }
}

impl VmGuest for MicroVmSandbox {
    fn id(&self) -> &str {
        &self.id
    }

    fn boot_kind(&self) -> Option<&'static str> {
        Some(MicroVmSandbox::boot_kind(self).as_str())
    }

    fn writable_layer(&self) -> BoxFut<'_, Result<Option<WritableLayer>, WritableLayerError>> {
        Box::pin(async move {
            let m = self
                .expose_upper()
                .await
                .map_err(|e| WritableLayerError(e.to_string()))?;
            Ok(Some(WritableLayer {
                upper: m.upper.clone(),
                release: Box::new(move || {
                    Box::pin(async move {
                        m.release()
                            .await
                            .map_err(|e| WritableLayerError(e.to_string()))
                    })
                }),
            }))
        })
    }
}
