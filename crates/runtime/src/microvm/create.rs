//! Creating a microVM: the guest's initramfs and disks, QEMU's command line, a cold boot (with
//! the fall back from the `microvm` machine to `pc`) or a restore from a template, and the
//! template built in the background after the first cold boot of a shape.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use super::*;

pub(super) fn spawn_err(what: &str, e: io::Error) -> CreateSandboxError {
    CreateSandboxError::Spawn(io::Error::new(e.kind(), format!("{what}: {e}")))
}

/// Whether a failed cold boot is the machine type's fault: QEMU exited before the guest's
/// /init handed over to aether (QEMU refused its command line, or the guest's kernel or /init
/// failed on the machine's devices), or the kernel hung before /init said anything. A guest
/// that reached aether failed for other reasons.
pub(super) fn machine_failure(e: &vm::BootError, vm_dir: &Path) -> bool {
    let console = std::fs::read_to_string(vm_dir.join("console.log")).unwrap_or_default();
    (e.qemu_exited || e.init_silent) && !console.contains("root ready, starting aether")
}

/// How long a `microvm` guest may boot without a line from its /init before the boot counts
/// as hung on the machine (a boot prints its first line after ≈ 1 s of guest time; minutes
/// would mean a kernel stuck in early boot, e.g. in timer calibration).
pub(super) const MICROVM_INIT_SILENCE: Duration = Duration::from_secs(30);

/// Resolves once `console` went `limit` without a line from the guest's /init; never if
/// one came.
pub(super) async fn init_silent(console: &Path, limit: Duration) {
    let start = std::time::Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let text = tokio::fs::read(console).await.unwrap_or_default();
        if text.windows(10).any(|w| w == b"dsec-init:") {
            return std::future::pending().await;
        }
        if start.elapsed() >= limit {
            return;
        }
    }
}

/// The last lines of the guest's console, for error messages.
pub(super) fn console_tail(vm_dir: &Path) -> String {
    // Our init's and aether's own lines (not the kernel's `[ time] ...`), then the last ones.
    let text = std::fs::read_to_string(vm_dir.join("console.log")).unwrap_or_default();
    let ours: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('[') && !l.trim().is_empty())
        .collect();
    let all: Vec<&str> = text.lines().collect();
    let mut out = ours[ours.len().saturating_sub(10)..].to_vec();
    out.extend_from_slice(&all[all.len().saturating_sub(3)..]);
    out.join(" | ")
}

impl MicroVmSubstrate {
    /// Boots a microVM (cold or from a template); on error everything built so far is removed.
    pub async fn create(&self, spec: SandboxSpec) -> Result<MicroVmSandbox, CreateSandboxError> {
        let vm_dir = spec.dir.join("vm");
        match self.start(&spec, &vm_dir).await {
            Ok(s) => Ok(s),
            // QEMU is gone (killed on the error paths or on drop); remove its files.
            Err(e) => Err(vm::cleanup_failed_create(&spec.id, &vm_dir, e).await),
        }
    }

