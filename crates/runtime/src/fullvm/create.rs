//! Creating a full VM: a copy-on-write overlay over the disk image, QEMU started on it, aether's
//! `Ready` awaited over the channel, the hostname set; on error QEMU is ended and its files
//! removed.

use super::*;

impl FullVmSubstrate {
    /// Boots a full VM; `spec.lowers` holds exactly one path: the VM's disk image. On error
    /// everything built so far is removed.
    pub async fn create(&self, spec: SandboxSpec) -> Result<FullVmSandbox, CreateSandboxError> {
        let vm_dir = spec.dir.join("vm");
        match self.start(&spec, &vm_dir).await {
            Ok(vm) => {
                let sandbox = FullVmSandbox {
                    id: spec.id.clone(),
                    vm_dir,
                    vm,
                };
                // The sandbox's hostname (the disk image brings its own /etc/hostname).
                if let Err(e) = set_hostname(sandbox.vm.aether(), &spec.hostname).await {
                    let _ = self.destroy(&sandbox).await;
                    return Err(CreateSandboxError::Setup(format!(
                        "set the hostname {:?} in the guest: {e}",
                        spec.hostname
                    )));
                }
                Ok(sandbox)
            }
            // QEMU is gone (killed on the error paths or on drop); remove its files.
            Err(e) => Err(vm::cleanup_failed_create(&spec.id, &vm_dir, e).await),
        }
    }

