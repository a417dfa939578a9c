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
    pub async fn release(self) -> Result<(), UpperError> {
        let mut problems = Vec::new();
        if let Err(e) = run_tool("umount", &[self.mnt.as_os_str()]).await {
            problems.push(e.into());
        } else if let Err(source) = tokio::fs::remove_dir(&self.mnt).await {
            problems.push(UpperError::Dir {
                what: "rmdir",
                path: self.mnt.clone(),
                source,
            });
        }
        if self.continue_guest {
            let r = async {
                let mut q = qmp::Qmp::connect_retry(&self.qmp, Duration::from_secs(5)).await?;
                q.cont().await
            }
            .await;
            if let Err(e) = r {
                problems.push(UpperError::Continue(e));
            }
        }
        match problems.len() {
            0 => Ok(()),
            1 => Err(problems.remove(0)),
            _ => Err(UpperError::Several(problems)),
        }
    }
}

async fn run_tool(tool: &str, args: &[&std::ffi::OsStr]) -> Result<(), ToolError> {
    let out = tokio::process::Command::new(tool)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|source| ToolError::Run {
            tool: tool.to_string(),
            source,
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(ToolError::Failed {
            command: format!("{tool} {args:?}"),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

impl MicroVmSandbox {
    /// Makes the writable disk readable on the host, consistently: `sync` in the guest, its
    /// vCPUs stopped (a paused VM is already still), then a read-only loop mount of the image
    /// (no journal: nothing to replay).
    pub async fn expose_upper(&self) -> Result<UpperMount, UpperError> {
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
                .map_err(|source| UpperError::Dir {
                    what: "mkdir",
                    path: mnt.clone(),
                    source,
                })?;
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
            .await?;
            Ok(())
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