    pub(super) async fn start(
        &self,
        spec: &SandboxSpec,
        vm_dir: &Path,
    ) -> Result<MicroVmSandbox, CreateSandboxError> {
        let mut machine = self.machine();
        let mut layers = self.guest_layers(spec, machine).await?;
        let mut key = self.template_key(spec, &layers, machine).await;
        let mut boot = template::BootKind::Cold;
        if let (Some((key, _)), Some(t)) = (&key, &self.templates) {
            if let Some(tpl) = t.lookup(key) {
                match self
                    .start_from_template(spec, vm_dir, &tpl, &layers, machine)
                    .await
                {
                    Ok(vm) => {
                        t.stats
                            .templated
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::info!(sandbox = %spec.id, pid = vm.pid(), template = %key, boot = "template", "microVM ready");
                        return Ok(MicroVmSandbox {
                            id: spec.id.clone(),
                            vm_dir: vm_dir.to_path_buf(),
                            vm,
                            boot: template::BootKind::Template,
                        });
                    }
                    Err(e) => {
                        t.stats
                            .fallbacks
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::warn!(sandbox = %spec.id, template = %key, error = %e, "microVM template failed to restore: dropped, booting cold");
                        t.drop_template(key);
                        let _ = tokio::fs::remove_dir_all(vm_dir).await;
                        boot = template::BootKind::ColdFallback;
                    }
                }
            }
        }
        tokio::fs::create_dir_all(vm_dir)
            .await
            .map_err(|e| spawn_err("create the VM directory", e))?;
        // A NIC on the sandbox's network namespace (net.rs): bridge + tap there, QEMU in it.
        // Prepared once: a fallback boot reuses it.
        let nic = net::attach(spec.netns.clone(), vm_dir).await?;
        let vm = match self
            .boot_cold(spec, vm_dir, &layers, machine, nic.as_ref())
            .await
        {
            Ok(vm) => vm,
            Err(e) if machine == Machine::Microvm && machine_failure(&e, vm_dir) => {
                tracing::warn!(
                    sandbox = %spec.id, error = %e.msg,
                    "microVM: the microvm machine failed to boot the guest; retrying on pc"
                );
                // The failed attempt's logs stay for a look: console-microvm.log, qemu.log.
                let _ = std::fs::rename(
                    vm_dir.join("console.log"),
                    vm_dir.join("console-microvm.log"),
                );
                machine = Machine::Pc;
                layers = self.guest_layers(spec, machine).await?;
                key = self.template_key(spec, &layers, machine).await;
                let vm = self
                    .boot_cold(spec, vm_dir, &layers, machine, nic.as_ref())
                    .await
                    .map_err(|e2| {
                        CreateSandboxError::Setup(format!(
                            "{e2}; guest console: {} (booted on pc after microvm failed: {e})",
                            console_tail(vm_dir)
                        ))
                    })?;
                if !self
                    .pc_fallback
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::warn!(
                        "microVM: the microvm machine fails here and pc works: new VMs use pc"
                    );
                }
                vm
            }
            Err(e) => {
                return Err(CreateSandboxError::Setup(format!(
                    "{e}; guest console: {}",
                    console_tail(vm_dir)
                )))
            }
        };
        if let Some(t) = &self.templates {
            t.stats
                .cold
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        tracing::info!(sandbox = %spec.id, pid = vm.pid(), boot = boot.as_str(), machine = machine.as_str(), "microVM ready");
        if let Some((key, shape)) = key {
            self.spawn_template_build(spec, key, shape, machine);
        }
        Ok(MicroVmSandbox {
            id: spec.id.clone(),
            vm_dir: vm_dir.to_path_buf(),
            vm,
            boot,
        })
    }

    /// Boots the guest's kernel (init_user and env reach aether through the initramfs:
    /// /dsec-user, /dsec-environ, which the guest's /init passes as --user / --env-file).
    /// `vm_dir` exists; `nic` is the guest's NIC ([`net::attach`]) if it has one.
    pub(super) async fn boot_cold(
        &self,
        spec: &SandboxSpec,
        vm_dir: &Path,
        layers: &[GuestLayer],
        machine: Machine,
        nic: Option<&net::VmNet>,
    ) -> Result<vm::Vm, vm::BootError> {
        let initrd = self
            .write_initrd(spec, vm_dir)
            .await
            .map_err(|e| format!("write the initramfs: {e}"))?;
        make_upper_disk(&vm_dir.join(UPPER_DISK), self.disk_mb(spec))
            .await
            .map_err(|e| format!("create the writable disk: {e}"))?;
        let mut launch = self.launch_for(spec, vm_dir, &initrd, layers, machine);
        if let Some(n) = nic {
            net::add_to_microvm(&mut launch.args, n, machine);
        }
        tracing::info!(
            sandbox = %spec.id, accel = self.config.accel.as_str(),
            machine = machine.as_str(), layers = layers.len(), "microVM starting"
        );
        let boot = vm::Vm::boot(&spec.id, vm_dir, launch, self.config.boot_timeout);
        if machine != Machine::Microvm {
            return boot.await;
        }
        let console = vm_dir.join("console.log");
        tokio::select! {
            r = boot => r,
            // Dropping the boot ends QEMU (kill on drop).
            _ = init_silent(&console, MICROVM_INIT_SILENCE) => Err(vm::BootError {
                msg: format!(
                    "the guest's /init printed nothing within {MICROVM_INIT_SILENCE:?} (the \
                     kernel hangs early on the {} machine?)",
                    machine.as_str()
                ),
                qemu_exited: false,
                init_silent: true,
            }),
        }
    }

