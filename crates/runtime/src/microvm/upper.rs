//! The microVM's writable layer seen from the host: its disk mounted read-only (for `pack`)
//! while the guest's vCPUs are stopped.

use std::path::PathBuf;

use super::*;

/// The writable disk mounted read-only on the host (for `pack`); [`UpperMount::release`]
/// unmounts it and lets the guest run again.
#[derive(Debug)]
pub struct UpperMount {
    /// The overlay upper directory inside the mount.
    pub upper: PathBuf,
    mnt: PathBuf,
    qmp: PathBuf,
    continue_guest: bool,
}

impl UpperMount {
    pub async fn release(self) -> Result<(), String> {
        let mut problems = Vec::new();
        if let Err(e) = run_tool("umount", &[self.mnt.as_os_str()]).await {
            problems.push(e);
        } else if let Err(e) = tokio::fs::remove_dir(&self.mnt).await {
            problems.push(format!("rmdir {}: {e}", self.mnt.display()));
        }
        if self.continue_guest {
            let r = async {
                let mut q = qmp::Qmp::connect_retry(&self.qmp, Duration::from_secs(5)).await?;
                q.cont().await
            }
            .await;
            if let Err(e) = r {
                problems.push(format!("continue the guest: {e}"));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

async fn run_tool(tool: &str, args: &[&std::ffi::OsStr]) -> Result<(), String> {
    let out = tokio::process::Command::new(tool)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|e| format!("run {tool}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{tool} {:?}: {}",
            args,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl MicroVmSandbox {
    /// Makes the writable disk readable on the host, consistently: `sync` in the guest, its
    /// vCPUs stopped (a paused VM is already still), then a read-only loop mount of the image
    /// (no journal: nothing to replay).
    pub async fn expose_upper(&self) -> Result<UpperMount, String> {
        let running = self.vm.pid() > 0;
        let qmp = self.vm_dir.join("qmp.sock");
        if running {
            self.vm.sync_guest().await;
            self.freeze_vcpus(true).await?;
        }
        let mnt = self.vm_dir.join("pack.mnt");
        let mounted = async {
            tokio::fs::create_dir_all(&mnt)
                .await
                .map_err(|e| format!("mkdir {}: {e}", mnt.display()))?;
            let img = self.upper_disk();
            run_tool(
                "mount",
                &[
                    "-t".as_ref(),
                    "ext4".as_ref(),
                    "-o".as_ref(),
                    "ro,loop,noload".as_ref(),
                    img.as_os_str(),
                    mnt.as_os_str(),
                ],
            )
            .await
        }
        .await;
        if let Err(e) = mounted {
            let _ = tokio::fs::remove_dir(&mnt).await;
            if running {
                let _ = self.freeze_vcpus(false).await;
            }
            return Err(e);
        }
        Ok(UpperMount {
            upper: mnt.join("upper"),
            mnt,
            qmp,
            continue_guest: running,
        })
    }
}