    /// `qemu-img`'s name for the format of `disk` (`raw` or `qcow2`).
    pub(super) async fn disk_format(&self, disk: &Path) -> Result<String, CreateSandboxError> {
        let out = tokio::process::Command::new(&self.config.qemu_img)
            .args(["info", "--output=json", "-U"])
            .arg(disk)
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| spawn_err(&format!("run {}", self.config.qemu_img.display()), e))?;
        if !out.status.success() {
            return Err(CreateSandboxError::InvalidSpec(format!(
                "VM image {}: {}",
                disk.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
            CreateSandboxError::Setup(format!("parse qemu-img info of {}: {e}", disk.display()))
        })?;
        match v.get("format").and_then(|f| f.as_str()) {
            Some(f @ ("raw" | "qcow2")) => Ok(f.to_string()),
            other => Err(CreateSandboxError::InvalidSpec(format!(
                "VM image {}: format {other:?} is not supported (raw or qcow2)",
                disk.display()
            ))),
        }
    }

    /// Creates `overlay` backed by `disk` (read-only for QEMU: the image is never written).
    pub(super) async fn make_overlay(
        &self,
        disk: &Path,
        overlay: &Path,
    ) -> Result<(), CreateSandboxError> {
        let fmt = self.disk_format(disk).await?;
        let out = tokio::process::Command::new(&self.config.qemu_img)
            .args(["create", "-q", "-f", "qcow2", "-F", &fmt, "-b"])
            .arg(disk)
            .arg(overlay)
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| spawn_err("run qemu-img create", e))?;
        if !out.status.success() {
            return Err(CreateSandboxError::Setup(format!(
                "create the overlay on {}: {}",
                disk.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        Ok(())
    }

    /// Builds the VM directory and boots; the caller removes the directory on error.
    pub(super) async fn start(
        &self,
        spec: &SandboxSpec,
        vm_dir: &Path,
    ) -> Result<Vm, CreateSandboxError> {
        if spec.user != "root" && spec.user != "0" {
            return Err(CreateSandboxError::InvalidSpec(format!(
                "init_user {:?}: full-VM sandboxes run commands as root only (for now)",
                spec.user
            )));
        }
        if !spec.env.is_empty() {
            return Err(CreateSandboxError::InvalidSpec(
                "env: sandbox-wide environment variables are not supported for full-VM sandboxes yet; pass env per command".into(),
            ));
        }
        let disk = match spec.lowers.as_slice() {
            [d] => d.clone(),
            _ => {
                return Err(CreateSandboxError::InvalidSpec(
                    "a full VM needs exactly one disk image".into(),
                ))
            }
        };
        let image = VmImage::at(&disk)
            .map_err(|e| spawn_err(&format!("read the boot files of {}", disk.display()), e))?;
        tokio::fs::create_dir_all(vm_dir)
            .await
            .map_err(|e| spawn_err("create the VM directory", e))?;
        let overlay = vm_dir.join("overlay.qcow2");
        self.make_overlay(&image.disk, &overlay).await?;
        let cmdline = image
            .cmdline
            .clone()
            .unwrap_or_else(|| DEFAULT_CMDLINE.into());
        let direct = image.kernel.as_deref().map(|k| DirectBoot {
            kernel: k,
            initrd: image.initrd.as_deref(),
            append: &cmdline,
        });
        let args = qemu::command_line(&qemu::FullVmArgs {
            machine: self.config.machine,
            accel: self.config.accel,
            memory_mb: spec.memory_limit_mb.max(128),
            vcpus: spec.cpu_cores_limit.ceil().max(1.0) as u32,
            overlay: &overlay,
            direct,
            console_log: &vm_dir.join("console.log"),
            aether_socket: &vm_dir.join("aether.sock"),
            qmp_socket: &vm_dir.join("qmp.sock"),
            pidfile: &vm_dir.join("qemu.pid"),
        });
        let mut args = args;
        // A NIC on the sandbox's network namespace (microvm/net.rs); config through fw_cfg.
        if let Some(n) = crate::qemu::net::attach(spec.netns.clone(), vm_dir).await? {
            args.extend(qemu::network_args(&n));
        }
        let launch = Launch {
            qemu_binary: self.config.qemu_binary.clone(),
            args,
        };
        tracing::info!(
            sandbox = %spec.id, image = %image.disk.display(), accel = self.config.accel.as_str(),
            machine = self.config.machine.as_str(),
            boot = if image.kernel.is_some() { "direct kernel" } else { "firmware" },
            "full VM starting"
        );
        Vm::boot(&spec.id, vm_dir, launch, self.config.boot_timeout)
            .await
            .map_err(|msg| {
                CreateSandboxError::Setup(format!("{msg}; guest console: {}", console_tail(vm_dir)))
            })
    }
}

/// The last lines of the guest's console, for error messages.
pub(super) fn console_tail(vm_dir: &Path) -> String {
    let text = std::fs::read_to_string(vm_dir.join("console.log")).unwrap_or_default();
    let lines: Vec<&str> = text
        .lines()
        .map(|l| l.trim_matches(|c: char| c.is_control() || c == ' '))
        .filter(|l| !l.is_empty())
        .collect();
    lines[lines.len().saturating_sub(8)..].join(" | ")
}

/// Setting the guest's hostname failed.
#[derive(Debug, thiserror::Error)]
pub enum HostnameError {
    #[error(transparent)]
    Channel(#[from] crate::aether_client::ChannelError),
    #[error("exit {code}: {stderr}")]
    Exit { code: i32, stderr: String },
}

/// Runs `hostname NAME` in the guest (the name was validated by the edge).
async fn set_hostname(aether: &AetherClient, name: &str) -> Result<(), HostnameError> {
    let out = aether
        .run(
            Request::Exec {
                argv: vec!["hostname".into(), name.into()],
                timeout_ms: 10_000,
                env: Default::default(),
                cwd: None,
                user: None,
                max_output: 4096,
                stream: false,
            },
            Bytes::new(),
        )
        .await?;
    if out.outcome.exit_code != 0 {
        return Err(HostnameError::Exit {
            code: out.outcome.exit_code,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

fn spawn_err(what: &str, e: io::Error) -> CreateSandboxError {
    CreateSandboxError::Spawn(io::Error::new(e.kind(), format!("{what}: {e}")))
}
