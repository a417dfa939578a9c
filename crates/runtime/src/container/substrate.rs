//! The container substrate behind the one substrate interface ([`crate::substrate`]).

use std::path::PathBuf;
use std::sync::Arc;

use dsec_wire::api::PauseReport;

use super::adopt::AdoptError;
use super::pause::PauseError;
use super::{ContainerConfig, ContainerSandbox, ContainerSubstrate, SchedClass};
use crate::aether_client::AetherClient;
use crate::substrate::{
    BoxFut, Capabilities, CreateOptions, CreateSandboxError, DestroySandboxError, DiskLimit,
    ImageSource, LiveSandbox, OpenContext, SandboxSpec, Substrate, Unavailable, Usage,
};

/// What containers can do.
pub const CAPABILITIES: Capabilities = Capabilities {
    image_source: ImageSource::Layers,
    pack_diff: true,
    disk_limit: DiskLimit::HostFileSystem,
    sched_idle_at_spawn: true,
    pause_ends_process: false,
    early_teardown: true,
    cgroup_reclaim: true,
    ports_in_netns: true,
    volume_binds: true,
};

/// The container substrate of an edge (see [`ContainerDriver::open`]).
pub struct ContainerDriver {
    inner: Arc<ContainerSubstrate>,
}

impl ContainerDriver {
    pub fn new(substrate: ContainerSubstrate) -> Self {
        Self {
            inner: Arc::new(substrate),
        }
    }

    /// The container substrate as the edge configures it.
    pub fn open(ctx: &OpenContext) -> Result<Arc<dyn Substrate>, Unavailable> {
        Ok(Arc::new(Self::new(Self::configured(ctx))))
    }

    /// The [`ContainerSubstrate`] an edge with `ctx` runs its sandboxes on.
    pub fn configured(ctx: &OpenContext) -> ContainerSubstrate {
        ContainerSubstrate::new(ContainerConfig {
            aether_path: ctx.aether_path.clone(),
            cgroup_parent: ctx.cgroup_parent.clone(),
            shm_mb: ctx.shm_mb,
        })
        .with_reattach_grace(ctx.reattach_grace_ms)
        .with_disk_bps_limit(ctx.disk_bps_limit)
    }
}

struct ContainerLive {
    substrate: Arc<ContainerSubstrate>,
    sandbox: ContainerSandbox,
}

impl Substrate for ContainerDriver {
    fn kind(&self) -> dsec_wire::api::Substrate {
        dsec_wire::api::Substrate::Container
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn create(
        &self,
        spec: SandboxSpec,
        opts: CreateOptions,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, CreateSandboxError>> {
        let sched = if opts.sched_idle {
            SchedClass::Idle
        } else {
            SchedClass::Inherit
        };
        Box::pin(async move {
            let sandbox = self.inner.create_with(spec, sched).await?;
            Ok(Box::new(ContainerLive {
                substrate: self.inner.clone(),
                sandbox,
            }) as Box<dyn LiveSandbox>)
        })
    }

    fn reap_orphans(&self, known_live: Vec<String>) -> BoxFut<'_, Vec<String>> {
        Box::pin(async move { self.inner.reap_orphans(&known_live).await })
    }

    fn adopt(
        &self,
        id: String,
        dir: PathBuf,
        pid: i32,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, AdoptError>> {
        Box::pin(async move {
            let sandbox = self.inner.adopt(&id, &dir, pid).await?;
            Ok(Box::new(ContainerLive {
                substrate: self.inner.clone(),
                sandbox,
            }) as Box<dyn LiveSandbox>)
        })
    }
}

impl LiveSandbox for ContainerLive {
    fn id(&self) -> &str {
        self.sandbox.id()
    }

    fn aether(&self) -> &AetherClient {
        self.sandbox.aether()
    }

    fn pid(&self) -> i32 {
        self.sandbox.pid()
    }

    fn usage(&self) -> Usage {
        self.sandbox.usage()
    }

    fn oom_kills(&self) -> u64 {
        // v1 `memory.oom_control` / v2 `memory.events`, the `oom_kill` line only.
        self.sandbox.cgroup().oom_kills().unwrap_or(0)
    }

    fn destroy(&self) -> BoxFut<'_, Result<(), DestroySandboxError>> {
        Box::pin(self.substrate.destroy(&self.sandbox))
    }

    fn destroy_moving_dir<'a>(
        &'a self,
        to: &'a std::path::Path,
    ) -> BoxFut<'a, (bool, Result<(), DestroySandboxError>)> {
        Box::pin(self.substrate.destroy_moving_dir(&self.sandbox, to))
    }

    fn exited(&self) -> BoxFut<'_, ()> {
        Box::pin(async move {
            tokio::select! {
                _ = self.sandbox.exited() => {}
                _ = self.sandbox.aether().closed() => {}
            }
        })
    }

    fn pause(&self, reclaim_memory: bool) -> BoxFut<'_, Result<PauseReport, PauseError>> {
        Box::pin(self.sandbox.pause(reclaim_memory))
    }

    fn resume(&self) -> BoxFut<'_, Result<(), PauseError>> {
        Box::pin(self.sandbox.resume())
    }

    fn is_paused(&self) -> bool {
        self.sandbox.is_frozen()
    }

    fn cgroup(&self) -> Option<&crate::cgroup::Cgroup> {
        Some(self.sandbox.cgroup())
    }

    fn apply_qos(
        &self,
        settings: &crate::qos::QosSettings,
    ) -> Result<crate::qos::QosApplied, crate::qos::ApplyQosError> {
        self.sandbox.apply_qos(settings)
    }

    fn wait_released(&self, limit: std::time::Duration) -> bool {
        // The overlay and layer mounts live only in the container's mount namespace: the
        // directory is free once that namespace is gone (released in the background).
        super::mntns::wait_released(self.sandbox.id(), limit)
    }
}
