//! QEMU, shared by the two VM substrates ([`crate::microvm`] and [`crate::fullvm`]): each builds
//! its own command line, and this module runs it.
//!
//! * [`args`] — the command-line parts every VM shares (accelerator, quoting, control sockets,
//!   shell quoting of the migration commands).
//! * [`vm`] — one QEMU process: launch, boot to aether's `Ready`, kill, death detection.
//! * [`snapshot`] — pause by migrating the guest to a file and ending QEMU; resume from it.
//! * [`qmp`] — the QMP client (commands, migration status).
//! * [`relay`] — the aether channel's relay between the edge and QEMU's socket, which
//!   survives a snapshot.
//! * [`error`] — what starting, restoring or killing QEMU and wiring its NIC fail with.
//! * [`machine`] — the machine types (`microvm`, `pc`) and their virtio device names.
//! * [`net`] — a networked VM's tap device and NIC in the sandbox's network namespace.

pub mod args;
pub mod error;
pub mod machine;
pub mod net;
pub mod qmp;
pub mod relay;
pub mod snapshot;
pub mod vm;

pub use args::Accel;
pub use error::{VmError, VmNetError};
pub use machine::Machine;
pub use vm::{Launch, Vm};
