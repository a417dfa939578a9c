//! Named persistent volumes on this node: an ext4 file system in a sparse image file,
//! `<edge dir>/volumes/<id>/disk.img`, loop-mounted on the host at `<id>/fs` while at least one
//! sandbox uses it, and bound (its `data` directory) into each such sandbox by the substrate.
//!
//! - The size limit is the file system's: writes past it fail with ENOSPC inside the sandboxes
//!   using the volume, and nothing else (the host disk only holds the blocks really written).
//! - One host mount per volume, shared by every sandbox using it (read-write or read-only binds
//!   of the same super block), so the image is never mounted twice on this node. The loop
//!   device is looked up by its backing file before a new one is attached: a sandbox whose
//!   mount namespace is still being torn down keeps the old super block alive, and mounting
//!   the same loop device again shares it instead of opening a second writer of the image.
//! - Who uses a volume is kept on disk (`<id>/users/<sandbox id>`), so an edge restarted after
//!   a crash keeps the mounts of the sandboxes it re-adopts and removes the others
//!   ([`Volumes::recover`]).
//! - A volume in use cannot be deleted ([`VolumeError::InUse`] names the sandboxes).
//!
//! This module must not know which project owns a volume or its name: the apiserver keeps
//! both and sends the node's ids.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};

use dsec_wire::api::{
    check_volume_path, is_valid_volume_id, EdgeVolumeInfo, VolumeMount, MAX_VOLUME_MB,
    MIN_VOLUME_MB,
};
use dsec_wire::id::is_valid_sandbox_id;

use crate::error::EdgeError;

/// Why a volume operation failed.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("{0}")]
    Invalid(String),
    #[error("volume {0} does not exist on this node")]
    NotFound(String),
    #[error("volume {0} already exists on this node")]
    Exists(String),
    #[error("volume {id} is mounted by sandbox(es) {}; stop them first", sandboxes.join(", "))]
    InUse { id: String, sandboxes: Vec<String> },
    #[error("volume: {op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("volume: run {cmd}: {source}")]
    Spawn { cmd: String, source: std::io::Error },
    #[error("volume: {cmd} failed: {stderr}")]
    Command { cmd: String, stderr: String },
}

