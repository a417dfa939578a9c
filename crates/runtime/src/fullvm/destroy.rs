//! Destroying a full VM: QEMU killed (or a paused VM's snapshot forgotten), its directory
//! (overlay, sockets, snapshot) removed.

use super::*;

impl FullVmSubstrate {
    /// Kills the VM and removes its directory. Idempotent.
    pub async fn destroy(&self, sandbox: &FullVmSandbox) -> Result<(), DestroySandboxError> {
        vm::destroy_vm(&sandbox.id, &sandbox.vm, &sandbox.vm_dir).await
    }
}