    /// A clone of `tpl`: its disk copied, its snapshot restored, then the guest's own identity
    /// (hostname, wall clock, fresh randomness) set over the aether channel.
    pub(super) async fn start_from_template(
        &self,
        spec: &SandboxSpec,
        vm_dir: &Path,
        tpl: &template::Template,
        layers: &[GuestLayer],
        machine: Machine,
    ) -> Result<vm::Vm, TemplateError> {
        tokio::fs::create_dir_all(vm_dir)
            .await
            .map_err(|e| TemplateError::io("create the VM directory", e))?;
        // The clone's own initramfs file (a resume after the template is gone still needs
        // one): a hard link, or a copy across file systems.
        let initrd = vm_dir.join("initrd.img");
        if std::fs::hard_link(tpl.initrd(), &initrd).is_err() {
            tokio::fs::copy(tpl.initrd(), &initrd)
                .await
                .map_err(|e| TemplateError::io("copy the template's initramfs", e))?;
        }
        template::copy_disk(&tpl.disk(), &vm_dir.join(UPPER_DISK)).await?;
        let launch = self.launch_for(spec, vm_dir, &initrd, layers, machine);
        tracing::info!(sandbox = %spec.id, template = %tpl.key, "microVM restoring from its template");
        let vm = vm::Vm::restore_clone(&spec.id, vm_dir, launch, &tpl.snapshot()).await?;
        let seed = template::host_seed().map_err(TemplateError::Seed)?;
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default();
        let req = dsec_wire::aether::Request::SetIdentity {
            hostname: spec.hostname.clone(),
            unix_secs: now.as_secs() as i64,
            unix_nanos: now.subsec_nanos(),
        };
        let r = tokio::time::timeout(
            Duration::from_secs(30),
            vm.aether().request(req, bytes::Bytes::from(seed)),
        )
        .await;
        let err = match r {
            Ok(Ok((dsec_wire::aether::Reply::Done, _))) => return Ok(vm),
            Ok(Ok((other, _))) => format!("unexpected reply {other:?}"),
            Ok(Err(e)) => e.to_string(),
            Err(_) => "no answer within 30 s".to_string(),
        };
        let err = TemplateError::Identity(err);
        let _ = vm.kill().await;
        Err(err)
    }

    /// Builds the template of a shape in the background (unless it exists or is being built).
    pub(super) fn spawn_template_build(
        &self,
        spec: &SandboxSpec,
        key: String,
        shape: String,
        machine: Machine,
    ) {
        let Some(t) = self.templates.clone() else {
            return;
        };
        let Some(dir) = t.claim_build(&key) else {
            return;
        };
        let this = self.clone();
        let spec = SandboxSpec {
            id: format!("template-{}", &key[..12]),
            hostname: "dsec-template".into(),
            dir: dir.clone(),
            ..spec.clone()
        };
        let t2 = t.clone();
        let h = tokio::spawn(async move {
            let r = tokio::select! {
                r = this.build_template(&spec, &key, shape, &dir, machine) => r,
                _ = t2.closing() => Err(TemplateError::Stopping),
            };
            t2.finish_build(&key, &dir, r);
        });
        t.track(h);
    }

