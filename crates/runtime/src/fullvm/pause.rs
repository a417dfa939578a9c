//! Pause and resume of a full VM: the guest is snapshotted to disk and QEMU ends (the overlay
//! disk is a host file and needs no copy); resume starts QEMU again from the snapshot. Both VM
//! substrates pause the same way, so the code is [`crate::qemu::snapshot`] (`Vm::pause`,
//! `Vm::resume`), reached through [`crate::substrate::vm::VmLive`]; nothing here is specific to
//! the full VM.
