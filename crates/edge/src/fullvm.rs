//! The edge's driver for the full-VM substrate ([`dsec_runtime::fullvm`]).
//!
//! Sandboxes with `substrate: "vm"` are routed here by the manager; their `image` names a VM
//! disk image (not an image of the layer store): `<data_dir>/vm-images/<name>.qcow2`
//! (registered with `dsec vm image import`), else `${DSEC_CACHE:-/var/cache/dsec}/vm/<name>.qcow2`
//! (built by `scripts/vm/build-disk.sh`). Pause/resume snapshot the VM like a microVM.
//! What a full VM cannot do is refused: sandbox-wide env,
//! a non-root init user, workspaces/toolkits (layers), and `pack` (checked in the manager).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsec_runtime::container::adopt::AdoptError;
use dsec_runtime::fullvm::{FullVmSandbox, FullVmSubstrate};
use dsec_runtime::substrate::{CreateSandboxError, SandboxSpec, Substrate as _};

use crate::substrate::{BoxFut, Driver, LiveSandbox};
use crate::EdgeError;

/// Checks a VM image name: 1-64 of `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Where `dsec vm image import` registers images (`<data_dir>/vm-images`).
pub fn registered_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("vm-images")
}

/// The directories searched for `<name>.qcow2`, in order.
pub fn image_dirs(data_dir: &Path) -> Vec<PathBuf> {
    let cache = std::env::var_os("DSEC_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/dsec"));
    vec![registered_dir(data_dir), cache.join("vm")]
}

/// Resolves a VM image name to its disk file.
pub fn resolve_image(data_dir: &Path, name: &str) -> Result<PathBuf, EdgeError> {
    if !valid_name(name) {
        return Err(EdgeError::BadRequest(format!(
            "VM image name {name:?}: 1-64 of [A-Za-z0-9._-], not starting with '.' or '-'"
        )));
    }
    let dirs = image_dirs(data_dir);
    dirs.iter()
        .map(|d| d.join(format!("{name}.qcow2")))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            EdgeError::ImageNotFound(format!(
                "VM image {name:?} not found (looked in {}); register one with `dsec vm image import {name} FILE --data-dir ...` or build the default with scripts/vm/build-disk.sh",
                dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
            ))
        })
}

/// Validates the parts of a create request a full VM cares about; returns the image name.
pub fn check_request(req: &dsec_wire::api::CreateSandboxRequest) -> Result<String, EdgeError> {
    if req.workspace.is_some() || !req.toolkits.is_empty() {
        return Err(EdgeError::BadRequest(
            "workspace and toolkits are layers of the image store; a full VM boots a disk image and cannot take them".into(),
        ));
    }
    if req.disk_limit_mb.is_some() {
        return Err(EdgeError::BadRequest(
            "disk_limit_mb is not supported for full-VM sandboxes yet (the overlay can grow to the image's virtual size)".into(),
        ));
    }
    if !valid_name(&req.image) {
        return Err(EdgeError::BadRequest(format!(
            "VM image name {:?}: 1-64 of [A-Za-z0-9._-], not starting with '.' or '-'",
            req.image
        )));
    }
    Ok(req.image.clone())
}

/// The driver if QEMU and qemu-img are installed, else why not (for the 501). `microvm` and
/// `vm` are the validated `[edge.microvm]` and `[edge.vm]` of the edge config (a full VM uses
/// the microVMs' accelerator and QEMU unless `[edge.vm]` says otherwise).
pub fn driver(
    microvm: &crate::vm_config::MicroVmSection,
    vm: &crate::vm_config::VmSection,
) -> Result<Arc<dyn Driver>, String> {
    let config = vm.runtime_config(microvm).map_err(|e| e.to_string())?;
    for bin in [&config.qemu_binary, &config.qemu_img] {
        if !crate::microvm::installed(bin) {
            return Err(format!(
                "{} is not installed: run scripts/install-deps.sh (qemu-system-x86, qemu-utils)",
                bin.display()
            ));
        }
    }
    tracing::info!(
        accel = config.accel.as_str(),
        machine = config.machine.as_str(),
        "full-VM substrate available"
    );
    Ok(Arc::new(FullVmDriver {
        inner: Arc::new(FullVmSubstrate::new(config)),
    }))
}

/// [`Driver`] for the full-VM substrate.
pub struct FullVmDriver {
    inner: Arc<FullVmSubstrate>,
}

impl Driver for FullVmDriver {
    fn kind(&self) -> dsec_wire::api::Substrate {
        dsec_wire::api::Substrate::Vm
    }

    fn create(
        &self,
        spec: SandboxSpec,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, CreateSandboxError>> {
        Box::pin(async move {
            if !spec.protected_paths.is_empty() {
                return Err(CreateSandboxError::InvalidSpec(
                    "protected_paths are not supported for full-VM sandboxes (no Landlock in the guest)".into(),
                ));
            }
            let sandbox = self.inner.create(spec).await?;
            Ok(Box::new(crate::microvm::VmLive(sandbox)) as Box<dyn LiveSandbox>)
        })
    }

    fn reap_orphans(&self, known_live: Vec<String>) -> BoxFut<'_, Vec<String>> {
        Box::pin(async move { self.inner.reap_orphans(&known_live).await })
    }

    /// After an edge restart: a paused full VM (snapshot + overlay on disk) is taken over and
    /// resumes on its next request; a running one lost its channel with the old edge, so its
    /// QEMU (by the pidfile, only if that pid is a QEMU) is ended and its files removed.
    fn adopt(
        &self,
        id: String,
        dir: PathBuf,
        pid: i32,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, AdoptError>> {
        Box::pin(async move {
            let adopted = self.inner.adopt_paused(&id, &dir);
            crate::microvm::adopt_paused_vm("full VM", adopted, id, &dir, pid).await
        })
    }
}

impl crate::microvm::EdgeVm for FullVmSandbox {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_lookup() {
        assert!(valid_name("debian"));
        assert!(valid_name("deb-12.1_x"));
        assert!(!valid_name(""));
        assert!(!valid_name(".x"));
        assert!(!valid_name("../etc"));
        assert!(!valid_name("a/b"));
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(t.path().join("vm-images")).unwrap();
        std::fs::write(t.path().join("vm-images/mine.qcow2"), b"x").unwrap();
        assert_eq!(
            resolve_image(t.path(), "mine").unwrap(),
            t.path().join("vm-images/mine.qcow2")
        );
        assert!(matches!(
            resolve_image(t.path(), "nope-does-not-exist"),
            Err(EdgeError::ImageNotFound(_))
        ));
        assert!(matches!(
            resolve_image(t.path(), "../x"),
            Err(EdgeError::BadRequest(_))
        ));
    }
}
