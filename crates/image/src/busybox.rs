//! The built-in `busybox:latest` image, made from the host's static busybox binary.

use std::fs;
use std::io::{self, Read};
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};

pub const BUSYBOX_IMAGE: &str = "busybox:latest";
pub const HOST_BUSYBOX: &str = "/bin/busybox";

const INSTALL_HINT: &str = "install the static build with `apt-get install busybox-static`";

/// Why the built-in busybox image could not be built from the host's binary.
#[derive(Debug, thiserror::Error)]
pub enum BusyboxError {
    #[error("{} is dynamically linked and would not run inside a sandbox; {INSTALL_HINT}", .0.display())]
    Dynamic(PathBuf),
    #[error("{} not found; {INSTALL_HINT}", .0.display())]
    NotFound(PathBuf),
    #[error("read {}: {source}; {INSTALL_HINT}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("run {} --list-full: {source}", path.display())]
    Run { path: PathBuf, source: io::Error },
    #[error("{} --list-full failed ({status}): {stderr}; {INSTALL_HINT}", path.display())]
    ListFailed {
        path: PathBuf,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("{} lists no applets; {INSTALL_HINT}", .0.display())]
    NoApplets(PathBuf),
    #[error("build busybox root in {}: {source}", root.display())]
    Populate { root: PathBuf, source: io::Error },
    /// The store's work directory for the build could not be made.
    #[error("create {}: {source}", path.display())]
    WorkDir { path: PathBuf, source: io::Error },
}

/// Builds the busybox root filesystem in `root` (which must not exist yet) from `busybox`.
pub fn build_root(busybox: &Path, root: &Path) -> Result<(), BusyboxError> {
    match is_static_elf(busybox) {
        Ok(true) => {}
        Ok(false) => return Err(BusyboxError::Dynamic(busybox.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(BusyboxError::NotFound(busybox.to_path_buf()))
        }
        Err(source) => {
            return Err(BusyboxError::Read {
                path: busybox.to_path_buf(),
                source,
            })
        }
    }
    let applets = list_applets(busybox)?;
    populate(busybox, root, &applets).map_err(|source| BusyboxError::Populate {
        root: root.to_path_buf(),
        source,
    })
}

/// `busybox --list-full`: applet paths relative to `/` (e.g. `bin/sh`, `usr/bin/env`).
fn list_applets(busybox: &Path) -> Result<Vec<PathBuf>, BusyboxError> {
    let out = std::process::Command::new(busybox)
        .arg("--list-full")
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|source| BusyboxError::Run {
            path: busybox.to_path_buf(),
            source,
        })?;
    if !out.status.success() {
        return Err(BusyboxError::ListFailed {
            path: busybox.to_path_buf(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut applets: Vec<PathBuf> = text
        .lines()
        .map(str::trim)
        .filter(|l| {
            !l.is_empty()
                && !l.starts_with('/')
                && l.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
        })
        .map(PathBuf::from)
        .collect();
    if applets.is_empty() {
        return Err(BusyboxError::NoApplets(busybox.to_path_buf()));
    }
    if !applets.iter().any(|p| p == Path::new("bin/sh")) {
        applets.push(PathBuf::from("bin/sh"));
    }
    Ok(applets)
}

fn populate(busybox: &Path, root: &Path, applets: &[PathBuf]) -> io::Result<()> {
    let dirs: &[(&str, u32)] = &[
        ("", 0o755),
        ("bin", 0o755),
        ("sbin", 0o755),
        ("usr", 0o755),
        ("usr/bin", 0o755),
        ("usr/sbin", 0o755),
        ("etc", 0o755),
        ("root", 0o700),
        ("home", 0o755),
        ("home/user", 0o755),
        ("tmp", 0o1777),
        ("var", 0o755),
        ("var/tmp", 0o1777),
        ("proc", 0o555),
        ("sys", 0o555),
        ("dev", 0o755),
        ("dev/pts", 0o755),
        ("dev/shm", 0o1777),
        ("run", 0o755),
    ];
    for (d, mode) in dirs {
        let p = root.join(d);
        fs::create_dir_all(&p)?;
        fs::set_permissions(&p, fs::Permissions::from_mode(*mode))?;
    }
    let bin = root.join("bin/busybox");
    fs::copy(busybox, &bin)?;
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o755))?;
    nix::unistd::chown(&bin, Some(0.into()), Some(0.into()))?;
    for applet in applets {
        if applet == Path::new("bin/busybox") {
            continue;
        }
        let link = root.join(applet);
        if let Some(parent) = link.parent() {
            fs::create_dir_all(parent)?;
        }
        match symlink("/bin/busybox", &link) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
    }
    let files: &[(&str, &str, u32)] = &[
        (
            "etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\n\
             nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n\
             user:x:1000:1000::/home/user:/bin/sh\n",
            0o644,
        ),
        (
            "etc/group",
            "root:x:0:\nnogroup:x:65534:\nuser:x:1000:\n",
            0o644,
        ),
        ("etc/hostname", "dsec\n", 0o644),
        ("etc/hosts", "127.0.0.1\tlocalhost\n::1\tlocalhost\n", 0o644),
    ];
    for (name, content, mode) in files {
        let p = root.join(name);
        fs::write(&p, content)?;
        fs::set_permissions(&p, fs::Permissions::from_mode(*mode))?;
    }
    nix::unistd::chown(
        &root.join("home/user"),
        Some(1000.into()),
        Some(1000.into()),
    )?;
    Ok(())
}

/// True if `path` is an ELF executable without a program interpreter (`PT_INTERP`), i.e.
/// statically linked. Only 64-bit little-endian ELF is recognised.
pub fn is_static_elf(path: &Path) -> io::Result<bool> {
    let mut f = fs::File::open(path)?;
    let mut head = vec![0u8; 64];
    f.read_exact(&mut head)?;
    if &head[..4] != b"\x7fELF" || head[4] != 2 || head[5] != 1 {
        return Ok(false);
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let phoff = u64::from_le_bytes(head[32..40].try_into().map_err(io::Error::other)?);
    let phentsize = usize::from(u16_at(&head, 54));
    let phnum = usize::from(u16_at(&head, 56));
    if phentsize < 4 || phnum == 0 || phnum > 4096 {
        return Ok(false);
    }
    use std::io::Seek;
    f.seek(io::SeekFrom::Start(phoff))?;
    let mut table = vec![0u8; phentsize * phnum];
    f.read_exact(&mut table)?;
    const PT_INTERP: u32 = 3;
    let has_interp = table
        .chunks_exact(phentsize)
        .any(|ph| u32::from_le_bytes([ph[0], ph[1], ph[2], ph[3]]) == PT_INTERP);
    Ok(!has_interp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_dynamic_binaries() {
        // Whatever runs the tests is dynamically linked (Rust links libc dynamically).
        let me = std::env::current_exe().unwrap();
        assert!(!is_static_elf(&me).unwrap());
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk");
        fs::write(&junk, vec![0u8; 100]).unwrap();
        assert!(!is_static_elf(&junk).unwrap());
        let err = build_root(&junk, &dir.path().join("root"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("busybox-static"), "{err}");
        let err = build_root(&dir.path().join("missing"), &dir.path().join("root"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("not found") && err.contains("busybox-static"),
            "{err}"
        );
        if Path::new(HOST_BUSYBOX).exists() {
            println!(
                "host busybox static: {:?}",
                is_static_elf(Path::new(HOST_BUSYBOX))
            );
        }
    }
}
