//! Re-adoption of a microVM after an edge restart: a paused VM's snapshot is on disk and is
//! taken over; a VM that was running is gone (its channel closed with the old edge).

use std::path::Path;

use super::{template, vm, MicroVmSandbox, MicroVmSubstrate};

impl MicroVmSubstrate {
    /// Takes over a paused microVM of an earlier edge run (its snapshot is on disk). A VM that
    /// was running when the edge went away is gone: its channel closed and the guest ended.
    pub fn adopt_paused(
        &self,
        id: &str,
        sandbox_dir: &Path,
    ) -> Result<MicroVmSandbox, crate::qemu::VmError> {
        let vm_dir = sandbox_dir.join("vm");
        let vm = vm::Vm::adopt_paused(id, &vm_dir)?;
        Ok(MicroVmSandbox {
            id: id.to_string(),
            vm_dir,
            vm,
            boot: template::BootKind::Cold,
        })
    }
}
