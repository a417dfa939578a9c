//! Re-adoption of a full VM after an edge restart: a paused VM's snapshot and overlay are on
//! disk and are taken over; a VM that was running is gone (its channel closed with the old
//! edge).

use super::*;

impl FullVmSubstrate {
    /// Takes over a paused full VM of an earlier edge run: its state is the snapshot and the
    /// qcow2 overlay in `<sandbox dir>/vm`, with the QEMU command line (`qemu.args`) that
    /// restores it. A VM that was running when the edge went away is not adoptable (its
    /// channel is gone); the caller ends its QEMU ([`crate::qemu::vm::kill_leftover_qemu`]).
    pub fn adopt_paused(
        &self,
        id: &str,
        sandbox_dir: &Path,
    ) -> Result<FullVmSandbox, crate::qemu::VmError> {
        let vm_dir = sandbox_dir.join("vm");
        if !vm_dir.join("overlay.qcow2").is_file() {
            return Err(crate::qemu::VmError::NoOverlay(vm_dir));
        }
        let vm = vm::Vm::adopt_paused(id, &vm_dir)?;
        Ok(FullVmSandbox {
            id: id.to_string(),
            vm_dir,
            vm,
        })
    }
}
