//! Pause and resume of a microVM: the guest is snapshotted to disk and QEMU ends (the memory
//! goes back to the host); resume restores the snapshot. Both VM substrates pause the same
//! way, so that code is [`crate::qemu::snapshot`] (`Vm::pause`, `Vm::resume`), reached through
//! [`crate::substrate::vm::VmLive`]. What is the microVM's own: stopping its vCPUs without a
//! snapshot (to read its writable disk for `pack`).

use std::time::Duration;

use super::{qmp, MicroVmSandbox, UpperError};

impl MicroVmSandbox {
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
