//! The full-VM substrate behind the one substrate interface ([`crate::substrate`]).
//!
//! A full VM's `image` names a VM disk image (not an image of the layer store):
//! `<data_dir>/vm-images/<name>.qcow2` (registered with `dsec vm image import`), else
//! `<cache dir>/vm/<name>.qcow2` (built by `scripts/vm/build-disk.sh`; the edge's cache dir,
//! `${DSEC_CACHE:-/var/cache/dsec}`).
//! Pause/resume snapshot the VM like a microVM. What a full VM cannot do is refused: sandbox-wide
//! env, a non-root init user, workspaces/toolkits (layers), a disk limit, protected paths and
//! `pack_diff`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dsec_wire::api::CreateSandboxRequest;

use super::{FullVmSandbox, FullVmSubstrate};
use crate::error::AdoptError;
use crate::substrate::vm::{adopt_paused_vm, installed, VmGuest, VmLive};
use crate::substrate::{
    BoxFut, Capabilities, CreateOptions, CreateSandboxError, DiskLimit, ImageSource,
    InvalidRequest, LiveSandbox, OpenContext, ResolveImageError, SandboxSpec, Substrate,
    Unavailable,
};

/// What full VMs can do.
pub const CAPABILITIES: Capabilities = Capabilities {
    image_source: ImageSource::DiskImage,
    pack_diff: false,
    disk_limit: DiskLimit::Unsupported,
    sched_idle_at_spawn: false,
    pause_ends_process: true,
    early_teardown: false,
    cgroup_reclaim: false,
    ports_in_netns: false,
    volume_binds: false,
};

/// Checks a VM image name: 1-64 of `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && !name.starts_with(['.', '-'])
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn bad_name(name: &str) -> String {
    format!("VM image name {name:?}: 1-64 of [A-Za-z0-9._-], not starting with '.' or '-'")
}

/// Where `dsec vm image import` registers images (`<data_dir>/vm-images`).
pub fn registered_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("vm-images")
}

/// The directories searched for `<name>.qcow2`, in order: the registered ones below
/// `data_dir`, then the built ones below `cache_dir`.
pub fn image_dirs(data_dir: &Path, cache_dir: &Path) -> Vec<PathBuf> {
    vec![registered_dir(data_dir), cache_dir.join("vm")]
}

/// Resolves a VM image name to its disk file in the first of `dirs` that has it.
pub fn resolve_image(dirs: &[PathBuf], name: &str) -> Result<PathBuf, ResolveImageError> {
    if !valid_name(name) {
        return Err(ResolveImageError::InvalidName(bad_name(name)));
    }
    dirs.iter()
        .map(|d| d.join(format!("{name}.qcow2")))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            ResolveImageError::NotFound(format!(
                "VM image {name:?} not found (looked in {}); register one with `dsec vm image import {name} FILE --data-dir ...` or build the default with scripts/vm/build-disk.sh",
                dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>().join(", ")
            ))
        })
}

/// Refuses the parts of a create request a full VM cannot serve.
pub fn check_request(req: &CreateSandboxRequest) -> Result<(), InvalidRequest> {
    if req.workspace.is_some() || !req.toolkits.is_empty() {
        return Err(InvalidRequest(
            "workspace and toolkits are layers of the image store; a full VM boots a disk image and cannot take them".into(),
        ));
    }
    if req.disk_limit_mb.is_some() {
        return Err(InvalidRequest(
            "disk_limit_mb is not supported for full-VM sandboxes yet (the overlay can grow to the image's virtual size)".into(),
        ));
    }
    if !valid_name(&req.image) {
        return Err(InvalidRequest(bad_name(&req.image)));
    }
    Ok(())
}

/// The full-VM substrate of an edge.
pub struct FullVmDriver {
    inner: Arc<FullVmSubstrate>,
    /// Where disk images are looked up ([`image_dirs`]).
    image_dirs: Vec<PathBuf>,
}

impl FullVmDriver {
    /// The substrate if QEMU and qemu-img are installed, else why not.
    pub fn open(ctx: &OpenContext) -> Result<Arc<dyn Substrate>, Unavailable> {
        let config = ctx.vm.clone()?;
        for bin in [&config.qemu_binary, &config.qemu_img] {
            if !installed(bin) {
                return Err(Unavailable(format!(
                    "{} is not installed: run scripts/install-deps.sh (qemu-system-x86, qemu-utils)",
                    bin.display()
                )));
            }
        }
        tracing::info!(
            accel = config.accel.as_str(),
            machine = config.machine.as_str(),
            "full-VM substrate available"
        );
        Ok(Arc::new(Self {
            inner: Arc::new(FullVmSubstrate::new(config)),
            image_dirs: image_dirs(&ctx.data_dir, &ctx.cache_dir),
        }))
    }
}

impl Substrate for FullVmDriver {
    fn kind(&self) -> dsec_wire::api::Substrate {
        dsec_wire::api::Substrate::Vm
    }

    fn capabilities(&self) -> Capabilities {
        CAPABILITIES
    }

    fn check_request(&self, req: &CreateSandboxRequest) -> Result<(), InvalidRequest> {
        check_request(req)
    }

    fn resolve_disk_image(&self, name: &str) -> Result<PathBuf, ResolveImageError> {
        resolve_image(&self.image_dirs, name)
    }

    fn create(
        &self,
        spec: SandboxSpec,
        _opts: CreateOptions,
    ) -> BoxFut<'_, Result<Box<dyn LiveSandbox>, CreateSandboxError>> {
        Box::pin(async move {
            if !spec.protected_paths.is_empty() {
                return Err(CreateSandboxError::InvalidSpec(
                    "protected_paths are not supported for full-VM sandboxes (no Landlock in the guest)".into(),
                ));
            }
            let sandbox = self.inner.create(spec).await?;
            Ok(Box::new(VmLive(sandbox)) as Box<dyn LiveSandbox>)
        })
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
            adopt_paused_vm("full VM", adopted, id, &dir, pid).await
        })
    }

    // reap_orphans: QEMU processes are children of the edge (killed on drop); the default
    // (nothing to reap) applies.
}

impl VmGuest for FullVmSandbox {
    fn id(&self) -> &str {
        &self.id
    }
}

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
            resolve_image(&image_dirs(t.path(), &t.path().join("cache")), "mine").unwrap(),
            t.path().join("vm-images/mine.qcow2")
        );
        assert!(matches!(
            resolve_image(
                &image_dirs(t.path(), &t.path().join("cache")),
                "nope-does-not-exist"
            ),
            Err(ResolveImageError::NotFound(_))
        ));
        assert!(matches!(
            resolve_image(&image_dirs(t.path(), &t.path().join("cache")), "../x"),
            Err(ResolveImageError::InvalidName(_))
        ));
    }

    #[test]
    fn requests_a_full_vm_cannot_serve() {
        let ok = CreateSandboxRequest {
            image: "debian".into(),
            ..Default::default()
        };
        check_request(&ok).unwrap();
        for bad in [
            CreateSandboxRequest {
                workspace: Some("ws".into()),
                ..ok.clone()
            },
            CreateSandboxRequest {
                disk_limit_mb: Some(64),
                ..ok.clone()
            },
            CreateSandboxRequest {
                image: "../etc".into(),
                ..ok.clone()
            },
        ] {
            assert!(check_request(&bad).is_err(), "{bad:?}");
        }
    }
}
