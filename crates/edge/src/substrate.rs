//! The edge's object-safe view of a substrate.
//!
//! [`dsec_runtime::substrate::Substrate`] uses `async fn` in a trait, whose futures cannot be
//! required to be `Send` in generic code on stable Rust. The edge therefore talks to substrates
//! through [`Driver`] / [`LiveSandbox`], which box `Send` futures, and implements them for each
//! concrete substrate (where the compiler can see that the futures are `Send`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use std::path::PathBuf;

use dsec_runtime::aether_client::AetherClient;
use dsec_runtime::cgroup::Cgroup;
use dsec_runtime::container::adopt::AdoptError;
use dsec_runtime::container::pause::PauseError;
use dsec_runtime::container::{ContainerSandbox, ContainerSubstrate, SchedClass};
use dsec_runtime::qos::{ApplyQosError, QosApplied, QosSettings};
use dsec_runtime::substrate::{
    CreateSandboxError, DestroySandboxError, Sandbox, SandboxSpec, Substrate as _, Usage,
};
use dsec_wire::api::PauseReport;

pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a create asks of the substrate beyond the [`SandboxSpec`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CreateOptions {
    /// Start the sandbox's agent SCHED_IDLE with RLIMIT_NICE 0/0 (best-effort QoS), so that
    /// it and everything it forks inherit both from the first instruction on. Substrates that
    /// cannot do this ignore it; the edge's QoS pass after the create covers them.
    pub sched_idle: bool,
}

/// A kind of sandbox, as the edge uses it.
pub trait Driver: Send + Sync + 'static {
    /// The API's name for this substrate.
    fn kind(&self) -> dsec_wire::api::Substrate;
    /// Builds and starts a sandbox; on error the substrate removed everything it built.
    fn create(
        &self,
        spec: SandboxSpec,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, CreateSandboxError>>;
    /// [`Driver::create`] with [`CreateOptions`] (the default ignores them).
    fn create_with(
        &self,
        spec: SandboxSpec,
        _opts: CreateOptions,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, CreateSandboxError>> {
        self.create(spec)
    }
    /// Removes leftovers of an earlier run; returns the ids cleaned.
    fn reap_orphans(&self, known_live: Vec<String>) -> BoxFut<'_, Vec<String>>;
    /// Takes over a sandbox an earlier run of the edge started (after a crash): `dir` is its
    /// directory, `pid` the host pid recorded for it. A paused sandbox stays paused.
    fn adopt(
        &self,
        id: String,
        _dir: PathBuf,
        pid: i32,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, AdoptError>> {
        Box::pin(async move { Err(AdoptError::Gone { id, pid }) })
    }
    /// The edge is stopping (after every sandbox was stopped): remove what the driver keeps
    /// besides sandboxes (e.g. microVM templates).
    fn shutdown(&self) -> BoxFut<'_, ()> {
        Box::pin(async {})
    }
    /// What the driver keeps to start sandboxes faster (microVM templates), as JSON; `None`
    /// when it keeps nothing of the kind.
    fn templates(&self) -> Option<serde_json::Value> {
        None
    }
    /// Removes those; how many, `None` when the driver has none.
    fn remove_templates(&self) -> Option<usize> {
        None
    }
    /// Images were removed from the store: drop what the driver keeps per layer file and no
    /// longer needs (the microVM substrate's virtio-pmem copies). Also called at start.
    fn images_removed(&self) -> BoxFut<'_, ()> {
        Box::pin(async {})
    }
}

/// One running sandbox.
pub trait LiveSandbox: Send + Sync + 'static {
    fn id(&self) -> &str;
    fn aether(&self) -> &AetherClient;
    fn pid(&self) -> i32;
    fn usage(&self) -> Usage;
    /// How many times the memory limit OOM-killed a process in this sandbox: what each command
    /// needs to flag `oom_killed`. Substrates that can read the counter alone override this
    /// (a container reads one cgroup file instead of [`LiveSandbox::usage`]'s several).
    fn oom_kills(&self) -> u64 {
        self.usage().oom_kills
    }
    /// Kills everything and removes the substrate's kernel objects and directories. Idempotent.
    fn destroy(&self) -> BoxFut<'_, Result<(), DestroySandboxError>>;
    /// Resolves when the sandbox is gone on its own: its init exited or its channel closed.
    fn exited(&self) -> BoxFut<'_, ()>;
    /// Stops the sandbox from running and gives its memory back, keeping its state: a
    /// container freezes its cgroup and reclaims; a VM would snapshot its memory to disk and
    /// end its process.
    fn pause(&self, reclaim_memory: bool) -> BoxFut<'_, Result<PauseReport, PauseError>>;
    /// Undoes [`LiveSandbox::pause`] (thaw, or restore the snapshot).
    fn resume(&self) -> BoxFut<'_, Result<(), PauseError>>;
    /// Whether the substrate holds the sandbox paused right now.
    fn is_paused(&self) -> bool;
    /// For `pack_diff`: when the writable layer is not `<sandbox dir>/upper` on the host (a VM's
    /// disk image), makes it readable on the host in a consistent state and says where;
    /// [`WritableLayer::release`] undoes that. `None`: the default `<dir>/upper` path applies.
    fn writable_layer(&self) -> BoxFut<'_, Result<Option<WritableLayer>, String>> {
        Box::pin(async { Ok(None) })
    }
    /// How the sandbox started, for VM substrates with template boots (`cold`, `template`,
    /// `cold-fallback`); `None` when the substrate has no such choice.
    fn boot_kind(&self) -> Option<&'static str> {
        None
    }
    /// The host cgroup the sandbox's processes and memory are charged to, for the node's
    /// usage sampling and reclaim; `None` (the default) when it has none of its own (a VM).
    fn cgroup(&self) -> Option<&Cgroup> {
        None
    }
    /// Applies a QoS class before the sandbox is handed out. The default covers a sandbox
    /// that is one host process (a VM): the scheduler part on [`LiveSandbox::pid`] only.
    fn apply_qos(&self, settings: &QosSettings) -> Result<QosApplied, ApplyQosError> {
        dsec_runtime::qos::apply(self.pid(), None, settings)
    }
}

/// A sandbox's writable layer, exposed on the host for `pack_diff` (see
/// [`LiveSandbox::writable_layer`]).
pub struct WritableLayer {
    /// The overlay upper directory (whiteouts and opaque xattrs as overlayfs wrote them).
    pub upper: PathBuf,
    /// Undoes the exposure (unmount, let the sandbox run again).
    pub release: Box<dyn FnOnce() -> BoxFut<'static, Result<(), String>> + Send>,
}

/// [`Driver`] for the container substrate.
pub struct ContainerDriver {
    inner: Arc<ContainerSubstrate>,
}

impl ContainerDriver {
    pub fn new(substrate: ContainerSubstrate) -> Self {
        Self {
            inner: Arc::new(substrate),
        }
    }
}

struct ContainerLive {
    substrate: Arc<ContainerSubstrate>,
    sandbox: ContainerSandbox,
}

impl Driver for ContainerDriver {
    fn kind(&self) -> dsec_wire::api::Substrate {
        dsec_wire::api::Substrate::Container
    }

    fn create(
        &self,
        spec: SandboxSpec,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, CreateSandboxError>> {
        self.create_with(spec, CreateOptions::default())
    }

    fn create_with(
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

    fn cgroup(&self) -> Option<&Cgroup> {
        Some(self.sandbox.cgroup())
    }

    fn apply_qos(&self, settings: &QosSettings) -> Result<QosApplied, ApplyQosError> {
        self.sandbox.apply_qos(settings)
    }
}
