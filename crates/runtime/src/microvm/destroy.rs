//! Destroying a microVM: QEMU killed (or a paused VM's snapshot forgotten), its directory
//! (disks, sockets, snapshot) removed.

use super::*;

impl MicroVmSubstrate {
    /// Kills the VM and removes its directory. Idempotent.
    pub async fn destroy(&self, sandbox: &MicroVmSandbox) -> Result<(), DestroySandboxError> {
        vm::destroy_vm(&sandbox.id, &sandbox.vm, &sandbox.vm_dir).await
    }
}