impl From<VolumeError> for EdgeError {
    fn from(e: VolumeError) -> Self {
        match e {
            VolumeError::Invalid(m) => EdgeError::BadRequest(m),
            VolumeError::NotFound(_) => EdgeError::NotFound(e.to_string()),
            VolumeError::Exists(_) | VolumeError::InUse { .. } => {
                EdgeError::Conflict(e.to_string())
            }
            _ => EdgeError::Internal(e.to_string()),
        }
    }
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> VolumeError {
    let path = path.to_path_buf();
    move |source| VolumeError::Io { op, path, source }
}

fn run(cmd: &str, args: &[&str]) -> Result<String, VolumeError> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|source| VolumeError::Spawn {
            cmd: cmd.to_string(),
            source,
        })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(VolumeError::Command {
            cmd: format!("{cmd} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// `<id>/meta.json`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Meta {
    size_mb: u64,
    created_ms: u64,
}

/// The volumes of this node.
pub struct Volumes {
    dir: PathBuf,
    /// Volume id → the sandboxes using it (a volume is mounted on the host exactly while this
    /// set is not empty).
    users: Mutex<BTreeMap<String, BTreeSet<String>>>,
}

/// One mount a create asks for, resolved: the host directory to bind.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub source: PathBuf,
    pub target: String,
    pub read_only: bool,
}

/// Checks the `volumes` of a create request (paths and ids), before admission.
pub fn validate_mounts(mounts: &BTreeMap<String, VolumeMount>) -> Result<(), EdgeError> {
    let mut ids = BTreeSet::new();
    for (path, m) in mounts {
        check_volume_path(path).map_err(EdgeError::BadRequest)?;
        if !is_valid_volume_id(m.name()) {
            return Err(EdgeError::BadRequest(format!(
                "volume {:?} (at {path}) is not a volume id of this node: create volumes with POST /v1/volumes and mount them by name through the apiserver",
                m.name()
            )));
        }
        if !ids.insert(m.name()) {
            return Err(EdgeError::BadRequest(format!(
                "volume {} is mounted twice; mount each volume at one path",
                m.name()
            )));
        }
    }
    Ok(())
}

impl Volumes {
    pub fn new(dir: PathBuf) -> Self {
        Volumes {
            dir,
            users: Mutex::new(BTreeMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, BTreeSet<String>>> {
        self.users.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn vol_dir(&self, id: &str) -> Result<PathBuf, VolumeError> {
        if !is_valid_volume_id(id) {
            return Err(VolumeError::NotFound(id.to_string()));
        }
        Ok(self.dir.join(id))
    }

    /// Makes a volume of `size_mb` MiB (blocking: mkfs).
    pub fn create(&self, id: &str, size_mb: u64) -> Result<EdgeVolumeInfo, VolumeError> {
        if !is_valid_volume_id(id) {
            return Err(VolumeError::Invalid(format!(
                "volume id {id:?} must be `vol-` and 16 lowercase hex digits"
            )));
        }
        if !(MIN_VOLUME_MB..=MAX_VOLUME_MB).contains(&size_mb) {
            return Err(VolumeError::Invalid(format!(
                "size_mb {size_mb} is out of range: give {MIN_VOLUME_MB} to {MAX_VOLUME_MB} MiB"
            )));
        }
        let dir = self.dir.join(id);
        if dir.exists() {
            return Err(VolumeError::Exists(id.to_string()));
        }
        let tmp = self.dir.join(format!(".new-{id}"));
        let _ = std::fs::remove_dir_all(&tmp);
        let made = (|| {
            std::fs::create_dir_all(tmp.join("users")).map_err(io_err("create", &tmp))?;
            let img = tmp.join("disk.img");
            let f = std::fs::File::create(&img).map_err(io_err("create", &img))?;
            f.set_len(size_mb << 20).map_err(io_err("size", &img))?;
            drop(f);
            run(
                "mkfs.ext4",
                &[
                    "-q",
                    "-F",
                    "-m",
                    "0",
                    "-E",
                    "lazy_itable_init=1,nodiscard",
                    &img.to_string_lossy(),
                ],
            )?;
            let meta = Meta {
                size_mb,
                created_ms: dsec_node::now_ms(),
            };
            let m = tmp.join("meta.json");
            std::fs::write(&m, serde_json::to_vec(&meta).unwrap_or_default())
                .map_err(io_err("write", &m))?;
            std::fs::rename(&tmp, &dir).map_err(io_err("rename", &dir))
        })();
        if let Err(e) = made {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        tracing::info!(volume = %id, size_mb, "volume created");
        self.info(id)
    }

    /// What this node knows about one volume.
    pub fn info(&self, id: &str) -> Result<EdgeVolumeInfo, VolumeError> {
        let dir = self.vol_dir(id)?;
        let m = dir.join("meta.json");
        let meta: Meta = match std::fs::read(&m) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| VolumeError::Io {
                op: "parse",
                path: m.clone(),
                source: std::io::Error::other(e),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(VolumeError::NotFound(id.to_string()))
            }
            Err(e) => return Err(io_err("read", &m)(e)),
        };
        let used_by: Vec<String> = self
            .lock()
            .get(id)
            .map(|u| u.iter().cloned().collect())
            .unwrap_or_default();
        let fs = dir.join("fs");
        let used_bytes = (!used_by.is_empty() && is_mountpoint(&fs))
            .then(|| nix::sys::statvfs::statvfs(&fs).ok())
            .flatten()
            .map(|s| s.blocks().saturating_sub(s.blocks_free()) * s.fragment_size());
        Ok(EdgeVolumeInfo {
            id: id.to_string(),
            size_mb: meta.size_mb,
            used_bytes,
            used_by,
        })
    }

    /// Every volume of this node.
    pub fn list(&self) -> Vec<EdgeVolumeInfo> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut out: Vec<EdgeVolumeInfo> = rd
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| is_valid_volume_id(n))
            .filter_map(|n| self.info(&n).ok())
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Deletes a volume and its data; refused while a sandbox has it mounted.
    pub fn delete(&self, id: &str) -> Result<(), VolumeError> {
        let dir = self.vol_dir(id)?;
        let users = self.lock();
        if let Some(u) = users.get(id).filter(|u| !u.is_empty()) {
            return Err(VolumeError::InUse {
                id: id.to_string(),
                sandboxes: u.iter().cloned().collect(),
            });
        }
        if !dir.join("meta.json").exists() {
            return Err(VolumeError::NotFound(id.to_string()));
        }
        unmount(&dir);
        std::fs::remove_dir_all(&dir).map_err(io_err("remove", &dir))?;
        drop(users);
        tracing::info!(volume = %id, "volume deleted");
        Ok(())
    }

    /// Mounts each volume for `sandbox` (on the host, once per volume) and answers the host
    /// directories to bind. On error nothing stays acquired.
    pub fn acquire(
        &self,
        sandbox: &str,
        mounts: &BTreeMap<String, VolumeMount>,
    ) -> Result<Vec<Resolved>, VolumeError> {
        let mut out = Vec::new();
        for (target, m) in mounts {
            match self.acquire_one(sandbox, m.name()) {
                Ok(source) => out.push(Resolved {
                    source,
                    target: target.clone(),
                    read_only: m.read_only(),
                }),
                Err(e) => {
                    self.release(sandbox);
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    fn acquire_one(&self, sandbox: &str, id: &str) -> Result<PathBuf, VolumeError> {
        let dir = self.vol_dir(id)?;
        if !dir.join("meta.json").exists() {
            return Err(VolumeError::NotFound(id.to_string()));
        }
        let mut users = self.lock();
        let set = users.entry(id.to_string()).or_default();
        if !is_mountpoint(&dir.join("fs")) {
            if let Err(e) = mount(&dir) {
                if set.is_empty() {
                    users.remove(id);
                }
                return Err(e);
            }
        }
        let note = dir.join("users").join(sandbox);
        std::fs::create_dir_all(dir.join("users"))
            .and_then(|()| std::fs::write(&note, b""))
            .map_err(io_err("write", &note))?;
        set.insert(sandbox.to_string());
        Ok(dir.join("fs").join("data"))
    }

    /// Gives back every volume `sandbox` used; a volume nobody uses any more is unmounted from
    /// the host (blocking). Idempotent.
    pub fn release(&self, sandbox: &str) {
        let mut users = self.lock();
        let ids: Vec<String> = users
            .iter()
            .filter(|(_, u)| u.contains(sandbox))
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            let dir = self.dir.join(&id);
            let _ = std::fs::remove_file(dir.join("users").join(sandbox));
            let empty = users.get_mut(&id).is_some_and(|u| {
                u.remove(sandbox);
                u.is_empty()
            });
            if empty {
                users.remove(&id);
                unmount(&dir);
                tracing::debug!(volume = %id, "volume unmounted: no sandbox uses it");
            }
        }
    }

    /// After a restart: keeps the uses of re-adopted sandboxes (mounting their volumes again if
    /// the host lost the mount), forgets the others and unmounts volumes nobody uses.
    pub fn recover(&self, adopted: &[String]) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut users = self.lock();
        users.clear();
        for e in rd.flatten() {
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let dir = e.path();
            if name.starts_with(".new-") {
                unmount(&dir);
                let _ = std::fs::remove_dir_all(&dir);
                continue;
            }
            if !is_valid_volume_id(&name) {
                continue;
            }
            let mut set = BTreeSet::new();
            if let Ok(us) = std::fs::read_dir(dir.join("users")) {
                for u in us.flatten() {
                    let sb = u.file_name().to_string_lossy().into_owned();
                    if is_valid_sandbox_id(&sb) && adopted.contains(&sb) {
                        set.insert(sb);
                    } else {
                        let _ = std::fs::remove_file(u.path());
                    }
                }
            }
            if set.is_empty() {
                if is_mountpoint(&dir.join("fs")) {
                    tracing::info!(volume = %name, "unmount a volume no re-adopted sandbox uses");
                }
                unmount(&dir);
            } else {
                if !is_mountpoint(&dir.join("fs")) {
                    if let Err(e) = mount(&dir) {
                        tracing::error!(volume = %name, error = %e, "mount a volume of re-adopted sandboxes");
                    }
                }
                users.insert(name, set);
            }
        }
    }

    /// At shutdown (every sandbox stopped): unmounts whatever is still mounted.
    pub fn unmount_all(&self) {
        let mut users = self.lock();
        for (id, u) in users.iter() {
            tracing::warn!(volume = %id, users = ?u, "volume still in use at shutdown: unmounting");
            unmount(&self.dir.join(id));
        }
        users.clear();
    }
}

fn is_mountpoint(p: &Path) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    match (std::fs::metadata(p), p.parent().map(std::fs::metadata)) {
        (Ok(a), Some(Ok(b))) => a.dev() != b.dev(),
        _ => false,
    }
}

/// The loop devices backed by `img` (`losetup -j`), e.g. `/dev/loop3`.
fn loop_devices_of(img: &Path) -> Vec<String> {
    run("losetup", &["-j", &img.to_string_lossy()])
        .map(|out| {
            out.lines()
                .filter_map(|l| l.split(':').next())
                .filter(|d| d.starts_with("/dev/loop"))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// Mounts `<dir>/disk.img` at `<dir>/fs` (nodev, nosuid) and makes `<dir>/fs/data`.
fn mount(dir: &Path) -> Result<(), VolumeError> {
    let img = dir.join("disk.img");
    let fs = dir.join("fs");
    std::fs::create_dir_all(&fs).map_err(io_err("create", &fs))?;
    let fs_s = fs.to_string_lossy().into_owned();
    let mut last = None;
    for _ in 0..2 {
        // An existing loop device of this image (a super block still alive in a sandbox's
        // dying mount namespace) is mounted again, never a second one.
        let dev = match loop_devices_of(&img).into_iter().next() {
            Some(d) => d,
            None => run("losetup", &["--find", "--show", &img.to_string_lossy()])?
                .trim()
                .to_string(),
        };
        match run("mount", &["-t", "ext4", "-o", "nodev,nosuid", &dev, &fs_s]) {
            Ok(_) => {
                // Detached by the kernel once the last user of the super block is gone.
                let _ = run("losetup", &["-d", &dev]);
                last = None;
                break;
            }
            Err(e) => {
                let _ = run("losetup", &["-d", &dev]);
                last = Some(e);
            }
        }
    }
    if let Some(e) = last {
        return Err(e);
    }
    let data = fs.join("data");
    let made = std::fs::create_dir_all(&data).and_then(|()| {
        use std::os::unix::fs::PermissionsExt as _;
        // Any user of the sandbox may write (the volume is the project's, not one uid's).
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o1777))
    });
    if let Err(e) = made {
        unmount(dir);
        return Err(io_err("create", &data)(e));
    }
    Ok(())
}

/// Unmounts `<dir>/fs` if mounted (lazily: sandboxes' binds keep their super block until they
/// are gone; the loop device is detached with it).
fn unmount(dir: &Path) {
    let fs = dir.join("fs");
    if is_mountpoint(&fs) {
        if let Err(e) = nix::mount::umount2(&fs, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!(dir = %fs.display(), error = %e, "unmount volume");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mounts(v: &[(&str, &str, bool)]) -> BTreeMap<String, VolumeMount> {
        v.iter()
            .map(|(p, id, ro)| {
                (
                    p.to_string(),
                    VolumeMount::Spec(dsec_wire::api::VolumeMountSpec {
                        name: id.to_string(),
                        read_only: *ro,
                    }),
                )
            })
            .collect()
    }

    #[test]
    fn mount_requests_are_checked() {
        let id = "vol-00000000000000aa";
        assert!(validate_mounts(&mounts(&[("/data", id, false)])).is_ok());
        assert!(validate_mounts(&mounts(&[("/data", "vol1", false)])).is_err());
        assert!(validate_mounts(&mounts(&[("/proc/x", id, false)])).is_err());
        assert!(validate_mounts(&mounts(&[("/a", id, false), ("/b", id, true)])).is_err());
    }

    /// A real volume: made, mounted once for two users, ENOSPC past its size, unmounted when
    /// the last user goes, refused deletion while in use, kept across a recover for an
    /// adopted user only.
    #[test]
    fn lifecycle_on_a_real_loop_mount() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skip: needs root (loop mount)");
            return;
        }
        let d = tempfile::tempdir_in("/var/tmp").expect("tempdir");
        let v = Volumes::new(d.path().to_path_buf());
        let id = "vol-00000000000000ab";
        v.create(id, 8).expect("create");
        assert!(matches!(v.create(id, 8), Err(VolumeError::Exists(_))));
        let (a, b) = ("sb-n0-0000000000000001", "sb-n0-0000000000000002");
        let m = mounts(&[("/data", id, false)]);
        let src = v.acquire(a, &m).expect("acquire a")[0].source.clone();
        v.acquire(b, &m).expect("acquire b");
        assert_eq!(
            loop_devices_of(&d.path().join(id).join("disk.img")).len(),
            1
        );
        let err = std::fs::write(src.join("big"), vec![0u8; 16 << 20]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
        let _ = std::fs::remove_file(src.join("big"));
        std::fs::write(src.join("kept"), b"yes").unwrap();
        match v.delete(id) {
            Err(VolumeError::InUse { sandboxes, .. }) => assert_eq!(sandboxes, [a, b]),
            other => panic!("delete in use: {other:?}"),
        }
        // A restart that re-adopted only `a`.
        v.recover(&[a.to_string()]);
        assert_eq!(v.info(id).unwrap().used_by, [a]);
        v.release(a);
        assert!(!is_mountpoint(&d.path().join(id).join("fs")));
        // The loop device is detached by the kernel once the super block is gone (the rundown
        // may run on a workqueue): bounded wait.
        let img = d.path().join(id).join("disk.img");
        let t0 = std::time::Instant::now();
        while !loop_devices_of(&img).is_empty() && t0.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert!(loop_devices_of(&img).is_empty());
        let src = v.acquire(a, &m).expect("again")[0].source.clone();
        assert_eq!(std::fs::read(src.join("kept")).unwrap(), b"yes");
        v.release(a);
        v.delete(id).expect("delete");
        assert!(!d.path().join(id).exists());
    }
}
