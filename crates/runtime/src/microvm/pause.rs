//! Pause and resume of a microVM: the guest is snapshotted to disk and QEMU ends (the memory
//! goes back to the host); resume restores the snapshot. The snapshot machinery is shared
//! with the full VM ([`crate::qemu::snapshot`]).

use std::time::Duration;

use super::{qmp, MicroVmSandbox, UpperError};
use crate::error::PauseError;
use dsec_wire::api::PauseReport;

impl MicroVmSandbox {
    /// Snapshots the guest to disk and ends QEMU.
    pub async fn pause(&self) -> Result<PauseReport, PauseError> {
        self.vm.pause().await
    }

    /// Restores the guest from its snapshot.
    pub async fn resume(&self) -> Result<(), PauseError> {
        self.vm.resume().await
    }

    pub fn is_paused(&self) -> bool {
        self.vm.is_paused()
    }

    /// Stops (QMP `stop`) or continues (`cont`) the guest's vCPUs without a snapshot, e.g. to
    /// read its disk consistently. Fails while paused by snapshot.
    pub async fn freeze_vcpus(&self, freeze: bool) -> Result<(), UpperError> {
        if self.vm.pid() <= 0 {
            return Err(UpperError::NotRunning);
        }
        let mut q =
            qmp::Qmp::connect_retry(&self.vm_dir.join("qmp.sock"), Duration::from_secs(5)).await?;
        Ok(if freeze {
            q.stop().await
        } else {
            q.cont().await
        }?)
    }
}
