//! Pause and resume of a full VM: the guest is snapshotted to disk and QEMU ends; resume
//! restores the snapshot. The snapshot machinery is shared with the microVM
//! ([`crate::qemu::snapshot`]).

use super::*;

impl FullVmSandbox {
    /// Snapshots memory and devices to `<vm dir>/snapshot` and ends QEMU (the overlay disk is
    /// a host file and needs no copy).
    pub async fn pause(&self) -> Result<PauseReport, PauseError> {
        self.vm.pause().await
    }

    /// Starts QEMU again from the snapshot; the guest carries on where it stopped.
    pub async fn resume(&self) -> Result<(), PauseError> {
        self.vm.resume().await
    }

    pub fn is_paused(&self) -> bool {
        self.vm.is_paused()
    }
}