    /// Boots one VM of the shape to `Ready`, snapshots it (which syncs its disk and ends QEMU)
    /// and leaves snapshot, disk and initramfs in `dir`.
    pub(super) async fn build_template(
        &self,
        spec: &SandboxSpec,
        key: &str,
        shape: String,
        dir: &Path,
        machine: Machine,
    ) -> Result<template::TemplateMeta, TemplateError> {
        let started = std::time::Instant::now();
        let layers = self
            .guest_layers(spec, machine)
            .await
            .map_err(|e| TemplateError::Layers(e.to_string()))?;
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|e| TemplateError::io(format!("create {}", dir.display()), e))?;
        let vm = self
            .boot_cold(spec, dir, &layers, machine, None)
            .await
            .map_err(|e| TemplateError::Boot {
                reason: e.to_string(),
                console: console_tail(dir),
            })?;
        // A guard: the VM ends if this future is dropped (edge stopping) mid-snapshot.
        struct KillOnDrop(Option<vm::Vm>);
        impl Drop for KillOnDrop {
            fn drop(&mut self) {
                if let Some(vm) = self.0.take() {
                    let pid = vm.pid();
                    if pid > 0 {
                        // SAFETY: kill(2) on the template VM's QEMU, a child of ours that the
                        // VM's waiter task has not reaped (pid > 0 while it runs).
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                }
            }
        }
        let mut guard = KillOnDrop(Some(vm));
        let paused = match &guard.0 {
            Some(vm) => vm.pause().await,
            None => unreachable!(),
        };
        let vm = guard.0.take();
        if let Err(e) = paused {
            if let Some(vm) = vm {
                let _ = vm.kill().await;
            }
            return Err(TemplateError::Snapshot(e));
        }
        drop(vm);
        for f in ["aether.sock", "qmp.sock", "qemu.pid", vm::ARGS_FILE] {
            let _ = std::fs::remove_file(dir.join(f));
        }
        tracing::info!(template = %key, ms = started.elapsed().as_millis() as u64, "microVM template built");
        Ok(template::TemplateMeta {
            key: key.to_string(),
            shape,
            created: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        })
    }
}

/// The copy of a layer file padded with zeros to [`qemu::PMEM_ALIGN`] for virtio-pmem, made
/// once per file (layer files are named by digest and never change). `None` (the layer is then
/// a virtio-blk disk) when it cannot be made.
pub(super) async fn pmem_copy(dir: &Path, src: &Path) -> Option<PathBuf> {
    let name = src.file_name()?.to_str()?;
    let dst = dir.join(format!("{name}{}", pmem::COPY_SUFFIX));
    // Which layer files a copy serves, for its garbage collection (pmem.rs).
    let record = |dst: &Path| {
        if let Err(e) = pmem::record_source(dst, src) {
            tracing::warn!(copy = %dst.display(), error = %e, "record the source of a virtio-pmem copy");
        }
    };
    if dst.is_file() {
        record(&dst);
        return Some(dst);
    }
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.{}.{seq}.tmp", std::process::id()));
    let tmp_cleanup = tmp.clone();
    let (dir2, src2, dst2) = (dir.to_path_buf(), src.to_path_buf(), dst.clone());
    let made = tokio::task::spawn_blocking(move || -> io::Result<()> {
        std::fs::create_dir_all(&dir2)?;
        std::fs::copy(&src2, &tmp)?;
        let len = std::fs::metadata(&tmp)?.len();
        let padded = len.div_ceil(qemu::PMEM_ALIGN).max(1) * qemu::PMEM_ALIGN;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&tmp)?
            .set_len(padded)?;
        std::fs::rename(&tmp, &dst2)
    })
    .await;
    match made {
        Ok(Ok(())) => {
            record(&dst);
            Some(dst)
        }
        Ok(Err(e)) => {
            let _ = std::fs::remove_file(&tmp_cleanup);
            tracing::warn!(layer = %src.display(), error = %e, "no virtio-pmem copy of the layer; it is attached as a disk");
            None
        }
        Err(_) => None,
    }
}

/// Creates the sparse writable disk: a raw ext4 image without a journal (the host reads it
/// read-only for `pack` after a `sync` in the guest, which then sees everything in place).
pub(super) async fn make_upper_disk(path: &Path, size_mb: u64) -> io::Result<()> {
    let f = std::fs::File::create(path)?;
    f.set_len(size_mb * 1024 * 1024)?;
    drop(f);
    let out = tokio::process::Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-O",
            "^has_journal",
            "-E",
            "root_owner=0:0,lazy_itable_init=1",
            "-m",
            "0",
        ])
        .arg(path)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| io::Error::new(e.kind(), format!("run mkfs.ext4: {e}")))?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "mkfs.ext4 {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}
