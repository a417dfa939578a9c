//! Create: admission (capacity, CPU, memory, idempotency) and building the sandbox.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use dsec_runtime::substrate::{CreateOptions, ImageSource, LiveSandbox, SandboxSpec};
use dsec_wire::api::EndReason;
use dsec_wire::api::{CreateSandboxRequest, SandboxInfo, SandboxState};
use dsec_wire::id::make_sandbox_id;
use tokio::sync::OnceCell;

use crate::config::EdgeConfig;
use crate::error::EdgeError;
use crate::records::{self, SandboxRecord};

use super::admission_queue::Admit;
use super::rollback::Rollback;
use super::{
    lock, now_ms, now_rfc3339, remove_dir, validate_create, End, Entry, Manager, Validated,
};

/// How long admission reuses the machine's CPU count and `MemTotal` (when the config does not
/// set them) before reading them again.
const MACHINE_TOTALS_TTL: std::time::Duration = std::time::Duration::from_secs(1);

impl Manager {
    /// Creates a sandbox.
    pub async fn create(
        self: &Arc<Self>,
        req: CreateSandboxRequest,
    ) -> Result<SandboxInfo, EdgeError> {
        let started = Instant::now();
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(EdgeError::Unavailable(format!(
                "node {} is shutting down",
                self.cfg.node_id
            )));
        }
        let v = validate_create(&self.cfg, &self.substrates, &req)?;
        crate::ports::validate_public_ports(&req.public_ports)?;
        crate::volumes::validate_mounts(&req.volumes)?;
        let id = make_sandbox_id(&self.cfg.node_id, rand::random());
        // Waits (bounded) while only sandboxes still starting stand in the way (issue 22).
        let bound = super::admission_queue::wait_bound(req.wait_s);
        if let Some(existing) = self
            .admit_or_wait(&id, &v, req.idempotency_key.as_deref(), bound)
            .await?
        {
            return Ok(existing);
        }
        // Everything the create builds from here on is undone, in reverse order, unless it
        // succeeds (also when this future is dropped halfway).
        let mut rb = Rollback::new(&id);
        {
            let (me, id, memory_mb, cpu) = (self.clone(), id.clone(), v.memory_mb, v.cpu);
            rb.push("release the admission", move || async move {
                me.unadmit(&id, memory_mb, cpu);
                Ok(())
            });
        }
        match self.build(&id, &req, &v, started, &mut rb).await {
            Ok(entry) => {
                rb.commit();
                let info = entry.info();
                crate::trajectory::hooks::begin(&self.traj, &id, &req, &info);
                self.qos.started(&id);
                {
                    let mut st = lock(&self.state);
                    st.creating.remove(&id);
                    st.live.insert(id.clone(), entry.clone());
                    if let Some(k) = &req.idempotency_key {
                        st.idempotency.insert(k.clone(), id.clone());
                    }
                }
                self.metrics.sandboxes_created.inc();
                self.metrics.sandboxes_running.inc();
                if self.shutting_down.load(Ordering::SeqCst) {
                    // Shutdown began while this create ran: do not leave it behind.
                    let ended = self
                        .finish(
                            &entry,
                            End::Stopped(EndReason::Preempted, "the edge shut down".into()),
                        )
                        .await;
                    return Err(EdgeError::Unavailable(format!(
                        "node {} shut down while sandbox {} was being created; it was {:?}",
                        self.cfg.node_id, ended.id, ended.state
                    )));
                }
                self.metrics
                    .create_seconds
                    .observe(started.elapsed().as_secs_f64());
                let pid = entry.sandbox.pid();
                self.watch(entry);
                tracing::info!(sandbox = %id, image = %info.image, pid, create_ms = info.create_ms, "sandbox created");
                Ok(info)
            }
            Err(e) => {
                let problems = rb.run().await;
                self.metrics.sandboxes_create_errors.inc();
                tracing::warn!(sandbox = %id, error = %e, "create failed");
                if problems.is_empty() {
                    Err(e)
                } else {
                    Err(EdgeError::CleanupFailed {
                        error: Box::new(e),
                        problems: problems.join("; "),
                    })
                }
            }
        }
    }

    /// Gives back what [`Manager::admit`] reserved for a create that failed.
    fn unadmit(&self, id: &str, memory_mb: u64, cpu: f64) {
        self.qos.release(id);
        let mut st = lock(&self.state);
        st.creating.remove(id);
        st.count -= 1;
        st.memory_mb -= memory_mb;
        st.cpu = (st.cpu - cpu).max(0.0);
    }

    /// Admission: capacity, CPU and memory (with overcommit), idempotency. Reserves on success;
    /// returns the existing sandbox for a repeated idempotency key.
    /// The config with the machine's CPU count and memory filled in where it sets none, read
    /// at most every [`MACHINE_TOTALS_TTL`]: reading them (`/proc/meminfo`, and the affinity
    /// mask and cgroup files behind `available_parallelism`) on every create was ~2% of the
    /// node's CPU per sandbox. A change of the machine (memory hot-plug, a balloon, a new CPU
    /// quota) is seen within that period.
    fn admission_cfg(&self) -> Arc<EdgeConfig> {
        if self.cfg.cpu_cores_total.is_some() && self.cfg.memory_mb_total.is_some() {
            return self.cfg.clone();
        }
        let mut cached = lock(&self.admission_cfg);
        if cached.0.is_some_and(|t| t.elapsed() < MACHINE_TOTALS_TTL) {
            return cached.1.clone();
        }
        let mut c = (*self.cfg).clone();
        c.cpu_cores_total = Some(self.cfg.cpu_total());
        c.memory_mb_total = Some(self.cfg.memory_total_mb());
        *cached = (Some(Instant::now()), Arc::new(c));
        cached.1.clone()
    }

    pub(super) fn admit(
        &self,
        id: &str,
        v: &Validated,
        key: Option<&str>,
    ) -> Result<Option<SandboxInfo>, Admit> {
        let mut st = lock(&self.state);
        if let Some(k) = key {
            if let Some(existing) = st.idempotency.get(k) {
                if let Some(e) = st.live.get(existing) {
                    return Ok(Some(e.info()));
                }
                if let Some(t) = st.tombstones.get(existing) {
                    return Ok(Some(t.clone()));
                }
            }
            if st.creating.values().any(|c| c.as_deref() == Some(k)) {
                return Err(EdgeError::Conflict(format!(
                    "a create with idempotency_key {k:?} is in progress; retry in a moment to get its sandbox"
                ))
                .into());
            }
        }
        let node = &self.cfg.node_id;
        if st.count >= self.cfg.capacity {
            return Err(EdgeError::NodeFull(format!(
                "node {node} is full: {} of {} sandboxes in use; stop sandboxes or use another node",
                st.count, self.cfg.capacity
            ))
            .into());
        }
        // Memory and CPU: overcommit by measured usage with a latency-sensitive floor.
        self.qos
            .admit(
                &self.admission_cfg().capacity(),
                id,
                v.qos,
                v.memory_mb,
                v.cpu,
            )
            .map_err(|r| {
                let transient = r.transient;
                let e = EdgeError::NodeFull(format!(
                    "node {node} is full for a {:?} sandbox: {r}",
                    v.qos
                ));
                if transient {
                    Admit::Wait(e)
                } else {
                    Admit::Refused(e)
                }
            })?;
        st.count += 1;
        st.memory_mb += v.memory_mb;
        st.cpu += v.cpu;
        st.creating.insert(id.to_string(), key.map(str::to_string));
        Ok(None)
    }

    async fn build(
        &self,
        id: &str,
        req: &CreateSandboxRequest,
        v: &Validated,
        started: Instant,
        rb: &mut Rollback,
    ) -> Result<Arc<Entry>, EdgeError> {
        let driver = self.substrates.get(req.substrate)?;
        let caps = driver.capabilities();
        if !req.volumes.is_empty() && !caps.volume_binds {
            return Err(EdgeError::Unsupported(format!(
                "volumes cannot be mounted into {} sandboxes yet (the volume's ext4 image would have to be attached as a virtio-blk disk and mounted by the guest's init); use a container for sandboxes with volumes",
                self.substrates.label(req.substrate)
            )));
        }
        // A full VM boots a disk image, not the layer store's image: no lease.
        let vm_disk = match caps.image_source {
            ImageSource::DiskImage => Some(
                driver
                    .resolve_disk_image(&v.image)
                    .map_err(EdgeError::from_resolve_image)?,
            ),
            ImageSource::Layers => None,
        };
        let lease = match vm_disk {
            Some(_) => None,
            None => Some(
                self.images
                    .acquire_composed(&v.image, v.workspace.as_deref(), &v.toolkits)
                    .await
                    .map_err(EdgeError::Image)?,
            ),
        };
        let image = lease
            .as_ref()
            .map_or_else(|| v.image.clone(), |l| l.image().to_string());
        let lowers = match &lease {
            Some(l) => l.lowers(),
            None => vm_disk.clone().into_iter().collect(),
        };
        // Held until the sandbox is torn down (the entry takes it), or the rollback is done.
        let lease = Arc::new(Mutex::new(lease));
        {
            let lease = lease.clone();
            rb.push("release the image lease", move || async move {
                drop(lock(&lease).take());
                Ok(())
            });
        }
        let dir = self.cfg.sandboxes_dir().join(id);
        let disk_limit_mb = req
            .disk_limit_mb
            .or((self.cfg.default_disk_limit_mb > 0).then_some(self.cfg.default_disk_limit_mb));
        let short = id.rsplit('-').next().unwrap_or(id).to_string();
        let mut info = SandboxInfo {
            id: id.to_string(),
            node: self.cfg.node_id.clone(),
            state: SandboxState::Creating,
            substrate: req.substrate,
            image,
            memory_limit_mb: v.memory_mb,
            cpu_cores_limit: v.cpu,
            pids_limit: v.pids,
            init_user: v.user.clone(),
            hostname: v.hostname.clone().unwrap_or(short),
            ttl_running_stop: req.ttl_running_stop,
            ttl_total: req.ttl_total,
            network_rules: req.network_rules.clone(),
            labels: req.labels.clone(),
            created_at: now_rfc3339(),
            create_ms: None,
            reason: None,
            ttl_action: req.ttl_action.unwrap_or_default(),
            qos: v.qos,
            public_ports: req.public_ports.clone(),
            ..Default::default()
        };
        let created_ms = now_ms();
        let mut record = SandboxRecord {
            info: info.clone(),
            pid: 0,
            image: info.image.clone(),
            env: req.env.clone(),
            created_ms,
            last_request_ms: created_ms,
        };
        // The record is written once the sandbox runs: a crash before leaves a directory
        // without one, which the recovery at start cleans up (its cgroup is reaped by name).
        // A plain container (no disk limit, whose `upper`/`work` would be links into a file
        // system of its own) gets a spare skeleton when there is one.
        let reuse = caps.early_teardown && disk_limit_mb.is_none();
        let spare = self.cfg.edge_dir().join(records::SPARE_DIR);
        if let Err(e) = records::make_sandbox_dir(&dir, &spare, reuse) {
            return Err(EdgeError::Io {
                context: format!("create {}", dir.display()),
                source: e,
            });
        }
        {
            let dir = dir.clone();
            rb.push("remove the sandbox dir", move || async move {
                remove_dir(&dir).map_err(|e| format!("remove {}: {e}", dir.display()).into())
            });
        }
        // Network namespace and rules (issue 8).
        let extras = crate::network::prepare(&self.net, &self.cfg, id, &dir, req).await?;
        {
            let (net, id, dir) = (self.net.clone(), id.to_string(), dir.clone());
            rb.push("release the network", move || async move {
                crate::network::release(&net, &id, &dir).await;
                Ok(())
            });
        }
        // Volumes: mounted on the host (once per volume), bound in by the substrate.
        let binds = if req.volumes.is_empty() {
            Vec::new()
        } else {
            let (vols, sid, mounts) = (self.volumes.clone(), id.to_string(), req.volumes.clone());
            let resolved = tokio::task::spawn_blocking(move || vols.acquire(&sid, &mounts))
                .await
                .map_err(|e| EdgeError::Internal(format!("mount volumes: {e}")))??;
            let (vols, sid) = (self.volumes.clone(), id.to_string());
            rb.push("release the volumes", move || async move {
                tokio::task::spawn_blocking(move || vols.release(&sid))
                    .await
                    .map_err(Into::into)
            });
            resolved
                .into_iter()
                .map(|r| dsec_runtime::substrate::BindMount {
                    source: r.source,
                    target: r.target,
                    read_only: r.read_only,
                })
                .collect()
        };
        let spec = SandboxSpec {
            binds,
            id: id.to_string(),
            hostname: info.hostname.clone(),
            lowers,
            dir: dir.clone(),
            memory_limit_mb: v.memory_mb,
            cpu_cores_limit: v.cpu,
            pids_limit: v.pids,
            user: v.user.clone(),
            env: req.env.clone(),
            netns: extras.netns.clone(),
            layer_files: extras.layer_files,
            protected_paths: req.protected_paths.clone(),
            disk_limit_mb,
        };
        // A best-effort agent starts SCHED_IDLE (the container's spawn sets it before the exec),
        // so no process of the sandbox ever runs as SCHED_OTHER; `apply_qos` below checks it.
        let opts = CreateOptions {
            sched_idle: matches!(v.qos, dsec_wire::api::QosClass::BestEffort),
        };
        // The substrate removes what it built itself when its create fails.
        let sandbox: Arc<dyn LiveSandbox> = driver
            .create(spec, opts)
            .await
            .map_err(EdgeError::Create)?
            .into();
        {
            let sandbox = sandbox.clone();
            rb.push("destroy the sandbox", move || async move {
                sandbox.destroy().await.map_err(Into::into)
            });
        }
        // The sandbox's nftables chains were added while it started: wait for them.
        let net_ready = crate::network::started(&self.net, &self.cfg, id, &dir).await;
        // QoS before the sandbox is handed out: no user command has run yet.
        let qos = sandbox.apply_qos(&self.qos.settings(v.qos));
        if let Ok(a) = &qos {
            if opts.sched_idle && caps.sched_idle_at_spawn && a.not_idle_before > 0 {
                tracing::warn!(
                    sandbox = %id,
                    tasks = a.not_idle_before,
                    "best-effort container had processes not SCHED_IDLE after spawn (fixed now)"
                );
            }
        }
        info.state = SandboxState::Running;
        info.create_ms = Some(started.elapsed().as_secs_f64() * 1000.0);
        info.boot = sandbox.boot_kind().map(str::to_string);
        if let Some(b) = &info.boot {
            self.metrics.vm_boots.with_label_values(&[b]).inc();
        }
        record.info = info.clone();
        record.pid = sandbox.pid();
        let persisted = match qos.map(|q| (q, net_ready)) {
            Ok((_, Err(e))) => Err(e),
            Ok((_, Ok(()))) => records::write_new(&dir, &record).map_err(EdgeError::Record),
            Err(source) => Err(EdgeError::Qos {
                class: v.qos,
                source,
            }),
        };
        persisted?;
        let lease = lock(&lease).take();
        let aether = sandbox.aether().clone();
        Ok(Arc::new(Entry {
            id: id.to_string(),
            dir,
            info: Mutex::new(info),
            sandbox,
            aether,
            lease: Mutex::new(lease),
            memory_mb: v.memory_mb,
            cpu: v.cpu,
            ended: OnceCell::new(),
            env: req.env.clone(),
            created_ms,
            last_request_ms: AtomicU64::new(now_ms()),
            inflight: AtomicU64::new(0),
            op: tokio::sync::Mutex::new(()),
        }))
    }
}
